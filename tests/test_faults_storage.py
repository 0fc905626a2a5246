"""Full disk through real OS limits: every kind of file a model writes (call record, history,
trajectories, checkpoint, marker) fails with its own error code and leaves the folder as it was;
a real ``tracerl serve`` whose file size limit is lowered under it answers ``disk_full`` to the
step, the log and the call, and trains the next step once space is back."""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys

import openai
import pytest

import tracerl
from tracerl.core.errors import DiskFullError
from tracerl.core.storage import ModelStore, read_jsonl

from .faults_support import CONFIG, tiny_groups
from .remote_server import API_KEY, ROOT, ServerProcess

WIDE_METRICS = {f"a_metric_with_a_long_name_{i}": 1.0 for i in range(40)}
WRITES = ["history", "call record", "trajectories", "checkpoint", "marker"]


def tmpfs_mount_allowed() -> str | None:
    """None when a tmpfs can be mounted here (in a user and mount namespace), else why not."""
    if shutil.which("unshare") is None:
        return "no unshare command"
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                           capture_output=True, text=True, timeout=30)
    return None if probe.returncode == 0 else f"cannot mount a tmpfs: {probe.stderr.strip()}"


def run_writer(folder, mode: str) -> dict:
    cmd = [sys.executable, "-m", "tests.faults_disk_writer", str(folder), mode]
    if mode == "fill":  # a 1 MiB tmpfs mounted on the folder, in this command's namespace only
        cmd = ["unshare", "-rm", "sh", "-c",
               f"mount -t tmpfs -o size=1m tmpfs {folder} && exec {' '.join(cmd)}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module", params=["rlimit", "fill"], ids=["ulimit-f", "tmpfs-full"])
def disk_full(request, tmp_path_factory):
    if request.param == "fill" and (why := tmpfs_mount_allowed()):
        pytest.skip(why)
    return run_writer(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("what", WRITES)
def test_a_failed_write_raises_disk_full_naming_the_file(disk_full, what):
    result = disk_full["results"][what]
    assert result["error"] == "disk_full" and result["type"] == "DiskFullError", result
    assert "could not write" in result["message"] and "/faults/models/disk/" in result["message"]


def test_failed_writes_leave_every_file_as_it_was(disk_full):
    assert disk_full["unchanged"], (disk_full["before"], disk_full["during"])
    assert disk_full["left_over"] == []  # no temporary file, no partial checkpoint


def test_once_space_is_back_appends_and_checkpoints_read_back_whole(disk_full):
    assert disk_full["history"] == [1, 2]
    assert disk_full["calls"] == ["call-0", "call-2"]
    assert disk_full["checkpoints"] == [1, 2]


@pytest.fixture(scope="module")
async def server_out_of_space(tmp_path_factory):
    """A real server: step 1; then its file size limit is lowered (prlimit) under it while a
    step, a log and a call are sent; then lifted, and step 2 is sent."""
    srv = ServerProcess(tmp_path_factory.mktemp("full")).start()
    backend = tracerl.RemoteBackend(srv.url, api_key=API_KEY, retry_for_s=5)
    model = tracerl.TrainableModel(name="full", project="faults", base_model="smollm2",
                                   config=CONFIG)
    store = ModelStore(srv.path / "data", "faults", "full")
    out: dict = {}
    try:
        await model.register(backend)
        await model.train(tiny_groups(1))
        _, hard = resource.prlimit(srv.proc.pid, resource.RLIMIT_FSIZE)
        # 256 bytes past the history: a step's groups fit, its checkpoint does not; the log's
        # history line (WIDE_METRICS alone are ~1.4 KB) tears, and so does the long call's record
        limit = store.history_path.stat().st_size + 256
        resource.prlimit(srv.proc.pid, resource.RLIMIT_FSIZE, (limit, hard))
        for what, attempt in {
            "train": lambda: model.train(tiny_groups(2)),
            "log": lambda: model.log(tiny_groups(3), split="val", metrics=WIDE_METRICS),
            "train again": lambda: model.train(tiny_groups(4)),
            "call": lambda: model.openai_client().chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": "hi " * 200}],
                max_tokens=4, extra_headers={"x-rollout-id": "full-disk"}),
        }.items():
            try:
                await attempt()
                out[what] = None
            except (DiskFullError, openai.APIStatusError) as e:
                out[what] = e
        resource.prlimit(srv.proc.pid, resource.RLIMIT_FSIZE, (hard, hard))
        await model.train(tiny_groups(5))
        out["step"] = await model.get_step()
        out["checkpoints"] = store.checkpoint_steps()
        torn: list[int] = []
        out["history"] = [(h["step"], h["split"]) for h in read_jsonl(store.history_path,
                                                                      torn=torn)]
        out["torn"] = torn
        out["superseded"] = sorted(
            p.name for p in (store.root / "trajectories" / "train" / "superseded").iterdir())
    finally:
        await backend.close()
        srv.stop()
    return out


@pytest.mark.parametrize("what", ["train", "log", "train again"])
async def test_the_client_gets_disk_full_from_the_server(server_out_of_space, what):
    error = server_out_of_space[what]
    assert isinstance(error, DiskFullError), error
    assert "could not write" in str(error)


async def test_a_call_that_cannot_be_recorded_is_answered_507_disk_full(server_out_of_space):
    error = server_out_of_space["call"]
    assert isinstance(error, openai.APIStatusError) and error.status_code == 507, error
    assert error.body["code"] == "disk_full", error.body


async def test_the_queue_trains_the_next_step_once_space_is_back(server_out_of_space):
    assert server_out_of_space["step"] == 2
    assert server_out_of_space["checkpoints"] == [1, 2]


async def test_the_groups_of_failed_attempts_are_kept_not_overwritten(server_out_of_space):
    assert server_out_of_space["superseded"] == ["0002.1.jsonl", "0002.2.jsonl"]


async def test_history_has_no_torn_line_and_no_line_of_a_failed_write(server_out_of_space):
    assert server_out_of_space["torn"] == []
    assert server_out_of_space["history"] == [(1, "train"), (2, "train")]
