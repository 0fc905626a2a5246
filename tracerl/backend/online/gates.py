"""Release gates: the evidence that a candidate policy may replace the incumbent.

Each arm (candidate, incumbent) is summarised from its recorded calls and its rollouts'
rewards (:func:`arm_evidence`); :func:`judge` compares them:

- **reward**: the candidate's mean minus the incumbent's, with a one-sided confidence bound
  (Welch: ``diff +- z * se``). ``rollback`` when even the upper bound is below ``-margin``
  (surely worse by more than the margin), or when the upper bound is below 0 and the difference
  itself is beyond ``-margin`` (surely worse, most likely by more than the margin: waiting for
  the first rule kept a candidate 0.19 worse in canary past 50 rewards an arm); ``promote``
  needs the lower bound above ``-margin`` (not worse by more than the margin) and
  ``min_samples`` rewards per arm;
- **error rate**: a candidate erring ``max_error_rate_increase`` more often: ``rollback``;
- **p95 latency** above ``p95_latency_ratio`` times the incumbent's, and the drift monitors --
  mean completion length outside ``length_ratio``, repeated n-grams, broken tool calls -- trip
  a ``hold``: the canary stops and waits for a person (``tracerl promote`` / ``rollback``);
- otherwise ``continue``: not enough evidence yet.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from ...core.errors import ConfigError
from ...core.trajectory import LLMCall

NGRAM = 4


@dataclass
class Gates:
    """Thresholds of :func:`judge` (each field: when it trips)."""

    min_samples: int = 8  # rewards per arm before promote (and calls before a monitor trips)
    z: float = 1.645  # one-sided 95% bound
    margin: float = 0.05  # reward the candidate may lose and still be promoted
    max_error_rate_increase: float = 0.02
    p95_latency_ratio: float = 2.0
    length_ratio: tuple[float, float] = (0.5, 2.0)  # candidate / incumbent mean completion tokens
    max_repeated_ngram_increase: float = 0.15  # fraction of repeated 4-grams of a completion
    max_broken_tool_call_increase: float = 0.05

    def __post_init__(self) -> None:
        """Every threshold a finite number: they are written to the release log as JSON, which
        has no infinity (a monitor is turned off by a large value, e.g. a ratio of 1e9)."""
        for name, value in asdict(self).items():
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if not (isinstance(v, (int, float)) and math.isfinite(v)):
                    raise ConfigError(f"Gates.{name} must be a finite number, not {value!r} "
                                      "(turn a monitor off with a large value, e.g. 1e9)")


@dataclass
class ArmEvidence:
    """One arm's calls and rewards, summarised."""

    calls: int = 0
    errors: int = 0
    rewards: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    completion_tokens: list[int] = field(default_factory=list)
    repeated_ngrams: list[float] = field(default_factory=list)
    tool_turns: int = 0
    broken_tool_calls: int = 0

    @property
    def error_rate(self) -> float:
        return self.errors / self.calls if self.calls else 0.0

    @property
    def p95_latency(self) -> float:
        return percentile(self.latencies, 0.95)

    @property
    def mean_length(self) -> float:
        return _mean([float(n) for n in self.completion_tokens])

    @property
    def repeated_ngram_rate(self) -> float:
        return _mean(self.repeated_ngrams)

    @property
    def broken_tool_call_rate(self) -> float:
        return self.broken_tool_calls / self.tool_turns if self.tool_turns else 0.0

    def summary(self) -> dict[str, float]:
        return {"calls": float(self.calls), "rewards": float(len(self.rewards)),
                "reward_mean": _mean(self.rewards), "error_rate": self.error_rate,
                "p95_latency_s": self.p95_latency, "mean_completion_tokens": self.mean_length,
                "repeated_ngram_rate": self.repeated_ngram_rate,
                "broken_tool_call_rate": self.broken_tool_call_rate}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _var(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - 1)


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    ordered = sorted(xs)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def repeated_ngram_fraction(ids: list[int], n: int = NGRAM) -> float:
    """The share of a completion's ``n``-grams that repeat an earlier one (0: none repeat)."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def broken_tool_call(call: LLMCall) -> bool | None:
    """Whether a call offered tools answered with a broken tool call (arguments that are not a
    JSON object, or tool-call markup left unparsed in the text); None: no tools offered."""
    if not call.request.get("tools"):
        return None
    for completion in call.completions:
        for tc in completion.tool_calls or []:
            args = (tc.get("function") or {}).get("arguments")
            try:
                if not isinstance(json.loads(args) if isinstance(args, str) else args, dict):
                    return True
            except ValueError:
                return True
        if "<tool_call>" in completion.text:
            return True
    return False


def arm_evidence(calls: Iterable[LLMCall], rewards: Iterable[float]) -> ArmEvidence:
    out = ArmEvidence(rewards=[float(r) for r in rewards])
    for call in calls:
        out.calls += 1
        if call.error:
            out.errors += 1
            continue
        out.latencies.append(call.latency_s)
        for completion in call.completions:
            out.completion_tokens.append(len(completion.token_ids))
            out.repeated_ngrams.append(repeated_ngram_fraction(completion.token_ids))
        broken = broken_tool_call(call)
        if broken is not None:
            out.tool_turns += 1
            out.broken_tool_calls += broken
    return out


@dataclass
class Verdict:
    """What the gates say: ``promote``, ``rollback``, ``hold`` or ``continue``, and why."""

    decision: str
    tripped: list[str]
    evidence: dict[str, Any]


def judge(candidate: ArmEvidence, incumbent: ArmEvidence, gates: Gates | None = None) -> Verdict:
    g = gates or Gates()
    diff = _mean(candidate.rewards) - _mean(incumbent.rewards)
    se = math.sqrt(_var(candidate.rewards) / max(len(candidate.rewards), 1)
                   + _var(incumbent.rewards) / max(len(incumbent.rewards), 1))
    lower, upper = diff - g.z * se, diff + g.z * se
    enough = min(len(candidate.rewards), len(incumbent.rewards)) >= g.min_samples
    seen = min(candidate.calls, incumbent.calls) >= g.min_samples
    evidence: dict[str, Any] = {
        "candidate": candidate.summary(), "incumbent": incumbent.summary(),
        "reward_diff": diff, "reward_diff_lower": lower, "reward_diff_upper": upper,
        "gates": asdict(g)}
    fail, hold = [], []
    if enough and upper < -g.margin:
        fail.append(f"reward: candidate worse by {-diff:.3g} (upper bound {upper:.3g} < "
                    f"-{g.margin})")
    elif enough and upper < 0 and diff < -g.margin:
        fail.append(f"reward: candidate worse by {-diff:.3g}, more than the margin {g.margin} "
                    f"(upper bound {upper:.3g} < 0)")
    if seen and candidate.error_rate - incumbent.error_rate > g.max_error_rate_increase:
        fail.append(f"error rate {candidate.error_rate:.1%} vs {incumbent.error_rate:.1%}")
    if seen and incumbent.p95_latency and \
            candidate.p95_latency > g.p95_latency_ratio * incumbent.p95_latency:
        hold.append(f"p95 latency {candidate.p95_latency:.3g} s vs {incumbent.p95_latency:.3g} s")
    if seen and incumbent.mean_length:
        ratio = candidate.mean_length / incumbent.mean_length
        if not g.length_ratio[0] <= ratio <= g.length_ratio[1]:
            hold.append(f"completion length drifted: {ratio:.2f}x the incumbent's")
    if seen and candidate.repeated_ngram_rate - incumbent.repeated_ngram_rate > \
            g.max_repeated_ngram_increase:
        hold.append(f"repeated {NGRAM}-grams {candidate.repeated_ngram_rate:.1%} vs "
                    f"{incumbent.repeated_ngram_rate:.1%}")
    if seen and candidate.broken_tool_call_rate - incumbent.broken_tool_call_rate > \
            g.max_broken_tool_call_increase:
        hold.append(f"broken tool calls {candidate.broken_tool_call_rate:.1%} vs "
                    f"{incumbent.broken_tool_call_rate:.1%}")
    if fail:
        return Verdict("rollback", fail + hold, evidence)
    if hold:
        return Verdict("hold", hold, evidence)
    if enough and lower >= -g.margin:
        return Verdict("promote", [], evidence)
    return Verdict("continue", [], evidence)
