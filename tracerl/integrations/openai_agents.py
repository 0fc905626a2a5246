"""OpenAI Agents SDK adapter: a model provider on the gateway and a tracing processor.

- :class:`TracerlModelProvider` serves every agent of a run from a tracerl model through the
  chat completions API (``RunConfig(model_provider=TracerlModelProvider(model))``), or the
  Responses API, the SDK's default (``use_responses=True``); each call is attributed to the
  current rollout and tagged with the SDK span it belongs to.
- :class:`TracerlTracingProcessor` records the run's spans (agents, turns, generations, function
  tools, handoffs, guardrails) into the rollout. :func:`install_tracing` makes it the SDK's
  processor; it replaces the default exporter, so traces are never uploaded anywhere unless
  you pass your own exporting processors along. One processor serves the whole process, so
  providers made per rollout still close every span they opened.
- An agent that holds its own ``Model`` instance bypasses the provider (its calls go to that
  client's base URL, api.openai.com by default, unrecorded): the processor warns about each
  such call made inside a rollout and counts them in ``bypassed_calls``.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from agents import Model, ModelProvider, OpenAIChatCompletionsModel, OpenAIResponsesModel
from agents.tracing import (
    TracingProcessor,
    get_current_span,
    get_trace_provider,
    set_trace_processors,
)
from agents.tracing.processors import default_processor

from ..core.context import call_tags, current_rollout
from ..core.model_name import ModelName
from ..core.spans import SpanKind
from .span_recorder import SpanRecorder, short

_KINDS: dict[str, SpanKind] = {
    "agent": "agent", "function": "tool", "generation": "llm", "response": "llm",
    "handoff": "handoff", "guardrail": "guardrail", "task": "chain", "turn": "chain"}
log = logging.getLogger(__name__)
# set while a model served by TracerlModelProvider runs: its generation spans are ours
_via_provider: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "tracerl_agents_via_provider", default=False)
BYPASS_FIX = ("give the Agent a model name (or none) instead of a Model instance, and run it "
              "with RunConfig(model_provider=TracerlModelProvider(model))")


class TracerlTracingProcessor(TracingProcessor):
    """Records Agents SDK traces and spans as tracerl spans of the running rollout."""

    def __init__(self) -> None:
        self.recorder = SpanRecorder("openai-agents")
        self.bypassed_calls = 0

    def on_trace_start(self, trace: Any) -> None:
        _stop_upload(self)
        self.recorder.start(trace.trace_id, "chain", trace.name or "trace",
                            group_id=getattr(trace, "group_id", None))

    def on_trace_end(self, trace: Any) -> None:
        self.recorder.end(trace.trace_id)

    def on_span_start(self, span: Any) -> None:
        data = span.span_data
        kind = _KINDS.get(data.type, "custom")
        if kind == "llm" and not _via_provider.get() and (rollout := current_rollout()):
            self.bypassed_calls += 1
            log.warning("an Agents SDK model call in rollout %s bypassed TracerlModelProvider "
                        "(the agent holds its own Model instance): it goes to that model's own "
                        "client (api.openai.com by default) and is not recorded for training; "
                        "fix: %s", rollout.rollout_id, BYPASS_FIX)
        name = getattr(data, "name", None) or data.type  # handoffs are named when they end
        self.recorder.start(span.span_id, kind, name, span.parent_id or span.trace_id,
                            span_type=data.type)

    def on_span_end(self, span: Any) -> None:
        data = span.span_data
        attrs: dict[str, Any] = {}
        if data.type == "function":
            attrs = {"input": short(data.input), "output": short(data.output)}
        elif data.type == "agent":
            attrs = {
                "tools": data.tools,
                "handoffs": data.handoffs,
                "output_type": data.output_type,
            }
        elif data.type == "generation":
            attrs = {"model": data.model, "usage": data.usage}
        elif data.type == "handoff":
            attrs = {"from_agent": data.from_agent, "to_agent": data.to_agent}
            if (open_span := self.recorder.get(span.span_id)) is not None:
                open_span.name = f"{data.from_agent} -> {data.to_agent}"
        elif data.type == "guardrail":
            attrs = {"triggered": data.triggered}
        error = span.error
        message = f"{error.get('message')}: {error.get('data')}" if error else None
        self.recorder.end(span.span_id, error=message, **attrs)

    def shutdown(self) -> None:
        pass

    def force_flush(self) -> None:
        pass


_processor: TracerlTracingProcessor | None = None
_processor_lock = threading.Lock()


def _stop_upload(processor: TracerlTracingProcessor) -> None:
    """When tracerl's processor was added beside the SDK's default one (``add_trace_processor``),
    drop the default one, which uploads traces to OpenAI."""
    multi = getattr(get_trace_provider(), "_multi_processor", None)  # the SDK's default provider
    processors = list(getattr(multi, "_processors", ()))
    if default_processor() in processors and processor in processors:
        log.info("tracerl's trace processor is in use: the SDK's upload to OpenAI is turned off "
                 "(pass the exporter to install_tracing() to keep it)")
        set_trace_processors([p for p in processors if p is not default_processor()])


def install_tracing(*extra_processors: TracingProcessor) -> TracerlTracingProcessor:
    """Make tracerl's processor (plus ``extra_processors``) the SDK's trace processors.

    This replaces the SDK's default exporter that uploads to OpenAI; pass that or any other
    exporting processor here to keep it. The processor is one per process: installing again
    (a provider made per rollout) keeps it, so spans opened before are still closed.
    """
    global _processor
    with _processor_lock:
        if _processor is None:
            _processor = TracerlTracingProcessor()
        set_trace_processors([_processor, *extra_processors])
        return _processor


class _TaggedModel(Model):
    """Delegates to the chat completions model; tags each call with its SDK parent span."""

    def __init__(self, inner: Model) -> None:
        self.inner = inner

    def _tags(self) -> Any:
        span = get_current_span()
        return call_tags(parent_span_id=span.span_id if span is not None else None)

    async def get_response(self, *args: Any, **kwargs: Any) -> Any:
        token = _via_provider.set(True)
        try:
            with self._tags():
                return await self.inner.get_response(*args, **kwargs)
        finally:
            _via_provider.reset(token)

    async def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        token = _via_provider.set(True)
        try:
            with self._tags():
                async for event in self.inner.stream_response(*args, **kwargs):
                    yield event
        finally:
            _via_provider.reset(token)

    async def close(self) -> None:
        await self.inner.close()


class TracerlModelProvider(ModelProvider):
    """Serves agents from ``model``'s gateway (register the model first).

    ``Agent.model`` may be unset, the tracerl model's name (bare or ``project/name``), or
    either with ``@STEP`` for a fixed checkpoint, each sent as ``project/name[@STEP]``; other
    names go to ``fallback`` (e.g. the SDK's ``MultiProvider`` for a judge on a hosted API) or
    raise. With ``tracing`` (default) it calls :func:`install_tracing`.
    ``use_responses`` speaks the Responses API (the SDK's default) instead of chat completions;
    the gateway records either token-exactly.
    """

    def __init__(self, model: Any, *, fallback: ModelProvider | None = None,
                 tracing: bool = True, use_responses: bool = False) -> None:
        self.model = model
        self.fallback = fallback
        self.use_responses = use_responses
        self.processor = install_tracing() if tracing else None

    def get_model(self, model_name: str | None) -> Model:
        name = self._served_name(model_name)
        if name is not None:
            # the client is made per event loop by the tracerl model
            api = OpenAIResponsesModel if self.use_responses else OpenAIChatCompletionsModel
            return _TaggedModel(api(model=name, openai_client=self.model.openai_client()))
        if self.fallback is not None:
            return self.fallback.get_model(model_name)
        raise ValueError(
            f"TracerlModelProvider serves {self.model.name!r}; agent model {model_name!r} "
            "is not it (pass fallback=MultiProvider() to route other names)"
        )

    def _served_name(self, model_name: str | None) -> str | None:
        """The gateway's unambiguous name for ``model_name`` when it names this model (unset,
        ``name`` or ``project/name``, either with ``@STEP``); None when it names another."""
        served = self.model.get_inference_name()
        if not model_name:
            return served
        asked = ModelName.parse(model_name)
        if asked.base not in (self.model.name, served):
            return None
        if not asked.pinned:
            return served
        return model_name if asked.step is None else self.model.get_inference_name(asked.step)
