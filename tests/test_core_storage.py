"""Storage: atomic folders and files, append-only JSONL, name validation."""


import pytest

import tracerl
from tracerl.core.storage import (
    OPTIMIZER_FILE,
    ModelStore,
    append_jsonl,
    atomic_directory,
    read_jsonl,
    validate_name,
)
from tracerl.core.trajectory import read_groups_jsonl, write_groups_jsonl

ESCAPING_NAMES = {
    "parent": "../etc",
    "slash": "a/b",
    "empty": "",
    "hidden": ".hidden",
    "too-long": "x" * 200,
    "space": "a b",
    "dot-dot": "..",
    "dot-dot-inside": "ok/../x",
}


@pytest.mark.parametrize("name", ESCAPING_NAMES.values(), ids=list(ESCAPING_NAMES))
def test_names_that_could_escape_a_folder_are_rejected(name):
    with pytest.raises(tracerl.ConfigError, match="invalid model name"):
        validate_name("model", name)


@pytest.mark.parametrize("name", ESCAPING_NAMES.values(), ids=list(ESCAPING_NAMES))
def test_a_model_cannot_be_named_so_that_its_folder_escapes(name):
    with pytest.raises(tracerl.ConfigError, match="invalid model name"):
        tracerl.TrainableModel(name=name, project="p", base_model="smollm2")


def test_a_plain_name_is_accepted():
    assert validate_name("model", "Qwen2.5-7b_run-3") == "Qwen2.5-7b_run-3"


def test_atomic_directory_leaves_nothing_on_failure(tmp_path):
    final = tmp_path / "checkpoints" / "0003"
    with pytest.raises(RuntimeError), atomic_directory(final) as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("crash while saving")
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_atomic_directory_shows_nothing_under_the_final_name_until_done(tmp_path):
    final = tmp_path / "checkpoints" / "0003"
    with atomic_directory(final) as tmp:
        (tmp / "adapter.bin").write_bytes(b"ok")
        inside = sorted(p.name for p in final.parent.iterdir())
    assert "0003" not in inside and len(inside) == 1  # only the temporary folder


def test_atomic_directory_appears_whole_on_success(tmp_path):
    final = tmp_path / "checkpoints" / "0003"
    with atomic_directory(final) as tmp:
        (tmp / "adapter.bin").write_bytes(b"ok")
    assert (final / "adapter.bin").read_bytes() == b"ok"
    assert [p.name for p in final.parent.iterdir()] == ["0003"]


@pytest.fixture
def store_with_a_crashed_save(tmp_path):
    """Step 1 saved; step 2's save killed midway: its temporary folder, named by the real
    ``atomic_directory``, is left behind (a kill -9 runs no cleanup)."""
    store = ModelStore(tmp_path, "p", "m")
    with atomic_directory(store.checkpoints_dir / "0001"):
        pass
    interrupted = atomic_directory(store.checkpoints_dir / "0002")
    partial = interrupted.__enter__()  # never exited, as in a process killed inside the block
    assert partial.parent == store.checkpoints_dir
    yield store  # (a yield keeps ``interrupted`` alive: closing it would clean up)


def test_partial_checkpoints_are_ignored(store_with_a_crashed_save):
    store = store_with_a_crashed_save
    assert (store.checkpoint_steps(), store.latest_step()) == ([1], 1)


def test_partial_checkpoints_are_cleaned(store_with_a_crashed_save):
    store = store_with_a_crashed_save
    (removed,) = store.remove_partial_checkpoints()
    assert removed.name.startswith(".0002.")
    assert sorted(p.name for p in store.checkpoints_dir.iterdir()) == ["0001"]


def test_a_torn_last_jsonl_line_is_skipped(tmp_path):
    path = tmp_path / "history.jsonl"
    append_jsonl(path, {"step": 1})
    with open(path, "a") as f:
        f.write('{"step": 2, "rew')  # crash mid-append
    assert read_jsonl(path) == [{"step": 1}]


def test_a_torn_line_anywhere_is_skipped_and_reported_by_number(tmp_path):
    path = tmp_path / "history.jsonl"
    path.write_text('{"bad\n{"step": 1}\n[1]\n\xff\xfe\n{"step": 2}\n')
    torn: list[int] = []
    assert read_jsonl(path, torn=torn) == [{"step": 1}, {"step": 2}]
    assert torn == [1, 3, 4]


def test_an_append_after_a_torn_line_starts_on_a_fresh_line(tmp_path):
    path = tmp_path / "history.jsonl"
    append_jsonl(path, {"step": 1})
    with open(path, "a") as f:
        f.write('{"step": 2, "rew')  # a kill -9 mid-append
    append_jsonl(path, {"step": 2})
    torn: list[int] = []
    assert read_jsonl(path, torn=torn) == [{"step": 1}, {"step": 2}]
    assert torn == [2]


def test_deleting_checkpoints_keeps_the_newest_so_the_step_never_rewinds(tmp_path):
    store = ModelStore(tmp_path, "p", "m")
    for step in (1, 2, 3):
        with atomic_directory(store.checkpoint_dir(step)) as tmp:
            (tmp / "adapter.bin").write_bytes(b"x")
    assert store.delete_checkpoints(keep=set()) == [1, 2]
    assert store.checkpoint_steps() == [3] and store.latest_step() == 3
    assert not list(store.checkpoints_dir.glob(".*"))  # nothing half-deleted left behind


def one_group(reward):
    return tracerl.TrajectoryGroup([tracerl.Trajectory(messages_and_choices=[], reward=reward)])


def test_group_jsonl_append_creates_the_file_then_keeps_earlier_lines(tmp_path):
    path = tmp_path / "val" / "0000.jsonl"
    g1, g2 = one_group(1.0), one_group(2.0)
    write_groups_jsonl(path, [g1], append=True)  # no file yet: just written
    write_groups_jsonl(path, [g2], append=True)
    assert read_groups_jsonl(path) == [g1, g2]


def test_group_jsonl_write_without_append_replaces_the_file(tmp_path):
    path = tmp_path / "val" / "0000.jsonl"
    g1, g2 = one_group(1.0), one_group(2.0)
    write_groups_jsonl(path, [g1])
    write_groups_jsonl(path, [g2])
    assert read_groups_jsonl(path) == [g2]


def test_dropping_optimizer_state_keeps_adapters_and_the_state_of_later_checkpoints(tmp_path):
    store = ModelStore(tmp_path, "p", "m")
    for step in (1, 2, 3):
        with atomic_directory(store.checkpoint_dir(step)) as folder:
            (folder / "adapter_model.safetensors").write_bytes(b"adapter")
            (folder / OPTIMIZER_FILE).write_bytes(b"adam")
    assert store.drop_optimizer_state(before=3) == [1, 2]
    assert store.drop_optimizer_state(before=3) == []  # already gone: nothing to do
    assert [(store.checkpoint_dir(s) / OPTIMIZER_FILE).exists() for s in (1, 2, 3)] == [
        False, False, True]
    assert all((store.checkpoint_dir(s) / "adapter_model.safetensors").read_bytes() == b"adapter"
               for s in (1, 2, 3))
