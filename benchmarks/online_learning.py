"""Online learning with simulated production traffic: the demo's task (``--task repeat``:
repeat a number) or a catalog agent that learns (``--task tool-products``, the default).

A LocalBackend serves SmolLM2-135M-Instruct (transformers engine) in online mode
(:class:`tracerl.backend.online.loop.OnlineLoop`). A traffic simulator calls it as a production
service would, on a simulated clock, each reward sent through the feedback route a random delay
later (late rewards), a share of them never (they expire). An injected fault trains a bad
candidate on an inverted reward; the gates should roll it back. Every ``--eval-every``
simulated minutes the incumbent is evaluated greedily on held-out problems; the report is
held-out success over simulated time, the release decisions, the failed production calls and
the expiry counts.

``--task repeat``: plain chat completions tagged ``task=repeat``; the first online batch gets
``1 - number_reward`` (tests/online_bad_candidate_plugin.py).

``--task tool-products``: the task's own LangGraph agent (tracerl/tasks/tool_products.py) on a
plain ``ChatOpenAI`` pointed at the gateway: each episode (a tool call, then the answer) is
tagged ``{"task": <the problem>, "session": <the episode>}``, so online mode keeps its calls as
one rollout and groups ``--group-size`` episodes of one problem; its reward (the task's scorer,
shaped) is posted to the episode's last response id. Problems come from the task's train
split, each asked ``--asks`` times while ``--pool`` of them are open (popular questions); the
held-out split is evaluated with :func:`tracerl.tasks.runner.evaluate`. The first
``--bad-batches`` batches trained once a trained incumbent serves well (``--bad-after``) get
``1 - reward`` at ``--bad-lr-factor`` times the learning rate (the injected bad candidate).

The simulated clock runs ``--speedup`` times faster than the wall clock: an hour of traffic
(``--sim-minutes 60``) with ``--speedup 6`` arrives in 10 real minutes; reward delays and the
reward TTL are simulated minutes too (divided by the speedup on the wall clock).

    PYTHONPATH=. .venv/bin/python benchmarks/online_learning.py --seed 0
    PYTHONPATH=. .venv/bin/python benchmarks/online_learning.py --task repeat \
        --sim-minutes 60 --speedup 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from typing import Any

import httpx

import tracerl
from tests.online_bad_candidate_plugin import inverted_reward
from tracerl.backend.online.loop import OnlineLoop
from tracerl.backend.training.health import CLAIMED
from tracerl.core.config import OnlineConfig
from tracerl.core.storage import ModelStore, append_jsonl
from tracerl.demo import SYSTEM, number_reward, scenarios
from tracerl.events.plugins import get_plugin_manager


class InvertFirstBatch:
    """The injected fault: the first online batch gets the true reward with its sign flipped
    (``1 - number_reward``: tests/online_bad_candidate_plugin.py)."""

    def __init__(self) -> None:
        self.inverted: list[int] = []

    @tracerl.hookimpl
    def tracerl_online_batch(self, model: Any, step: int, groups: list[Any]) -> None:
        if not self.inverted:
            self.inverted.append(step)
            for group in groups:
                for t in group.trajectories:
                    t.reward = inverted_reward(t)


def messages(number: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Repeat this number: {number}"}]


async def held_out(http: httpx.AsyncClient, store: ModelStore, name: str, step: int,
                   numbers: list[str]) -> dict[str, float]:
    """Greedy answers of version ``step`` on ``numbers``: mean reward and exact share."""
    async def one(i: int, number: str) -> float:
        r = await http.post("/chat/completions", headers={"x-rollout-id": f"heldout-{step}-{i}"},
                            json={"model": f"{name}@{step}", "messages": messages(number),
                                  "max_tokens": 16, "temperature": 0.0})
        r.raise_for_status()
        return number_reward(r.json()["choices"][0]["message"]["content"] or "", number)

    rewards = await asyncio.gather(*(one(i, n) for i, n in enumerate(numbers)))
    append_jsonl(store.root / "calls" / CLAIMED,  # evaluation calls: not orphans
                 {"rollout_ids": [f"heldout-{step}-{i}" for i in range(len(numbers))]})
    return {"reward": sum(rewards) / len(rewards),
            "exact": sum(r == 1.0 for r in rewards) / len(rewards)}


async def run(a: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(a.seed)
    fault = InvertFirstBatch()
    get_plugin_manager().register(fault, name="online-benchmark-fault")
    backend = tracerl.LocalBackend(path=a.path or tempfile.mkdtemp(prefix="online-bench-"),
                                   engine="transformers")
    model = tracerl.TrainableModel(
        name="online-bench", project="bench", base_model="smollm2",
        config=tracerl.ModelConfig(lora=tracerl.LoraConfig(r=8, alpha=16),
                                   engine=tracerl.EngineConfig(max_model_len=256)))
    await model.register(backend)
    speed = a.speedup
    config = OnlineConfig(
        group_size=a.group_size, groups_per_step=a.groups_per_step, canary_share=0.5,
        evaluate_every=8, train=tracerl.TrainConfig(learning_rate=a.learning_rate),
        gates={"min_samples": a.min_samples, "margin": a.margin,
               "length_ratio": [0.1, 10.0]},  # the task rewards brevity: no length drift
        poll_s=0.5,
        reward_ttl_s=a.ttl_sim_minutes * 60 / speed)
    loop = OnlineLoop(backend, model, config)
    stop = await backend.call_on_gateway(_event())
    runner = asyncio.run_coroutine_threadsafe(loop.run(stop), backend.gateway_loop)
    numbers = scenarios(seed=12345, n=a.held_out)
    timeline: list[dict[str, Any]] = []
    failed: list[str] = []
    feedback = {"sent": 0, "never": 0, "rejected": 0}
    started = time.monotonic()

    def sim_now() -> float:  # simulated minutes since the start
        return (time.monotonic() - started) * speed / 60

    async def at_sim(minute: float) -> None:
        await asyncio.sleep(max(0.0, minute * 60 / speed - (time.monotonic() - started)))

    async with httpx.AsyncClient(base_url=backend.base_url, timeout=300) as http:
        gate = asyncio.Semaphore(a.concurrency)

        async def production_call(minute: float) -> None:
            await at_sim(minute)
            number = str(rng.randint(100, 9999))
            async with gate:
                r = await http.post("/chat/completions", headers={
                    "x-tracerl-tags": json.dumps({"task": "repeat"})}, json={
                    "model": model.name, "messages": messages(number), "max_tokens": 16,
                    "temperature": a.temperature})
            if r.status_code != 200:
                failed.append(f"{r.status_code} {r.text[:200]}")
                return
            body = r.json()
            if rng.random() < a.no_feedback:
                feedback["never"] += 1
                return
            reward = number_reward(body["choices"][0]["message"]["content"] or "", number)
            await at_sim(sim_now() + rng.uniform(a.delay_min, a.delay_max))  # a late reward
            f = await http.post(f"/feedback/{body['id']}", json={"reward": reward})
            feedback["sent" if f.status_code == 200 else "rejected"] += 1

        async def evaluations() -> None:
            minute = 0.0
            while minute <= a.sim_minutes:
                await at_sim(minute)
                state = loop.control.state()
                score = await held_out(http, backend.store(model), model.name,
                                       state.incumbent or 0, numbers)
                timeline.append({"sim_minute": round(sim_now(), 1), "incumbent": state.incumbent,
                                 "candidate": state.candidate, **score})
                print(f"sim {sim_now():5.1f} min  incumbent {state.incumbent}  held-out reward "
                      f"{score['reward']:.3f} exact {score['exact']:.2f}", file=sys.stderr)
                minute += a.eval_every

        n_calls = int(a.sim_minutes * a.calls_per_minute)
        arrivals = sorted(rng.uniform(0, a.sim_minutes) for _ in range(n_calls))
        await asyncio.gather(evaluations(), *(production_call(m) for m in arrivals))
    records, status = await stop_online(backend, loop, stop, runner)
    await backend.close()
    return {"timeline": timeline, "failed_calls": len(failed), "failures": failed[:5],
            "feedback": feedback, "online": status, "inverted_step": fault.inverted,
            "rejected": [r["step"] for r in records if r["event"] == "rejected"],
            "promoted": [r["step"] for r in records
                         if r["event"] == "commit" and r["action"] == "promote"],
            "wall_s": round(time.monotonic() - started, 1), "args": vars(a)}


async def stop_online(backend: Any, loop: OnlineLoop, stop: asyncio.Event,
                      runner: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Stop the online loop (its ``stop`` event, set on the gateway's loop), wait until it
    ended, and return its release records and status."""
    backend.gateway_loop.call_soon_threadsafe(stop.set)
    await asyncio.wrap_future(runner)
    return loop.control.log.records(), loop.status()


async def _event() -> asyncio.Event:
    return asyncio.Event()


TASK_DEFAULTS = {  # per --task: the defaults of the options that differ
    "repeat": {"sim_minutes": 60.0, "speedup": 6.0, "calls_per_minute": 6.0, "group_size": 4,
               "groups_per_step": 4, "learning_rate": 5e-3, "min_samples": 16, "margin": 0.15,
               "concurrency": 8, "temperature": 0.5, "held_out": 16, "eval_every": 6.0,
               "ttl_sim_minutes": 30.0},
    "tool-products": {"sim_minutes": 1440.0, "speedup": 72.0, "calls_per_minute": 0.15,
                      "group_size": 6, "groups_per_step": 3, "learning_rate": 1e-3,
                      "min_samples": 8, "margin": 0.1, "concurrency": 6, "temperature": 1.0,
                      "held_out": 12, "eval_every": 360.0, "ttl_sim_minutes": 720.0},
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=sorted(TASK_DEFAULTS), default="tool-products")
    p.add_argument("--sim-minutes", type=float, help="simulated traffic span")
    p.add_argument("--speedup", type=float, help="simulated seconds per real one")
    p.add_argument("--calls-per-minute", type=float,
                   help="production calls (episodes) per simulated minute")
    p.add_argument("--delay-min", type=float, default=1.0, help="reward delay, sim minutes")
    p.add_argument("--delay-max", type=float, default=20.0)
    p.add_argument("--no-feedback", type=float, default=0.1,
                   help="share of calls whose reward never comes")
    p.add_argument("--ttl-sim-minutes", type=float,
                   help="TRACERL_ONLINE_REWARD_TTL_S, in simulated minutes")
    p.add_argument("--group-size", type=int)
    p.add_argument("--groups-per-step", type=int)
    p.add_argument("--learning-rate", type=float)
    p.add_argument("--min-samples", type=int, help="gate: rewards per arm")
    p.add_argument("--margin", type=float, help="gate: reward margin")
    p.add_argument("--concurrency", type=int)
    p.add_argument("--temperature", type=float, help="of production calls")
    p.add_argument("--held-out", type=int)
    p.add_argument("--eval-every", type=float, help="sim minutes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--path", default=None)
    p.add_argument("--out", default=None, help="write the JSON report here too")
    p.add_argument("--pool", type=int, default=4, help="tool-products: problems open at once")
    p.add_argument("--asks", type=int, default=7, help="tool-products: episodes per problem")
    p.add_argument("--bad-batches", type=int, default=1,
                   help="tool-products: inverted batches after the first promotion")
    p.add_argument("--bad-lr-factor", type=float, default=10.0,
                   help="tool-products: the bad batches' learning rate, times --learning-rate")
    p.add_argument("--bad-after", type=float, default=0.3,
                   help="tool-products: production success (last 12 episodes, and the batch's "
                   "own) that arms the fault")
    p.add_argument("--judge-within", type=float, default=720.0,
                   help="tool-products: simulated minutes of traffic after the day while an "
                   "inverted candidate is unjudged")
    a = p.parse_args()
    for key, value in TASK_DEFAULTS[a.task].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.task == "tool-products":
        from benchmarks.online_tool_agent import run as run_tool_agent

        report = asyncio.run(run_tool_agent(a))
    else:
        report = asyncio.run(run(a))
    text = json.dumps(report, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
