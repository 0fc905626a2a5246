"""The engine contract: what the gateway needs from an inference engine, and its errors.

Engines speak OpenAI-shaped JSON with vLLM's extras, whatever they run on: a chat response has
``prompt_token_ids`` at the top level and ``token_ids`` plus ``logprobs`` on every choice. That
is what makes records of every engine the same shape.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import EngineConfig, LoraConfig
from .errors import EngineError, EngineRequestError, EngineTimeoutError, EngineUnavailableError
from .pluggable import Pluggable

__all__ = ["PROMPT_IDS", "CallRoute", "Engine", "EngineError", "EngineRequestError",
           "EngineSpec", "EngineTimeoutError", "EngineUnavailableError", "current_route"]

# A chat request may carry its prompt's token ids under this key (the gateway's exact turns):
# the engine then generates from them instead of rendering the messages.
PROMPT_IDS = "tracerl_prompt_token_ids"


@dataclass
class CallRoute:
    """Where one gateway call went: the gateway sets ``rollout_id`` (routing engines keep a
    rollout on one server), a routing engine fills in ``replica``, the engine that served the
    call ``adapter_digest`` (the weights that answered it, :mod:`tracerl.core.fingerprint`);
    the gateway records them."""

    rollout_id: str | None = None
    replica: str | None = None
    adapter_digest: str | None = None


current_route: ContextVar[CallRoute | None] = ContextVar("tracerl_call_route", default=None)


@dataclass(frozen=True)
class EngineSpec:
    """What to serve: a base model folder and the LoRA shape trained on it."""

    model_path: Path
    served_name: str
    config: EngineConfig
    lora: LoraConfig


class Engine(Pluggable):
    """An inference engine serving one base model and its LoRA adapters (``available()``:
    whether its packages are importable here)."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec

    @abstractmethod
    async def start(self) -> None:
        """Load the model; return when requests can be served."""

    @abstractmethod
    async def stop(self) -> None:
        """Release the model and any process."""

    @abstractmethod
    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """A non-streaming chat completion (``body['model']`` is an engine model name)."""

    @abstractmethod
    def chat_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Chat completion chunks, as dicts (the SSE ``data:`` payloads)."""

    @abstractmethod
    async def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        """A non-streaming text completion; ``prompt`` may be a string or token ids."""

    @abstractmethod
    async def load_adapter(self, lora_name: str, path: Path) -> None:
        """Serve the LoRA adapter at ``path`` as ``lora_name``, replacing one of that name."""

    async def unload_adapter(self, lora_name: str) -> None:
        """Stop serving ``lora_name`` and free its memory (engines that cannot, keep it)."""

    @abstractmethod
    async def healthy(self) -> bool:
        """Whether the engine answers now (a busy engine may not, for a while)."""

    def alive(self) -> bool:
        """Whether the engine still exists at all (False: restart at once)."""
        return True

    async def restart(self) -> None:
        """Stop and start again, re-loading adapters (default: stop, then start)."""
        await self.stop()
        await self.start()

    async def sleep(self) -> None:
        """Release accelerator memory until :meth:`wake_up` (engines that can)."""

    async def wake_up(self) -> None:
        """Undo :meth:`sleep`."""

    def prompt_ids_refusal(self, body: dict[str, Any]) -> str | None:
        """Why this engine cannot answer the chat request ``body`` from given prompt token ids
        (``body[PROMPT_IDS]``); None when it can."""
        return f"the {self.name} engine renders its own chat prompts"
