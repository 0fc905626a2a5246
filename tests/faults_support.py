"""Helpers of the faults stage: a model on a real ``tracerl serve``, driven over plain HTTP with
request ids the test chooses (so it can send the same request again after a crash)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx2

import tracerl
from tracerl.core.model_spec import spec_of
from tracerl.remote.wire import API_PREFIX, NDJSON, encode_groups

from .remote_server import API_KEY


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"

AUTH = {"authorization": f"Bearer {API_KEY}"}
CONFIG = tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256))


def tiny_groups(i: int, text: str = "1 2 3") -> list[tracerl.TrajectoryGroup]:
    """One group of two short rendered trajectories with different rewards."""
    return [tracerl.TrajectoryGroup(
        tracerl.Trajectory(messages_and_choices=[
            {"role": "user", "content": f"Count to {i}."},
            {"role": "assistant", "content": f"{text} {r}"}], reward=float(r))
        for r in (0, 1))]


class Control:
    """One model of a server's control API, over HTTP."""

    def __init__(self, url: str, project: str, name: str) -> None:
        self.url, self.project, self.name = url, project, name
        self.path = f"{API_PREFIX}/models/{project}/{name}"

    def _client(self, timeout: float = 120) -> httpx2.Client:
        return httpx2.Client(base_url=self.url, headers=AUTH, timeout=timeout)

    def register(self) -> dict[str, Any]:
        model = tracerl.TrainableModel(name=self.name, project=self.project,
                                       base_model="smollm2", config=CONFIG)
        with self._client() as c:
            r = c.post(f"{API_PREFIX}/models", json=spec_of(model).definition())
            r.raise_for_status()
            return r.json()

    def train(self, request_id: str, groups: list[tracerl.TrajectoryGroup],
              timeout: float = 180) -> dict[str, Any]:
        """The last event of the training request's stream (done or error)."""
        body = encode_groups({"request_id": request_id, "config": {"learning_rate": 1e-4}},
                             groups)
        last: dict[str, Any] = {}
        with self._client(timeout) as c, c.stream(
                "POST", self.path + "/train", content=body,
                headers={"content-type": NDJSON}) as r:
            if r.status_code != 200:
                r.read()
                return {"event": "http_error", "status": r.status_code, **r.json()}
            for line in r.iter_lines():
                if line.strip():
                    last = json.loads(line)
        return last

    def get(self, what: str = "") -> Any:
        with self._client() as c:
            r = c.get(self.path + what)
            r.raise_for_status()
            return r.json()

    def post(self, what: str, body: dict[str, Any]) -> httpx2.Response:
        with self._client() as c:
            return c.post(self.path + what, json=body)

    def log(self, request_id: str, step: int, metrics: dict[str, float]) -> httpx2.Response:
        body = encode_groups({"request_id": request_id, "split": "val", "step": step,
                              "metrics": metrics}, tiny_groups(step))
        with self._client() as c:
            return c.post(self.path + "/log", content=body, headers={"content-type": NDJSON})
