"""A streamed call: SSE events forwarded as the engine's chunks come, while a task of the
gateway's own assembles and records the call.

The task (:func:`_pump`), not the response's generator, holds the call's admission to its model
(:class:`~.swap_lock.Admission`) until the engine's stream ends and releases it: a client that
hangs up at any point, or a response that is never iterated, cannot leave the swap lock held.
A hang-up cancels the task, which closes the engine's stream (vLLM aborts the request) and
records what was generated, marked ``disconnected``. The record is on disk before the final
event (``[DONE]``, ``response.completed``, ``message_stop``) is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from ...core.engine import EngineError, EngineUnavailableError
from ...core.errors import TracerlError
from ..protocols.replies import StreamAssembler
from .http_answers import error_response
from .recorder import CallRecording
from .served import ServedModel
from .supervisor import EngineSupervisor
from .swap_lock import Admission

log = logging.getLogger(__name__)

STREAM_CLOSE_TIMEOUT_S = 5.0


async def stream_answer(served: ServedModel, rec: CallRecording, admission: Admission,
                        supervisor: EngineSupervisor, pumps: set[asyncio.Task[None]]
                        ) -> StreamingResponse | JSONResponse:
    """The answer to a streamed call admitted to ``served`` (its ``admission`` passes to the
    pump at once, with no ``await`` in between): an SSE stream, or the error answer when the
    engine fails before its first chunk. ``pumps`` keeps the tasks in flight referenced."""
    loop = asyncio.get_running_loop()
    out: asyncio.Queue[bytes | None] = asyncio.Queue()
    first: asyncio.Future[EngineError | None] = loop.create_future()
    pump = asyncio.create_task(_pump(served, rec, admission, supervisor,
                                     loop.time() + served.timeout_s, out, first))
    pumps.add(pump)
    pump.add_done_callback(pumps.discard)
    try:  # the first chunk is awaited here so that engine errors become proper statuses
        failed = await asyncio.shield(first)
    except asyncio.CancelledError:
        pump.cancel()
        raise
    if failed is not None:
        return error_response(failed)

    async def events() -> AsyncIterator[bytes]:
        ended = False
        try:
            while (data := await out.get()) is not None:
                yield data
            ended = True
        finally:  # if this never runs, the pump still ends by its deadline
            if not ended:
                pump.cancel()

    return StreamingResponse(events(), media_type="text/event-stream")


async def _pump(served: ServedModel, rec: CallRecording, admission: Admission,
                supervisor: EngineSupervisor, deadline: float, out: asyncio.Queue[bytes | None],
                first: asyncio.Future[EngineError | None]) -> None:
    exchange = rec.exchange
    assembler = StreamAssembler(keep_entries=exchange.keeps_logprob_entries)
    stream: AsyncIterator[dict[str, Any]] | None = None
    error: str | None = None
    sent = 0
    disconnected = False
    final: list[bytes] = []  # sent once the record is on disk
    with admission:  # released (synchronously) once the engine's stream has ended
        try:
            try:  # an engine may refuse in chat_stream itself (a plain def) or at its first chunk
                stream = served.engine.chat_stream(rec.engine_body)
                async with asyncio.timeout_at(deadline):
                    chunk = await anext(stream, None)
            except (EngineError, TimeoutError) as e:  # before generating: nothing to record
                first.set_result(supervisor.failure(e, served.engine, served.timeout_s,
                                                    starting_stream=True))
                return
            first.set_result(None)
            async with asyncio.timeout_at(deadline):
                while chunk is not None:
                    assembler.add(chunk)
                    chunk["model"] = exchange.chat_body["model"]
                    for event in exchange.stream_events(chunk):
                        out.put_nowait(event)
                    sent += 1
                    chunk = await anext(stream, None)
            final = exchange.final_events()
        except asyncio.CancelledError:  # the client hung up (or the server is stopping)
            if (task := asyncio.current_task()) is not None:
                task.uncancel()  # record it anyway
            disconnected = True
            error = f"client disconnected after {sent} chunk(s)"
        except (EngineError, TimeoutError) as e:
            reason = (f"the engine did not finish within {served.timeout_s} s"
                      if isinstance(e, TimeoutError) else str(e) or type(e).__name__)
            error = f"stream broke off: {reason}"
            supervisor.schedule_restart(served.engine)
            final = [exchange.error_event(error)]
        finally:
            if not first.done():
                first.set_result(EngineUnavailableError("the stream was cancelled"))
    try:
        with contextlib.suppress(Exception):  # closing vLLM's stream aborts its request
            async with asyncio.timeout(STREAM_CLOSE_TIMEOUT_S):
                await stream.aclose()  # type: ignore[union-attr]  # engines return generators
        await rec.finish(assembler.response(), streamed=True, error=error,
                         disconnected=disconnected)
        exchange.recorded()
    except TracerlError as e:  # e.g. a full disk: the client hears it instead of the end
        final = [exchange.error_event(f"the call was not recorded: {e}", e.code)]
        log.error("streamed call not recorded: %s", e)
    finally:
        for event in final:
            out.put_nowait(event)
        out.put_nowait(None)
