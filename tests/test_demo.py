"""The README's main job: its reward function, and (slow) GRPO on SmolLM2 on CPU raising the
held-out reward."""

import pytest

from tracerl.demo import demo, number_reward


def test_number_reward():
    assert number_reward("4721", "4721") == 1.0
    assert number_reward("The number is 4721.", "4721") == pytest.approx(0.7)
    assert number_reward("47210", "4721") == 0.0
    assert number_reward("no", "4721") == 0.0
    assert number_reward("4721 " + "x " * 20, "4721") == 0.2


@pytest.mark.slow
async def test_demo_learns(tmp_path):
    """Learning check (slow stage): 12 steps raise the held-out and the train reward."""
    result = await demo(steps=12, engine="transformers", base_path=str(tmp_path), group_size=6,
                        groups_per_step=4)
    (_, first), (_, last) = result["evals"][0], result["evals"][-1]
    curve = result["train_curve"]
    assert last >= first + 0.2, result
    assert sum(curve[-3:]) / 3 > sum(curve[:3]) / 3 + 0.2, result
