"""Faults against a real ``tracerl serve`` process: clients that hang up at random points of a
streamed call (real sockets), one model name in two projects, floods of slow clients, and access
without the key."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import struct
from collections import Counter
from typing import Any

import httpx2
import pytest

import tracerl
from tests.conftest import until
from tests.remote_server import API_KEY, registered_on
from tracerl.core.storage import ModelStore, read_jsonl
from tracerl.rollout.client import async_client

CONFIG = tracerl.ModelConfig(engine=tracerl.EngineConfig(max_model_len=256))
AUTH = {"authorization": f"Bearer {API_KEY}"}
HANG_UPS = 120
HANG_POINTS = ("mid-body", "after-request", "after-head", "mid-stream", "after-last-chunk")
# a call hung up right after its request may be dropped before its body is read (nothing ran);
# one that got its response head has run and must be recorded
ANSWERED = ("after-head", "mid-stream", "after-last-chunk")


def raw_post(path: str, body: bytes, *, key: str | None = API_KEY,
             content_length: int | None = None) -> bytes:
    """An HTTP/1.1 POST as bytes, for clients that misbehave on a real socket."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    length = len(body) if content_length is None else content_length
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode() + body


def abort(writer: asyncio.StreamWriter, reset: bool) -> None:
    """Close a client socket: politely (FIN) or with a reset (RST, SO_LINGER 0)."""
    sock = writer.get_extra_info("socket")
    if reset and sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort() if reset else writer.close()


def calls_on_disk(store: ModelStore, rollout_id: str) -> list[dict]:
    return read_jsonl(store.calls_path(rollout_id))


@pytest.fixture(scope="module")
async def faults_model(faults_server):
    model = await registered_on(faults_server.url, "faults", "fa", CONFIG)
    yield model
    await model.backend.close()


async def _rollout(model: tracerl.Model, i: int) -> tracerl.Trajectory:
    messages = [{"role": "user", "content": f"Say {i}."}]
    r = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(), messages=messages, max_tokens=4, temperature=1.0)
    return tracerl.Trajectory(messages_and_choices=[*messages, r.choices[0]], reward=float(i))


async def served_adapter_step(model: tracerl.Model, stream: bool = False,
                              client: Any = None) -> int:
    """The adapter step the gateway serves ``model`` with, read from a fresh call's record."""
    with tracerl.rollout_scope() as ro:
        r = await (client or model.openai_client()).chat.completions.create(
            model=model.get_inference_name(), messages=[{"role": "user", "content": "hi"}],
            max_tokens=2, stream=stream)
        if stream:
            async for _ in r:
                pass
    (call,) = await model.fetch_calls(ro.rollout_id)
    return call.adapter_step


# --- streams: hang-ups at random points ---------------------------------------------------------

async def _hang_up(port: int, rollout_id: str, point: str, rng: random.Random) -> None:
    body = json.dumps({"model": "faults", "stream": True, "max_tokens": 8, "temperature": 1.0,
                       "messages": [{"role": "user", "content": f"Count from {rollout_id}."}]})
    raw = raw_post(f"/rollouts/{rollout_id}/v1/chat/completions", body.encode())
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if point == "mid-body":
            writer.write(raw[:len(raw) - rng.randint(1, len(body))])
            await writer.drain()
            return
        writer.write(raw)
        await writer.drain()
        if point == "after-request":
            return
        await reader.readuntil(b"\r\n\r\n")
        if point == "mid-stream":
            try:
                await reader.readexactly(rng.randint(1, 1500))
            except asyncio.IncompleteReadError:
                pass
        elif point == "after-last-chunk":
            await reader.readuntil(b"data: [DONE]")
    finally:
        abort(writer, reset=rng.random() < 0.5)


@pytest.fixture(scope="module")
async def hung_up(faults_server, faults_model):
    """120 streamed calls hung up at random points (24 per point, half with a TCP reset), 30 at
    a time; then a training step, which must finish."""
    rng = random.Random(18)
    plan = [(f"hang-{i}", HANG_POINTS[i % len(HANG_POINTS)]) for i in range(HANG_UPS)]
    rng.shuffle(plan)
    gate = asyncio.Semaphore(30)

    async def one(rid: str, point: str) -> None:
        async with gate:
            await _hang_up(faults_server.port, rid, point, random.Random(rid))

    await asyncio.wait_for(asyncio.gather(*(one(rid, p) for rid, p in plan)), 180)
    store = ModelStore(faults_server.path / "data", "fa", "faults")
    answered = [rid for rid, point in plan if point in ANSWERED]
    missing = lambda: [(r, p) for r, p in plan if p in ANSWERED and not calls_on_disk(store, r)]  # noqa: E731
    try:
        await until(lambda: all(calls_on_disk(store, rid) for rid in answered),
                    "a record of every hung-up call that got a response head", 60)
    except AssertionError as e:
        raise AssertionError(f"{e}; missing: {missing()}") from None
    groups = [tracerl.TrajectoryGroup([await _rollout(faults_model, i) for i in range(2)])]
    step_before = await faults_model.get_step()
    await asyncio.wait_for(faults_model.train(groups, config=tracerl.TrainConfig(
        learning_rate=1e-3)), 240)
    return plan, store, step_before


async def test_a_step_after_120_hang_ups_finishes_and_calls_go_on(hung_up, faults_model):
    plan, _, step_before = hung_up
    assert Counter(p for _, p in plan) == {p: HANG_UPS // len(HANG_POINTS) for p in HANG_POINTS}
    assert await faults_model.get_step() == step_before + 1
    assert await served_adapter_step(faults_model, stream=True) == step_before + 1
    assert await served_adapter_step(faults_model) == step_before + 1


async def test_a_call_hung_up_before_its_body_arrived_writes_nothing(hung_up):
    plan, store, _ = hung_up
    assert all(not calls_on_disk(store, rid) for rid, p in plan if p == "mid-body")


async def test_each_hung_up_call_is_recorded_once_whole_or_marked_disconnected(hung_up):
    plan, store, _ = hung_up
    outcomes = Counter()
    for rid, point in plan:
        if point == "mid-body":
            continue
        calls = calls_on_disk(store, rid)
        if point == "after-request" and not calls:
            outcomes["dropped before its body was read"] += 1
            continue
        (call,) = calls
        assert call["streamed"] and call["prompt_token_ids"], (rid, point)
        if call["error"] is None:
            (completion,) = call["completions"]
            assert completion["token_ids"] and completion["finish_reason"], (rid, point)
            assert len(completion["logprobs"]) == len(completion["token_ids"])
            outcomes["whole"] += 1
        else:
            assert call["metadata"]["disconnected"] is True, (rid, point, call["error"])
            assert "client disconnected" in call["error"]
            outcomes["disconnected"] += 1
    assert sum(outcomes.values()) == HANG_UPS * 4 // 5


# --- identity: one name, two projects -------------------------------------------------------------

@pytest.fixture(scope="module")
async def twins(faults_server):
    """Model `twin` registered in projects pa and pb of one server; pa trained one step."""
    backend = tracerl.RemoteBackend(faults_server.url, api_key=API_KEY)
    pa, pb = (tracerl.TrainableModel(name="twin", project=p, base_model="smollm2", config=CONFIG)
              for p in ("pa", "pb"))
    await pa.register(backend)
    await pb.register(backend)
    await pa.register(backend)  # registration is idempotent and names pa's route anew
    ids = {}
    for m in (pa, pb):
        with tracerl.rollout_scope(rollout_id="same-rollout"):
            r = await m.openai_client().chat.completions.create(
                model=m.get_inference_name(), messages=[{"role": "user", "content": m.project}],
                max_tokens=2)
        ids[m.project] = r.id
    await asyncio.wait_for(pa.train([tracerl.TrajectoryGroup(
        [await _rollout(pa, i) for i in range(2)])]), 240)
    yield pa, pb, ids
    await backend.close()


async def test_the_same_name_in_two_projects_gets_two_routes(twins):
    pa, pb, _ = twins
    assert (pa.inference_model_name, pb.inference_model_name) == ("pa/twin", "pb/twin")


async def test_a_bare_shared_name_is_refused_naming_both_projects(twins, faults_server):
    async with httpx2.AsyncClient(base_url=faults_server.url, headers=AUTH, timeout=30) as http:
        r = await http.post("/v1/chat/completions", json={
            "model": "twin", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
    assert r.status_code == 404
    assert "pa/twin" in r.json()["error"]["message"] and "pb/twin" in r.json()["error"]["message"]


async def test_each_project_records_its_own_calls_under_one_rollout_id(twins, faults_server):
    pa, pb, ids = twins
    for m in (pa, pb):
        (call,) = await m.fetch_calls("same-rollout")
        assert call.request["messages"][0]["content"] == m.project
        assert call.response["id"] == ids[m.project]
        on_disk = calls_on_disk(ModelStore(faults_server.path / "data", m.project, "twin"),
                                "same-rollout")
        assert [c["response"]["id"] for c in on_disk] == [ids[m.project]]


async def test_training_one_project_does_not_change_the_others_adapter(twins):
    pa, pb, _ = twins
    assert (await pa.get_step(), await pb.get_step()) == (1, 0)
    assert (await served_adapter_step(pa), await served_adapter_step(pb)) == (1, 0)


async def test_unattributed_calls_do_not_land_in_a_rollout_named_unattributed(faults_server,
                                                                                faults_model):
    client = faults_model.openai_client()
    msgs = [{"role": "user", "content": "hi"}]
    await client.chat.completions.create(model="faults", messages=msgs, max_tokens=1)
    with tracerl.rollout_scope(rollout_id="unattributed"):
        await client.chat.completions.create(model="faults", messages=msgs, max_tokens=1)
    store = ModelStore(faults_server.path / "data", "fa", "faults")
    assert len(calls_on_disk(store, "unattributed")) == 1
    assert read_jsonl(store.unattributed_calls_path)[-1]["rollout_id"] is None


# --- slow clients ---------------------------------------------------------------------------------

IDLE, TRICKLING_HEADS, TRICKLING_BODIES = 150, 150, 50


async def _closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    return await reader.read(-1)


async def _slow_client(port: int, kind: str, stop: asyncio.Event) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = raw_post("/v1/chat/completions", b"", content_length=1000)
    try:
        if kind == "body":
            writer.write(head)
        closed = asyncio.ensure_future(_closed_by_server(reader))
        sent = 0
        while not closed.done() and not stop.is_set() and kind != "idle":
            # the fault itself: one byte every half second, a slowloris
            writer.write(b"x" if kind == "body" else head[sent:sent + 1])
            sent += 1
            await asyncio.wait([closed], timeout=0.5)
        return await asyncio.wait_for(closed, 15)
    finally:
        writer.close()


async def test_a_flood_of_slow_clients_is_cut_off_and_calls_go_on(faults_server, faults_model):
    """350 connections: idle, trickling their head a byte at a time, trickling their body. The
    server closes each at its head or body deadline (2 s here), and authorised calls are served
    meanwhile."""
    stop = asyncio.Event()
    kinds = ["idle"] * IDLE + ["head"] * TRICKLING_HEADS + ["body"] * TRICKLING_BODIES
    clients = [asyncio.ensure_future(_slow_client(faults_server.port, k, stop)) for k in kinds]
    # a new connection, made during the flood: the model's pooled one may be past the server's
    # idle deadline (2 s here, under the client's 5 s keep-alive) and closing as it is reused
    fresh = async_client(faults_model, *faults_model.endpoint())
    try:
        assert await served_adapter_step(faults_model, client=fresh) >= 0  # during the flood
        answers = await asyncio.wait_for(asyncio.gather(*clients), 30)
    finally:
        stop.set()
        await fresh.close()
    for kind, answer in zip(kinds, answers, strict=True):
        if kind == "body":
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            assert b'"code":"body_timeout"' in answer
        else:
            assert answer == b"", answer[:200]  # closed without a word


# --- security -------------------------------------------------------------------------------------

async def test_auth_is_checked_before_the_body_is_read(faults_server):
    reader, writer = await asyncio.open_connection("127.0.0.1", faults_server.port)
    try:  # a 100 MB body announced, none sent: the refusal must not wait for it
        writer.write(raw_post("/v1/chat/completions", b"", key=None, content_length=10**8))
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()
    assert status.startswith(b"HTTP/1.1 401")


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/v1/nothing", "/api/v1/nothing"])
async def test_schema_and_unknown_routes_need_the_key(faults_server, path):
    async with httpx2.AsyncClient(base_url=faults_server.url, timeout=30) as http:
        r = await http.get(path)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"


async def test_the_schema_is_served_with_the_key(faults_server):
    async with httpx2.AsyncClient(base_url=faults_server.url, headers=AUTH, timeout=30) as http:
        r = await http.get("/openapi.json")
    assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"]


@pytest.mark.parametrize("method, path", [("GET", "/v1/nothing"), ("POST", "/v2/chat"),
                                          ("GET", "/api/v1/nope/x")])
async def test_unknown_routes_get_an_openai_style_404(faults_server, method, path):
    async with httpx2.AsyncClient(base_url=faults_server.url, headers=AUTH, timeout=30) as http:
        r = await http.request(method, path)
    assert r.status_code == 404
    assert r.json()["error"] == {"message": f"Unknown route: {method} {path}",
                                 "type": "invalid_request_error", "param": None,
                                 "code": "not_found"}
