"""The vLLM engine: a vLLM OpenAI server subprocess on loopback, driven over HTTP.

vLLM may live in its own virtual environment (its pins rarely match the trainer's): set
``TRACERL_VLLM_PYTHON`` to that interpreter, or install vLLM beside tracerl. LoRA adapters are
hot-swapped with ``/v1/load_lora_adapter`` and ``load_inplace``. Logprobs are requested in
``processed_logprobs`` mode, i.e. of the distribution actually sampled from.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from ...core import settings
from ...core.engine import (
    PROMPT_IDS,
    Engine,
    EngineRequestError,
    EngineSpec,
    EngineUnavailableError,
)
from ...core.errors import EngineError
from ...core.fingerprint import BASE, digest_if_readable, note_served
from ...core.net import free_port, start_child, stop_process_group
from ...events.hookspecs import hookimpl
from ..chat_template import apply_chat_template_override, chat_template_path, turn_end_ids
from . import token_prompts
from .json_codec import loads

log = logging.getLogger(__name__)


def startup_timeout_s() -> float:
    """How long vLLM may take to start (``TRACERL_VLLM_STARTUP_TIMEOUT``, default 600 s)."""
    return settings.TRACERL_VLLM_STARTUP_TIMEOUT.get()


def vllm_python() -> str | None:
    """The interpreter that has vLLM: ``TRACERL_VLLM_PYTHON``, else this one if it has vLLM."""
    explicit = settings.TRACERL_VLLM_PYTHON.get()
    if explicit:
        return explicit if shutil.which(explicit) or Path(explicit).exists() else None
    return sys.executable if importlib.util.find_spec("vllm") else None


# tool parsers tracerl replaces with its own plugin (vllm_plugins/): name -> the plugin's name
_TOOL_PARSER_PLUGINS = {"hermes": ("hermes_tool_parser.py", "tracerl_hermes")}


def tool_parser_flags(parser: str) -> list[str]:
    """vLLM's flags for tool parser ``parser``: ``hermes`` is tracerl's plugin, which answers a
    call whose arguments are not a JSON object as text, as the transformers engine does
    (``vllm_plugins/hermes_tool_parser.py``); the others are vLLM's own."""
    if parser not in _TOOL_PARSER_PLUGINS:
        return ["--tool-call-parser", parser]
    file, name = _TOOL_PARSER_PLUGINS[parser]
    plugin = Path(__file__).resolve().parent / "vllm_plugins" / file
    return ["--tool-parser-plugin", str(plugin), "--tool-call-parser", name]


def _lora_rank_slot(r: int) -> int:
    """vLLM accepts only these values for --max-lora-rank."""
    for slot in (8, 16, 32, 64, 128, 256, 320, 512):
        if r <= slot:
            return slot
    raise EngineError(f"LoRA rank {r} is above what vLLM serves (512)")


def _cuda_visible() -> bool:
    try:
        import torch
    except ImportError:
        return shutil.which("nvidia-smi") is not None
    return torch.cuda.is_available()


# vLLM servers that tracerl starts keep idle connections this long (vLLM's default is 5 s), and
# the gateway's pool drops them earlier, so a request never goes out on a connection the server
# is closing. Rollouts pause longer than 5 s between turns (a tool runs, a training step), and
# re-opening hundreds of connections cost the gateway a third of its CPU at 256 concurrent
# rollouts on the H200 (BENCHMARKS.md, session 8).
SERVER_KEEP_ALIVE_S = 75
POOL_KEEP_ALIVE_S = 60.0


def _kv_cache_bytes(devices: Any, share: float) -> int | None:
    """Half of a server's share of its GPU for the KV cache (the rest: weights, activations,
    CUDA graphs); None when no GPU is visible to tell its size."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        device = devices[0] if devices else 0
        total = torch.cuda.get_device_properties(device).total_memory
    except (ImportError, RuntimeError, AssertionError):
        return None
    return int(total * share / 2)


def engine_connector(max_num_seqs: int, keepalive_s: float = 2.0) -> aiohttp.TCPConnector:
    """Connection pool towards vLLM's server (aiohttp: its pool hands out an idle connection in
    O(1); httpx/httpx2 re-scan every pooled connection, probing each socket, on each request and
    response, which cost the gateway a quarter of its CPU at 256 concurrent rollouts).

    No cap at 100 connections (aiohttp's default): vLLM queues requests itself, so let every
    rollout through. Idle connections are dropped after ``keepalive_s``, which must be shorter
    than the server's keep-alive: with equal timeouts a request can go out on a connection the
    server is closing, and fail (seen on the H200 at 256 concurrent requests). 2 s suits a
    server with vLLM's default (5 s); servers tracerl starts keep connections longer
    (:data:`SERVER_KEEP_ALIVE_S`).
    """
    return aiohttp.TCPConnector(limit=max(1024, 8 * max_num_seqs), limit_per_host=0,
                                keepalive_timeout=keepalive_s)


@dataclass(frozen=True)
class EngineReply:
    """A whole answer from the vLLM server."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self) -> Any:
        return loads(self.content)


@contextlib.contextmanager
def transport_errors() -> Iterator[None]:
    """Transport failures as the gateway's terms: too slow -> TimeoutError (504, as for the
    gateway's own deadline), unreachable -> EngineUnavailableError (503 and a restart check)."""
    try:
        yield
    except TimeoutError as e:  # before ClientError: aiohttp's ServerTimeoutError is both
        raise TimeoutError(f"the vLLM server did not answer in time: {e!r}") from e
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
        raise EngineUnavailableError(f"the vLLM server did not answer: {e!r}") from e


async def sse_events(stream: aiohttp.StreamReader) -> AsyncIterator[Any]:
    """The JSON payloads of a server-sent event stream, up to ``data: [DONE]``."""
    async for raw in stream:  # one line at a time
        line = raw.rstrip(b"\r\n")
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield loads(data)


class VLLMEngine(Engine):
    name = "vllm"

    def __init__(self, spec: EngineSpec, devices: tuple[int, ...] | None = None,
                 cpus: tuple[int, ...] | None = None) -> None:
        """``devices``: the GPUs this server may use (CUDA_VISIBLE_DEVICES; tensor parallel over
        them when several), for one replica of a replica set; None: whatever it sees. ``cpus``:
        the cores its CPU worker binds to (vLLM's CPU build; None: vLLM's own choice)."""
        super().__init__(spec)
        self.devices, self.cpus = devices, cpus
        self.process: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self.client: aiohttp.ClientSession | None = None
        self._adapters: dict[str, Path] = {}
        # lora name -> digest of the files handed to /v1/load_lora_adapter, once it said 200
        self._digests: dict[str, str] = {}
        self._ready = False  # healthy and every adapter re-loaded
        # the chat template's end of a turn, found once by the first start() (None: not yet)
        self._turn_end: list[int] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="tracerl-vllm-", suffix=".log", delete=False)
        sleep = spec.config.sleep_during_training
        self.sleeps = _cuda_visible() if sleep is None else sleep

    @classmethod
    def available(cls) -> bool:
        return vllm_python() is not None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        python = vllm_python()
        if python is None:
            raise EngineError("vLLM is not installed: install it or set TRACERL_VLLM_PYTHON to the "
                              "python of a venv that has it")
        cfg, lora = self.spec.config, self.spec.lora
        dtype = "bfloat16" if cfg.dtype == "auto" else cfg.dtype
        cmd = [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.spec.model_path), "--served-model-name", self.spec.served_name,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
            "--max-model-len", str(cfg.max_model_len), "--max-num-seqs", str(cfg.max_num_seqs),
            "--enable-lora", "--max-lora-rank", str(_lora_rank_slot(lora.r)),
            "--max-loras", str(max(2, cfg.resident_adapters + 1)),  # the next one loads first
            "--logprobs-mode", "processed_logprobs", "--disable-uvicorn-access-log",
        ]
        if self.sleeps:
            cmd += ["--enable-sleep-mode"]
        if self.devices is not None and len(self.devices) > 1:
            cmd += ["--tensor-parallel-size", str(len(self.devices))]
        share = cfg.gpu_memory_utilization
        if cfg.replicas_per_gpu > 1:  # several servers on one GPU split vLLM's share of it
            share = round((0.9 if share is None else share) / cfg.replicas_per_gpu, 3)
        if share is not None:
            cmd += ["--gpu-memory-utilization", str(share)]
        if cfg.replicas_per_gpu > 1 and not any(a.startswith("--kv-cache-memory")
                                                for a in cfg.extra_args):
            # servers sharing a GPU: each one's memory profiler counts the others' memory, so
            # a share alone can leave one without room; an explicit KV cache size cannot
            kv_bytes = _kv_cache_bytes(self.devices, share or 0.9 / cfg.replicas_per_gpu)
            if kv_bytes:
                cmd += ["--kv-cache-memory-bytes", str(kv_bytes)]
        if cfg.chat_template:
            cmd += ["--chat-template", str(chat_template_path(cfg.chat_template))]
        if cfg.tool_call_parser:
            cmd += ["--enable-auto-tool-choice", *tool_parser_flags(cfg.tool_call_parser)]
        return cmd + list(cfg.extra_args)

    def log_tail(self, n: int = 40) -> str:
        """The server log's last ``n`` lines, after its error lines: vLLM's worker prints the
        root cause, then the API server a long traceback that ends "See root cause above"."""
        try:
            lines = Path(self._log.name).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        causes = [line for line in lines[:-n] if " ERROR " in line or "Error: " in line][-8:]
        return "\n".join([*causes, *(["..."] if causes else []), *lines[-n:]])

    async def start(self) -> None:
        self._ready = False
        if self.sleeps and not _cuda_visible():
            raise EngineError("sleep_during_training needs vLLM on CUDA; vLLM's sleep mode does "
                              "not exist on CPU")
        self.port = free_port()
        env = {
            **os.environ,
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            "DO_NOT_TRACK": "1",
            "VLLM_CONFIGURE_LOGGING": "1",
        }
        if self.sleeps:
            env["VLLM_SERVER_DEV_MODE"] = "1"  # exposes /sleep and /wake_up (loopback only)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in self.devices)
        if self.cpus is not None and settings.VLLM_CPU_OMP_THREADS_BIND.get() is None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(str(c) for c in self.cpus)
        env.pop("PYTHONPATH", None)  # the vLLM venv brings its own packages
        env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(SERVER_KEEP_ALIVE_S))
        # dies with this process: a killed trainer must not leave a server holding the GPU
        self.process = start_child(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                   env=env)
        self.connect(POOL_KEEP_ALIVE_S)
        try:
            if self._turn_end is None:  # while the server loads; a restart knows it
                await asyncio.to_thread(self.find_turn_end)
            await self._wait_until_healthy(self.process)
        except BaseException:  # exited, timed out or cancelled (Ctrl-C): no server left
            await asyncio.shield(self.stop())
            raise
        await self._serve_known_adapters()

    def find_turn_end(self) -> None:
        """Find the chat template's end of an assistant turn (:func:`turn_end_ids`), which
        every chat request then stops at: vLLM stops at the configs' ``eos_token_id`` only, and
        a config naming another end token (``<|endoftext|>``) lets a turn run on past its end.
        A tokenizer that does not load leaves vLLM's own stopping (logged)."""
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(self.spec.model_path)
            apply_chat_template_override(tokenizer, self.spec.config.chat_template)
            self._turn_end = sorted(turn_end_ids(tokenizer))
        except Exception as e:  # vLLM may serve what transformers cannot load
            log.warning("no turn end to stop at for %s (vLLM stops at the configs' end token "
                        "only): %s", self.spec.model_path, e)
            self._turn_end = []

    def stopping_at_turn_end(self, body: dict[str, Any]) -> dict[str, Any]:
        """Chat request ``body`` with the turn end among its ``stop_token_ids`` (as it was with
        ``ignore_eos``, or no turn end known)."""
        if not self._turn_end or body.get("ignore_eos"):
            return body
        ids = list(body.get("stop_token_ids") or [])
        return {**body, "stop_token_ids": ids + [i for i in self._turn_end if i not in ids]}

    async def _wait_until_healthy(self, process: subprocess.Popen[bytes]) -> None:
        loop = asyncio.get_running_loop()
        timeout_s = startup_timeout_s()
        deadline = loop.time() + timeout_s
        while True:
            if process.poll() is not None:
                raise EngineError(
                    f"vLLM exited with code {process.returncode} while starting:\n"
                    f"{self.log_tail()}"
                )
            if await self.healthy():
                return
            if loop.time() > deadline:
                raise EngineError(f"vLLM did not become healthy within {timeout_s:.0f} s:\n"
                                  f"{self.log_tail()}")
            await asyncio.sleep(0.5)

    async def _serve_known_adapters(self) -> None:
        """Load again the adapters served before a (re)start, then take traffic."""
        for name, path in list(self._adapters.items()):
            await self.load_adapter(name, path)
        self._ready = True

    def connect(self, keepalive_s: float = 2.0) -> None:
        """Open the connection pool towards the server at :attr:`base_url`."""
        self.client = aiohttp.ClientSession(
            base_url=self.base_url,
            connector=engine_connector(self.spec.config.max_num_seqs, keepalive_s),
            timeout=aiohttp.ClientTimeout(total=None, connect=5,
                                          sock_read=self.spec.config.request_timeout_s))

    async def stop(self) -> None:
        self._ready = False
        if self.client is not None:
            await self.client.close()
            self.client = None
        proc, self.process = self.process, None
        if proc is not None:
            await asyncio.to_thread(stop_process_group, proc, 20)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    async def healthy(self) -> bool:
        if not self.alive() or self.client is None:
            return False
        try:
            async with self.client.get("/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def load_adapter(self, lora_name: str, path: Path) -> None:
        # once, before the load (None: the server reads a mount this process cannot)
        digest = await asyncio.to_thread(digest_if_readable, Path(path))
        body = {"lora_name": lora_name, "lora_path": str(path), "load_inplace": True}
        self._digests.pop(lora_name, None)  # unknown while vLLM loads it in place
        r = await self._post("/v1/load_lora_adapter", body)
        if r.status_code != 200:
            raise EngineError(f"vLLM refused adapter {lora_name!r} from {path}: {r.text}")
        self._adapters[lora_name] = Path(path)
        if digest is not None:
            self._digests[lora_name] = digest

    async def unload_adapter(self, lora_name: str) -> None:
        r = await self._post("/v1/unload_lora_adapter", {"lora_name": lora_name})
        if r.status_code != 200:
            raise EngineError(f"vLLM refused to unload adapter {lora_name!r}: {r.text}")
        self._adapters.pop(lora_name, None)
        self._digests.pop(lora_name, None)

    async def sleep(self) -> None:
        if self.sleeps:
            self._ready = False
            r = await self._post("/sleep?level=1", {})
            if r.status_code != 200:
                raise EngineError(f"vLLM refused to sleep: {r.text}")

    async def wake_up(self) -> None:
        if self.sleeps:
            r = await self._post("/wake_up", {})
            if r.status_code != 200:
                raise EngineError(f"vLLM did not wake up: {r.text}")
            self._ready = True

    async def _post(self, path: str, body: dict[str, Any]) -> EngineReply:
        if self.client is None or not self.alive():
            raise EngineUnavailableError("the vLLM server is not running")
        with transport_errors():
            async with self.client.post(path, json=body) as r:
                return EngineReply(r.status, await r.read())

    @staticmethod
    def _raise_for(r: EngineReply) -> None:
        if r.status_code < 400:
            return
        try:
            err = r.json().get("error", {})
            message = err.get("message") or r.text
        except (json.JSONDecodeError, AttributeError):
            err, message = {}, r.text
        if r.status_code >= 500:
            raise EngineUnavailableError(f"vLLM failed ({r.status_code}): {message}")
        raise EngineRequestError(message, status=r.status_code, param=err.get("param"),
                                 code=err.get("code"))

    def _check_ready(self) -> None:
        if not self._ready:
            raise EngineUnavailableError("the vLLM server is starting")

    def served_digest(self, model: str) -> str | None:
        """The digest of what serves ``model`` now: the base model's, or the adapter's loaded
        under that name (None while unknown: not loaded, or being loaded)."""
        return BASE if model == self.spec.served_name else self._digests.get(model)

    def _note(self, model: str, before: str | None) -> None:
        """Note the served digest on the call's route: the one at send time, if the adapter of
        that name was not reloaded while the call ran (then nobody can tell: None)."""
        after = self.served_digest(model)
        note_served(before if before == after else None)

    def prompt_ids_refusal(self, body: dict[str, Any]) -> str | None:
        """Given prompt ids go through ``/v1/completions`` (the chat endpoint takes none)."""
        return token_prompts.refusal(body, self.spec.config.tool_call_parser)

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check_ready()
        body = self.stopping_at_turn_end(body)
        before = self.served_digest(body.get("model", ""))
        if body.get(PROMPT_IDS) is not None:  # the gateway's exact turn: given, not rendered
            r = await self._post("/v1/completions", token_prompts.completion_request(
                body, self.spec.config.max_model_len))
            self._raise_for(r)
            self._note(body.get("model", ""), before)
            return token_prompts.chat_reply(body, r.json(), self.spec.config.tool_call_parser)
        r = await self._post("/v1/chat/completions", body)
        self._raise_for(r)
        self._note(body.get("model", ""), before)
        return r.json()

    async def completions(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check_ready()
        before = self.served_digest(body.get("model", ""))
        r = await self._post("/v1/completions", body)
        self._raise_for(r)
        self._note(body.get("model", ""), before)
        return r.json()

    async def chat_stream(self, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        self._check_ready()
        if self.client is None:
            raise EngineUnavailableError("the vLLM server is not running")
        before = self.served_digest(body.get("model", ""))
        body = self.stopping_at_turn_end(body)
        path, request, chunks = "/v1/chat/completions", body, None
        if body.get(PROMPT_IDS) is not None:  # the gateway's exact turn: given, not rendered
            path, chunks = "/v1/completions", token_prompts.ChatChunks(
                body, self.spec.config.tool_call_parser)
            request = token_prompts.completion_request(body, self.spec.config.max_model_len)
        with transport_errors():
            async with self.client.post(path, json=request) as r:
                if r.status >= 400:
                    self._raise_for(EngineReply(r.status, await r.read()))
                if chunks is not None:
                    yield chunks.first()
                async for chunk in sse_events(r.content):
                    self._note(body.get("model", ""), before)  # before the caller sees it end
                    yield chunk if chunks is None else chunks.chunk(chunk)


@hookimpl
def tracerl_engines() -> list[type]:
    return [VLLMEngine]
