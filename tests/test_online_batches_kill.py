"""kill -9 of a real ``tracerl serve --online`` after the first failed try of an online batch
whose training fails for real (tests/online_failing_batch_plugin.py: a reward the trainer's row
checks refuse). The try count is on disk: the restart sets the batch aside after the remaining
``batch_tries`` tries, not after a fresh set of them; a second kill -9 and restart do not
resurrect it; later good feedback trains (the loop moved on); and ``failed_batches.jsonl`` has no
torn line. The SIGKILL twin of tests/test_online_batches.py's restart test."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

import tracerl
from tests.conftest import until
from tracerl.backend.online.batches import FAILED_BATCHES
from tracerl.backend.online.live_calls import events_path
from tracerl.core.storage import ModelStore, read_jsonl
from tracerl.core.trajectory import read_groups_jsonl

from .remote_server import API_KEY, ServerProcess, registered_on

CONFIG = tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=128))
# poll_s leaves the test 10 s between the first failed try and the second to kill the server in
ONLINE = {"group_size": 2, "groups_per_step": 1, "batch_tries": 2, "poll_s": 10.0,
          "train": {"learning_rate": 1e-4}}
STATUS = "/api/v1/models/tests/aside/online"
ONLINE_ON = "tests/aside: online mode on"


async def _rewarded_calls(url: str, task: str) -> None:
    """One group: two calls tagged ``task``, each given a reward (0, then 1)."""
    async with httpx.AsyncClient(base_url=url, timeout=300,
                                 headers={"authorization": f"Bearer {API_KEY}"}) as http:
        for reward in (0.0, 1.0):
            r = await http.post("/v1/chat/completions",
                                headers={"x-tracerl-tags": json.dumps({"task": task})},
                                json={"model": "aside", "max_tokens": 3, "temperature": 1.0,
                                      "messages": [{"role": "user", "content": "Say hi."}]})
            assert r.status_code == 200, r.text
            r = await http.post(f"/v1/feedback/{r.json()['id']}", json={"reward": reward})
            assert r.status_code == 200, r.text


def _online_status(url: str) -> dict:
    r = httpx.get(url + STATUS, headers={"authorization": f"Bearer {API_KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _records(path: Path) -> list[tuple[str, str, int | None]]:
    """``failed_batches.jsonl`` as (event, batch, try), after checking that every line is whole:
    one JSON object ending in a newline (read with its writer killed or stopped)."""
    data = path.read_bytes() if path.exists() else b""
    assert not data or data.endswith(b"\n"), data[-200:]
    lines = [json.loads(line) for line in data.splitlines()]
    assert all(isinstance(r, dict) for r in lines), lines
    return [(r["event"], r["batch"], r.get("try")) for r in lines]


@pytest.mark.timeout(900)
async def test_a_failing_batch_keeps_its_tries_through_kill_9_and_stays_aside(tmp_path):
    server = ServerProcess(tmp_path, args=(
        "--online", "tests/aside", "--online-config", json.dumps(ONLINE),
        "--plugin", "tests.online_failing_batch_plugin"))
    store = ModelStore(server.path / "data", "tests", "aside")
    failed_batches = store.root / "online" / FAILED_BATCHES
    first_try = [("failed", "online-0001", 1)]
    set_aside = [*first_try, ("failed", "online-0001", 2), ("set_aside", "online-0001", None)]
    try:
        server.start()
        model = await registered_on(server.url, "aside", "tests", CONFIG)
        await model.backend.close()
        server.wait_for_log_line(ONLINE_ON, timeout_s=60)  # from now on calls are live ones
        await _rewarded_calls(server.url, "bad")
        await until(lambda: read_jsonl(failed_batches), "the first failed try", timeout_s=120)
        server.kill9()  # before the second try (poll_s later)
        assert _records(failed_batches) == first_try
        assert "reward" in read_jsonl(failed_batches)[0]["error"]

        server.start()  # the count goes on: one try left, not batch_tries fresh ones
        await until(lambda: len(read_jsonl(failed_batches)) >= 3, "the batch set aside",
                    timeout_s=120)
        assert _records(failed_batches) == set_aside
        server.kill9()

        on = server.log.read_text().count(ONLINE_ON)
        server.start()  # not resurrected
        server.wait_for_log_line(ONLINE_ON, after=on, timeout_s=60)
        status = _online_status(server.url)
        assert status["set_aside_batches"] == ["online-0001"], status
        assert status["failing_batches"] == {} and "reward" in status["last_set_aside_error"]
        await _rewarded_calls(server.url, "good")
        await until(lambda: _online_status(server.url)["candidate"] == 1,
                    "good feedback to train step 1", timeout_s=300)
    finally:
        server.stop()
    assert _records(failed_batches) == set_aside  # nothing retried, nothing torn
    taken = [e["batch"] for e in read_jsonl(events_path(store)) if e["event"] == "taken"]
    assert taken == ["online-0001", "online-0001-1"]
    trained = {t.metadata["task"] for g in read_groups_jsonl(store.trajectories_path("train", 1))
               for t in g.trajectories}
    assert trained == {"task:good"}
