"""``tracerl serve``: the backend (gateway + trainer + control API) as a server for thin clients."""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..backend.local import LocalBackend
from ..core.errors import ConfigError
from ..core.model_name import ModelName
from ..core.net import is_loopback
from ..core.storage import validate_name
from ..events.plugins import register as register_plugin
from .server import ControlServer

log = logging.getLogger(__name__)


def parse_base_models(items: list[str]) -> dict[str, str]:
    """``NAME=PATH`` pairs: the base models clients may ask for by NAME."""
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--base-model wants NAME=PATH, got {item!r}")
        if not (Path(path).expanduser() / "config.json").exists():
            raise ConfigError(f"--base-model {name}: {path} is not a model folder (no config.json)")
        out[name] = str(Path(path).expanduser().resolve())
    return out


def placement_options(*, replicas: int | None = None, replica_urls: Sequence[str] = (),
                      replicas_per_gpu: int = 1, gpus_per_replica: int = 1,
                      replica_failure: str = "restart", publish_dir: str | None = None,
                      publish_mount: str | None = None) -> dict[str, Any]:
    """The ``tracerl serve`` replica flags as placement fields (defaults left out)."""
    given = {"replicas": replicas, "replica_urls": list(replica_urls) or None,
             "replicas_per_gpu": replicas_per_gpu if replicas_per_gpu != 1 else None,
             "gpus_per_replica": gpus_per_replica if gpus_per_replica != 1 else None,
             "replica_failure": replica_failure if replica_failure != "restart" else None,
             "publish_dir": publish_dir, "publish_mount": publish_mount}
    return {k: v for k, v in given.items() if v is not None}


def serve(*, host: str, port: int, path: str, api_key: str | None, engine: str | None = None,
          plugins: Sequence[str] = (), base_models: dict[str, str] | None = None,
          max_upload_bytes: int = 256 * 1024 * 1024, max_queued: int = 4,
          heartbeat_s: float = 5.0, allow_engine_args: bool = False,
          placement: dict[str, Any] | None = None, online: Sequence[str] = (),
          online_config: str | None = None) -> int:
    """Serve until SIGTERM or Ctrl-C. Models registered earlier in ``path`` are served again.

    ``placement``: where inference runs for every model (the operator's choice, never a
    client's): ``replicas``, ``replicas_per_gpu``, ``gpus_per_replica``, ``replica_urls``,
    ``replica_failure``, ``publish_dir``, ``publish_mount`` of
    :class:`~tracerl.core.config.EngineConfig`.

    ``online``: the ``project/name`` of models to run in online mode
    (:mod:`tracerl.backend.online.loop`), each with ``online_config`` (a JSON object)."""
    if not is_loopback(host) and not api_key:
        raise ConfigError(f"serving on {host} needs an API key (set TRACERL_API_KEY); "
                          "without one, only loopback (127.0.0.1) is allowed")
    if not is_loopback(host):
        log.warning("listening on %s over plain HTTP; put a TLS-terminating proxy in front of it "
                    "so the API key and trajectories are encrypted", host)
    from ..backend.online.loop import online_config as parse_online_config

    config = parse_online_config(online_config)  # a bad one: refused before anything starts
    for key in online:
        model = ModelName.parse(key)
        validate_name("project", model.project or "")
        validate_name("model", str(model.local))
    for module in plugins:
        register_plugin(importlib.import_module(module), name=module)
    _no_progress_bars()
    backend = LocalBackend(path=path, host=host, port=port, api_key=api_key, engine=engine,
                           placement=placement or {})
    control = ControlServer(backend, max_upload_bytes=max_upload_bytes, max_queued=max_queued,
                            heartbeat_s=heartbeat_s, base_models=base_models,
                            allow_engine_args=allow_engine_args)
    control.install(backend.gateway.app, backend.gateway.check_auth)
    url = backend.base_url.removesuffix("/v1")
    log.info("listening on %s (data in %s)", url, Path(path).resolve())
    restored = backend.run_sync(control.restore(Path(path)))
    log.info("ready; models restored: %s", ", ".join(restored) or "none")

    online_stop = backend.run_sync(_make_event())
    runs = [asyncio.run_coroutine_threadsafe(control.run_online(key, config, online_stop),
                                             backend.gateway_loop) for key in online]

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        if not backend.serving:
            log.error("the server thread died")
            return 1
    log.info("stopping")
    backend.gateway_loop.call_soon_threadsafe(online_stop.set)
    for run in runs:
        try:
            run.result(timeout=60)
        except Exception:
            log.exception("the online loop did not stop cleanly")
    backend.run_sync(control.queue.close(), timeout=30)
    asyncio.run(backend.close())
    return 0


async def _make_event() -> asyncio.Event:
    """An event of the gateway's loop (made on it)."""
    return asyncio.Event()


def _no_progress_bars() -> None:
    """A server's log is lines, not progress bars (transformers draws one per weight load)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
