"""A third-party plugin used by the tests: a length judge, a metrics recorder, an inference
engine (echo_engine.py), an API protocol (plain_protocol.py) and a catalog task
(reverse_task.py)."""

import tracerl

TRACERL_PLUGIN_API = 1
LOGGED: list = []


@tracerl.hookimpl
def tracerl_score_group(group, judge):
    if judge not in (None, "length"):
        return None

    async def score():
        for t in group.trajectories:
            t.reward = float(len(t.messages()[-1].get("content") or ""))
        return group

    return score()


@tracerl.hookimpl
def tracerl_log_metrics(model, step, split, metrics):
    LOGGED.append((model.name, step, split, metrics["reward"]))


@tracerl.hookimpl
def tracerl_engines():
    from .echo_engine import EchoEngine

    return [EchoEngine]


@tracerl.hookimpl
def tracerl_protocols():
    from .plain_protocol import Plain

    return [Plain]


@tracerl.hookimpl
def tracerl_tasks():
    return {"example-reverse": "tracerl_example_plugin.reverse_task:TASK"}
