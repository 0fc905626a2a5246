"""``tracerl doctor``: a healthy run passes; a run with each step-health problem is flagged with
the fix; agent runs are explained in agent terms (tool calls, turns per rollout, calls outside
rollouts, equal-reward groups) and a solved task is not called a failure; the live check catches
an engine with another chat template than the trainer; the environment checks see a port in
use."""

import json
import logging
import os
import socket
import subprocess
import sys

import pytest

import tracerl
from tracerl.core.trajectory import read_groups_jsonl
from tracerl.doctor import environment_checks, live_checks

PROBLEM_ITEMS = ["skipped_groups", "unattributed_calls", "prefix_mismatch_fraction",
                 "rendered_fraction", "length_clipped_fraction"]
# (template_mismatch_fraction: a step trains only its own model's calls since sub-agents, so the
# fixture cannot make one through the gateway; tests/test_training_health.py counts it directly)


def doctor_json(*args: str) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-m", "tracerl", "doctor", "--json", *args],
                         capture_output=True, text=True, timeout=120, env=os.environ)
    return out.returncode, json.loads(out.stdout)


@pytest.fixture(scope="module")
async def healthy_run(tf_backend):
    """One step of a fresh model: distinct rewards, single short greedy calls, no problems.
    Each rollout of a group asks its own number (greedy calls of one prompt would sample one
    completion per group: the doctor's collapse)."""
    backend, _ = tf_backend
    model = tracerl.TrainableModel(
        name="healthy", project="tests", base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256)))
    await model.register(backend)

    async def rollout(number: str, i: int) -> tracerl.Trajectory:
        asked = number if i == 0 else number[::-1]
        messages = [{"role": "system", "content": "Reply with the number only."},
                    {"role": "user", "content": f"Repeat this number: {asked}"}]
        response = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=16, temperature=0.0)
        return tracerl.Trajectory(messages_and_choices=[*messages, response.choices[0]],
                                  reward=float(i))

    groups = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(rollout(n, i) for i in range(2)) for n in ("4721", "38")],
        show_progress=False)
    await model.train(groups, config=tracerl.TrainConfig(learning_rate=1e-5))
    return backend.store(model).root


def test_a_healthy_run_passes(healthy_run):
    rc, report = doctor_json("--no-env", "--run", str(healthy_run))
    assert rc == 0 and report["status"] == "pass", report
    assert {f["check"] for f in report["findings"]} >= set(PROBLEM_ITEMS) | {"engine_kl"}


@pytest.fixture(scope="module")
def unhealthy_report(unhealthy_step):
    return doctor_json("--no-env", "--run", str(unhealthy_step[3]))


@pytest.mark.parametrize("item", PROBLEM_ITEMS)
def test_each_problem_of_a_run_is_flagged_with_its_fix(unhealthy_report, item):
    rc, report = unhealthy_report
    (finding,) = [f for f in report["findings"] if f["check"] == item]
    assert finding["status"] in ("warn", "fail") and finding["fix"], finding
    assert report["status"] in ("warn", "fail") and rc == (report["status"] == "fail")


async def test_live_check_catches_a_trainer_with_another_chat_template(monkeypatch, caplog):
    """Engine: SmolLM2's own template; trainer: chatml-tools (another default system prompt).
    Round-trip, logprobs (on the engine's tokens) and the adapter swap still pass. The engine's
    start is watched (threshold 0 here, so the watchdog reports it)."""
    monkeypatch.setenv("TRACERL_WATCHDOG_ENGINE_START_S", "0")
    caplog.set_level(logging.WARNING, logger="tracerl.watchdog")
    findings = {f.check: f for f in await live_checks(trainer_chat_template="chatml-tools")}
    assert findings["engine vs trainer template"].status == "fail", findings
    assert "0 of 3 engine prompts" in findings["engine vs trainer template"].detail
    for check in ("template round-trip", "engine vs trainer logprobs", "adapter swap"):
        assert findings[check].status == "pass", findings[check]
    assert any("engine start for" in r.getMessage() and "has not answered" in r.getMessage()
               for r in caplog.records if r.name == "tracerl.watchdog")


CALCULATOR = {"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "number"},
                                                    "b": {"type": "number"}}}}}


async def agent_run(backend, name: str, reward: float, *, tools: bool) -> tracerl.TrainableModel:
    """Two steps of a two-turn agent (greedy, real calls through the gateway); every rollout
    gets ``reward``. With ``tools`` each call offers a calculator (its validity is then parsed
    from the recorded calls), else the agent logs its own ``tool_call_valid`` metric."""
    model = tracerl.TrainableModel(
        name=name, project="tests", base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256)))
    await model.register(backend)

    async def rollout(number: str) -> tracerl.Trajectory:
        messages = [{"role": "system", "content": "Reply with the number only."},
                    {"role": "user", "content": f"Repeat this number: {number}"}]
        extra = {"tools": [CALCULATOR]} if tools else {}
        for _ in range(2):
            response = await model.openai_client().chat.completions.create(
                model=model.get_inference_name(), messages=messages, max_tokens=16,
                temperature=0.0, **extra)
            choice = response.choices[0]
            messages = [*messages, choice.message.model_dump(exclude_none=True),
                        {"role": "user", "content": "Once more."}]
        return tracerl.Trajectory(messages_and_choices=[*messages[:-1]], reward=reward,
                                  metrics={} if tools else {"tool_call_valid": 1.0})

    for step in range(2):
        groups = await tracerl.gather_trajectory_groups(
            [tracerl.TrajectoryGroup(rollout(f"{n}{step}") for _ in range(2))
             for n in ("47", "38")], show_progress=False)
        await model.train(groups, config=tracerl.TrainConfig(learning_rate=1e-5))
    return model


def by_check(report: dict) -> dict[str, dict]:
    return {f"{f['area']}/{f['check']}": f for f in report["findings"]}


async def test_a_solved_agent_run_is_reported_solved_not_a_failure(tf_backend):
    """Every rollout at reward 1 (held-out success 1): all groups have equal rewards, and the
    doctor says the task is solved instead of "no learning signal"."""
    backend, _ = tf_backend
    model = await agent_run(backend, "agent_solved", 1.0, tools=False)
    held_out = tracerl.Trajectory(reward=1.0, metrics={"success": 1.0}, messages_and_choices=[
        {"role": "user", "content": "Repeat this number: 5"},
        {"role": "assistant", "content": "5"}])
    await model.log([tracerl.TrajectoryGroup([held_out])], split="val")
    history = await model.history()
    assert all(h["skipped_groups"] == h["groups"] == 2 for h in history if h["split"] == "train")
    _, report = doctor_json("--no-env", "--run", str(backend.store(model).root))
    found = by_check(report)
    assert found["run/skipped_groups"]["status"] == "pass", found["run/skipped_groups"]
    equal = found["agent/equal-reward groups"]
    assert equal["status"] == "pass" and equal["detail"].startswith("solved: 2 of 2 steps")
    assert "held-out success 1.00" in equal["detail"]
    assert "no learning signal" not in json.dumps(report)
    turns = found["agent/turns per rollout"]
    assert turns["status"] == "pass"
    assert turns["detail"].startswith(
        "2.0 LLM calls per rollout at the first step, 2.0 at the last")
    tool = found["agent/tool calls"]
    assert tool["status"] == "pass"
    assert "1.00 at the last (metrics/tool_call_valid" in tool["detail"]
    assert found["agent/calls outside rollouts"]["status"] == "pass"


async def test_an_agent_run_with_no_signal_is_explained_in_agent_terms(tf_backend):
    """Every rollout at reward 0 (never rewarded): no learning signal, flagged; the offered tool
    is judged from the recorded calls; a call made outside any rollout is counted."""
    backend, _ = tf_backend
    model = await agent_run(backend, "agent_zero", 0.0, tools=True)
    await model.openai_client().chat.completions.create(  # no rollout around it
        model=model.get_inference_name(), max_tokens=2,
        messages=[{"role": "user", "content": "Hi"}])
    await model.train([tracerl.TrajectoryGroup([  # a step after it, which counts it
        tracerl.Trajectory(reward=float(i), messages_and_choices=[
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": a}])
        for i, a in enumerate(("yes", "no"))])])
    _, report = doctor_json("--no-env", "--run", str(backend.store(model).root))
    found = by_check(report)
    assert found["run/skipped_groups"]["status"] in ("warn", "fail")
    assert "no learning signal" in found["run/skipped_groups"]["detail"]
    equal = found["agent/equal-reward groups"]
    assert equal["status"] == "warn" and equal["detail"].startswith("4 of 5 groups")
    assert "0 steps solved; no held-out success logged" in equal["detail"]
    stray = found["agent/calls outside rollouts"]
    assert stray["status"] == "warn" and stray["detail"].startswith("1 calls without a rollout")
    saved = [t for step in (1, 2) for g in read_groups_jsonl(
        backend.store(model).trajectories_path("train", step)) for t in g.trajectories]
    calls = [c for t in saved for c in t.llm_calls]
    assert len(calls) == 16 and all(c.request.get("tools") for c in calls)
    attempts = sum(bool(comp.tool_calls) or "<tool_call>" in comp.text or '{"name"' in comp.text
                   for c in calls for comp in c.completions)
    tool = found["agent/tool calls"]
    if attempts:
        assert f"({attempts} tool-call attempts in the recorded calls)" in tool["detail"], tool
    else:
        assert tool["status"] == "warn" and tool["detail"].startswith(
            "16 recorded calls offered tools; the model called none"), tool
    assert "turns per rollout" in {f["check"] for f in report["findings"]}


def test_environment_checks_see_a_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        findings = {f.check: f for f in environment_checks(ports=(port,))}
    assert findings[f"port {port}"].status == "warn" and "--port" in findings[f"port {port}"].fix
    assert findings["python"].status == "pass" and findings["torch"].status == "pass"
