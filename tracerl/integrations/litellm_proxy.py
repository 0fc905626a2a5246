"""``tracerl proxy``: a real LiteLLM proxy in front of the gateway, for agents in any language.

The proxy listens on loopback with a master key that is given, or generated once and kept in
``<directory>/master_key`` (mode 0600), so clients keep working across restarts. A call names
its rollout either with the ``x-rollout-id`` header (optionally ``x-tracerl-tags``), or, for
clients that cannot set headers, in LiteLLM's body ``metadata``: ``{"metadata": {"rollout_id":
"ro-..."}}``; a small callback inside the proxy forwards it to the gateway, which records every
call token-exactly under that rollout. The callback module is
written next to the config and needs nothing but LiteLLM, so the proxy may run from its own
virtualenv (``python`` argument / ``TRACERL_LITELLM_PYTHON``): LiteLLM's ``[proxy]`` extra
pins packages that do not resolve together with ours.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx2

from ..core import settings
from ..core.context import ROLLOUT_HEADER, TAGS_HEADER
from ..core.errors import ConfigError
from ..core.model_name import ModelName
from ..core.net import free_port, start_child, stop_process_group
from ..core.spans import POSTED_SPAN_TAG

CALLBACK_MODULE = "tracerl_proxy_callback"

CALLBACK_SOURCE = f'''"""Written by tracerl: forwards rollout attribution headers to its gateway,
and posts one `llm` span per proxied call of a rollout to the gateway's span route, after the
response (a failed post is logged; it never fails the call). The span's id is announced in the
call's tags before the call goes out, so the rollout's finish knows to wait for the post."""
import json
import logging
import uuid

import httpx
from litellm.integrations.custom_logger import CustomLogger

FORWARD = ({ROLLOUT_HEADER!r}, {TAGS_HEADER!r})
ROLLOUT_KEY = "tracerl_rollout_id"  # in the call's metadata, for the log events
SPAN_KEY = "tracerl_span_id"  # the id announced to the gateway for the span posted later
SPAN_POST_TIMEOUT_S = 10.0
log = logging.getLogger("tracerl.proxy")


_span_client = None  # one pooled client per proxy process: making one costs ~17 ms of CPU


def _client():
    global _span_client
    if _span_client is None:
        _span_client = httpx.AsyncClient(timeout=SPAN_POST_TIMEOUT_S)
    return _span_client


def _announce(tags, span_id):
    """The tags header with the id of the span to be posted: the gateway keeps it on the call's
    record, and finishing the rollout waits for that span. A header that is not a JSON object
    is left as sent, for the gateway to refuse."""
    try:
        parsed = json.loads(tags) if tags is not None else {{}}
    except ValueError:
        return tags
    if not isinstance(parsed, dict):
        return tags
    return json.dumps({{**parsed, {POSTED_SPAN_TAG!r}: span_id}}, separators=(",", ":"))


def _metadata_key(data, call_type):
    """Where LiteLLM keeps a call's own metadata: ``litellm_metadata`` on the routes whose API
    has a ``metadata`` parameter of its own (Responses, Anthropic Messages, ...), else
    ``metadata``; a span id kept elsewhere never reaches the success event."""
    if "litellm_metadata" in data or "responses" in str(call_type) or "anthropic" in str(call_type):
        return "litellm_metadata"
    return "metadata"


def _our_metadata(kwargs, params):
    """The metadata holding the rollout and span ids, wherever the call type kept it."""
    for found in (params.get("metadata"), params.get("litellm_metadata"),
                  kwargs.get("litellm_metadata"), kwargs.get("metadata")):
        if isinstance(found, dict) and ROLLOUT_KEY in found:
            return found
    return {{}}


def _seconds(t):
    return t.timestamp() if hasattr(t, "timestamp") else float(t)


class TracerlProxyCallback(CustomLogger):
    async def async_pre_call_hook(self, user_api_key_dict, cache, data, call_type):
        request = data.get("proxy_server_request") or {{}}
        headers = {{k.lower(): v for k, v in (request.get("headers") or {{}}).items()}}
        body_rollout = (data.get("metadata") or {{}}).get("rollout_id")
        forward = {{k: headers[k] for k in FORWARD if k in headers}}
        if body_rollout and {ROLLOUT_HEADER!r} not in forward:
            forward[{ROLLOUT_HEADER!r}] = str(body_rollout)
        if forward:
            data["extra_headers"] = {{**(data.get("extra_headers") or {{}}), **forward}}
        if {ROLLOUT_HEADER!r} in forward:
            span_id = "litellm-" + uuid.uuid4().hex
            forward[{TAGS_HEADER!r}] = _announce(forward.get({TAGS_HEADER!r}), span_id)
            data["extra_headers"] = {{**data["extra_headers"], **forward}}
            key = _metadata_key(data, call_type)
            data[key] = {{**(data.get(key) or {{}}),
                         ROLLOUT_KEY: forward[{ROLLOUT_HEADER!r}], SPAN_KEY: span_id}}
        return data

    async def async_log_success_event(self, kwargs, response_obj, start_time, end_time):
        await self._post_span(kwargs, response_obj, start_time, end_time, None)

    async def async_log_failure_event(self, kwargs, response_obj, start_time, end_time):
        error = kwargs.get("exception") or kwargs.get("traceback_exception") or "call failed"
        await self._post_span(kwargs, None, start_time, end_time, str(error)[:2000])

    async def _post_span(self, kwargs, response_obj, start_time, end_time, error):
        try:
            params = kwargs.get("litellm_params") or {{}}
            metadata = _our_metadata(kwargs, params)
            rollout = metadata.get(ROLLOUT_KEY)
            api_base = params.get("api_base") or kwargs.get("api_base")
            if not rollout or not api_base:
                return
            call_id = str(kwargs.get("litellm_call_id") or uuid.uuid4().hex)
            model = str(metadata.get("model_group") or kwargs.get("model") or "")
            span = {{"id": str(metadata.get(SPAN_KEY) or "litellm-" + call_id), "kind": "llm",
                    "name": model, "framework": "litellm-proxy", "start_time": _seconds(start_time),
                    "end_time": _seconds(end_time), "error": error,
                    "response_id": getattr(response_obj, "id", None),
                    "attributes": {{"litellm_call_id": call_id, "model": model}}}}
            key = kwargs.get("api_key") or params.get("api_key")
            headers = {{"authorization": f"Bearer {{key}}"}} if key else {{}}
            base = str(api_base).rstrip("/")  # the endpoint's URL: keep up to its /v1
            cut = base.rfind("/v1/")
            url = f"{{base[:cut + 3] if cut >= 0 else base}}/rollouts/{{rollout}}/spans"
            r = await _client().post(url, headers=headers, json={{"model": model,
                                                                 "spans": [span]}})
            if r.status_code >= 400:
                log.warning("tracerl: the span of call %s was refused by the gateway: HTTP %s %s",
                            call_id, r.status_code, r.text[:300])
        except Exception as e:  # the call itself has been answered: never fail it
            log.warning("tracerl: could not post the span of a proxied call: %r", e)


recorder = TracerlProxyCallback()
'''


def gateway_names(upstream_base_url: str, upstream_api_key: str, names: list[str]
                  ) -> dict[str, str]:
    """The gateway's unambiguous name (``project/name``) for each name clients will send: a bare
    ``name`` served by one project becomes that project's, so a model of the same name
    registered in another project later does not break the proxy. A :class:`ConfigError`
    names a bare name several projects serve, a name the gateway does not serve, and a
    gateway that cannot be asked."""
    try:
        r = httpx2.get(f"{upstream_base_url.rstrip('/')}/models", timeout=30,
                       headers={"authorization": f"Bearer {upstream_api_key}"})
        r.raise_for_status()
        served = [str(m["id"]) for m in r.json()["data"]]
    except (httpx2.HTTPError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"could not list the models of the gateway at {upstream_base_url} "
                          f"(--backend-url, --api-key): {e!r}") from None
    qualified = [m for m in served if (n := ModelName.parse(m)).qualified and not n.pinned]
    out = {}
    for name in names:
        asked = ModelName.parse(name)
        matches = [m for m in qualified if asked.base in (m, ModelName.parse(m).name)]
        if len(matches) == 1:
            out[name] = str(replace(asked, base=matches[0]))
        elif not matches and asked.base in served:
            out[name] = name  # the base model's own served name
        elif matches:
            raise ConfigError(f"--model {name}: several projects serve a model of that name; "
                              f"name one of {sorted(matches)}")
        else:
            raise ConfigError(f"--model {name}: the gateway at {upstream_base_url} serves no "
                              f"such model; it serves {sorted(qualified)}")
    return out


def write_proxy_config(directory: Path, *, upstream_base_url: str, upstream_api_key: str,
                       models: dict[str, str]) -> Path:
    """Write ``config.yaml`` (JSON is valid YAML) and the callback module into ``directory``;
    ``models`` maps each name clients send to the gateway's name for it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{CALLBACK_MODULE}.py").write_text(CALLBACK_SOURCE)
    config = {
        "model_list": [
            {
                "model_name": name,
                "litellm_params": {
                    "model": f"hosted_vllm/{upstream}",
                    "api_base": upstream_base_url,
                    "api_key": upstream_api_key,
                    "num_retries": 0,
                },
            }
            for name, upstream in models.items()
        ],
        "litellm_settings": {"callbacks": f"{CALLBACK_MODULE}.recorder", "num_retries": 0},
        "general_settings": {"disable_spend_logs": True},
    }
    path = directory / "config.yaml"
    path.write_text(json.dumps(config, indent=2))
    return path


def _litellm_command(python: str | None) -> list[str]:
    python = python or settings.TRACERL_LITELLM_PYTHON.get() or sys.executable
    cli = Path(os.path.abspath(python)).parent / "litellm"  # abspath: a venv's python is a symlink
    if cli.exists():
        return [str(cli)]
    if found := shutil.which("litellm"):
        return [found]
    raise FileNotFoundError(f"no `litellm` CLI next to {python}; install litellm with its proxy "
                            "dependencies there (see README) or set TRACERL_LITELLM_PYTHON")


@dataclass
class LiteLLMProxy:
    """A LiteLLM proxy process serving ``model_names`` from the gateway at ``upstream_base_url``
    (each forwarded under the gateway's unambiguous name, see :func:`gateway_names`)."""

    upstream_base_url: str
    model_names: list[str]
    upstream_api_key: str = "tracerl-local"
    directory: Path = field(default_factory=lambda: Path.cwd() / ".tracerl" / "proxy")
    host: str = "127.0.0.1"
    port: int = 0
    python: str | None = None
    master_key: str | None = None  # None: the one kept in directory/master_key (made once)
    startup_timeout_s: float = 120.0
    workers: int = 1  # uvicorn worker processes (``--num_workers``)
    process: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        # absolute: the child runs in it (cwd) and is given paths under it
        self.directory = Path(self.directory).expanduser().resolve()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def _persisted_master_key(self) -> str:
        path = self.directory / "master_key"
        if path.exists():
            return path.read_text().strip()
        self.directory.mkdir(parents=True, exist_ok=True)
        key = "sk-" + secrets.token_urlsafe(24)
        fd = os.open(path.with_suffix(".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        os.replace(path.with_suffix(".tmp"), path)  # atomic: never a half-written key
        return key

    def start(self) -> LiteLLMProxy:
        self.master_key = self.master_key or self._persisted_master_key()
        config = write_proxy_config(
            self.directory,
            upstream_base_url=self.upstream_base_url,
            upstream_api_key=self.upstream_api_key,
            models=gateway_names(self.upstream_base_url, self.upstream_api_key,
                                 self.model_names),
        )
        self.port = self.port or free_port(self.host)
        env = {
            **os.environ,
            "LITELLM_MASTER_KEY": str(self.master_key),
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "LITELLM_OFFLINE_MODE": "true",
            "PYTHONPATH": str(self.directory),
        }
        log = open(self.directory / "proxy.log", "wb")
        self.process = start_child(
            [
                *_litellm_command(self.python),
                "--config",
                str(config),
                "--host",
                self.host,
                "--port",
                str(self.port),
                "--num_workers",
                str(self.workers),
            ],
            cwd=self.directory,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            return self._wait_until_live()
        except BaseException:  # a timeout, Ctrl-C or SIGTERM while starting: no proxy left
            self.stop()
            raise

    def _wait_until_live(self) -> LiteLLMProxy:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the LiteLLM proxy exited with {self.process.returncode}; "
                                   f"see {self.directory / 'proxy.log'}")
            try:
                if (
                    httpx2.get(
                        f"http://{self.host}:{self.port}/health/liveliness", timeout=2
                    ).status_code
                    == 200
                ):
                    return self
            except httpx2.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the LiteLLM proxy did not come up within {self.startup_timeout_s} s; "
                           f"see {self.directory / 'proxy.log'}")

    def stop(self) -> None:
        if self.process is not None:
            stop_process_group(self.process, 15)

    def __enter__(self) -> LiteLLMProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
