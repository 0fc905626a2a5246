"""The gateway's HTTP server (uvicorn) on an event loop of its own, in a daemon thread, so
rollouts on the caller's loop and engine work never block each other."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Coroutine
from typing import Any, Protocol, TypeVar

from ...core.engine import EngineError

T = TypeVar("T")


class OnGateway(Protocol):
    """Runs a coroutine on the gateway's loop (where engines and routes live) and awaits it
    (:meth:`GatewayThread.call`, ``LocalBackend.call_on_gateway``)."""

    def __call__(self, coro: Coroutine[Any, Any, T], /) -> Awaitable[T]: ...


class GatewayThread:
    """uvicorn serving the gateway app on its own loop in a daemon thread."""

    def __init__(self, app: Any, host: str, port: int, api_key: str | None = None) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        from .http_limits import uvicorn_options

        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                **uvicorn_options(api_key))
        self.server = uvicorn.Server(config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="tracerl-gateway", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise EngineError(f"the gateway did not start on {host}:{port}")
            time.sleep(0.01)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the gateway loop and await its result from any loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
