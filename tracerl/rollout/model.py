"""``Model`` and ``TrainableModel``: the user-facing handle of a model (ART-compatible)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Iterable
from typing import TYPE_CHECKING, Any

import openai

from ..core.art_compat import model_config_from_art, train_options_from_art
from ..core.config import ModelConfig, TrainConfig, TrainSFTConfig
from ..core.context import current_rollout
from ..core.errors import ConfigError, InvalidTrajectoryError, NotRegisteredError
from ..core.loops import PerLoop
from ..core.metrics import summarize_groups
from ..core.model_name import ModelName
from ..core.model_spec import ModelSpec
from ..core.spans import Span
from ..core.storage import check_history_metrics, validate_name
from ..core.trajectory import LLMCall, Trajectory, TrajectoryGroup, attach_scoped_calls
from ..events.lifecycle import step_logged, train_event
from . import client as _client
from .gather import why_no_training_data
from .sampling import SampledGroups, log_sampling

if TYPE_CHECKING:
    from ..core.backend import Backend

log = logging.getLogger(__name__)


def _as_groups(items: Iterable[Trajectory | BaseException | TrajectoryGroup]
               ) -> list[TrajectoryGroup]:
    items = list(items)
    loose = [i for i in items if isinstance(i, Trajectory | BaseException)]
    if len(loose) == len(items) and items:
        return [TrajectoryGroup(loose)]  # exceptions among them: the group's failed rollouts
    groups = []
    for i, g in enumerate(items):
        if not isinstance(g, TrajectoryGroup):
            raise InvalidTrajectoryError(
                f"item {i} is a {type(g).__name__}; pass TrajectoryGroups (or a list of "
                "Trajectories). "
                "Did you forget to await gather_trajectory_groups(...)?"
            )
        groups.append(g)
    return groups


class Model:
    """A model served through a backend; base class of :class:`TrainableModel`."""

    trainable = False

    def __init__(self, *, name: str, project: str, entity: str | None = None,
                 base_model: str | None = None, config: ModelConfig | None = None,
                 inference_base_url: str | None = None, inference_api_key: str | None = None,
                 inference_model_name: str | None = None,
                 _internal_config: dict[str, Any] | None = None) -> None:
        """``_internal_config`` takes ART's ``art.dev.InternalModelConfig`` dict instead of
        ``config``."""
        self.name = validate_name("model", name)
        self.project = validate_name("project", project)
        self.entity = entity
        self.base_model = base_model
        if _internal_config is not None and config is not None:
            raise ConfigError("pass config or ART's _internal_config, not both")
        self._backend: Backend | None = None
        self.config = config or ModelConfig()
        self._art_internal_config: dict[str, Any] | None = None
        if _internal_config is not None:
            self._internal_config = _internal_config
        self.inference_base_url = inference_base_url
        self.inference_api_key = inference_api_key
        self.inference_model_name = inference_model_name
        # sync clients, and async ones made outside a loop, by their sorted kwargs
        self._clients: dict[tuple[tuple[str, object], ...], openai.OpenAI] = {}
        self._async_clients: dict[tuple[tuple[str, object], ...], openai.AsyncOpenAI] = {}
        # (client, its closer: kept referenced, the loop holds it weakly) per event loop
        self._loop_clients: PerLoop[tuple[openai.AsyncOpenAI, AsyncGenerator[None, None]]] = (
            PerLoop(usable=lambda entry: not entry[0].is_closed()))

    @property
    def _internal_config(self) -> dict[str, Any] | None:
        """ART's ``art.dev.InternalModelConfig`` dict; setting it (before ``register``, as ART
        scripts do right after construction) replaces ``config`` with its translation."""
        return self._art_internal_config

    @_internal_config.setter
    def _internal_config(self, value: dict[str, Any] | None) -> None:
        if self._backend is not None:
            raise ConfigError(f"{self!r}: _internal_config is set after register(); set it "
                              "before `await model.register(backend)` (the engine is already "
                              "started with the old config)")
        self.config = model_config_from_art(value) if value is not None else ModelConfig()
        self._art_internal_config = value

    @property
    def spec(self) -> ModelSpec:
        """What backends and hooks are given: identity, base model and config."""
        return ModelSpec(name=self.name, project=self.project, base_model=self.base_model,
                         trainable=self.trainable, config=self.config)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, project={self.project!r}, "
                f"base_model={self.base_model!r})")

    # --- registration and inference --------------------------------------------------------

    async def register(self, backend: Backend) -> None:
        """Attach the model to ``backend``: it is then served and (if trainable) trainable."""
        endpoint = await backend.register(self.spec)
        self._backend = backend
        if endpoint.base_url:  # served by the backend (a comparison model keeps its own URL)
            self.inference_base_url = endpoint.base_url
            self.inference_api_key = endpoint.api_key
            self.inference_model_name = endpoint.model_name
        self._clients.clear()
        self._async_clients.clear()
        self._loop_clients.pop_all()

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            raise NotRegisteredError(
                f"{self!r} is not registered; call `await model.register(backend)` first"
            )
        return self._backend

    def endpoint(self) -> tuple[str, str]:
        """``(base_url, api_key)`` of the model's OpenAI-compatible endpoint."""
        if not self.inference_base_url:
            raise NotRegisteredError(
                f"{self!r} has no inference endpoint; call `await model.register(backend)` first"
            )
        return self.inference_base_url, self.inference_api_key or "tracerl"

    def get_inference_name(self, step: int | None = None) -> str:
        """The name to send for this model: ``project/name`` once registered with a backend
        that serves it (``project/name@step`` for checkpoint ``step``); a model served
        elsewhere keeps its ``inference_model_name`` (else ``name``), as in ART. Qualified
        always, so a model of the same name registered in another project later cannot make
        it ambiguous (the gateway refuses an ambiguous bare name)."""
        base = self.inference_model_name or self.name
        return str(ModelName.of(base, step))

    def litellm_completion_params(self, step: int | None = None) -> dict[str, Any]:
        """ART's keyword arguments for ``litellm.(a)completion``. Read them inside the rollout:
        they carry its id, so the gateway records the call under it. (With
        ``TracerlLiteLLMLogger``, ``tracerl.integrations.litellm.completion_kwargs`` adds spans.)"""
        base_url, api_key = self.endpoint()
        name = self.get_inference_name(step)
        params: dict[str, Any] = {
            # served by a tracerl gateway (vLLM's API); an external model keeps its own prefix
            "model": f"hosted_vllm/{name}" if self.trainable and self._backend is not None
            else name,
            "base_url": base_url, "api_key": api_key,
            "temperature": 1,  # the trained policy is the one sampled at temperature 1
            "num_retries": 0,  # a retry would record the call twice
        }
        if current_rollout() is not None:
            params["extra_headers"] = _client.rollout_headers(self)
        return params

    def openai_client(self, **kwargs: Any) -> openai.AsyncOpenAI:
        """An AsyncOpenAI client for this model's endpoint, attributing calls to the current
        rollout. One client per event loop (clients cannot outlive their loop); made inside a
        loop, it uses aiohttp where installed and is closed when the loop shuts down."""
        base_url, api_key = self.endpoint()
        if not _has_loop():  # made outside any loop: an httpx client, usable in any one
            key = tuple(sorted(kwargs.items()))
            if key not in self._async_clients:
                self._async_clients[key] = _client.async_client(self, base_url, api_key,
                                                                **kwargs)
            return self._async_clients[key]

        def make(loop: asyncio.AbstractEventLoop
                 ) -> tuple[openai.AsyncOpenAI, AsyncGenerator[None, None]]:
            return _client.loop_client(self, base_url, api_key, loop, **kwargs)

        client, _closer = self._loop_clients.get(make, key=tuple(sorted(kwargs.items())))
        return client

    def sync_openai_client(self, **kwargs: Any) -> openai.OpenAI:
        """A sync OpenAI client, for sync agent code; attribution works the same way."""
        base_url, api_key = self.endpoint()
        key = tuple(sorted(kwargs.items()))
        if key not in self._clients:
            self._clients[key] = _client.sync_client(self, base_url, api_key, **kwargs)
        return self._clients[key]

    async def fetch_calls(self, rollout_id: str) -> list[LLMCall]:
        """The token records the backend holds for ``rollout_id``."""
        if self._backend is None:
            return []
        return await self._backend.fetch_calls(self.spec, rollout_id)

    async def fetch_spans(self, rollout_id: str) -> list[Span]:
        """The spans posted to the backend's gateway for ``rollout_id`` (LiteLLM proxy)."""
        if self._backend is None:
            return []
        return await self._backend.fetch_spans(self.spec, rollout_id)

    # --- logging ---------------------------------------------------------------------------

    async def get_step(self) -> int:
        """The newest trained step (0 before the first; always 0 for a model not trained here)."""
        if not self.trainable:
            return 0
        return await self.backend.get_step(self.spec)

    async def log(self, trajectories: Iterable[Trajectory | BaseException | TrajectoryGroup]
                  | None = None, split: str = "val", *, metrics: dict[str, float] | None = None,
                  step: int | None = None) -> dict[str, float]:
        """Save trajectories and/or metrics at ``step`` (default: the current one) under
        ``split``, and send them to the loggers (ART 0.5's signature). Returns what was logged:
        the groups' summary (reward, metrics, group metrics, counts) and ``metrics``. No
        trajectories (``None`` or ``[]``, as when a judge dropped every group) log only the
        metrics, as in ART."""
        validate_name("split", split)
        groups = _as_groups(trajectories) if trajectories is not None else []
        if not groups and metrics is None:
            raise InvalidTrajectoryError("model.log needs trajectories, metrics=, or both (it "
                                         "got no trajectories and no metrics)")
        check_history_metrics(metrics or {})
        if step is None:
            step = await self.get_step()
        await attach_scoped_calls(groups)
        summary = {**(summarize_groups(groups) if groups else {}), **(metrics or {})}
        await self.backend.log(self.spec, groups, split, step, summary)
        await step_logged(self.spec, step, split, summary, groups)
        return summary

    async def history(self) -> list[dict[str, Any]]:
        return await self.backend.history(self.spec)


def _has_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class TrainableModel(Model):
    """A model whose LoRA adapter is trained with GRPO on its own trajectories."""

    trainable = True

    def __init__(self, *, name: str, project: str, base_model: str, **kwargs: Any) -> None:
        if not base_model:
            raise InvalidTrajectoryError("TrainableModel needs base_model (a path or model id)")
        super().__init__(name=name, project=project, base_model=base_model, **kwargs)

    async def train(self, trajectory_groups: Iterable[TrajectoryGroup],
                    config: TrainConfig | None = None, _config: dict[str, Any] | None = None, *,
                    verbose: bool = False) -> dict[str, float]:
        """Run one GRPO step on the groups; the trajectories are saved first. Returns metrics.
        ``_config`` takes ART's ``art.dev.TrainConfig`` dict on top of ``config``."""
        config = config or TrainConfig()
        if _config:
            config = TrainConfig(**{**config.model_dump(exclude_unset=True),
                                    **train_options_from_art(_config)})
        groups = _as_groups(trajectory_groups)
        if not groups:
            raise InvalidTrajectoryError(
                "train() got no trajectory groups (if a judge dropped them all, e.g. RULER with "
                "swallow_exceptions=True, skip this step; ART 0.5's `await backend.train(model, "
                "groups, ...)` skips it for you)")
        await attach_scoped_calls(groups)
        if why := why_no_training_data(groups):
            log.warning("%s: this step has no training signal: %s", self.name, why)
        spec = self.spec
        metrics: dict[str, float] = {}
        async for event in self.backend.train_events(spec, groups, config):
            await train_event(spec, event, groups, config)
            if verbose:
                log.info("%s: step %d %s %s", self.name, event.step, event.kind, ", ".join(
                    f"{k}={v:.4g}" for k, v in event.metrics.items()))
            if event.kind == "done":
                metrics = event.metrics
                if isinstance(trajectory_groups, SampledGroups):  # dynamic sampling's draws
                    metrics = {**metrics, **await log_sampling(
                        self, trajectory_groups.sampling, event.step)}
        return metrics

    async def train_sft(self, trajectories: Iterable[Trajectory],
                        config: TrainSFTConfig | None = None, _config: dict[str, Any] | None = None,
                        verbose: bool = False) -> None:
        """Supervised fine-tuning on whole conversations (ART's ``model.train_sft``): loss on the
        assistant tokens only, ``config.batch_size`` trajectories per optimizer step; one call
        is one new checkpoint, with its own history line (``sft_batches`` > 0) and its
        trajectories saved under the ``sft`` split. Usable before RL and between RL steps."""
        if _config:
            raise ConfigError(f"train_sft: tracerl has no equivalent for ART's _config keys "
                              f"{sorted(_config)}; remove _config")
        trajectories = list(trajectories)
        if not trajectories:
            raise InvalidTrajectoryError("train_sft() got no trajectories")
        for i, t in enumerate(trajectories):
            if not isinstance(t, Trajectory):
                raise InvalidTrajectoryError(f"train_sft: item {i} is a {type(t).__name__}, "
                                             "not a Trajectory")
        result = await self.backend.train_sft(self.spec, trajectories,
                                              config or TrainSFTConfig())
        # the step's history line is written; the loggers get its metrics, as ART's model.log
        await step_logged(self.spec, result.step, "train", result.metrics, [])
        if verbose:
            log.info("%s: SFT step %d %s", self.name, result.step, result.metrics)

    async def delete_checkpoints(self, best_checkpoint_metric: str | None = "val/reward",
                                 *, split: str = "val", keep_last: int = 1) -> list[int]:
        """Keep the newest ``keep_last`` checkpoints and the one whose logged metric is highest;
        delete the rest. Returns the deleted steps. ``best_checkpoint_metric`` is ART's
        ``"split/metric"`` (default ``"val/reward"``), or a metric name looked up in ``split``;
        None keeps only the newest."""
        latest = await self.get_step()
        keep = {s for s in range(max(latest - keep_last + 1, 0), latest + 1)}
        if best_checkpoint_metric:
            if "/" in best_checkpoint_metric:
                split, best_checkpoint_metric = best_checkpoint_metric.split("/", 1)
            scored = [h for h in await self.history()
                      if h.get("split") == split and best_checkpoint_metric in h]
            if scored:
                keep.add(max(scored, key=lambda h: h[best_checkpoint_metric])["step"])
        return await self.backend.delete_checkpoints(self.spec, keep)
