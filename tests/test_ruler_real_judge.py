"""A real small judge: SmolLM2 served by vLLM through our gateway, with guided JSON."""

import pytest

import tracerl
from tracerl.backend.engines.vllm_engine import VLLMEngine
from tracerl.ruler import Ruler

pytestmark = [
    pytest.mark.slow, pytest.mark.vllm,
    pytest.mark.skipif(not VLLMEngine.available(), reason="needs vLLM (TRACERL_VLLM_PYTHON)"),
]


async def test_smollm2_judge_gives_valid_scores_end_to_end(tmp_path):
    backend = tracerl.LocalBackend(path=tmp_path, engine="vllm")
    judge = tracerl.Model(name="judge", project="tests", base_model="smollm2",
                          config=tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=2048)))
    try:
        await judge.register(backend)
        task = {"role": "user", "content": "What is the capital of France?"}
        group = tracerl.TrajectoryGroup(
            [
                tracerl.Trajectory(
                    messages_and_choices=[task, {"role": "assistant", "content": answer}]
                )
                for answer in ("Paris.", "I like turtles.")
            ]
        )
        ruler = Ruler(
            judge.openai_client(),
            judge.get_inference_name(),
            max_retries=4,
            temperature=0.8,
            max_tokens=200,
            timeout_s=300,
        )
        scored = await ruler.score_group(group)
    finally:
        await backend.close()
    assert all(0.0 <= t.reward <= 1.0 for t in scored)
    assert all("ruler_score" in t.metrics for t in scored)
    meta = scored.metadata["ruler"]
    assert meta["calls"] >= 1 and meta["completion_tokens"] > 0
