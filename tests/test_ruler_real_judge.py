"""A real small judge: SmolLM2 served by vLLM through our gateway, with guided JSON."""

from types import SimpleNamespace

import pytest

import tracerl
from tests.judge_server import ids_in
from tracerl.backend.engines.vllm_engine import VLLMEngine
from tracerl.ruler import Ruler, parse_scores

pytestmark = [
    pytest.mark.slow, pytest.mark.vllm,
    pytest.mark.skipif(not VLLMEngine.available(), reason="needs vLLM (TRACERL_VLLM_PYTHON)"),
]


@pytest.fixture(scope="module")
async def judged(tmp_path_factory):
    """Two answers judged by SmolLM2 on vLLM (one vLLM start for the module)."""
    tmp_path = tmp_path_factory.mktemp("real-judge")
    backend = tracerl.LocalBackend(path=tmp_path, engine="vllm")
    judge = tracerl.Model(
        name="judge", project="tests", base_model="smollm2",
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
        with tracerl.rollout_scope() as ro:  # so the gateway files the judge's calls
            scored = await ruler.score_group(group)
        calls = await judge.fetch_calls(ro.rollout_id)
    finally:
        await backend.close()
    return SimpleNamespace(scored=scored, calls=calls)


async def test_the_judge_was_asked_for_guided_json_through_the_gateway(judged):
    assert judged.calls, "the gateway recorded no judge call"
    assert {c.request["response_format"]["type"] for c in judged.calls} == {"json_schema"}


async def test_the_rewards_are_the_scores_in_the_judges_last_recorded_answer(judged):
    # (was `0 <= reward <= 1` for every trajectory, which could not fail: parse_scores refuses
    # any other score); the recorded answer is the model's own text, parsed here again
    last = judged.calls[-1]
    ids = ids_in(last.request)  # the trajectories in the order the prompt lists them
    scores = parse_scores(last.completions[0].text, ids)
    assert [t.reward for t in judged.scored] == [scores[i] for i in ids]


async def test_both_distinct_answers_were_judged_together(judged):
    assert judged.scored.metadata["ruler"]["unique_trajectories"] == 2


async def test_the_judges_token_usage_is_reported(judged):
    meta = judged.scored.metadata["ruler"]
    assert meta["calls"] == len(judged.calls) and meta["completion_tokens"] > 0
