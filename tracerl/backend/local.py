"""``LocalBackend``: gateway, engine and trainer in this process (the gateway in a thread).

The gateway runs its own event loop in a background thread, so rollouts on the caller's loop
and engine work never block each other; training runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ..core import settings
from ..core.backend import Backend, InferenceEndpoint, LocalTrainResult, TrainEvent, TrainResult
from ..core.config import DistributedTrainerConfig, EngineConfig, TrainConfig, TrainSFTConfig
from ..core.engine import Engine, EngineError, EngineSpec
from ..core.errors import ConfigError, RankFailedError, StepsFailedError, TrainingError
from ..core.model_spec import ModelLike, ModelSpec, spec_of
from ..core.net import is_loopback
from ..core.release_log import ReleaseLog
from ..core.spans import Span
from ..core.storage import ModelStore, check_history_metrics
from ..core.trajectory import (
    LLMCall,
    Trajectory,
    TrajectoryGroup,
    read_groups_jsonl,
    write_groups_jsonl,
)
from ..core.watchdog import watch
from ..events.hookspecs import hookimpl
from ..events.plugins import collect_classes
from .engines.replica_set import build_engine
from .publishing import AdapterPublisher
from .training.health import claim_rollouts
from .training.rows import check_token_records
from .training.sft import sft_step
from .training.step import train_step

if TYPE_CHECKING:
    from .gateway.recorder import CallStore
    from .gateway.rollout_api import ExternalRollouts
    from .gateway.served import ServedModel
    from .training.adapters import SharedBase
    from .training.distributed import DistributedPolicy
    from .training.trainer import Trainer

T = TypeVar("T")
log = logging.getLogger(__name__)

# EngineConfig fields saying where inference runs: the operator's to set (`tracerl serve`)
PLACEMENT_FIELDS = ("replicas", "replicas_per_gpu", "gpus_per_replica", "replica_urls",
                    "replica_failure", "publish_dir", "publish_mount")


@hookimpl
def tracerl_backends() -> list[type]:
    return [LocalBackend]


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


class _GatewayThread:
    """uvicorn serving the gateway app on its own loop in a daemon thread."""

    def __init__(self, app: Any, host: str, port: int, api_key: str | None = None) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        from .gateway.http_limits import uvicorn_options

        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                **uvicorn_options(api_key))
        self.server = uvicorn.Server(config)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="tracerl-gateway", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise EngineError(f"the gateway did not start on {host}:{port}")
            time.sleep(0.01)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve(sockets=[self.sock]))

    async def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the gateway loop and await its result from any loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self.loop))

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


class _ServingOnGateway:
    """A model's engine and route, driven from a training step (on the gateway's loop)."""

    def __init__(self, gateway: _GatewayThread, route: ServedModel, engine: Engine,
                 publisher: AdapterPublisher | None = None, sleeps: bool = True) -> None:
        self.gateway, self.route, self.engine = gateway, route, engine
        self.publisher = publisher
        self.sleeps = sleeps  # False: another model of the step puts this engine to sleep

    async def sleep(self) -> None:
        if self.sleeps:
            await self.gateway.call(self.engine.sleep())

    async def wake_up(self) -> None:
        if self.sleeps:
            await self.gateway.call(self.engine.wake_up())

    async def publish(self, step: int, adapter: Path) -> None:
        """Write ``policy@step`` to the publish location (if one is set), load it on every
        server, then delete published versions no longer resident."""
        if self.publisher is None:
            await self.gateway.call(self.route.swap_adapter(step, adapter))
            return
        name = self.route.key  # project/name: two projects' `agent` publish apart
        served = await asyncio.to_thread(self.publisher.publish, name, step, adapter)
        await self.gateway.call(self.route.swap_adapter(step, served))
        keep = set(self.route.versions) | {step}
        await asyncio.to_thread(self.publisher.retire, name, keep)


def freeze_long_lived_objects() -> bool:
    """Move every object alive now (modules, the model, the engine's state) out of the cyclic
    garbage collector's sight (:func:`gc.freeze`), as vLLM's server does after start-up.

    Each gateway call decodes an engine reply of ~1,000 containers; the collections those
    allocations trigger walked the whole heap again and again, and were most of the gateway's CPU
    (``benchmarks/rollout_throughput.py`` over ``benchmarks/instant_vllm``: 2x calls per second
    once frozen). Each call first unfreezes and collects, so what an earlier freeze held and has
    since become garbage (a dropped engine, say) is reclaimed then. ``TRACERL_GC_FREEZE=0``
    leaves the collector as it is. Returns whether it froze (and so collected).
    """
    if not settings.TRACERL_GC_FREEZE.get():
        return False
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    log.debug("froze %d long-lived objects", gc.get_freeze_count())
    return True


class LocalBackend(Backend):
    """Serve and train models on this machine: the gateway, one engine per served base model
    and one policy (trainer) per trained model. The step itself is
    :func:`tracerl.backend.training.step.train_step`.

    ART's ``in_process`` is accepted for ported scripts: here the gateway and trainer always run
    in this process and vLLM in a subprocess of its own, whichever value it has.

    ``trainer=DistributedTrainerConfig(...)`` trains with torch.distributed ranks (DDP or
    FSDP2) started by a launcher plugin (``local``: torchrun; ``ray``: Ray actors, which then
    host the inference engines too) instead of in this process.

    Trained models that share a base model, LoRA shape and chat template share one copy of
    the base weights in the trainer (:mod:`tracerl.backend.training.adapters`): each keeps its
    own adapter, optimizer state, step, checkpoints and history, and :meth:`train_many` trains
    several of them in shared passes.

    ``resident_policies`` bounds how many policies' base weights stay in memory (models sharing
    a base count once): loading one more first closes the least recently trained one, whose
    models later resume exactly from their newest checkpoints (adapter and optimizer state).
    """

    name = "local"

    def __init__(self, *, path: str | Path | None = None, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, engine: str | None = None,
                 in_process: bool = False, heartbeat_s: float = 30.0,
                 placement: dict[str, Any] | None = None,
                 trainer: DistributedTrainerConfig | None = None,
                 resident_policies: int = 2) -> None:
        from .gateway.app import Gateway
        from .gateway.served import ModelTable
        from .online.live_calls import LiveCalls

        del in_process
        if resident_policies < 1:
            raise ConfigError(f"resident_policies must be at least 1, not {resident_policies}")
        self.resident_policies = resident_policies
        if not is_loopback(host) and not api_key:
            raise ConfigError(f"binding the gateway to {host} needs an api_key "
                              "(loopback is the default)")
        self.path = Path(path if path is not None else ".tracerl").expanduser().resolve()
        self.host, self.port = host, port
        self.api_key = api_key
        self.engine_override = engine
        if placement is not None:  # validated now, not at the first registration
            unknown = set(placement) - set(PLACEMENT_FIELDS)
            if unknown:
                raise ConfigError(f"placement: unknown fields {sorted(unknown)}")
            EngineConfig(**placement)
        self.placement = placement
        self.heartbeat_s = heartbeat_s
        self.trainer = trainer
        models = ModelTable()  # the gateway's routes; online mode's live calls read them too
        self.live_calls = LiveCalls(models)  # online mode (online/seam.py): handed to the gateway
        self.gateway = Gateway(api_key=api_key, models=models, live=self.live_calls)
        self._thread: _GatewayThread | None = None
        self._engines: dict[tuple[Path, str, str], Engine] = {}
        self._stores: dict[str, ModelStore] = {}
        self._policies: dict[str, Trainer | DistributedPolicy] = {}
        self._bases: dict[tuple[Path, str, str | None], SharedBase] = {}
        self._train_from: dict[str, int] = {}  # model folder -> its next step starts from
        self._train_lock = asyncio.Lock()

    # --- resources -------------------------------------------------------------------------

    def _gateway(self) -> _GatewayThread:
        if self._thread is None:
            self._thread = _GatewayThread(self.gateway.app, self.host, self.port, self.api_key)
        return self._thread

    def run_sync(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the gateway's loop and wait for it, from a thread with no running
        loop (the ``tracerl serve`` main thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._gateway().loop).result(timeout)

    async def call_on_gateway(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the gateway's loop (where engines and routes live) and await it."""
        return await self._gateway().call(coro)

    @property
    def gateway_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the gateway, its engines and online mode run on."""
        return self._gateway().loop

    @property
    def serving(self) -> bool:
        """Whether the gateway's server thread is running."""
        return self._thread is not None and self._thread.thread.is_alive()

    @property
    def base_url(self) -> str:
        t = self._gateway()
        host = f"[{t.host}]" if ":" in t.host else t.host
        return f"http://{host}:{t.port}/v1"

    # --- what online mode and release control ask of the backend (online/seam.py) ---------

    def served(self, model: ModelLike) -> ServedModel:
        """The gateway's route of registered ``model`` (its routing, versions and store)."""
        return self.gateway.models[spec_of(model).key]

    @property
    def rollouts(self) -> ExternalRollouts:
        """The rollout API's rollouts (services outside this process)."""
        return self.gateway.rollouts

    @property
    def call_store(self) -> CallStore:
        """Where the gateway keeps recorded calls."""
        return self.gateway.calls

    def store(self, model: ModelLike) -> ModelStore:
        """The folder of ``model`` under this backend's path."""
        model = spec_of(model)
        if model.key not in self._stores:
            self._stores[model.key] = ModelStore(self.path, model.project, model.name)
        return self._stores[model.key]

    async def _engine_for(self, model: ModelSpec, model_path: Path) -> Engine:
        """The engine serving ``model_path`` the way ``model`` wants (started on first use);
        models share an engine only when they serve the same weights the same way."""
        key = (model_path, model.config.engine.model_dump_json(),
               model.config.lora.model_dump_json())
        engine = self._engines.get(key)
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
                await self._gateway().call(engine.start())
            self._engines[key] = engine
        return engine

    def _placed(self, model: ModelLike) -> ModelSpec:
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

    @staticmethod
    def _publisher(model: ModelSpec) -> AdapterPublisher | None:
        """Where ``model``'s adapters are published for the servers (None: its checkpoints)."""
        engine = model.config.engine
        return AdapterPublisher(engine.publish_dir, engine.publish_mount) \
            if engine.publish_dir else None

    def _policy(self, model: ModelSpec) -> Trainer | DistributedPolicy:
        """The trained policy of ``model`` (loaded on first use, from its newest checkpoint):
        an adapter on the base it shares with the models of the same base and LoRA shape."""
        from .training.adapters import SharedBase
        from .training.distributed import start_distributed_policy
        from .training.trainer import Trainer, unsloth_usable

        store = self.store(model)
        key = str(store.root)
        if key in self._policies:  # the most recently trained model goes last
            self._policies[key] = self._policies.pop(key)
            return self._policies[key]
        start = self._train_from.pop(key, None)
        step = store.latest_step() if start is None else start
        checkpoint = store.checkpoint_dir(step) if step > 0 else None
        model_path = self.gateway.models[model.key].engine.spec.model_path
        chat_template = model.config.engine.chat_template
        if self.trainer is not None:
            self._close_least_recent_policies(len(self._holders()) + 1 - self.resident_policies)
            self._policies[key] = start_distributed_policy(
                self.trainer, model_path, model.config.lora, checkpoint, chat_template,
                store.root / "logs" / "trainer-ranks.log")
        elif unsloth_usable():  # pragma: no cover - GPU only; Unsloth patches its own model
            self._close_least_recent_policies(len(self._holders()) + 1 - self.resident_policies)
            self._policies[key] = Trainer(model_path=model_path, lora=model.config.lora,
                                          adapter_path=checkpoint, chat_template=chat_template)
        else:
            base_key = (model_path, model.config.lora.model_dump_json(), chat_template)
            shared = self._bases.get(base_key)
            if shared is None or shared.closed:
                self._close_least_recent_policies(
                    len(self._holders()) + 1 - self.resident_policies)
                shared = self._bases[base_key] = SharedBase(
                    model_path, model.config.lora, chat_template=chat_template)
            self._policies[key] = shared.attach(checkpoint)
        return self._policies[key]

    def _holders(self) -> list[list[str]]:
        """The loaded policies' keys by what holds their base weights (a shared base, or a
        policy of its own), the least recently trained holder first."""
        holders: dict[int, list[str]] = {}
        for key, policy in self._policies.items():  # least recently trained first
            holder = holders.setdefault(id(getattr(policy, "shared", policy)), [])
            holder.append(key)
        return sorted(holders.values(), key=lambda keys: list(self._policies).index(keys[-1]))

    def _close_policy(self, key: str) -> None:
        """Close the policy of model folder ``key``, if loaded: it reloads from its newest
        checkpoint when it trains again."""
        policy = self._policies.pop(key, None)
        if policy is not None:
            policy.close()
        self._bases = {k: b for k, b in self._bases.items() if not b.closed}

    async def train_from(self, model: ModelLike, step: int) -> None:
        """The model's next training step starts from checkpoint ``step`` (0: the base model)
        instead of its newest one: after a candidate was rolled back, training goes on from
        the incumbent. The policy in memory, if any, is closed."""
        store = self.store(model)
        if step > 0 and step not in store.checkpoint_steps():
            raise ConfigError(f"{store.root.name} has no checkpoint {step} to train from")
        key = str(store.root)
        self._train_from[key] = step
        await asyncio.to_thread(self._close_policy, key)

    def _close_least_recent_policies(self, count: int) -> None:
        """Close the policies of the ``count`` least recently trained base weights in memory
        and reclaim it (their models reload from their checkpoints when they train again)."""
        if count <= 0:
            return
        for keys in self._holders()[:count]:
            for key in keys:
                log.info("closing the policy of %s to keep %d in memory; it resumes from its "
                         "newest checkpoint when it trains again", key, self.resident_policies)
                self._close_policy(key)
        if not freeze_long_lived_objects():  # frozen or not, the closed policies are collected
            gc.collect()

    # --- Backend API -----------------------------------------------------------------------

    async def register(self, model: ModelLike) -> InferenceEndpoint:
        from .gateway.served import ServedModel
        from .weights import resolve_base_model

        model = self._placed(model)
        if not model.trainable and not model.base_model:
            # a comparison model served elsewhere (ART's `art.Model(inference_base_url=...)`):
            # registered for logging only; it keeps its own endpoint
            self.store(model).write_definition(model.definition())
            return InferenceEndpoint("", "", model.name)
        if not model.base_model:
            raise ConfigError(f"model {model.key} has no base_model to serve")
        store = self.store(model)
        store.recover()  # partial checkpoints go; a crash-lost history line comes back
        store.write_definition(model.definition())
        model_path = await asyncio.to_thread(resolve_base_model, model.base_model)
        engine = await self._engine_for(model, model_path)
        if engine.spec.served_name == model.name:
            raise ConfigError(f"model name {model.name!r} collides with its base model's "
                              "served name")
        existing = self.gateway.models.get(model.key)
        if existing is None or existing.store.root != store.root:
            self.gateway.add_model(ServedModel(
                name=model.name, engine=engine, store=store,
                resident=model.config.engine.resident_adapters))
        route = self.gateway.models[model.key]
        step = store.latest_step()
        if ReleaseLog(store.root).exists():  # release control: the committed incumbent
            from .gateway.releases import attach

            await self._gateway().call(attach(route))
        elif step > 0 and route.step != step:
            await self._gateway().call(route.swap_adapter(step, store.checkpoint_dir(step)))
        freeze_long_lived_objects()
        return InferenceEndpoint(self.base_url, self.api_key or "tracerl-local",
                                 self.inference_name(model))

    def inference_name(self, model: ModelLike) -> str:
        """The model name callers send for registered ``model``: ``project/name`` (see
        :meth:`~tracerl.backend.gateway.served.ModelTable.model_id`)."""
        return self.gateway.model_id(self.gateway.models[spec_of(model).key])

    async def serve_step(self, model: ModelLike, step: int) -> None:
        """Serve checkpoint ``step`` of registered ``model`` under its name (a held-out
        evaluation of an older step, ``tracerl eval``); ``register`` again serves the newest.
        Step 0 is the base model, always served as ``NAME@0``."""
        store = self.store(model)
        steps = store.checkpoint_steps()
        if step not in steps:
            raise ConfigError(f"model {spec_of(model).key} has no checkpoint of step {step}; "
                              f"checkpoints: {steps or 'none'} (0 is the base model: NAME@0)")
        route = self.gateway.models[spec_of(model).key]
        await self._gateway().call(route.swap_adapter(step, store.checkpoint_dir(step)))

    async def pending_groups(self, model: ModelLike) -> list[TrajectoryGroup]:
        """Groups saved for a step whose training never finished (a crash): train on them again
        with ``await model.train(await backend.pending_groups(model))``."""
        store = self.store(model)
        path = store.trajectories_path("train", store.latest_step() + 1)
        return read_groups_jsonl(path) if path.exists() else []

    async def get_step(self, model: ModelLike) -> int:
        return self.store(model).latest_step()

    async def fetch_calls(self, model: ModelLike, rollout_id: str) -> list[LLMCall]:
        return self.gateway.calls.take(self.store(model), rollout_id)

    async def fetch_spans(self, model: ModelLike, rollout_id: str) -> list[Span]:
        from .gateway.rollout_api import read_spans, spans_path

        store = self.store(model)
        if not spans_path(store, rollout_id).exists():  # most rollouts: no thread hop
            return []
        return await asyncio.to_thread(read_spans, store, rollout_id)

    async def take_external_groups(self, model: ModelLike, n_groups: int, request_id: str
                                   ) -> list[TrajectoryGroup]:
        from .gateway.rollout_api import build_groups

        store = self.store(model)
        taken = await asyncio.to_thread(self.gateway.rollouts.take, store, n_groups, request_id)
        return await asyncio.to_thread(build_groups, taken, store, self.gateway.calls,
                                       self.gateway.rollouts)

    async def external_rollouts_status(self, model: ModelLike) -> dict[str, int]:
        return self.gateway.rollouts.counts(self.store(model))

    async def log(self, model: ModelLike, groups: list[TrajectoryGroup], split: str, step: int,
                  metrics: dict[str, float]) -> None:
        check_history_metrics(metrics)  # before the groups are written
        store = self.store(model)
        path = store.trajectories_path(split, step)
        # several log() calls of one step add up; a group already in the file (ART's
        # `model.log(groups, split="train", step=result.step)` after the step saved them) is not
        # written twice
        saved = set(path.read_text().splitlines()) if path.exists() else set()
        new = [g for g in groups if g.model_dump_json() not in saved]
        if new:
            write_groups_jsonl(path, new, append=True)
            claim_rollouts(store, new)  # e.g. validation rollouts: their calls are no orphans
        store.log_history(step, split, metrics)

    async def history(self, model: ModelLike) -> list[dict[str, Any]]:
        return self.store(model).history()

    async def delete_checkpoints(self, model: ModelLike, keep_steps: set[int]) -> list[int]:
        return self.store(model).delete_checkpoints(keep_steps)

    # --- ART's object-storage sync (backend/object_sync.py) ----------------------------------

    async def _experimental_push_to_s3(
            self, model: ModelLike, *, s3_bucket: str | None = None, prefix: str | None = None,
            verbose: bool = False, delete: bool = False,
            storage_options: dict[str, Any] | None = None) -> None:
        """Copy the model's folder (checkpoints, history, records) to
        ``s3://BUCKET/[PREFIX/]PROJECT/models/NAME`` (ART's layout); ``delete`` removes objects
        there that are not here. Waits for a running step, so its checkpoint goes whole."""
        from .object_sync import model_url, push

        store = self.store(model)
        url = model_url(store, bucket=s3_bucket, prefix=prefix)
        async with self._train_lock:
            result = await asyncio.to_thread(push, store, url, delete=delete,
                                             storage_options=storage_options)
        if verbose:
            log.info("pushed %d files to %s", len(result.copied), url)

    async def _experimental_pull_from_s3(
            self, model: ModelLike, *, s3_bucket: str | None = None, prefix: str | None = None,
            verbose: bool = False, delete: bool = False,
            only_step: int | Literal["latest"] | None = None, step: int | None = None,
            exclude: list[str] | None = None, latest_only: bool = False,
            storage_options: dict[str, Any] | None = None) -> None:
        """Copy a model pushed by :meth:`_experimental_push_to_s3` (here or on another machine)
        into this backend's folder; training continues after its newest checkpoint. A
        registered model serves that checkpoint at once and its next step trains from it.
        ``only_step`` (or ART's older ``step`` / ``latest_only``): one checkpoint instead of
        all; ``exclude``: any of ``checkpoints``, ``logs``, ``trajectories``."""
        from .object_sync import model_url, pull

        if only_step is None:
            only_step = step if step is not None else ("latest" if latest_only else None)
        spec = self._placed(model)
        store = self.store(spec)
        url = model_url(store, bucket=s3_bucket, prefix=prefix)
        async with self._train_lock:
            result = await asyncio.to_thread(
                pull, store, url, only_step=only_step, exclude=exclude or (), delete=delete,
                storage_options=storage_options)
            store.recover()  # a checkpoint whose history line did not travel gets it back
            # what this process holds of the model was read from the folder before the pull
            policy = self._policies.pop(str(store.root), None)
            if policy is not None:
                await asyncio.to_thread(policy.close)
            route = self.gateway.models.get(spec.key)
            latest = store.latest_step()
            if route is not None and latest > 0 and route.step != latest:
                await self._gateway().call(
                    route.swap_adapter(latest, store.checkpoint_dir(latest)))
        if verbose:
            log.info("pulled %d files from %s; newest checkpoint: step %d",
                     len(result.copied), url, latest)

    async def train(self, model: ModelLike, trajectory_groups: Iterable[TrajectoryGroup],
                    *args: Any, **kwargs: Any) -> LocalTrainResult:
        """ART 0.5's ``backend.train`` (see :meth:`Backend.train`), with the checkpoint's folder."""
        result = await super().train(model, trajectory_groups, *args, **kwargs)
        checkpoint = self.store(model).checkpoint_dir(result.step)
        return LocalTrainResult(result.step, result.metrics,
                                str(checkpoint) if checkpoint.exists() else None)

    def check_groups(self, model: ModelLike, groups: list[TrajectoryGroup]) -> None:
        """Raise :class:`InvalidTrajectoryError` naming the first row of ``groups`` that
        registered ``model`` cannot train on (a token id outside its vocabulary, ids and
        logprobs of different lengths, a call longer than its context length); nothing is
        queued or written before this passes."""
        from .weights import vocab_size

        route = self.gateway.models.get(self._placed(model).key)
        if route is None:
            raise TrainingError(f"model {spec_of(model).key} is not registered with this "
                                "backend")
        spec = route.engine.spec
        check_token_records(groups, vocab_size(spec.model_path), spec.config.max_model_len)

    async def train_events(self, model: ModelLike, groups: list[TrajectoryGroup],
                           config: TrainConfig) -> AsyncIterator[TrainEvent]:
        self.check_groups(model, groups)
        async for event in self._run_step(model, functools.partial(train_step, groups=groups,
                                                                   config=config)):
            yield event

    async def train_sft(self, model: ModelLike, trajectories: list[Trajectory],
                        config: TrainSFTConfig) -> TrainResult:
        """One supervised step (:mod:`tracerl.backend.training.sft`): a new checkpoint."""
        if self.trainer is not None:
            raise ConfigError("SFT steps run on the one-process trainer; this backend's "
                              "distributed trainer (LocalBackend(trainer=...)) trains GRPO only")
        result = TrainResult(step=0)
        async for event in self._run_step(model, functools.partial(
                sft_step, trajectories=trajectories, config=config)):
            if event.kind == "done":
                result = TrainResult(event.step, dict(event.metrics))
        return result

    async def _run_step(self, model: ModelLike, step_fn: Callable[..., AsyncIterator[TrainEvent]]
                        ) -> AsyncIterator[TrainEvent]:
        """Run ``step_fn`` (GRPO's ``train_step`` or SFT's ``sft_step``) as the model's next
        step, one step of this backend at a time."""
        model = self._placed(model)
        route = self.gateway.models.get(model.key)
        if route is None:
            raise TrainingError(f"model {model.key} is not registered with this backend")
        if self._train_lock.locked():
            raise TrainingError("a training step of this backend is already running; "
                                "await it first")
        async with self._train_lock:
            store = self.store(model)
            try:
                async for event in step_fn(
                        step=store.latest_step() + 1, store=store,
                        load_policy=lambda: self._policy(model),
                        serving=_ServingOnGateway(self._gateway(), route, route.engine,
                                                  self._publisher(model)),
                        heartbeat_s=self.heartbeat_s):
                    yield event
            except RankFailedError:  # its ranks are gone: the next step starts fresh ones
                self._policies.pop(str(store.root), None)
                raise
            except BaseException:  # its weights may be half-updated: reload its checkpoint
                self._close_policy(str(store.root))
                raise

    async def train_many_events(self, groups: list[tuple[ModelSpec, list[TrajectoryGroup]]],
                                config: TrainConfig) -> AsyncIterator[tuple[str, TrainEvent]]:
        """One step of each model; the rows of models sharing a base train in shared passes
        (:mod:`tracerl.backend.training.many`)."""
        from .training.many import ModelStep, train_many_step

        if self.trainer is not None:
            raise ConfigError("train_many runs on the one-process trainer; this backend's "
                              "distributed trainer (LocalBackend(trainer=...)) trains one model "
                              "a step: call model.train for each")
        if not groups:
            return
        specs = [self._placed(spec) for spec, _ in groups]
        for spec in specs:
            if spec.key not in self.gateway.models:
                raise TrainingError(f"model {spec.key} is not registered with this backend")
        if self._train_lock.locked():
            raise TrainingError("a training step of this backend is already running; "
                                "await it first")
        async with self._train_lock:
            parts, engines = [], set()
            for spec, (_, model_groups) in zip(specs, groups, strict=True):
                route, store = self.gateway.models[spec.key], self.store(spec)
                serving = _ServingOnGateway(self._gateway(), route, route.engine,
                                            self._publisher(spec),
                                            sleeps=id(route.engine) not in engines)
                engines.add(id(route.engine))
                parts.append(ModelStep(spec.key, store.latest_step() + 1, model_groups, store,
                                       serving))

            def load_policies() -> list[Any]:
                policies = [self._policy(spec) for spec in specs]
                if any(str(p.store.root) not in self._policies for p in parts):
                    raise ConfigError(
                        f"train_many: these models need more base weights in memory than "
                        f"resident_policies={self.resident_policies}; raise it or train fewer "
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
                        self._close_policy(str(part.store.root))

    async def close(self) -> None:
        for policy in self._policies.values():
            await asyncio.to_thread(policy.close)
        self._policies.clear()
        self._bases.clear()
        for engine in self._engines.values():
            if self._thread is not None:
                try:
                    await self._thread.call(engine.stop())
                except Exception:
                    log.exception("stopping engine %s failed", engine.name)
        self._engines.clear()
        if self._thread is not None:
            self._thread.stop()
            self._thread = None

