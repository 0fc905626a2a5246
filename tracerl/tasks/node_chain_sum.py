"""An agent outside the trainer's process: reasoning-gym's ``chain_sum`` (reasoning-gym 0.1.25,
Apache-2.0; sums and differences of 2-3 one-digit numbers) solved by a Node program
(``node_agent.cjs``, the openai npm client) started per rollout, through the rollout API.

One rollout:

1. the task starts ``node node_agent.cjs`` and sends it the job on stdin (the gateway, the
   served name ``NAME@STEP`` that pins the version, a fresh group of one, the question);
2. Node opens a rollout (``POST /v1/rollouts``), asks the model through the rollout's
   ``base_url`` (recorded under it) and prints its answer;
3. the task scores the answer with reasoning-gym's own scorer (it is Python) and sends the
   score back on Node's stdin; Node posts it as the rollout's reward (``/reward``, with the
   metrics) and finishes the rollout (``/finish``). The reward is the scorer's score (part
   marks for the right number inside other text); success is full marks;
4. the task takes the finished group from the gateway (``gather_external_groups``) and returns
   its trajectory: Node's recorded calls under the rollout API's id, the reward Node posted.

Concurrent rollouts of one process take the ready groups one at a time and hand each to the
rollout that opened it (a group taken by one rollout may be another's). The openai npm
package (a pinned version) is installed under ``TRACERL_NPM_PREFIX`` on first use.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
import time
import uuid
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..core import settings
from ..core.errors import ConfigError, ExternalAgentError
from ..core.trajectory import Trajectory, TrajectoryGroup
from .base import TASKS_EXTRA, Item, Task, lora_config_for

log = logging.getLogger(__name__)
AGENT = Path(__file__).with_name("node_agent.cjs")
NPM_OPENAI = "openai@6.49.0"
DIFFICULTY = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}
TIMEOUT_S = 300.0  # each exchange with the Node agent (a loaded CPU serves slowly)
EXAMPLES = [
    {"role": "user", "content": "State the final answer to the following arithmetic problem: "
                                "3 + 4 ="},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "State the final answer to the following arithmetic problem: "
                                "12 - 5 + 8 ="},
    {"role": "assistant", "content": "15"},
]


def draw(seed: int, n: int) -> list[Item]:
    import reasoning_gym

    dataset = reasoning_gym.create_dataset("chain_sum", seed=seed, size=n, **DIFFICULTY)
    return [Item(key=entry["question"], data=dict(entry)) for entry in dataset]


def score(entry: dict[str, Any], answer: str) -> float:
    """reasoning-gym's own scorer for ``chain_sum``."""
    import reasoning_gym

    return float(reasoning_gym.get_score_answer_fn("chain_sum")(answer.strip(), entry))


NPM_INSTALL_TIMEOUT_S = 600


@contextlib.contextmanager
def _install_lock(prefix: Path) -> Iterator[None]:
    """Held while one process (or thread) checks and installs the npm package under ``prefix``:
    rollouts start at once, in several processes too, and one that saw another's half-done
    install ran Node on missing modules. Waits at most the install's own timeout."""
    prefix.mkdir(parents=True, exist_ok=True)
    path = prefix / ".tracerl-install.lock"
    deadline = time.monotonic() + NPM_INSTALL_TIMEOUT_S + 60
    with open(path, "a") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ConfigError(f"waited {NPM_INSTALL_TIMEOUT_S + 60} s for another "
                                      f"install of {NPM_OPENAI} under {prefix} (lock {path})"
                                      ) from None
                time.sleep(0.2)  # a poll with a deadline: flock has no timeout of its own
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def node_modules() -> Path:
    """The node_modules holding the openai npm package, installed there (pinned) when missing,
    one install at a time."""
    prefix = (settings.TRACERL_NPM_PREFIX.get()
              or settings.TRACERL_CACHE.get() / "npm").expanduser()
    if (prefix / "node_modules" / "openai" / "package.json").exists() and \
            not (prefix / ".tracerl-install.lock").exists():
        return prefix / "node_modules"  # installed by hand or by the GPU kit
    with _install_lock(prefix):
        if not (prefix / "node_modules" / "openai" / "package.json").exists():
            _npm_install(prefix)
    return prefix / "node_modules"


def _npm_install(prefix: Path) -> None:
    npm = shutil.which("npm")
    if npm is None:
        raise ConfigError(f"the node-chain-sum task needs the openai npm package in "
                          f"{prefix}/node_modules and npm to install it: install Node.js "
                          f"(with npm), or run `npm install --prefix {prefix} {NPM_OPENAI}`")
    log.info("installing %s under %s for the Node agent", NPM_OPENAI, prefix)
    subprocess.run([npm, "install", "--silent", "--no-audit", "--no-fund", "--prefix",
                    str(prefix), NPM_OPENAI], check=True, timeout=NPM_INSTALL_TIMEOUT_S)


class _Mailbox:
    """The groups this process's rollouts wait for, by group name, and one taker at a time."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.waiting: dict[str, asyncio.Future[TrajectoryGroup]] = {}


_mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = \
    weakref.WeakKeyDictionary()


def _mailbox() -> _Mailbox:
    return _mailboxes.setdefault(asyncio.get_running_loop(), _Mailbox())


async def take_group(model: Any, group: str) -> TrajectoryGroup:
    """The finished group ``group`` from the rollout API, once it is ready (its waiter was
    registered before it was opened): each ready group taken is handed to the rollout waiting
    for it, until ours comes."""
    from ..rollout.external import gather_external_groups

    box = _mailbox()
    mine = box.waiting[group]
    async with box.lock:
        while not mine.done():
            (taken,) = await gather_external_groups(model, 1, timeout_s=TIMEOUT_S)
            name = taken.metadata.get("group")
            waiter = box.waiting.get(name) if isinstance(name, str) else None
            if waiter is None:
                log.warning("dropped rollout API group %r: no rollout of this process waits "
                            "for it (its rollout failed first, or it is from an earlier run)",
                            name)
            elif not waiter.done():
                waiter.set_result(taken)
    return mine.result()


async def _exchange(proc: asyncio.subprocess.Process, what: str) -> dict[str, Any]:
    assert proc.stdout is not None and proc.stderr is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        raise ExternalAgentError(f"the Node agent sent no {what} within {TIMEOUT_S:g} s") from None
    if not line:
        await proc.wait()
        err = (await proc.stderr.read()).decode(errors="replace")[-2000:]
        raise ExternalAgentError(f"the Node agent exited ({proc.returncode}) before its {what}: "
                                 f"{err}")
    reply: dict[str, Any] = json.loads(line)
    return reply


async def rollout(model: Any, item: Item, *, temperature: float = 1.0,
                  step: int | None = None) -> Trajectory:
    node = shutil.which("node")
    if node is None:
        raise ConfigError("the node-chain-sum task needs Node.js (node) on PATH")
    root, api_key = model.endpoint()
    group = f"node-chain-sum-{uuid.uuid4().hex}"
    job = {"root": root.removesuffix("/").removesuffix("/v1"), "apiKey": api_key,
           "model": model.get_inference_name(step), "group": group,
           "question": item.data["question"], "examples": EXAMPLES,
           "temperature": temperature, "maxTokens": 12}
    env = {**os.environ, "NODE_PATH": str(await asyncio.to_thread(node_modules))}
    box = _mailbox()
    box.waiting[group] = asyncio.get_running_loop().create_future()
    try:
        return await _play(node, job, env, model, item, group)
    finally:
        box.waiting.pop(group, None)


async def _play(node: str, job: dict[str, Any], env: dict[str, str], model: Any, item: Item,
                group: str) -> Trajectory:
    proc = await asyncio.create_subprocess_exec(
        node, str(AGENT), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=env)
    assert proc.stdin is not None
    try:
        proc.stdin.write((json.dumps(job) + "\n").encode())
        await proc.stdin.drain()
        answer = str((await _exchange(proc, "answer")).get("answer", ""))
        reward = score(item.data, answer)
        metrics = {"success": float(reward == 1.0), "turns": 1.0,
                   "answer_is_number": float(answer.strip().lstrip("-").isdigit())}
        proc.stdin.write((json.dumps({"reward": reward, "metrics": metrics}) + "\n").encode())
        await proc.stdin.drain()
        await _exchange(proc, "finish")
        await asyncio.wait_for(proc.wait(), TIMEOUT_S)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    taken = await take_group(model, group)
    if taken.exceptions or len(taken.trajectories) != 1:
        raise ExternalAgentError(f"the Node agent's rollout failed: {taken.exceptions}")
    trajectory = taken.trajectories[0]
    trajectory.metadata["item"] = item.key
    return trajectory


TASK = Task(name="node-chain-sum",
            summary="reasoning-gym chain_sum answered by a Node agent through the rollout API",
            source="reasoning-gym 0.1.25 `chain_sum` (Apache-2.0)",
            framework="Node.js openai npm client, tracerl rollout API",
            draw=draw, rollout=rollout, model_config=lora_config_for(512),
            requires=("reasoning_gym",), install=TASKS_EXTRA)
