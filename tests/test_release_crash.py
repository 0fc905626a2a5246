"""kill -9 of a real ``tracerl serve`` at each commit point of a promotion
(tests/release_crash_plugin.py): before and after its ``begin`` record, before and after its
``commit``. Each restart must serve one incumbent, the committed one (the old version unless
the commit was on disk), say in the release log what happened, and answer calls with it."""

from __future__ import annotations

import asyncio
import json
import urllib.request

from tests.conftest import make_random_lora, until
from tracerl.core.fingerprint import adapter_digest
from tracerl.core.release_log import ReleaseLog
from tracerl.core.storage import ModelStore

from .remote_server import API_KEY, ServerProcess, registered_on

PLUGIN = ("--plugin", "tests.release_crash_plugin")


def post(url: str, body: dict) -> None:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {API_KEY}",
                                              "Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=300).read()


async def served_step(srv: ServerProcess) -> tuple[int, str | None]:
    import tracerl

    model = await registered_on(srv.url, "crash", "rel", tracerl.ModelConfig(
        engine=tracerl.EngineConfig(max_model_len=256)))
    try:
        with tracerl.rollout_scope() as ro:
            await model.openai_client().chat.completions.create(
                model=model.get_inference_name(), messages=[{"role": "user", "content": "Hi"}],
                max_tokens=2, temperature=0.0)
        (call,) = await model.fetch_calls(ro.rollout_id)
    finally:
        await model.backend.close()
    return call.adapter_step, call.adapter_digest


async def test_kill_9_at_each_commit_point_of_a_promotion_restarts_on_one_incumbent(
        tmp_path, smollm2_path):
    store = ModelStore(tmp_path / "data", "rel", "crash")
    for step in (1, 2):
        await asyncio.to_thread(make_random_lora, smollm2_path, store.checkpoint_dir(step), step)
    releases = ReleaseLog(store.root)
    releases.begin("adopt", 1, None)
    releases.commit("adopt", 1)
    srv = ServerProcess(tmp_path)
    incumbent = 1
    for point in (0, 1, 2, 3, None):
        marker = tmp_path / f"stalled-{point}"
        srv.env = {"TRACERL_TEST_CRASH_AT": str(point if point is not None else -1),
                   "TRACERL_TEST_CRASH_MARKER": str(marker)}
        await asyncio.to_thread(srv.start, extra_args=PLUGIN)
        step, digest = await served_step(srv)  # the restart serves the committed incumbent
        assert step == incumbent == releases.state().incumbent, (point, step, incumbent)
        assert digest == adapter_digest(store.checkpoint_dir(incumbent))
        if point is None:
            break
        target = 2 if incumbent == 1 else 1
        url = f"{srv.url}/api/v1/models/rel/crash/release/promote"
        promoting = asyncio.ensure_future(asyncio.to_thread(post, url, {"step": target}))
        await until(marker.exists, f"the promotion to stall at point {point}", timeout_s=120)
        srv.kill9()
        promoting.cancel()
        records = releases.records()
        committed = point == 3
        assert (records[-1]["event"], records[-1]["step"]) == (
            ("commit", target) if committed else ("begin", target)) or point == 0
        if committed:
            incumbent = target
    events = [r["event"] for r in releases.records()]
    # points 1 and 2 left a begin without commit: each restart said so
    assert events.count("recovered") == 2, events
    srv.stop()
