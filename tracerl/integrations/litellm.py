"""LiteLLM adapter (SDK mode): route ``litellm.acompletion`` to the gateway, record spans.

    import litellm
    from tracerl.integrations.litellm import TracerlLiteLLMLogger, completion_kwargs

    litellm.callbacks.append(TracerlLiteLLMLogger())
    response = await litellm.acompletion(messages=msgs, **completion_kwargs(model))

:func:`completion_kwargs` is read inside the rollout, so the request carries its rollout id
(and any ``call_tags``); the gateway keeps the token-exact record, the logger adds a span with
LiteLLM's call id and timing. For agents in other languages see ``tracerl proxy``
(:mod:`tracerl.integrations.litellm_proxy`).
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from typing import Any

from litellm.integrations.custom_logger import CustomLogger

from ..core.context import TAGS_HEADER, current_call_tags, current_rollout
from .span_recorder import SpanRecorder

SPAN_KEY = "tracerl_span_id"


def _span_id(kwargs: dict[str, Any]) -> str:
    metadata = (kwargs.get("litellm_params") or {}).get("metadata") or kwargs.get("metadata") or {}
    return metadata.get(SPAN_KEY) or kwargs.get("litellm_call_id") or "litellm-" + uuid.uuid4().hex


def completion_kwargs(model: Any, /, **extra: Any) -> dict[str, Any]:
    """Keyword arguments for ``litellm.(a)completion`` that reach ``model``'s gateway and
    attribute the call to the current rollout."""
    params = model.litellm_completion_params()  # gateway, key, rollout headers, no retries
    params.pop("temperature")  # ART's params sample at 1; here sampling is the caller's choice
    headers = {**params.pop("extra_headers", {}), **(extra.pop("extra_headers", None) or {})}
    # the span id travels both to the gateway (call tag) and to the logger (metadata), so the
    # record and the span pair up exactly
    span_id = "litellm-" + uuid.uuid4().hex
    headers[TAGS_HEADER] = json.dumps({**current_call_tags(), "span_id": span_id},
                                      separators=(",", ":"))
    metadata = {**(extra.pop("metadata", None) or {}), SPAN_KEY: span_id}
    return {**params, "extra_headers": headers, "metadata": metadata, **extra}


class TracerlLiteLLMLogger(CustomLogger):
    """Records each LiteLLM call as an ``llm`` span of the rollout it ran in.

    The span opens in ``log_pre_api_call`` (synchronously, inside the rollout), so it is part
    of the trajectory even though LiteLLM reports success from a background task. Calls made
    outside rollouts open no span at all.
    """

    def __init__(self) -> None:
        super().__init__()
        self.recorder = SpanRecorder("litellm")
        self._ended: OrderedDict[str, None] = OrderedDict()  # LiteLLM may report a call twice

    def log_pre_api_call(self, model, messages, kwargs):
        span_id = _span_id(kwargs)
        if span_id in self._ended or self.recorder.get(span_id) is not None:
            return  # LiteLLM calls this again on some error paths
        if current_rollout() is None:
            return  # not a rollout's call: nothing to record it in
        self.recorder.start(
            span_id, "llm", model or "litellm", litellm_call_id=kwargs.get("litellm_call_id")
        )

    def _record(self, kwargs: dict[str, Any], response_obj: Any, start_time: Any, end_time: Any,
                error: Any = None) -> None:
        span_id = _span_id(kwargs)
        if span_id in self._ended:
            return
        if self.recorder.get(span_id) is None:  # no pre-call event (e.g. a cache hit)
            if current_rollout() is None:
                return
            self.recorder.start(span_id, "llm", kwargs.get("model") or "litellm")
        span = self.recorder.end(span_id, error=error, stream=bool(kwargs.get("stream")) or None)
        self._ended[span_id] = None
        if len(self._ended) > 10_000:
            self._ended.popitem(last=False)
        if span is None:
            return
        if hasattr(end_time, "timestamp"):
            span.end_time = end_time.timestamp()
        if response_obj is not None:
            span.response_id = getattr(response_obj, "id", None)

    def log_success_event(self, kwargs, response_obj, start_time, end_time):
        self._record(kwargs, response_obj, start_time, end_time)

    async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):
        self._record(kwargs, response_obj, start_time, end_time)

    def log_failure_event(self, kwargs, response_obj, start_time, end_time):
        self._record(
            kwargs, None, start_time, end_time, error=str(kwargs.get("exception") or "failed")
        )

    async def async_log_failure_event(self, kwargs, response_obj, start_time, end_time):
        self._record(
            kwargs, None, start_time, end_time, error=str(kwargs.get("exception") or "failed")
        )
