"""Online learning on the demo's task (repeat a number) with simulated production traffic.

A LocalBackend serves SmolLM2-135M-Instruct (transformers engine) in online mode
(:class:`tracerl.backend.online.loop.OnlineLoop`). A traffic simulator calls it as a production
service would: plain chat completions tagged ``task=repeat``, arriving on a simulated clock, each
reward sent through the feedback route a random delay later (late rewards), a share of them
never (they expire). The first candidate is trained on an inverted reward (a
``tracerl_online_batch`` hook gives 1 for leaving the number out: it really learns the wrong
thing); the gates should roll it back. Every ``--eval-every`` simulated minutes the incumbent
answers held-out numbers greedily; the report is held-out success over simulated time, the
release decisions, and the expiry counts.

The simulated clock runs ``--speedup`` times faster than the wall clock: an hour of traffic
(``--sim-minutes 60``) with ``--speedup 6`` arrives in 10 real minutes; reward delays and the
reward TTL are simulated minutes too (divided by the speedup on the wall clock).

    PYTHONPATH=. .venv/bin/python benchmarks/online_learning.py --sim-minutes 60 --speedup 6
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
    backend.gateway_loop.call_soon_threadsafe(stop.set)
    await asyncio.wrap_future(runner)
    records = loop.control.log.records()
    status = loop.status()
    await backend.close()
    return {"timeline": timeline, "failed_calls": len(failed), "failures": failed[:5],
            "feedback": feedback, "online": status, "inverted_step": fault.inverted,
            "rejected": [r["step"] for r in records if r["event"] == "rejected"],
            "promoted": [r["step"] for r in records
                         if r["event"] == "commit" and r["action"] == "promote"],
            "wall_s": round(time.monotonic() - started, 1), "args": vars(a)}


async def _event() -> asyncio.Event:
    return asyncio.Event()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sim-minutes", type=float, default=60.0, help="simulated traffic span")
    p.add_argument("--speedup", type=float, default=6.0, help="simulated seconds per real one")
    p.add_argument("--calls-per-minute", type=float, default=6.0,
                   help="production calls per simulated minute")
    p.add_argument("--delay-min", type=float, default=1.0, help="reward delay, sim minutes")
    p.add_argument("--delay-max", type=float, default=20.0)
    p.add_argument("--no-feedback", type=float, default=0.1,
                   help="share of calls whose reward never comes")
    p.add_argument("--ttl-sim-minutes", type=float, default=30.0,
                   help="TRACERL_ONLINE_REWARD_TTL_S, in simulated minutes")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups-per-step", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=5e-3)
    p.add_argument("--min-samples", type=int, default=16, help="gate: rewards per arm")
    p.add_argument("--margin", type=float, default=0.15, help="gate: reward margin")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--temperature", type=float, default=0.5, help="of production calls")
    p.add_argument("--held-out", type=int, default=16)
    p.add_argument("--eval-every", type=float, default=6.0, help="sim minutes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--path", default=None)
    p.add_argument("--out", default=None, help="write the JSON report here too")
    a = p.parse_args()
    report = asyncio.run(run(a))
    text = json.dumps(report, indent=1)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
