import json
import math

import pytest
from openai.types.chat.chat_completion import Choice

import tracerl
from tracerl.core.trajectory import read_groups_jsonl, write_groups_jsonl


def make_choice(content="4", **extra):
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "stop",
            "message": {"role": "assistant", "content": content},
            "logprobs": {
                "content": [{"token": content, "logprob": -0.25, "bytes": [52], "top_logprobs": []}]
            },
            **extra,
        }
    )


def make_trajectory(reward=1.0):
    call = tracerl.LLMCall(
        id="call-1", rollout_id="ro-1", model="m@2", adapter_step=2,
        request={"messages": [{"role": "user", "content": "2+2?"}]},
        prompt_token_ids=[1, 2, 3],
        completions=[tracerl.CompletionRecord(token_ids=[7, 8], logprobs=[-0.5, -1e-9], text="4",
                                              finish_reason="stop")],
        temperature=0.7, latency_s=0.01,
    )
    return tracerl.Trajectory(
        messages_and_choices=[{"role": "system", "content": "be brief"},
                              {"role": "user", "content": "2+2?"},
                              make_choice(token_ids=[7, 8])],
        tools=[{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
        reward=reward, metrics={"correct": True, "len": 2}, metadata={"scenario": 3, "tags": ["a"]},
        logs=["hello"], llm_calls=[call],
    )


def test_trajectory_json_round_trip_is_lossless():
    t = make_trajectory()
    back = tracerl.Trajectory.from_json(t.to_json())
    assert back == t
    assert isinstance(back.messages_and_choices[2], Choice)
    # vLLM extras on the choice survive (openai models keep extra fields)
    assert back.messages_and_choices[2].model_extra["token_ids"] == [7, 8]
    assert back.llm_calls[0].completions[0].logprobs == [-0.5, -1e-9]
    assert back.metrics == {"correct": 1.0, "len": 2.0}
    assert back.messages()[-1] == {"role": "assistant", "content": "4"}


def test_additional_histories_round_trip_and_are_validated():
    sub_agent = tracerl.History(messages_and_choices=[{"role": "user", "content": "summarise"},
                                                      make_choice("ok", token_ids=[9])],
                                tools=[{"type": "function", "function": {"name": "f"}}])
    t = make_trajectory()
    t.additional_histories = [sub_agent]
    back = tracerl.Trajectory.from_json(t.to_json())
    assert back == t and isinstance(back.additional_histories[0].messages_and_choices[1], Choice)
    assert back.additional_histories[0].messages()[-1] == {"role": "assistant", "content": "ok"}
    with pytest.raises(tracerl.InvalidTrajectoryError, match=r"messages_and_choices\[1\].*'robot'"):
        tracerl.Trajectory(additional_histories=[{"messages_and_choices": [
            {"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}])


def test_exceptions_among_trajectories_become_the_groups_failed_rollouts():
    g = tracerl.TrajectoryGroup([make_trajectory(), ValueError("boom")], exceptions=[KeyError("k")])
    assert len(g) == 1 and [e.type for e in g.exceptions] == ["ValueError", "KeyError"]


def test_group_jsonl_round_trip(tmp_path):
    g1 = tracerl.TrajectoryGroup([make_trajectory(1.0), make_trajectory(0.0)],
                                 exceptions=[ValueError("boom")], metadata={"scenario": "x"})
    g2 = tracerl.TrajectoryGroup(t for t in [make_trajectory(0.5)])  # generators work too
    path = tmp_path / "g.jsonl"
    write_groups_jsonl(path, [g1, g2])
    back = read_groups_jsonl(path)
    assert back == [g1, g2]
    assert back[0].exceptions[0].type == "ValueError"
    assert back[0].exceptions[0].message == "boom"
    assert back[0].exceptions[0].traceback == "ValueError: boom\n"  # never raised: no frames
    assert len(back[1]) == 1


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "1.0", None])
def test_non_finite_or_non_numeric_reward_rejected(bad):
    with pytest.raises(tracerl.InvalidTrajectoryError, match="reward"):
        tracerl.Trajectory(messages_and_choices=[], reward=bad)


def test_reward_assignment_is_validated_too():
    t = tracerl.Trajectory(messages_and_choices=[])
    with pytest.raises(tracerl.InvalidTrajectoryError, match="finite"):
        t.reward = float("nan")


def test_non_finite_metric_rejected():
    with pytest.raises(tracerl.InvalidTrajectoryError, match=r"metrics\['x'\]"):
        tracerl.Trajectory(messages_and_choices=[], metrics={"x": math.inf})


def test_unknown_role_rejected_with_position():
    with pytest.raises(tracerl.InvalidTrajectoryError, match=r"messages_and_choices\[1\].*'robot'"):
        tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "hi"},
                                                 {"role": "robot", "content": "beep"}])


def test_non_message_entry_rejected():
    with pytest.raises(tracerl.InvalidTrajectoryError, match="message dict or an openai Choice"):
        tracerl.Trajectory(messages_and_choices=["just a string"])


def test_metadata_must_be_json():
    with pytest.raises(tracerl.InvalidTrajectoryError, match="JSON"):
        tracerl.Trajectory(messages_and_choices=[], metadata={"f": object()})


def test_empty_group_rejected():
    with pytest.raises(tracerl.InvalidTrajectoryError, match="at least one trajectory"):
        tracerl.TrajectoryGroup([])


def test_group_of_non_trajectories_rejected():
    with pytest.raises(tracerl.InvalidTrajectoryError, match=r"trajectories\[0\] is a int"):
        tracerl.TrajectoryGroup([1])


def test_logprob_count_must_match_tokens():
    with pytest.raises(tracerl.InvalidTrajectoryError, match="2 token ids but 1 logprobs"):
        tracerl.CompletionRecord(token_ids=[1, 2], logprobs=[-0.1])


def test_positive_logprob_rejected():
    with pytest.raises(tracerl.InvalidTrajectoryError, match="not a log-probability"):
        tracerl.CompletionRecord(token_ids=[1], logprobs=[0.5])


def test_trajectory_created_in_rollout_scope_gets_its_id():
    with tracerl.rollout_scope("ro-abc"):
        t = tracerl.Trajectory(messages_and_choices=[])
    assert t.rollout_id == "ro-abc"
    assert tracerl.Trajectory(messages_and_choices=[]).rollout_id is None


def test_train_config_rejects_bad_values():
    with pytest.raises(ValueError, match="learning_rate"):
        tracerl.TrainConfig(learning_rate=0)
    with pytest.raises(ValueError, match="extra"):
        tracerl.TrainConfig(learnign_rate=1e-5)
    assert (
        json.loads(tracerl.TrainConfig(learning_rate=1e-5).model_dump_json())["learning_rate"]
        == 1e-5
    )
