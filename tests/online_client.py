"""A production client in its own process, for the online-mode tests and benchmark: it calls a
``tracerl serve --online`` model as an outside service would (plain chat completions, a task
tag, no rollout id), scores each answer with the demo's reward and sends it back late through
the feedback route, keyed by the response id it got.

    python tests/online_client.py URL MODEL --key KEY --until-steps 2 --deadline-s 600

Traffic comes in rounds of ``--concurrency`` calls; the feedback for a round is sent
``--feedback-lag`` rounds later (late rewards). It stops when the model's online status shows
``--until-steps`` trained versions all decided (none left in canary), or at the deadline, and
prints one JSON line: calls, failed calls (any non-200 answer), feedback answers by status
(with the message of each refused one), and the online status it saw last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter

import httpx

from tracerl.demo import SYSTEM, number_reward


async def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("model", help="PROJECT/NAME")
    p.add_argument("--key", required=True)
    p.add_argument("--until-steps", type=int, default=2)
    p.add_argument("--deadline-s", type=float, default=600)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--feedback-lag", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = random.Random(a.seed)
    project, name = a.model.split("/")
    headers = {"authorization": f"Bearer {a.key}"}
    calls, failed, refused, feedback = 0, [], [], Counter[int]()
    lagging: list[list[tuple[str, float]]] = []
    status: dict = {}
    deadline = time.monotonic() + a.deadline_s
    async with httpx.AsyncClient(base_url=a.url, headers=headers, timeout=600) as client:

        async def one() -> tuple[str, float] | None:
            number = str(rng.randint(100, 9999))
            r = await client.post("/v1/chat/completions", headers={
                "x-tracerl-tags": json.dumps({"task": "repeat"})}, json={
                "model": name, "max_tokens": a.max_tokens, "temperature": a.temperature,
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"Repeat this number: {number}"}]})
            if r.status_code != 200:
                failed.append(f"{r.status_code} {r.text[:200]}")
                return None
            body = r.json()
            return body["id"], number_reward(body["choices"][0]["message"]["content"] or "",
                                             number)

        while time.monotonic() < deadline:
            answered = await asyncio.gather(*(one() for _ in range(a.concurrency)))
            calls += a.concurrency
            lagging.append([x for x in answered if x is not None])
            if len(lagging) > a.feedback_lag:  # the rewards of an older round arrive now
                for response_id, reward in lagging.pop(0):
                    r = await client.post(f"/v1/feedback/{response_id}", json={"reward": reward})
                    feedback[r.status_code] += 1
                    if r.status_code != 200:
                        refused.append(f"{r.status_code} {r.text[:300]}")
            r = await client.get(f"/api/v1/models/{project}/{name}/online")
            if r.status_code == 200:
                status = r.json()
                if len(status["trained_steps"]) >= a.until_steps and status["candidate"] is None:
                    break
    print(json.dumps({"calls": calls, "failed": failed, "feedback": dict(feedback),
                      "refused_feedback": refused,
                      "status": status, "timed_out": time.monotonic() >= deadline}))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
