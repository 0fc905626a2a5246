"""Values that belong to one event loop, such as HTTP clients, which cannot outlive their loop."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class PerLoop(Generic[T]):
    """One value per (running event loop, key), made on first use.

    A loop's id can be reused by a later loop once the first is gone; the entry remembers its
    loop weakly, so a later loop never gets an earlier loop's value. ``usable`` can refuse a
    cached value (a client that was closed), which is then made again.
    """

    def __init__(self, usable: Callable[[T], bool] = lambda value: True) -> None:
        self._usable = usable
        self._entries: dict[tuple[int, Hashable],
                            tuple[weakref.ref[asyncio.AbstractEventLoop], T]] = {}

    def get(self, make: Callable[[asyncio.AbstractEventLoop], T], key: Hashable = None) -> T:
        """The running loop's value for ``key``; ``make(loop)`` makes a missing one."""
        loop = asyncio.get_running_loop()
        entry = self._entries.get((id(loop), key))
        if entry is None or entry[0]() is not loop or not self._usable(entry[1]):
            entry = self._entries[id(loop), key] = (weakref.ref(loop), make(loop))
        return entry[1]

    def pop_all(self) -> list[T]:
        """Every value, forgotten here (to close them)."""
        values = [value for _, value in self._entries.values()]
        self._entries.clear()
        return values
