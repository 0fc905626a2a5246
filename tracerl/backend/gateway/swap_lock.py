"""The lock between a model's calls and its adapter swaps: calls share it; a swap waits for the
calls in flight and holds new ones.

A call holds its share as an :class:`Admission` (:meth:`SwapLock.admit`), the one way the call
path takes and gives it back: one holder at a time (the call's handler, or the pump of its
stream), released once at the end of the holder's ``with`` block.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from ...core.engine import EngineTimeoutError


class SwapLock:
    """Requests share it; an adapter swap waits for requests in flight and holds new ones.

    Releasing a read is synchronous (no ``await``), so a cancelled request or a closed stream
    cannot leave its reader counted; every wait has a deadline and says what it waited for.
    """

    def __init__(self, model: str = "") -> None:
        self.model = model
        self._readers = 0
        self._idle = asyncio.Event()  # set while no request is in flight
        self._idle.set()
        self._open = asyncio.Event()  # set while no swap is running or waiting
        self._open.set()
        self._swapper = asyncio.Lock()

    @property
    def readers(self) -> int:
        return self._readers

    async def admit(self, timeout_s: float) -> Admission:
        """A call's share of the lock, once no swap runs or waits (at most ``timeout_s``:
        :class:`~tracerl.core.engine.EngineTimeoutError` after that)."""
        await self.acquire_read(timeout_s)
        return Admission(self)

    async def acquire_read(self, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while not self._open.is_set():
                    await self._open.wait()
        except TimeoutError:
            raise EngineTimeoutError(
                f"waited {timeout_s:g} s for the adapter swap of model {self.model} to finish"
            ) from None
        self._readers += 1
        self._idle.clear()

    def release_read(self) -> None:
        """Give back a share taken with :meth:`acquire_read` (the call path: through its
        :class:`Admission`)."""
        self._readers -= 1
        if self._readers <= 0:
            self._readers = 0
            self._idle.set()

    def describe(self) -> str:
        """Who holds the lock (the watchdog's view of a waiting swap)."""
        held = "a swap holds new requests; " if not self._open.is_set() else ""
        return f"{held}{self._readers} requests in flight hold the swap lock"

    @contextlib.asynccontextmanager
    async def swapping(self, timeout_s: float) -> AsyncIterator[None]:
        """Hold new requests, wait (at most ``timeout_s``) for those in flight, then swap."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._swapper.acquire()
        except TimeoutError:
            raise EngineTimeoutError(f"waited {timeout_s:g} s for another adapter swap of model "
                                     f"{self.model}") from None
        try:
            self._open.clear()
            try:
                async with asyncio.timeout(timeout_s):
                    await self._idle.wait()
            except TimeoutError:
                raise EngineTimeoutError(
                    f"waited {timeout_s:g} s for {self._readers} call(s) in flight on model "
                    f"{self.model} to finish before swapping its adapter") from None
            yield
        finally:
            self._open.set()
            self._swapper.release()


class Admission:
    """One call's share of its model's :class:`SwapLock`, released once: by :meth:`release`
    (again: nothing happens) or at the end of a ``with`` block. Releasing is synchronous, so a
    cancelled holder cannot leave the share taken."""

    __slots__ = ("_lock",)

    def __init__(self, lock: SwapLock) -> None:
        self._lock: SwapLock | None = lock

    @property
    def held(self) -> bool:
        return self._lock is not None

    def release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release_read()

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
