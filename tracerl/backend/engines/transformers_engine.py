"""The transformers engine: CPU-friendly fallback for users without vLLM.

Concurrent requests with the same sampling settings are batched (left-padded) into one
``generate`` call on a single worker thread, whichever model's adapter each one uses (peft
routes each row through its own adapter). Logprobs are those of the processed distribution
(after temperature and top-p), like vLLM's ``processed_logprobs`` mode, so the recorded values
are the sampling policy's. Each request gets its answer as soon as its own sequences end, and a
request past its deadline stops its sequences. Tokenization runs off the event loop. Streaming is
emitted after generation, token by token; a tool-call turn streams its plain content and then
tool-call deltas, never the markup.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core.engine import (
    PROMPT_IDS,
    Engine,
    EngineRequestError,
    EngineSpec,
    EngineUnavailableError,
)
from ...core.fingerprint import BASE, digest_if_readable, note_served
from ...core.trajectory import is_greedy
from ...events.hookspecs import hookimpl
from ..chat_template import apply_chat_template_override, render_prompt
from .tool_parsers import PARSERS, content_before_tool_calls

BATCH_WINDOW_S = 0.005


@dataclass
class _Job:
    prompt_ids: list[int]
    n: int
    max_tokens: int
    temperature: float
    top_p: float
    adapter: str | None
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    digest: str | None = None  # of the weights that generated it (set under the model lock)

    @property
    def key(self) -> tuple:
        """Jobs of one key generate in one batch (whichever adapters they use)."""
        return (self.temperature, self.top_p)


def _prompt_too_long(max_len: int, prompt: int, max_tokens: int) -> EngineRequestError:
    return EngineRequestError(
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the completion). "
        "Please reduce the length of the messages or completion.",
        param="messages", code="context_length_exceeded",
    )


class TransformersEngine(Engine):
    name = "transformers"

    def __init__(self, spec: EngineSpec) -> None:
        super().__init__(spec)
        self.model: Any = None
        self.tokenizer: Any = None
        self._adapters: dict[str, Path] = {}
        self._peft_names: dict[str, str] = {}
        self._digests: dict[str, str] = {}  # peft name -> digest of the weights loaded under it
        self._queue: asyncio.Queue[_Job] | None = None
        self._batcher: asyncio.Task | None = None
        self._lock = threading.Lock()

    @classmethod
    def available(cls) -> bool:
        import importlib.util

        return all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft"))

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        self._queue = asyncio.Queue()
        self._batcher = asyncio.create_task(self._batch_loop())
        for name, path in list(self._adapters.items()):
            await self.load_adapter(name, path)

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        cuda = torch.cuda.is_available()
        dtype = {"auto": torch.bfloat16 if cuda else torch.float32, "float32": torch.float32,
                 "bfloat16": torch.bfloat16, "float16": torch.float16}[self.spec.config.dtype]
        self.tokenizer = AutoTokenizer.from_pretrained(self.spec.model_path)
        self.tokenizer.padding_side = "left"
        apply_chat_template_override(self.tokenizer, self.spec.config.chat_template)
        model = AutoModelForCausalLM.from_pretrained(self.spec.model_path, dtype=dtype)
        # (the ignore: functools.wraps on PreTrainedModel.to makes mypy read the device as self)
        model.to("cuda" if cuda else "cpu").eval()  # type: ignore[arg-type]  # see above
        self.model = model

    async def stop(self) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
            self._batcher = None
        self.model = None

    async def healthy(self) -> bool:
        return self.model is not None and self._batcher is not None and not self._batcher.done()

    async def load_adapter(self, lora_name: str, path: Path) -> None:
        await asyncio.to_thread(self._load_adapter, lora_name, Path(path))
        self._adapters[lora_name] = Path(path)

    def _peft_name(self, lora_name: str) -> str:
        """peft's name for an adapter: served names may hold '/' and '.', which module names
        may not."""
        return self._peft_names.setdefault(lora_name, f"adapter{len(self._peft_names)}")

    def _load_adapter(self, lora_name: str, path: Path) -> None:
        from peft import PeftModel

        lora_name = self._peft_name(lora_name)
        digest = digest_if_readable(path)  # taken once, before the load

        with self._lock:
            self._digests.pop(lora_name, None)  # set again only once the load succeeded
            if not hasattr(self.model, "peft_config"):
                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=lora_name)
            else:
                if lora_name in self.model.peft_config:
                    self.model.delete_adapter(lora_name)
                self.model.load_adapter(path, adapter_name=lora_name)
            self.model.eval()
            if digest is not None:
                self._digests[lora_name] = digest

    # --- request handling ----------------------------------------------------------------

    def _adapter_for(self, model_name: str) -> str | None:
        if model_name == self.spec.served_name:
            return None
        if model_name in self._adapters:
            return self._peft_name(model_name)
        raise EngineRequestError(f"The model `{model_name}` does not exist.", status=404,
                                 param="model", code="model_not_found")

    def render_chat(self, body: dict[str, Any]) -> list[int]:
        if body.get(PROMPT_IDS) is not None:  # the gateway's exact turn: given, not rendered
            return list(body[PROMPT_IDS])
        try:
            return render_prompt(self.tokenizer, body["messages"], body.get("tools"))
        except Exception as e:
            raise EngineRequestError(
                f"could not apply the chat template: {e}", param="messages"
            ) from e

    def prompt_ids_refusal(self, body: dict[str, Any]) -> str | None:
        return None  # given prompt ids take the rendered prompt's place

    async def _submit(
        self, prompt_ids: list[int], body: dict[str, Any]
    ) -> list[tuple[list[int], list[float], str]]:
        if self._queue is None or not await self.healthy():
            raise EngineUnavailableError("the transformers engine is not running")
        if (body.get("response_format") or {}).get("type") in ("json_schema", "json_object") or \
                body.get("guided_json") or body.get("structured_outputs"):
            raise EngineRequestError("structured output (response_format / guided_json) needs the "
                                     "vLLM engine", param="response_format")
        if body.get("stop"):
            raise EngineRequestError("`stop` is not supported by the transformers engine; use vLLM",
                                     param="stop")
        max_len = self.spec.config.max_model_len
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
        if max_tokens is None:
            max_tokens = max(min(max_len - len(prompt_ids), 1024), 1)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise EngineRequestError("max_tokens must be a positive integer", param="max_tokens")
        if len(prompt_ids) + max_tokens > max_len:
            raise _prompt_too_long(max_len, len(prompt_ids), max_tokens)
        n = body.get("n") or 1
        temperature = body.get("temperature")
        temperature = 1.0 if temperature is None else float(temperature)
        top_p = float(body.get("top_p") or 1.0)
        loop = asyncio.get_running_loop()
        job = _Job(prompt_ids, n, max_tokens, temperature, top_p, self._adapter_for(body["model"]),
                   loop.create_future(), loop)
        await self._queue.put(job)
        results = await job.future
        note_served(job.digest)
        return results

    async def _batch_loop(self) -> None:
        assert self._queue is not None
        while True:
            first = await self._queue.get()
            await asyncio.sleep(BATCH_WINDOW_S)
            batch, rest = [first], list[_Job]()
            while not self._queue.empty():
                job = self._queue.get_nowait()
                same = (
                    job.key == first.key
                    and sum(j.n for j in batch) + job.n <= self.spec.config.max_num_seqs
                )
                (batch if same else rest).append(job)
            for job in rest:
                self._queue.put_nowait(job)
            batch = [job for job in batch if not job.future.done()]  # past their deadline
            if not batch:
                continue
            try:
                await asyncio.to_thread(self._generate, batch)
            except Exception as e:
                for job in batch:
                    if not job.future.done():
                        job.future.set_exception(e)

    def _generate(self, batch: list[_Job]) -> None:
        import torch
        from transformers import StoppingCriteriaList

        tok = self.tokenizer
        rows = [(job, job.prompt_ids) for job in batch for _ in range(job.n)]
        width = max(len(ids) for _, ids in rows)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        device = next(self.model.parameters()).device
        input_ids = torch.tensor(
            [[pad] * (width - len(ids)) + ids for _, ids in rows], device=device
        )
        attention = torch.tensor(
            [[0] * (width - len(ids)) + [1] * len(ids) for _, ids in rows], device=device
        )
        first = batch[0]
        sample = not is_greedy(first.temperature)
        # neutralise generation_config defaults the trainer cannot reproduce (penalties, top-k)
        gen_kwargs: dict[str, Any] = {"do_sample": sample, "repetition_penalty": 1.0,
                                      "no_repeat_ngram_size": 0}
        if sample:
            gen_kwargs.update(temperature=first.temperature, top_p=first.top_p, top_k=0)
        eos = self._eos_ids()
        handback = _SequenceHandback([job for job, _ in rows], eos)
        adapters = [job.adapter for job, _ in rows]
        with self._lock, torch.inference_mode():
            model = self.model
            ctx: Any = _null()
            for job in batch:  # the digest of what serves each call, read under the lock
                job.digest = BASE if job.adapter is None else self._digests.get(job.adapter)
            if len(set(adapters)) > 1:  # several models' adapters: peft routes each row
                gen_kwargs["adapter_names"] = [a or "__base__" for a in adapters]
            elif first.adapter is not None:
                model.set_adapter(first.adapter)
            elif hasattr(model, "peft_config"):
                ctx = model.disable_adapter()
            with ctx:
                model.generate(
                    input_ids=input_ids, attention_mask=attention,
                    max_new_tokens=max(job.max_tokens for job in batch),
                    pad_token_id=pad, eos_token_id=list(eos), output_scores=True,
                    return_dict_in_generate=True,
                    stopping_criteria=StoppingCriteriaList([handback]), **gen_kwargs,
                )
        handback.finish_all()

    def _eos_ids(self) -> set[int]:
        eos = self.model.generation_config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            [i for i in ids if i not in self._eos_ids()], skip_special_tokens=False
        )

    def _logprob_content(self, ids: list[int], lps: list[float]) -> list[dict[str, Any]]:
        out = []
        for token_id, lp in zip(ids, lps, strict=True):
            text = self.tokenizer.decode([token_id])
            out.append(
                {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
            )
        return out

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt_ids = await asyncio.to_thread(self.render_chat, body)  # CPU work off the loop
        results = await self._submit(prompt_ids, body)
        parser = PARSERS.get(self.spec.config.tool_call_parser or "") if body.get("tools") else None
        choices = []
        for index, (ids, lps, finish) in enumerate(results):
            text = self._decode(ids)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if parser is not None:
                content, calls = parser(text)
                if calls:
                    message = {"role": "assistant", "content": content or None, "tool_calls": calls}
                    finish = "tool_calls"
            choices.append({
                "index": index, "message": message, "finish_reason": finish,
                "logprobs": {"content": self._logprob_content(ids, lps)}, "token_ids": ids,
            })
        completion_tokens = sum(len(r[0]) for r in results)
        return {
            "id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion",
            "created": int(time.time()), "model": body["model"], "choices": choices,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(prompt_ids) + completion_tokens},
            "prompt_token_ids": prompt_ids,
        }

    async def chat_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        full = await self.chat(body)
        base = {"id": full["id"], "object": "chat.completion.chunk", "created": full["created"],
                "model": full["model"]}
        yield {
            **base,
            "choices": [
                {
                    "index": c["index"],
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                for c in full["choices"]
            ],
            "prompt_token_ids": full["prompt_token_ids"],
        }
        eos = self._eos_ids()
        for choice in full["choices"]:
            ids, content = choice["token_ids"], choice["logprobs"]["content"]
            calls = choice["message"].get("tool_calls")
            pieces = ["" if t in eos else lp["token"] for t, lp in zip(ids, content, strict=True)]
            if calls:
                pieces = content_before_tool_calls(pieces, choice["message"].get("content") or "")
            for k, (token_id, lp) in enumerate(zip(ids, content, strict=True)):
                last = k == len(ids) - 1
                delta: dict[str, Any] = {"content": pieces[k]} if pieces[k] or not calls else {}
                if last and calls:
                    delta["tool_calls"] = [{"index": j, **tc} for j, tc in enumerate(calls)]
                yield {
                    **base,
                    "choices": [
                        {
                            "index": choice["index"],
                            "delta": delta,
                            "logprobs": {"content": [lp]},
                            "finish_reason": choice["finish_reason"] if last else None,
                            "token_ids": [token_id],
                        }
                    ],
                }
        if (body.get("stream_options") or {}).get("include_usage"):
            yield {**base, "choices": [], "usage": full["usage"]}

    async def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):  # tokenized off the event loop
            prompt_ids = (await asyncio.to_thread(
                self.tokenizer, prompt, add_special_tokens=False))["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise EngineRequestError(
                "prompt must be a string or a list of token ids", param="prompt"
            )
        vocab = self.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise EngineRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        results = await self._submit(prompt_ids, body)
        choices = []
        for index, (ids, lps, finish) in enumerate(results):
            choices.append(
                {
                    "index": index,
                    "text": self._decode(ids),
                    "finish_reason": finish,
                    "logprobs": {
                        "tokens": [self.tokenizer.decode([t]) for t in ids],
                        "token_logprobs": lps,
                        "top_logprobs": None,
                        "text_offset": None,
                    },
                    "token_ids": ids,
                    "prompt_token_ids": prompt_ids,
                }
            )
        completion_tokens = sum(len(r[0]) for r in results)
        return {
            "id": "cmpl-" + uuid.uuid4().hex,
            "object": "text_completion",
            "created": int(time.time()),
            "model": body["model"],
            "choices": choices,
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens,
            },
        }


class _SequenceHandback:
    """A stopping criterion that records each row's tokens and logprobs as they are sampled
    (of the processed distribution, like vLLM's ``processed_logprobs``), stops a row at its own
    ``max_tokens`` or end of sequence, and hands a request its answer as soon as all its rows have
    ended, instead of when the batch's longest row ends. A request whose future is done (past its
    deadline, cancelled) stops its rows at once; the batch stops when every row has."""

    def __init__(self, jobs: list[_Job], eos: set[int]) -> None:
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
        for row, job in enumerate(self.jobs):
            if self.finish[row] is not None:
                continue
            if job.future.done():
                self.finish[row] = "cancelled"
                continue
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
                job.loop.call_soon_threadsafe(_resolve, job.future, results)

    def finish_all(self) -> None:
        """After ``generate``: rows it ended without a criterion verdict end by length."""
        self.finish = [f or "length" for f in self.finish]
        self._hand_back_ended()


def _resolve(future: asyncio.Future, results: list[tuple[list[int], list[float], str]]) -> None:
    if not future.done():
        future.set_result(results)


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@hookimpl
def tracerl_engines() -> list[type]:
    return [TransformersEngine]
