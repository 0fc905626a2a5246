"""The watchdog: a wait past its threshold says what it waits on, for real waits (a rollout that
never returns, a swap held by a request in flight, a training step), and keeps saying it."""

import asyncio
import logging

import pytest

import tracerl
from tests.conftest import until
from tracerl.backend.gateway.app import ServedModel


@pytest.fixture
def fast_watchdog(monkeypatch, caplog):
    monkeypatch.setenv("TRACERL_WATCHDOG_GATHER_S", "0.2")
    monkeypatch.setenv("TRACERL_WATCHDOG_SWAP_S", "0.2")
    monkeypatch.setenv("TRACERL_WATCHDOG_INTERVAL_S", "0.2")
    caplog.set_level(logging.WARNING, logger="tracerl.watchdog")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "tracerl.watchdog"]


async def test_a_rollout_that_never_returns_is_named_with_its_last_call(tf_backend,
                                                                         fast_watchdog):
    _, model = tf_backend
    release = asyncio.Event()

    async def stuck() -> tracerl.Trajectory:
        messages = [{"role": "user", "content": "Say hi."}]
        response = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(), messages=messages, max_tokens=2)
        await release.wait()  # never returns until the test has seen the watchdog speak
        return tracerl.Trajectory(messages_and_choices=[*messages, response.choices[0]],
                                  reward=0.0)

    async def quick() -> tracerl.Trajectory:
        return tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}],
                                  reward=1.0)

    gather = asyncio.create_task(tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup([stuck(), quick()])], pbar_desc="stuck", show_progress=False))
    await until(lambda: len([m for m in fast_watchdog() if "gather stuck" in m]) >= 2,
                "two watchdog reports of the stuck gather", timeout_s=60)
    release.set()
    (group,) = await gather
    message = [m for m in fast_watchdog() if "gather stuck" in m][-1]
    assert "1 of 2 rollouts still running: rollout 0 of group 0" in message
    assert group.trajectories[0].rollout_id in message
    assert "last call POST /v1/chat/completions" in message


async def test_a_held_swap_names_the_requests_in_flight(tf_backend, fast_watchdog, tmp_path):
    backend, model = tf_backend
    route = backend.gateway.models[model.spec.key]
    served = ServedModel(name="watched", engine=route.engine, store=route.store)
    await served.swap.acquire_read(30)  # what a request in flight holds
    swap = asyncio.create_task(served.swap_adapter(1, tmp_path))
    await until(lambda: any("adapter swap of watched" in m for m in fast_watchdog()),
                "the watchdog's report of the held swap", timeout_s=30)
    swap.cancel()
    served.swap.release_read()
    message = next(m for m in fast_watchdog() if "adapter swap of watched" in m)
    assert message.endswith("a swap holds new requests; 1 requests in flight hold the swap lock")


def test_a_training_step_says_what_it_waits_on(unhealthy_step):
    _, _, watchdog, _ = unhealthy_step
    step = [m for m in watchdog if " on training step " in m]
    assert step and any(m.endswith("(a worker thread)") for m in step), watchdog
