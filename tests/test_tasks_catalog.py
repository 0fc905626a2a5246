"""The catalog's game, Node and ART tasks, each played for real (SmolLM2 on the transformers
engine) at the base step: every call is recorded token-exactly under the trajectory's rollout,
and ``metrics["success"]`` (and the reward) are what the task's library scores."""

from __future__ import annotations

import os
import random
import shutil

import pytest

import tracerl
from tests.conftest import render_ids
from tracerl.core.storage import read_jsonl
from tracerl.tasks import get_task

pytest.importorskip("reasoning_gym")
pytest.importorskip("textarena")


async def play(backend, name: str, n: int = 1, temperature: float = 1.0):
    """``n`` held-out items of task ``name`` played once each at step 0, inside a gather."""
    task = get_task(name)
    model = tracerl.TrainableModel(name=name, project="catalog", base_model="smollm2",
                                   config=task.model_config())
    await model.register(backend)
    items = task.items("test", n)
    groups = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(task.rollout(model, item, temperature=temperature, step=0)
                                 for item in items)], show_progress=False)
    assert groups[0].exceptions == []
    return model, items, groups[0].trajectories


def assert_recorded_token_exactly(backend, model, trajectory, tokenizer) -> list[str]:
    """Every call of ``trajectory`` is on disk under its rollout id, served at step 0, its
    prompt the chat template's tokens and its completion's tokens its text; the texts."""
    assert trajectory.llm_calls and trajectory.rollout_id
    on_disk = read_jsonl(backend.store(model).calls_path(trajectory.rollout_id))
    assert [c["id"] for c in on_disk] == [c.id for c in trajectory.llm_calls]
    texts = []
    for call in trajectory.llm_calls:
        assert call.rollout_id == trajectory.rollout_id and call.adapter_step == 0
        assert call.prompt_token_ids == render_ids(tokenizer, call.request["messages"])
        (completion,) = call.completions
        assert tokenizer.decode(completion.token_ids, skip_special_tokens=True).strip() \
            == (completion.text or "").strip()
        texts.append(completion.text or "")
    return texts


async def test_guess_the_number_is_scored_by_textarena(tf_backend, tokenizer):
    from tracerl.tasks.game_guess_number import game_metrics, new_game

    backend, _ = tf_backend
    model, (item,), (t,) = await play(backend, "game-guess-number", temperature=0.0)
    texts = assert_recorded_token_exactly(backend, model, t, tokenizer)
    assert t.spans and {"agent", "llm"} <= {s.kind for s in t.spans}  # the SDK's span tree
    env = new_game(item.data["seed"])  # the game replayed with the agent's moves
    for text in texts:
        done, _ = env.step(action=text.strip())
    rewards, info = env.close()
    assert done and t.reward == rewards[0]
    assert t.metrics["success"] == float(rewards[0] == 1)
    assert t.metrics == {"success": t.metrics["success"], **game_metrics(
        [x.strip() for x in texts], info[0])}


async def test_node_agent_rollout_is_the_rollout_apis_and_reasoning_gyms_score(
        tf_backend, tokenizer):
    from tracerl.tasks.node_chain_sum import score

    if shutil.which("node") is None:
        pytest.skip("node is not installed")
    backend, _ = tf_backend
    model, items, trajectories = await play(backend, "node-chain-sum", n=2)
    for item, t in zip(items, trajectories, strict=True):
        (answer,) = assert_recorded_token_exactly(backend, model, t, tokenizer)
        assert t.rollout_id.startswith("ext-") and t.metadata["external"] is True
        assert t.reward == score(item.data, answer)
        assert t.metrics["success"] == float(t.reward == 1.0)
        assert t.metrics["answer_is_number"] == float(answer.strip().lstrip("-").isdigit())
    status = await backend.external_rollouts_status(model)
    assert status["handed_out"] == 2 and status["open"] == status["ready_groups"] == 0


def test_concurrent_rollouts_install_the_npm_package_once(tmp_path, monkeypatch):
    """Four threads of this process and a second process ask for the Node agent's modules
    under an empty prefix at once: npm (a counting wrapper around the real one) runs once, and
    every caller gets a prefix where the package loads. Before the lock, the GPU kit's seeds
    each started npm install there, and a rollout that saw a half-done one ran Node on
    missing modules."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from tracerl.tasks.node_chain_sum import node_modules

    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("node and npm are not installed")
    bin_dir, count = tmp_path / "bin", tmp_path / "npm-runs"
    bin_dir.mkdir()
    (bin_dir / "npm").write_text(f'#!/bin/sh\necho run >> {count}\nexec {npm} "$@"\n')
    (bin_dir / "npm").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("TRACERL_NPM_PREFIX", str(tmp_path / "prefix"))
    other = subprocess.Popen([sys.executable, "-c", "from tracerl.tasks.node_chain_sum import "
                              "node_modules; print(node_modules())"],
                             stdout=subprocess.PIPE, text=True)
    with ThreadPoolExecutor(4) as pool:
        found = set(pool.map(lambda _: node_modules(), range(4)))
    out, _ = other.communicate(timeout=700)
    assert other.returncode == 0
    assert found == {tmp_path / "prefix" / "node_modules"} and out.strip() == str(*found)
    assert count.read_text().splitlines() == ["run"]
    loads = subprocess.run([node, "-e", "require('openai'); console.log('loaded')"],
                           env={**os.environ, "NODE_PATH": str(*found)}, capture_output=True,
                           text=True, timeout=60)
    assert loads.stdout.strip() == "loaded", loads.stderr


async def test_art_tic_tac_toe_is_scored_by_the_examples_rules(tf_backend, tokenizer):
    from tracerl.tasks import art_tic_tac_toe as ttt

    backend, _ = tf_backend
    model, (item,), (t,) = await play(backend, "art-tic-tac-toe")
    texts = assert_recorded_token_exactly(backend, model, t, tokenizer)
    rng = random.Random(item.data["seed"])  # the game replayed with the agent's moves
    game = ttt.generate_game(rng)
    if game["agent_symbol"] == "o":
        r, c = ttt.get_opponent_move(game, rng)
        game["board"][r][c] = game["opponent_symbol"]
    invalid = False
    for text in texts:
        try:
            ttt.apply_agent_move(game, text)
        except ValueError:
            invalid = True
            break
        if ttt.check_winner(game["board"]) is None:
            r, c = ttt.get_opponent_move(game, rng)
            game["board"][r][c] = game["opponent_symbol"]
    assert t.metrics["invalid_move"] == float(invalid)
    won = ttt.check_winner(game["board"]) == game["agent_symbol"]
    assert t.metrics["success"] == float(won) and t.metrics["turns"] == len(texts)
    assert (t.reward < 0) == invalid


def test_tic_tac_toe_rules():
    from tracerl.tasks.art_tic_tac_toe import apply_agent_move, check_winner, generate_game

    game = generate_game(random.Random(0))
    apply_agent_move(game, "<move>B2</move>")
    assert game["board"][1][1] == game["agent_symbol"]
    for bad in ("<move>B2</move>", "B2", "<move>D1</move>", "<move>x</move>"):
        with pytest.raises(ValueError):
            apply_agent_move(game, bad)
    assert check_winner([["x", "o", "_"], ["_", "x", "o"], ["_", "_", "x"]]) == "x"
    assert check_winner([["o", "x", "_"], ["o", "x", "_"], ["o", "_", "x"]]) == "o"
    assert check_winner([["x", "o", "x"], ["x", "o", "o"], ["o", "x", "x"]]) == "draw"
    assert check_winner([["_"] * 3 for _ in range(3)]) is None


def test_guess_the_number_metrics_follow_textarenas_rules():
    from tracerl.tasks.game_guess_number import game_metrics

    # a bare number is bracketed by textarena's ActionFormattingWrapper; a repeat is invalid
    assert game_metrics(["5", "[5]", "I say [12]", "[40]", "five"], {}) == {
        "turns": 5.0, "move_valid": 0.4, "invalid_end": 0.0}
    assert game_metrics([], {"invalid_move": True})["invalid_end"] == 1.0


def test_guess_the_number_leaves_the_global_rng_alone():
    from tracerl.tasks.game_guess_number import OPENING, new_game

    random.seed(7)
    expected = random.random()
    random.seed(7)
    env = new_game(123)
    assert random.random() == expected
    assert env.get_observation()[1].strip() == OPENING  # the examples open as the game does
