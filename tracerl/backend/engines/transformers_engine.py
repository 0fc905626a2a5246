"""The transformers engine: CPU-friendly fallback for users without vLLM.

Requests are served by iteration-level (continuous) batching (:mod:`.continuous_batcher`): a new
request joins the decoding rows at the next step, whichever model's adapter it uses, and a
sequence leaves as soon as it ends, so no request waits for another's longest answer. Logprobs
are those of the processed distribution (after temperature and top-p), like vLLM's
``processed_logprobs`` mode, so the recorded values are the sampling policy's. A request past its
deadline, or whose streaming client left, stops its sequences at the next step. Tokenization runs
off the event loop. A streamed call gets each token as it is sampled; a tool-call turn (tools
given and a tool-call parser configured) streams once generated, its plain content and then
tool-call deltas, never the markup.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

from ...core.engine import (
    PROMPT_IDS,
    Engine,
    EngineRequestError,
    EngineSpec,
    EngineUnavailableError,
)
from ...core.fingerprint import BASE, digest_if_readable, note_served
from ...events.hookspecs import hookimpl
from ..chat_template import apply_chat_template_override, render_prompt, turn_end_ids
from .adapter_switch import AdapterSwitch
from .generation_job import GenerationJob, ModelAccess, Results, TokenSink
from .token_prompts import requested_max_tokens
from .tool_parsers import PARSERS, content_before_tool_calls


def _prompt_too_long(max_len: int, prompt: int, max_tokens: int) -> EngineRequestError:
    return EngineRequestError(
        f"This model's maximum context length is {max_len} tokens. However, you requested "
        f"{prompt + max_tokens} tokens ({prompt} in the messages, {max_tokens} in the completion). "
        "Please reduce the length of the messages or completion.",
        param="messages", code="context_length_exceeded",
    )


class TransformersEngine(Engine):
    name = "transformers"

    def __init__(self, spec: EngineSpec, *,
                 _batching: Literal["continuous", "static"] = "continuous") -> None:
        super().__init__(spec)
        self.model: Any = None
        self.tokenizer: Any = None
        self._adapters: dict[str, Path] = {}
        self._peft_names: dict[str, str] = {}
        self._digests: dict[str, str] = {}  # peft name -> digest of the weights loaded under it
        self._batching = _batching  # "static": the former batcher, a benchmark's baseline only
        self._batcher_impl: Any = None  # a ContinuousBatcher (or StaticBatcher)
        self._batcher: asyncio.Task | None = None
        self._lock = threading.Lock()
        self._switch = AdapterSwitch()  # the model's adapter state, set only on a change
        self._stop_ids: set[int] | None = None  # _eos_ids(), once the tokenizer is loaded
        # seconds from each answered request's submission to its first sampled token
        self.first_token_waits: deque[float] = deque(maxlen=10_000)

    @classmethod
    def available(cls) -> bool:
        import importlib.util

        return all(importlib.util.find_spec(m) for m in ("torch", "transformers", "peft"))

    # --- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        self._batcher_impl = self._make_batcher()
        self._batcher = asyncio.create_task(self._batcher_impl.run())
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
        self._stop_ids = None
        model = AutoModelForCausalLM.from_pretrained(self.spec.model_path, dtype=dtype)
        # (the ignore: functools.wraps on PreTrainedModel.to makes mypy read the device as self)
        model.to("cuda" if cuda else "cpu").eval()  # type: ignore[arg-type]  # see above
        self.model = model
        self._switch.forget()

    def _make_batcher(self) -> Any:
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        access = ModelAccess(
            lock=self._lock, model=lambda: self.model, eos=self._eos_ids(), pad=pad,
            digest=lambda a: BASE if a is None else self._digests.get(a), adapters=self._switch)
        config = self.spec.config
        if self._batching == "static":
            from .static_batcher import StaticBatcher

            return StaticBatcher(access, config.max_num_seqs)
        from .continuous_batcher import ContinuousBatcher

        return ContinuousBatcher(access, config.max_num_seqs, config.max_model_len)

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
            self._switch.forget()
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

    async def unload_adapter(self, lora_name: str) -> None:
        """Stop serving ``lora_name`` and delete its weights from the model (a retired version:
        an engine that kept every version grew by an adapter per promotion)."""
        self._adapters.pop(lora_name, None)
        await asyncio.to_thread(self._delete_adapter, self._peft_name(lora_name))

    def _delete_adapter(self, peft_name: str) -> None:
        with self._lock:  # after the step in progress: no forward runs it from here on
            self._digests.pop(peft_name, None)
            if self.model is not None and peft_name in getattr(self.model, "peft_config", {}):
                self._switch.forget()
                self.model.delete_adapter(peft_name)

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

    def _job(self, prompt_ids: list[int], body: dict[str, Any],
             on_token: TokenSink | None = None) -> GenerationJob:
        """A request's generation job, its settings checked."""
        if self.model is None or self._batcher is None or self._batcher.done():
            raise EngineUnavailableError("the transformers engine is not running")
        if (body.get("response_format") or {}).get("type") in ("json_schema", "json_object") or \
                body.get("guided_json") or body.get("structured_outputs"):
            raise EngineRequestError("structured output (response_format / guided_json) needs the "
                                     "vLLM engine", param="response_format")
        if body.get("stop"):
            raise EngineRequestError("`stop` is not supported by the transformers engine; use vLLM",
                                     param="stop")
        max_len = self.spec.config.max_model_len
        max_tokens = requested_max_tokens(body)
        if max_tokens is None:
            max_tokens = max(min(max_len - len(prompt_ids), 1024), 1)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise EngineRequestError("max_tokens must be a positive integer", param="max_tokens")
        if len(prompt_ids) + max_tokens > max_len:
            raise _prompt_too_long(max_len, len(prompt_ids), max_tokens)
        n = body.get("n") or 1
        if not isinstance(n, int) or n < 1:
            raise EngineRequestError("n must be a positive integer", param="n")
        temperature = body.get("temperature")
        temperature = 1.0 if temperature is None else float(temperature)
        top_p = float(body.get("top_p") or 1.0)
        loop = asyncio.get_running_loop()
        job = GenerationJob(prompt_ids, n, max_tokens, temperature, top_p,
                            self._adapter_for(body["model"]), loop.create_future(), loop,
                            on_token=on_token)
        job.future.add_done_callback(lambda _: self._note_wait(job))
        return job

    def _note_wait(self, job: GenerationJob) -> None:
        if job.first_token is not None:
            self.first_token_waits.append(job.first_token - job.submitted)

    async def _submit(self, prompt_ids: list[int], body: dict[str, Any]) -> Results:
        job = self._job(prompt_ids, body)
        self._batcher_impl.submit(job)
        results = await job.future  # cancelled with its caller: its sequences stop
        note_served(job.digest)
        return results

    def _eos_ids(self) -> set[int]:
        """Where generation stops: the model's and the tokenizer's end tokens, and the chat
        template's end of an assistant turn (see :func:`turn_end_ids`)."""
        if self._stop_ids is None:
            eos = self.model.generation_config.eos_token_id
            ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
            if self.tokenizer.eos_token_id is not None:
                ids.add(self.tokenizer.eos_token_id)
            self._stop_ids = ids | turn_end_ids(self.tokenizer)
        return self._stop_ids

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
        tool_turn = bool(body.get("tools")) and self.spec.config.tool_call_parser in PARSERS
        stream = (self._stream_after(body) if tool_turn or self._batching == "static"
                  else self._stream_live(body))
        async for chunk in stream:
            yield chunk

    async def _stream_live(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Each token as it is sampled; the caller leaving (the generator closed) stops its
        sequences at the next step."""
        prompt_ids = await asyncio.to_thread(self.render_chat, body)  # CPU work off the loop
        events: asyncio.Queue[tuple[int, int, float, str | None] | None] = asyncio.Queue()
        job = self._job(prompt_ids, body, on_token=lambda *e: events.put_nowait(e))
        job.future.add_done_callback(lambda _: events.put_nowait(None))
        self._batcher_impl.submit(job)
        base = {"id": "chatcmpl-" + uuid.uuid4().hex, "object": "chat.completion.chunk",
                "created": int(time.time()), "model": body["model"]}
        eos, completion_tokens = self._eos_ids(), 0
        try:
            while (event := await events.get()) is not None:
                index, token_id, lp, finish = event
                if completion_tokens == 0:
                    yield {**base, "prompt_token_ids": prompt_ids, "choices": [
                        {"index": i, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None} for i in range(job.n)]}
                completion_tokens += 1
                (entry,) = self._logprob_content([token_id], [lp])
                yield {**base, "choices": [{
                    "index": index, "delta": {"content": "" if token_id in eos else entry["token"]},
                    "logprobs": {"content": [entry]}, "finish_reason": finish,
                    "token_ids": [token_id]}]}
            await job.future  # raises what failed the generation
            note_served(job.digest)
        finally:
            job.future.cancel()  # a no-op once answered
        if (body.get("stream_options") or {}).get("include_usage"):
            yield {**base, "choices": [], "usage": {
                "prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                "total_tokens": len(prompt_ids) + completion_tokens}}

    async def _stream_after(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Generated first, then streamed token by token (a tool-call turn: its plain content,
        then tool-call deltas)."""
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


@hookimpl
def tracerl_engines() -> list[type]:
    return [TransformersEngine]
