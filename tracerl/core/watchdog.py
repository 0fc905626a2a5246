"""The watchdog: a wait that lasts longer than its threshold says what it is waiting on.

Code that may wait (a gather, a training step, an adapter swap, an engine start) wraps the wait
in :func:`watch` with a ``describe`` callable; once the wait passes its kind's threshold a
daemon thread logs ``waiting N s on WHAT: DESCRIPTION`` on the ``tracerl.watchdog`` logger,
and again every ``interval_s`` until the wait ends. ``describe`` runs on the watchdog thread, so
it must only read state (counts, dicts), never await or take a lock that the wait holds.

Thresholds (seconds) per kind: :data:`THRESHOLDS`, overridden by :func:`configure` or the
environment (one variable per kind, ``TRACERL_WATCHDOG_GATHER_S=30``, and
``TRACERL_WATCHDOG_INTERVAL_S``: :mod:`tracerl.core.settings` declares them).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from . import settings

log = logging.getLogger("tracerl.watchdog")

# kind -> seconds: a gather with rollouts still running (each listed, with its last call), a
# training step's update, an adapter swap waiting for requests in flight, an engine that has not
# answered since it was started
THRESHOLDS: dict[str, float] = {
    kind: setting.default for kind, setting in settings.WATCHDOG_THRESHOLDS.items()}
INTERVAL_S = settings.TRACERL_WATCHDOG_INTERVAL_S.default


def threshold(kind: str) -> float:
    """The threshold of ``kind`` in seconds (its variable first, then :data:`THRESHOLDS`)."""
    fallback = THRESHOLDS.get(kind, 120.0)
    setting = settings.WATCHDOG_THRESHOLDS.get(kind)
    return fallback if setting is None else setting.get(fallback)


def interval() -> float:
    return settings.TRACERL_WATCHDOG_INTERVAL_S.get(INTERVAL_S)


def configure(interval_s: float | None = None, **thresholds: float) -> None:
    """Set the repeat interval and per-kind thresholds, e.g. ``configure(gather=30, swap=5)``."""
    global INTERVAL_S
    if interval_s is not None:
        INTERVAL_S = float(interval_s)
    THRESHOLDS.update({k: float(v) for k, v in thresholds.items()})


@dataclass
class Wait:
    """One watched wait."""

    kind: str
    what: str
    describe: Callable[[], str] | None
    started: float = field(default_factory=time.monotonic)
    next_report: float = 0.0

    def report(self, now: float) -> str:
        detail = ""
        if self.describe is not None:
            try:
                detail = self.describe()
            except Exception as e:  # a description must never break the wait it describes
                detail = f"(no description: {type(e).__name__}: {e})"
        return f"waiting {now - self.started:.0f} s on {self.what}" + (
            f": {detail}" if detail else "")


class Watchdog:
    """The process's watched waits and the thread that reports the long ones."""

    def __init__(self) -> None:
        self._waits: dict[int, Wait] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, wait: Wait) -> int:
        wait.next_report = wait.started + threshold(wait.kind)
        with self._lock:
            key = next(self._ids)
            self._waits[key] = wait
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="tracerl-watchdog",
                                                daemon=True)
                self._thread.start()
        self._wake.set()
        return key

    def remove(self, key: int) -> None:
        with self._lock:
            self._waits.pop(key, None)

    def pending(self) -> list[Wait]:
        with self._lock:
            return list(self._waits.values())

    def _run(self) -> None:
        while True:
            now = time.monotonic()
            for wait in self.pending():
                if now >= wait.next_report:
                    log.warning("%s", wait.report(now))
                    wait.next_report = now + interval()
            waits = self.pending()
            if not waits:
                with self._lock:
                    if not self._waits:
                        self._thread = None
                        return
                continue
            due = min(w.next_report for w in waits) - time.monotonic()
            self._wake.wait(max(0.01, min(due, 1.0)))
            self._wake.clear()


WATCHDOG = Watchdog()


@contextmanager
def watch(kind: str, what: str, describe: Callable[[], str] | None = None) -> Iterator[Wait]:
    """Watch the block as a wait of ``kind`` on ``what`` (works around awaits and blocking
    calls alike: the watchdog runs on a thread of its own)."""
    wait = Wait(kind, what, describe)
    key = WATCHDOG.add(wait)
    try:
        yield wait
    finally:
        WATCHDOG.remove(key)
