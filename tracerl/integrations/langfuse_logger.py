"""Langfuse logger plugin: each rollout a trace, each LLM call a generation, the reward a score.

Enabled by ``TRACERL_LOGGERS`` containing ``langfuse``; the client reads Langfuse's own
environment (``LANGFUSE_PUBLIC_KEY``, ``LANGFUSE_SECRET_KEY``, ``LANGFUSE_BASE_URL``) or takes
arguments through :func:`configure` (e.g. a ``span_exporter`` for tests). Spans go out over
OTLP; call :func:`flush` before the process ends.
"""

from __future__ import annotations

import threading
from typing import Any

from ..core.hookspecs import hookimpl
from . import logger_enabled

_client: Any = None
_options: dict[str, Any] = {}
_lock = threading.Lock()


def enabled() -> bool:
    return logger_enabled("langfuse")


def configure(**options: Any) -> None:
    """Arguments for the ``langfuse.Langfuse`` client (takes effect on the next use)."""
    global _client
    with _lock:
        _options.clear()
        _options.update(options)
        _client = None


def client() -> Any:
    global _client
    with _lock:
        if _client is None:
            from langfuse import Langfuse

            _client = Langfuse(**_options)
        return _client


@hookimpl
def tracerl_on_trajectory_end(trajectory: Any) -> None:
    if not enabled():
        return
    lf = client()
    messages = trajectory.messages()
    with lf.start_as_current_observation(
        as_type="span", name="rollout", input=messages[:-1], output=messages[-1:] or None,
        metadata={"rollout_id": trajectory.rollout_id, "reward": trajectory.reward,
                  **{f"metric_{k}": v for k, v in trajectory.metrics.items()}},
    ):
        for call in trajectory.llm_calls:
            with lf.start_as_current_observation(
                as_type="generation", name=call.endpoint, model=call.model,
                input=call.request.get("messages", call.request.get("prompt")),
                model_parameters={"temperature": call.temperature},
                metadata={"call_id": call.id, "adapter_step": call.adapter_step,
                          "latency_s": call.latency_s, "streamed": call.streamed},
            ) as generation:
                generation.update(
                    output=[c.text for c in call.completions],
                    usage_details={"input": len(call.prompt_token_ids),
                                   "output": sum(len(c.token_ids) for c in call.completions)})
        lf.score_current_trace(name="reward", value=trajectory.reward)


def flush() -> None:
    if _client is not None:
        _client.flush()
