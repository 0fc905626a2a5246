"""Langfuse logger plugin: each rollout a trace, each LLM call a generation, the reward a score.

Registered when ``TRACERL_LOGGERS`` names ``langfuse``; the client then reads Langfuse's own
environment (``LANGFUSE_PUBLIC_KEY``, ``LANGFUSE_SECRET_KEY``, ``LANGFUSE_BASE_URL``). To pass
arguments instead (a ``span_exporter`` in tests), register an instance yourself:
``tracerl.events.plugins.register(LangfuseLogger(span_exporter=...), name="langfuse_logger")``.
Spans go out over OTLP; call :meth:`LangfuseLogger.flush` before the process ends.
"""

from __future__ import annotations

import threading
from typing import Any

from ..core.trajectory import Trajectory
from ..events.hookspecs import hookimpl


class LangfuseLogger:
    """Sends rollouts to Langfuse through one client, made on first use."""

    def __init__(self, **options: Any) -> None:
        self.options = options  # arguments of ``langfuse.Langfuse``
        self._client: Any = None
        self._lock = threading.Lock()

    def client(self) -> Any:
        """The ``langfuse.Langfuse`` client."""
        with self._lock:
            if self._client is None:
                from langfuse import Langfuse

                self._client = Langfuse(**self.options)
            return self._client

    @hookimpl
    def tracerl_on_trajectory_end(self, trajectory: Trajectory) -> None:
        lf = self.client()
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
                                       "output": call.completion_tokens})
            lf.score_current_trace(name="reward", value=trajectory.reward)

    def flush(self) -> None:
        """Send everything queued."""
        if self._client is not None:
            self._client.flush()
