"""Connection bounds that uvicorn lacks: deadlines for each request's head and each stalled write.

uvicorn's keep-alive timer is cancelled by the first byte a client sends and is not armed at all
on a fresh connection, so an idle connection, or one that sends its headers a byte at a time,
holds a slot forever (thousands of them turn every call into 503 at ``limit_concurrency``).
:class:`BoundedH11Protocol` closes a connection whose request head has not arrived whole within
``HEAD_TIMEOUT_S`` of the connection opening or of the previous response ending. Bodies have their
own deadline (:func:`~tracerl.backend.request_body.read_limited_body`); headers are limited in
size by h11 (``h11_max_incomplete_event_size``).

A response that a client stops reading fills the socket's buffers, and uvicorn then waits for
them to drain, for ever: a client that never reads a large answer (a long stream, a history)
held its handler and its slot. When the buffers have stayed full for ``WRITE_TIMEOUT_S`` with no
byte taken, the connection is aborted, like nginx's ``send_timeout``. It is a deadline on
progress, not on the whole answer: a slow reader that keeps taking bytes is never cut.

A connection cut at that deadline is closed gracefully: a FIN is sent at once, what the client
still sends is read and dropped, and the socket goes when the client closes its side or
``LINGER_S`` later. Closing a socket outright while the client is mid-write makes the kernel send
a reset, which can destroy a response the client has not read yet (a 408 to a trickled body).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from ..core import settings

HEAD_TIMEOUT_S = settings.TRACERL_HEAD_TIMEOUT_S.default
WRITE_TIMEOUT_S = settings.TRACERL_WRITE_TIMEOUT_S.default
LINGER_S = 2.0

log = logging.getLogger(__name__)


def head_timeout_s() -> float:
    """Seconds a request head may take (``TRACERL_HEAD_TIMEOUT_S``, default 10)."""
    return settings.TRACERL_HEAD_TIMEOUT_S.get()


def write_timeout_s() -> float:
    """Seconds a response write may stay stalled (``TRACERL_WRITE_TIMEOUT_S``, default 60)."""
    return settings.TRACERL_WRITE_TIMEOUT_S.get()


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head and on each stalled write."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout_s = head_timeout_s()
        self.write_timeout_s = write_timeout_s()
        self._deadlines: dict[str, asyncio.TimerHandle] = {}  # "head", "write", "linger"

    def _arm(self, deadline: str, seconds: float, expired: Callable[[], object]) -> None:
        self._disarm(deadline)
        self._deadlines[deadline] = self.loop.call_later(seconds, expired)

    def _disarm(self, deadline: str) -> None:
        if (timer := self._deadlines.pop(deadline, None)) is not None:
            timer.cancel()

    def _head_timed_out(self) -> None:
        self._deadlines.pop("head", None)
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:  # still waiting for a head
            self._close_gracefully()

    def pause_writing(self) -> None:
        """The socket's buffers are full: the client has that long to take a byte."""
        super().pause_writing()
        self._arm("write", self.write_timeout_s, self._write_timed_out)

    def resume_writing(self) -> None:
        self._disarm("write")
        super().resume_writing()

    def _write_timed_out(self) -> None:
        self._deadlines.pop("write", None)
        log.warning("dropped a connection from %s: it took no byte of its response for %.0f s",
                    self.client, self.write_timeout_s)
        self.transport.abort()  # no FIN to wait for: its buffers are full and it does not read

    def _close_gracefully(self) -> None:
        """FIN now; the socket itself once the client closes its side or ``LINGER_S`` passes."""
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.transport.resume_reading()  # keep draining, so no unread byte turns close into a reset
        # abort, not close: close waits for unsent bytes, which a client that never reads holds up
        self._arm("linger", LINGER_S, self.transport.abort)

    @property
    def _lingering(self) -> bool:
        return "linger" in self._deadlines

    def data_received(self, data: bytes) -> None:
        if not self._lingering:  # while lingering, what arrives is dropped unread
            super().data_received(data)

    def eof_received(self) -> None:
        if self._lingering:  # the client has closed its side: returning None closes the socket
            return
        super().eof_received()

    def connection_made(  # type: ignore[override]  # uvicorn's H11Protocol narrows it too
        self, transport: asyncio.Transport
    ) -> None:
        super().connection_made(transport)
        self._arm("head", self.head_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        for deadline in list(self._deadlines):
            self._disarm(deadline)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request head arrived whole
            self._disarm("head")

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None
                                                or self.cycle.response_complete):
            self._arm("head", self.head_timeout_s, self._head_timed_out)


def uvicorn_options() -> dict[str, Any]:
    """The bounds every tracerl server runs uvicorn with."""
    return {"http": BoundedH11Protocol, "timeout_keep_alive": 30, "limit_concurrency": 4096,
            "h11_max_incomplete_event_size": 64 * 1024}
