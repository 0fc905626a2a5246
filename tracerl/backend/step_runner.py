"""A backend's training steps, one at a time.

Every step passes the same guards (:meth:`StepRunner.exclusive`: its models registered, no
other step of the backend running) and then holds the backend's step lock; the step function
(:func:`~.training.step.train_step`, :func:`~.training.sft.sft_step`,
:func:`~.training.many.train_many_step`) gets each model's folder, policy and serving engine
(:class:`ServingOnGateway`). A failed step closes its models' policies, whose weights may be
half-updated: the next step reloads their newest checkpoints.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.backend import TrainEvent
from ..core.config import TrainConfig
from ..core.engine import Engine
from ..core.errors import ConfigError, RankFailedError, StepsFailedError, TrainingError
from ..core.model_spec import ModelSpec
from ..core.storage import ModelStore
from ..core.trajectory import TrajectoryGroup
from .gateway.server_thread import OnGateway
from .policies import PolicyCache
from .publishing import AdapterPublisher

if TYPE_CHECKING:
    from .gateway.served import ServedModel
    from .training.distributed import DistributedPolicy
    from .training.policy import Policy

# a step function: GRPO's train_step or SFT's sft_step, its data bound
StepFn = Callable[..., AsyncIterator[TrainEvent]]


def publisher_of(model: ModelSpec) -> AdapterPublisher | None:
    """Where ``model``'s adapters are published for the servers (None: its checkpoints)."""
    engine = model.config.engine
    return AdapterPublisher(engine.publish_dir, engine.publish_mount) \
        if engine.publish_dir else None


def registered(models: Mapping[str, ServedModel], key: str) -> ServedModel:
    """The route of model ``key``; :class:`TrainingError` when it is not registered."""
    route = models.get(key)
    if route is None:
        raise TrainingError(f"model {key} is not registered with this backend")
    return route


class ServingOnGateway:
    """A model's engine and route, driven from a training step (on the gateway's loop)."""

    def __init__(self, on_gateway: OnGateway, route: ServedModel, engine: Engine,
                 publisher: AdapterPublisher | None = None, sleeps: bool = True) -> None:
        self.on_gateway, self.route, self.engine = on_gateway, route, engine
        self.publisher = publisher
        self.sleeps = sleeps  # False: another model of the step puts this engine to sleep

    async def sleep(self) -> None:
        if self.sleeps:
            await self.on_gateway(self.engine.sleep())

    async def wake_up(self) -> None:
        if self.sleeps:
            await self.on_gateway(self.engine.wake_up())

    async def publish(self, step: int, adapter: Path) -> None:
        """Write ``policy@step`` to the publish location (if one is set), load it on every
        server, then delete published versions no longer resident."""
        if self.publisher is None:
            await self.on_gateway(self.route.swap_adapter(step, adapter))
            return
        name = self.route.key  # project/name: two projects' `agent` publish apart
        served = await asyncio.to_thread(self.publisher.publish, name, step, adapter)
        await self.on_gateway(self.route.swap_adapter(step, served))
        keep = set(self.route.versions) | {step}
        await asyncio.to_thread(self.publisher.retire, name, keep)


class StepRunner:
    """Runs the steps of the models served in ``models`` (by key; their folders from
    ``store``), their policies kept in ``policies``, their engines reached through
    ``on_gateway``; a heartbeat event every ``heartbeat_s`` while one trains."""

    def __init__(self, models: Mapping[str, ServedModel], store: Callable[[ModelSpec], ModelStore],
                 policies: PolicyCache, on_gateway: OnGateway, heartbeat_s: float) -> None:
        self.models, self.store, self.policies = models, store, policies
        self.on_gateway, self.heartbeat_s = on_gateway, heartbeat_s
        self.lock = asyncio.Lock()  # one step of the backend at a time

    @asynccontextmanager
    async def exclusive(self, models: list[ModelSpec]) -> AsyncIterator[list[ServedModel]]:
        """The guards of every step, written once: each of ``models`` is registered and no
        step of this backend is running; then holds the step lock. Yields their routes."""
        routes = [registered(self.models, model.key) for model in models]
        if self.lock.locked():
            raise TrainingError("a training step of this backend is already running; "
                                "await it first")
        async with self.lock:
            yield routes

    def load_policy(self, model: ModelSpec) -> Policy | DistributedPolicy:
        """The policy of registered ``model`` (loaded on first use)."""
        return self.policies.get(model, self.store(model),
                                 self.models[model.key].engine.spec.model_path)

    def serving(self, model: ModelSpec, route: ServedModel, sleeps: bool = True
                ) -> ServingOnGateway:
        return ServingOnGateway(self.on_gateway, route, route.engine, publisher_of(model),
                                sleeps)

    async def reread(self, model: ModelSpec, store: ModelStore) -> int:
        """After the folder ``store`` of placed ``model`` changed on disk (a pull, under the
        step lock): its policy in memory is closed, and its route, if registered, serves its
        newest checkpoint. Returns that checkpoint's step."""
        await asyncio.to_thread(self.policies.close, str(store.root))
        route = self.models.get(model.key)
        latest = store.latest_step()
        if route is not None and latest > 0 and route.step != latest:
            await self.on_gateway(route.swap_adapter(latest, store.checkpoint_dir(latest)))
        return latest

    async def run(self, model: ModelSpec, step_fn: StepFn) -> AsyncIterator[TrainEvent]:
        """Run ``step_fn`` as the next step of placed ``model``."""
        async with self.exclusive([model]) as (route,):
            store = self.store(model)
            try:
                async for event in step_fn(
                        step=store.latest_step() + 1, store=store,
                        load_policy=lambda: self.load_policy(model),
                        serving=self.serving(model, route), heartbeat_s=self.heartbeat_s):
                    yield event
            except RankFailedError:  # its ranks are gone: the next step starts fresh ones
                self.policies.forget(str(store.root))
                raise
            except BaseException:  # its weights may be half-updated: reload its checkpoint
                self.policies.close(str(store.root))
                raise

    async def run_many(self, groups: list[tuple[ModelSpec, list[TrajectoryGroup]]],
                       config: TrainConfig) -> AsyncIterator[tuple[str, TrainEvent]]:
        """One GRPO step of each placed model of ``groups`` on its groups, the models sharing
        a base in shared passes (:func:`~.training.many.train_many_step`)."""
        from .training.many import ModelStep, train_many_step

        specs = [spec for spec, _ in groups]
        async with self.exclusive(specs) as routes:
            parts, engines = [], set()
            for spec, route, (_, model_groups) in zip(specs, routes, groups, strict=True):
                store = self.store(spec)
                serving = self.serving(spec, route, sleeps=id(route.engine) not in engines)
                engines.add(id(route.engine))
                parts.append(ModelStep(spec.key, store.latest_step() + 1, model_groups, store,
                                       serving))

            def load_policies() -> list[Any]:
                policies = [self.load_policy(spec) for spec in specs]
                if any(str(p.store.root) not in self.policies.loaded for p in parts):
                    raise ConfigError(
                        f"train_many: these models need more base weights in memory than "
                        f"resident_policies={self.policies.resident}; raise it or train fewer "
                        "models at once")
                return policies

            failed: set[str] = set()
            try:
                async for key, event in train_many_step(parts, config,
                                                        load_policies=load_policies,
                                                        heartbeat_s=self.heartbeat_s):
                    yield key, event
            except StepsFailedError as e:
                failed = set(e.failed)
                raise
            except BaseException:
                failed = {p.key for p in parts}
                raise
            finally:
                for part in parts:  # weights maybe half-updated: reload their checkpoints
                    if part.key in failed:
                        self.policies.close(str(part.store.root))
