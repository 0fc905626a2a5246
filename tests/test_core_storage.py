"""Storage: atomic folders and files, append-only JSONL, name validation."""

import json

import pytest

import tracerl
from tracerl.core.storage import (
    ModelStore,
    append_jsonl,
    atomic_directory,
    read_jsonl,
    validate_name,
)


@pytest.mark.parametrize("bad", ["../etc", "a/b", "", ".hidden", "x" * 200, "a b", "..", "ok/../x"])
def test_names_that_could_escape_a_folder_are_rejected(bad):
    with pytest.raises(tracerl.ConfigError, match="invalid model name"):
        validate_name("model", bad)
    with pytest.raises(tracerl.ConfigError):
        tracerl.TrainableModel(name=bad, project="p", base_model="smollm2")


def test_atomic_directory_leaves_nothing_on_failure(tmp_path):
    final = tmp_path / "checkpoints" / "0003"
    with pytest.raises(RuntimeError), atomic_directory(final) as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("crash while saving")
    assert not final.exists() and list((tmp_path / "checkpoints").iterdir()) == []


def test_atomic_directory_appears_whole_on_success(tmp_path):
    final = tmp_path / "checkpoints" / "0003"
    with atomic_directory(final) as tmp:
        (tmp / "adapter.bin").write_bytes(b"ok")
        assert not final.exists()  # nothing under the final name until the block ends
    assert (final / "adapter.bin").read_bytes() == b"ok"
    assert [p.name for p in final.parent.iterdir()] == ["0003"]


def test_partial_checkpoints_are_ignored_and_cleaned(tmp_path):
    store = ModelStore(tmp_path, "p", "m")
    (store.checkpoints_dir / "0001").mkdir(parents=True)
    (store.checkpoints_dir / ".0002.abc.tmp").mkdir()
    assert store.checkpoint_steps() == [1] and store.latest_step() == 1
    store.remove_partial_checkpoints()
    assert sorted(p.name for p in store.checkpoints_dir.iterdir()) == ["0001"]


def test_a_torn_last_jsonl_line_is_skipped(tmp_path):
    path = tmp_path / "history.jsonl"
    append_jsonl(path, {"step": 1})
    with open(path, "a") as f:
        f.write('{"step": 2, "rew')  # crash mid-append
    assert read_jsonl(path) == [{"step": 1}]


def test_a_corrupt_jsonl_line_before_the_last_raises(tmp_path):
    path = tmp_path / "history.jsonl"
    path.write_text('{"bad\n{"step": 1}\n')
    with pytest.raises(json.JSONDecodeError):
        read_jsonl(path)


def test_unregistered_model_says_what_to_do():
    m = tracerl.TrainableModel(name="m", project="p", base_model="smollm2")
    with pytest.raises(tracerl.NotRegisteredError, match=r"await model.register\(backend\)"):
        m.openai_client()


def test_group_jsonl_append_keeps_earlier_lines(tmp_path):
    from tracerl.core.trajectory import read_groups_jsonl, write_groups_jsonl

    path = tmp_path / "val" / "0000.jsonl"
    g1 = tracerl.TrajectoryGroup([tracerl.Trajectory(messages_and_choices=[], reward=1.0)])
    g2 = tracerl.TrajectoryGroup([tracerl.Trajectory(messages_and_choices=[], reward=2.0)])
    write_groups_jsonl(path, [g1], append=True)  # no file yet: just written
    write_groups_jsonl(path, [g2], append=True)
    assert read_groups_jsonl(path) == [g1, g2]
    write_groups_jsonl(path, [g2])
    assert read_groups_jsonl(path) == [g2]
