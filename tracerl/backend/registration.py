"""Registering a model: placed where this backend serves (``tracerl serve``'s placement), on
the engine of the weights it serves (one engine per served weights, started on first use), on
a gateway route that serves its newest checkpoint."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core import settings
from ..core.config import DistributedTrainerConfig, EngineConfig
from ..core.engine import Engine, EngineError, EngineSpec
from ..core.errors import ConfigError
from ..core.model_spec import ModelLike, ModelSpec, spec_of
from ..core.release_log import ReleaseLog
from ..core.storage import ModelStore
from ..core.watchdog import watch
from ..events.plugins import collect_classes
from .engines.replica_set import build_engine
from .gateway.releases import attach
from .gateway.server_thread import OnGateway

if TYPE_CHECKING:
    from .gateway.app import Gateway
    from .gateway.served import ServedModel

log = logging.getLogger(__name__)

# EngineConfig fields saying where inference runs: the operator's to set (`tracerl serve`)
PLACEMENT_FIELDS = ("replicas", "replicas_per_gpu", "gpus_per_replica", "replica_urls",
                    "replica_failure", "publish_dir", "publish_mount")


def choose_engine(requested: str) -> type[Engine]:
    """The engine class for 'vllm', 'transformers', a plugin's name, or 'auto'."""
    engines = collect_classes("tracerl_engines")
    if requested == "auto":
        requested = settings.TRACERL_ENGINE.get() or requested
    if requested == "auto":
        for name in ("vllm", "transformers"):
            if name in engines and engines[name].available():
                return engines[name]
        raise EngineError(
            "no inference engine is available: install vLLM or torch+transformers+peft"
        )
    if requested not in engines:
        raise ConfigError(f"unknown engine {requested!r}; available: {sorted(engines)}")
    if not engines[requested].available():
        raise EngineError(f"engine {requested!r} is not available here (missing packages)")
    return engines[requested]


class Registrar:
    """Puts models on the gateway: ``engine`` overrides each model's engine, ``placement``
    (``EngineConfig``'s :data:`PLACEMENT_FIELDS`) its replicas and publish location, and a
    distributed ``trainer`` on Ray hosts the replicas in its actors."""

    def __init__(self, gateway: Gateway, on_gateway: OnGateway, *, engine: str | None,
                 placement: dict[str, Any] | None,
                 trainer: DistributedTrainerConfig | None) -> None:
        if placement is not None:  # validated now, not at the first registration
            unknown = set(placement) - set(PLACEMENT_FIELDS)
            if unknown:
                raise ConfigError(f"placement: unknown fields {sorted(unknown)}")
            EngineConfig(**placement)
        self.gateway, self.on_gateway = gateway, on_gateway
        self.engine_override, self.placement, self.trainer = engine, placement, trainer
        self.engines: dict[tuple[Path, str, str], Engine] = {}

    def placed(self, model: ModelLike) -> ModelSpec:
        """``model`` with this backend's placement (replicas, publish location) in place of its
        own, when the backend has one (``tracerl serve``: clients do not choose servers)."""
        model = spec_of(model)
        if self.placement is None:
            return model
        engine = EngineConfig(**{**model.config.engine.model_dump(),
                                 **{f: EngineConfig.model_fields[f].get_default(
                                     call_default_factory=True) for f in PLACEMENT_FIELDS},
                                 **self.placement})
        return model.model_copy(update={"config": model.config.model_copy(
            update={"engine": engine})})

    async def engine_for(self, model: ModelSpec, model_path: Path) -> Engine:
        """The engine serving ``model_path`` the way ``model`` wants (started on first use);
        models share an engine only when they serve the same weights the same way."""
        key = (model_path, model.config.engine.model_dump_json(),
               model.config.lora.model_dump_json())
        engine = self.engines.get(key)
        if engine is None:
            cls = None if model.config.engine.replica_urls else choose_engine(
                self.engine_override or model.config.engine.engine)
            spec = EngineSpec(model_path=model_path, served_name=model_path.name,
                              config=model.config.engine, lora=model.config.lora)
            engine = None
            if self.trainer is not None and cls is not None:  # Ray: replicas in actors
                from .training.distributed import make_launcher

                engine = make_launcher(self.trainer).engine(cls, spec)
            if engine is None:
                engine = build_engine(cls, spec)
            with watch("engine_start", f"{engine.name} engine start for {model_path.name}",
                       lambda: "the engine has not answered since it was started"):
                await self.on_gateway(engine.start())
            self.engines[key] = engine
        return engine

    async def serve(self, model: ModelSpec, store: ModelStore) -> ServedModel:
        """Serve placed ``model`` (its folder ``store``, its base model resolved and on its
        engine) under its name, at its newest checkpoint; returns its route."""
        from .gateway.served import ServedModel
        from .weights import resolve_base_model

        if not model.base_model:
            raise ConfigError(f"model {model.key} has no base_model to serve")
        store.recover()  # partial checkpoints go; a crash-lost history line comes back
        store.write_definition(model.definition())
        model_path = await asyncio.to_thread(resolve_base_model, model.base_model)
        engine = await self.engine_for(model, model_path)
        if engine.spec.served_name == model.name:
            raise ConfigError(f"model name {model.name!r} collides with its base model's "
                              "served name")
        existing = self.gateway.models.get(model.key)
        if existing is None or existing.store.root != store.root:
            self.gateway.add_model(ServedModel(
                name=model.name, engine=engine, store=store,
                resident=model.config.engine.resident_adapters))
        route = self.gateway.models[model.key]
        await serve_newest(route, store, self.on_gateway)
        return route

    async def serve_step(self, model: ModelSpec, store: ModelStore, step: int) -> None:
        """Serve checkpoint ``step`` (in ``store``; 0: the base model) of registered ``model``
        under its name."""
        steps = store.checkpoint_steps()
        if step not in steps:
            raise ConfigError(f"model {model.key} has no checkpoint of step {step}; "
                              f"checkpoints: {steps or 'none'} (0 is the base model: NAME@0)")
        route = self.gateway.models[model.key]
        await self.on_gateway(route.swap_adapter(step, store.checkpoint_dir(step)))

    async def stop_engines(self, on_gateway: OnGateway | None) -> None:
        """Stop every engine (through ``on_gateway``: None when the gateway never started)."""
        for engine in self.engines.values():
            if on_gateway is not None:
                try:
                    await on_gateway(engine.stop())
                except Exception:
                    log.exception("stopping engine %s failed", engine.name)
        self.engines.clear()


async def serve_newest(route: ServedModel, store: ModelStore, on_gateway: OnGateway) -> None:
    """Serve the newest checkpoint in ``store`` on ``route``; under release control, the
    committed incumbent instead."""
    step = store.latest_step()
    if ReleaseLog(store.root).exists():  # release control: the committed incumbent
        # (its checkpoint gone: the route is unavailable, said why; the server goes on)
        await on_gateway(attach(route, missing_ok=True))
    elif step > 0 and route.step != step:
        await on_gateway(route.swap_adapter(step, store.checkpoint_dir(step)))
