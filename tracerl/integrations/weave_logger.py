"""Weave logger plugin: each rollout a Weave call, each recorded LLM call a child call, the
reward as the rollout call's output and as feedback.

Registered when ``TRACERL_LOGGERS`` names ``weave``: the client is then ``weave.init(project)``
with the project from ``TRACERL_WEAVE_PROJECT`` (``entity/project`` or ``project``; default
``tracerl``). To use a client of your own, register ``WeaveLogger(client)`` with
``tracerl.events.plugins.register``. Calls go out in Weave's background batches;
:meth:`WeaveLogger.flush` waits for them. Weave's own settings (``WANDB_API_KEY``,
``WF_TRACE_SERVER_URL``...) apply as usual.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

from ..core import settings
from ..core.trajectory import Trajectory
from ..events.hookspecs import hookimpl

ROLLOUT_OP = "tracerl.rollout"
LLM_CALL_OP = "tracerl.llm_call"
REWARD_FEEDBACK = "reward"


def _time(ts: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC)


def _llm_output(call: Any) -> dict[str, Any]:
    """The engine's answer as the caller saw it, with OpenAI-style usage (Weave sums it up)."""
    prompt_tokens, completion_tokens = len(call.prompt_token_ids), call.completion_tokens
    return {
        "model": call.model,
        "choices": [{"index": c.index, "text": c.text, "tool_calls": c.tool_calls,
                     "finish_reason": c.finish_reason} for c in call.completions],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


class WeaveLogger:
    """Sends rollouts to Weave through one client: the one given, else ``weave.init(project)``
    on first use (project from ``TRACERL_WEAVE_PROJECT``, default ``tracerl``)."""

    def __init__(self, client: Any = None) -> None:
        self._client = client
        self._lock = threading.Lock()
        if client is not None:  # feedback goes through Weave's current client
            from weave.trace.context.weave_client_context import set_weave_client_global

            set_weave_client_global(client)

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                import weave

                self._client = weave.init(settings.TRACERL_WEAVE_PROJECT.get())
            return self._client

    @hookimpl
    def tracerl_on_trajectory_end(self, trajectory: Trajectory) -> None:
        wc = self.client()
        calls = sorted(trajectory.llm_calls, key=lambda c: c.created_at)
        messages = trajectory.messages()
        steps = [c.adapter_step for c in calls if c.adapter_step is not None]
        rollout = wc.create_call(
            ROLLOUT_OP,
            {"messages": messages[:-1], "tools": trajectory.tools, "metadata": trajectory.metadata},
            attributes={
                "rollout_id": trajectory.rollout_id,
                "adapter_step": max(steps, default=None),
            },
            use_stack=False,
            started_at=_time(calls[0].created_at - calls[0].latency_s) if calls else None,
        )
        for call in calls:
            child = wc.create_call(
                LLM_CALL_OP,
                {"model": call.model, "temperature": call.temperature,
                 "messages": call.request.get("messages"), "prompt": call.request.get("prompt"),
                 "tools": call.request.get("tools")},
                parent=rollout, use_stack=False, display_name=call.endpoint,
                attributes={"call_id": call.id, "adapter_step": call.adapter_step,
                            "latency_s": call.latency_s, "streamed": call.streamed,
                            "span_path": call.metadata.get("span_path")},
                started_at=_time(call.created_at - call.latency_s),
            )
            wc.finish_call(child, _llm_output(call),
                           exception=RuntimeError(call.error) if call.error else None,
                           ended_at=_time(call.created_at))
        wc.finish_call(rollout, {"final": messages[-1:], "reward": trajectory.reward,
                                 "metrics": trajectory.metrics})
        rollout.feedback.add(REWARD_FEEDBACK, {"value": trajectory.reward})

    def flush(self) -> None:
        """Wait until Weave has sent everything queued."""
        if self._client is not None:
            self._client.flush()
