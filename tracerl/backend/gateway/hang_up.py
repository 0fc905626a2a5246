"""A non-streamed call stops in the engine when its client hangs up.

uvicorn runs a handler to its end after the client's connection is gone, so an engine call whose
caller left (a rollout cancelled, an async trainer that stopped) would go on generating for
nobody and hold its rows. While the engine answers, a task listens on the request's ``receive``
for ``http.disconnect``; on it the engine call is cancelled, as at its deadline: the
transformers engine drops the request's rows at its next step, vLLM's HTTP request is closed,
which aborts it. Nothing is recorded (no answer came). Streamed calls need none of this:
Starlette ends their response when the client leaves, which cancels the pump
(:mod:`.stream_pump`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientHungUp(Exception):
    """The client left before the engine answered (nobody reads the answer)."""


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass  # the body was read whole before the engine call: nothing else is expected


async def _settle(task: asyncio.Future[T]) -> None:
    """Wait for a cancelled engine call to unwind (vLLM: its request closed)."""
    await asyncio.gather(task, return_exceptions=True)


async def unless_hung_up(receive: Receive, call: Awaitable[T]) -> T:
    """``call``'s answer; if the client hangs up first, ``call`` is cancelled and
    :class:`ClientHungUp` raised. Cancelled itself (the call's deadline), it cancels ``call``."""
    work = asyncio.ensure_future(call)
    hang_up = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((work, hang_up), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        hang_up.cancel()
        work.cancel()
        await _settle(work)
        raise
    hang_up.cancel()
    if work.done():  # answered (perhaps as the client left: the answer wins)
        return work.result()
    if hang_up.exception() is not None:  # a server whose receive failed: nothing to listen to
        return await work
    work.cancel()
    await _settle(work)
    raise ClientHungUp("the client hung up before the engine answered")
