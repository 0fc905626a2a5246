"""The transformers engine's former batcher, kept only as the baseline of
``benchmarks/engine_batching.py``: concurrent requests with the same sampling settings are
batched (left-padded) into one ``model.generate`` call, which runs until its longest row ends
while new requests wait behind it. The engine serves with :mod:`.continuous_batcher`."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from ...core.trajectory import is_greedy
from .generation_job import GenerationJob, ModelAccess, resolve

BATCH_WINDOW_S = 0.005


class StaticBatcher:
    def __init__(self, access: ModelAccess, max_rows: int) -> None:
        self.access = access
        self.max_rows = max_rows
        self.queue: asyncio.Queue[GenerationJob] = asyncio.Queue()

    def submit(self, job: GenerationJob) -> None:
        self.queue.put_nowait(job)

    async def run(self) -> None:
        while True:
            first = await self.queue.get()
            await asyncio.sleep(BATCH_WINDOW_S)
            batch, rest = [first], list[GenerationJob]()
            while not self.queue.empty():
                job = self.queue.get_nowait()
                same = job.key == first.key and sum(j.n for j in batch) + job.n <= self.max_rows
                (batch if same else rest).append(job)
            for job in rest:
                self.queue.put_nowait(job)
            batch = [job for job in batch if not job.cancelled]
            if not batch:
                continue
            try:
                await asyncio.to_thread(self._generate, batch)
            except Exception as e:
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(e)

    def _generate(self, batch: list[GenerationJob]) -> None:
        import torch
        from transformers import StoppingCriteriaList

        rows = [(job, job.prompt_ids) for job in batch for _ in range(job.n)]
        width = max(len(ids) for _, ids in rows)
        pad = self.access.pad
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in rows])
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in rows])
        first = batch[0]
        sample = not is_greedy(first.temperature)
        # neutralise generation_config defaults the trainer cannot reproduce (penalties, top-k)
        gen_kwargs: dict[str, Any] = {"do_sample": sample, "repetition_penalty": 1.0,
                                      "no_repeat_ngram_size": 0}
        if sample:
            gen_kwargs.update(temperature=first.temperature, top_p=first.top_p, top_k=0)
        eos = self.access.eos
        handback = _SequenceHandback([job for job, _ in rows], eos)
        adapters = [job.adapter for job, _ in rows]
        with self.access.lock, torch.inference_mode():
            model = self.access.model()
            device = next(model.parameters()).device
            for job in batch:  # the digest of what serves each call, read under the lock
                job.digest = self.access.digest(job.adapter)
            gen_kwargs.update(self.access.adapters.select(model, adapters))
            model.generate(
                input_ids=input_ids.to(device), attention_mask=attention.to(device),
                max_new_tokens=max(job.max_tokens for job in batch),
                pad_token_id=pad, eos_token_id=list(eos), output_scores=True,
                return_dict_in_generate=True,
                stopping_criteria=StoppingCriteriaList([handback]), **gen_kwargs,
            )
        handback.finish_all()


class _SequenceHandback:
    """A stopping criterion that records each row's tokens and logprobs as they are sampled
    (of the processed distribution, like vLLM's ``processed_logprobs``), stops a row at its own
    ``max_tokens`` or end of sequence, and hands a request its answer as soon as all its rows have
    ended, instead of when the batch's longest row ends. A request whose future is done (past its
    deadline, cancelled) stops its rows at once; the batch stops when every row has."""

    def __init__(self, jobs: list[GenerationJob], eos: set[int]) -> None:
        self.jobs = jobs
        self.eos = eos
        self.ids: list[list[int]] = [[] for _ in jobs]
        self.lps: list[list[float]] = [[] for _ in jobs]
        self.finish: list[str | None] = [None for _ in jobs]
        self._handed: set[int] = set()

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        step_scores = scores[-1] if isinstance(scores, tuple) else scores
        tokens = input_ids[:, -1:]
        lps = torch.log_softmax(step_scores.float(), dim=-1).gather(-1, tokens)[:, 0].tolist()
        tokens = tokens[:, 0].tolist()
        now = time.monotonic()
        for row, job in enumerate(self.jobs):
            if self.finish[row] is not None:
                continue
            if job.cancelled:
                self.finish[row] = "cancelled"
                continue
            if job.first_token is None:
                job.first_token = now
            self.ids[row].append(int(tokens[row]))
            self.lps[row].append(float(lps[row]))
            if tokens[row] in self.eos:
                self.finish[row] = "stop"
            elif len(self.ids[row]) >= job.max_tokens:
                self.finish[row] = "length"
        self._hand_back_ended()
        return torch.tensor([f is not None for f in self.finish], device=input_ids.device)

    def _hand_back_ended(self) -> None:
        for job in {id(j): j for j in self.jobs}.values():
            if id(job) in self._handed:
                continue
            rows = [r for r, j in enumerate(self.jobs) if j is job]
            if all(self.finish[r] is not None for r in rows):
                self._handed.add(id(job))
                results = [(self.ids[r], self.lps[r], self.finish[r] or "length") for r in rows]
                job.loop.call_soon_threadsafe(resolve, job.future, results)

    def finish_all(self) -> None:
        """After ``generate``: rows it ended without a criterion verdict end by length."""
        self.finish = [f or "length" for f in self.finish]
        self._hand_back_ended()

