"""ART's ``art.langgraph``: ``from art.langgraph import init_chat_model, wrap_rollout`` becomes
``from tracerl.langgraph import init_chat_model, wrap_rollout`` (needs the langgraph extra).
A module-level ``init_chat_model("openai:...")`` binds to the rollout's model when called."""

from .integrations.langchain import graph_rollout, init_chat_model, wrap_rollout

__all__ = ["graph_rollout", "init_chat_model", "wrap_rollout"]
