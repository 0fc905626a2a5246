"""Weave logger plugin: each rollout a Weave call, each recorded LLM call a child call, the
reward as the rollout call's output and as feedback.

Enabled by ``TRACERL_LOGGERS`` containing ``weave``. The client is ``weave.init(project)`` with
the project from ``TRACERL_WEAVE_PROJECT`` (``entity/project`` or ``project``; default
``tracerl``), or one passed to :func:`configure`. Calls go out in Weave's background batches;
:func:`flush` waits for them. Weave's own settings (``WANDB_API_KEY``, ``WF_TRACE_SERVER_URL``...)
apply as usual.
"""

from __future__ import annotations

import datetime
import os
import threading
from typing import Any

from ..core.hookspecs import hookimpl
from . import logger_enabled

ROLLOUT_OP = "tracerl.rollout"
LLM_CALL_OP = "tracerl.llm_call"
REWARD_FEEDBACK = "reward"

_client: Any = None
_lock = threading.Lock()


def enabled() -> bool:
    return logger_enabled("weave")


def configure(client: Any = None) -> None:
    """Use ``client`` (a ``weave.trace.weave_client.WeaveClient``) instead of ``weave.init``;
    ``configure()`` forgets it. Feedback is sent through Weave's current client, so a configured
    client becomes the current one if there is none."""
    global _client
    with _lock:
        _client = client
    if client is not None:
        from weave.trace.context.weave_client_context import set_weave_client_global

        set_weave_client_global(client)


def client() -> Any:
    global _client
    with _lock:
        if _client is None:
            import weave

            _client = weave.init(os.environ.get("TRACERL_WEAVE_PROJECT", "tracerl"))
        return _client


def _time(ts: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC)


def _llm_output(call: Any) -> dict[str, Any]:
    """The engine's answer as the caller saw it, with OpenAI-style usage (Weave sums it up)."""
    prompt_tokens = len(call.prompt_token_ids)
    completion_tokens = sum(len(c.token_ids) for c in call.completions)
    return {
        "model": call.model,
        "choices": [{"index": c.index, "text": c.text, "tool_calls": c.tool_calls,
                     "finish_reason": c.finish_reason} for c in call.completions],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


@hookimpl
def tracerl_on_trajectory_end(trajectory: Any) -> None:
    if not enabled():
        return
    wc = client()
    calls = sorted(trajectory.llm_calls, key=lambda c: c.created_at)
    messages = trajectory.messages()
    steps = [c.adapter_step for c in calls if c.adapter_step is not None]
    rollout = wc.create_call(
        ROLLOUT_OP,
        {"messages": messages[:-1], "tools": trajectory.tools, "metadata": trajectory.metadata},
        attributes={"rollout_id": trajectory.rollout_id, "adapter_step": max(steps, default=None)},
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


def flush() -> None:
    """Wait until Weave has sent everything queued."""
    if _client is not None:
        _client.flush()
