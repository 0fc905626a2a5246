"""LangChain / LangGraph adapter: record run structure into rollouts, serve the chat model.

- :func:`init_chat_model` gives a ``ChatOpenAI`` on the model's gateway endpoint; every call is
  attributed to the rollout that makes it (token records come from the gateway, since
  LangChain drops vLLM's token ids).
- :class:`TracerlCallbackHandler` records chains, LangGraph nodes, chat-model and tool runs as
  spans. :func:`install` (called by :func:`init_chat_model`, :func:`wrap_rollout` and
  :func:`graph_rollout`) puts it, through LangChain's ``register_configure_hook``, into every
  run that happens inside a tracerl rollout; runs outside rollouts are untouched. It can also
  be passed explicitly: ``config={"callbacks": [TracerlCallbackHandler()]}``.
- :func:`wrap_rollout` (ART-style) and :func:`graph_rollout` (an existing compiled graph plus
  a reward function) turn agent code into rollouts that return trajectories.
- ``init_chat_model("openai:...")`` at module level (no tracerl model yet) gives a
  :class:`LazyChatModel` that binds to the rollout's model when it is called, so agent code
  written for LangChain's own ``init_chat_model`` works with only the import changed.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
from collections.abc import Awaitable, Callable
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import BaseMessage, convert_to_openai_messages
from langchain_core.tracers.context import register_configure_hook
from pydantic import Field, PrivateAttr

from ..core.context import RolloutContext, current_rollout
from ..core.spans import SpanKind
from ..core.trajectory import Trajectory
from ..events.hookspecs import hookimpl
from ..events.plugins import get_plugin_manager
from ..events.plugins import register as register_plugin
from ..rollout.client import async_http_client, sync_http_client
from ..rollout.gather import run_as_rollout
from .span_recorder import SpanRecorder, short

HIDDEN_TAG = "langsmith:hidden"


class TracerlCallbackHandler(BaseCallbackHandler):
    """Records LangChain runs as tracerl spans, keyed by run id."""

    run_inline = True  # called in the run's own context, so the rollout is the right one
    raise_error = False

    def __init__(self, rollout: RolloutContext | None = None) -> None:
        self.recorder = SpanRecorder("langchain", rollout)

    @property
    def orphans(self) -> list[Any]:
        """Spans of runs that happened outside any rollout."""
        return self.recorder.orphans

    def _parent(self, parent_run_id: UUID | None) -> str | None:
        return str(parent_run_id) if parent_run_id is not None else None

    # chains and LangGraph nodes
    def on_chain_start(self, serialized: dict[str, Any] | None, inputs: Any, *, run_id: UUID,
                       parent_run_id: UUID | None = None, tags: list[str] | None = None,
                       metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if tags and HIDDEN_TAG in tags:
            return
        metadata = metadata or {}
        name = kwargs.get("name") or _serialized_name(serialized) or "chain"
        node = metadata.get("langgraph_node")
        kind: SpanKind = "node" if node is not None and name == node else "chain"
        self.recorder.start(str(run_id), kind, name, self._parent(parent_run_id),
                            langgraph_step=metadata.get("langgraph_step"), node=node)

    def on_chain_end(self, outputs: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self.recorder.end(str(run_id))

    def on_chain_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self.recorder.end(str(run_id), error=error)

    # chat models and LLMs
    def on_chat_model_start(
        self,
        serialized: dict[str, Any] | None,
        messages: list[list[BaseMessage]],
        *,
        run_id: UUID,
        parent_run_id: UUID | None = None,
        tags: list[str] | None = None,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        params = kwargs.get("invocation_params") or {}
        tools = [
            t.get("function", t).get("name")
            for t in params.get("tools") or []
            if isinstance(t, dict)
        ]
        self.recorder.start(
            str(run_id),
            "llm",
            kwargs.get("name") or _serialized_name(serialized) or "chat_model",
            self._parent(parent_run_id),
            model=params.get("model") or params.get("model_name"),
            node=(metadata or {}).get("langgraph_node"),
            messages=sum(len(m) for m in messages),
            tools=tools or None,
        )

    def on_llm_start(self, serialized: dict[str, Any] | None, prompts: list[str], *, run_id: UUID,
                     parent_run_id: UUID | None = None, metadata: dict[str, Any] | None = None,
                     **kwargs: Any) -> None:
        self.recorder.start(
            str(run_id),
            "llm",
            kwargs.get("name") or _serialized_name(serialized) or "llm",
            self._parent(parent_run_id),
            node=(metadata or {}).get("langgraph_node"),
        )

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        span = self.recorder.end(str(run_id))
        if span is None:
            return
        generations = [g for gs in response.generations for g in gs]
        message = getattr(generations[0], "message", None) if generations else None
        if message is None:
            return
        meta = getattr(message, "response_metadata", {}) or {}
        span.response_id = meta.get("id")
        calls = [c["name"] for c in getattr(message, "tool_calls", []) or []]
        span.attributes = {**span.attributes, "finish_reason": meta.get("finish_reason"),
                           **({"tool_calls": calls} if calls else {})}

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self.recorder.end(str(run_id), error=error)

    # tools
    def on_tool_start(self, serialized: dict[str, Any] | None, input_str: str, *, run_id: UUID,
                      parent_run_id: UUID | None = None, metadata: dict[str, Any] | None = None,
                      inputs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.recorder.start(
            str(run_id),
            "tool",
            kwargs.get("name") or _serialized_name(serialized) or "tool",
            self._parent(parent_run_id),
            input=short(inputs if inputs is not None else input_str),
            tool_call_id=kwargs.get("tool_call_id"),
            node=(metadata or {}).get("langgraph_node"),
        )

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self.recorder.end(str(run_id), output=short(getattr(output, "content", output)))

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self.recorder.end(str(run_id), error=error)


def _serialized_name(serialized: dict[str, Any] | None) -> str | None:
    if not serialized:
        return None
    return serialized.get("name") or (serialized.get("id") or [None])[-1]


# --- automatic installation inside rollouts -------------------------------------------------

_handler: contextvars.ContextVar[TracerlCallbackHandler | None] = contextvars.ContextVar(
    "tracerl_langchain_handler", default=None)
PLUGIN_NAME = "langchain"
_install_lock = threading.Lock()
_hook_registered = False


class _RolloutHandlers:
    """The plugin that gives every rollout its own callback handler."""

    @hookimpl
    def tracerl_rollout_started(self, rollout: RolloutContext) -> Callable[[], None]:
        token = _handler.set(TracerlCallbackHandler(rollout))
        return lambda: _handler.reset(token)


def install() -> None:
    """Record LangChain runs inside rollouts from now on (idempotent): LangChain's configure
    hook reads the handler that the ``tracerl_rollout_started`` plugin sets per rollout. Called
    inside a rollout that started before the plugin existed (a chat model made in the first
    rollout), it gives that rollout its handler too."""
    global _hook_registered
    with _install_lock:
        if not _hook_registered:
            register_configure_hook(_handler, inheritable=True,
                                    handle_class=TracerlCallbackHandler)
            _hook_registered = True
        if get_plugin_manager().get_plugin(PLUGIN_NAME) is not None:
            return
        register_plugin(_RolloutHandlers(), name=PLUGIN_NAME)
        rollout = current_rollout()
        if rollout is not None and _handler.get() is None:
            _handler.set(TracerlCallbackHandler(rollout))


# --- chat model and rollouts ------------------------------------------------------------------

_WRAPPED_MODEL: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "tracerl_wrapped_model", default=None
)


def _chat_openai(model: Any, step: int | None = None, **kwargs: Any) -> Any:
    from langchain_openai import ChatOpenAI

    base_url, api_key = model.endpoint()
    kwargs.setdefault("max_retries", 0)  # a retry would record the call twice
    return ChatOpenAI(
        model=model.get_inference_name(step),
        base_url=base_url,
        api_key=api_key,
        http_client=sync_http_client(model),
        http_async_client=async_http_client(model),
        **kwargs,
    )


def init_chat_model(model: Any = None, **kwargs: Any) -> Any:
    """A ``langchain_openai.ChatOpenAI`` served by ``model``'s backend (register it first).

    Calls are attributed to the current rollout when they are sent, so one chat model (and
    one compiled graph using it) can serve any number of concurrent rollouts. Extra keyword
    arguments go to ``ChatOpenAI`` (temperature, max_tokens, ...); ``step=N`` pins the served
    version (``model.get_inference_name(N)``; 0 is the base model). As in ART, inside
    :func:`wrap_rollout` ``model`` may be left out or be a name: the wrapped model serves it.
    Outside one (a module-level ``init_chat_model("openai:gpt-4o")``) it returns a
    :class:`LazyChatModel`, which binds to the rollout's model at each call.
    """
    install()
    if model is None or isinstance(model, str):
        wrapped = _WRAPPED_MODEL.get()
        if wrapped is None:
            kwargs.pop("model_provider", None)  # LangChain's init_chat_model argument
            return LazyChatModel(requested=model, chat_kwargs=kwargs)
        model = wrapped
    return _chat_openai(model, **kwargs)


class LazyChatModel(BaseChatModel):
    """A chat model made before any tracerl model exists; each call is served by the model of
    the rollout that makes it (``wrap_rollout(model, ...)`` or ``graph_rollout(...,
    model=model)``). ``bind_tools`` and ``with_structured_output`` work as on ``ChatOpenAI``."""

    requested: str | None = None
    chat_kwargs: dict[str, Any] = Field(default_factory=dict)
    _bound: dict[tuple[int, int], Any] = PrivateAttr(default_factory=dict)

    @property
    def _llm_type(self) -> str:
        return "tracerl-lazy"

    def _served(self) -> Any:
        model = _WRAPPED_MODEL.get()
        if model is None:
            raise RuntimeError(
                f"init_chat_model({self.requested!r}) was made outside a rollout and is called "
                "outside one too: call it inside wrap_rollout(model, fn) or "
                "graph_rollout(graph, reward, model=model), which say which model serves it")
        try:
            loop = id(asyncio.get_running_loop())  # async http clients belong to one loop
        except RuntimeError:
            loop = 0
        key = (id(model), loop)
        if key not in self._bound:
            self._bound[key] = _chat_openai(model, **self.chat_kwargs)
        return self._bound[key]

    def bind_tools(self, tools: Any, **kwargs: Any) -> Any:
        from langchain_openai import ChatOpenAI

        # ChatOpenAI formats tools and tool_choice; the call itself is bound later
        shaped = ChatOpenAI(model="unbound", api_key="unbound").bind_tools(tools, **kwargs)
        return self.bind(**shaped.kwargs)  # type: ignore[attr-defined]  # a RunnableBinding

    def _generate(self, messages: Any, stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> Any:
        return self._served()._generate(messages, stop=stop, run_manager=run_manager, **kwargs)

    async def _agenerate(self, messages: Any, stop: Any = None, run_manager: Any = None,
                         **kwargs: Any) -> Any:
        return await self._served()._agenerate(messages, stop=stop, run_manager=run_manager,
                                               **kwargs)

    def _stream(self, messages: Any, stop: Any = None, run_manager: Any = None,
                **kwargs: Any) -> Any:
        yield from self._served()._stream(messages, stop=stop, run_manager=run_manager, **kwargs)

    async def _astream(self, messages: Any, stop: Any = None, run_manager: Any = None,
                       **kwargs: Any) -> Any:
        async for chunk in self._served()._astream(messages, stop=stop, run_manager=run_manager,
                                                   **kwargs):
            yield chunk


RewardFn = Callable[..., float | tuple[float, dict[str, float]] | Awaitable[Any]]


def wrap_rollout(
    model: Any, fn: Callable[..., Awaitable[Any]]
) -> Callable[..., Awaitable[Trajectory]]:
    """Turn ``async fn(*args, **kwargs)`` running LangChain/LangGraph code into a rollout.

    ``fn`` returns a :class:`Trajectory`, or a reward (a number, or ``(reward, metrics)``), in
    which case the trajectory is the conversation of the rollout's last recorded LLM call.
    Works inside ``gather_trajectory_groups`` and on its own.
    """
    install()

    async def rollout(*args: Any, **kwargs: Any) -> Trajectory:
        async def run() -> Trajectory:
            token = _WRAPPED_MODEL.set(model)  # init_chat_model() inside fn serves this model
            try:
                result = await fn(*args, **kwargs)
            finally:
                _WRAPPED_MODEL.reset(token)
            if isinstance(result, Trajectory):
                return result
            reward, metrics = _split_reward(result)
            return Trajectory(messages_and_choices=[], reward=reward, metrics=metrics,
                              metadata={"framework": "langchain"})
        return await run_as_rollout(run)

    rollout.__name__ = getattr(fn, "__name__", "rollout")
    return rollout


GraphConfig = dict[str, Any] | Callable[[Any], dict[str, Any]]


def rollout_config(graph: Any, config: GraphConfig | None, graph_input: Any) -> dict[str, Any]:
    """The config of one rollout's graph run: ``config`` (or ``config(graph_input)``), with
    ``configurable.thread_id`` set to the rollout id when the graph has a checkpointer and the
    config names no thread, so concurrent rollouts never share a conversation."""
    made = config(graph_input) if callable(config) else config
    made = {**(made or {})}
    configurable = {**(made.get("configurable") or {})}
    rollout = current_rollout()
    if getattr(graph, "checkpointer", None) not in (None, False) and rollout is not None:
        if "thread_id" not in configurable:
            configurable["thread_id"] = rollout.rollout_id
        elif not callable(config):  # one fixed thread for every rollout: keep them apart
            configurable["thread_id"] = f"{configurable['thread_id']}/{rollout.rollout_id}"
    if configurable:
        made["configurable"] = configurable
    return made


def graph_rollout(graph: Any, reward: RewardFn, *, config: GraphConfig | None = None,
                  model: Any = None) -> Callable[[Any], Awaitable[Trajectory]]:
    """Use an existing compiled graph as a rollout: ``await rollout(graph_input)``.

    The graph runs unchanged (its chat model should come from :func:`init_chat_model`); then
    ``reward(graph_input, final_state)`` (sync or async) returns a number or
    ``(number, metrics)``. The trajectory's messages are the final state's ``messages``.
    ``config`` is the graph's run config, or a function of the input that returns one per
    rollout (see :func:`rollout_config` for ``thread_id``). ``model`` serves chat models made
    by a module-level ``init_chat_model("openai:...")``.
    """
    install()

    async def rollout(graph_input: Any) -> Trajectory:
        async def run() -> Trajectory:
            token = _WRAPPED_MODEL.set(model) if model is not None else None
            try:
                state = await graph.ainvoke(graph_input,
                                            config=rollout_config(graph, config, graph_input))
            finally:
                if token is not None:
                    _WRAPPED_MODEL.reset(token)
            scored = reward(graph_input, state)
            if inspect.isawaitable(scored):
                scored = await scored
            value, metrics = _split_reward(scored)
            messages = state.get("messages") if isinstance(state, dict) else None
            return Trajectory(
                messages_and_choices=convert_to_openai_messages(messages) if messages else [],
                reward=value, metrics=metrics,
                metadata={"framework": "langgraph"})
        return await run_as_rollout(run)

    return rollout


def _split_reward(result: Any) -> tuple[float, dict[str, float]]:
    if isinstance(result, tuple):
        reward, metrics = result
        return float(reward), dict(metrics)
    if isinstance(result, int | float):
        return float(result), {}
    raise TypeError(f"a rollout function must return a Trajectory, a reward or (reward, metrics); "
                    f"got {type(result).__name__}")
