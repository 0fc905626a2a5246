"""RULER-style relative judging: an LLM ranks the trajectories of a group against each other.

Compared with ART's RULER:
- the messages all trajectories share are sent once, as context;
- trajectories get stable content-derived ids and scores are matched by id, never by position;
  identical trajectories share one id, so they get identical scores;
- the judge's answer is validated (JSON schema: every id exactly once, scores in [0, 1]) and
  retried; after the retries it fails with :class:`RulerError`, or returns None when asked to;
- large groups are split into chunks that share an anchor trajectory, and each chunk's scores
  are shifted so the anchor scores the same everywhere;
- answers are cached on disk by content; judge latency and token usage become metrics.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from openai.types.chat.chat_completion import Choice

from ..core.errors import RulerError
from ..core.trajectory import Trajectory, TrajectoryGroup

log = logging.getLogger(__name__)

DEFAULT_RUBRIC = """\
- A trajectory that achieves its goal should always score higher than one that does not.
- Among trajectories that achieve the goal, more efficient ones (fewer steps, less text) \
score higher.
- If no trajectory achieves the goal, score partial progress toward it.
- Scores are between 0 and 1 and are comparable within this group only."""

SYSTEM_PROMPT = """\
You are a judge. You compare several trajectories of an AI agent that all attempted the same \
task, and you score each one between 0 and 1 according to the rubric. Answer with JSON only: \
{{"scores": [{{"trajectory_id": "...", "explanation": "...", "score": 0.0}}, ...]}} with every \
trajectory id exactly once.

Rubric:
{rubric}"""


def _plain(item: Any) -> dict[str, Any]:
    if isinstance(item, Choice):
        return item.message.model_dump(exclude_none=True)
    return {k: v for k, v in item.items() if v is not None}


def trajectory_id(messages: list[dict[str, Any]]) -> str:
    """A stable id from a trajectory's content: identical trajectories get the same id."""
    digest = hashlib.sha256(json.dumps(messages, sort_keys=True, default=str).encode()).hexdigest()
    return "t" + digest[:10]


def shared_prefix(histories: list[list[dict[str, Any]]]) -> int:
    """How many leading messages every history has in common."""
    n = min(len(h) for h in histories)
    for i in range(n):
        if any(h[i] != histories[0][i] for h in histories[1:]):
            return i
    return n


def score_schema(ids: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "minItems": len(ids),
                "maxItems": len(ids),
                "items": {
                    "type": "object",
                    "properties": {
                        "trajectory_id": {"type": "string", "enum": ids},
                        "explanation": {"type": "string"},
                        "score": {"type": "number", "minimum": 0, "maximum": 1},
                    },
                    "required": ["trajectory_id", "explanation", "score"],
                },
            }
        },
        "required": ["scores"],
    }


@dataclass(frozen=True)
class TrajectoryScore:
    """One trajectory's judged score and the judge's reason for it."""

    trajectory_id: str
    score: float
    explanation: str = ""


def parse_judgement(text: str, ids: list[str]) -> dict[str, TrajectoryScore]:
    """Validate a judge answer; raise ValueError saying what is wrong with it."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise ValueError(f"no JSON object in the judge's answer: {text[:200]!r}")
    try:
        data = json.loads(text[start:end + 1])
    except json.JSONDecodeError as e:
        raise ValueError(f"the judge's answer is not valid JSON ({e}): {text[:200]!r}") from None
    entries = data.get("scores") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError("the judge's answer has no 'scores' list")
    scores: dict[str, TrajectoryScore] = {}
    for entry in entries:
        if not isinstance(entry, dict) or not isinstance(entry.get("trajectory_id"), str):
            raise ValueError(f"score entry without a trajectory_id: {entry!r}")
        tid, score = entry["trajectory_id"], entry.get("score")
        if tid not in ids:
            raise ValueError(f"the judge scored unknown trajectory id {tid!r}")
        if tid in scores:
            raise ValueError(f"the judge scored {tid!r} twice")
        if isinstance(score, bool) or not isinstance(score, int | float) or not 0 <= score <= 1:
            raise ValueError(f"score of {tid!r} is {score!r}, not a number in [0, 1]")
        explanation = entry.get("explanation")
        scores[tid] = TrajectoryScore(
            tid, float(score), explanation if isinstance(explanation, str) else ""
        )
    missing = [i for i in ids if i not in scores]
    if missing:
        raise ValueError(f"the judge did not score {missing}")
    return scores


def parse_scores(text: str, ids: list[str]) -> dict[str, float]:
    """Validate a judge answer and return its scores by trajectory id."""
    return {tid: s.score for tid, s in parse_judgement(text, ids).items()}


@dataclass
class JudgeStats:
    """What judging a group cost: calls, retries, cache hits, latency, tokens, errors."""

    calls: int = 0
    retries: int = 0
    cache_hits: int = 0
    errors: list[str] = field(default_factory=list)
    latency_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Ruler:
    """A configured judge. ``client`` is any AsyncOpenAI-compatible client (our own backend's
    ``model.openai_client()`` works too); ``model`` the judge's model name."""

    def __init__(self, client: Any, model: str, *, rubric: str = DEFAULT_RUBRIC,
                 max_retries: int = 2, timeout_s: float = 120.0, chunk_size: int = 8,
                 max_prompt_chars: int = 24_000, cache_dir: str | Path | None = None,
                 structured_output: bool = True, temperature: float = 0.0,
                 max_tokens: int = 1024, debug: bool = False) -> None:
        if chunk_size < 2:
            raise ValueError("chunk_size must be at least 2 (a chunk holds the anchor and another)")
        self.client, self.model, self.rubric = client, model, rubric
        self.max_retries, self.timeout_s = max_retries, timeout_s
        self.chunk_size, self.max_prompt_chars = chunk_size, max_prompt_chars
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.structured_output, self.temperature, self.max_tokens = (
            structured_output,
            temperature,
            max_tokens,
        )
        self.debug = debug

    # --- prompt ------------------------------------------------------------------------

    def _messages(self, context: list[dict[str, Any]], items: list[tuple[str, list[dict[str, Any]]]]
                  ) -> list[dict[str, Any]]:
        parts = (
            ["<shared_context>\n" + json.dumps(context, indent=1) + "\n</shared_context>"]
            if context
            else []
        )
        for tid, msgs in items:
            parts.append(f'<trajectory id="{tid}">\n{json.dumps(msgs, indent=1)}\n</trajectory>')
        parts.append("Score every trajectory id: " + ", ".join(tid for tid, _ in items))
        return [{"role": "system", "content": SYSTEM_PROMPT.format(rubric=self.rubric)},
                {"role": "user", "content": "\n\n".join(parts)}]

    def _chunks(self, items: list[tuple[str, list[dict[str, Any]]]]) -> list[list[tuple[str, Any]]]:
        """Split so each chunk fits; every chunk after the first starts with the anchor."""
        anchor, rest = items[0], items[1:]
        chunks: list[list[tuple[str, Any]]] = []
        current = [anchor]
        size = len(json.dumps(anchor[1]))
        for item in rest:
            item_size = len(json.dumps(item[1]))
            if len(current) >= self.chunk_size or (
                len(current) > 1 and size + item_size > self.max_prompt_chars
            ):
                chunks.append(current)
                current, size = [anchor], len(json.dumps(anchor[1]))
            current.append(item)
            size += item_size
        chunks.append(current)
        return chunks

    # --- calling the judge -------------------------------------------------------------

    def _cache_path(self, messages: list[dict[str, Any]]) -> Path | None:
        if self.cache_dir is None:
            return None
        key = hashlib.sha256(
            json.dumps([self.model, messages], sort_keys=True).encode()
        ).hexdigest()
        return self.cache_dir / f"{key}.json"

    async def _ask(self, messages: list[dict[str, Any]], ids: list[str], stats: JudgeStats
                   ) -> dict[str, TrajectoryScore]:
        cache = self._cache_path(messages)
        if cache is not None and cache.exists():
            stats.cache_hits += 1
            return parse_judgement(cache.read_text(), ids)
        kwargs: dict[str, Any] = {}
        if self.structured_output:
            kwargs["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "ruler_scores", "schema": score_schema(ids), "strict": True}}
        last_error = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                stats.retries += 1
            started = time.perf_counter()
            try:
                response = await asyncio.wait_for(self.client.chat.completions.create(
                    model=self.model, messages=messages, temperature=self.temperature,
                    max_tokens=self.max_tokens, **kwargs), self.timeout_s)
            except TimeoutError:
                last_error = f"the judge did not answer within {self.timeout_s} s"
                stats.errors.append(last_error)
                continue
            except Exception as e:  # an API error is retried like a bad answer
                if kwargs and getattr(e, "status_code", None) == 400:
                    kwargs = {}  # the endpoint has no structured output: ask in plain text
                last_error = f"judge request failed: {type(e).__name__}: {e}"
                stats.errors.append(last_error)
                continue
            finally:
                stats.calls += 1
                stats.latency_s += time.perf_counter() - started
            usage = getattr(response, "usage", None)
            if usage is not None:
                stats.prompt_tokens += usage.prompt_tokens or 0
                stats.completion_tokens += usage.completion_tokens or 0
            text = response.choices[0].message.content or ""
            if self.debug:
                log.warning("[ruler] %s answered (attempt %d): %s", self.model, attempt + 1, text)
            try:
                scores = parse_judgement(text, ids)
            except ValueError as e:
                last_error = str(e)
                stats.errors.append(last_error)
                continue
            if cache is not None:
                cache.parent.mkdir(parents=True, exist_ok=True)
                from ..core.storage import atomic_write_text

                atomic_write_text(cache, text)
            return scores
        raise RulerError(f"no valid scores after {self.max_retries + 1} attempts: {last_error}")

    # --- scoring a group ---------------------------------------------------------------

    async def judge_histories(self, histories: list[list[dict[str, Any]]], stats: JudgeStats
                              ) -> tuple[list[TrajectoryScore], int, int]:
        """Score message histories against each other: one score per history, in order (ids
        are content-derived), plus how many messages they share and how many are distinct."""
        n_shared = shared_prefix(histories)
        context = histories[0][:n_shared]
        ids = [trajectory_id(h[n_shared:]) for h in histories]
        unique: dict[str, list[dict[str, Any]]] = {}
        for tid, h in zip(ids, histories, strict=True):
            unique.setdefault(tid, h[n_shared:])
        judged = await self._score_items(context, list(unique.items()), stats)
        return [judged[tid] for tid in ids], n_shared, len(unique)

    async def score_group(self, group: TrajectoryGroup, *, swallow_exceptions: bool = False
                          ) -> TrajectoryGroup | None:
        """Set each trajectory's reward to its judged score (the old reward is kept in
        ``metrics['independent_reward']``, the judge's explanation in ``logs``). Returns the
        group, or None if judging failed and ``swallow_exceptions`` is set."""
        trajectories = group.trajectories
        if len(trajectories) < 2:
            return group
        stats = JudgeStats()
        try:
            judged, n_shared, n_unique = await self.judge_histories(
                [_judged_conversation(t) for t in trajectories], stats)
        except RulerError as e:
            if swallow_exceptions:  # as ART: the group is dropped, the judge's reason shown
                log.warning("RULER: judging a group of %d failed, the group is dropped "
                            "(swallow_exceptions=True): %s", len(trajectories), e)
                return None
            raise
        for t, result in zip(trajectories, judged, strict=True):
            _set_score(t, result.score)
            if result.explanation:
                t.log(f"RULER explanation: {result.explanation}")
        group.metadata["ruler"] = {
            "judge": self.model, "calls": stats.calls, "retries": stats.retries,
            "cache_hits": stats.cache_hits, "latency_s": stats.latency_s,
            "prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "shared_messages": n_shared, "unique_trajectories": n_unique, "errors": stats.errors,
        }
        return group

    async def _score_items(self, context: list[dict[str, Any]], items: list[tuple[str, Any]],
                           stats: JudgeStats) -> dict[str, TrajectoryScore]:
        if len(items) == 1:
            return {items[0][0]: TrajectoryScore(items[0][0], 1.0, "the only distinct trajectory")}
        chunks = self._chunks(items)
        results = await asyncio.gather(
            *[
                self._ask(self._messages(context, chunk), [tid for tid, _ in chunk], stats)
                for chunk in chunks
            ]
        )
        if len(results) == 1:
            return results[0]
        anchor = items[0][0]
        target = sum(r[anchor].score for r in results) / len(results)
        merged = {anchor: replace(results[0][anchor], score=target)}
        for r in results:  # shift each chunk so the anchor scores the same everywhere
            shift = target - r[anchor].score
            for tid, s in r.items():
                if tid != anchor:
                    merged[tid] = replace(s, score=min(1.0, max(0.0, s.score + shift)))
        return merged


def _judged_conversation(t: Trajectory) -> list[dict[str, Any]]:
    """What the judge reads of a trajectory: its conversation, then each additional history
    (ART's sub-agent conversations) after a marker saying what follows."""
    messages = [_plain(m) for m in t.messages_and_choices]
    for i, history in enumerate(t.additional_histories, start=1):
        messages.append(
            {
                "role": "system",
                "content": f"[additional history {i} of this trajectory: "
                "another conversation of the same rollout]",
            }
        )
        messages += [_plain(m) for m in history.messages_and_choices]
    return messages


def _set_score(t: Trajectory, score: float) -> None:
    metrics = dict(t.metrics)
    metrics.setdefault("independent_reward", t.reward)
    metrics["ruler_score"] = score
    t.metrics = metrics
    t.reward = score


def _judge(judge_model: str, extra_litellm_params: dict[str, Any] | None, client: Any,
           rubric: str, debug: bool, options: dict[str, Any]) -> Ruler:
    if client is not None and extra_litellm_params:
        raise ValueError("extra_litellm_params apply to LiteLLM, which is used only without a "
                         "client; configure the client instead")
    if client is None:
        client = _LiteLLMClient(extra_litellm_params or {})
    return Ruler(client, judge_model, rubric=rubric, debug=debug, **options)


async def ruler_score_group(group: TrajectoryGroup, judge_model: str = "openai/o3",
                            extra_litellm_params: dict[str, Any] | None = None,
                            rubric: str = DEFAULT_RUBRIC, *, client: Any = None,
                            swallow_exceptions: bool = False, debug: bool = False,
                            **options: Any) -> TrajectoryGroup | None:
    """ART's signature, usable as ``after_each=lambda g: ruler_score_group(g, "openai/o3")``.

    Without ``client`` (any AsyncOpenAI-compatible client), the judge is called through LiteLLM
    with ``extra_litellm_params`` (``api_base``, ``api_key``, ...). ``options`` go to
    :class:`Ruler` (``max_retries``, ``chunk_size``, ``cache_dir``, ...)."""
    judge = _judge(judge_model, extra_litellm_params, client, rubric, debug, options)
    return await judge.score_group(group, swallow_exceptions=swallow_exceptions)


async def ruler(
    message_lists: list[list[dict[str, Any]]],
    judge_model: str = "openai/o3",
    extra_litellm_params: dict[str, Any] | None = None,
    rubric: str = DEFAULT_RUBRIC,
    *,
    client: Any = None,
    debug: bool = False,
    **options: Any,
) -> list[TrajectoryScore]:
    """ART's low-level ``ruler``: score raw message lists against each other. Returns one
    :class:`TrajectoryScore` per list, in order, with ids "1", "2", ... as ART numbers them."""
    if not message_lists:
        return []
    judge = _judge(judge_model, extra_litellm_params, client, rubric, debug, options)
    histories = [[_plain(m) for m in messages] for messages in message_lists]
    judged, _, _ = await judge.judge_histories(histories, JudgeStats())
    return [replace(result, trajectory_id=str(i)) for i, result in enumerate(judged, start=1)]


class _LiteLLMClient:
    """The slice of the AsyncOpenAI interface the judge uses, over ``litellm.acompletion``."""

    def __init__(self, extra_params: dict[str, Any]) -> None:
        try:
            import litellm
        except ImportError as e:
            raise RulerError(
                "judging without a client needs LiteLLM: pip install 'tracerl[litellm]'"
            ) from e
        self._litellm = litellm
        self._extra = dict(extra_params)
        self.chat = self
        self.completions = self

    async def create(self, **kwargs: Any) -> Any:
        """``litellm.acompletion`` sending only the parameters the judge model accepts: LiteLLM
        drops the others (``drop_params``; ART's judges ``openai/o3`` and ``o4-mini`` take no
        ``temperature`` but 1). ``extra_litellm_params`` may set ``drop_params`` itself."""
        return await self._litellm.acompletion(**{"drop_params": True, **kwargs, **self._extra})
