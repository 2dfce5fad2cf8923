"""The gateway when things go wrong: an enqueue or a bus that fails, a request refused
after its Idempotency-Key was stored, bodies Python's JSON reader takes but no JSON
writer gives back, a client that waits for ``100 Continue``. Each answer is a status
that says what to do (503 + Retry-After, 4xx naming the problem), never a bare 500, and
an Idempotency-Key only ever answers for work that was really queued."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from tandem.cli.devstack import NatsServer, S3Server
from tandem.common import subjects
from tandem.common import tasks as moves
from tandem.common.bus import Bus
from tandem.common.events import IdempotencyRecord, TaskRecord, TaskState
from tandem.common.jobs import OPEN, GenerationRequest, build_task
from tandem.common.settings import Settings, load
from tandem.common.streams import KV_TASKS, gen_stream
from tandem.gateway.api import create_app
from tandem.gateway.auth import AuthSettings, Keyring, Limits
from tandem.gateway.generations import NOT_ENQUEUED, Gateway, fingerprint
from tandem.gateway.jobs import JobService
from tests import test_gateway
from tests.conftest import fill_store
from tests.test_gateway import MAX_BODY, queued_on, small_store_gateway

gw, http = test_gateway.gw, test_gateway.http  # the same gateway on the same real servers
ASK = {"model": "tiny-text", "prompt": "a cat"}


async def test_a_retry_after_the_gateway_could_not_enqueue_queues_the_task(
        http: httpx.AsyncClient, bus: Bus) -> None:
    # Cluster "other" has no stream: the task is recorded, its publish refused (503).
    # The retry with the same key, once the stream is back, must queue the work, not
    # answer 202 for the task that failed and will never run.
    ask = {**ASK, "cluster": "other"}
    await bus.js.delete_stream(subjects.gen_stream_name("other"))
    first = await http.post("/v1/generations", json=ask, headers={"Idempotency-Key": "r"})
    assert first.status_code == 503, first.text
    assert first.headers["retry-after"]
    assert NOT_ENQUEUED in first.json()["detail"]
    await bus.provision([gen_stream("other")])
    again = await http.post("/v1/generations", json=ask, headers={"Idempotency-Key": "r"})
    assert again.status_code == 202, again.text
    assert "idempotent-replayed" not in again.headers
    assert again.json()["state"] == "queued"
    assert (await http.get(again.json()["status_url"])).json()["state"] == "queued"
    assert await queued_on(bus, "other") == 1
    # From now on the key is that task's, and never enqueues twice.
    replay = await http.post("/v1/generations", json=ask, headers={"Idempotency-Key": "r"})
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.json()["id"] == again.json()["id"]
    assert await queued_on(bus, "other") == 1


async def _key_to_a_failed_task(gw: Gateway, key: str, reason: str, attempts: int = 0
                                ) -> str:
    """An Idempotency-Key naming a task recorded, then failed with ``reason``."""
    req = GenerationRequest.model_validate(ASK)
    spec = gw.registry.get(req.model)
    assert spec is not None and gw.tasks is not None and gw.idem is not None
    task_id = uuid.uuid4().hex
    rec = moves.queued(build_task(req, spec, task_id, gw.clusters[0]), gw.clusters[0])
    failed = moves.to_failed(reason)(rec)
    assert failed is not None
    await gw.tasks.create(task_id, msgspec.structs.replace(failed, attempts=attempts))
    await gw.idem.create(OPEN.scoped(key), IdempotencyRecord(task_id=task_id,
                                                             fingerprint=fingerprint(req)))
    return task_id


async def test_a_key_left_on_a_task_that_was_never_enqueued_moves_to_a_new_task(
        http: httpx.AsyncClient, gw: Gateway, bus: Bus, settings: Settings) -> None:
    # The 503 path deletes the key, but the bus that refused the publish may refuse the
    # delete too: the retry finds the key on a task the gateway failed to enqueue.
    stale = await _key_to_a_failed_task(
        gw, "left", f"{NOT_ENQUEUED} {settings.cluster}: NoStreamResponseError()")
    r = await http.post("/v1/generations", json=ASK, headers={"Idempotency-Key": "left"})
    assert r.status_code == 202, r.text
    assert "idempotent-replayed" not in r.headers
    assert r.json()["id"] != stale and r.json()["state"] == "queued"
    assert await queued_on(bus, settings.cluster) == 1
    # The failed task stays failed; the key now answers for the new one.
    tasks = await bus.typed(KV_TASKS, TaskRecord)
    old = await tasks.get(stale)
    assert old is not None and old[0].state == TaskState.failed
    again = await http.post("/v1/generations", json=ASK, headers={"Idempotency-Key": "left"})
    assert again.json()["id"] == r.json()["id"]
    assert again.headers["idempotent-replayed"] == "true"
    # A task that failed after a worker took it is a result: its key replays it.
    ran = await _key_to_a_failed_task(gw, "ran", "exhausted: delivered 3 times", attempts=3)
    r = await http.post("/v1/generations", json=ASK, headers={"Idempotency-Key": "ran"})
    assert r.status_code == 202 and r.headers["idempotent-replayed"] == "true"
    assert r.json()["id"] == ran and r.json()["state"] == "failed"
    assert await queued_on(bus, settings.cluster) == 1


async def test_a_key_whose_task_was_recorded_but_never_enqueued_queues_it_once_even_late(
        gw: Gateway, http: httpx.AsyncClient, bus: Bus) -> None:
    """The gateway died between recording a task and enqueueing it: its record says
    queued and nothing is in any queue. A replay of its key, even past the stream's
    dedupe window, sends it, and replays at once send it once between them."""
    req = GenerationRequest.model_validate(ASK)
    spec = gw.registry.get(req.model)
    assert spec is not None and gw.tasks is not None and gw.idem is not None
    cluster, task_id = gw.clusters[0], uuid.uuid4().hex
    before = await queued_on(bus, cluster)
    long_ago = moves.queued(build_task(req, spec, task_id, cluster), cluster)
    long_ago = msgspec.structs.replace(long_ago, created_at=long_ago.created_at - 700,
                                       updated_at=long_ago.updated_at - 700)
    await gw.tasks.create(task_id, long_ago)
    await gw.idem.create(OPEN.scoped("late"), IdempotencyRecord(task_id=task_id,
                                                                fingerprint=fingerprint(req)))
    replays = await asyncio.gather(*(http.post("/v1/generations", json=ASK, headers={
        "Idempotency-Key": "late"}) for _ in range(4)))
    for r in replays:
        assert r.status_code == 202 and r.headers["idempotent-replayed"] == "true", r.text
        assert r.json()["id"] == task_id
    assert await queued_on(bus, cluster) == before + 1
    again = await http.post("/v1/generations", json=ASK, headers={"Idempotency-Key": "late"})
    assert again.json()["id"] == task_id
    assert await queued_on(bus, cluster) == before + 1  # within the window: the same message


async def test_a_request_refused_by_routing_leaves_its_idempotency_key_unused(
        http: httpx.AsyncClient, bus: Bus) -> None:
    wrong = await http.post("/v1/generations", json={**ASK, "cluster": "nope"},
                            headers={"Idempotency-Key": "k"})
    assert wrong.status_code == 422
    assert wrong.json()["detail"][0]["loc"] == ["body", "cluster"]
    fixed = await http.post("/v1/generations", json={**ASK, "cluster": "other"},
                            headers={"Idempotency-Key": "k"})
    assert fixed.status_code == 202, fixed.text
    assert "idempotent-replayed" not in fixed.headers
    assert await queued_on(bus, "other") == 1


async def test_a_key_stored_by_an_attempt_that_died_before_recording_is_not_a_replay(
        http: httpx.AsyncClient, gw: Gateway, bus: Bus, settings: Settings) -> None:
    # As if an earlier attempt stored the key, then died before the task's record: this
    # request enqueues the task under the key's id for the first time.
    task_id = uuid.uuid4().hex
    assert gw.idem is not None
    await gw.idem.create(OPEN.scoped("died"), IdempotencyRecord(
        task_id=task_id, fingerprint=fingerprint(GenerationRequest.model_validate(ASK))))
    r = await http.post("/v1/generations", json=ASK, headers={"Idempotency-Key": "died"})
    assert r.status_code == 202, r.text
    assert r.json()["id"] == task_id
    assert "idempotent-replayed" not in r.headers
    assert await queued_on(bus, settings.cluster) == 1
    again = await http.post("/v1/generations", json=ASK, headers={"Idempotency-Key": "died"})
    assert again.headers["idempotent-replayed"] == "true"


async def test_a_bus_that_does_not_answer_gets_503_with_retry_after_naming_what_failed(
        http: httpx.AsyncClient, nats_server: NatsServer) -> None:
    url = (await http.post("/v1/generations", json=ASK)).json()["status_url"]
    nats_server.stop()
    post = await http.post("/v1/generations", json=ASK, headers={"Idempotency-Key": "z"})
    assert post.status_code == 503, post.text
    assert post.headers["retry-after"]
    assert "could not store the Idempotency-Key" in post.json()["detail"]
    get = await http.get(url)
    assert get.status_code == 503, get.text
    assert get.headers["retry-after"]
    assert f"the message bus (NATS) failed to serve GET {url}" in get.json()["detail"]


async def test_a_full_bus_refuses_keys_and_cancels_with_503_at_both_doors(
        tmp_path: Path, s3_server: S3Server) -> None:
    # JetStream with no room (10023) refuses every write: the Idempotency-Key, the
    # cancel's record move. Each door says so with a 503, not a 500 or an empty error.
    async with small_store_gateway(tmp_path, s3_server) as (bus, gw, http):
        jobs = await _job_service(gw, bus)
        try:
            first = await http.post("/v1/generations", json=ASK)
            assert first.status_code == 202, first.text
            await fill_store(bus)
            keyed = await http.post("/v1/generations", json=ASK,
                                    headers={"Idempotency-Key": "k"})
            assert keyed.status_code == 503, keyed.text
            assert keyed.headers["retry-after"]
            assert "could not store the Idempotency-Key: insufficient resources " \
                   "(JetStream error 503/10023)" in keyed.json()["detail"]
            cancel = await http.delete(first.json()["status_url"])
            assert cancel.status_code == 503, cancel.text
            assert cancel.headers["retry-after"]
            assert "failed to serve DELETE" in cancel.json()["detail"]
            assert "10023" in cancel.json()["detail"]
            code, body = await _ask(bus, "cancel", {"id": first.json()["id"]})
            assert code == "503", body
            assert "failed to serve cancel" in body["detail"]
            assert "10023" in body["detail"]
        finally:
            await jobs.stop()


@pytest.mark.parametrize(("raw", "field", "echoed"), [
    (b'{"model":"tiny-text","prompt":"a","guidance":NaN}', "guidance", "nan"),
    (b'{"model":"tiny-text","prompt":"a","guidance":Infinity}', "guidance", "inf"),
    (b'{"model":"tiny-text","prompt":"a","guidance":1e999}', "guidance", "inf"),
    (b'{"model":"tiny-text","prompt":"a\\ud800b"}', "prompt", "a\\ud800b"),
])
async def test_a_value_json_cannot_carry_back_gets_422_echoing_it_safely(
        http: httpx.AsyncClient, raw: bytes, field: str, echoed: str) -> None:
    r = await http.post("/v1/generations", content=raw,
                        headers={"content-type": "application/json"})
    assert r.status_code == 422, r.text
    [problem] = r.json()["detail"]
    assert problem["loc"] == ["body", field] and problem["msg"]
    assert problem["input"] == echoed


async def _job_service(gw: Gateway, bus: Bus) -> JobService:
    keys = Keyring([])
    limits = await Limits.on(bus, keys, load(AuthSettings))
    jobs = JobService(gw, keys, limits)
    await jobs.start(bus.nc)
    return jobs


async def _ask(bus: Bus, endpoint: str, body: Any) -> tuple[str | None, Any]:
    """The job service's answer: its error code (None: no error) and its JSON body."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    msg = await bus.nc.request(subjects.jobs(endpoint), data, timeout=30)
    return (msg.headers or {}).get("Nats-Service-Error-Code"), json.loads(msg.data)


@pytest.fixture
async def jobs(gw: Gateway, bus: Bus) -> AsyncIterator[JobService]:
    svc = await _job_service(gw, bus)
    yield svc
    await svc.stop()


async def test_the_job_service_answers_unreadable_bodies_with_a_detail(
        jobs: JobService, bus: Bus) -> None:
    code, body = await _ask(bus, "generate", b"[" * 50_000)
    assert code == "400" and "nests arrays or objects too deeply" in body["detail"]
    code, body = await _ask(bus, "status", b'{"id":' + b"[" * 30_000 + b"]" * 30_000 + b"}")
    assert code == "400" and "too deeply" in body["detail"]
    big = json.dumps({"model": "tiny-text", "prompt": "a" * (64 * 1024)}).encode()
    code, body = await _ask(bus, "generate", big)  # refused before it is read
    assert code == "413" and f"{len(big)} bytes, over the {64 * 1024}" in body["detail"]
    code, body = await _ask(bus, "generate", b'{"model":"tiny-text","prompt":"a\\ud800"}')
    assert code == "422", body
    [problem] = body["detail"]
    assert problem["loc"] == ["body", "prompt"] and problem["input"] == "a\\ud800"


async def test_a_client_expecting_100_continue_gets_413_before_sending_an_oversized_body(
        gw: Gateway) -> None:
    from tandem.gateway.service import _Server, bind

    asgi, _ = create_app(gw, max_body_bytes=MAX_BODY)
    sock = bind("127.0.0.1", 0)
    sock.listen()  # connections queue until the server accepts them
    server = _Server(asgi, sock)
    serving = asyncio.create_task(server.serve())
    try:
        reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        writer.write(f"POST /v1/generations HTTP/1.1\r\nHost: gw\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {MAX_BODY + 1}\r\n"
                     "Expect: 100-continue\r\n\r\n".encode())
        await writer.drain()
        # Nothing of the body is sent: the answer must come without it.
        status = await asyncio.wait_for(reader.readline(), 30)
        assert status.startswith(b"HTTP/1.1 413"), status
        writer.close()
    finally:
        server.stop()
        await serving


async def test_the_job_service_answers_on_inboxes_only(
        jobs: JobService, gw: Gateway, http: httpx.AsyncClient, bus: Bus) -> None:
    """A reply subject chose where the gateway published its answer, with its own
    permissions: ``$KV.tasks.<id>`` wrote an error body over another tenant's record (its
    status then 500, its worker dead-lettering it), ``gen.<cluster>.<lane>`` queued junk.
    A request whose reply is not an inbox, or that has none, is dropped unserved."""
    victim = (await http.post("/v1/generations", json=ASK)).json()["id"]
    tasks = await bus.typed(KV_TASKS, TaskRecord)
    before = await tasks.get(victim)
    queued = await queued_on(bus, gw.clusters[0])
    record = subjects.task_record(victim)
    for subject, body in ((subjects.jobs("status"), {"id": "x"}),
                          (subjects.jobs("generate"), ASK), ("$SRV.PING", None),
                          ("$SRV.STATS.tandem-jobs", None)):
        for reply in (record, subjects.gen(gw.clusters[0], "batch")):
            await bus.nc.publish(subject, b"" if body is None else json.dumps(body).encode(),
                                 reply=reply)
        await bus.nc.publish(subject, json.dumps(ASK).encode())  # no reply at all
        # The same subscription answers in order: once this is answered, those were seen.
        answer = await bus.nc.request(subject, b"" if body is None else json.dumps(
            body).encode(), timeout=30)
        assert answer.data
    assert await tasks.get(victim) == before
    assert await queued_on(bus, gw.clusters[0]) == queued + 1  # the one answered generate
    assert subjects.is_inbox("_INBOX.abc") and subjects.is_inbox("_INBOX_east.a.b")
    assert subjects.is_inbox("_R_.xyz.abc")
    assert not any(subjects.is_inbox(r) for r in (None, "", "_INBOX", "_INBOX.", "_INBOX.>",
                                                  "_INBOXES.a", record, "x._INBOX.a"))


async def test_the_job_service_reads_header_names_in_any_case(
        jobs: JobService, bus: Bus) -> None:
    """Header names are case-insensitive over HTTP; a NATS client that sent
    ``idempotency-key`` used to get a second task for each spelling."""
    ids = set()
    for name in ("Idempotency-Key", "idempotency-key", "IDEMPOTENCY-KEY"):
        msg = await bus.nc.request(subjects.jobs("generate"), json.dumps(ASK).encode(),
                                   timeout=30, headers={name: "one-key"})
        ids.add(json.loads(msg.data)["id"])
    assert len(ids) == 1


async def test_a_job_service_failure_answers_the_documented_body_and_stats_echo_no_input(
        jobs: JobService, gw: Gateway, bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    async def broken() -> list[dict[str, Any]]:
        raise RuntimeError("a bug with secret-ish internals")

    monkeypatch.setattr(gw, "models", broken)
    code, body = await _ask(bus, "models", {})
    assert code == "500" and "logged as" in body["detail"]
    assert "secret-ish" not in body["detail"]
    code, _ = await _ask(bus, "generate", {**ASK, "steps": "a tenant's secret"})
    assert code == "422"
    stats = json.loads((await bus.nc.request("$SRV.STATS.tandem-jobs", b"", timeout=30)).data)
    errors = {e["name"]: e["last_error"] for e in stats["endpoints"]}
    assert errors["models"] == "500 Internal Server Error"
    assert errors["generate"] == "422 Unprocessable Entity"


async def test_a_follow_on_the_bus_reads_on_while_no_gateway_answers(
        jobs: JobService, gw: Gateway, http: httpx.AsyncClient, bus: Bus) -> None:
    """Only ``generate`` retried: in a rolling restart of the gateways, a ``wait`` whose
    read of the record found none serving (503, no responders) or timed out ended with
    that error while its task ran on. A follow's reads now ride it out (``patience``)."""
    from tandem.client import JobError, NatsClient

    refused: list[int] = []
    was_refused = asyncio.Event()

    class Watched(NatsClient):
        async def status(self, task_id: str) -> dict[str, Any]:
            try:
                return await super().status(task_id)
            except JobError as exc:
                refused.append(exc.status)
                was_refused.set()
                raise

    task_id = (await http.post("/v1/generations", json=ASK)).json()["id"]
    await jobs.stop()  # every gateway away
    waiting = asyncio.create_task(Watched(bus.nc, recheck=0.2).wait(task_id, timeout=60))
    await asyncio.wait_for(was_refused.wait(), 30)  # its first read: it must read on
    assert refused[0] == 503 and not waiting.done()
    await gw.cancel(task_id)
    await jobs.start(bus.nc)  # a gateway back
    record = await waiting
    assert record["id"] == task_id and record["state"] == "cancelled"
