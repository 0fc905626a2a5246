"""integrations: framework adapters (they add structure to rollouts) and logger plugins.

Framework adapters, used from the user's process:
- ``langchain.py``: LangGraph / LangChain: ``init_chat_model``, the callback handler that
  records runs as spans, ``wrap_rollout`` and ``graph_rollout``.
- ``openai_agents.py``: the OpenAI Agents SDK: a model provider on the gateway, its traces as
  spans.
- ``litellm.py``: LiteLLM in SDK mode: ``completion_kwargs`` and a span-recording logger.
- ``litellm_proxy.py``: ``tracerl proxy``: a LiteLLM proxy process in front of the gateway.
- ``span_recorder.py``: what every adapter does with spans (open, close, fail).

Logger plugins, registered only when enabled (``TRACERL_LOGGERS``; the console one unless
``TRACERL_QUIET=1``):
- ``console_logger.py``: one line per logged step on stderr.
- ``wandb_logger.py``: W&B curves and trajectory tables.
- ``langfuse_logger.py``: a Langfuse trace per rollout, a generation per call.
- ``weave_logger.py``: a Weave call per rollout, a child call per LLM call.
"""
