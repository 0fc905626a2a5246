"""``tracerl doctor``: a healthy run passes; a run with each step-health problem is flagged with
the fix; the live check catches an engine with another chat template than the trainer; the
environment checks see a port in use."""

import json
import logging
import os
import socket
import subprocess
import sys

import pytest

import tracerl
from tracerl.doctor import environment_checks, live_checks

PROBLEM_ITEMS = ["skipped_groups", "unattributed_calls", "prefix_mismatch_fraction",
                 "rendered_fraction", "template_mismatch_fraction", "length_clipped_fraction"]


def doctor_json(*args: str) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-m", "tracerl", "doctor", "--json", *args],
                         capture_output=True, text=True, timeout=120, env=os.environ)
    return out.returncode, json.loads(out.stdout)


@pytest.fixture(scope="module")
async def healthy_run(tf_backend):
    """One step of a fresh model: distinct rewards, single short greedy calls, no problems."""
    backend, _ = tf_backend
    model = tracerl.TrainableModel(
        name="healthy", project="tests", base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256)))
    await model.register(backend)

    async def rollout(number: str, i: int) -> tracerl.Trajectory:
        messages = [{"role": "system", "content": "Reply with the number only."},
                    {"role": "user", "content": f"Repeat this number: {number}"}]
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


def test_environment_checks_see_a_port_in_use():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        findings = {f.check: f for f in environment_checks(ports=(port,))}
    assert findings[f"port {port}"].status == "warn" and "--port" in findings[f"port {port}"].fix
    assert findings["python"].status == "pass" and findings["torch"].status == "pass"
