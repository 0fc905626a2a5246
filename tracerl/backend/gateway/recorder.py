"""Turning engine responses into token-exact :class:`LLMCall` records, and keeping them.

The gateway records each call through one :class:`CallRecording`: ``rec =
recorder.begin(...)`` before the engine call (it makes the engine request: the caller's plus
logprobs and token ids), then ``await rec.finish(reply)`` (a stream's reply assembled by
:class:`~.replies.StreamAssembler`), which builds the record, writes it and fires
``tracerl_on_llm_call``.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...core.engine import CallRoute
from ...core.storage import ModelStore, append_jsonl, read_jsonl
from ...core.trajectory import CompletionRecord, LLMCall
from ...events.lifecycle import llm_call_recorded
from ..protocols.base import Endpoint, Exchange
from ..protocols.replies import (
    SAMPLED_LOGPROBS,
    StreamAssembler,
    caller_wants_logprobs,
    drop_logprob_entries,
    sampled_logprobs,
    strip_for_caller,
)
from .turns import TURN, Turn, TurnSplicer, given_prompt

if TYPE_CHECKING:
    from .request_validation import Attribution

__all__ = [
    "CallRecording",
    "CallStore",
    "Recorder",
    "StreamAssembler",
    "build_call",
    "caller_wants_logprobs",
    "completions_from_response",
    "drop_logprob_entries",
    "inject_training_fields",
    "sampled_logprobs",
    "strip_for_caller",
]


def inject_training_fields(endpoint: str, body: dict[str, Any], model: str | None = None
                           ) -> dict[str, Any]:
    """The request the engine gets: the caller's (a copy; ``model``: the engine's model name in
    it), plus logprobs and token ids."""
    out = dict(body)
    if model is not None:
        out["model"] = model
    out["return_token_ids"] = True
    if endpoint == "chat.completions":
        out["logprobs"] = True
        if out.get("top_logprobs") is None:
            out["top_logprobs"] = 0
    else:
        out["logprobs"] = out.get("logprobs") or 0
    return out


def _chat_logprobs(choice: dict[str, Any]) -> list[float] | None:
    logprobs = choice.get("logprobs") or {}
    if SAMPLED_LOGPROBS in logprobs:  # drop_logprob_entries kept these
        return logprobs[SAMPLED_LOGPROBS]
    content = logprobs.get("content")
    if content is None:
        return None
    return sampled_logprobs(content)


def completions_from_response(
    endpoint: str, response: dict[str, Any]
) -> tuple[list[int], list[CompletionRecord]]:
    """Prompt token ids and one record per choice of a (non-streamed or assembled) response."""
    records = []
    prompt_ids = response.get("prompt_token_ids") or []
    for c in response.get("choices") or []:
        if endpoint == "chat.completions":
            message = c.get("message") or {}
            records.append(CompletionRecord(
                index=c.get("index", 0), token_ids=c.get("token_ids") or [],
                logprobs=_chat_logprobs(c), text=message.get("content") or "",
                finish_reason=c.get("finish_reason"), tool_calls=message.get("tool_calls") or None,
            ))
        else:
            lp = (c.get("logprobs") or {}).get("token_logprobs")
            prompt_ids = prompt_ids or c.get("prompt_token_ids") or []
            records.append(
                CompletionRecord(
                    index=c.get("index", 0),
                    token_ids=c.get("token_ids") or [],
                    logprobs=[float(x) for x in lp] if lp is not None else None,
                    text=c.get("text") or "",
                    finish_reason=c.get("finish_reason"),
                )
            )
    return list(prompt_ids), records


def build_call(*, endpoint: str, caller_body: dict[str, Any], response: dict[str, Any] | None,
               rollout_id: str | None, model: str, adapter_step: int | None, latency_s: float,
               streamed: bool, error: str | None = None,
               adapter_digest: str | None = None) -> LLMCall:
    prompt_ids, completions = (
        completions_from_response(endpoint, response) if response else ([], [])
    )
    temperature = caller_body.get("temperature")
    request = {k: v for k, v in caller_body.items() if k not in ("stream_options",)}
    # Stored: the response as the caller saw it, plus token ids. Per-token logprobs the caller
    # did not ask for live in `completions` only: duplicating them made each record 4x larger
    # and 3.7x slower to write (benchmarks/call_record_write.py).
    if response is not None:
        response = strip_for_caller(endpoint, {**caller_body, "return_token_ids": True}, response)
    return LLMCall(
        id="call-" + uuid.uuid4().hex, rollout_id=rollout_id, endpoint=endpoint, model=model,
        adapter_step=adapter_step, adapter_digest=adapter_digest, request=request,
        response=response,
        prompt_token_ids=prompt_ids, completions=completions,
        temperature=1.0 if temperature is None else float(temperature),
        streamed=streamed, latency_s=latency_s, created_at=time.time(), error=error,
    )


class CallStore:
    """Recorded calls per rollout, appended to ``calls/{rollout_id}.jsonl`` as they come.

    The file is the only copy: ``take`` reads it, so the calls recorded before a restart are
    returned together with those after it. ``add`` is thread-safe: the gateway calls it from
    worker threads so that serialising and fsyncing records never blocks its event loop;
    appends to one rollout's file, and reads of it, are serialised. A failed write raises
    :class:`~tracerl.core.errors.StorageError` and leaves the file as it was.
    """

    _FILE_LOCKS = 64

    def __init__(self, divert: Callable[[ModelStore, str], Path | None] | None = None,
                 after_add: Callable[[ModelStore, LLMCall], None] | None = None) -> None:
        self._file_locks = [threading.Lock() for _ in range(self._FILE_LOCKS)]
        # where a rollout's call goes instead of its file (e.g. after its rollout finished)
        self.divert = divert
        # told of each call once its record is on disk (the online mode's live calls)
        self.after_add = after_add

    def _file_lock(self, path: Path) -> threading.Lock:
        return self._file_locks[hash(str(path)) % self._FILE_LOCKS]

    def add(self, store: ModelStore, call: LLMCall) -> None:
        rid = call.rollout_id
        path = store.calls_path(rid) if rid is not None else store.unattributed_calls_path
        if rid is not None and self.divert is not None:
            path = self.divert(store, rid) or path
        line = call.json_line()
        with self._file_lock(path):
            append_jsonl(path, line)
        if self.after_add is not None:
            self.after_add(store, call)

    def take(self, store: ModelStore, rollout_id: str) -> list[LLMCall]:
        """The calls of a rollout, all that its file holds (a torn line is skipped, logged)."""
        path = store.calls_path(rollout_id)
        with self._file_lock(path):
            records = read_jsonl(path)
        return [LLMCall.model_validate(r) for r in records]


@dataclass(slots=True)
class CallRecording:
    """One call being recorded, from the engine request to the record on disk."""

    calls: CallStore
    store: ModelStore
    endpoint: Endpoint
    exchange: Exchange
    who: Attribution
    step: int | None
    route: CallRoute
    engine_body: dict[str, Any]
    turns: TurnSplicer | None = None  # told of the call, for its rollout's next turn
    turn: Turn | None = None  # the call's splice verdict (:mod:`.turns`)
    started: float = field(default_factory=time.perf_counter)

    async def finish(self, response: dict[str, Any] | None, *, streamed: bool = False,
                     error: str | None = None, disconnected: bool = False) -> LLMCall:
        """Record the call: ``response`` is the engine's reply (``streamed``: assembled from its
        chunks). The record is on disk when this returns, even if the caller's task is
        cancelled meanwhile; then ``tracerl_on_llm_call`` fires. A failed write raises
        :class:`~tracerl.core.errors.StorageError` (the caller must not train on it)."""
        if (response is not None and not streamed and self.endpoint == "chat.completions"
                and not self.exchange.keeps_logprob_entries):
            # before any await: at 256 replies ending together, the engine's per-token entries
            # of all of them would otherwise be alive at once (BENCHMARKS.md, the c256 tail)
            drop_logprob_entries(response)
        body = self.exchange.chat_body
        call = build_call(endpoint=self.endpoint, caller_body=body, response=response,
                          rollout_id=self.who.rollout_id, model=body.get("model", ""),
                          adapter_step=self.step, latency_s=time.perf_counter() - self.started,
                          streamed=streamed, error=error,
                          adapter_digest=self.route.adapter_digest)
        del response  # not kept alive over the write (the gateway's comment says why)
        if self.who.tags:
            call.metadata["tags"] = self.who.tags
        if disconnected:
            call.metadata["disconnected"] = True
        if self.route.replica is not None:
            call.metadata["replica"] = self.route.replica
        call.metadata.update(self.exchange.metadata)
        if self.turn is not None:
            call.metadata[TURN] = self.turn.metadata()
        if self.turns is not None:
            self.turns.remember(self.store.root, call)
        # Serialising and fsyncing a record takes milliseconds: done in a worker thread, so that
        # hundreds of concurrent calls do not queue behind each other's disk writes. The write
        # and the plugin hook happen even if the caller is cancelled meanwhile (a client that
        # went away).
        written = asyncio.ensure_future(asyncio.to_thread(self.calls.add, self.store, call))

        def notify(done: asyncio.Future[None]) -> None:
            if not done.cancelled() and done.exception() is None:
                llm_call_recorded(call)

        written.add_done_callback(notify)
        await asyncio.shield(written)
        return call


class Recorder:
    """The gateway's recorder: where calls are kept, and one :class:`CallRecording` per call."""

    def __init__(self, calls: CallStore, turns: TurnSplicer | None = None) -> None:
        self.calls = calls
        self.turns = turns  # told of each recorded call (exact turns), None: no splicing

    def begin(self, store: ModelStore, exchange: Exchange, endpoint: Endpoint,
              engine_model: str, who: Attribution, step: int | None,
              route: CallRoute, turn: Turn | None = None) -> CallRecording:
        """Start recording a call that ``engine_model`` answers: its engine request is
        ``rec.engine_body`` (with ``turn``'s spliced prompt ids, if any); latency counts from
        now."""
        engine_body = inject_training_fields(endpoint, exchange.chat_body, engine_model)
        given_prompt(engine_body, turn)
        return CallRecording(self.calls, store, endpoint, exchange, who, step, route,
                             engine_body, self.turns, turn)
