"""Step health: whether a training step's data can teach the model anything, and if not, why.

Every step logs these beside loss and reward (``history.jsonl``):

- ``skipped_groups`` / ``groups``: groups with equal rewards (or one trajectory) carry no signal;
- ``unattributed_calls``: calls the gateway recorded without a rollout id since the last step;
- ``late_calls``: calls for a rollout-API rollout that arrived after it was finished;
- ``orphan_calls``: calls recorded under a rollout id that no trained or logged trajectory
  claimed;
- ``prefix_mismatch_fraction``: turns whose prompt did not continue the previous call's tokens,
  by reason (the gateway's verdict on each record, ``LLMCall.metadata["turn"]``):
  ``history_edits`` (the agent changed an earlier message; the first at
  ``history_edit_message``), ``new_conversations`` (a subagent's conversation of its own),
  ``unspliced_turns`` (the gateway did not splice the turn: the template, a cut completion, an
  engine that renders its own prompts, or records from before exact turns);
- ``rendered_fraction``: rows trained on re-rendered text instead of the engine's tokens;
- ``template_mismatch_fraction``: recorded prompts the trainer's chat template renders
  differently from the engine's tokens (spliced turns are not rendered, so not compared);
- ``engine_kl``: KL(engine || trainer) over the sampled tokens (k3 estimate, from the trainer);
- ``length_clipped_fraction``: completions cut at ``max_tokens``;
- ``past_turn_end``: completions that went on past the chat template's end of an assistant turn
  (an engine stopping at another end token: the answer's text then holds ``<|im_end|>``...);
- ``identical_groups``: groups whose rollouts all sampled the same completion tokens, and
  ``sampled_entropy``: the mean surprisal (-logprob, as the engine recorded it) of every sampled
  completion token of the step, trained or not (an estimate of the policy's per-token entropy;
  the trainer's exact ``entropy`` covers only the trained rows): together they tell an entropy
  collapse (:func:`collapse`);
- ``fingerprint_mismatches``: calls the engine served with other weights than the policy
  version they claim (``LLMCall.adapter_digest`` vs the checkpoint's digest,
  :mod:`tracerl.core.fingerprint`); refused, not trained on. ``fingerprint_unverified``: calls
  whose engine could not tell, or whose checkpoint is gone.

:func:`step_warnings` turns them into warnings that name the likely cause and the fix;
``tracerl doctor`` and ``tracerl report`` read the same metrics back from a run's history.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core import settings
from ...core.storage import ModelStore, append_jsonl, atomic_write_text, read_jsonl
from ...core.trajectory import CompletionRecord, TrajectoryGroup
from ..rollout_log import late_calls_path, pending_rollout_ids

log = logging.getLogger(__name__)

UNATTRIBUTED_TOTAL = "unattributed_calls_total"
CLAIMED = "_claimed.jsonl"  # in calls/: rollout ids trained so far, one line per step
ORPHANS = "_orphans.json"  # in calls/: rollout ids unclaimed at the last step, and counted ones
TOKEN_LOGPROBS_DIR = "token_logprobs"  # per step: engine and trainer logprobs of trained tokens
TEMPLATE_SAMPLE = 8  # recorded prompts re-rendered per step to compare chat templates


@dataclass(frozen=True)
class HealthWarning:
    """One step-health item over its threshold: what was seen, the likely cause, the fix."""

    item: str
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.message}: {self.fix}"


def _recorded_completions(groups: Iterable[TrajectoryGroup]) -> Iterator[CompletionRecord]:
    """Every completion the gateway recorded for the groups' rollouts."""
    for group in groups:
        for trajectory in group:
            for call in trajectory.llm_calls:
                yield from call.completions


def completion_clipping(groups: Iterable[TrajectoryGroup]) -> dict[str, float]:
    """Recorded completions that stopped at ``max_tokens`` (``finish_reason == "length"``)."""
    clipped = total = 0
    for completion in _recorded_completions(groups):
        total += 1
        clipped += completion.finish_reason == "length"
    return {"completions": float(total), "length_clipped": float(clipped),
            "length_clipped_fraction": clipped / total if total else 0.0}


def past_turn_end(groups: Iterable[TrajectoryGroup], turn_end: set[int]) -> dict[str, float]:
    """Recorded completions with tokens after the chat template's end of an assistant turn
    (``turn_end``, :func:`~tracerl.backend.chat_template.turn_end_ids`): the engine did not
    stop where the turn ends, and the agent got the end token's text in its answer."""
    past = sum(any(i in turn_end for i in completion.token_ids[:-1])
               for completion in _recorded_completions(groups))
    return {"past_turn_end": float(past)}


def collapse(groups: Iterable[TrajectoryGroup]) -> dict[str, float]:
    """Signs of an entropy collapse: ``identical_groups``, groups of two rollouts or more that
    all sampled the same completion tokens (their text, for rollouts without token records),
    and ``sampled_entropy``, the mean -logprob of the sampled tokens the engine recorded (no
    key when it recorded none)."""
    identical = surprisal = tokens = 0.0
    for group in groups:
        samples: list[object] = []  # of the rollouts that sampled anything (of this model)
        for trajectory in group:
            sampled = tuple(tuple(c.token_ids) for call in trajectory.llm_calls
                            for c in call.completions) or [
                m for m in trajectory.messages() if m.get("role") == "assistant"]
            if sampled:
                samples.append(sampled if isinstance(sampled, tuple)
                               else json.dumps(sampled, sort_keys=True, default=str))
            for call in trajectory.llm_calls:
                for completion in call.completions:
                    if completion.logprobs:
                        surprisal -= sum(completion.logprobs)
                        tokens += len(completion.logprobs)
        identical += len(samples) > 1 and len(set(samples)) == 1
    return {"identical_groups": identical,
            **({"sampled_entropy": surprisal / tokens} if tokens else {})}


def template_mismatches(groups: Iterable[TrajectoryGroup],
                        render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None],
                                         list[int]],
                        sample: int = TEMPLATE_SAMPLE) -> dict[str, float]:
    """Re-render the first ``sample`` recorded chat prompts with the trainer's template and
    count those whose tokens differ from what the engine saw."""
    checked = mismatched = 0
    for group in groups:
        for trajectory in group:
            for call in trajectory.llm_calls:
                messages = call.request.get("messages")
                if checked >= sample:
                    break
                if call.endpoint != "chat.completions" or not messages or \
                        not call.prompt_token_ids or \
                        (call.metadata.get("turn") or {}).get("verdict") == "spliced":
                    continue
                checked += 1
                try:
                    rendered = render(messages, call.request.get("tools"))
                except Exception as e:  # a template that cannot render the request differs too
                    log.debug("re-rendering a recorded prompt failed: %s", e)
                    rendered = []
                mismatched += list(rendered) != list(call.prompt_token_ids)
    return {"template_checked": float(checked), "template_mismatches": float(mismatched),
            "template_mismatch_fraction": mismatched / checked if checked else 0.0}


def _lines(path: Path) -> int:
    if not path.exists():
        return 0
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def _since_last_step(store: ModelStore, path: Path, key: str) -> dict[str, float]:
    """``key``: records added to ``path`` since the previous training step (whose history line
    holds the running total, ``{key}_total``)."""
    total, previous = _lines(path), 0.0
    for entry in reversed(store.history()):
        if entry.get("split") == "train" and f"{key}_total" in entry:
            previous = float(entry[f"{key}_total"])
            break
    return {f"{key}_total": float(total), key: max(total - previous, 0.0)}


def unattributed_calls(store: ModelStore) -> dict[str, float]:
    """Calls recorded without a rollout id since the previous training step."""
    return _since_last_step(store, store.unattributed_calls_path, "unattributed_calls")


def late_calls(store: ModelStore) -> dict[str, float]:
    """Calls that arrived for a rollout-API rollout after it was finished (recorded apart),
    since the previous training step."""
    return _since_last_step(store, late_calls_path(store), "late_calls")


def claim_rollouts(store: ModelStore, groups: Iterable[TrajectoryGroup]) -> None:
    """Note the rollout ids of trained or logged groups (their calls are no orphans)."""
    ids = sorted({rid for g in groups for rid in (
        *(t.rollout_id for t in g.trajectories), *(e.rollout_id for e in g.exceptions)) if rid})
    if ids:
        append_jsonl(store.root / "calls" / CLAIMED, {"rollout_ids": ids})


def orphan_calls(store: ModelStore, groups: Iterable[TrajectoryGroup]) -> dict[str, float]:
    """Calls recorded under a rollout id that no trajectory claimed: a rollout id first seen
    unclaimed at one step and still unclaimed at the next (no trajectory trained or logged so
    far holds it, and it is no rollout-API rollout waiting to be handed out) is counted once,
    with all its calls. A client that sends made-up ``x-rollout-id`` values, or rollouts
    whose groups were dropped, show up here."""
    calls_dir = store.root / "calls"
    claim_rollouts(store, groups)
    state_path = calls_dir / ORPHANS
    claimed = {rid for r in read_jsonl(calls_dir / CLAIMED) for rid in r.get("rollout_ids", [])}
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    counted, seen = set(state.get("counted", [])), set(state.get("seen", []))
    recorded = {p.stem for p in calls_dir.glob("*.jsonl")  # live calls: online mode counts them
                if not p.name.startswith(("_", "live-"))}
    unclaimed = recorded - claimed - counted - pending_rollout_ids(store)
    orphans = unclaimed & seen
    n_calls = sum(_lines(store.calls_path(rid)) for rid in orphans)
    if recorded or state:
        atomic_write_text(state_path, json.dumps({"seen": sorted(unclaimed - orphans),
                                                  "counted": sorted(counted | orphans)}))
    return {"orphan_calls": float(n_calls), "orphan_rollouts": float(len(orphans))}


def stray_calls(store: ModelStore, groups: Iterable[TrajectoryGroup]) -> dict[str, float]:
    """The step's count of calls no trajectory holds: unattributed, late and orphan calls."""
    return {**unattributed_calls(store), **late_calls(store), **orphan_calls(store, groups)}


def ratios(metrics: dict[str, float]) -> dict[str, float]:
    """The fractions derived from a step's counts."""
    turns = metrics.get("merged_calls", 0.0) + metrics.get("prefix_mismatches", 0.0)
    rows = metrics.get("rows", 0.0)
    return {
        "prefix_mismatch_fraction": metrics.get("prefix_mismatches", 0.0) / turns if turns else 0.0,
        "rendered_fraction": min(metrics.get("rendered_rows", 0.0) / rows, 1.0) if rows else 0.0,
    }


def _past_turn_end_warning(m: dict[str, Any], threshold: float) -> list[HealthWarning]:
    past = float(m.get("past_turn_end", 0) or 0)
    if past < threshold:
        return []
    return [HealthWarning(
        "past_turn_end",
        f"{past:.0f} of {m.get('completions', 0):.0f} completions went on past the chat "
        "template's end of an assistant turn: the engine does not stop there, and the answers "
        "hold the end token's text",
        "make the model's generation_config.json eos_token_id list the turn's end token "
        "(tracerl's engines stop there themselves, when the tokenizer loads; an engine "
        "tracerl does not drive stops on the config's)")]


# thresholds: a step over one of them logs a warning (configurable by assigning to this dict)
THRESHOLDS: dict[str, float] = {
    "skipped_groups": 0.25,           # fraction of the step's groups
    "unattributed_calls": 1,          # calls since the previous step
    "late_calls": 1,                  # calls since the previous step
    "orphan_calls": 1,                # calls of rollout ids no trajectory claimed
    "prefix_mismatch_fraction": 0.2,  # of turns after the first
    "rendered_fraction": 0.01,        # of trained rows
    "template_mismatch_fraction": 0.01,
    "engine_kl": 0.05,                # nats per sampled token
    "length_clipped_fraction": 0.3,   # of completions
    "past_turn_end": 1,               # completions that went on past their turn's end
    "fingerprint_mismatches": 1,      # calls served by other weights than they claim
}


def starting_entropy(history: Iterable[dict[str, Any]], current: float) -> float:
    """The sampled tokens' entropy of the adapter's first logged training step (``current``
    when this step is the first): the baseline an entropy collapse falls from. A small model
    can sample with little entropy from the start (SmolLM2-135M on a templated tool call:
    ~0.02 nats/token), which is no collapse."""
    for h in history:
        if h.get("split") == "train" and "sampled_entropy" in h:
            return float(h["sampled_entropy"])
    return current


def collapse_thresholds() -> dict[str, float]:
    """The collapse warning's thresholds, from their settings (an entry of the same name in
    :data:`THRESHOLDS` wins): ``identical_groups`` (a fraction of the step's groups) and
    ``collapse_entropy`` (nats per sampled token, under which a step of flat rewards warns)."""
    return {"identical_groups": settings.TRACERL_COLLAPSE_IDENTICAL_GROUPS.get(),
            "collapse_entropy": settings.TRACERL_COLLAPSE_ENTROPY.get()}


COLLAPSE_FIX = ("the policy collapsed onto one answer: keep entropy up with a lower "
                "learning_rate (or warmup_steps), larger groups (more rollouts per item) and "
                "dynamic sampling (gather_trajectory_groups(..., "
                "dynamic_sampling=tracerl.DynamicSampling())); clip-higher "
                "(TrainConfig(epsilon_high=0.28)) acts only when a batch is reused "
                "(num_epochs > 1) or trained off-policy; then restart from a checkpoint from "
                "before the collapse")


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def step_warnings(m: dict[str, Any], thresholds: dict[str, float] | None = None
                  ) -> list[HealthWarning]:
    """The warnings a step's metrics call for (empty when healthy)."""
    t = {**collapse_thresholds(), **THRESHOLDS, **(thresholds or {})}
    out = _learning_warnings(m, t)
    groups, skipped = float(m.get("groups", 0) or 0), float(m.get("skipped_groups", 0) or 0)
    if groups and skipped / groups >= t["skipped_groups"]:
        seen = (f"all {skipped:.0f} groups" if skipped >= groups
                else f"{skipped:.0f} of {groups:.0f} groups")
        if skipped >= groups and m.get("reward_std") == 0.0 and "reward" in m:
            out.append(HealthWarning(  # every trajectory of the step had the same reward
                "skipped_groups", f"{seen} had the same reward {m['reward']:.3g}, all of them "
                "(no learning signal)", "the task is solved (or never rewarded) at this "
                "difficulty: stop here, or make the tasks harder or the reward finer"))
        else:
            out.append(HealthWarning(
                "skipped_groups", f"{seen} had equal rewards (no learning signal)",
                "widen the reward (partial credit) or raise the group size"))
    if float(m.get("unattributed_calls", 0) or 0) >= t["unattributed_calls"]:
        out.append(HealthWarning(
            "unattributed_calls",
            f"{m['unattributed_calls']:.0f} calls reached the gateway without a rollout id and "
            "were not trained on",
            "make the calls inside gather_trajectory_groups / tracerl.rollout_scope with "
            "model.openai_client(), or send the x-rollout-id header"))
    if float(m.get("late_calls", 0) or 0) >= t["late_calls"]:
        out.append(HealthWarning(
            "late_calls",
            f"{m['late_calls']:.0f} calls reached the gateway after their rollout was finished "
            "(POST /v1/rollouts/{id}/finish) and were not trained on",
            "finish a rollout only once every call it made has returned"))
    if float(m.get("orphan_calls", 0) or 0) >= t["orphan_calls"]:
        out.append(HealthWarning(
            "orphan_calls",
            f"{m['orphan_calls']:.0f} calls were recorded under rollout ids that no trained or "
            "logged trajectory claimed (made-up x-rollout-id values, failed rollouts, dropped "
            "groups)",
            "send the rollout id your trajectory gets (tracerl's clients, or the rollout_id "
            "from POST /v1/rollouts), and finish every opened rollout"))
    mismatch = float(m.get("prefix_mismatch_fraction", 0) or 0)
    if mismatch >= t["prefix_mismatch_fraction"]:
        out.append(_mismatch_warning(m, mismatch))
    checks = (
        ("rendered_fraction", "{pct} of trained rows were re-rendered text, not engine tokens",
         "the calls were not recorded by the gateway: use model.openai_client() (or the "
         "gateway's base_url) inside each rollout so token ids and logprobs are kept"),
        ("template_mismatch_fraction",
         "the trainer's chat template renders {pct} of recorded prompts differently from the "
         "engine", "serve and train with the same EngineConfig.chat_template; run "
         "`tracerl doctor --live` to compare them"),
        ("length_clipped_fraction", "{pct} of completions were cut at max_tokens",
         "raise max_tokens, or reward shorter answers"),
    )
    for item, message, fix in checks:
        value = float(m.get(item, 0) or 0)
        if value >= t[item]:
            out.append(HealthWarning(item, message.format(pct=_pct(value)), fix))
    out.extend(_past_turn_end_warning(m, t["past_turn_end"]))
    wrong = float(m.get("fingerprint_mismatches", 0) or 0)
    if wrong >= t["fingerprint_mismatches"]:
        out.append(HealthWarning(
            "fingerprint_mismatches",
            f"{wrong:.0f} calls were served by other weights than the policy version they claim "
            "(the engine's adapter digest differs from the checkpoint's); refused, not trained on",
            "something loaded another adapter into the engine, or a sync failed: check what "
            "loads adapters besides tracerl, then `tracerl doctor --run MODEL_DIR`"))
    kl = float(m.get("engine_kl", 0) or 0)
    if kl >= t["engine_kl"]:
        out.append(HealthWarning(
            "engine_kl",
            f"engine and trainer logprobs of the sampled tokens disagree (KL {kl:.3g} nats/token)",
            "the engine serves other weights, another adapter, dtype or chat template than the "
            "trainer; run `tracerl doctor --live`"))
    return out


def _learning_warnings(m: dict[str, Any], t: dict[str, float]) -> list[HealthWarning]:
    """An entropy collapse (:func:`_collapse_warning`); a step trained at learning rate 0."""
    out = [w for w in (_collapse_warning(m, t),) if w is not None]
    if m.get("learning_rate") == 0.0 and not m.get("skipped"):
        out.append(HealthWarning(
            "learning_rate", "the step trained at learning rate 0: its adapter is past the "
            "schedule's max_steps (TrainConfig.lr_scheduler_type decays to 0 there)",
            "raise max_steps to the run's length, or train at lr_scheduler_type='constant'"))
    return out


COLLAPSE_FALL = 0.5  # an entropy collapse: under this share of the first step's entropy


def _collapse_warning(m: dict[str, Any], t: dict[str, float]) -> HealthWarning | None:
    """The step's rollouts became identical within their groups, or its sampled tokens' entropy
    fell under ``collapse_entropy`` and under half its value at the adapter's first step
    (``sampled_entropy_start``) while the rewards were flat (most groups equal)."""
    groups = float(m.get("groups", 0) or 0)
    if not groups:
        return None
    identical = float(m.get("identical_groups", 0) or 0)
    flat = float(m.get("skipped_groups", 0) or 0)  # groups with equal rewards
    entropy = m.get("sampled_entropy", m.get("entropy"))
    if identical / groups >= t["identical_groups"]:
        seen = (f"all {identical:.0f} groups" if identical >= groups
                else f"{identical:.0f} of {groups:.0f} groups")
        message = f"{seen} sampled the same completion in every rollout"
    elif (entropy is not None and float(entropy) < t["collapse_entropy"]
          and float(entropy) < COLLAPSE_FALL * float(m.get("sampled_entropy_start", 0.0))
          and flat / groups >= 0.5):
        message = (f"the sampled tokens' entropy fell to {float(entropy):.3g} nats/token (from "
                   f"{float(m['sampled_entropy_start']):.3g} at the adapter's first step) while "
                   f"{flat:.0f} of {groups:.0f} groups had equal rewards")
    else:
        return None
    return HealthWarning("collapse", f"entropy collapse: {message}", COLLAPSE_FIX)


EDITS_FIX = ("the agent edits history between calls (trims, summarises or rewrites messages): "
             "keep earlier messages verbatim, or accept one training row per such call")


def _mismatch_warning(m: dict[str, Any], fraction: float) -> HealthWarning:
    """Why turns did not continue their rollout's tokens, by the reasons their records give."""
    edits, new = float(m.get("history_edits", 0) or 0), float(m.get("new_conversations", 0) or 0)
    unspliced = float(m.get("unspliced_turns", 0) or 0)
    reasons, fixes = [], []
    if edits:
        at = m.get("history_edit_message")
        reasons.append(f"{edits:.0f} where the agent edited history"
                       + (f", first at message {at:.0f}" if at is not None else ""))
        fixes.append(EDITS_FIX)
    if unspliced:
        reasons.append(f"{unspliced:.0f} the gateway did not splice")
        fixes.append("see each call's metadata['turn']['why'] (a chat template that renders "
                     "history differently once later messages follow, completions cut at "
                     "max_tokens, or an engine that renders its own prompts)")
    if new:
        reasons.append(f"{new:.0f} that started a conversation of their own (subagents)")
        fixes.append("each conversation of a rollout trains as its own row")
    seen = f" ({'; '.join(reasons)})" if reasons else ""
    return HealthWarning("prefix_mismatch_fraction",
                         f"prompt did not continue the previous call's tokens in "
                         f"{_pct(fraction)} of turns{seen}",
                         # metrics from before the reasons were counted: the old advice
                         "; ".join(fixes) or EDITS_FIX)


def log_warnings(step: int, metrics: dict[str, Any]) -> list[HealthWarning]:
    """Log each warning of a step's metrics; returns them."""
    warnings = step_warnings(metrics)
    for w in warnings:
        log.warning("step %d: %s", step, w)
    return warnings


def token_logprobs_path(root: Any, step: int) -> Any:
    return root / TOKEN_LOGPROBS_DIR / f"{step:04d}.jsonl"


def write_token_logprobs(store: ModelStore, step: int, rows: Iterable[Any]) -> None:
    """Per trained row: its group, trajectory, and the engine's and trainer's logprobs of its
    trained tokens (what the viewer shows per token); with per-turn credit their advantages."""
    import json

    lines = []
    for row in rows:
        engine = [lp for lp, m in zip(row.old_logprobs, row.loss_mask, strict=True) if m]
        line = {"group": row.group, "trajectory": row.trajectory,
                "engine": engine, "trainer": row.trainer_logprobs or []}
        if row.advantages is not None:  # per-turn credit: each trained token's advantage
            line["advantages"] = [a for a, m in zip(row.advantages, row.loss_mask,
                                                    strict=True) if m]
        lines.append(json.dumps(line))
    path = token_logprobs_path(store.root, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(line + "\n" for line in lines))
