"""The README's main job: its reward function, and (slow) GRPO on SmolLM2 on CPU raising the
held-out reward."""

import pytest

from tracerl.demo import cosine, demo, number_reward

REWARDS = {
    # id: (the answer, its reward for the number 4721)
    "exactly-the-number": ("4721", 1.0),
    "number-with-two-extra-words": ("The number is 4721.", 0.7),
    "number-inside-a-longer-number": ("47210", 0.0),
    "number-missing": ("no", 0.0),
    "many-extra-words-floor-at-0.2": ("4721 " + "x " * 20, 0.2),
}


@pytest.mark.parametrize("answer, reward", REWARDS.values(), ids=list(REWARDS))
def test_number_reward(answer, reward):
    assert number_reward(answer, "4721") == pytest.approx(reward)


def test_the_learning_rate_falls_along_a_half_cosine_from_the_first_step_to_the_last():
    rates = [cosine(step, 8, 2e-3, 5e-4) for step in range(1, 9)]
    assert rates[0] == pytest.approx(2e-3) and rates[-1] == pytest.approx(5e-4)
    assert rates == sorted(rates, reverse=True)
    assert cosine(5, 9, 2e-3, 5e-4) == pytest.approx(1.25e-3)  # the middle step: halfway
    assert cosine(3, 8, 2e-3, None) == 2e-3  # no end: constant


@pytest.fixture(scope="module")
async def demo_run(tmp_path_factory):
    """``tracerl demo`` (8 steps, about a minute of CPU: only the slow tests below use it)."""
    return await demo(steps=8, engine="transformers",
                      base_path=str(tmp_path_factory.mktemp("demo")), group_size=6,
                      groups_per_step=4)


@pytest.mark.slow
def test_demo_raises_the_held_out_reward(demo_run):
    """Learning check (slow stage): 8 steps raise the greedy held-out reward by 0.2 or more."""
    (_, first), (_, last) = demo_run["evals"][0], demo_run["evals"][-1]
    assert last >= first + 0.2, demo_run


@pytest.mark.slow
def test_demo_raises_the_train_reward(demo_run):
    """Learning check (slow stage): the sampled train reward of the last 3 steps beats the first
    3 steps' by more than 0.2."""
    curve = demo_run["train_curve"]
    assert sum(curve[-3:]) / 3 > sum(curve[:3]) / 3 + 0.2, demo_run
