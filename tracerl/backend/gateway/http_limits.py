"""Connection bounds that uvicorn lacks: deadlines for each request's head and each stalled write.

uvicorn's keep-alive timer is cancelled by the first byte a client sends and is not armed at all
on a fresh connection, so an idle connection, or one that sends its headers a byte at a time,
holds a slot forever (thousands of them turn every call into 503 at ``limit_concurrency``).
:class:`BoundedH11Protocol` closes a connection whose request head has not arrived whole within
``HEAD_TIMEOUT_S`` of the connection opening or of the previous response ending. A connection whose
latest request presented the key, and ended cleanly (its body read whole, no byte past it), may
stay idle between requests for ``TRACERL_IDLE_TIMEOUT_S`` (60 s), longer
than clients keep idle connections (httpx 5 s, aiohttp 15 s): at 10 s, a client under load sent
its next request on a connection the server was closing and got "Server disconnected without
sending a response"; its next head then has ``HEAD_TIMEOUT_S`` from its first byte. Bodies have
their own deadline (:func:`~tracerl.backend.gateway.request_body.read_limited_body`); headers
are limited in size by h11 (``h11_max_incomplete_event_size``).

A response that a client stops reading fills the socket's buffers, and uvicorn then waits for
them to drain, for ever: a client that never reads a large answer (a long stream, a history)
held its handler and its slot. When the buffers have stayed full for ``WRITE_TIMEOUT_S`` with no
byte taken, the connection is aborted, like nginx's ``send_timeout``. It is a deadline on
progress, not on the whole answer: a slow reader that keeps taking bytes is never cut.

A connection cut at that deadline is closed gracefully: a FIN is sent at once, what the client
still sends is read and dropped, and the socket goes when the client closes its side or
``LINGER_S`` later. Closing a socket outright while the client is mid-write makes the kernel send
a reset, which can destroy a response the client has not read yet (a 408 to a trickled body).

Connections that hold no key cannot crowd out those that do. uvicorn's ``limit_concurrency``
answered 503 to every request once that many connections were open, so a flood of half-sent
requests from one keyless client locked out every caller and ``/health``. Here a connection is
*unkeyed* until a request head carrying the server's key arrives on it (any head, on a server
without a key); :class:`Admission` caps the unkeyed connections of each client address and of
all clients: past a cap, the oldest unkeyed connection that has had ``STALE_S`` to send its head
is aborted, and when none has, the new connection is. A keyed connection never counts, and only
running requests count against ``limit_concurrency`` (keyless ones against half of it).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from typing import Any

import h11
from uvicorn._types import ASGIReceiveCallable, ASGISendCallable, Scope
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.h11_impl import H11Protocol

from ...core import settings

HEAD_TIMEOUT_S = settings.TRACERL_HEAD_TIMEOUT_S.default
WRITE_TIMEOUT_S = settings.TRACERL_WRITE_TIMEOUT_S.default
LINGER_S = 2.0
STALE_S = 1.0  # an unkeyed connection this old may be closed to admit a new one
LIMIT_CONCURRENCY = 4096  # running requests (keyless ones: half of it) before a 503

log = logging.getLogger(__name__)


def head_timeout_s() -> float:
    """Seconds a request head may take (``TRACERL_HEAD_TIMEOUT_S``, default 10)."""
    return settings.TRACERL_HEAD_TIMEOUT_S.get()


def idle_timeout_s() -> float:
    """Seconds a keyed connection may stay idle between requests (``TRACERL_IDLE_TIMEOUT_S``,
    default 60)."""
    return settings.TRACERL_IDLE_TIMEOUT_S.get()


def write_timeout_s() -> float:
    """Seconds a response write may stay stalled (``TRACERL_WRITE_TIMEOUT_S``, default 60)."""
    return settings.TRACERL_WRITE_TIMEOUT_S.get()


class Admission:
    """One server's unkeyed connections, oldest first, overall and by client address."""

    def __init__(self, per_client: int, total: int) -> None:
        self.per_client, self.total = per_client, total
        self.unkeyed: dict[BoundedH11Protocol, float] = {}  # -> when it opened (monotonic)
        self.by_client: dict[str, dict[BoundedH11Protocol, float]] = {}
        self.refused = 0

    def admit(self, conn: BoundedH11Protocol, client: str) -> bool:
        """Count ``conn`` as unkeyed, closing an older unkeyed one where a cap is reached;
        False: no room (every unkeyed connection is younger than ``STALE_S``)."""
        now = time.monotonic()
        mine = self.by_client.setdefault(client, {})
        if (len(mine) >= self.per_client and not self._evict_stale(mine, now)) or (
                len(self.unkeyed) >= self.total and not self._evict_stale(self.unkeyed, now)):
            if not mine:
                del self.by_client[client]
            self.refused += 1
            if self.refused & (self.refused - 1) == 0:  # the 1st, 2nd, 4th, 8th... refusal
                log.warning("refused a connection from %s: %d of its connections and %d in all "
                            "hold no key yet (caps %d and %d; %d refused so far)", client,
                            len(mine), len(self.unkeyed), self.per_client, self.total,
                            self.refused)
            return False
        mine[conn] = self.unkeyed[conn] = now
        return True

    def _evict_stale(self, conns: dict[BoundedH11Protocol, float], now: float) -> bool:
        oldest, since = next(iter(conns.items()))
        if now - since < STALE_S:
            return False
        self.release(oldest)
        oldest.transport.abort()  # no answer is owed to a connection that sent no whole head
        return True

    def release(self, conn: BoundedH11Protocol) -> None:
        """``conn`` presented the key or closed: it no longer counts."""
        if self.unkeyed.pop(conn, None) is None:
            return
        mine = self.by_client[conn.client_address]
        del mine[conn]
        if not mine:
            del self.by_client[conn.client_address]


def _admission(server_state: Any) -> Admission:
    """The server's :class:`Admission`, kept on uvicorn's per-server state."""
    admission: Admission | None = getattr(server_state, "tracerl_admission", None)
    if admission is None:
        admission = Admission(settings.TRACERL_MAX_UNKEYED_PER_CLIENT.get(),
                              settings.TRACERL_MAX_UNKEYED.get())
        server_state.tracerl_admission = admission
    return admission


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head and on each stalled write,
    and room kept for connections that present the key (``api_key``; None: any request head)."""

    api_key: bytes | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.head_timeout_s = head_timeout_s()
        self.idle_timeout_s = max(idle_timeout_s(), self.head_timeout_s)
        self._idle = False  # between requests on a keyed connection: no byte of a head yet
        self.write_timeout_s = write_timeout_s()
        self._deadlines: dict[str, asyncio.TimerHandle] = {}  # "head", "write", "linger"
        self.admission = _admission(self.server_state)
        self.task_limit = self.limit_concurrency
        self.limit_concurrency = None  # uvicorn's check counts idle connections too: ours runs
        self.keyed = False
        self.last_keyed = False  # the latest request presented the key
        self.client_address = ""
        self.inner_app = self.app
        self.app = self._admit_request

    def _presents_key(self, headers: list[tuple[bytes, bytes]]) -> bool:
        if self.api_key is None:
            return True
        for name, value in headers:
            if name == b"authorization":
                token = value[7:] if value[:7].lower() == b"bearer " else b""
                return hmac.compare_digest(token, self.api_key)
        return False

    async def _admit_request(self, scope: Scope, receive: ASGIReceiveCallable,
                             send: ASGISendCallable) -> None:
        """The app behind the admission: a keyed request marks its connection keyed; a 503
        when running requests reach the limit (keyless ones: half of it)."""
        self.last_keyed = self._presents_key(scope.get("headers", []))  # type: ignore[arg-type]
        keyed = self.keyed or self.last_keyed
        if keyed and not self.keyed:
            self.keyed = True
            self.admission.release(self)
        limit = self.task_limit
        if limit is not None and len(self.tasks) > (limit if keyed else limit // 2):
            log.warning("answered 503: %d requests running (limit %d, keyless ones %d)",
                        len(self.tasks), limit, limit // 2)
            await service_unavailable(scope, receive, send)
            return
        await self.inner_app(scope, receive, send)

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
        if self._idle:  # the first byte of the next head: it has the head deadline from now
            self._idle = False
            self._arm("head", self.head_timeout_s, self._head_timed_out)
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
        self.client_address = self.client[0] if self.client else ""
        if not self.admission.admit(self, self.client_address):
            transport.abort()
            return
        self._arm("head", self.head_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        for deadline in list(self._deadlines):
            self._disarm(deadline)
        self.admission.release(self)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before:  # a request head arrived whole
            self._idle = False
            self._disarm("head")

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and (self.cycle is None
                                                or self.cycle.response_complete):
            self._idle = self.last_keyed and self._clean_between_requests()
            self._arm("head", self.idle_timeout_s if self._idle else self.head_timeout_s,
                      self._head_timed_out)

    def _clean_between_requests(self) -> bool:
        """Both sides ended their messages and no byte of the next head is buffered: a body
        left unread (a 408), bytes past a short ``Content-Length`` or a keyless request after
        the keyed one keep the head deadline, which ends the connection."""
        their, ours = self.conn.their_state, self.conn.our_state
        return their is h11.IDLE and ours is h11.IDLE and not self.conn.trailing_data[0]


def uvicorn_options(api_key: str | None = None) -> dict[str, Any]:
    """The bounds every tracerl server runs uvicorn with; ``api_key``: the key its app requires
    (connections presenting it are never crowded out by those that do not)."""
    protocol = type("KeyedH11Protocol", (BoundedH11Protocol,),
                    {"api_key": api_key.encode() if api_key is not None else None})
    # uvicorn's own keep-alive close (abrupt) comes after ours (a FIN, then a linger)
    keep_alive = max(idle_timeout_s(), head_timeout_s()) + 5
    return {"http": protocol, "timeout_keep_alive": keep_alive,
            "limit_concurrency": LIMIT_CONCURRENCY,
            "h11_max_incomplete_event_size": 64 * 1024}
