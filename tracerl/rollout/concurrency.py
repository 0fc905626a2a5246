"""``limit_concurrency``: at most N calls of an async function at once (ART's decorator).

Unlike a module-level ``asyncio.Semaphore``, the limit is kept per event loop, so a decorated
function works across several ``asyncio.run`` calls (tests, notebooks, scripts that train in
phases) instead of failing with "bound to a different event loop".
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import weakref
from collections.abc import Awaitable, Callable, Hashable
from typing import ParamSpec, TypeVar

from ..core.validated import check_int

P = ParamSpec("P")
R = TypeVar("R")


def limit_concurrency(n: int, derive_key: Callable[..., Hashable] | None = None
                      ) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """Decorate an async function so at most ``n`` calls run at once; with ``derive_key``
    (called with the function's arguments), the limit applies per key."""
    check_int("limit_concurrency's n", n, 1)

    def decorate(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        if not inspect.iscoroutinefunction(fn):
            raise TypeError(f"limit_concurrency decorates async functions; {fn!r} is not one")
        per_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop,
                                            dict[Hashable, asyncio.Semaphore]] = (
            weakref.WeakKeyDictionary())

        @functools.wraps(fn)
        async def limited(*args: P.args, **kwargs: P.kwargs) -> R:
            key = derive_key(*args, **kwargs) if derive_key is not None else None
            semaphores = per_loop.setdefault(asyncio.get_running_loop(), {})
            semaphore = semaphores.get(key)
            if semaphore is None:
                semaphore = semaphores[key] = asyncio.Semaphore(n)
            async with semaphore:
                return await fn(*args, **kwargs)

        return limited

    return decorate
