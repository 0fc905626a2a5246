"""Checking a gateway request's fields before anything runs or is written.

Each malformed field is refused with an OpenAI-style 400 that names it (``param``). Bounds follow
what OpenAI and vLLM refuse: ``n`` up to 128, ``top_logprobs`` up to 20, ``logprobs`` (legacy
completions) up to 5, temperatures in [0, 2], penalties in [-2, 2], at most 4 stop strings, and
``max_tokens`` no larger than the model's context length. The rollout id and call tags a
request carries (path or headers) are checked here too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...core import strict_json
from ...core.context import MAX_TAGS_BYTES, ROLLOUT_HEADER, TAGS_HEADER
from ...core.engine import EngineRequestError
from ...core.errors import ConfigError, RequestError
from ...core.storage import validate_name

MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
MAX_STOP = 4
MAX_CHARS_PER_TOKEN = 256  # a prompt longer than this many characters per token cannot fit
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _bad(param: str, message: str) -> EngineRequestError:
    return EngineRequestError(f"Invalid value for '{param}': {message}", param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


def _int_field(body: dict[str, Any], param: str, low: int, high: int) -> None:
    value = body.get(param)
    if value is None:
        return
    if not _is_int(value) or not low <= value <= high:
        raise _bad(param, f"expected an integer in [{low}, {high}], got {_show(value)}")


def _number_field(body: dict[str, Any], param: str, low: float, high: float,
                  *, low_open: bool = False) -> None:
    value = body.get(param)
    if value is None:
        return
    if not _is_number(value) or value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise _bad(param, f"expected a number in {bracket}{low}, {high}], got {_show(value)}")


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_text(param: str, value: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad(param, "the string holds a lone surrogate (not valid Unicode)") from None


def _check_content(param: str, content: Any) -> None:
    if content is None or isinstance(content, str):
        if isinstance(content, str):
            _check_text(param, content)
        return
    if not isinstance(content, list):
        raise _bad(param, "content must be a string, a list of parts or null")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _bad(f"{param}[{j}]", "each content part must be an object with a type")
        if part["type"] == "text":
            if not isinstance(part.get("text"), str):
                raise _bad(f"{param}[{j}].text", "a text part needs a string text")
            _check_text(f"{param}[{j}].text", part["text"])


def _check_messages(body: dict[str, Any]) -> None:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise EngineRequestError("messages must be a non-empty list", param="messages")
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or "role" not in m:
            raise EngineRequestError(f"{where} must be an object with a role", param=where)
        if not isinstance(m["role"], str) or m["role"] not in CHAT_ROLES:  # [] is unhashable
            raise _bad(f"{where}.role", f"unknown role {_show(m['role'])}; expected one of "
                                        f"{sorted(CHAT_ROLES)}")
        _check_content(f"{where}.content", m.get("content"))
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise _bad(f"{where}.name", "expected a string")


def _check_tools(body: dict[str, Any]) -> None:
    tools = body.get("tools")
    names: list[str] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise _bad("tools", "expected a list of tools")
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise _bad(f"tools[{i}].function.name", "each tool needs a function with a name")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise _bad(f"tools[{i}].function.parameters", "expected a JSON schema object")
            names.append(fn["name"])
    choice = body.get("tool_choice")
    if choice is None or choice in ("none", "auto", "required"):
        if choice == "required" and not names:
            raise _bad("tool_choice", "'required' needs tools")
        return
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise _bad("tool_choice", "a named tool choice needs function.name")
        if name not in names:
            raise _bad("tool_choice", f"names tool {name!r}, which is not in tools {names}")
        return
    raise _bad("tool_choice", "expected 'none', 'auto', 'required' or a named function")


def _check_stop(body: dict[str, Any]) -> None:
    stop = body.get("stop")
    if stop is None or isinstance(stop, str):
        return
    if (not isinstance(stop, list) or len(stop) > MAX_STOP
            or not all(isinstance(s, str) for s in stop)):
        raise _bad("stop", f"expected a string or a list of at most {MAX_STOP} strings")


def _check_prompt(body: dict[str, Any], vocab_size: int | None) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", "the prompt is empty; send at least one character or token id")
        _check_text("prompt", prompt)
        return
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in prompt):
            raise _bad("prompt", f"token ids must be in [0, {vocab_size})")
        return
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        raise EngineRequestError("send one prompt per request (a string or token ids) so the call "
                                 "can be recorded exactly", param="prompt")
    raise _bad("prompt", "expected a string or a non-empty list of token ids")


def check_request(endpoint: str, body: dict[str, Any], *, max_model_len: int,
                  vocab_size: int | None = None) -> None:
    """Raise :class:`EngineRequestError` naming the first malformed field of ``body``."""
    if endpoint == "chat.completions":
        _check_messages(body)
        _check_tools(body)
        logprobs = body.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise _bad("logprobs", "expected a boolean")
        _int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    else:
        _check_prompt(body, vocab_size)
        _int_field(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    _int_field(body, "n", 1, MAX_N)
    _int_field(body, "max_tokens", 1, max_model_len)
    _int_field(body, "max_completion_tokens", 1, max_model_len)
    _int_field(body, "seed", -(2**63), 2**64 - 1)
    _number_field(body, "temperature", 0.0, 2.0)
    _number_field(body, "top_p", 0.0, 1.0, low_open=True)
    _number_field(body, "presence_penalty", -2.0, 2.0)
    _number_field(body, "frequency_penalty", -2.0, 2.0)
    _check_stop(body)
    for flag in ("stream", "return_token_ids"):
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise _bad(flag, "expected a boolean")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "expected an object")
    for key in ("response_format", "logit_bias", "metadata"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise _bad(key, "expected an object")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("user", "expected a string")
    if endpoint == "chat.completions":
        chars = sum(len(json.dumps(m.get("content"))) for m in body["messages"])
    else:
        chars = len(body["prompt"]) if isinstance(body["prompt"], str) else 0
    if chars > max_model_len * MAX_CHARS_PER_TOKEN:
        raise EngineRequestError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{chars} characters, more than that many tokens can hold",
            param="messages" if endpoint == "chat.completions" else "prompt",
            code="context_length_exceeded")


@dataclass(frozen=True)
class Attribution:
    """Who made a call: the rollout (path or header) and the caller's call tags."""

    rollout_id: str | None
    tags: dict[str, Any] | None = None


def attribution(path_rollout: str | None, headers: Mapping[str, str]) -> Attribution:
    """The rollout id (the path's, else the ``x-rollout-id`` header's) and the call tags of a
    request; a 4xx :class:`EngineRequestError` naming the one that is malformed."""
    rollout_id = path_rollout or headers.get(ROLLOUT_HEADER)
    if rollout_id is not None:
        try:
            validate_name("rollout id", rollout_id)
        except ConfigError as e:
            raise EngineRequestError(str(e), status=e.status, param="rollout_id",
                                     code=e.code) from None
    return Attribution(rollout_id, parse_tags(headers.get(TAGS_HEADER)))


def parse_tags(header: str | None) -> dict[str, Any] | None:
    """The ``x-tracerl-tags`` header: a small JSON object of scalar values."""
    if header is None:
        return None
    if len(header.encode()) > MAX_TAGS_BYTES:
        raise EngineRequestError(
            f"{TAGS_HEADER} is larger than {MAX_TAGS_BYTES} bytes", param=TAGS_HEADER
        )
    try:
        tags = strict_json.loads(header, TAGS_HEADER)
    except RequestError as e:
        raise EngineRequestError(str(e), param=TAGS_HEADER) from None
    except ValueError:
        raise EngineRequestError(
            f"{TAGS_HEADER} must be a JSON object", param=TAGS_HEADER
        ) from None
    if not isinstance(tags, dict) or not all(
        isinstance(k, str) and isinstance(v, str | int | float | bool | type(None))
        for k, v in tags.items()
    ):
        raise EngineRequestError(
            f"{TAGS_HEADER} must be a JSON object of scalar values", param=TAGS_HEADER
        )
    return tags
