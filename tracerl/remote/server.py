"""The remote backend's control API (``/api/v1``), served beside the gateway by ``tracerl serve``.

Every route needs the server's API key when it has one. Model and project names, rollout and
request ids are validated before they touch a path; bodies are read under size limits.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from ..backend.chat_template import builtin_templates
from ..backend.gateway.http_answers import KeyCheck, KeyRequired, error_response
from ..backend.gateway.request_body import parse_json_object, read_limited_body
from ..backend.weights import SMOLLM2_ALIASES
from ..core.config import ModelConfig, TrainConfig
from ..core.errors import (
    ConfigError,
    InvalidTrajectoryError,
    NotRegisteredError,
    RequestError,
    TracerlError,
)
from ..core.model_spec import ModelSpec
from ..core.release_log import delete_checkpoints as delete_checkpoints_of
from ..core.storage import HISTORY_FIELDS, atomic_write_text, validate_name
from ..core.trajectory import group_lines
from .jobs import TrainQueue, request_marker
from .wire import API_PREFIX, NDJSON, decode_groups

if TYPE_CHECKING:
    from ..backend.local import LocalBackend
    from ..backend.online.loop import OnlineConfig, OnlineLoop

logger = logging.getLogger(__name__)

SMALL_BODY_BYTES = 1024 * 1024
MAX_STEP = 2**63 - 1  # a step is a file's name and an int64 elsewhere (TensorBoard, W&B)


class ControlServer:
    """Registered models, the training queue and the routes that reach them."""

    def __init__(
        self,
        backend: LocalBackend,
        *,
        max_upload_bytes: int = 256 * 1024 * 1024,
        max_queued: int = 4,
        heartbeat_s: float = 5.0,
        base_models: dict[str, str] | None = None,
        allow_engine_args: bool = False,
    ) -> None:
        self.backend = backend
        self.base_models = dict(base_models or {})
        self.allow_engine_args = allow_engine_args
        self.max_upload_bytes = max_upload_bytes
        self.models: dict[str, ModelSpec] = {}
        self.queue = TrainQueue(backend, max_queued=max_queued, heartbeat_s=heartbeat_s)
        self._register_locks: dict[str, asyncio.Lock] = {}
        self.ready = False
        self.online: dict[str, OnlineLoop] = {}
        self.restore_errors: dict[str, str] = {}  # model -> why it could not be restored

    # --- models ----------------------------------------------------------------------------

    def model(self, project: str, name: str) -> ModelSpec:
        key = f"{validate_name('project', project)}/{validate_name('model', name)}"
        if key not in self.models:
            raise NotRegisteredError(f"model {key} is not registered on this server; "
                                     "register it first")
        return self.models[key]

    def _base_model_source(self, requested: Any) -> str:
        """What the server loads for a client's ``base_model``: an embedded model, or a name the
        operator mapped to a folder (``--base-model NAME=PATH``); never a client's path."""
        if not isinstance(requested, str) or not requested:
            raise ConfigError("base_model must be a non-empty string")
        if requested in self.base_models:
            return self.base_models[requested]
        if requested.lower() in SMOLLM2_ALIASES:
            return requested
        offered = [*sorted(self.base_models), "smollm2"]
        raise ConfigError(f"base_model {requested!r} is not offered by this server; it offers "
                          f"{offered} (the operator adds more with --base-model NAME=PATH)")

    async def register(self, definition: dict[str, Any]) -> ModelSpec:
        """Register (idempotently) the model a client describes; validated before anything is
        written."""
        spec = ModelSpec.from_definition(definition)
        self.check_client_engine_config(spec.config)
        return await self._add(spec.model_copy(
            update={"base_model": self._base_model_source(spec.base_model)}))

    def check_client_engine_config(self, config: ModelConfig) -> None:
        """A client's config must not reach the server's filesystem: chat templates by built-in
        name only, and vLLM flags (which can name paths) only where the operator allows them."""
        template = config.engine.chat_template
        builtin = builtin_templates()
        if template is not None and template not in builtin:
            raise ConfigError(f"chat_template {template!r}: remote clients may name a built-in "
                              f"template ({', '.join(sorted(builtin))}), not a file on "
                              "the server")
        if config.engine.extra_args and not self.allow_engine_args:
            raise ConfigError("engine extra_args (vLLM flags, which can name server paths) are "
                              "refused from remote clients; the operator allows them with "
                              "`tracerl serve --allow-engine-args`")

    async def _add(self, spec: ModelSpec) -> ModelSpec:
        async with self._register_locks.setdefault(spec.key, asyncio.Lock()):
            existing = self.models.get(spec.key)
            if existing is not None:
                if existing != spec:
                    raise ConfigError(f"model {spec.key} is registered with another base model "
                                      "or config; use a new model name for a different set-up")
                return existing
            await self.backend.register(spec)
            self.models[spec.key] = spec
            return spec

    async def restore(self, base_path: Path) -> list[str]:
        """Register again every model this server's folder holds (after a restart). A model
        that cannot be served (a corrupt definition, a missing base model) is logged and left
        out (:meth:`unavailable` says why); the others are served."""
        restored = []
        for definition_path in sorted(Path(base_path).glob("*/models/*/model.json")):
            key = "/".join(definition_path.parts[-4:-1:2])  # PROJECT/models/NAME
            try:
                definition = ModelSpec.read(definition_path)
            except ConfigError as e:
                logger.error("model %s is not served: %s", key, e)
                self.restore_errors[key] = str(e)
                continue
            try:
                spec = await self._add(definition)
            except Exception as e:
                logger.exception("model %s is not served: %s", key, e)
                self.restore_errors[key] = f"{type(e).__name__}: {e}"
                continue
            restored.append(spec.key)
        self.ready = True
        return restored

    def unavailable(self) -> dict[str, str]:
        """The models this server holds but does not serve now, ``project/name`` -> why: those
        that could not be restored, and those whose release incumbent's checkpoint is gone."""
        served = {k: self.backend.served(m) for k, m in self.models.items()
                  if m.trainable or m.base_model}  # (not: comparison models, served elsewhere)
        return {**self.restore_errors,
                **{k: r.unavailable for k, r in served.items() if r.unavailable is not None}}

    async def run_online(self, key: str, config: OnlineConfig, stop: asyncio.Event) -> None:
        """Online mode for model ``key`` (``project/name``), from when it is registered until
        ``stop`` is set (on the gateway's loop)."""
        from ..backend.online.loop import OnlineLoop

        while key not in self.models:
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
                return
            except TimeoutError:
                continue
        loop = self.online[key] = OnlineLoop(self.backend, self.models[key], config)
        await loop.run(stop)

    def install(self, app: FastAPI, check_auth: KeyCheck) -> None:
        """Serve the control routes (:data:`router`) on ``app`` (the gateway's), guarded by
        ``check_auth``."""
        app.state.control = self
        app.exception_handler(TracerlError)(_answer_error)
        app.add_middleware(KeyRequired, check=check_auth, only_under=API_PREFIX + "/")
        app.include_router(router)


# --- routes ----------------------------------------------------------------------------------

router = APIRouter(prefix=API_PREFIX)
MODEL_PATH = "/models/{project}/{name}"


def _control(request: Request) -> ControlServer:
    """The server whose routes these are (set by :meth:`ControlServer.install`)."""
    control: ControlServer = request.app.state.control
    return control


Control = Annotated[ControlServer, Depends(_control)]  # a route's server, as a dependency
Rows = list[dict[str, Any]]


async def _answer_error(request: Request, e: TracerlError) -> Response:
    return error_response(e)


async def _json(request: Request) -> dict[str, Any]:
    return parse_json_object(await read_limited_body(request, SMALL_BODY_BYTES) or b"{}")


@router.get("/status")
async def status(control: Control) -> dict[str, Any]:
    backend = control.backend
    return {"ready": control.ready, "training": control.queue.status(),
            "models": {k: await backend.get_step(m) for k, m in control.models.items()},
            "unavailable": control.unavailable()}


@router.post("/models")
async def register(control: Control, request: Request) -> dict[str, Any]:
    model = await control.register(await _json(request))
    return {"model_name": control.backend.inference_name(model),
            "step": await control.backend.get_step(model), "gateway_path": "/v1"}


@router.get(MODEL_PATH)
async def get_model(project: str, name: str, control: Control) -> dict[str, Any]:
    model = control.model(project, name)
    return {"name": model.name, "project": model.project, "base_model": model.base_model,
            "step": await control.backend.get_step(model)}


@router.post(MODEL_PATH + "/train")
async def train(project: str, name: str, control: Control, request: Request
                ) -> StreamingResponse:
    model = control.model(project, name)
    params, groups = decode_groups(await read_limited_body(request, control.max_upload_bytes))
    try:
        config = TrainConfig.model_validate(params.get("config") or {})
    except ValueError as e:
        raise ConfigError(f"invalid train config: {e}") from None
    if not groups:
        raise InvalidTrajectoryError("train got no trajectory groups")
    control.backend.check_groups(model, groups)  # rows against the model, before queueing
    job = control.queue.submit(model, params.get("request_id"), groups, config)
    return StreamingResponse(_ndjson(control.queue.events(job)), media_type=NDJSON)


@router.post(MODEL_PATH + "/check")
async def check(project: str, name: str, control: Control, request: Request) -> dict[str, int]:
    """The train route's checks of an upload's rows, nothing queued or written (a 400 naming
    the row, as the train route answers): ``RemoteBackend.train_many`` checks every model's
    rows before any model trains."""
    model = control.model(project, name)
    _, groups = decode_groups(await read_limited_body(request, control.max_upload_bytes))
    control.backend.check_groups(model, groups)
    return {"checked": len(groups)}


@router.post(MODEL_PATH + "/log")
async def log(project: str, name: str, control: Control, request: Request) -> dict[str, Any]:
    model = control.model(project, name)
    params, groups = decode_groups(await read_limited_body(request, control.max_upload_bytes))
    split, step = params.get("split"), params.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise RequestError(f"the parameters line needs step, an integer in [0, {MAX_STEP}]"
                           f", got {step!r}"[:200], param="step")
    metrics = _log_metrics(params.get("metrics") or {})
    marker = request_marker(control.backend.store(model), "log", params.get("request_id"))
    if not marker.exists():  # a retried log is applied once
        await control.backend.log(model, groups, validate_name("split", split), step, metrics)
        atomic_write_text(marker, json.dumps({"split": split, "step": step}))
    return {"logged": len(groups)}


def _log_metrics(metrics: Any) -> dict[str, Any]:
    """A log request's ``metrics``: a JSON object of numbers, none named as a history field."""
    if not isinstance(metrics, dict):
        raise RequestError("metrics must be a JSON object of numbers", param="metrics")
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RequestError(f"metrics.{key} must be a number, got {value!r}"[:200],
                               param=f"metrics.{key}")
        if key in HISTORY_FIELDS:
            raise RequestError(f"metrics.{key}: {key!r} is a field of every history line "
                               f"({', '.join(HISTORY_FIELDS)}); log it under another name",
                               param=f"metrics.{key}")
    return metrics


@router.get(MODEL_PATH + "/history")
async def history(project: str, name: str, control: Control) -> Rows:
    return await control.backend.history(control.model(project, name))


@router.get(MODEL_PATH + "/calls/{rollout_id}")
async def calls(project: str, name: str, rollout_id: str, control: Control) -> Rows:
    validate_name("rollout id", rollout_id)
    found = await control.backend.fetch_calls(control.model(project, name), rollout_id)
    return [c.model_dump(mode="json") for c in found]


@router.get(MODEL_PATH + "/spans/{rollout_id}")
async def spans(project: str, name: str, rollout_id: str, control: Control) -> Rows:
    validate_name("rollout id", rollout_id)
    found = await control.backend.fetch_spans(control.model(project, name), rollout_id)
    return [s.model_dump(mode="json") for s in found]


@router.post(MODEL_PATH + "/external/take")
async def take_external(project: str, name: str, control: Control, request: Request
                        ) -> Response:
    model, body = control.model(project, name), await _json(request)
    groups = await control.backend.take_external_groups(  # n_groups: checked by the store
        model, body.get("n_groups", 0), validate_name("request id", body.get("request_id")))
    return Response(group_lines(groups), media_type=NDJSON)


@router.get(MODEL_PATH + "/external/status")
async def external_status(project: str, name: str, control: Control) -> dict[str, int]:
    return await control.backend.external_rollouts_status(control.model(project, name))


@router.get(MODEL_PATH + "/pending")
async def pending(project: str, name: str, control: Control) -> Response:
    groups = await control.backend.pending_groups(control.model(project, name))
    return Response(group_lines(groups), media_type=NDJSON)


@router.post(MODEL_PATH + "/checkpoints/delete")
async def delete_checkpoints(project: str, name: str, control: Control, request: Request
                             ) -> dict[str, Any]:
    model = control.model(project, name)
    keep = (await _json(request)).get("keep_steps")
    if not isinstance(keep, list) or not all(isinstance(s, int) and not isinstance(s, bool)
                                             and s >= 0 for s in keep):
        raise ConfigError("keep_steps must be a list of step numbers")
    # kept besides keep_steps: the newest, and what the release log points at (named, and why)
    deleted, kept = await asyncio.to_thread(delete_checkpoints_of,
                                            control.backend.store(model), set(keep))
    return {"deleted": deleted, "kept": {str(step): why for step, why in kept.items()}}


@router.get(MODEL_PATH + "/release")
async def release_state(project: str, name: str, control: Control) -> dict[str, Any]:
    from ..core.release_log import ReleaseLog

    store = control.backend.store(control.model(project, name))
    return asdict(await asyncio.to_thread(ReleaseLog(store.root).state))


@router.get(MODEL_PATH + "/online")
async def online_status(project: str, name: str, control: Control) -> dict[str, Any]:
    """Online mode's counts (live calls waiting, trained, expired by reason), release stage
    and last gate verdict."""
    model = control.model(project, name)
    loop = control.online.get(model.key)
    if loop is None:
        raise NotRegisteredError(f"model {model.key} is not in online mode on this server "
                                 "(tracerl serve --online PROJECT/NAME)")
    return await asyncio.to_thread(loop.status)


@router.post(MODEL_PATH + "/release/{action}")
async def release_move(project: str, name: str, action: str, control: Control, request: Request
                       ) -> dict[str, Any]:
    """Promote (``{"step": N}``) or roll back (``{"to": N}``) the model's incumbent: effective
    for the next call on every replica; calls in flight finish."""
    from ..backend.online.release import ReleaseControl

    model, body = control.model(project, name), await _json(request)
    key = {"promote": "step", "rollback": "to"}.get(action)
    if key is None:
        raise ConfigError(f"no release action {action!r}: promote or rollback")
    step = body.get(key)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"{key} must be a step number (an integer >= 0), not {step!r}")
    release = ReleaseControl(control.backend, model)
    move = release.promote if action == "promote" else release.rollback
    state = await move(step, body.get("reason") or "by hand")
    return {"incumbent": state.incumbent}


async def _ndjson(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async for event in events:
        yield json.dumps(event, allow_nan=False).encode() + b"\n"
