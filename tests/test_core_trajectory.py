"""The data model: trajectories, groups and call records round-trip losslessly and refuse bad
input with a message naming the field."""

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


def make_sub_agent_history():
    return tracerl.History(messages_and_choices=[{"role": "user", "content": "summarise"},
                                                 make_choice("ok", token_ids=[9])],
                           tools=[{"type": "function", "function": {"name": "f"}}])


# --- round trips ---------------------------------------------------------------------------


def test_trajectory_json_round_trip_is_lossless():
    t = make_trajectory()
    back = tracerl.Trajectory.from_json(t.to_json())
    assert back == t
    assert isinstance(back.messages_and_choices[2], Choice)
    # vLLM extras on the choice survive (openai models keep extra fields)
    assert back.messages_and_choices[2].model_extra["token_ids"] == [7, 8]
    assert back.llm_calls[0].completions[0].logprobs == [-0.5, -1e-9]


def test_metrics_are_stored_as_floats():
    assert make_trajectory().metrics == {"correct": 1.0, "len": 2.0}


def test_messages_turns_a_choice_into_a_plain_assistant_message():
    assert make_trajectory().messages()[-1] == {"role": "assistant", "content": "4"}


def test_additional_histories_round_trip_with_their_choices():
    t = make_trajectory()
    t.additional_histories = [make_sub_agent_history()]
    back = tracerl.Trajectory.from_json(t.to_json())
    assert back == t
    assert isinstance(back.additional_histories[0].messages_and_choices[1], Choice)
    assert back.additional_histories[0].messages()[-1] == {"role": "assistant", "content": "ok"}


def test_group_jsonl_round_trip(tmp_path):
    g1 = tracerl.TrajectoryGroup([make_trajectory(1.0), make_trajectory(0.0)],
                                 exceptions=[ValueError("boom")], metadata={"scenario": "x"})
    g2 = tracerl.TrajectoryGroup([make_trajectory(0.5)])
    path = tmp_path / "g.jsonl"
    write_groups_jsonl(path, [g1, g2])
    back = read_groups_jsonl(path)
    assert back == [g1, g2]
    assert (back[0].exceptions[0].type, back[0].exceptions[0].message) == ("ValueError", "boom")


def test_an_exception_never_raised_is_recorded_without_frames():
    (e,) = tracerl.TrajectoryGroup([make_trajectory()], exceptions=[ValueError("boom")]).exceptions
    assert e.traceback == "ValueError: boom\n"


def test_a_group_takes_a_generator_of_trajectories():
    g = tracerl.TrajectoryGroup(make_trajectory(r) for r in (0.5, 1.5))
    assert [t.reward for t in g] == [0.5, 1.5]


def test_exceptions_among_trajectories_become_the_groups_failed_rollouts():
    g = tracerl.TrajectoryGroup([make_trajectory(), ValueError("boom")], exceptions=[KeyError("k")])
    assert len(g) == 1 and [e.type for e in g.exceptions] == ["ValueError", "KeyError"]


def test_trajectory_created_in_rollout_scope_gets_its_id():
    with tracerl.rollout_scope("ro-abc"):
        t = tracerl.Trajectory(messages_and_choices=[])
    assert t.rollout_id == "ro-abc"


def test_trajectory_created_outside_a_rollout_has_no_id():
    assert tracerl.Trajectory(messages_and_choices=[]).rollout_id is None


# --- bad input: every constructor names what is wrong ----------------------------------------

BAD_TRAJECTORIES = {
    "reward-nan": ({"reward": math.nan}, "reward"),
    "reward-inf": ({"reward": math.inf}, "reward"),
    "reward-minus-inf": ({"reward": -math.inf}, "reward"),
    "reward-string": ({"reward": "1.0"}, "reward"),
    "reward-none": ({"reward": None}, "reward"),
    "metric-inf": ({"metrics": {"x": math.inf}}, r"metrics\['x'\]"),
    "unknown-role": ({"messages_and_choices": [{"role": "user", "content": "hi"},
                                               {"role": "robot", "content": "beep"}]},
                     r"messages_and_choices\[1\].*'robot'"),
    "not-a-message": ({"messages_and_choices": ["just a string"]},
                      "message dict or an openai Choice"),
    "metadata-not-json": ({"metadata": {"f": object()}}, "JSON"),
    "history-with-unknown-role": (
        {"additional_histories": [{"messages_and_choices": [
            {"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]}]},
        r"messages_and_choices\[1\].*'robot'"),
}


@pytest.mark.parametrize("case", BAD_TRAJECTORIES, ids=list(BAD_TRAJECTORIES))
def test_a_bad_trajectory_is_refused_naming_the_field(case):
    fields, message = BAD_TRAJECTORIES[case]
    with pytest.raises(tracerl.InvalidTrajectoryError, match=message):
        tracerl.Trajectory(**{"messages_and_choices": [], **fields})


def test_reward_assignment_is_validated_too():
    t = tracerl.Trajectory(messages_and_choices=[])
    with pytest.raises(tracerl.InvalidTrajectoryError, match="finite"):
        t.reward = float("nan")


BAD_GROUPS = {
    "empty": ([], "at least one trajectory"),
    "not-trajectories": ([1], r"trajectories\[0\] is a int"),
}


@pytest.mark.parametrize("case", BAD_GROUPS, ids=list(BAD_GROUPS))
def test_a_bad_group_is_refused(case):
    trajectories, message = BAD_GROUPS[case]
    with pytest.raises(tracerl.InvalidTrajectoryError, match=message):
        tracerl.TrajectoryGroup(trajectories)


BAD_COMPLETIONS = {
    "fewer-logprobs-than-tokens": (([1, 2], [-0.1]), "2 token ids but 1 logprobs"),
    "positive-logprob": (([1], [0.5]), "not a log-probability"),
    "nan-logprob-after-good-ones": (([1, 2, 3], [-0.1, -0.2, float("nan")]), "logprob nan"),
}


@pytest.mark.parametrize("case", BAD_COMPLETIONS, ids=list(BAD_COMPLETIONS))
def test_a_bad_completion_record_is_refused(case):
    (token_ids, logprobs), message = BAD_COMPLETIONS[case]
    with pytest.raises(tracerl.InvalidTrajectoryError, match=message):
        tracerl.CompletionRecord(token_ids=token_ids, logprobs=logprobs)


def test_a_call_record_line_is_the_json_of_its_fields():
    call = make_trajectory().llm_calls[0]
    call.request = {"messages": [{"role": "user", "content": "NaN, Infinity or 4721? é"}]}
    line = call.json_line()
    assert b"\n" not in line
    assert json.loads(line) == call.model_dump(mode="json")  # text that says NaN is only text


def test_a_call_record_with_a_non_finite_float_is_not_json():
    call = make_trajectory().llm_calls[0]
    call.completions[0].logprobs = [-0.5, float("-inf")]  # a log-probability, but not JSON
    with pytest.raises(ValueError, match="not JSON compliant"):
        call.json_line()


# --- the train config ----------------------------------------------------------------------

BAD_TRAIN_CONFIGS = {
    "zero-learning-rate": ({"learning_rate": 0}, "learning_rate"),
    "misspelt-field": ({"learnign_rate": 1e-5}, "extra"),
}


@pytest.mark.parametrize("case", BAD_TRAIN_CONFIGS, ids=list(BAD_TRAIN_CONFIGS))
def test_train_config_rejects_bad_values(case):
    fields, message = BAD_TRAIN_CONFIGS[case]
    with pytest.raises(ValueError, match=message):
        tracerl.TrainConfig(**fields)


def test_train_config_round_trips_through_json():
    config = tracerl.TrainConfig(learning_rate=1e-5, beta=0.05)
    assert tracerl.TrainConfig.model_validate_json(config.model_dump_json()) == config
