"""The framework examples train end to end on CPU (slow stage: one step each)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.slow
@pytest.mark.parametrize(
    "script",
    [
        "train_existing_agent.py",
        "langgraph_react_agent.py",
        "openai_agents_handoff.py",
        "litellm_proxy_agent.py",
    ],
)
def test_example_trains_a_step(script, tmp_path):
    if script.startswith("litellm") and not os.environ.get("TRACERL_LITELLM_PYTHON"):
        pytest.skip("TRACERL_LITELLM_PYTHON is not set")
    out = subprocess.run(
        [
            sys.executable,
            script,
            "--steps",
            "1",
            "--groups",
            "1",
            "--group-size",
            "3",
            "--path",
            str(tmp_path),
        ],
        cwd=EXAMPLES,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("step 1:")]
    assert "trained tokens" in line
    # the step's trajectories were written before training, with their token records
    (saved,) = tmp_path.rglob("trajectories/train/0001.jsonl")  # step 1, named as the store does
    assert '"prompt_token_ids"' in saved.read_text()
