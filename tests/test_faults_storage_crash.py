"""kill -9 of a real ``tracerl serve`` at every disk commit of a training step.

A first step runs whole and lists its fault points (tests/faults_crash_plugin.py: every rename
and fsync of the step, from its request marker to its last byte: trajectories, checkpoint files,
the checkpoint rename, the history append, the final marker). Then, for each point k, the
server is restarted with request ``r{k}`` set to stall at point k, killed there with SIGKILL,
and restarted; after each restart the folder must agree (step, checkpoints, history,
trajectories, markers), and sending the killed request again must return the metrics of the
step it asked for, trained exactly once."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

from tracerl.core.storage import ModelStore

from .faults_support import Control, tiny_groups
from .remote_server import ServerProcess

PLUGIN = ("--plugin", "tests.faults_crash_plugin")


def folder_state(store: ModelStore) -> dict:
    """What a reader of the folder sees (dot-named temporary files are not the folder's)."""
    train_dir = store.root / "trajectories" / "train"
    return {
        "checkpoints": store.checkpoint_steps(),
        "history": [h["step"] for h in store.history() if h["split"] == "train"],
        "trajectories": sorted(int(p.stem) for p in train_dir.glob("[0-9]*.jsonl")),
        "markers": {p.stem: json.loads(p.read_text())
                    for p in (store.root / "requests" / "train").glob("[!.]*.json")},
        "partial_checkpoints": [p.name for p in store.checkpoints_dir.glob(".*")],
    }


def restart(srv: ServerProcess, data: Path, request: str, at: int) -> Path:
    marker = data / f"stalled-{request}"
    srv.stop()
    srv.env = {"TRACERL_TEST_CRASH_REQUEST": request, "TRACERL_TEST_CRASH_AT": str(at),
               "TRACERL_TEST_CRASH_MARKER": str(marker),
               "TRACERL_TEST_CRASH_LOG": str(data / f"points-{request}.log")}
    srv.start(extra_args=PLUGIN)
    return marker


def kill_at_marker(srv: ServerProcess, control: Control, request: str, marker: Path,
                   pool: ThreadPoolExecutor, timeout_s: float = 120) -> str:
    """Send ``request``; once the server stalls at its fault point, kill -9 it."""
    sent = pool.submit(control.train, request, tiny_groups(int(request[1:])))
    deadline = time.monotonic() + timeout_s
    while not marker.exists():
        assert time.monotonic() < deadline, f"{request} did not stall within {timeout_s} s"
        assert srv.proc.poll() is None, "the server died before stalling"
        try:  # wait on the request itself (it must not finish before it stalls)
            raise AssertionError(f"{request} ended without stalling: "
                                 f"{sent.result(timeout=0.05)}")
        except TimeoutError:
            pass
    where = marker.read_text()
    srv.kill9()
    try:
        sent.result(timeout=60)  # the stream breaks with the server
    except Exception:  # the broken connection is the expected outcome
        pass
    return where


@pytest.fixture(scope="module")
def campaign(tmp_path_factory):
    data = tmp_path_factory.mktemp("crash-points")
    srv = ServerProcess(data)
    store = ModelStore(data / "data", "faults", "crash")
    run = SimpleNamespace(points=[], killed_at=[], after_restart=[], retried=[], final={})
    pool = ThreadPoolExecutor(1)
    try:
        restart(srv, data, "base", -1)  # armed for request "base", never stalls: lists points
        control = Control(srv.url, "faults", "crash")
        control.register()
        assert control.train("base", tiny_groups(0))["event"] == "done"
        points = (data / "points-base.log").read_text().splitlines()
        run.points = points
        previous: tuple[str, int] | None = None
        for k in range(len(points)):
            request = f"r{k + 1}"
            marker = restart(srv, data, request, k)
            if previous is not None:
                run.after_restart.append(folder_state(store))
                run.retried.append(retry(control, store, *previous))
            step = control.get()["step"] + 1
            where = kill_at_marker(srv, control, request, marker, pool)
            run.killed_at.append(where)
            previous = (request, step)
        restart(srv, data, "none", -1)
        run.after_restart.append(folder_state(store))
        run.retried.append(retry(control, store, *previous))
        run.final = folder_state(store)
        run.final_step = control.get()["step"]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        srv.stop()
    return run


def retry(control: Control, store: ModelStore, request: str, step: int) -> dict:
    """Send the killed request again: what it returned, and what the folder says of its step."""
    last = control.train(request, tiny_groups(int(request[1:])))
    return {"request": request, "asked_step": step, "event": last.get("event"),
            "step": last.get("step"), "metrics": last.get("metrics"),
            "recorded": store.train_metrics(step), "served_step": control.get()["step"]}


def test_a_step_has_many_fault_points_including_the_checkpoint_window(campaign):
    points = [p.split(" ", 1)[1] for p in campaign.points]  # "k what" -> "what"
    rename = next(i for i, p in enumerate(points) if p.startswith("replace") and "/checkpoints/"
                  in p and p.split("/")[-1].isdigit())
    history = next(i for i, p in enumerate(points) if "history.jsonl" in p)
    assert len(points) >= 12 and rename < history
    assert len(campaign.killed_at) == len(points)  # every point was reached and killed at


def test_after_every_kill_the_folder_agrees_after_restart(campaign):
    for state in campaign.after_restart:
        assert state["checkpoints"] == state["history"], state
        assert state["checkpoints"] == list(range(1, len(state["checkpoints"]) + 1)), state
        assert state["partial_checkpoints"] == [], state
        latest = state["checkpoints"][-1]
        assert set(state["trajectories"]) <= set(range(1, latest + 2)), state  # at most pending
        for marker in state["markers"].values():
            assert marker["state"] in ("running", "done"), marker
            assert marker["state"] == "running" or marker["step"] in state["checkpoints"]


def test_a_retried_request_returns_the_metrics_of_the_step_it_asked_for(campaign):
    assert len(campaign.retried) == len(campaign.points)
    for r in campaign.retried:
        assert r["event"] == "done" and r["step"] == r["asked_step"], r
        assert r["metrics"] == r["recorded"] and r["metrics"], r
        assert r["served_step"] == r["asked_step"], r


def test_every_step_is_trained_and_recorded_exactly_once(campaign):
    steps = list(range(1, len(campaign.points) + 2))
    final = campaign.final
    assert campaign.final_step == steps[-1]
    assert final["checkpoints"] == steps and final["history"] == steps
    assert final["trajectories"] == steps
    assert {m["step"] for m in final["markers"].values()} == set(steps)
    assert all(m["state"] == "done" for m in final["markers"].values())
