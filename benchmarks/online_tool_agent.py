"""``benchmarks/online_learning.py --task tool-products``: the tool-products agent
(tracerl/tasks/tool_products.py) as production traffic of a model in online mode.

Each episode is the task's LangGraph agent on a plain ``ChatOpenAI`` pointed at the gateway, as
a production service would run it: its calls tagged ``{"task": <problem>, "session":
<episode>}`` (one live rollout, grouped by problem), its reward (the task's shaped scorer)
posted late to its last response id, a share never. The incumbent's held-out success is
:func:`tracerl.tasks.runner.evaluate` on the task's test split, greedily, every
``--eval-every`` simulated minutes. The injected fault: the first ``--bad-batches`` online
batches trained once a trained incumbent serves production well (its last 12 episodes succeed
``--bad-after`` or more), and whose own episodes succeed that often (a batch of failures,
inverted, teaches next to nothing: 2 of 3 runs on 2026-12-07 before this rule), get ``1 -
reward`` (at ``--bad-lr-factor`` times the learning rate); the gates should roll each back.
When the day ends with such a candidate not yet judged (2 of 2 runs on the loaded 2-core box,
2026-12-07), the traffic goes on an hour at a time until the gates judge it, for up to
``--judge-within`` simulated minutes (``extended_sim_minutes`` in the report). Each trained
inverted candidate and its parent are evaluated on the held-out split at the end
(``inverted_held_out``), each loaded again first: the ground truth the gates' verdict is
checked against (until 2026-12-08 a version retired by then was not loaded again, so its pinned
calls got 404 and it scored 0 successes: ``inverted_held_out_errors`` now says what share of
rollouts failed). A held-out evaluation of the incumbent during which a promotion retired it
is run again on the new incumbent (``rollout_errors`` in the timeline). One inverted
batch at 2x the learning rate was not clearly worse (seed 0, 2026-12-07: held-out 1.00, promoted
on rewards 1.00 vs 0.84), so the fault's step runs at 10x (``--bad-lr-factor``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
from langchain_core.callbacks import BaseCallbackHandler

import tracerl
from tracerl.backend.online.loop import OnlineLoop
from tracerl.core.config import OnlineConfig
from tracerl.events.plugins import get_plugin_manager
from tracerl.tasks import tool_products
from tracerl.tasks.base import Item
from tracerl.tasks.runner import evaluate

log = logging.getLogger("online_tool_agent")


class InvertAfterLearning:
    """The injected fault: the first ``n`` online batches trained once the incumbent is a
    trained version and ``armed()`` (production succeeds) get ``1 - reward`` (the shaped reward
    is in [0, 1]), and their step the learning rate times ``factor``."""

    def __init__(self, loop: OnlineLoop, n: int, factor: float,
                 armed: Callable[[], bool], least_success: float) -> None:
        self.loop, self.n, self.factor, self.armed = loop, n, factor, armed
        self.least_success = least_success  # of the batch itself: successes to unlearn
        self.inverted: list[int] = []
        self.lr = loop.config.train.learning_rate

    @tracerl.hookimpl
    def tracerl_online_batch(self, model: Any, step: int, groups: list[Any]) -> None:
        config = self.loop.config
        if len(self.inverted) >= self.n or not self.loop.control.state().incumbent \
                or not self.armed() or batch_success(groups) < self.least_success:
            config.train = config.train.model_copy(update={"learning_rate": self.lr})
            return
        self.inverted.append(step)
        config.train = config.train.model_copy(update={"learning_rate": self.lr * self.factor})
        for group in groups:
            for t in group.trajectories:
                t.reward = 1.0 - t.reward


def batch_success(groups: list[Any]) -> float:
    """The share of a batch's episodes that succeeded (the ``success`` metric each feedback
    carries): inverting a batch of failures teaches little, so the fault waits for successes."""
    episodes = [t for g in groups for t in g.trajectories]
    return sum(t.metrics.get("success", 0.0) for t in episodes) / max(len(episodes), 1)


class ResponseIds(BaseCallbackHandler):
    """The chat completion ids an episode's calls got (LangChain drops them on failure)."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def on_llm_end(self, response: Any, **kwargs: Any) -> None:
        for generations in response.generations:
            for g in generations:
                message = getattr(g, "message", None)
                rid = (message.response_metadata or {}).get("id") if message else None
                if rid:
                    self.ids.append(rid)


class Traffic:
    """Problems of the train split, each asked ``asks`` times while ``pool`` are open."""

    def __init__(self, rng: random.Random, seed: int, pool: int, asks: int, n: int) -> None:
        self.rng, self.asks = rng, asks
        needed = n // asks + pool + 2
        self.fresh = tool_products.TASK.items("train", needed, seed=seed + 1000)
        self.open: list[tuple[Item, int]] = [(self.fresh.pop(), 0) for _ in range(pool)]

    def next(self) -> Item:
        i = self.rng.randrange(len(self.open))
        item, asked = self.open[i]
        if asked + 1 >= self.asks and self.fresh:
            self.open[i] = (self.fresh.pop(), 0)
        else:
            self.open[i] = (item, asked + 1)
        return item


def _config(a: argparse.Namespace) -> OnlineConfig:
    return OnlineConfig(
        group_size=a.group_size, groups_per_step=a.groups_per_step, canary_share=0.5,
        evaluate_every=4, poll_s=0.5, reward_ttl_s=a.ttl_sim_minutes * 60 / a.speedup,
        train=tracerl.TrainConfig(learning_rate=a.learning_rate, seed=a.seed,
                                  micro_batch_tokens=1024),
        # the monitors widened for a CPU shared with other work (latency) and for an agent
        # that learns to call the tool (length): the reward gate is the one under test
        gates={"min_samples": a.min_samples, "margin": a.margin, "length_ratio": [0.2, 5.0],
               "p95_latency_ratio": 10.0, "max_broken_tool_call_increase": 0.3})


async def run(a: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(a.seed)
    backend = tracerl.LocalBackend(path=a.path or tempfile.mkdtemp(prefix="online-tool-"),
                                   engine="transformers")
    model = tracerl.TrainableModel(name="online-tool", project="bench", base_model="smollm2",
                                   config=tool_products.TASK.model_config())
    await model.register(backend)
    loop = OnlineLoop(backend, model, _config(a))
    out = Outcome()

    def armed() -> bool:  # the last 12 production episodes succeed at least --bad-after
        recent = [s for _, s in out.train_success[-12:]]
        return len(recent) == 12 and sum(recent) / 12 >= a.bad_after

    fault = InvertAfterLearning(loop, a.bad_batches, a.bad_lr_factor, armed, a.bad_after)
    get_plugin_manager().register(fault, name="online-benchmark-fault")
    stop = await backend.call_on_gateway(_event())
    runner = asyncio.run_coroutine_threadsafe(loop.run(stop), backend.gateway_loop)
    n_calls = int(a.sim_minutes * a.calls_per_minute)
    traffic = Traffic(rng, a.seed, a.pool, a.asks, n_calls)
    sim = SimClock(a.speedup)
    async with httpx.AsyncClient(base_url=backend.base_url, timeout=600) as http:
        from langchain_openai import ChatOpenAI

        gate = asyncio.Semaphore(a.concurrency)
        key = backend.api_key or "tracerl-local"

        async def episode(minute: float) -> None:
            await sim.at(minute)
            item, session = traffic.next(), uuid.uuid4().hex
            tags = {"task": item.key, "session": session}
            llm = ChatOpenAI(model=model.get_inference_name(), base_url=backend.base_url,
                             api_key=key, temperature=a.temperature, max_tokens=40, max_retries=0,
                             default_headers={"x-tracerl-tags": json.dumps(tags)},
                             http_async_client=http)
            ids = ResponseIds()
            async with gate:
                try:
                    _, reward, metrics = await tool_products.play(
                        tool_products.agent_with(llm), item, {"callbacks": [ids]})
                except Exception as e:  # a failed production call
                    out.failed.append(f"{type(e).__name__}: {str(e)[:200]}")
                    return
            out.episodes += 1
            out.train_success.append((sim.now(), metrics["success"]))
            if not ids.ids or rng.random() < a.no_feedback:
                out.feedback["never"] += 1
                return
            await sim.at(sim.now() + rng.uniform(a.delay_min, a.delay_max))  # a late reward
            try:
                f = await http.post(f"/feedback/{ids.ids[-1]}", json={
                    "reward": reward, "metrics": {"success": metrics["success"]}})
            except httpx.HTTPError as e:  # counted: one lost reward does not end the day
                out.feedback[f"failed {type(e).__name__}"] += 1
                return
            out.feedback["sent" if f.status_code == 200 else f"refused {f.status_code}"] += 1

        async def held_out(step: int) -> dict[str, float]:  # greedy, the same problems
            return await evaluate(tool_products.TASK, model, n=a.held_out, temperature=0.0,
                                  step=step, seed=12345, log_to_model=False)

        async def evaluate_incumbent() -> None:
            for _ in range(3):  # a promotion mid-evaluation retires the version evaluated
                state = loop.control.state()
                step = state.incumbent or 0
                score = await held_out(step)
                if not score["rollout_errors"] or loop.control.state().incumbent in (None, step):
                    break
            out.timeline.append({"sim_minute": round(sim.now(), 1), "incumbent": step,
                                 "candidate": state.candidate,
                                 "success": score.get("metrics/success", 0.0),
                                 "reward": score["reward"],
                                 "rollout_errors": score["rollout_errors"]})
            print(f"sim {sim.now():6.1f} min  incumbent {step}  held-out success "
                  f"{out.timeline[-1]['success']:.2f}", file=sys.stderr, flush=True)

        async def evaluations() -> None:
            minute = 0.0
            while minute <= a.sim_minutes:
                await sim.at(minute)
                await evaluate_incumbent()
                minute += a.eval_every

        arrivals = sorted(rng.uniform(0, a.sim_minutes) for _ in range(n_calls))
        await asyncio.gather(evaluations(), *(episode(m) for m in arrivals))
        # the day is over; while a bad candidate is still unjudged (on a slow machine the gates
        # may not have their rewards yet), the traffic goes on, an hour at a time, for up to
        # --judge-within simulated minutes, then the incumbent is evaluated once more
        day_end = sim.now()
        while unjudged(loop, fault.inverted) and sim.now() < day_end + a.judge_within:
            start = sim.now()
            hour = sorted(rng.uniform(start, start + 60)
                          for _ in range(max(1, round(60 * a.calls_per_minute))))
            await asyncio.gather(*(episode(m) for m in hour))
        out.extended_sim_minutes = sim.now() - day_end if fault.inverted else 0.0
        if out.extended_sim_minutes and unjudged(loop, fault.inverted) != fault.inverted:
            await evaluate_incumbent()
        # ground truth for the gates: each trained inverted candidate and the version it was
        # trained from (its step - 1), on the held-out split
        newest = await model.get_step()
        for step in [s for s in fault.inverted if s <= newest]:
            for judged in (step - 1, step):
                if judged > 0:  # loaded again if retired (a pinned call to it would get 404)
                    await backend.serve_step(model, judged)
                score = await held_out(judged)
                out.inverted_held_out[str(judged)] = score.get("metrics/success", 0.0)
                out.inverted_held_out_errors[str(judged)] = score["rollout_errors"]
    from benchmarks.online_learning import stop_online

    records, status = await stop_online(backend, loop, stop, runner)
    get_plugin_manager().unregister(name="online-benchmark-fault")
    await backend.close()
    return out.report(records, status, fault.inverted, sim, a)


def unjudged(loop: OnlineLoop, steps: list[int]) -> list[int]:
    """The steps among ``steps`` that the release gates have neither promoted nor rejected."""
    judged = {r["step"] for r in loop.control.log.records()
              if (r["event"] == "commit" and r.get("action") == "promote")
              or r["event"] == "rejected"}
    return [s for s in steps if s not in judged]


class SimClock:
    """Simulated minutes since the start, ``speedup`` times the wall clock."""

    def __init__(self, speedup: float) -> None:
        self.speedup, self.started = speedup, time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self.started) * self.speedup / 60

    async def at(self, minute: float) -> None:
        await asyncio.sleep(max(0.0, (minute - self.now()) * 60 / self.speedup))


class Outcome:
    """What the run saw: episodes, failed calls, feedback, the held-out timeline."""

    def __init__(self) -> None:
        self.episodes = 0
        self.failed: list[str] = []
        self.feedback: Counter[str] = Counter()
        self.timeline: list[dict[str, Any]] = []
        self.train_success: list[tuple[float, float]] = []
        self.extended_sim_minutes = 0.0  # traffic after the day, for an unjudged bad candidate
        self.inverted_held_out: dict[str, float] = {}  # inverted steps and their parents
        self.inverted_held_out_errors: dict[str, float] = {}  # their failed rollouts' share

    def report(self, records: list[dict[str, Any]], status: dict[str, Any],
               inverted: list[int], sim: SimClock, a: argparse.Namespace) -> dict[str, Any]:
        gates = [{"step": r["step"], "verdict": r["verdict"], "tripped": r["tripped"],
                  "rewards": [r["evidence"]["candidate"]["reward_mean"],
                              r["evidence"]["incumbent"]["reward_mean"]],
                  "n": [r["evidence"]["candidate"]["rewards"],
                        r["evidence"]["incumbent"]["rewards"]]}
                 for r in records if r["event"] == "gate" and r["verdict"] != "continue"]
        quarters = [[s for m, s in self.train_success
                     if q * a.sim_minutes / 4 <= m < (q + 1) * a.sim_minutes / 4]
                    for q in range(4)]
        return {"timeline": self.timeline,
                "held_out_start": self.timeline[0]["success"] if self.timeline else None,
                "held_out_end": self.timeline[-1]["success"] if self.timeline else None,
                "incumbents": sorted({t["incumbent"] for t in self.timeline}),
                "episodes": self.episodes, "failed_calls": len(self.failed),
                "failures": self.failed[:5], "feedback": dict(self.feedback),
                "production_success_by_quarter": [
                    round(sum(q) / len(q), 3) if q else None for q in quarters],
                "inverted_steps": inverted,
                "extended_sim_minutes": round(self.extended_sim_minutes, 1),
                "inverted_held_out": self.inverted_held_out,
                "inverted_held_out_errors": self.inverted_held_out_errors,
                "promoted": [r["step"] for r in records
                             if r["event"] == "commit" and r["action"] == "promote"],
                "rejected": [r["step"] for r in records if r["event"] == "rejected"],
                "decisions": gates, "online": status,
                "wall_s": round(time.monotonic() - sim.started, 1), "args": vars(a)}


async def _event() -> asyncio.Event:
    return asyncio.Event()
