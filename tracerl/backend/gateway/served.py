"""Served models and their versions: which engine and adapter answer a requested model name.

A :class:`ServedModel` is one trainable model's route (its engine, store, the adapter steps it
serves, the lock that holds new calls while its adapter is swapped, and its routing under
release control); the :class:`ModelTable` is the gateway's set of them, by ``project/name``,
and resolves what a caller asked for (:class:`~tracerl.core.model_name.ModelName`). Under
release control (:mod:`.releases`) the plain name goes to the incumbent version, or to the
candidate for the canary's share of rollouts (a sticky hash of the rollout id,
:class:`ReleaseRouting`), and a newly trained version is only loaded (``NAME@N``) until it is
promoted.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...core.engine import Engine, EngineRequestError
from ...core.model_name import ModelName
from ...core.storage import ModelStore
from ...core.watchdog import watch
from .swap_lock import Admission, SwapLock

MAX_PINNED_ROLLOUTS = 65536  # rollouts whose policy version is remembered (oldest forgotten)


def canary_bucket(rollout_id: str) -> float:
    """A rollout id's place in [0, 1): sticky (the same id, the same place, in every process)."""
    return int.from_bytes(hashlib.sha256(rollout_id.encode()).digest()[:8], "big") / 2.0 ** 64


@dataclass
class ReleaseRouting:
    """Which version a plain-name call gets: the incumbent, or the candidate for the canary's
    share of rollouts (calls without a rollout id: the incumbent)."""

    incumbent: int
    candidate: int | None = None
    share: float = 0.0

    def pick(self, rollout_id: str | None) -> int:
        if self.candidate is not None and rollout_id is not None and \
                canary_bucket(rollout_id) < self.share:
            return self.candidate
        return self.incumbent

    def steps(self) -> set[int]:
        return {self.incumbent} | ({self.candidate} if self.candidate is not None else set())


@dataclass
class ServedModel:
    """A trainable model's route: requests for ``project/name`` (or ``name`` while no other
    project serves that name) go to its newest adapter. Its identity is the (project, name)
    pair of its ``store``."""

    name: str
    engine: Engine
    store: ModelStore
    step: int = 0
    swap: SwapLock = field(default_factory=SwapLock)
    resident: int = 1  # policy versions kept loaded (EngineConfig.resident_adapters)
    versions: dict[int, Path] = field(default_factory=dict)  # resident step -> adapter path
    pins: OrderedDict[str, int] = field(default_factory=OrderedDict)  # rollout -> its version
    release: ReleaseRouting | None = None  # set: release control routes the plain name
    # set: why the model is not served (its release incumbent's checkpoint is gone); its calls
    # are 503s saying so, the other models are served (.releases.attach)
    unavailable: str | None = None
    # set: online mode; each plain call is a live rollout with an id from it, given the call's
    # tags (online/live_calls: a ``session`` tag names one rollout for several calls)
    live: Callable[[dict[str, Any] | None], str] | None = None

    timeout_s: float = field(init=False)  # a call's deadline (EngineConfig.request_timeout_s)

    def __post_init__(self) -> None:
        self.swap.model = self.key
        self.timeout_s = self.engine.spec.config.request_timeout_s

    @property
    def key(self) -> str:
        """``project/name``: the route's identity (two projects may share a model name)."""
        return f"{self.store.project}/{self.name}"

    @property
    def adapter_name(self) -> str:
        """The adapter's name in the engine: one per (project, name), never shared."""
        return self.key

    async def swap_adapter(self, step: int, path: Path) -> None:
        """Serve checkpoint ``step``. One resident version: swapped in place once calls in
        flight have finished (new calls wait). Several: ``step`` is loaded beside the others as
        ``name@step``; the oldest beyond ``resident`` is unloaded once no call uses it."""
        with watch("swap", f"the adapter swap of {self.name} to step {step}",
                   self.swap.describe):
            if self.release is not None:  # loaded as NAME@step; routed once promoted
                await self.load_version(step, path)
                return
            if self.resident <= 1:
                async with self.swap.swapping(self.timeout_s + 30.0):
                    await self.engine.load_adapter(self.adapter_name, path)
                    self.step = step
                return
            await self.engine.load_adapter(self.lora_name(step), path)
            self.versions[step] = path
            self.step = max(self.step, step)
            await self._retire(sorted(self.versions)[:-self.resident])

    async def load_version(self, step: int, path: Path, keep: Collection[int] = ()) -> None:
        """Release control: load ``step`` as ``NAME@step`` (kept: ``step``, ``keep``, the
        incumbent, the candidate, the newest; the others are unloaded once no call uses them).
        Loaded before any routing names it: a call is never routed to a version not yet
        loaded, nor to one retired as it loaded (a move to an older step is routed after this
        load)."""
        if step > 0 and self.versions.get(step) != Path(path):
            await self.engine.load_adapter(self.version_name(step), path)
            self.versions[step] = Path(path)
        self.step = max(self.step, step)
        keep = {step, self.step, *keep,
                *(self.release.steps() if self.release is not None else ())}
        await self._retire([s for s in self.versions if s not in keep])

    async def _retire(self, steps: list[int]) -> None:
        """Unload versions ``steps``: no call is routed to them from now on (one that was is
        resolved again when admitted, see :meth:`admit`); the engine unloads them once the
        calls in flight that use them have finished. The other versions' calls go on meanwhile.
        If those calls outlast the wait, the versions stay served (a later swap retires them)."""
        if not steps:
            return
        paths = {step: self.versions.pop(step) for step in steps}
        names = [self.version_name(step) for step in steps]
        try:
            async with self.swap.retiring(names, self.timeout_s + 30.0):
                for step, name in zip(steps, names, strict=True):
                    await self.engine.unload_adapter(name)
                    del paths[step]
        finally:
            self.versions.update(paths)  # those not unloaded (a timeout, a failed unload)

    async def admit(self, engine_model: str, step: int | None, requested: str,
                    rollout_id: str | None) -> tuple[Admission, str, int | None]:
        """Count a call in, waiting (within the call's deadline) for a swap in progress: its
        :class:`~.swap_lock.Admission`, and the engine model name and step that serve it: those
        it was resolved to, or the newest when the swap retired that version.
        :class:`~tracerl.core.engine.EngineTimeoutError` if the swap outlasts the deadline."""
        admission = await self.swap.admit(self.timeout_s)
        if not (step is None or (self.resident <= 1 and self.release is None) or
                self._resident(step) or ModelName.parse(requested).pinned):
            engine_model, step = self.resolve(requested, rollout_id)  # unpinned: never fails
        admission.serve(engine_model)  # (a pinned step that was retired: the engine's 404)
        return admission, engine_model, step

    def lora_name(self, step: int) -> str:
        """The engine's name of the adapter serving ``step`` now."""
        if self.resident <= 1 and self.release is None:
            return self.adapter_name
        return self.version_name(step)

    def version_name(self, step: int) -> str:
        """The engine's name of version ``step`` when several are resident: ``NAME@step``."""
        return str(ModelName.of(self.adapter_name, step))

    def _resident(self, step: int) -> bool:
        if self.release is not None:
            return step == 0 or step in self.versions
        if step == 0:
            return self.step < self.resident  # the base model counts as version 0
        return step == self.step if self.resident <= 1 else step in self.versions

    def resolve(self, requested: str, rollout_id: str | None = None) -> tuple[str, int | None]:
        """Engine model name and adapter step for a requested model name. With several
        resident versions, a rollout stays on the version its first call got while that
        version is resident (the call records which one served it)."""
        if requested == self.engine.spec.served_name and requested != self.name:
            return requested, None
        asked = ModelName.parse(requested)
        step = self.step
        if asked.pinned:
            step = self._pinned_step(asked)
        elif self.release is not None:
            step = self.release.pick(rollout_id)
        elif self.resident > 1 and rollout_id is not None:
            pinned = self.pins.get(rollout_id)
            if pinned is not None and self._resident(pinned):
                step = pinned
            else:
                self.pins[rollout_id] = step
                while len(self.pins) > MAX_PINNED_ROLLOUTS:
                    self.pins.popitem(last=False)
        if step == 0:
            return self.engine.spec.served_name, 0
        return self.lora_name(step), step

    def _pinned_step(self, asked: ModelName) -> int:
        """The step ``NAME@STEP`` asks for; a 404 naming it when it is malformed or not served
        (step 0, the base model, is always served)."""
        step = asked.step
        if step is None:
            raise EngineRequestError(f"bad step in model name {str(asked)!r}", status=404,
                                     param="model", code="model_not_found")
        if step != 0 and not self._resident(step):
            served = sorted(self.versions) if self.resident > 1 or self.release else [self.step]
            raise EngineRequestError(
                f"The model `{asked}` is not served: step {asked.step_text} is not the current "
                f"step ({self.step}) nor resident (steps served: {served}); use `{self.key}` or "
                f"`{ModelName.of(self.key, self.step)}`",
                status=404, param="model", code="model_not_found")
        return step


class ModelTable(Mapping[str, ServedModel]):
    """The served models by ``project/name``, and what a requested model name resolves to."""

    def __init__(self) -> None:
        self._models: dict[str, ServedModel] = {}

    def __getitem__(self, key: str) -> ServedModel:
        return self._models[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)

    def add(self, served: ServedModel) -> None:
        self._models[served.key] = served

    def model_id(self, served: ServedModel) -> str:
        """The name the library hands out for ``served`` (``get_inference_name``, the remote
        API, integrations): always ``project/name``, which no later registration can make
        ambiguous. The bare ``name`` is accepted too while one project serves it."""
        return served.key

    def _unique(self, served: ServedModel) -> bool:
        """Whether no other project serves a model of ``served``'s name."""
        return not any(m.name == served.name and m is not served for m in self._models.values())

    def listing(self) -> list[str]:
        """Every name a caller may use (``/v1/models``), model by model (an unavailable model's
        are left out: see :meth:`unavailable`)."""
        ids: list[str] = []
        for m in self._models.values():
            if m.unavailable is not None:
                continue
            ids += dict.fromkeys((m.key, str(ModelName.of(m.key, m.step)),
                                  *([m.name] if self._unique(m) else []),
                                  m.engine.spec.served_name))
        return ids

    def unavailable(self) -> dict[str, str]:
        """The models not served now, ``project/name`` -> why."""
        return {k: m.unavailable for k, m in self._models.items() if m.unavailable is not None}

    def route(self, requested: Any, rollout_id: str | None = None
              ) -> tuple[ServedModel, str, int | None]:
        """The model ``requested`` names, its engine model name and the adapter step serving
        it; a 4xx :class:`~tracerl.core.engine.EngineRequestError` naming ``model`` if none."""
        if not isinstance(requested, str) or not requested:
            raise EngineRequestError("you must provide a model parameter", param="model")
        asked = ModelName.parse(requested)
        served = self._models.get(asked.base) if asked.qualified else None
        if served is None and not asked.qualified:
            named = [m for m in self._models.values() if m.name == asked.base]
            if len(named) > 1:
                raise EngineRequestError(
                    f"The model `{requested}` is ambiguous: projects "
                    f"{sorted(m.store.project for m in named)} each have a model `{asked.base}`; "
                    f"use one of {sorted(m.key for m in named)}",
                    status=404, param="model", code="model_not_found")
            served = named[0] if named else None
        if served is None:
            for m in self._models.values():
                if m.engine.spec.served_name == requested:
                    served = m
                    break
        if served is None:
            known = sorted(
                {*self._models, *(m.engine.spec.served_name for m in self._models.values())}
            )
            raise EngineRequestError(f"The model `{requested}` does not exist. Served: {known}",
                                     status=404, param="model", code="model_not_found")
        if served.unavailable is not None:
            raise EngineRequestError(f"The model `{requested}` is not served now: "
                                     f"{served.unavailable}", status=503, param="model",
                                     code="model_unavailable")
        engine_model, step = served.resolve(str(asked.local) if asked.qualified else requested,
                                            rollout_id)
        return served, engine_model, step
