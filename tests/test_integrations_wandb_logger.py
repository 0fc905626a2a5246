"""The W&B logger plugin in offline mode: the run's own .wandb file holds the metrics."""

import glob
import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def wandb_history(run_file: str) -> list[dict]:
    """Decode the history records of a .wandb file (LevelDB-style log of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = Path(run_file).read_bytes()
    assert raw[:4] == b":W&B"
    block, pos, buf, out = 32768, 7, b"", []
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            pos += left - 7
            continue
        buf += raw[pos:pos + length]
        pos += length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                out.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                            for i in record.history.item})
    return out


def test_offline_run_files_contain_metrics_and_trajectory_tables(tmp_path):
    code = textwrap.dedent("""
        import asyncio
        import tracerl
        from tracerl.events.lifecycle import step_logged, train_event
        from tracerl.events.plugins import get_plugin_manager
        m = tracerl.ModelSpec(name="wb-model", project="wb-project", base_model="smollm2")
        g = tracerl.TrajectoryGroup([tracerl.Trajectory(
            messages_and_choices=[{"role": "assistant", "content": "hi"}], reward=r)
            for r in (0.2, 0.8)])
        config = tracerl.TrainConfig()
        steps = [(1, {"reward": 0.5, "loss": 0.25}), (2, {"reward": 0.75, "loss": 0.125})]
        for step, metrics in steps:
            done = tracerl.TrainEvent("done", step, metrics=metrics)
            asyncio.run(train_event(m, done, [], config))
        asyncio.run(step_logged(m, 2, "val", {}, [g]))
        get_plugin_manager().get_plugin("wandb_logger").finish()
    """)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(ROOT),
           "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
           "TRACERL_LOGGERS": "wandb", "TRACERL_QUIET": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (run_file,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "*.wandb"))
    history = wandb_history(run_file)
    by_step = {h["_step"]: h for h in history}
    assert by_step[1]["train/reward"] == 0.5 and by_step[1]["train/loss"] == 0.25
    assert by_step[2]["train/reward"] == 0.75
    table_meta = next(h for h in history if "val/trajectories/_type" in h)
    assert table_meta["val/trajectories/nrows"] == 2
    (table_file,) = glob.glob(
        str(Path(run_file).parent / "files" / "media" / "table" / "**" / "*.json"), recursive=True
    )
    table = json.loads(Path(table_file).read_text())
    assert table["columns"][:3] == ["group", "rollout_id", "reward"]
    assert sorted(row[2] for row in table["data"]) == [0.2, 0.8]
