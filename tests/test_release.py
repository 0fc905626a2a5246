"""Release control against a real gateway (transformers engine): a candidate is loaded beside
the incumbent, replayed in shadow, served to a sticky share of rollouts, judged by the gates on
the rewards that came back, and promoted or rolled back -- with calls in flight the whole time,
none failing. The release log replays to one incumbent after a begin without its commit."""

import asyncio

import pytest

import tracerl
from tests.conftest import make_random_lora
from tracerl.backend.online.gates import Gates, arm_evidence, judge
from tracerl.backend.online.release import ReleaseControl, canary_bucket
from tracerl.core.fingerprint import adapter_digest
from tracerl.core.release_log import ReleaseLog
from tracerl.core.trajectory import CompletionRecord, LLMCall

MESSAGES = [{"role": "user", "content": "Name a color."}]


def test_the_log_restarts_on_the_committed_incumbent_after_a_begin_without_commit(tmp_path):
    log = ReleaseLog(tmp_path)
    log.begin("adopt", 0, None)
    log.commit("adopt", 0)
    log.begin("promote", 3, 0)  # killed here: no commit
    with open(log.path, "ab") as f:
        f.write(b'{"seq": 3, "event": "comm')  # and a torn line after it
    state = log.recover()
    assert state.incumbent == 0 and state.pending is None
    last = log.records()[-1]
    assert last["event"] == "recovered" and last["aborted"] == {"action": "promote", "step": 3,
                                                                  "from": 0}
    log.begin("promote", 3, 0)
    log.commit("promote", 3)
    assert log.recover().incumbent == 3 and log.records()[-1]["event"] == "commit"


def _call(tokens: list[int], latency: float = 0.1, error: str | None = None) -> LLMCall:
    return LLMCall(id="c", latency_s=latency, error=error,
                   completions=[CompletionRecord(index=0, token_ids=tokens, text="x")])


def test_gates_promote_roll_back_hold_and_wait():
    gates = Gates(min_samples=8)
    normal = [_call(list(range(20))) for _ in range(10)]
    inc = arm_evidence(normal, [0.5, 0.6] * 5)
    assert judge(arm_evidence(normal, [0.55, 0.65] * 5), inc, gates).decision == "promote"
    worse = judge(arm_evidence(normal, [0.0, 0.1] * 5), inc, gates)
    assert worse.decision == "rollback" and "reward" in worse.tripped[0]
    assert judge(arm_evidence(normal, [0.5] * 3), inc, gates).decision == "continue"
    looping = judge(arm_evidence([_call([7, 8, 9, 10] * 10) for _ in range(10)],
                                 [0.55, 0.65] * 5), inc, gates)
    assert looping.decision == "hold" and "repeated 4-grams" in looping.tripped[0]
    erring = [_call([], error="boom") for _ in range(5)] + normal[:5]
    assert judge(arm_evidence(erring, [0.5, 0.6] * 5), inc, gates).decision == "rollback"


def test_a_candidate_surely_worse_beyond_the_margin_is_rolled_back_without_waiting():
    """The online benchmark's inverted candidate (2026-12-07): 0.61 over 54 rewards against the
    incumbent's 0.81 over 47. Surely worse (upper bound -0.05), most likely by more than the
    margin 0.1, but not surely by more than it: the verdict was "continue" for ever."""
    gates = Gates(min_samples=8, margin=0.1)
    calls = [_call(list(range(20))) for _ in range(10)]
    incumbent = arm_evidence(calls, [1.0] * 38 + [0.0] * 9)
    verdict = judge(arm_evidence(calls, [1.0] * 33 + [0.0] * 21), incumbent, gates)
    assert verdict.evidence["reward_diff_upper"] > -gates.margin  # the first rule alone waits
    assert verdict.decision == "rollback", verdict
    assert verdict.tripped == ["reward: candidate worse by 0.197, more than the margin 0.1 "
                               "(upper bound -0.0517 < 0)"]
    # surely worse, but by less than the margin: promoted, as the margin allows
    close = judge(arm_evidence(calls, [1.0] * 7_800 + [0.0] * 2_200),
                  arm_evidence(calls, [1.0] * 8_000 + [0.0] * 2_000), gates)
    assert close.evidence["reward_diff_upper"] < 0 and close.decision == "promote"


@pytest.fixture(scope="module")
async def rel_model(tf_backend, smollm2_path):
    backend, _ = tf_backend
    model = tracerl.TrainableModel(
        name="rel", project="tests", base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256)))
    await model.register(backend)
    store = backend.store(model)
    for step in (1, 2):
        await asyncio.to_thread(make_random_lora, smollm2_path, store.checkpoint_dir(step), step)
    # no latency monitor: on a loaded CPU a call's latency is the machine's, not the version's
    # (two shadow calls a version: one slow call was a "hold" that failed this test in CI)
    control = ReleaseControl(backend, model, Gates(min_samples=4, p95_latency_ratio=1e9))
    await control.enable()
    return backend, model, store, control


async def rollout(model) -> tuple[str, LLMCall]:
    with tracerl.rollout_scope() as ro:
        await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=MESSAGES, max_tokens=3, temperature=0.0)
    (call,) = await model.fetch_calls(ro.rollout_id)
    return ro.rollout_id, call


async def calls_on_both_arms(model, served: dict[str, LLMCall], steps: tuple[int, int]
                             ) -> dict[str, LLMCall]:
    """``served`` and more rollouts until each of ``steps`` served the gates' 4 (the canary
    hashes random rollout ids: 16 rollouts leave an arm short of 4 in 2% of runs, the second
    canary's 14 in 6%)."""
    while min(sum(c.adapter_step == s for c in served.values()) for s in steps) < 4:
        assert len(served) < 60, f"an arm served fewer than 4 of {len(served)} rollouts"
        served.update([await rollout(model) for _ in range(4)])
    return served


async def test_a_bad_canary_is_rolled_back_and_a_good_one_promoted_without_a_failed_call(
        rel_model):
    _, model, store, control = rel_model
    assert control.state().incumbent == 0  # adopted: the base model served
    await control.propose(1)
    verdict = await control.shadow([{"messages": MESSAGES}] * 2, lambda s, text: 1.0)
    assert verdict.decision in ("promote", "continue"), verdict.tripped
    assert control.state().candidate == 1
    await control.start_canary(0.5)

    served = await calls_on_both_arms(model, dict(await asyncio.gather(
        *(rollout(model) for _ in range(16)))), (0, 1))
    for rid, call in served.items():  # sticky hash: the canary's share, by rollout id
        assert call.adapter_step == (1 if canary_bucket(rid) < 0.5 else 0), rid
    assert {c.adapter_step for c in served.values()} == {0, 1}

    # an inverted reward: the candidate's rollouts all score 0
    bad = await control.evaluate({rid: float(c.adapter_step == 0) for rid, c in served.items()})
    assert bad.decision == "rollback" and control.state().incumbent == 0
    assert control.state().candidate is None
    assert {c.adapter_step for _, c in await asyncio.gather(
        *(rollout(model) for _ in range(4)))} == {0}

    await control.propose(2)
    await control.start_canary(0.5)
    traffic = [asyncio.ensure_future(rollout(model)) for _ in range(12)]
    second = await calls_on_both_arms(model, dict(await asyncio.gather(*traffic[:6])), (0, 2))
    good = asyncio.ensure_future(control.evaluate(
        {rid: 0.5 + 0.1 * (c.adapter_step == 2) + 0.01 * (hash(rid) % 3)
         for rid, c in second.items()}))
    later = await asyncio.gather(*traffic[6:])  # calls in flight across the promotion
    verdict = await good
    assert verdict.decision == "promote", verdict.evidence
    assert all(c.error is None for _, c in later)
    state = control.state()
    assert state.incumbent == 2 and state.history[-1]["action"] == "promote"
    _, call = await rollout(model)
    assert call.adapter_step == 2
    assert call.adapter_digest == adapter_digest(store.checkpoint_dir(2))

    await control.rollback(0)
    _, call = await rollout(model)
    assert call.adapter_step == 0 and control.state().incumbent == 0
    events = [r["event"] for r in control.log.records()]
    assert events[:2] == ["begin", "commit"] and "rejected" in events and "gate" in events


def test_promote_and_rollback_commands_write_the_log_of_a_stopped_server(tmp_path):
    import subprocess
    import sys

    from tracerl.core.storage import ModelStore

    store = ModelStore(tmp_path, "p", "m")
    store.checkpoint_dir(3).mkdir(parents=True)

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tracerl", *args, "--path", str(tmp_path)],
                              capture_output=True, text=True, timeout=120)

    # no model.json: no such model (before, its release log was written and the exit was 0)
    files = sorted(tmp_path.rglob("*"))
    for args in (("promote", "p/m", "3"), ("rollback", "p/m", "--to", "0"),
                 ("promote", "p/absent", "0")):
        out = cli(*args)
        assert out.returncode == 2 and "holds no model p/" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    assert sorted(tmp_path.rglob("*")) == files  # nothing written
    store.write_definition(tracerl.TrainableModel(name="m", project="p",
                                                  base_model="smollm2").spec.definition())
    assert cli("promote", "p/m", "4").returncode == 2  # no checkpoint 4: refused, nothing written
    assert not ReleaseLog(store.root).exists()
    assert cli("promote", "p/m", "3").returncode == 0
    assert cli("rollback", "p/m", "--to", "0").returncode == 0
    state = ReleaseLog(store.root).state()
    assert state.incumbent == 0 and [h["action"] for h in state.history] == ["promote", "rollback"]


def test_promote_with_the_server_down_is_a_one_line_error(tmp_path):
    """Nothing listens on the port: a clear line naming the server, no URLError traceback."""
    import subprocess
    import sys

    from tests.remote_server import free_port

    server = f"http://127.0.0.1:{free_port()}"
    out = subprocess.run([sys.executable, "-m", "tracerl", "promote", "p/m", "1", "--server",
                          server], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(f"tracerl: error: could not reach tracerl serve at {server}"), line


@pytest.mark.parametrize("field, value", [("p95_latency_ratio", float("inf")),
                                          ("margin", float("nan")),
                                          ("length_ratio", (0.5, float("inf")))])
def test_a_gate_that_is_not_a_finite_number_is_refused_naming_it(field, value):
    with pytest.raises(tracerl.ConfigError, match=f"Gates.{field} must be a finite number"):
        Gates(**{field: value})
