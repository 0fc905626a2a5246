"""OpenAI Agents SDK adapter: a model provider on the gateway and a tracing processor.

- :class:`TracerlModelProvider` serves every agent of a run from a tracerl model through the
  chat completions API (``RunConfig(model_provider=TracerlModelProvider(model))``); each call
  is attributed to the current rollout and tagged with the SDK span it belongs to.
- :class:`TracerlTracingProcessor` records the run's spans (agents, turns, generations, function
  tools, handoffs, guardrails) into the rollout. :func:`install_tracing` makes it the SDK's
  processor; it replaces the default exporter, so traces are never uploaded anywhere unless
  you pass your own exporting processors along.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from agents import Model, ModelProvider, OpenAIChatCompletionsModel
from agents.tracing import TracingProcessor, get_current_span, set_trace_processors

from ..core.context import call_tags
from .span_recorder import SpanRecorder, short

_KINDS = {"agent": "agent", "function": "tool", "generation": "llm", "response": "llm",
          "handoff": "handoff", "guardrail": "guardrail", "task": "chain", "turn": "chain"}


class TracerlTracingProcessor(TracingProcessor):
    """Records Agents SDK traces and spans as tracerl spans of the running rollout."""

    def __init__(self) -> None:
        self.recorder = SpanRecorder("openai-agents")

    def on_trace_start(self, trace: Any) -> None:
        self.recorder.start(trace.trace_id, "chain", trace.name or "trace",
                            group_id=getattr(trace, "group_id", None))

    def on_trace_end(self, trace: Any) -> None:
        self.recorder.end(trace.trace_id)

    def on_span_start(self, span: Any) -> None:
        data = span.span_data
        kind = _KINDS.get(data.type, "custom")
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


def install_tracing(*extra_processors: TracingProcessor) -> TracerlTracingProcessor:
    """Make tracerl's processor (plus ``extra_processors``) the SDK's trace processors.

    This replaces the SDK's default exporter that uploads to OpenAI; pass that or any other
    exporting processor here to keep it.
    """
    processor = TracerlTracingProcessor()
    set_trace_processors([processor, *extra_processors])
    return processor


class _TaggedModel(Model):
    """Delegates to the chat completions model; tags each call with its SDK parent span."""

    def __init__(self, inner: Model) -> None:
        self.inner = inner

    def _tags(self) -> Any:
        span = get_current_span()
        return call_tags(parent_span_id=span.span_id if span is not None else None)

    async def get_response(self, *args: Any, **kwargs: Any) -> Any:
        with self._tags():
            return await self.inner.get_response(*args, **kwargs)

    async def stream_response(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        with self._tags():
            async for event in self.inner.stream_response(*args, **kwargs):
                yield event

    async def close(self) -> None:
        await self.inner.close()


class TracerlModelProvider(ModelProvider):
    """Serves agents from ``model``'s gateway (register the model first).

    ``Agent.model`` may be unset, the tracerl model's name, or ``NAME@STEP`` for a fixed
    checkpoint; other names go to ``fallback`` (e.g. the SDK's ``MultiProvider`` for a judge
    on a hosted API) or raise. With ``tracing`` (default) it calls :func:`install_tracing`.
    """

    def __init__(self, model: Any, *, fallback: ModelProvider | None = None,
                 tracing: bool = True) -> None:
        self.model = model
        self.fallback = fallback
        self.processor = install_tracing() if tracing else None

    def get_model(self, model_name: str | None) -> Model:
        served = self.model.get_inference_name()
        if model_name in (None, "", self.model.name, served) or (
                model_name and model_name.startswith(f"{self.model.name}@")):
            name = model_name if model_name and "@" in model_name else served
            # the client is made per event loop by the tracerl model
            return _TaggedModel(
                OpenAIChatCompletionsModel(model=name, openai_client=self.model.openai_client())
            )
        if self.fallback is not None:
            return self.fallback.get_model(model_name)
        raise ValueError(
            f"TracerlModelProvider serves {self.model.name!r}; agent model {model_name!r} "
            "is not it (pass fallback=MultiProvider() to route other names)"
        )
