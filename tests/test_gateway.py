"""The gateway's HTTP API in-process (ASGI) against a real NATS server and S3:
submission, idempotency, validation, limits, cancel, the model registry."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.cli.devstack import NatsServer, S3Server
from tandem.common import subjects
from tandem.common import tasks as moves
from tandem.common.bus import Bus
from tandem.common.events import (
    CancelNotice,
    GenerationTask,
    NodeHeartbeat,
    TaskRecord,
    TaskState,
    decode,
)
from tandem.common.jobs import JobLimits
from tandem.common.models import Registry
from tandem.common.settings import Settings, load
from tandem.common.storage import s3_client
from tandem.common.streams import KV_CANCELS, KV_NODES, KV_TASKS, core_streams, gen_stream
from tandem.gateway.api import create_app
from tandem.gateway.generations import Gateway
from tests.conftest import FILL, PYTHON, fill_store, small_store

MAX_BODY = 4096
SEAL_KEY = b"a test seal key, not a secret"


@pytest.fixture
async def gw(bus: Bus, settings: Settings, s3_server: S3Server) -> AsyncIterator[Gateway]:
    await bus.provision([*core_streams(), gen_stream(settings.cluster), gen_stream("other")])
    s3 = s3_client(load(Settings, s3_endpoint=s3_server.url, s3_access_key="tandem",
                        s3_secret_key="tandem"))
    g = Gateway(bus, Registry.parse(""), [settings.cluster, "other"], s3=s3, bucket="b",
                url_ttl=60, publish_retry_for=1.0,
                limits=JobLimits(max_images=4, max_prompt_chars=100, max_size=512),
                seal_key=SEAL_KEY)
    await g.start()
    yield g
    await g.stop()


@pytest.fixture
async def http(gw: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    asgi, _ = create_app(gw, max_body_bytes=MAX_BODY)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi),
                                 base_url="http://gw") as client:
        yield client


async def queued_on(bus: Bus, cluster: str) -> int:
    return (await bus.js.stream_info(subjects.gen_stream_name(cluster))).state.messages


async def test_post_returns_202_with_id_and_status_url_and_enqueues_the_task(
        http: httpx.AsyncClient, bus: Bus, settings: Settings) -> None:
    r = await http.post("/v1/generations", json={"model": "tiny-text", "prompt": "a cat",
                                                  "num_images": 2, "lane": "batch"})
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["state"] == "queued" and body["cluster"] == settings.cluster
    assert body["status_url"] == f"/v1/generations/{body['id']}" == r.headers["location"]
    assert body["events_url"] == body["status_url"] + "/events"
    # Its record is its one source of truth; each write of it travels on this subject.
    assert body["record_subject"] == f"tasks.written.{body['id']}"
    assert await queued_on(bus, settings.cluster) == 1
    view = (await http.get(body["status_url"])).json()
    assert view["state"] == "queued" and view["lane"] == "batch"
    # Unset parameters took the model's defaults; the seed is derived and reported.
    assert view["params"] == {"width": 16, "height": 16, "steps": 10, "guidance": 5.0,
                              "seed": body["seed"], "num_images": 2}
    assert view["created_at"] and view["images"] == []
    # The queued task is the very body its record holds: a worker runs a delivery only
    # if the two are equal (tasks.claim).
    msg = await bus.js.get_last_msg(subjects.gen_stream_name(settings.cluster),
                                    subjects.gen(settings.cluster, "batch"))
    task = decode(msg.data, GenerationTask)
    stored = await (await bus.typed(KV_TASKS, TaskRecord)).get(body["id"])
    assert stored is not None
    assert stored[0].task == task and stored[0] == moves.queued(task, settings.cluster)
    # Sealed with that record's revision: a worker holding the key moves it unread; to
    # anyone else (another key, no key, other bytes) the seal says nothing.
    assert moves.as_sealed(task, msg.data, msg.headers, SEAL_KEY) == stored
    assert moves.as_sealed(task, msg.data, msg.headers, b"another key of 16+ chars") is None
    assert moves.as_sealed(task, msg.data, msg.headers, None) is None
    assert moves.as_sealed(task, msg.data + b" ", msg.headers, SEAL_KEY) is None


async def test_same_idempotency_key_returns_same_task_and_never_enqueues_twice(
        http: httpx.AsyncClient, bus: Bus, settings: Settings) -> None:
    body = {"model": "digits", "class_label": 3}
    first = await http.post("/v1/generations", json=body, headers={"Idempotency-Key": "k-1"})
    again = await http.post("/v1/generations", json=body, headers={"Idempotency-Key": "k-1"})
    assert first.status_code == again.status_code == 202
    assert first.json() == again.json()
    assert again.headers["idempotent-replayed"] == "true"
    assert await queued_on(bus, settings.cluster) == 1
    other = await http.post("/v1/generations", json=body, headers={"Idempotency-Key": "k-2"})
    assert other.json()["id"] != first.json()["id"]
    assert await queued_on(bus, settings.cluster) == 2
    reused = await http.post("/v1/generations", json={**body, "class_label": 4},
                             headers={"Idempotency-Key": "k-1"})
    assert reused.status_code == 422
    assert reused.json()["detail"][0]["loc"] == ["header", "Idempotency-Key"]


@pytest.mark.parametrize(("body", "field", "says"), [
    ({"model": "nope", "prompt": "x"}, "model", "unknown model 'nope'"),
    ({"model": "bad model"}, "model", "pattern"),
    ({"model": "tiny-text"}, "prompt", "a prompt is required"),
    ({"model": "tiny-text", "prompt": "x" * 101}, "prompt", "101 characters; at most 100"),
    ({"model": "tiny-text", "prompt": "x", "negative_prompt": "y" * 200}, "negative_prompt",
     "at most 100"),
    ({"model": "tiny-text", "prompt": "x", "class_label": 1}, "class_label", "not a class"),
    ({"model": "digits", "prompt": "x", "class_label": 1}, "prompt", "does not take a prompt"),
    ({"model": "digits"}, "class_label", "class_label 0..9 is required"),
    ({"model": "digits", "class_label": 10}, "class_label", "0..9"),
    ({"model": "noop", "class_label": 0}, "class_label", "unconditional"),
    ({"model": "tiny-text", "prompt": "x", "width": 20}, "width", "multiple of 8"),
    ({"model": "tiny-text", "prompt": "x", "height": 0}, "height", "greater than or equal"),
    ({"model": "tiny-text", "prompt": "x", "width": 128}, "width", "8..64"),
    ({"model": "tiny-text", "prompt": "x", "height": 1024}, "height", "at most 512"),
    ({"model": "digits", "class_label": 1, "width": 32}, "width", "sizes [16]"),
    ({"model": "tiny-text", "prompt": "x", "steps": 0}, "steps", "greater than or equal"),
    ({"model": "tiny-text", "prompt": "x", "steps": 201}, "steps", "at most 200 steps"),
    ({"model": "tiny-text", "prompt": "x", "guidance": 21}, "guidance", "up to 20.0"),
    ({"model": "tiny-text", "prompt": "x", "guidance": -1}, "guidance", "greater than"),
    ({"model": "digits", "class_label": 1, "guidance": 7.5}, "guidance", "up to 1.0"),
    ({"model": "tiny-text", "prompt": "x", "num_images": 5}, "num_images", "at most 4"),
    ({"model": "tiny-text", "prompt": "x", "num_images": 0}, "num_images", "greater than"),
    ({"model": "tiny-text", "prompt": "x", "lane": "fast"}, "lane", "interactive"),
    ({"model": "tiny-text", "prompt": "x", "cluster": "mars"}, "cluster", "unknown cluster"),
    ({"model": "tiny-text", "prompt": "x", "colour": "red"}, "colour", "Extra inputs"),
])
async def test_invalid_request_gets_422_naming_the_field(
        http: httpx.AsyncClient, bus: Bus, settings: Settings, body: dict[str, Any],
        field: str, says: str) -> None:
    r = await http.post("/v1/generations", json=body)
    assert r.status_code == 422, r.text
    problems = r.json()["detail"]
    assert any(p["loc"][-1] == field and says in p["msg"] for p in problems), problems
    assert await queued_on(bus, settings.cluster) == 0


async def test_oversized_body_gets_413_whether_declared_or_streamed(
        http: httpx.AsyncClient) -> None:
    big = b'{"model": "tiny-text", "prompt": "' + b"x" * MAX_BODY + b'"}'
    r = await http.post("/v1/generations", content=big,
                        headers={"content-type": "application/json"})
    assert r.status_code == 413 and "limit is 4096 bytes" in r.json()["detail"]

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    r = await http.post("/v1/generations", content=chunks(),
                        headers={"content-type": "application/json"})
    assert r.status_code == 413


async def test_an_event_stream_follows_its_task_without_a_consumer_of_its_own(
        gw: Gateway, http: httpx.AsyncClient, bus: Bus) -> None:
    """Each open stream used to hold a JetStream consumer on the tasks bucket's stream
    (an ordered watch): thousands of followers were thousands of consumers. It now
    hears the task's progress and record writes on core subjects, as clients do."""
    task_id = (await http.post("/v1/generations", json={"model": "noop"})).json()["id"]
    consumers = (await bus.js.stream_info(f"KV_{KV_TASKS}")).state.consumer_count
    events = gw.follow(task_id)
    kind, data = await asyncio.wait_for(anext(events), 10)
    assert (kind, data["state"]) == ("state", "queued")
    assert (await bus.js.stream_info(f"KV_{KV_TASKS}")).state.consumer_count == consumers
    # A worker's first step says it runs; its progress follows.
    await bus.nc.publish(subjects.gen_progress(task_id), b'{"step": 1, "steps": 10}')
    assert await asyncio.wait_for(anext(events), 10) == (
        "state", {"id": task_id, "state": "running", "cluster": "", "worker": ""})
    assert await asyncio.wait_for(anext(events), 10) == ("progress", {"step": 1, "steps": 10})
    # A write of the record (here the cancel) is heard and read: the stream ends on it.
    assert (await http.delete(f"/v1/generations/{task_id}")).status_code == 200
    kind, data = await asyncio.wait_for(anext(events), 10)
    assert (kind, data["state"]) == ("final", "cancelled")
    with pytest.raises(StopAsyncIteration):
        await anext(events)


async def test_an_event_stream_whose_client_leaves_during_its_set_up_leaves_no_subscription(
        gw: Gateway, http: httpx.AsyncClient, bus: Bus) -> None:
    """A client that hung up while its stream was being set up (the first read of the
    record, a round trip) left the progress subscription behind for the gateway's life:
    about one in fifteen impatient clients in the soak red team's run."""
    task_id = (await http.post("/v1/generations", json={"model": "noop"})).json()["id"]
    before = len(bus.nc._subs)
    for yields in range(12):  # each point of the set-up a cancel can land on
        events = gw.follow(task_id)
        opening = asyncio.create_task(anext(events))
        for _ in range(yields):
            await asyncio.sleep(0)  # let the set-up run that far: no time passes
        opening.cancel()
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await opening
        await events.aclose()  # as the loop does to a stream's abandoned generator
        assert len(bus.nc._subs) == before, yields


async def test_cancel_queued_task_moves_it_to_cancelled_and_finished_tasks_refuse(
        http: httpx.AsyncClient, bus: Bus) -> None:
    task_id = (await http.post("/v1/generations", json={"model": "noop"})).json()["id"]
    other = (await http.post("/v1/generations", json={"model": "noop"})).json()["id"]
    r = await http.delete(f"/v1/generations/{task_id}")
    assert r.status_code == 200
    assert r.json()["state"] == "cancelled" and r.json()["finished_at"]
    assert (await http.delete(f"/v1/generations/{task_id}")).status_code == 200
    tasks = await bus.typed(KV_TASKS, TaskRecord)
    got = await tasks.get(task_id)
    assert got is not None and got[0].state == TaskState.cancelled
    # The workers' notice (KV cancels) is left for the cancelled task only.
    notices = await bus.typed(KV_CANCELS, CancelNotice)
    notice = await notices.get(task_id)
    assert notice is not None and notice[0].task_id == task_id
    assert notice[0].reason == got[0].reason
    assert await notices.get(other) is None
    assert (await http.delete("/v1/generations/unknown")).status_code == 404
    assert (await http.get("/v1/generations/not..valid")).status_code == 422  # no task could
    assert (await http.get("/v1/generations/unknown")).status_code == 404


async def test_models_lists_conditioning_sizes_steps_and_where_each_is_loaded(
        http: httpx.AsyncClient, bus: Bus, settings: Settings) -> None:
    nodes = await bus.typed(KV_NODES, NodeHeartbeat)
    key = subjects.node_key(settings.cluster, "n1")
    await nodes.put(key, NodeHeartbeat(cluster=settings.cluster, node="n1", models=["digits"]))
    # The gateway's board hears the heartbeat by its watch, not by a read per request.
    models = await models_when(http, lambda m: m["digits"]["loaded_on"])
    assert set(models) == {"digits", "tiny-text", "noop"}
    digits = models["digits"]
    assert digits["conditioning"] == "class_label"
    assert digits["class_labels"] == {"min": 0, "max": 9}
    assert digits["sizes"] == [16] and digits["default_steps"] == 20
    assert digits["loaded_on"] == [f"{settings.cluster}/n1"]
    assert models["tiny-text"]["conditioning"] == "text"
    assert models["tiny-text"]["loaded_on"] == []
    assert "config" not in digits
    await nodes.delete(key)  # the node is gone: its models are loaded nowhere
    models = await models_when(http, lambda m: not m["digits"]["loaded_on"])
    assert all(m["loaded_on"] == [] for m in models.values())


async def models_when(http: httpx.AsyncClient, cond: Callable[[dict[str, Any]], Any],
                      timeout: float = 10.0) -> dict[str, Any]:
    """``GET /v1/models`` by name, once ``cond`` holds of it (within ``timeout``)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        models = {m["name"]: m for m in (await http.get("/v1/models")).json()["models"]}
        if cond(models):
            return models
        assert asyncio.get_running_loop().time() < deadline, models
        await asyncio.sleep(0.02)  # polling the gateway's answer


async def test_pinned_cluster_gets_the_task(http: httpx.AsyncClient, bus: Bus) -> None:
    r = await http.post("/v1/generations", json={"model": "noop", "cluster": "other"})
    assert r.status_code == 202 and r.json()["cluster"] == "other"
    assert await queued_on(bus, "other") == 1


async def test_openapi_documents_the_generation_api(http: httpx.AsyncClient) -> None:
    paths = (await http.get("/openapi.json")).json()["paths"]
    assert {"/v1/generations", "/v1/generations/{task_id}",
            "/v1/generations/{task_id}/events", "/v1/models"} <= set(paths)
    assert (await http.get("/docs")).status_code == 200


@contextlib.asynccontextmanager
async def small_store_gateway(tmp_path: Path, s3_server: S3Server
                              ) -> AsyncIterator[tuple[Bus, Gateway, httpx.AsyncClient]]:
    """A gateway on a nats-server whose JetStream store is 1 MB (``fill_store`` fills
    it), its cluster ``c1``: the bus, the gateway and an HTTP client of its app."""
    nats = NatsServer(name="full", log_path=tmp_path / "nats.log", store_dir=tmp_path / "js",
                      config_path=small_store(tmp_path)).start()
    try:
        bus = await Bus.connect(load(Settings, nats_url=nats.url, cluster="c1", node="n0"),
                                "test")
        try:
            await bus.provision([*core_streams(), gen_stream("c1")])
            s3 = s3_client(load(Settings, s3_endpoint=s3_server.url, s3_access_key="tandem",
                                s3_secret_key="tandem"))
            gw = Gateway(bus, Registry.parse(""), ["c1"], s3=s3, bucket="b", url_ttl=60,
                         publish_retry_for=600.0, limits=JobLimits(), seal_key=SEAL_KEY)
            await gw.start()
            asgi, _ = create_app(gw, max_body_bytes=MAX_BODY)
            try:
                async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi),
                                             base_url="http://gw") as http:
                    yield bus, gw, http
            finally:
                await gw.stop()
        finally:
            await bus.drain()
    finally:
        nats.stop()


async def test_a_bus_with_no_room_refuses_a_task_at_once_naming_why_and_loses_none(
        tmp_path: Path, s3_server: S3Server) -> None:
    # A JetStream store of 1 MB, filled by a stream of another program's: no room for a
    # task's record. A 503 that says so (not the retry window of a leader election, not
    # a bare class name), the task accepted before it intact, and served once room is made.
    async with small_store_gateway(tmp_path, s3_server) as (bus, _, http):
        ask = {"model": "tiny-text", "prompt": "a cat"}
        first = await http.post("/v1/generations", json=ask)
        assert first.status_code == 202, first.text
        await fill_store(bus)
        # publish_retry_for is 600 s: a refusal that waited it out would time the
        # test out instead of answering.
        full = await http.post("/v1/generations", json=ask)
        assert full.status_code == 503, full.text
        assert "could not record the task: insufficient resources (JetStream " \
               "error 503/10023)" in full.json()["detail"]
        assert full.headers["retry-after"]
        view = await http.get(first.json()["status_url"])
        assert view.status_code == 200 and view.json()["state"] == "queued"
        assert await queued_on(bus, "c1") == 1
        await bus.js.purge_stream(FILL)
        again = await http.post("/v1/generations", json=ask)
        assert again.status_code == 202, again.text
        assert await queued_on(bus, "c1") == 2


def test_gateway_imports_without_torch_or_diffusers() -> None:
    code = ("import sys, tandem.gateway.service, tandem.gateway.api; "
            "bad = [m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_gateway_keeps_idle_connections_open_longer_than_clients_do() -> None:
    """A server that closes an idle connection first races the client's next request on
    it, which then fails without a response (found in a suite run: uvicorn's 5 s default
    against httpx's 5 s keep-alive). The gateway outlives httpx's and AWS ALB's (60 s)."""
    from tandem.gateway.service import GatewaySettings, _Server, bind

    async def app(scope: Any, receive: Any, send: Any) -> None:
        pass

    settings = load(GatewaySettings, "gateway")
    sock = bind("127.0.0.1", 0)
    try:
        server = _Server(app, sock, keep_alive=settings.http_keep_alive)
        assert server.config.timeout_keep_alive == settings.http_keep_alive
        assert settings.http_keep_alive > max(httpx.Limits().keepalive_expiry or 0, 60)
    finally:
        sock.close()
