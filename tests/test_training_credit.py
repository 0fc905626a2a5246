"""Per-turn credit (``TrainConfig(credit="turn")``, GiGPO): on hand-built groups with known
turns, states and rewards, each trained token's advantage is ``A_E + w * A_S`` worked out by
hand; per-rollout credit is what it was; the loss reads per-token advantages on real SmolLM2.
And on the catalog's game (textarena's GuessTheNumber, real SmolLM2 rollouts),
the turns of a rollout get different advantages, each the formula's."""

from __future__ import annotations

import math

import pytest
import torch

import tracerl
from tracerl.backend.training.advantages import group_advantages
from tracerl.backend.training.credit import discounted_returns, state_key
from tracerl.backend.training.rows import check_token_records
from tracerl.backend.training.step import rows_with_advantages
from tracerl.backend.training.trainer import Trainer
from tracerl.core.config import LoraConfig, TrainConfig


@pytest.fixture(scope="module")
def trainer(smollm2_path):
    torch.manual_seed(0)
    return Trainer(smollm2_path, LoraConfig(r=4, alpha=8), device="cpu")


def call(cid: str, prompt: list[int], completion: list[int], t: float,
         messages: list[dict] | None = None) -> tracerl.LLMCall:
    return tracerl.LLMCall(
        id=cid, prompt_token_ids=prompt, created_at=t,
        request={"messages": messages} if messages else {},
        completions=[tracerl.CompletionRecord(token_ids=completion,
                                              logprobs=[-0.5] * len(completion))])


def trajectory(reward: float, calls: list[tracerl.LLMCall], **metadata) -> tracerl.Trajectory:
    return tracerl.Trajectory(reward=reward, llm_calls=calls, metadata=metadata)


def shared_states_group() -> tracerl.TrajectoryGroup:
    """Three rollouts of one item. Their first turns share a state (prompt 1 2 3); the second
    turns of A and B share one too (both answered 10 first); B's third and C's second turn are
    states of their own. Each rollout's turns continue one row (exact turns)."""
    a = trajectory(1.0, [call("a1", [1, 2, 3], [10], 1), call("a2", [1, 2, 3, 10, 7], [11], 2)])
    b = trajectory(0.0, [call("b1", [1, 2, 3], [10], 1), call("b2", [1, 2, 3, 10, 7], [12], 2),
                         call("b3", [1, 2, 3, 10, 7, 12, 7], [13], 3)])
    c = trajectory(0.5, [call("c1", [1, 2, 3], [20], 1), call("c2", [1, 2, 3, 20, 7], [21], 2)])
    return tracerl.TrajectoryGroup([a, b, c])


TURN = TrainConfig(credit="turn", scale_rewards=False, turn_discount=0.5, turn_weight=1.0)


def test_each_turn_gets_its_episode_advantage_plus_its_step_groups(trainer):
    """By hand, unscaled, gamma 0.5: A_E = reward - 0.5 = (0.5, -0.5, 0); sparse returns
    G = 0.5^(T-1-t) * reward: A (0.5, 1), B (0, 0, 0), C (0.25, 0.5). State 1 2 3 holds
    0.5, 0, 0.25 (mean 0.25), state 1 2 3 10 7 holds 1, 0 (mean 0.5); the others are alone."""
    rows, stats, skipped = rows_with_advantages(trainer, [shared_states_group()], TURN)
    assert skipped == 0 and [r.trajectory for r in rows] == [0, 1, 2]
    a, b, c = rows
    assert a.input_ids == [1, 2, 3, 10, 7, 11]
    assert a.advantages == [0, 0, 0, 0.5 + 0.25, 0, 0.5 + 0.5]
    assert b.advantages == [0, 0, 0, -0.5 - 0.25, 0, -0.5 - 0.5, 0, -0.5 + 0]
    assert c.advantages == [0] * 6
    assert [r.advantage for r in rows] == [0.5, -0.5, 0.0]  # the episode's, for the viewer
    assert (stats.turns, stats.step_groups, stats.grouped_turns) == (7, 2, 5)
    assert stats.step_advantage_abs == pytest.approx((0.25 + 0.25 + 0.5 + 0.5) / 7)


def test_per_rollout_credit_is_unchanged(trainer):
    """The default: one GRPO advantage per rollout, no per-token list, one value per row in
    the loss's tensors; and its metrics name no turns."""
    config = TrainConfig(scale_rewards=False)
    rows, stats, _ = rows_with_advantages(trainer, [shared_states_group()], config)
    assert [(r.advantage, r.advantages) for r in rows] == [(0.5, None), (-0.5, None),
                                                           (0.0, None)]
    assert trainer.tensors(rows)["adv"].tolist() == [0.5, -0.5, 0.0]
    assert "turns" not in stats.as_metrics()


def test_weight_zero_gives_every_token_its_rollouts_scaled_advantage(trainer):
    group = shared_states_group()
    expected = group_advantages([t.reward for t in group.trajectories], True).advantages
    rows, _, _ = rows_with_advantages(trainer, [group], TrainConfig(credit="turn",
                                                                    turn_weight=0.0))
    for row, adv in zip(rows, expected, strict=True):
        assert row.advantages == [adv if m else 0.0 for m in row.loss_mask]


def test_step_groups_are_std_scaled_with_scale_rewards(trainer):
    """Scaled, gamma 1: every return is the reward. State 1 2 3 holds 1, 0, 0.5: std-scaled
    (r - 0.5) / (std + 1e-4), as the episode level; A's second turn: 1 vs 0 -> +1."""
    rows, _, _ = rows_with_advantages(trainer, [shared_states_group()],
                                      TrainConfig(credit="turn", turn_discount=1.0))
    std = math.sqrt(((0.5 ** 2) * 2) / 3)
    a_e = 0.5 / (std + 1e-4)
    assert rows[0].advantages[3] == pytest.approx(2 * a_e)
    assert rows[0].advantages[5] == pytest.approx(a_e + 0.5 / (0.5 + 1e-4))


def positional_group() -> tracerl.TrajectoryGroup:
    """Two rollouts with equal rewards but per-turn rewards in different turns."""
    x = trajectory(1.0, [call("x1", [1], [5], 1), call("x2", [2], [6], 2)], turn_rewards=[1, 0])
    y = trajectory(1.0, [call("y1", [3], [5], 1), call("y2", [4], [6], 2)], turn_rewards=[0, 1])
    return tracerl.TrajectoryGroup([x, y])


def test_per_turn_rewards_are_discounted_and_compared_by_position(trainer):
    """gamma 0.5: X returns (1, 0), Y (0.5, 1); A_E = 0 (equal rewards). Position 0: +-0.25,
    position 1: -+0.5. A group of equal rewards still teaches, per turn."""
    config = TURN.model_copy(update={"turn_state": "position"})
    rows, _, skipped = rows_with_advantages(trainer, [positional_group()], config)
    assert skipped == 0
    assert [r.advantages for r in rows] == [[0, 0.25], [0, -0.5], [0, -0.25], [0, 0.5]]
    _, _, skipped = rows_with_advantages(trainer, [positional_group()], TrainConfig())
    assert skipped == 1  # per rollout: equal rewards, nothing to learn


def test_discounted_returns():
    assert discounted_returns([1.0, 0.0, 2.0], 0.5) == [1.5, 1.0, 2.0]
    assert discounted_returns([], 0.9) == []


def test_the_observation_state_is_the_messages_since_the_last_answer():
    """Two histories that differ before the last answer but end in the same observation."""
    first = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "x"},
             {"role": "user", "content": "obs"}]
    second = [{"role": "user", "content": "b"}, {"role": "assistant", "content": "y"},
              {"role": "user", "content": "obs"}]
    c1, c2 = call("1", [1, 2], [3], 1, first), call("2", [1, 4], [3], 1, second)
    assert state_key(c1, "observation", 0) == state_key(c2, "observation", 5)
    assert state_key(c1, "prompt", 0) != state_key(c2, "prompt", 0)


def test_named_states_override_the_mode(trainer):
    """metadata['turn_states'] puts the position-0 turns in different states: no step group."""
    group = positional_group()
    for t, names in zip(group.trajectories, (["s", "t"], ["u", "t"]), strict=True):
        t.metadata["turn_states"] = names
    rows, stats, _ = rows_with_advantages(trainer, [group], TURN)
    assert [r.advantages for r in rows] == [[0, 0.0], [0, -0.5], [0, 0.0], [0, 0.5]]
    assert stats.step_groups == 1


@pytest.mark.parametrize("metadata, message", [
    ({"turn_rewards": [1.0]}, r"trajectories\[1\]\.metadata\['turn_rewards'\]: one entry per "
                              r"turn .* 2 here; got 1 entries"),
    ({"turn_rewards": [1.0, "x"]}, r"metadata\['turn_rewards'\]\[1\]: 'x' is not a finite"),
    ({"turn_states": [1, 2]}, r"metadata\['turn_states'\]\[0\]: 1 is not a string"),
])
def test_bad_turn_metadata_is_refused_naming_the_field(metadata, message):
    group = positional_group()
    group.trajectories[1].metadata = metadata
    with pytest.raises(tracerl.InvalidTrajectoryError, match=message):
        check_token_records([group], vocab_size=100, context=100)


def test_the_loss_reads_per_token_advantages(trainer):
    """Per-token advantages equal to each row's own give the loss and gradients of one
    advantage per row; per-token ones reach the loss's tensors as [rows, tokens]."""
    rows, _, _ = rows_with_advantages(trainer, [shared_states_group()], TURN)
    adv = trainer.tensors(rows)["adv"]  # from the first trained position (3) to the widest (8)
    assert adv.tolist() == [(r.advantages + [0.0] * (8 - len(r)))[3:] for r in rows]
    config = TrainConfig()
    flat, _, _ = rows_with_advantages(trainer, [shared_states_group()], config)
    per_token, _, _ = rows_with_advantages(trainer, [shared_states_group()], config.model_copy(
        update={"credit": "turn", "turn_weight": 0.0}))
    losses = []
    for batch in (flat, per_token):
        trainer.optimizer.zero_grad(set_to_none=True)
        losses.append(trainer.backward([batch], config)["loss"])
    assert losses[0] == pytest.approx(losses[1], abs=1e-7) and losses[0] != 0


@pytest.mark.parametrize("seeds", [(11, 12)])
async def test_guess_the_number_turns_get_different_advantages(tf_backend, trainer, seeds):
    """Two groups of four real games (SmolLM2 at temperature 1), their rows with
    credit='turn': every game's first turn shares its state (the opening) with its group's,
    so it gets A_E + A_S of its return 0.95^(T-1) * reward among the four; a later turn that
    no other game reached gets A_E alone. Some game's turns differ."""
    pytest.importorskip("textarena")
    pytest.importorskip("agents")
    from tracerl.tasks import get_task
    from tracerl.tasks.base import Item

    backend, _ = tf_backend
    task = get_task("game-guess-number")
    model = tracerl.TrainableModel(name="credit-game", project="tests", base_model="smollm2",
                                   config=task.model_config())
    await model.register(backend)
    items = [Item(key=f"seed-{s}", data={"seed": s}) for s in seeds]
    groups = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(task.rollout(model, item, temperature=1.0, step=0)
                                 for _ in range(4)) for item in items], show_progress=False)
    rows, stats, _ = rows_with_advantages(trainer, groups, TrainConfig(credit="turn"))
    trained: dict[tuple[int, int], list[float]] = {}
    for row in rows:  # one row per turn: each turn's prompt restarts the game's transcript
        assert row.advantages is not None
        (adv,) = {a for a, m in zip(row.advantages, row.loss_mask, strict=True) if m}
        trained.setdefault((row.group, row.trajectory), []).append(adv)
    differ = 0
    for gi, group in enumerate(groups):
        a_e = group_advantages([t.reward for t in group.trajectories], True).advantages
        firsts = [0.95 ** (len(t.llm_calls) - 1) * t.reward for t in group.trajectories]
        a_s = group_advantages(firsts, True).advantages
        prompts = [tuple(c.prompt_token_ids) for t in group.trajectories for c in t.llm_calls]
        for ti, t in enumerate(group.trajectories):
            if (gi, ti) not in trained:
                continue  # a group without signal
            got = trained[(gi, ti)]
            assert len(got) == len(t.llm_calls)
            assert got[0] == pytest.approx(a_e[ti] + a_s[ti], abs=1e-5)
            for k, c in enumerate(t.llm_calls[1:], start=1):
                if prompts.count(tuple(c.prompt_token_ids)) == 1:
                    assert got[k] == pytest.approx(a_e[ti], abs=1e-5)
            differ += len({round(a, 6) for a in got}) > 1
    assert differ >= 1, [t.reward for g in groups for t in g.trajectories]
    assert stats.turns == sum(len(t.llm_calls) for g in groups for t in g.trajectories)
    assert stats.step_groups is not None and stats.step_groups >= len(groups)  # the openings
