"""The data model: token-exact LLM call records, trajectories and groups of them.

Everything round-trips losslessly through JSON (``to_json`` / ``from_json``) and JSONL files.
"""

from __future__ import annotations

import contextvars
import inspect
import json
import math
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeAlias

from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from openai.types.chat.chat_completion import Choice
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_serializer,
    field_validator,
    model_validator,
)

from .context import RolloutContext, current_rollout, outside_rollout, rollout_scope
from .errors import InvalidTrajectoryError
from .spans import Span
from .storage import atomic_write_text
from .validated import Validated as _Validated
from .validated import check_json

# ART's type aliases (``art.Messages``, ``art.MessagesAndChoices``, ``art.Tools``)
Message: TypeAlias = ChatCompletionMessageParam
Messages: TypeAlias = list[ChatCompletionMessageParam]
MessageOrChoice: TypeAlias = ChatCompletionMessageParam | Choice
MessagesAndChoices: TypeAlias = list[MessageOrChoice]
Tools: TypeAlias = list[ChatCompletionToolParam]

MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})


def _check_finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidTrajectoryError(
            f"{name} must be a number, got {type(value).__name__}: {value!r}"
        )
    if not math.isfinite(value):
        raise InvalidTrajectoryError(f"{name} must be finite, got {value!r}")
    return float(value)




# |reward| above this is refused where rewards enter (feedback, the rollout API, a training
# step's trajectories): a group's sum and variance of rewards stay finite, its loss too
MAX_REWARD = 1e6


def _metrics_dict(value: Any) -> dict[str, float]:
    if not isinstance(value, dict):
        raise InvalidTrajectoryError("metrics must be a dict of name -> number")
    return {str(k): _check_finite(f"metrics[{k!r}]", float(v) if isinstance(v, bool) else v)
            for k, v in value.items()}


class CompletionRecord(_Validated):
    """One sampled completion of a call, exactly as the engine produced it."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    index: int = 0
    token_ids: list[int]
    logprobs: list[float] | None = None
    text: str = ""
    finish_reason: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _lengths_match(self) -> CompletionRecord:
        if any(t < 0 for t in self.token_ids):
            raise InvalidTrajectoryError("completion token ids must be non-negative")
        if self.logprobs is not None:
            if len(self.logprobs) != len(self.token_ids):
                raise InvalidTrajectoryError(
                    f"completion has {len(self.token_ids)} token ids but "
                    f"{len(self.logprobs)} logprobs"
                )
            if self.logprobs and (any(map(math.isnan, self.logprobs))
                                  or max(self.logprobs) > 1e-4):  # C loops: 256 per call
                bad = next(lp for lp in self.logprobs if math.isnan(lp) or lp > 1e-4)
                raise InvalidTrajectoryError(f"logprob {bad!r} is not a log-probability")
        return self


GREEDY_BELOW_TEMPERATURE = 1e-5


def is_greedy(temperature: float) -> bool:
    """Whether a call at ``temperature`` samples greedily: below 1e-5 (vLLM's ``_SAMPLING_EPS``)
    dividing logits by it overflows, so engines take the top token and training scores at 1."""
    return temperature < GREEDY_BELOW_TEMPERATURE


class LLMCall(_Validated):
    """A token-exact record of one LLM call made through the gateway."""

    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    id: str
    rollout_id: str | None = None
    endpoint: Literal["chat.completions", "completions"] = "chat.completions"
    model: str = ""
    adapter_step: int | None = None
    # the digest of the weights the engine served it with ("base", "sha256:...", None: unknown)
    adapter_digest: str | None = None
    request: dict[str, Any] = Field(default_factory=dict)
    response: dict[str, Any] | None = None
    prompt_token_ids: list[int] = Field(default_factory=list)
    completions: list[CompletionRecord] = Field(default_factory=list)
    temperature: float = 1.0
    streamed: bool = False
    latency_s: float = 0.0
    created_at: float = Field(default_factory=time.time)
    error: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    def json_line(self) -> bytes:
        """The record as one line of strict JSON (``ValueError`` for a non-finite float, as
        ``json.dumps(allow_nan=False)``), encoded by pydantic-core: the gateway encodes one per
        call, and ``json.dumps`` of ``model_dump`` took several times as long (BENCHMARKS.md)."""
        line = self.model_dump_json().encode()
        if b"NaN" in line or b"Infinity" in line:  # a real constant, or only text that says so
            json.dumps(self.model_dump(mode="json"), allow_nan=False)  # raises for a real one
        return line

    @property
    def completion_tokens(self) -> int:
        """Tokens sampled in this call, over all its completions."""
        return sum(len(c.token_ids) for c in self.completions)


def _to_message_or_choice(item: Any, position: int) -> dict[str, Any] | Choice:
    """Validate one entry of ``messages_and_choices``; dicts that look like a Choice become one."""
    if isinstance(item, Choice):
        return item
    if isinstance(item, BaseModel):  # e.g. a ChatCompletionMessage
        item = item.model_dump(exclude_none=True)
    if not isinstance(item, dict):
        raise InvalidTrajectoryError(
            f"messages_and_choices[{position}] must be a message dict or an openai Choice, "
            f"got {type(item).__name__}"
        )
    if "message" in item and "finish_reason" in item:
        return Choice.model_validate(item)
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        raise InvalidTrajectoryError(
            f"messages_and_choices[{position}] has unknown role {role!r}; "
            f"expected one of {sorted(MESSAGE_ROLES)}"
        )
    return item


class Conversation(_Validated):
    """A chat history: messages, and ``Choice`` objects where the model answered."""

    model_config = ConfigDict(
        arbitrary_types_allowed=True, validate_assignment=True, extra="forbid"
    )

    messages_and_choices: list[Any] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    @field_validator("messages_and_choices", mode="before")
    @classmethod
    def _validate_messages(cls, value: Any) -> list[Any]:
        if not isinstance(value, list | tuple):
            raise InvalidTrajectoryError("messages_and_choices must be a list")
        return [_to_message_or_choice(item, i) for i, item in enumerate(value)]

    @field_serializer("messages_and_choices")
    def _serialize_messages(self, value: list[Any]) -> list[dict[str, Any]]:
        return [v.model_dump(mode="json") if isinstance(v, Choice) else v for v in value]

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as plain chat messages (choices become assistant messages)."""
        out = []
        for item in self.messages_and_choices:
            if isinstance(item, Choice):
                out.append(item.message.model_dump(exclude_none=True))
            else:
                out.append(item)
        return out


class History(Conversation):
    """Another conversation of the same rollout (ART's ``History``), e.g. a sub-agent's."""


# the trajectories whose ``with`` block the running code is in (innermost last)
_capturing: contextvars.ContextVar[tuple[Trajectory, ...]] = contextvars.ContextVar(
    "tracerl_capturing", default=())


def current_trajectory(*, require: bool = False) -> Trajectory | None:
    """The trajectory of the innermost ``with Trajectory():`` block (ART's
    ``art.current_trajectory``); None outside one (``require``: raise instead)."""
    scopes = _capturing.get()
    if scopes:
        return scopes[-1]
    if require:
        raise RuntimeError("no trajectory is being captured here: call this inside `with "
                           "Trajectory():`, `await trajectory(coro)` or "
                           "`capture_auto_trajectory(coro)`")
    return None


class Trajectory(Conversation):
    """What one rollout did and how well: the ART-compatible trajectory, plus token records.

    ``additional_histories`` (ART's field) train only when the rollout has no token records:
    calls made through the gateway are all recorded, sub-agents' included, and train token-exactly.

    ``with Trajectory() as t:`` (ART's capture scope) runs the block as a rollout of its own: the
    LLM calls made inside are recorded under ``t.rollout_id`` and attached to ``t`` when it is
    trained or logged; :func:`current_trajectory` returns ``t`` inside.
    """

    additional_histories: list[History] = Field(default_factory=list)
    reward: float = 0.0
    metrics: dict[str, float] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)
    llm_calls: list[LLMCall] = Field(default_factory=list)
    spans: list[Span] = Field(default_factory=list)
    rollout_id: str | None = None
    start_time: float = Field(default_factory=time.time)
    end_time: float | None = None
    # the rollout of its ``with`` block, whose recorded calls are attached later
    _scope: RolloutContext | None = PrivateAttr(default=None)
    _scope_exit: list[tuple[AbstractContextManager[RolloutContext],
                            contextvars.Token[tuple[Trajectory, ...]]]] = PrivateAttr(
        default_factory=list)

    def __init__(self, **data: Any) -> None:
        if data.get("rollout_id") is None:
            ctx = current_rollout()
            if ctx is not None:
                data["rollout_id"] = ctx.rollout_id
        super().__init__(**data)

    @field_validator("reward", mode="before")
    @classmethod
    def _validate_reward(cls, value: Any) -> float:
        return _check_finite("reward", value)

    @field_validator("metrics", mode="before")
    @classmethod
    def _validate_metrics(cls, value: Any) -> dict[str, float]:
        return _metrics_dict(value)

    @field_validator("metadata", mode="after")
    @classmethod
    def _validate_metadata(cls, value: dict[str, Any]) -> dict[str, Any]:
        return check_json("metadata", value)

    def log(self, message: str) -> None:
        """Append a free-text line to the trajectory's logs."""
        self.logs.append(message)

    @property
    def completion_tokens(self) -> int:
        """Tokens sampled in the rollout's recorded calls."""
        return sum(call.completion_tokens for call in self.llm_calls)

    def finish(self) -> Trajectory:
        """Stamp the end: ``end_time`` and ART's ``metrics['duration']`` (seconds)."""
        self.end_time = time.time()
        self.metrics["duration"] = self.end_time - self.start_time
        return self

    @asynccontextmanager
    async def track_duration(self, metric_name: str) -> AsyncIterator[None]:
        """Add the block's wall time to ``metrics[f"{metric_name}_duration"]`` (ART's)."""
        started = time.monotonic()
        try:
            yield
        finally:
            key = f"{metric_name}_duration"
            self.metrics[key] = self.metrics.get(key, 0.0) + time.monotonic() - started

    @property
    def scope(self) -> RolloutContext | None:
        """The rollout of this trajectory's ``with`` block, if it was captured by one."""
        return self._scope

    def __enter__(self) -> Trajectory:
        scope = rollout_scope()  # a rollout of its own, even inside another one
        rollout = scope.__enter__()
        self.rollout_id, self._scope = rollout.rollout_id, rollout
        self._scope_exit.append((scope, _capturing.set((*_capturing.get(), self))))
        return self

    def __exit__(self, *exc: Any) -> None:  # (type, value, traceback), passed on as given
        scope, token = self._scope_exit.pop()
        _capturing.reset(token)
        scope.__exit__(*exc)
        self.finish()


@contextmanager
def no_capture() -> Iterator[None]:
    """Hide the enclosing capture (ART's ``art.no_capture``): inside, no trajectory is current
    and LLM calls belong to no enclosing rollout; new ``with Trajectory():`` blocks still
    capture."""
    with outside_rollout(), _hidden_capture():
        yield


@contextmanager
def _hidden_capture() -> Iterator[None]:
    token = _capturing.set(())
    try:
        yield
    finally:
        _capturing.reset(token)


async def attach_scoped_calls(groups: Iterable[TrajectoryGroup]) -> None:
    """Attach the recorded calls of trajectories captured by a ``with`` block, which could not
    be fetched when the (sync) block ended."""
    for group in groups:
        for trajectory in group.trajectories:
            if trajectory.scope is not None and not trajectory.llm_calls:
                trajectory.llm_calls = await calls_of(trajectory.scope)


async def calls_of(rollout: RolloutContext) -> list[LLMCall]:
    """The calls the gateway recorded for ``rollout``, from every model it called, in order."""
    calls: list[LLMCall] = []
    for model in rollout.models.values():
        calls.extend(await model.fetch_calls(rollout.rollout_id))
    calls.sort(key=lambda c: c.created_at)
    return calls


async def spans_of(rollout: RolloutContext) -> list[Span]:
    """The spans posted to the gateway for ``rollout`` (e.g. by the LiteLLM proxy's callback),
    from every model it called, in start order."""
    spans: list[Span] = []
    for model in rollout.models.values():
        fetch = getattr(model, "fetch_spans", None)
        if fetch is not None:
            spans.extend(await fetch(rollout.rollout_id))
    spans.sort(key=lambda s: s.start_time)
    return spans


def fill_messages_from_calls(trajectory: Trajectory) -> None:
    """A trajectory without messages gets its last chat call's conversation."""
    if trajectory.messages_and_choices:
        return
    chats = [c for c in trajectory.llm_calls if c.endpoint == "chat.completions" and c.response]
    if chats:
        last = chats[-1]
        choices = (last.response or {}).get("choices") or []  # (non-empty: filtered above)
        trajectory.messages_and_choices = [*last.request.get("messages", []), *choices[:1]]



class RolloutException(_Validated):
    """A rollout that raised instead of returning a trajectory."""

    model_config = ConfigDict(extra="forbid")

    type: str
    message: str
    traceback: str = ""
    rollout_id: str | None = None

    @classmethod
    def from_exception(cls, exc: BaseException, rollout_id: str | None = None) -> RolloutException:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(type=type(exc).__name__, message=str(exc), traceback=tb, rollout_id=rollout_id)


class _GroupConstruction(type(BaseModel)):  # type: ignore[misc]  # a dynamic base
    """``TrajectoryGroup(...)``: trajectories make a group; rollout awaitables (ART's way) make
    a :class:`PendingTrajectoryGroup` to await. An iterable is read once, here."""

    def __call__(cls, trajectories: Iterable[Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        if trajectories is not None and not isinstance(trajectories, list):
            trajectories = list(trajectories)
        if trajectories and any(inspect.isawaitable(t) for t in trajectories):
            return PendingTrajectoryGroup(trajectories, **kwargs)
        return super().__call__(trajectories, *args, **kwargs)


def rewards_spread(rewards: Iterable[float], tolerance: float) -> bool:
    """Whether ``rewards`` spread by more than ``tolerance``: a GRPO group with signal (all
    equal, every advantage is 0). The one rule of dynamic sampling, offline and online."""
    rewards = list(rewards)
    return bool(rewards) and max(rewards) - min(rewards) > tolerance


class TrajectoryGroup(_Validated, metaclass=_GroupConstruction):
    """Trajectories of the same scenario, compared with each other by GRPO.

    Like ART, passing awaitables (rollout coroutines) returns a :class:`PendingTrajectoryGroup`:
    awaiting it runs the rollouts concurrently, each in its own rollout context, and keeps
    per-rollout exceptions.
    """

    model_config = ConfigDict(extra="forbid")

    trajectories: list[Trajectory]
    exceptions: list[RolloutException] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    metrics: dict[str, float] = Field(default_factory=dict)  # ART's group-level metrics
    logs: list[str] = Field(default_factory=list)

    if TYPE_CHECKING:
        # ``TrajectoryGroup(rollout_awaitables)`` is a PendingTrajectoryGroup at run time (the
        # metaclass), which a type checker cannot express: declared awaitable here so that ART's
        # ``await TrajectoryGroup(...)`` and ``gather_trajectory_groups([TrajectoryGroup(...)])``
        # type-check. A group of finished trajectories is not awaitable.
        def __await__(self) -> Generator[Any, None, TrajectoryGroup]: ...

    def __init__(
        self,
        trajectories: Iterable[Trajectory | dict[str, Any] | BaseException]
        | Iterable[Awaitable[Trajectory]] | None = None, *,
        exceptions: Iterable[BaseException | RolloutException | dict[str, Any]] = (),
        metadata: dict[str, Any] | None = None, **data: Any,
    ) -> None:
        if trajectories is None:
            trajectories = data.pop("trajectories", [])
        # as in ART, exceptions among the trajectories (asyncio.gather(return_exceptions=True))
        # are the group's failed rollouts
        # (a list here: the metaclass lists an iterable, and sends awaitables elsewhere)
        failed = [t for t in trajectories if isinstance(t, BaseException)]
        kept = [t for t in trajectories if not isinstance(t, BaseException)]
        excs = [
            RolloutException.from_exception(e) if isinstance(e, BaseException) else e
            for e in [*failed, *exceptions]
        ]
        if not kept and not excs:
            raise InvalidTrajectoryError(
                "a TrajectoryGroup needs at least one trajectory "
                "(or the exceptions of its failed rollouts)"
            )
        for i, t in enumerate(kept):
            if not isinstance(t, Trajectory | dict):
                raise InvalidTrajectoryError(
                    f"trajectories[{i}] is a {type(t).__name__}, not a Trajectory"
                )
        super().__init__(trajectories=kept, exceptions=excs, metadata=metadata or {},
                         **data)

    @field_validator("metrics", mode="before")
    @classmethod
    def _validate_group_metrics(cls, value: Any) -> dict[str, float]:
        return _metrics_dict(value if value is not None else {})

    @field_validator("logs", mode="before")
    @classmethod
    def _validate_logs(cls, value: Any) -> list[str]:
        return list(value) if value is not None else []

    def log(self, message: str) -> None:
        """Append a free-text line to the group's logs."""
        self.logs.append(message)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __iter__(self) -> Iterator[Trajectory]:  # type: ignore[override]  # ART: not (name, value)
        return iter(self.trajectories)


RunRollouts = Callable[["PendingTrajectoryGroup", "int | None"], Awaitable[TrajectoryGroup]]


class PendingTrajectoryGroup:
    """Rollouts not yet run: what ``TrajectoryGroup(rollout_coroutines)`` returns (ART's API).

    Await it, or pass it to ``gather_trajectory_groups``, to run the rollouts. How they run is
    the rollout stage's business: ``tracerl.rollout.gather`` installs :attr:`run_rollouts`.
    """

    run_rollouts: ClassVar[RunRollouts | None] = None

    def __init__(self, awaitables: list[Awaitable[Trajectory]], *,
                 exceptions: Iterable[BaseException | RolloutException | dict[str, Any]] = (),
                 metadata: dict[str, Any] | None = None, metrics: dict[str, float] | None = None,
                 logs: list[str] | None = None) -> None:
        self.awaitables = awaitables
        self.exceptions = list(exceptions)
        self.metadata = metadata or {}
        self.metrics = metrics or {}
        self.logs = list(logs or [])

    def __len__(self) -> int:
        return len(self.awaitables)

    def run(self, group_index: int | None = None) -> Awaitable[TrajectoryGroup]:
        """Run the rollouts (``group_index``: the group's place in a gather)."""
        run = type(self).run_rollouts
        if run is None:
            raise RuntimeError("awaiting a TrajectoryGroup of rollouts needs tracerl.rollout "
                               "(import tracerl)")
        return run(self, group_index)

    def __await__(self) -> Generator[Any, None, TrajectoryGroup]:
        return self.run().__await__()



def group_lines(groups: Iterable[TrajectoryGroup]) -> str:
    """Groups as JSONL, one group per line: the on-disk and on-the-wire format."""
    return "".join(g.model_dump_json() + "\n" for g in groups)


def write_groups_jsonl(path: Path, groups: Iterable[TrajectoryGroup], append: bool = False) -> None:
    """Write groups to ``path`` atomically, one group per line (after its lines, if ``append``)."""
    existing = Path(path).read_text() if append and Path(path).exists() else ""
    atomic_write_text(path, existing + group_lines(groups))


def parse_group_lines(
    lines: Iterable[str], source: str, first_lineno: int = 1
) -> list[TrajectoryGroup]:
    """Groups from JSONL lines (blank lines skipped); a bad line names ``source`` and its number."""
    groups = []
    for lineno, line in enumerate(lines, first_lineno):
        if not line.strip():
            continue
        try:
            groups.append(TrajectoryGroup.from_json(line))
        except InvalidTrajectoryError as e:
            raise InvalidTrajectoryError(
                f"{source}:{lineno}: not a valid trajectory group: {e}"
            ) from e
    return groups


def read_groups_jsonl(path: Path) -> list[TrajectoryGroup]:
    """Read groups written by :func:`write_groups_jsonl`; a bad line names its number."""
    return parse_group_lines(Path(path).read_text().splitlines(), str(path))
