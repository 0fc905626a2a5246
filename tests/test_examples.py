"""The framework examples train end to end on CPU (slow stage: one step each)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tracerl.core.trajectory import read_groups_jsonl

EXAMPLES = Path(__file__).parent.parent / "examples"


SCRIPTS = [
    "train_existing_agent.py",
    "langgraph_react_agent.py",
    "openai_agents_handoff.py",
    "litellm_proxy_agent.py",
]


@pytest.fixture(scope="module", params=SCRIPTS, ids=[s.removesuffix(".py") for s in SCRIPTS])
def example_run(request, tmp_path_factory):
    """One step of the example (1 group of 3 rollouts); the step's line and its store."""
    script = request.param
    if script.startswith("litellm") and not os.environ.get("TRACERL_LITELLM_PYTHON"):
        pytest.skip("TRACERL_LITELLM_PYTHON is not set")
    path = tmp_path_factory.mktemp(script.removesuffix(".py"))
    out = subprocess.run(
        [sys.executable, script, "--steps", "1", "--groups", "1", "--group-size", "3",
         "--path", str(path)],
        cwd=EXAMPLES, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("step 1: reward")]
    (saved,) = path.rglob("trajectories/train/0001.jsonl")  # step 1, named as the store does
    (group,) = read_groups_jsonl(saved)
    return SimpleNamespace(path=path, line=line, group=group)


@pytest.mark.slow
def test_example_saves_the_steps_rollouts_with_their_token_records(example_run):
    """Written before training: every rollout with its recorded calls' token ids."""
    group = example_run.group
    assert group.trajectories
    assert all(t.llm_calls for t in group), "a rollout's calls were not recorded"
    assert all(c.prompt_token_ids and c.completions[0].token_ids
               for t in group for c in t.llm_calls)


@pytest.mark.slow
def test_example_trains_the_sampled_tokens_when_the_rewards_differ(example_run):
    """A group whose rewards differ trains its tokens; one with equal rewards is skipped."""
    trained_tokens = int(re.fullmatch(r"step 1: .* trained tokens (\d+)", example_run.line)[1])
    rewards = [t.reward for t in example_run.group]
    assert (trained_tokens > 0) == (len(set(rewards)) > 1), (example_run.line, rewards)


@pytest.mark.slow
def test_example_writes_the_steps_checkpoint(example_run):
    (checkpoint,) = example_run.path.rglob("checkpoints/0001")
    assert (checkpoint / "adapter_model.safetensors").is_file()
