"""``tracerl report --serve MODEL_DIR``: a local trajectory viewer that follows a run as it trains.

Standard library only (``http.server``); binds 127.0.0.1 by default. The page polls a JSON API
and redraws, so a run in progress shows up step by step:

- ``GET /api/history``: every ``history.jsonl`` entry (reward, loss and step-health curves);
- ``GET /api/steps``: the saved trajectory files per split;
- ``GET /api/step/SPLIT/N``: the step's groups, their rewards and advantages;
- ``GET /api/trajectory/SPLIT/N/G/I``: one trajectory: its span tree and each call's messages
  and completion tokens (engine logprob per token, the trajectory's advantage);
- ``GET /api/doctor``: ``tracerl doctor``'s findings on the run's folder.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import asdict
from functools import lru_cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .core.errors import ConfigError
from .core.net import is_loopback
from .core.storage import read_jsonl
from .core.trajectory import read_groups_jsonl

log = logging.getLogger(__name__)
PAGE = Path(__file__).with_name("viewer.html")


class RunView:
    """Reads a run's folder for the API (every request reads the files again: a run grows)."""

    def __init__(self, model_dir: Path) -> None:
        self.root = Path(model_dir)
        if not (self.root / "history.jsonl").exists():
            raise ConfigError(f"{model_dir} is not a model folder (no history.jsonl)")

    def history(self) -> list[dict[str, Any]]:
        return read_jsonl(self.root / "history.jsonl")

    def steps(self) -> dict[str, list[int]]:
        base = self.root / "trajectories"
        return {d.name: sorted(int(p.stem) for p in d.glob("*.jsonl"))
                for d in sorted(base.glob("*")) if d.is_dir()} if base.exists() else {}

    def _groups(self, split: str, step: int) -> list[Any]:
        if not re.fullmatch(r"[a-z0-9_-]+", split):
            raise KeyError(split)
        path = self.root / "trajectories" / split / f"{step:04d}.jsonl"
        if not path.exists():
            raise KeyError(f"{split}/{step}")
        return read_groups_jsonl(path)

    def step(self, split: str, step: int) -> dict[str, Any]:
        from .backend.training.advantages import group_advantages

        groups = []
        for g in self._groups(split, step):
            rewards = [t.reward for t in g.trajectories]
            adv = group_advantages(rewards, True) if len(rewards) > 1 else None
            groups.append({
                "rewards": rewards,
                "advantages": adv.advantages if adv else [0.0] * len(rewards),
                "skipped": adv is None or adv.skipped,
                "exceptions": [e.message for e in g.exceptions],
                "trajectories": [{"reward": t.reward, "rollout_id": t.rollout_id,
                                  "calls": len(t.llm_calls), "metrics": t.metrics}
                                 for t in g.trajectories],
            })
        return {"split": split, "step": step, "groups": groups}

    def trajectory(self, split: str, step: int, group: int, index: int) -> dict[str, Any]:
        data = self.step(split, step)["groups"][group]
        t = self._groups(split, step)[group].trajectories[index]
        decode = self._decoder()
        trainer = iter(self._trainer_logprobs(split, step, group, index))
        calls = []
        for c in t.llm_calls:
            comp = c.completions[0] if c.completions else None
            tokens = []
            if comp is not None:
                lps = comp.logprobs or [None] * len(comp.token_ids)
                trained = not c.error and c.prompt_token_ids  # rows skip failed calls
                tokens = [{"id": i, "text": decode(i), "logprob": lp,
                           "trainer_logprob": next(trainer, None) if trained else None}
                          for i, lp in zip(comp.token_ids, lps, strict=True)]
            calls.append({"id": c.id, "messages": c.request.get("messages")
                          or [{"role": "prompt", "content": c.request.get("prompt")}],
                          "tokens": tokens, "finish_reason": comp.finish_reason if comp else None,
                          "adapter_step": c.adapter_step, "latency_s": c.latency_s,
                          "error": c.error})
        return {"reward": t.reward, "advantage": data["advantages"][index],
                "rollout_id": t.rollout_id, "metrics": t.metrics, "messages": t.messages(),
                "spans": [s.model_dump(mode="json") for s in t.spans], "calls": calls}

    def _trainer_logprobs(self, split: str, step: int, group: int, index: int) -> list[float]:
        """The trainer's logprobs of this trajectory's trained tokens, in call order (written
        by the training step; none for val steps or skipped groups)."""
        from .backend.training.health import token_logprobs_path

        path = token_logprobs_path(self.root, step)
        if split != "train" or not path.exists():
            return []
        return [lp for r in read_jsonl(path) if r["group"] == group and r["trajectory"] == index
                for lp in r["trainer"]]

    def _decoder(self) -> Any:
        """Token id -> text with the base model's tokenizer when it can be loaded, else ``#id``."""
        try:
            base = json.loads((self.root / "model.json").read_text()).get("base_model")
        except (OSError, ValueError):
            base = None
        tokenizer = _tokenizer(base) if base else None
        if tokenizer is None:
            return lambda i: f"#{i}"
        return lambda i: tokenizer.decode([i])

    def doctor(self) -> list[dict[str, Any]]:
        from .doctor import run_checks

        return [asdict(f) for f in run_checks(self.root)]


@lru_cache(maxsize=4)
def _tokenizer(base_model: str) -> Any:
    try:
        from transformers import AutoTokenizer

        from .backend.weights import resolve_base_model

        return AutoTokenizer.from_pretrained(resolve_base_model(base_model))
    except Exception as e:  # the viewer works without it: tokens shown as ids
        log.info("no tokenizer for %s (%s): tokens shown as ids", base_model, e)
        return None


ROUTES: list[tuple[re.Pattern[str], Callable[..., object]]] = [
    (re.compile(r"/api/history"), lambda v: v.history()),
    (re.compile(r"/api/steps"), lambda v: v.steps()),
    (re.compile(r"/api/doctor"), lambda v: v.doctor()),
    (re.compile(r"/api/step/([a-z0-9_-]+)/(\d+)"), lambda v, s, n: v.step(s, int(n))),
    (re.compile(r"/api/trajectory/([a-z0-9_-]+)/(\d+)/(\d+)/(\d+)"),
     lambda v, s, n, g, i: v.trajectory(s, int(n), int(g), int(i))),
]


def make_handler(view: RunView) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            log.debug("viewer: " + format, *args)

        def _send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._send(200, PAGE.read_bytes(), "text/html; charset=utf-8")
                return
            for pattern, fn in ROUTES:
                m = pattern.fullmatch(path)
                if m:
                    try:
                        body = json.dumps(fn(view, *m.groups()), allow_nan=False,
                                          default=str).encode()
                    except (KeyError, IndexError) as e:
                        self._send(404, json.dumps({"error": f"not found: {e}"}).encode(),
                                   "application/json")
                        return
                    except ValueError:  # NaN in a metric: JSON has no NaN
                        body = json.dumps(_finite(fn(view, *m.groups()))).encode()
                    self._send(200, body, "application/json")
                    return
            self._send(404, json.dumps({"error": f"no such page: {path}"}).encode(),
                       "application/json")

    return Handler


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


class Viewer:
    """The viewer's HTTP server on a thread (``with Viewer(dir) as v: v.url``)."""

    def __init__(self, model_dir: str | Path, host: str = "127.0.0.1", port: int = 0) -> None:
        if not is_loopback(host):
            log.warning("the viewer listens on %s: anyone who can reach it can read the run's "
                        "trajectories", host)
        self.view = RunView(Path(model_dir))
        self.server = ThreadingHTTPServer((host, port), make_handler(self.view))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="tracerl-viewer",
                                       daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}/"  # a str host (!s: typeshed allows bytes too)

    def __enter__(self) -> Viewer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def serve_report(model_dir: str | Path, host: str = "127.0.0.1", port: int = 8765) -> int:
    """Serve until Ctrl-C (``tracerl report --serve``)."""
    with Viewer(model_dir, host, port) as viewer:
        print(f"tracerl viewer: {viewer.url} (Ctrl-C stops)", flush=True)
        try:
            viewer.thread.join()
        except KeyboardInterrupt:
            pass
    return 0
