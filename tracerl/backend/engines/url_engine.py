"""An existing vLLM (or vLLM-compatible) OpenAI server, reached by URL: one replica of a
replica set that tracerl did not start (another node, a Kubernetes pod, a SLURM job).

It speaks exactly what :class:`~.vllm_engine.VLLMEngine` speaks over HTTP; only the process is
someone else's, so "restart" means reconnecting and waiting until the server answers again.
The server must run with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and ``--enable-lora``.
"""

from __future__ import annotations

import asyncio

from ...core.engine import EngineSpec
from ...core.errors import EngineError
from .vllm_engine import VLLMEngine, startup_timeout_s


class URLEngine(VLLMEngine):
    """A vLLM server at ``url``, driven over HTTP, never started or stopped by tracerl."""

    name = "vllm-url"

    def __init__(self, spec: EngineSpec, url: str) -> None:
        super().__init__(spec)
        self.url = url.rstrip("/").removesuffix("/v1")
        self.sleeps = False  # another process's memory is not ours to release

    @classmethod
    def available(cls) -> bool:
        return True

    @property
    def base_url(self) -> str:
        return self.url

    async def start(self) -> None:
        self._ready = False
        if self.client is None:
            self.connect()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + startup_timeout_s()
        if self._turn_end is None:
            await asyncio.to_thread(self.find_turn_end)
        while not await self.healthy():
            if loop.time() > deadline:
                raise EngineError(f"the server at {self.url} did not answer /health within "
                                  f"{startup_timeout_s():.0f} s")
            await asyncio.sleep(0.5)
        await self._serve_known_adapters()

    async def stop(self) -> None:
        self._ready = False
        if self.client is not None:
            await self.client.close()
            self.client = None

    def alive(self) -> bool:
        return self.client is not None

    def log_tail(self, n: int = 40) -> str:
        return f"(the server at {self.url} keeps its own log)"
