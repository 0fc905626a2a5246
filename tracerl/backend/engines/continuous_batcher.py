"""Iteration-level (continuous) batching for the transformers engine.

One loop runs steps on a worker thread. A step (1) drops the rows of requests whose caller left
(past its deadline, hung up); (2) prefills waiting requests first come, first served, at most
``prefill_tokens`` prompt tokens per step while others decode (a longer prompt is prefilled in
chunks over several steps), and a request whose prefill ends samples its first token and joins
the decoding rows (its ``n`` sequences share the prefill); (3) decodes every row one token, rows
of different adapters in one forward (peft routes each row) and rows of different sampling
settings sampled group by group. A sequence that samples an end-of-sequence id or reaches its
``max_tokens`` leaves at once, and its request is answered when its last sequence has left.

Logprobs are those of the processed distribution (after temperature and top-p), like vLLM's
``processed_logprobs`` mode and like ``generate``'s scores: the sampling policy's own. The rows'
keys and values live in a :class:`.kv_slots.SlotCache`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ...core.engine import EngineRequestError
from ...core.trajectory import is_greedy
from .generation_job import GenerationJob, ModelAccess, Results, resolve

log = logging.getLogger(__name__)

PREFILL_TOKENS_PER_STEP = 256  # prompt tokens prefilled per step while other rows decode
IDLE_PREFILL_TOKENS = 2048  # per step when no row decodes (nobody to keep moving)


@dataclass
class _Row:
    job: GenerationJob
    index: int  # which of the job's n sequences
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    finish: str | None = None


@dataclass
class _Prefill:
    job: GenerationJob
    cache: Any  # a DynamicCache of the prompt's tokens so far
    done: int = 0


# a token sampled in a step: (its row, token id, logprob, finish reason if the row ended)
_Event = tuple[_Row, int, float, "str | None"]


class ContinuousBatcher:
    def __init__(self, access: ModelAccess, max_rows: int, max_len: int,
                 prefill_tokens: int = PREFILL_TOKENS_PER_STEP) -> None:
        self.access = access
        self.max_rows = max_rows
        self.max_len = max_len
        self.prefill_tokens = prefill_tokens
        self.queue: asyncio.Queue[GenerationJob] = asyncio.Queue()
        self._waiting: deque[GenerationJob] = deque()
        self._prefill: _Prefill | None = None
        self._rows: list[_Row] = []  # decoding; row i holds slot i of the cache
        self._jobs: dict[int, list[_Row]] = {}  # id(job) -> its rows, until answered
        self._cache: Any = None

    def submit(self, job: GenerationJob) -> None:
        self.queue.put_nowait(job)

    @property
    def decoding(self) -> list[GenerationJob]:
        """The requests with a row decoding now (for tests and benchmarks)."""
        return list({id(r.job): r.job for r in self._rows}.values())

    async def run(self) -> None:
        while True:
            if not (self._rows or self._prefill or self._waiting):
                self._waiting.append(await self.queue.get())
            while not self.queue.empty():
                self._waiting.append(self.queue.get_nowait())
            refused: list[GenerationJob] = []
            try:
                events = await asyncio.to_thread(self._step, refused)
            except Exception as e:
                log.exception("a generation step failed; its requests fail with it")
                self._fail_all(e)
                continue
            for job in refused:
                if not job.future.done() and job.refused is not None:
                    job.future.set_exception(job.refused)
            self._dispatch(events)

    # --- one step, on the worker thread ------------------------------------------------------

    def _step(self, refused: list[GenerationJob]) -> list[_Event]:
        """One step; requests whose adapter is no longer loaded are refused, into ``refused``."""
        import torch

        events: list[_Event] = []
        with self.access.lock, torch.inference_mode():
            model = self.access.model()
            self._refuse_unloaded(model, refused)
            self._drop_cancelled()
            budget = self.prefill_tokens if self._rows else IDLE_PREFILL_TOKENS
            while budget > 0 and self._admit():
                budget -= self._prefill_chunk(model, budget, events)
            if self._rows:
                self._decode(model, events)
        return events

    def _refuse_unloaded(self, model: Any, refused: list[GenerationJob]) -> None:
        """Requests of an adapter deleted since they came (an engine's direct caller; the
        gateway unloads a version only once its calls ended) are refused with a 404, so that
        their rows leave (:meth:`_drop_cancelled`) instead of failing the others' step."""
        loaded = getattr(model, "peft_config", {})
        prefilling = [self._prefill.job] if self._prefill is not None else []
        for job in (*self.decoding, *self._waiting, *prefilling):
            if job.adapter is not None and job.adapter not in loaded and job.refused is None:
                job.refused = EngineRequestError(
                    "the model's adapter was unloaded while the request waited",
                    status=404, param="model", code="model_not_found")
                refused.append(job)

    def _drop_cancelled(self) -> None:
        for slot in range(len(self._rows) - 1, -1, -1):
            if self._rows[slot].job.cancelled:
                self._remove(slot)
        self._jobs = {k: rows for k, rows in self._jobs.items() if not rows[0].job.cancelled}
        if self._prefill is not None and self._prefill.job.cancelled:
            self._prefill = None

    def _admit(self) -> bool:
        """Whether a request is being prefilled: the one already started, else the first
        waiting one (first come, first served), once there are rows free for its sequences."""
        from transformers import DynamicCache

        while self._prefill is None and self._waiting:
            job = self._waiting[0]
            if job.cancelled:
                self._waiting.popleft()
                continue
            if self._rows and len(self._rows) + job.n > self.max_rows:
                return False
            self._waiting.popleft()
            job.digest = self.access.digest(job.adapter)  # read under the model lock
            self._prefill = _Prefill(job, DynamicCache())
        return self._prefill is not None

    def _prefill_chunk(self, model: Any, budget: int, events: list[_Event]) -> int:
        """Prefill up to ``budget`` more tokens of the request being prefilled; once its prompt
        is in, sample its sequences' first tokens and let them join. Returns the tokens used."""
        import torch

        pre = self._prefill
        assert pre is not None
        job = pre.job
        chunk = job.prompt_ids[pre.done: pre.done + budget]
        device = next(model.parameters()).device
        kwargs = self.access.adapters.select(model, [job.adapter])
        out = model(input_ids=torch.tensor([chunk], device=device), past_key_values=pre.cache,
                    use_cache=True, logits_to_keep=1, **kwargs)
        pre.done += len(chunk)
        if pre.done < len(job.prompt_ids):
            return len(chunk)
        self._prefill = None
        logits = out.logits[0, -1:].expand(job.n, -1)
        tokens, lps = sample(logits, [job] * job.n)
        rows = [_Row(job, i) for i in range(job.n)]
        self._jobs[id(job)] = rows
        for row, token, lp in zip(rows, tokens, lps, strict=True):
            events.append(self._append(row, token, lp))
        joining = [row for row in rows if row.finish is None]
        if joining:
            if self._cache is None:
                from .kv_slots import SlotCache

                self._cache = SlotCache(model.config.num_hidden_layers, self.max_len)
            self._cache.insert(pre.cache, len(joining))
            self._rows.extend(joining)
        return len(chunk)

    def _decode(self, model: Any, events: list[_Event]) -> None:
        import torch

        device = next(model.parameters()).device
        cache = self._cache
        mask, positions = cache.columns_for_step(device)
        input_ids = torch.tensor([[row.ids[-1]] for row in self._rows], device=device)
        kwargs = self.access.adapters.select(model, [row.job.adapter for row in self._rows])
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                    past_key_values=cache, cache_position=torch.tensor([cache.width]),
                    use_cache=True, logits_to_keep=1, **kwargs)
        cache.advance()
        tokens, lps = sample(out.logits[:, -1], [row.job for row in self._rows])
        for row, token, lp in zip(self._rows, tokens, lps, strict=True):
            events.append(self._append(row, token, lp))
        for slot in range(len(self._rows) - 1, -1, -1):  # from the end: moved rows stay
            if self._rows[slot].finish is not None:
                self._remove(slot)

    def _append(self, row: _Row, token: int, lp: float) -> _Event:
        job = row.job
        if job.first_token is None:
            job.first_token = time.monotonic()
        row.ids.append(token)
        row.lps.append(lp)
        if token in self.access.eos:
            row.finish = "stop"
        elif len(row.ids) >= job.max_tokens:
            row.finish = "length"
        return row, token, lp, row.finish

    def _remove(self, slot: int) -> None:
        self._cache.remove(slot)
        last = self._rows.pop()
        if slot < len(self._rows):
            self._rows[slot] = last

    # --- back on the event loop -------------------------------------------------------------

    def _dispatch(self, events: list[_Event]) -> None:
        for row, token, lp, finish in events:
            job = row.job
            if job.cancelled:
                continue
            if job.on_token is not None:
                job.on_token(row.index, token, lp, finish)
            rows = self._jobs.get(id(job))
            if finish is not None and rows is not None and all(r.finish for r in rows):
                del self._jobs[id(job)]
                results: Results = [(r.ids, r.lps, r.finish or "length") for r in rows]
                resolve(job.future, results)

    def _fail_all(self, error: Exception) -> None:
        jobs = [r[0].job for r in self._jobs.values()] + list(self._waiting)
        if self._prefill is not None:
            jobs.append(self._prefill.job)
        for job in jobs:
            if not job.future.done():
                job.future.set_exception(error)
        self._waiting.clear()
        self._prefill, self._rows, self._jobs = None, [], {}
        if self._cache is not None:
            self._cache.release()
            self._cache = None


def sample(logits: Any, jobs: list[GenerationJob]) -> tuple[list[int], list[float]]:
    """Sample one token per row of ``logits`` ``[rows, vocab]`` with its job's settings, as
    ``generate`` does (temperature, then top-p; greedy below the greedy temperature); return the
    tokens and their logprobs under the processed distribution."""
    import torch
    from transformers import TemperatureLogitsWarper, TopPLogitsWarper

    logits = logits.float()
    tokens = torch.empty(len(jobs), dtype=torch.long, device=logits.device)
    lps = torch.empty(len(jobs), dtype=torch.float32, device=logits.device)
    groups: dict[tuple, list[int]] = {}
    for i, job in enumerate(jobs):
        groups.setdefault(job.key, []).append(i)
    for (temperature, top_p), members in groups.items():
        index = torch.tensor(members, device=logits.device)
        scores = logits.index_select(0, index)
        if is_greedy(temperature):
            chosen = scores.argmax(dim=-1, keepdim=True)
        else:
            scores = TemperatureLogitsWarper(temperature)(None, scores)
            if top_p < 1.0:
                scores = TopPLogitsWarper(top_p)(None, scores)
            chosen = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1)
        tokens[index] = chosen[:, 0]
        lps[index] = torch.log_softmax(scores, dim=-1).gather(-1, chosen)[:, 0]
    return tokens.tolist(), lps.tolist()
