"""The replica set's routing, fan-out, failover and elasticity, against real server processes.

Each replica is a small real OpenAI-compatible HTTP server process (tests/replica_server.py):
the router is what is under test, so its replicas only need to answer, hold a call on demand,
and die for real (SIGKILL). vLLM replicas behind the gateway: test_replicas_vllm.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

import tracerl
from tracerl.backend.engines.replica_set import (
    ReplicaSet,
    build_engine,
    replica_cpus,
    replica_devices,
)
from tracerl.backend.engines.url_engine import URLEngine
from tracerl.backend.publishing import AdapterPublisher
from tracerl.core.config import EngineConfig, LoraConfig
from tracerl.core.engine import CallRoute, EngineSpec, EngineUnavailableError, current_route
from tracerl.core.errors import ConfigError

from .conftest import until

SERVER = Path(__file__).with_name("replica_server.py")
MSGS = [{"role": "user", "content": "hi"}]


class ServerProcess:
    """One replica server process (a fresh one on the same port after a kill)."""

    def __init__(self, name: str, port: int = 0) -> None:
        self.name = name
        self.proc = subprocess.Popen([sys.executable, str(SERVER), name, str(port)],
                                     stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())
        self.url = f"http://127.0.0.1:{self.port}"

    def _request(self, path: str, data: bytes | None = None) -> dict:
        with urllib.request.urlopen(urllib.request.Request(self.url + path, data=data),
                                    timeout=10) as r:
            return json.loads(r.read() or b"{}")

    def state(self) -> dict:
        return self._request("/_state")

    def release(self) -> None:
        self._request("/_release", b"{}")

    def rearm(self) -> None:
        self._request("/_rearm", b"{}")

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def servers():
    procs = [ServerProcess(f"r{i}") for i in range(3)]
    yield procs
    for p in procs:
        p.stop()


def spec_for(urls: list[str], **config) -> EngineSpec:
    return EngineSpec(model_path=Path("."), served_name="base",
                      config=EngineConfig(replica_urls=urls, **config), lora=LoraConfig())


async def replica_set(procs: list[ServerProcess], **config) -> ReplicaSet:
    rs = build_engine(None, spec_for([p.url for p in procs], **config))
    assert isinstance(rs, ReplicaSet)
    await rs.start()
    return rs


async def chat(rs: ReplicaSet, rollout: str | None, model: str = "base", **extra
               ) -> tuple[str | None, dict]:
    """One call in its own routing context: (the replica it was routed to, the answer)."""
    route = CallRoute(rollout)
    current_route.set(route)
    response = await rs.chat({"model": model, "messages": MSGS, **extra})
    return route.replica, response


async def test_calls_of_one_rollout_stay_on_one_replica_and_rollouts_spread(servers):
    rs = await replica_set(servers)
    try:
        routed: dict[str, set[str]] = {}
        for _turn in range(3):
            for rollout in ("a", "b", "c", "d", "e", "f"):
                replica, response = await chat(rs, rollout)
                assert response["system_fingerprint"] == replica  # the recorded one answered
                routed.setdefault(rollout, set()).add(replica)
        assert all(len(r) == 1 for r in routed.values()), routed
        assert set().union(*routed.values()) == {"r0", "r1", "r2"}
    finally:
        await rs.stop()


async def test_a_new_rollout_goes_to_the_replica_with_fewest_calls_in_flight(servers):
    rs = await replica_set(servers)
    for p in servers:
        p.rearm()
    try:
        busy = [asyncio.create_task(chat(rs, "busy", x_hold=True)) for _ in range(2)]
        loaded = {p.name: p for p in servers}
        await until(lambda: sum(p.state()["held"] for p in servers) == 2, "2 held calls")
        hot = next(name for name, p in loaded.items() if p.state()["held"] == 2)  # sticky
        first = [asyncio.create_task(chat(rs, f"new{i}", x_hold=True)) for i in range(2)]
        await until(lambda: sum(p.state()["held"] for p in servers) == 4, "4 held calls")
        assert loaded[hot].state()["held"] == 2  # both idle replicas took one new rollout each
        late = asyncio.create_task(chat(rs, "late", x_hold=True))
        await until(lambda: sum(p.state()["held"] for p in servers) == 5, "5 held calls")
        assert loaded[hot].state()["held"] == 2  # 1 in flight beats 2 in flight
        for p in servers:
            p.release()
        results = await asyncio.gather(*busy, *first, late)
        assert {r for r, _ in results[:2]} == {hot}
        assert hot not in {r for r, _ in results[2:]}
        assert len({r for r, _ in results[2:4]}) == 2
    finally:
        await rs.stop()


async def test_adapters_are_loaded_on_and_unloaded_from_every_replica(servers):
    rs = await replica_set(servers)
    try:
        await rs.load_adapter("m@1", Path("/adapters/1"))
        await rs.load_adapter("m@2", Path("/adapters/2"))
        assert [p.state()["adapters"] for p in servers] == [["m@1", "m@2"]] * 3
        await rs.unload_adapter("m@1")
        assert [p.state()["adapters"] for p in servers] == [["m@2"]] * 3
        for rollout in ("x", "y", "z"):
            _, response = await chat(rs, rollout, model="m@2")
            assert response["choices"][0]["message"]["content"].endswith(":m@2")
    finally:
        await rs.unload_adapter("m@2")
        await rs.stop()


async def test_a_call_on_a_killed_replica_is_retried_elsewhere_and_the_replica_rejoins():
    a, b = ServerProcess("r0"), ServerProcess("r1")
    rs = await replica_set([a, b])
    try:
        await rs.load_adapter("m@1", Path("/adapters/1"))
        b.release()  # the retried call must not be held on the survivor
        call = asyncio.create_task(chat(rs, "k", x_hold=True))
        await until(lambda: a.state()["held"] == 1, "the call held on r0")
        a.kill()
        replica, response = await call
        assert (replica, response["system_fingerprint"]) == ("r1", "r1")
        assert [r["state"] for r in rs.status()] == ["down", "up"]
        assert (await chat(rs, "k"))[0] == "r1"  # the rollout moved with its retry
        a = ServerProcess("r0", a.port)  # the replica comes back (its supervisor restarted it)
        await until(lambda: rs.status()[0]["state"] == "up", "r0 rejoining", timeout_s=30)
        assert a.state()["adapters"] == ["m@1"]  # loaded before it took traffic
        assert (await chat(rs, "fresh"))[0] == "r0"  # least loaded, then idle longest
    finally:
        await rs.stop()
        a.stop()
        b.stop()


async def test_a_stream_cut_by_a_dead_replica_fails_naming_the_replica():
    a = ServerProcess("r0")
    rs = await replica_set([a], replica_failure="drop")
    try:
        current_route.set(CallRoute("s"))
        stream = rs.chat_stream({"model": "base", "messages": MSGS, "stream": True,
                                 "x_hold": True})
        first = await anext(stream)
        assert first["choices"][0]["token_ids"] == [7]
        a.kill()
        with pytest.raises(EngineUnavailableError, match="replica r0 failed after the stream"):
            await anext(stream)
        await until(lambda: not rs.replicas, "the dead replica dropped")
        with pytest.raises(EngineUnavailableError, match="no replica can take the call"):
            await chat(rs, "t")
    finally:
        await rs.stop()
        a.stop()


async def test_a_joining_replica_loads_the_adapters_first_and_a_leaving_one_drains():
    a, b = ServerProcess("r0"), ServerProcess("r1")
    rs = await replica_set([a])
    try:
        await rs.load_adapter("m@3", Path("/adapters/3"))
        a.rearm()
        held = asyncio.create_task(chat(rs, "on-r0", x_hold=True))
        await until(lambda: a.state()["held"] == 1, "a call held on r0")
        name = await rs.add_replica(URLEngine(rs.spec, b.url))
        assert name == "r1" and b.state()["adapters"] == ["m@3"]
        b.rearm()
        joined = asyncio.create_task(chat(rs, "new", model="m@3", x_hold=True))
        await until(lambda: b.state()["held"] == 1, "the new rollout on the joined replica")
        leaving = asyncio.create_task(rs.remove_replica("r1"))
        await until(lambda: rs.status()[1]["state"] == "leaving", "r1 leaving")
        assert (await asyncio.gather(asyncio.sleep(0), chat(rs, "after", x_hold=False)))[1][0] \
            == "r0"  # no new traffic for a leaving replica
        assert not leaving.done()  # it waits for its call in flight
        b.release()
        assert (await joined)[0] == "r1"
        await leaving
        assert [r["name"] for r in rs.status()] == ["r0"]
        a.release()
        await held
    finally:
        await rs.stop()
        a.stop()
        b.stop()


@pytest.fixture(scope="module")
async def versioned(servers, tmp_path_factory):
    """The gateway of a LocalBackend routing a model over the three replica servers, with two
    policy versions resident."""
    backend = tracerl.LocalBackend(path=tmp_path_factory.mktemp("replicas-gw"))
    model = tracerl.TrainableModel(
        name="vgw", project="tests", base_model="smollm2", config=tracerl.ModelConfig(
            engine=tracerl.EngineConfig(replica_urls=[p.url for p in servers],
                                        resident_adapters=2)))
    await model.register(backend)
    yield backend, model
    await backend.close()


async def gateway_call(model, rollout: str, name: str = "vgw") -> dict:
    with tracerl.rollout_scope(rollout):
        r = await model.openai_client().chat.completions.create(
            model=name, messages=MSGS, max_tokens=2)
    return r.model_dump()


async def test_gateway_records_name_the_replica_and_the_policy_version(versioned, servers):
    backend, model = versioned
    for p in servers:
        p.release()
    route = backend.gateway.models["vgw"]
    for step in (1, 2):
        await backend.call_on_gateway(route.swap_adapter(step, Path(f"/adapters/{step}")))
    assert [p.state()["adapters"] for p in servers] == [["vgw@1", "vgw@2"]] * 3
    for rollout in ("g1", "g2", "g3", "g4"):
        for _ in range(2):
            answer = await gateway_call(model, rollout)
            assert answer["system_fingerprint"]  # the replica that answered
    for rollout in ("g1", "g2", "g3", "g4"):
        calls = await model.fetch_calls(rollout)
        assert len(calls) == 2 and len({c.metadata["replica"] for c in calls}) == 1
        assert [c.adapter_step for c in calls] == [2, 2]


async def test_a_rollout_finishes_on_its_version_while_it_stays_resident(versioned, servers):
    backend, model = versioned
    route = backend.gateway.models["vgw"]
    await gateway_call(model, "pinned")  # first call: the newest version, 2
    await backend.call_on_gateway(route.swap_adapter(3, Path("/adapters/3")))
    await gateway_call(model, "pinned")  # still 2: resident beside 3
    await gateway_call(model, "newer")
    await backend.call_on_gateway(route.swap_adapter(4, Path("/adapters/4")))
    assert [p.state()["adapters"] for p in servers] == [["vgw@3", "vgw@4"]] * 3  # 2 unloaded
    await gateway_call(model, "pinned")  # 2 is gone: the rollout moves to the newest
    assert [c.adapter_step for c in await model.fetch_calls("pinned")] == [2, 2, 4]
    assert [c.adapter_step for c in await model.fetch_calls("newer")] == [3]
    with pytest.raises(Exception, match="nor resident"):
        await gateway_call(model, "old", name="vgw@2")


def test_published_versions_appear_whole_and_old_ones_are_retired(tmp_path):
    adapter = tmp_path / "ckpt"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    local = AdapterPublisher(str(tmp_path / "shm"))
    for step in (1, 2, 3):
        served = local.publish("m", step, adapter)
        assert served == tmp_path / "shm" / "m" / f"policy@{step}"
        assert (served / "adapter_model.safetensors").read_bytes() == b"weights"
    assert local.retire("m", {2, 3}) == [1]
    assert local.published("m") == [2, 3]
    remote = AdapterPublisher("memory://bucket/adapters", served_root="/mnt/adapters")
    assert remote.publish("m", 5, adapter) == Path("/mnt/adapters/m/policy@5")
    assert remote.published("m") == [5]
    with pytest.raises(ConfigError, match="served_root"):
        AdapterPublisher("s3://bucket/adapters")


def test_replicas_are_placed_per_gpu_and_tensor_parallel_groups():
    assert replica_devices(EngineConfig(), 0) == [None]
    assert replica_devices(EngineConfig(replicas=2), 0) == [None, None]
    assert replica_devices(EngineConfig(), 4) == [None]  # as before: one server
    assert replica_devices(EngineConfig(replicas=4), 4) == [(0,), (1,), (2,), (3,)]
    assert replica_devices(EngineConfig(replicas_per_gpu=2), 2) == [(0,), (0,), (1,), (1,)]
    assert replica_devices(EngineConfig(gpus_per_replica=2), 4) == [(0, 1), (2, 3)]
    cores = sorted(os.sched_getaffinity(0))
    assert replica_cpus(1) == [tuple(cores)]
    assert replica_cpus(len(cores) + 1) == [None] * (len(cores) + 1)
    with pytest.raises(ConfigError, match="gpus_per_replica=4"):
        replica_devices(EngineConfig(gpus_per_replica=4), 2)
    with pytest.raises(ValueError, match="publish_mount"):
        EngineConfig(publish_dir="s3://bucket/adapters")
    with pytest.raises(ValueError, match="replica_urls"):
        EngineConfig(replica_urls=["127.0.0.1:8000"])
