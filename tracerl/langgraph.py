"""ART's ``art.langgraph``: ``from art.langgraph import init_chat_model, wrap_rollout`` becomes
``from tracerl.langgraph import init_chat_model, wrap_rollout`` (needs the langgraph extra)."""

from .integrations.langchain import init_chat_model, wrap_rollout

__all__ = ["init_chat_model", "wrap_rollout"]
