"""A replica set: K inference servers behind one :class:`Engine`, so the gateway needs no change.

Data plane routed: a rollout's calls stay on one replica (its prefix cache holds the earlier
turns), a new rollout goes to the replica with the fewest calls in flight (ties: the one idle
longest). Control plane fanned out: adapters are loaded on / unloaded from every replica, sleep
and wake reach all of them.

Faults: a call whose replica fails before it produced anything (connection refused or reset, a
5xx) is retried on another replica; a stream that already sent chunks cannot be retried and
fails with an error naming the replica. The failed replica leaves the rotation, is restarted
(``replica_failure="restart"``) or dropped, and takes traffic again only once it has loaded the
current adapters. Replicas can join (:meth:`ReplicaSet.add_replica`, adapters first) and leave
(:meth:`ReplicaSet.remove_replica`, after its calls in flight finish).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ...core import settings
from ...core.config import EngineConfig
from ...core.engine import (
    Engine,
    EngineSpec,
    EngineUnavailableError,
    current_route,
)
from ...core.errors import ConfigError, EngineError

log = logging.getLogger(__name__)

MAX_STICKY_ROLLOUTS = 65536  # rollouts remembered for stickiness (oldest forgotten first)
ReplicaState = Literal["starting", "up", "down", "leaving"]


@dataclass
class Replica:
    """One server of the set and its routing state."""

    name: str
    engine: Engine
    state: ReplicaState = "starting"
    in_flight: int = 0
    served: int = 0  # calls routed here, ever
    last_pick: int = 0  # when a call was last routed here (ties go to the longest idle)


class ReplicaSet(Engine):
    """Routes calls over several engines serving the same base model and adapters."""

    name = "replicas"

    def __init__(self, spec: EngineSpec, engines: list[Engine], *,
                 on_failure: Literal["restart", "drop"] = "restart") -> None:
        super().__init__(spec)
        if not engines:
            raise ConfigError("a replica set needs at least one engine")
        self.on_failure = on_failure
        self._serial = 0
        self._picks = 0
        self.replicas = [Replica(self._next_name(), engine) for engine in engines]
        self._sticky: OrderedDict[str, Replica] = OrderedDict()
        self._adapters: dict[str, Path] = {}  # what every replica in rotation serves
        self._control = asyncio.Lock()  # adapter fan-out vs a replica joining
        self._recoveries: dict[str, asyncio.Task] = {}

    def _next_name(self) -> str:
        self._serial += 1
        return f"r{self._serial - 1}"

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start every replica at once; the set serves if at least one of them came up."""
        results = await asyncio.gather(*(self._join(r) for r in self.replicas),
                                       return_exceptions=True)
        failed = [(r, e) for r, e in zip(self.replicas, results, strict=True)
                  if isinstance(e, BaseException)]
        for r, e in failed:
            log.error("replica %s did not start: %s", r.name, e)
            self.replicas.remove(r)
        if not self.replicas:
            raise EngineError("no replica started: " + "; ".join(f"{r.name}: {e}"
                                                                 for r, e in failed))

    async def _join(self, r: Replica) -> None:
        r.state = "starting"
        if not await r.engine.healthy():
            await r.engine.start()
        async with self._control:  # adapters published meanwhile are not missed
            for name, path in self._adapters.items():
                await r.engine.load_adapter(name, path)
            r.state = "up"
        log.info("replica %s is up (%d adapters)", r.name, len(self._adapters))

    async def stop(self) -> None:
        for task in self._recoveries.values():
            task.cancel()
        await asyncio.gather(*(r.engine.stop() for r in self.replicas), return_exceptions=True)

    async def add_replica(self, engine: Engine) -> str:
        """Add a server (started here if it is not answering yet); it takes traffic once it
        serves every current adapter. Returns its name."""
        r = Replica(self._next_name(), engine)
        self.replicas.append(r)
        try:
            await self._join(r)
        except BaseException:
            self.replicas.remove(r)
            raise
        return r.name

    async def remove_replica(self, name: str, drain_timeout_s: float = 60.0) -> None:
        """Take ``name`` out of rotation, let its calls in flight finish, stop it."""
        r = self._replica(name)
        r.state = "leaving"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + drain_timeout_s
        while r.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if r.in_flight:
            log.warning("replica %s leaves with %d calls still in flight", name, r.in_flight)
        self._forget(r)
        await r.engine.stop()

    def _replica(self, name: str) -> Replica:
        for r in self.replicas:
            if r.name == name:
                return r
        raise ConfigError(f"no replica {name!r}; replicas: {[r.name for r in self.replicas]}")

    def _forget(self, r: Replica) -> None:
        if r in self.replicas:
            self.replicas.remove(r)
        for key in [k for k, v in self._sticky.items() if v is r]:
            del self._sticky[key]

    def status(self) -> list[dict[str, Any]]:
        """Each replica's name, state, calls in flight and calls served."""
        return [{"name": r.name, "state": r.state, "in_flight": r.in_flight, "served": r.served}
                for r in self.replicas]

    # --- health ----------------------------------------------------------------------------

    def alive(self) -> bool:
        return any(r.engine.alive() for r in self.replicas)

    async def healthy(self) -> bool:
        up = [r for r in self.replicas if r.state == "up"]
        return any(await asyncio.gather(*(r.engine.healthy() for r in up))) if up else False

    async def restart(self) -> None:
        """Recover every replica that is not answering (the healthy ones keep serving)."""
        checks = await asyncio.gather(*(r.engine.healthy() for r in self.replicas))
        for r, ok in zip(list(self.replicas), checks, strict=True):
            if not ok:
                self._failed(r, EngineUnavailableError("not answering /health"))
        await asyncio.gather(*self._recoveries.values(), return_exceptions=True)

    def _failed(self, r: Replica, error: BaseException) -> None:
        """Take ``r`` out of rotation and recover it in the background (once)."""
        if r.state != "up":
            return
        r.state = "down"
        log.warning("replica %s failed (%s); %s", r.name, error,
                    "restarting it" if self.on_failure == "restart" else "dropping it")
        self._recoveries[r.name] = asyncio.create_task(self._recover(r))

    async def _recover(self, r: Replica) -> None:
        try:
            if self.on_failure == "drop":
                self._forget(r)
                await r.engine.stop()
                return
            if not (r.engine.alive() and await r.engine.healthy()):
                await r.engine.restart()
            await self._join(r)
        except Exception as e:
            log.error("replica %s could not be recovered, dropping it: %s", r.name, e)
            self._forget(r)
            await r.engine.stop()

    # --- data plane ------------------------------------------------------------------------

    def _pick(self, exclude: list[Replica]) -> Replica:
        route = current_route.get()
        key = route.rollout_id if route is not None else None
        if key is not None:
            r = self._sticky.get(key)
            if r is not None and r.state == "up" and r not in exclude:
                self._sticky.move_to_end(key)
                return self._routed(r, route)
        candidates = [r for r in self.replicas if r.state == "up" and r not in exclude]
        if not candidates:
            states = ", ".join(f"{r.name}: {r.state}" for r in self.replicas) or "none left"
            raise EngineUnavailableError(f"no replica can take the call ({states})")
        r = min(candidates, key=lambda c: (c.in_flight, c.last_pick))
        if key is not None:
            self._sticky[key] = r
            self._sticky.move_to_end(key)
            while len(self._sticky) > MAX_STICKY_ROLLOUTS:
                self._sticky.popitem(last=False)
        return self._routed(r, route)

    def _routed(self, r: Replica, route: Any) -> Replica:
        if route is not None:
            route.replica = r.name
        self._picks += 1
        r.served, r.last_pick = r.served + 1, self._picks
        return r

    async def _call(self, call: Callable[[Engine], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        tried: list[Replica] = []
        while True:
            r = self._pick(tried)  # raises once every replica was tried
            r.in_flight += 1
            try:
                return await call(r.engine)
            except EngineUnavailableError as e:  # nothing came back: safe to send elsewhere
                self._failed(r, e)
                tried.append(r)
            finally:
                r.in_flight -= 1

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call(lambda engine: engine.chat(body))

    def prompt_ids_refusal(self, body: dict[str, Any]) -> str | None:
        return self.replicas[0].engine.prompt_ids_refusal(body) if self.replicas else \
            "the replica set has no replica"

    async def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call(lambda engine: engine.completions(body))

    async def chat_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        tried: list[Replica] = []
        while True:
            r = self._pick(tried)
            r.in_flight += 1
            stream = r.engine.chat_stream(body)
            try:
                first = await anext(stream)
                break
            except StopAsyncIteration:
                r.in_flight -= 1
                return
            except EngineUnavailableError as e:  # no chunk sent yet: retry elsewhere
                r.in_flight -= 1
                self._failed(r, e)
                tried.append(r)
        try:
            yield first
            try:
                async for chunk in stream:
                    yield chunk
            except EngineUnavailableError as e:
                self._failed(r, e)
                raise EngineUnavailableError(
                    f"replica {r.name} failed after the stream had started, so the call cannot "
                    f"be retried elsewhere: {e}") from e
        finally:
            r.in_flight -= 1

    # --- control plane ---------------------------------------------------------------------

    async def _fan_out(self, op: Callable[[Engine], Awaitable[None]], what: str) -> None:
        up = [r for r in self.replicas if r.state == "up"]
        results = await asyncio.gather(*(op(r.engine) for r in up), return_exceptions=True)
        refused = []
        for r, result in zip(up, results, strict=True):
            if isinstance(result, EngineUnavailableError):
                self._failed(r, result)  # it gets the adapters when it rejoins
            elif isinstance(result, BaseException):
                refused.append(f"{r.name}: {result}")
        if refused:
            raise EngineError(f"{what} failed on replicas " + "; ".join(refused))

    async def load_adapter(self, lora_name: str, path: Path) -> None:
        async with self._control:
            await self._fan_out(lambda e: e.load_adapter(lora_name, path),
                                f"loading adapter {lora_name!r}")
            self._adapters[lora_name] = Path(path)

    async def unload_adapter(self, lora_name: str) -> None:
        async with self._control:
            self._adapters.pop(lora_name, None)
            await self._fan_out(lambda e: e.unload_adapter(lora_name),
                                f"unloading adapter {lora_name!r}")

    async def sleep(self) -> None:
        await self._fan_out(lambda e: e.sleep(), "sleep")

    async def wake_up(self) -> None:
        await self._fan_out(lambda e: e.wake_up(), "wake-up")


def visible_gpus() -> int:
    """GPUs this process may use (CUDA_VISIBLE_DEVICES, else torch's count, else 0)."""
    visible = settings.CUDA_VISIBLE_DEVICES.get()
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def replica_devices(config: EngineConfig, gpus: int) -> list[tuple[int, ...] | None]:
    """Each replica's GPUs: ``gpus // gpus_per_replica`` groups, each shared by
    ``replicas_per_gpu`` servers (the first ``replicas`` of them, if set); without GPUs, or with
    none of the three set, ``replicas`` servers (default 1) placed by vLLM itself."""
    spread = config.replicas is not None or config.replicas_per_gpu > 1 \
        or config.gpus_per_replica > 1
    if gpus == 0 or not spread:
        return [None] * (config.replicas or 1)
    per = config.gpus_per_replica
    if per > gpus:
        raise ConfigError(f"gpus_per_replica={per} but only {gpus} GPUs are visible")
    groups = [tuple(range(i, i + per)) for i in range(0, gpus - per + 1, per)]
    devices: list[tuple[int, ...] | None] = [
        g for g in groups for _ in range(config.replicas_per_gpu)]
    if config.replicas is not None:
        if config.replicas > len(devices):
            raise ConfigError(f"replicas={config.replicas} needs more than the {gpus} visible "
                              f"GPUs allow ({len(devices)} with these settings)")
        devices = devices[:config.replicas]
    return devices


def build_engine(cls: type[Engine] | None, spec: EngineSpec) -> Engine:
    """The engine ``spec`` asks for: ``cls`` alone, or a replica set of several servers (several
    replicas configured, or server URLs given: then ``cls`` may be None)."""
    from .url_engine import URLEngine
    from .vllm_engine import VLLMEngine

    config = spec.config
    if config.replica_urls:
        return ReplicaSet(spec, [URLEngine(spec, url) for url in config.replica_urls],
                          on_failure=config.replica_failure)
    if cls is None:
        raise ConfigError("no engine class and no replica_urls: nothing to serve with")
    gpus = visible_gpus() if issubclass(cls, VLLMEngine) else 0
    devices = replica_devices(config, gpus)
    if len(devices) == 1 and config.replicas is None:
        return cls(spec)
    if not issubclass(cls, VLLMEngine):
        raise ConfigError(f"several replicas need the vLLM engine, not {cls.name!r}")
    # vLLM's CPU build binds its worker to the same cores in every server ("auto"): give each
    # replica its own share of this process's cores instead
    cpus = replica_cpus(len(devices)) if gpus == 0 else [None] * len(devices)
    return ReplicaSet(spec, [cls(spec, devices=d, cpus=c) for d, c in zip(devices, cpus,
                                                                           strict=True)],
                      on_failure=config.replica_failure)


def replica_cpus(replicas: int) -> list[tuple[int, ...] | None]:
    """This process's cores split evenly over ``replicas`` CPU servers (None: fewer cores than
    servers, then they share, bound by vLLM)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < replicas:
        return [None] * replicas
    per = len(cores) // replicas
    return [tuple(cores[i * per:(i + 1) * per]) for i in range(replicas)]
