"""The rollout context: which rollout the running code belongs to.

It lives in a :class:`contextvars.ContextVar`, so it follows the code into asyncio tasks
(tasks copy the context when created), ``asyncio.to_thread`` and :class:`ContextThreadPoolExecutor`.
Concurrent rollouts therefore never see each other's id, and every LLM call made through
``model.openai_client()`` is attributed to the rollout that made it.
"""

from __future__ import annotations

import contextvars
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

if TYPE_CHECKING:
    from .spans import Span

T = TypeVar("T")
P = ParamSpec("P")
# the value of one call tag (``call_tags``): a short JSON scalar
CallTag = str | int | float | bool | None

ROLLOUT_HEADER = "x-rollout-id"
# JSON object of short scalar tags the gateway stores on the call record (``call_tags``)
TAGS_HEADER = "x-tracerl-tags"
MAX_TAGS_BYTES = 2048


@dataclass
class RolloutContext:
    """State of one running rollout."""

    rollout_id: str
    group_index: int | None = None
    index: int | None = None
    started_at: float = field(default_factory=time.time)
    metadata: dict[str, Any] = field(default_factory=dict)
    # Models whose endpoint this rollout called; their calls are attached at the end. Any: the
    # rollout layer's Model (``fetch_calls``), which core cannot name, and a Protocol for it here
    # would need LLMCall from .trajectory, which imports this module (a cycle in core).
    models: dict[int, Any] = field(default_factory=dict)
    # Structure recorded by framework adapters, in start order.
    spans: list[Span] = field(default_factory=list)
    # the newest request sent to a model's endpoint (what the watchdog shows for a stuck rollout)
    last_call: str | None = None
    last_call_at: float | None = None

    def touch(self, model: Any) -> None:
        """Note that this rollout talked to ``model``'s endpoint."""
        self.models.setdefault(id(model), model)


_current: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar(
    "tracerl_rollout", default=None
)


_call_tags: contextvars.ContextVar[dict[str, CallTag] | None] = contextvars.ContextVar(
    "tracerl_call_tags", default=None
)


RolloutObserver = Callable[[RolloutContext], list[Callable[[], None]]]
_rollout_observers: list[RolloutObserver] = []


def observe_rollouts(observer: RolloutObserver) -> None:
    """Call ``observer(rollout)`` whenever a rollout is entered, in that rollout's context; it
    returns what undoes its work when the rollout's scope ends. Core fires no plugin hooks: the
    event layer subscribes here (:mod:`tracerl.events`) and fires ``tracerl_rollout_started``."""
    if observer not in _rollout_observers:
        _rollout_observers.append(observer)


def enter_rollout(ctx: RolloutContext) -> tuple[contextvars.Token[RolloutContext | None],
                                                  list[Callable[[], None]]]:
    """Make ``ctx`` the current rollout and tell the observers, in its context; returns what
    undoes both."""
    token = _current.set(ctx)
    return token, [undo for observer in _rollout_observers for undo in observer(ctx)]


def new_rollout_id() -> str:
    return "ro-" + uuid.uuid4().hex


def current_rollout() -> RolloutContext | None:
    """The rollout the calling code runs in, or None outside any rollout."""
    return _current.get()


@contextmanager
def rollout_scope(
    rollout_id: str | None = None, *, index: int | None = None,
    group_index: int | None = None, **metadata: Any,
) -> Iterator[RolloutContext]:
    """Run a block as one rollout: every LLM call inside it is attributed to ``rollout_id``."""
    ctx = RolloutContext(
        rollout_id=rollout_id or new_rollout_id(), index=index,
        group_index=group_index, metadata=dict(metadata),
    )
    token, undo = enter_rollout(ctx)
    try:
        yield ctx
    finally:
        for u in reversed(undo):
            u()
        _current.reset(token)


@contextmanager
def outside_rollout() -> Iterator[None]:
    """Run a block as part of no rollout (its LLM calls are attributed to none)."""
    token = _current.set(None)
    try:
        yield
    finally:
        _current.reset(token)


def current_call_tags() -> dict[str, CallTag]:
    return dict(_call_tags.get() or {})


@contextmanager
def call_tags(**tags: CallTag) -> Iterator[dict[str, CallTag]]:
    """Tag every LLM call made in this block (through tracerl's clients): the gateway stores
    the tags on the call's record (``LLMCall.metadata['tags']``). Nested blocks merge."""
    merged = {**(_call_tags.get() or {}), **tags}
    for k, v in merged.items():
        if not isinstance(v, str | int | float | bool | type(None)):
            raise TypeError(
                f"call tag {k!r} must be a str, number, bool or None, got {type(v).__name__}"
            )
    token = _call_tags.set(merged)
    try:
        yield merged
    finally:
        _call_tags.reset(token)


class ContextThreadPoolExecutor(ThreadPoolExecutor):
    """A thread pool whose tasks run in a copy of the submitter's context.

    The standard executor runs every task in the worker thread's own (empty) context, which
    would lose the rollout id; use this one for sync tool code that calls the LLM.
    """

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        ctx = contextvars.copy_context()
        return super().submit(lambda: ctx.run(fn, *args, **kwargs))
