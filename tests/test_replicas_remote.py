"""``tracerl serve`` fronting a replica set (its operator's ``--replica-url`` servers), used by an
unchanged ``RemoteBackend`` client: every call is routed to a replica and its record names it;
a client cannot point the server at servers of its own choosing."""

from __future__ import annotations

import pytest

import tracerl

from .remote_server import API_KEY, ServerProcess
from .test_replicas_routing import ServerProcess as ReplicaProcess


@pytest.fixture(scope="module")
def fronted(tmp_path_factory):
    replicas = [ReplicaProcess(f"r{i}") for i in range(2)]
    args = [a for r in replicas for a in ("--replica-url", r.url)]
    server = ServerProcess(tmp_path_factory.mktemp("remote-replicas"), args=tuple(args)).start()
    yield server, replicas
    server.stop()
    for r in replicas:
        r.stop()


async def test_a_remote_client_is_served_by_the_servers_replica_set(fronted):
    server, replicas = fronted
    backend = tracerl.RemoteBackend(server.url, api_key=API_KEY)
    model = tracerl.TrainableModel(
        name="remote-replicas", project="tests", base_model="smollm2",
        config=tracerl.ModelConfig(engine=tracerl.EngineConfig(
            replica_urls=["http://127.0.0.1:9"])))  # the client's choice is not the server's
    try:
        await model.register(backend)
        client = model.openai_client()
        for i in range(4):
            with tracerl.rollout_scope(f"rr-{i}"):
                for _ in range(2):
                    r = await client.chat.completions.create(
                        model=model.name, messages=[{"role": "user", "content": "hi"}],
                        max_tokens=2)
                    assert r.system_fingerprint in {"r0", "r1"}
        replica_of = {}
        for i in range(4):
            calls = await model.fetch_calls(f"rr-{i}")
            assert len(calls) == 2 and calls[0].completions[0].token_ids == [7, 8]
            (replica_of[i],) = {c.metadata["replica"] for c in calls}  # sticky per rollout
        assert set(replica_of.values()) == {"r0", "r1"}
        assert sum(r.state()["calls"] for r in replicas) == 8
    finally:
        await backend.close()
