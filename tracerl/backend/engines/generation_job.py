"""One request to the transformers engine's batchers: its prompt, sampling settings and adapter,
the future its answer resolves, and an optional sink its tokens stream to as they are sampled."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .adapter_switch import AdapterSwitch

# what a request gets back: per sequence (token ids, their logprobs, finish reason)
Results = list[tuple[list[int], list[float], str]]
# (sequence index, token id, its logprob, finish reason once the sequence ended)
TokenSink = Callable[[int, int, float, "str | None"], None]


@dataclass
class GenerationJob:
    prompt_ids: list[int]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    adapter: str | None
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    digest: str | None = None  # of the weights that generated it (set under the model lock)
    on_token: TokenSink | None = None  # called on ``loop`` for each sampled token
    submitted: float = field(default_factory=time.monotonic)
    first_token: float | None = None  # when its first token was sampled (monotonic)
    refused: Exception | None = None  # set once queued: it leaves, its future gets this error

    @property
    def key(self) -> tuple:
        """Jobs of one key may sample in one batch (whichever adapters they use)."""
        return (self.temperature, self.top_p)

    @property
    def cancelled(self) -> bool:
        """Its caller no longer waits (past its deadline, hung up), or it was refused after it
        was queued (its adapter unloaded)."""
        return self.future.done() or self.refused is not None


def resolve(future: asyncio.Future, results: Results) -> None:
    if not future.done():
        future.set_result(results)


@dataclass
class ModelAccess:
    """What a batcher needs of the engine: the model (replaced when the first adapter loads), the
    lock held while it runs, the digest of the weights serving an adapter (None: the base), the
    end-of-sequence ids, the padding id and the switch that sets the model's adapter for a
    forward."""

    lock: threading.Lock
    model: Callable[[], Any]
    digest: Callable[[str | None], str | None]
    eos: set[int]
    pad: int
    adapters: AdapterSwitch
