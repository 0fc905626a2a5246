"""``LocalBackend``: gateway, engines and trainer in this process (the gateway in a thread).

A facade over the rooms below: registration (:mod:`.registration`) puts a model on the engine
of its weights and a gateway route; its steps run one at a time (:mod:`.step_runner`) on the
policies kept in memory (:mod:`.policies`); the gateway serves on its own loop in a thread
(:mod:`.gateway.server_thread`), so rollouts on the caller's loop and engine work never block
each other; training runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Coroutine, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ..core.backend import Backend, InferenceEndpoint, LocalTrainResult, TrainEvent, TrainResult
from ..core.config import DistributedTrainerConfig, TrainConfig, TrainSFTConfig
from ..core.errors import ConfigError
from ..core.model_spec import ModelLike, ModelSpec, spec_of
from ..core.net import is_loopback
from ..core.release_log import delete_checkpoints
from ..core.spans import Span
from ..core.storage import ModelStore, check_history_metrics
from ..core.trajectory import (
    LLMCall,
    Trajectory,
    TrajectoryGroup,
    read_groups_jsonl,
    write_groups_jsonl,
)
from ..events.hookspecs import hookimpl
from .gateway.server_thread import GatewayThread
from .heap import freeze_long_lived_objects
from .policies import PolicyCache
from .registration import Registrar
from .rollout_log import read_spans, spans_path
from .step_runner import StepRunner, registered
from .training.health import claim_rollouts
from .training.rows import check_token_records
from .training.sft import sft_step
from .training.step import train_step

if TYPE_CHECKING:
    from .gateway.recorder import CallStore
    from .gateway.rollout_api import ExternalRollouts
    from .gateway.served import ServedModel

T = TypeVar("T")
log = logging.getLogger(__name__)


@hookimpl
def tracerl_backends() -> list[type]:
    return [LocalBackend]


class LocalBackend(Backend):
    """Serve and train models on this machine: the gateway, one engine per served weights
    (:mod:`.registration`) and one policy per trained model (:mod:`.policies`), its steps run
    one at a time (:mod:`.step_runner`; the GRPO step is :func:`.training.step.train_step`).

    ART's ``in_process`` is accepted for ported scripts: the gateway and trainer always run in
    this process (vLLM in a subprocess of its own), whichever value it has.
    ``trainer=DistributedTrainerConfig(...)`` trains with torch.distributed ranks (DDP or FSDP2)
    started by a launcher plugin (``local``: torchrun; ``ray``: Ray actors, which then host the
    inference engines too) instead of in this process.

    Trained models that share a base model, LoRA shape and chat template share one copy of the
    base weights (:mod:`.training.adapters`): each keeps its own adapter, optimizer state, step,
    checkpoints and history, and :meth:`train_many` trains several in shared passes.
    ``resident_policies`` bounds how many base weights stay in memory: loading one more first
    closes the least recently trained, whose models later resume exactly from their newest
    checkpoints (adapter and optimizer state).
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
        self.policies = PolicyCache(trainer, resident_policies)
        if not is_loopback(host) and not api_key:
            raise ConfigError(f"binding the gateway to {host} needs an api_key "
                              "(loopback is the default)")
        self.path = Path(path if path is not None else ".tracerl").expanduser().resolve()
        self.host, self.port = host, port
        self.api_key = api_key
        self.trainer = trainer
        models = ModelTable()  # the gateway's routes; online mode's live calls read them too
        self.live_calls = LiveCalls(models)  # online mode (online/seam.py): handed to the gateway
        self.gateway = Gateway(api_key=api_key, models=models, live=self.live_calls)
        self.registrar = Registrar(self.gateway, self.call_on_gateway, engine=engine,
                                   placement=placement, trainer=trainer)
        self.steps = StepRunner(self.gateway.models, self.store, self.policies,
                                self.call_on_gateway, heartbeat_s)
        self._thread: GatewayThread | None = None
        self._stores: dict[str, ModelStore] = {}

    # --- resources -------------------------------------------------------------------------

    def _gateway(self) -> GatewayThread:
        if self._thread is None:
            self._thread = GatewayThread(self.gateway.app, self.host, self.port, self.api_key)
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

    async def register(self, model: ModelLike) -> InferenceEndpoint:
        model = self.registrar.placed(model)
        if not model.trainable and not model.base_model:
            # a comparison model served elsewhere (ART's `art.Model(inference_base_url=...)`):
            # registered for logging only; it keeps its own endpoint
            self.store(model).write_definition(model.definition())
            return InferenceEndpoint("", "", model.name)
        await self.registrar.serve(model, self.store(model))
        freeze_long_lived_objects()
        return InferenceEndpoint(self.base_url, self.api_key or "tracerl-local",
                                 self.inference_name(model))

    async def train_from(self, model: ModelLike, step: int) -> None:
        """The model's next training step starts from checkpoint ``step`` (0: the base model)
        instead of its newest one: after a candidate was rolled back, training goes on from
        the incumbent. The policy in memory, if any, is closed."""
        await self.policies.start_from(self.store(model), step)

    def inference_name(self, model: ModelLike) -> str:
        """The model name callers send for registered ``model``: ``project/name`` (see
        :meth:`~tracerl.backend.gateway.served.ModelTable.model_id`)."""
        return self.gateway.model_id(self.gateway.models[spec_of(model).key])

    async def serve_step(self, model: ModelLike, step: int) -> None:
        """Serve checkpoint ``step`` of registered ``model`` under its name (a held-out
        evaluation of an older step, ``tracerl eval``); ``register`` again serves the newest.
        Step 0 is the base model, always served as ``NAME@0``."""
        await self.registrar.serve_step(spec_of(model), self.store(model), step)

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
        return delete_checkpoints(self.store(model), keep_steps)[0]

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
        async with self.steps.lock:
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
        spec = self.registrar.placed(model)
        store = self.store(spec)
        url = model_url(store, bucket=s3_bucket, prefix=prefix)
        async with self.steps.lock:
            result = await asyncio.to_thread(
                pull, store, url, only_step=only_step, exclude=exclude or (), delete=delete,
                storage_options=storage_options)
            store.recover()  # a checkpoint whose history line did not travel gets it back
            latest = await self.steps.reread(spec, store)
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

        spec = registered(self.gateway.models, self.registrar.placed(model).key).engine.spec
        check_token_records(groups, vocab_size(spec.model_path), spec.config.max_model_len)

    async def train_events(self, model: ModelLike, groups: list[TrajectoryGroup],
                           config: TrainConfig) -> AsyncIterator[TrainEvent]:
        self.check_groups(model, groups)
        async for event in self.steps.run(self.registrar.placed(model), functools.partial(
                train_step, groups=groups, config=config)):
            yield event

    async def train_sft(self, model: ModelLike, trajectories: list[Trajectory],
                        config: TrainSFTConfig) -> TrainResult:
        """One supervised step (:mod:`tracerl.backend.training.sft`): a new checkpoint."""
        if self.trainer is not None:
            raise ConfigError("SFT steps run on the one-process trainer; this backend's "
                              "distributed trainer (LocalBackend(trainer=...)) trains GRPO only")
        result = TrainResult(step=0)
        async for event in self.steps.run(self.registrar.placed(model), functools.partial(
                sft_step, trajectories=trajectories, config=config)):
            if event.kind == "done":
                result = TrainResult(event.step, dict(event.metrics))
        return result

    async def train_many_events(self, groups: list[tuple[ModelSpec, list[TrajectoryGroup]]],
                                config: TrainConfig) -> AsyncIterator[tuple[str, TrainEvent]]:
        """One step of each model; the rows of models sharing a base train in shared passes
        (:mod:`tracerl.backend.training.many`)."""
        if self.trainer is not None:
            raise ConfigError("train_many runs on the one-process trainer; this backend's "
                              "distributed trainer (LocalBackend(trainer=...)) trains one model "
                              "a step: call model.train for each")
        if not groups:
            return
        placed = [(self.registrar.placed(spec), model_groups) for spec, model_groups in groups]
        async for key, event in self.steps.run_many(placed, config):
            yield key, event

    async def close(self) -> None:
        await self.policies.close_all()
        await self.registrar.stop_engines(self._thread.call if self._thread else None)
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
