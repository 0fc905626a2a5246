"""The Weave plugin against a recording stand-in trace server: real rollouts through the
gateway become Weave calls (rollout -> LLM calls) with inputs, outputs, usage and reward."""

import socket

import pytest

import tracerl
from tracerl.events.lifecycle import trajectory_finished
from tracerl.events.plugins import get_plugin_manager, register
from tracerl.integrations import weave_logger
from tracerl.integrations.weave_logger import WeaveLogger

from .weave_server import WeaveRecorder


@pytest.fixture
def weave_recorder(monkeypatch):
    for k, v in {"WEAVE_PRINT_CALL_LINK": "false", "WEAVE_CAPTURE_CODE": "false",
                 "WEAVE_IMPLICITLY_PATCH_INTEGRATIONS": "false", "WEAVE_USE_SERVER_CACHE": "false"
                 }.items():
        monkeypatch.setenv(k, v)
    real = socket.getaddrinfo

    def loopback_only(host, *args, **kwargs):  # nothing may leave the machine
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise OSError(f"test tripwire: lookup of {host}")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", loopback_only)
    from weave.trace.weave_client import WeaveClient
    from weave.trace_server_bindings.remote_http_trace_server import RemoteHTTPTraceServer

    recorder = WeaveRecorder()
    logger = WeaveLogger(WeaveClient("tests", "weave",
                                     RemoteHTTPTraceServer(recorder.url, should_batch=True),
                                     ensure_project_exists=False))
    name = register(logger, name="weave_logger_test")
    yield recorder, logger
    get_plugin_manager().unregister(name=name)
    recorder.close()


async def test_rollouts_become_weave_calls_with_rewards(tf_backend, weave_recorder):
    _, model = tf_backend
    weave_recorder, logger = weave_recorder

    async def rollout(i: int) -> tracerl.Trajectory:
        client = model.openai_client()
        messages = [{"role": "user", "content": f"Say {i}."}]
        first = await client.chat.completions.create(
            model=model.name, messages=messages, max_tokens=3
        )
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "Again."}]
        second = await client.chat.completions.create(
            model=model.name, messages=messages, max_tokens=2
        )
        return tracerl.Trajectory(
            messages_and_choices=[*messages, second.choices[0]],
            reward=0.25 * i,
            metrics={"turns": 2.0},
            metadata={"scenario": f"s{i}"},
        )

    (group,) = await tracerl.gather_trajectory_groups(
        [tracerl.TrajectoryGroup(rollout(i) for i in range(2))], show_progress=False)
    logger.flush()

    calls = weave_recorder.calls()
    rollouts = {c["attributes"]["rollout_id"]: c for c in calls.values()
                if c["op_name"].split("/")[-1].startswith(weave_logger.ROLLOUT_OP + ":")}
    assert set(rollouts) == {t.rollout_id for t in group}
    feedback = {f["weave_ref"].rsplit("/", 1)[-1]: f for f in weave_recorder.feedback()}
    for t in group:
        ro = rollouts[t.rollout_id]
        assert (
            ro["inputs"]["metadata"] == t.metadata
            and ro["inputs"]["messages"][0]["content"] == t.messages()[0]["content"]
        )
        assert ro["output"]["reward"] == t.reward and ro["output"]["metrics"] == {"turns": 2.0}
        assert ro["parent_id"] is None and ro["ended_at"] >= ro["started_at"]
        assert feedback[ro["id"]]["feedback_type"] == "reward" and feedback[ro["id"]][
            "payload"
        ] == {"value": t.reward}
        children = sorted(
            (c for c in calls.values() if c.get("parent_id") == ro["id"]),
            key=lambda c: c["started_at"],
        )
        assert len(children) == len(t.llm_calls) == 2
        for child, record in zip(children, t.llm_calls, strict=True):
            assert child["op_name"].split("/")[-1].startswith(weave_logger.LLM_CALL_OP + ":")
            assert child["trace_id"] == ro["trace_id"]
            assert (
                child["attributes"]["call_id"] == record.id
                # the session model's step: an earlier test may have trained it
                and child["attributes"]["adapter_step"] == record.adapter_step is not None
            )
            assert child["inputs"]["messages"] == record.request["messages"]
            usage = child["output"]["usage"]
            assert usage["prompt_tokens"] == len(record.prompt_token_ids) > 0
            assert usage["completion_tokens"] == len(record.completions[0].token_ids) > 0
            assert child["output"]["choices"][0]["text"] == record.completions[0].text


def test_an_unregistered_logger_sends_nothing(weave_recorder):
    weave_recorder, logger = weave_recorder
    get_plugin_manager().unregister(plugin=logger)
    trajectory_finished(tracerl.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}],
                                           reward=1.0))
    logger.flush()
    assert weave_recorder.calls() == {} and weave_recorder.feedback() == []
