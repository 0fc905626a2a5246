"""An inference engine from outside tracerl: it answers with the last user message reversed.

Tokens are the UTF-8 bytes of the text (ids 0-255), each sampled with logprob 0.0, so its
records are token-exact like any engine's. Adapters are accepted and remembered (not applied).
"""

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tracerl.core.engine import Engine, EngineRequestError


def _tokens(text: str) -> list[int]:
    return list(text.encode())


def _answer(body: dict[str, Any]) -> str:
    users = [m for m in body.get("messages") or [] if m.get("role") == "user"]
    if not users or not isinstance(users[-1].get("content"), str):
        raise EngineRequestError("the echo engine needs a user message with text content",
                                 param="messages")
    text = users[-1]["content"][::-1]
    return text[: int(body.get("max_tokens") or len(text))]


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    return _tokens("".join(f"{m.get('role')}:{m.get('content')}\n"
                           for m in body.get("messages") or []))


class EchoEngine(Engine):
    name = "echo"

    def __init__(self, spec: Any) -> None:
        super().__init__(spec)
        self.adapters: dict[str, Path] = {}
        self.started = False

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.started = False

    async def healthy(self) -> bool:
        return self.started

    async def load_adapter(self, lora_name: str, path: Path) -> None:
        self.adapters[lora_name] = path

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        text = _answer(body)
        ids = _tokens(text)
        entries = [{"token": chr(i), "logprob": 0.0, "bytes": [i], "top_logprobs": []}
                   for i in ids]
        prompt = _prompt_ids(body)
        return {"id": "chatcmpl-echo", "object": "chat.completion", "created": 0,
                "model": body["model"], "prompt_token_ids": prompt,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "stop", "token_ids": ids,
                             "logprobs": {"content": entries}}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                          "total_tokens": len(prompt) + len(ids)}}

    async def chat_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        text = _answer(body)
        base = {"id": "chatcmpl-echo", "object": "chat.completion.chunk", "created": 0,
                "model": body["model"]}
        yield {**base, "prompt_token_ids": _prompt_ids(body), "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}]}
        for i, char in enumerate(text):
            ids = _tokens(char)
            last = i == len(text) - 1
            yield {**base, "choices": [{
                "index": 0, "delta": {"content": char}, "token_ids": ids,
                "logprobs": {"content": [{"token": char, "logprob": 0.0, "top_logprobs": []}
                                         for _ in ids]},
                "finish_reason": "stop" if last else None}]}

    async def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise EngineRequestError("the echo engine takes a text prompt", param="prompt")
        text, ids = prompt[::-1], _tokens(prompt[::-1])
        return {"id": "cmpl-echo", "object": "text_completion", "created": 0,
                "model": body["model"], "choices": [{
                    "index": 0, "text": text, "token_ids": ids, "prompt_token_ids":
                    _tokens(prompt), "finish_reason": "stop",
                    "logprobs": {"token_logprobs": [0.0] * len(ids)}}]}
