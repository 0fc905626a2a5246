"""``@retry``: call a function again when it raises, waiting longer each time (ART's)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])


def retry(max_attempts: int = 3, delay: float = 0.25, backoff_factor: float = 2.0,
          exceptions: tuple[type[Exception], ...] = (Exception,),
          on_retry: Callable[[Exception, int], None] | None = None) -> Callable[[F], F]:
    """Decorate a sync or async function: on one of ``exceptions`` it is called again, up to
    ``max_attempts`` calls in all, ``delay`` seconds after the first failure and
    ``backoff_factor`` times longer after each next one; the last failure propagates.
    ``on_retry(exc, attempt)`` is told of each retry (by default a warning is logged)."""
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")

    def waits() -> Iterator[float]:
        wait = delay
        while True:
            yield wait
            wait *= backoff_factor

    def report(fn: Callable[..., Any], exc: Exception, attempt: int) -> None:
        if on_retry is not None:
            on_retry(exc, attempt)
        else:
            log.warning("retry %d/%d of %s after %s: %s", attempt, max_attempts,
                        getattr(fn, "__name__", fn), type(exc).__name__, exc)

    def decorate(fn: F) -> F:
        if inspect.iscoroutinefunction(fn):
            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                pause = waits()
                for attempt in range(1, max_attempts + 1):
                    try:
                        return await fn(*args, **kwargs)
                    except exceptions as e:
                        if attempt == max_attempts:
                            raise
                        report(fn, e, attempt)
                        await asyncio.sleep(next(pause))
            return cast(F, run_async)  # functools.wraps: fn's signature, awaited the same

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            pause = waits()
            for attempt in range(1, max_attempts + 1):
                try:
                    return fn(*args, **kwargs)
                except exceptions as e:
                    if attempt == max_attempts:
                        raise
                    report(fn, e, attempt)
                    time.sleep(next(pause))
        return cast(F, run)  # functools.wraps: fn's signature, called the same

    return decorate
