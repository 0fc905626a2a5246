"""RULER against a judge that misbehaves on purpose, and the plugin route."""

import json
from types import SimpleNamespace

import openai
import pytest

import tracerl
from tests.judge_server import JudgeServer, good
from tracerl.ruler import Ruler, RulerError, parse_scores, trajectory_id

SYSTEM = {"role": "system", "content": "You are a shopping agent."}
TASK = {"role": "user", "content": "Buy the cheapest red shoe."}


def traj(answer, reward=0.0):
    return tracerl.Trajectory(
        messages_and_choices=[SYSTEM, TASK, {"role": "assistant", "content": answer}], reward=reward
    )


def group(*answers):
    return tracerl.TrajectoryGroup([traj(a, reward=float(i)) for i, a in enumerate(answers)])


@pytest.fixture
def judge():
    servers = []

    def make(*behaviours, **kwargs):
        server = JudgeServer(list(behaviours))
        servers.append(server)
        client = openai.AsyncOpenAI(base_url=server.url, api_key="k", max_retries=0)
        return server, Ruler(client, "judge", **kwargs)

    yield make
    for s in servers:
        s.close()


def by_answer(g):
    return {t.messages()[-1]["content"]: t.reward for t in g}


ANSWER_SCORES = {"bought red shoe for $10": 0.9, "gave up": 0.1, "bought blue shoe": 0.4}


@pytest.fixture
async def scored_by_id(judge):
    """A group judged by a judge that lists its scores in reverse order (``good``), so only
    matching by trajectory id gives each answer its score."""
    g = group(*ANSWER_SCORES)
    scores = {trajectory_id([{"role": "assistant", "content": a}]): s
              for a, s in ANSWER_SCORES.items()}
    server, ruler = judge(good(lambda tid, k: scores[tid]))
    out = await ruler.score_group(g)
    return SimpleNamespace(out=out, request=server.requests[0],
                           prompt=server.requests[0]["messages"][-1]["content"])


async def test_scores_are_matched_by_trajectory_id(scored_by_id):
    assert by_answer(scored_by_id.out) == ANSWER_SCORES


async def test_the_reward_before_judging_is_kept_as_independent_reward(scored_by_id):
    assert [t.metrics["independent_reward"] for t in scored_by_id.out] == [0.0, 1.0, 2.0]


async def test_the_shared_prefix_is_sent_once_as_shared_context(scored_by_id):
    assert scored_by_id.prompt.count("Buy the cheapest red shoe.") == 1
    assert "<shared_context>" in scored_by_id.prompt


async def test_the_judge_is_asked_for_structured_output(scored_by_id):
    assert scored_by_id.request["response_format"]["type"] == "json_schema"


async def test_the_group_records_how_it_was_judged(scored_by_id):
    meta = scored_by_id.out.metadata["ruler"]
    assert (meta["shared_messages"], meta["calls"], meta["prompt_tokens"]) == (2, 1, 100)
    assert meta["latency_s"] > 0


async def test_malformed_json_is_retried(judge):
    server, ruler = judge(lambda r, ids: "{not json}", good(lambda tid, k: 0.5 + 0.1 * k))
    out = await ruler.score_group(group("a", "b"))
    assert len(server.requests) == 2 and out.metadata["ruler"]["retries"] == 1
    assert "not valid JSON" in out.metadata["ruler"]["errors"][0]
    assert sorted(t.reward for t in out) == [0.5, 0.6]


INVALID_ANSWERS = {
    "unknown-id": (
        lambda r, ids: json.dumps(
            {"scores": [{"trajectory_id": "t0000000000", "explanation": "", "score": 1}]}
        ),
        "unknown trajectory id",
    ),
    "score-out-of-range": (
        lambda r, ids: json.dumps(
            {"scores": [{"trajectory_id": i, "explanation": "", "score": 7} for i in ids]}
        ),
        "not a number in [0, 1]",
    ),
    "a-trajectory-unscored": (
        lambda r, ids: json.dumps(
            {"scores": [{"trajectory_id": ids[0], "explanation": "", "score": 1}]}
        ),
        "did not score",
    ),
}


@pytest.mark.parametrize("case", INVALID_ANSWERS, ids=list(INVALID_ANSWERS))
async def test_invalid_answers_fail_clearly_after_retries(judge, case):
    bad, needle = INVALID_ANSWERS[case]
    server, ruler = judge(bad, max_retries=2)
    g = group("a", "b")
    with pytest.raises(RulerError, match="after 3 attempts") as e:
        await ruler.score_group(g)
    assert needle in str(e.value) and len(server.requests) == 3
    assert [t.reward for t in g] == [0.0, 1.0]  # untouched


@pytest.mark.parametrize("case", INVALID_ANSWERS, ids=list(INVALID_ANSWERS))
async def test_invalid_answers_are_swallowed_on_request(judge, case):
    bad, _ = INVALID_ANSWERS[case]
    _, ruler = judge(bad, max_retries=2)
    g = group("a", "b")
    assert await ruler.score_group(g, swallow_exceptions=True) is None
    assert [t.reward for t in g] == [0.0, 1.0]  # untouched


async def test_a_stalled_judge_times_out(judge):
    _, ruler = judge(lambda r, ids: None, max_retries=1, timeout_s=0.5)
    with pytest.raises(RulerError, match=r"did not answer within 0\.5 s"):
        await ruler.score_group(group("a", "b"))


async def test_identical_trajectories_get_identical_scores(judge):
    _, ruler = judge(good(lambda tid, k: 0.2 + 0.3 * k))
    first, other, same = (t.reward for t in await ruler.score_group(group("same", "other",
                                                                           "same")))
    assert first == same != other


async def test_identical_trajectories_are_sent_once(judge):
    server, ruler = judge(good(lambda tid, k: 0.2 + 0.3 * k))
    await ruler.score_group(group("same", "other", "same"))
    assert server.requests[0]["messages"][-1]["content"].count("<trajectory id=") == 2


async def test_answers_are_cached_on_disk(judge, tmp_path):
    server, ruler = judge(good(lambda tid, k: 0.3 + 0.2 * k), cache_dir=tmp_path)
    first = by_answer(await ruler.score_group(group("a", "b")))
    again = await ruler.score_group(group("a", "b"))
    assert len(server.requests) == 1  # the second group was not sent
    assert by_answer(again) == first
    assert again.metadata["ruler"]["cache_hits"] == 1


async def test_large_groups_are_chunked_around_a_shared_anchor(judge):
    """The second chunk's judge is 0.2 more generous; the anchor shift removes that bias."""
    base = {
        trajectory_id([{"role": "assistant", "content": f"answer {i}"}]): 0.1 * (i + 1)
        for i in range(5)
    }
    calls = []

    def biased(request, ids):
        calls.append(ids)
        bias = 0.2 * (len(calls) - 1)
        return json.dumps(
            {
                "scores": [
                    {"trajectory_id": t, "explanation": "", "score": min(1, base[t] + bias)}
                    for t in ids
                ]
            }
        )

    server, ruler = judge(biased, chunk_size=3)
    out = await ruler.score_group(group(*[f"answer {i}" for i in range(5)]))
    assert len(server.requests) == 2
    anchor = trajectory_id([{"role": "assistant", "content": "answer 0"}])
    assert [c[0] for c in calls] == [anchor, anchor]  # both chunks start with the anchor
    rewards = [t.reward for t in out]  # anchor = the mean of its chunk scores; gaps stay true
    assert [round(r - rewards[0], 6) for r in rewards] == [0.0, 0.1, 0.2, 0.3, 0.4]


BAD_SCORE_LISTS = {
    "duplicate-id": (
        '{"scores": [{"trajectory_id": "a", "score": 1}, {"trajectory_id": "a", "score": 1}]}',
        "twice"),
    "boolean-score": ('{"scores": [{"trajectory_id": "a", "score": true}]}', "not a number"),
}


@pytest.mark.parametrize("case", BAD_SCORE_LISTS, ids=list(BAD_SCORE_LISTS))
def test_parse_scores_rejects_a_bad_score_list(case):
    text, needle = BAD_SCORE_LISTS[case]
    with pytest.raises(ValueError, match=needle):
        parse_scores(text, ["a"])


async def test_ruler_as_after_each_and_as_plugin(judge, monkeypatch):
    server, _ = judge(good(lambda tid, k: 0.25 * (k + 1)))
    monkeypatch.setenv("TRACERL_RULER_MODEL", "judge")
    monkeypatch.setenv("TRACERL_RULER_BASE_URL", server.url)
    from tracerl.events.lifecycle import score_group

    async def rollout(answer):
        return traj(answer)

    groups = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup([rollout("x"), rollout("y")])],
        after_each=lambda g: score_group(g, judge="ruler"), show_progress=False)
    assert sorted(t.reward for t in groups[0]) == [0.25, 0.5]
    assert "ruler" in groups[0].metadata


async def test_endpoint_without_structured_output_gets_a_plain_request(judge):
    def strict(request, ids):
        return "HTTP400" if "response_format" in request else good(lambda t, k: 0.5)(request, ids)

    server, ruler = judge(strict)
    out = await ruler.score_group(group("a", "b"))
    assert [("response_format" in r) for r in server.requests] == [True, False]
    assert [t.reward for t in out] == [0.5, 0.5]


@pytest.mark.parametrize("judge_model", ["openai/o3", "o4-mini"])
async def test_arts_reasoning_judges_through_real_litellm_get_only_the_params_they_accept(
        judge_model):
    """RULER's default judge in ART (``openai/o3``) and 2048's (``o4-mini``) through real
    LiteLLM to a local OpenAI-style server: the request arrives without ``temperature`` (o-series
    take only 1) and the group is scored. Before, LiteLLM refused ``temperature=0.0`` before
    any request (``UnsupportedParamsError``)."""
    pytest.importorskip("litellm")
    from tracerl.ruler import ruler_score_group

    server = JudgeServer([good(lambda tid, k: 0.5 + 0.1 * k)])
    try:
        out = await ruler_score_group(group("a", "b"), judge_model, extra_litellm_params={
            "api_base": server.url, "api_key": "k"})
    finally:
        server.close()
    assert out is not None and sorted(t.reward for t in out) == [0.5, 0.6]
    (request,) = server.requests
    assert request["model"] == judge_model.removeprefix("openai/")
    assert "temperature" not in request, request.keys()
    assert request["response_format"]["type"] == "json_schema"
