"""The lock between a model's calls and its adapter swaps: calls share it; a swap in place waits
for the calls in flight and holds new ones; retiring a version waits only for the calls that use
it.

A call holds its share as an :class:`Admission` (:meth:`SwapLock.admit`), the one way the call
path takes and gives it back: one holder at a time (the call's handler, or the pump of its
stream), released once at the end of the holder's ``with`` block. The admission names the
engine model (adapter version) the call uses (:meth:`Admission.serve`), so that unloading a
version no call is routed to any more (:meth:`SwapLock.retiring`) waits for that version's calls
alone: the other versions' calls go on, admitted, meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Collection

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
        self._using: Counter[str] = Counter()  # engine model name -> calls in flight using it
        self._released = asyncio.Event()  # set whenever a call that named its version ends
        self._retiring: set[str] = set()

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

    def serve(self, name: str) -> None:
        """Count a call admitted with :meth:`acquire_read` as using engine model ``name``
        (:meth:`Admission.serve`)."""
        self._using[name] += 1

    def unserve(self, name: str) -> None:
        """The end of a call counted by :meth:`serve` (a retirement waiting on it looks again)."""
        self._using[name] -= 1
        if self._using[name] <= 0:
            del self._using[name]
        self._released.set()

    def describe(self) -> str:
        """Who holds the lock (the watchdog's view of a waiting swap)."""
        held = "a swap holds new requests; " if not self._open.is_set() else ""
        said = f"{held}{self._readers} requests in flight hold the swap lock"
        if self._retiring:
            waited = sum(self._using[n] for n in self._retiring)
            said += f"; {waited} of them use the retired versions {sorted(self._retiring)}"
        return said

    async def _take_swapper(self, timeout_s: float) -> None:
        """The one adapter change of the model at a time (a swap or a retirement)."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._swapper.acquire()
        except TimeoutError:
            raise EngineTimeoutError(f"waited {timeout_s:g} s for another adapter swap of model "
                                     f"{self.model}") from None

    @contextlib.asynccontextmanager
    async def retiring(self, names: Collection[str], timeout_s: float) -> AsyncIterator[None]:
        """Wait (at most ``timeout_s``) for the calls in flight that use ``names``, versions no
        new call is routed to any more, then unload them. New calls are admitted meanwhile:
        they use other versions."""
        names = set(names)
        await self._take_swapper(timeout_s)
        self._retiring = names
        try:
            try:
                async with asyncio.timeout(timeout_s):
                    while any(self._using[n] for n in names):
                        self._released.clear()
                        await self._released.wait()
            except TimeoutError:
                left = sum(self._using[n] for n in names)
                raise EngineTimeoutError(
                    f"waited {timeout_s:g} s for {left} call(s) in flight on the retired "
                    f"version(s) {sorted(names)} of model {self.model} to finish before "
                    f"unloading them") from None
            yield
        finally:
            self._retiring = set()
            self._swapper.release()

    @contextlib.asynccontextmanager
    async def swapping(self, timeout_s: float) -> AsyncIterator[None]:
        """Hold new requests, wait (at most ``timeout_s``) for those in flight, then swap."""
        await self._take_swapper(timeout_s)
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

    __slots__ = ("_lock", "_name")

    def __init__(self, lock: SwapLock) -> None:
        self._lock: SwapLock | None = lock
        self._name: str | None = None

    def serve(self, name: str) -> None:
        """The engine model (version) this call uses: unloading it waits for the call."""
        if self._lock is not None and self._name is None:
            self._name = name
            self._lock.serve(name)

    @property
    def held(self) -> bool:
        return self._lock is not None

    def release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            if self._name is not None:
                lock.unserve(self._name)
            lock.release_read()

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
