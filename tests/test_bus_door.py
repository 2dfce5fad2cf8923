"""The bus door: tasks published straight on ``gen.<cluster>.<lane>`` with bare nats-py
calls, against a real worker process. The worker checks each with the gateway's own
function before it runs anything (oversized, malformed or misrouted tasks never start),
refuses a body under another task's id (no hijack of a queued or running task), and a
fuzzed stream of payloads never crashes it."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tandem.cli.devstack import S3Server
from tandem.common import subjects
from tandem.common import tasks as moves
from tandem.common.bus import Bus
from tandem.common.events import GenerationTask, TaskRecord, TaskState, decode
from tandem.common.jobs import JobLimits, check_task
from tandem.common.models import Registry
from tandem.common.storage import ensure_bucket, s3_client
from tandem.common.streams import KV_TASKS
from tests.serving_stack import (
    Child,
    ServingStack,
    Writes,
    dead_letters,
    gateway,
    http_port,
    terminal,
    wait_started,
    worker,
)

DOOR, PARKED = "door", "parked"
# "huge" is a model whose spec is wrong (any size to 8192, 10,000 steps): the hard cap on
# work still bounds what one task may ask of it.
MODELS = json.dumps([
    {"name": "digits", "source": "builtin:class-unet", "conditioning": "class_label",
     "num_classes": 10, "sizes": [16], "max_steps": 1000},
    {"name": "tiny-text", "source": "builtin:tiny-text", "conditioning": "text",
     "max_size": 64, "default_steps": 2, "max_guidance": 20, "default_guidance": 3.0},
    {"name": "huge", "source": "builtin:class-unet", "conditioning": "class_label",
     "num_classes": 10, "max_size": 8192, "max_steps": 10000},
    {"name": "noop", "source": "noop", "default_steps": 1, "max_steps": 1},
])
REGISTRY = Registry.parse(MODELS)


class Door(ServingStack):
    """NATS, the session's S3, a gateway and one worker on cluster ``door``."""

    def __init__(self, root: Path, s3: S3Server) -> None:
        super().__init__(root, s3, "door", MODELS)
        self.port = 0

    def start(self) -> None:
        self.nats.start()
        ensure_bucket(s3_client(self.settings()), self.bucket)
        gw = gateway(self.root, "gateway", **self.env(
            cluster=DOOR, clusters=f"{DOOR},{PARKED}", routing="static"))
        self.children.append(gw.start())
        self.worker = self.start_worker("w-door", DOOR)
        self.port = http_port(gw)

    def start_worker(self, name: str, cluster: str) -> Child:
        w = worker(self.root, name, **self.env(cluster=cluster, node=name, max_batch="8"))
        self.children.append(w.start())
        w.wait_healthy()
        return w

    def image_keys(self, task_id: str) -> list[str]:
        listed = s3_client(self.settings()).list_objects_v2(
            Bucket=self.bucket, Prefix=f"images/{task_id}/")
        return sorted(o["Key"] for o in listed.get("Contents", []))


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[Door]:
    d = Door(tmp_path_factory.mktemp("door"), s3_server)
    try:
        d.start()
        yield d
    finally:
        d.stop()


@pytest.fixture
async def bus(door: Door) -> AsyncIterator[Bus]:
    async with door.bus() as b:
        yield b


@pytest.fixture
async def writes(bus: Bus) -> AsyncIterator[Writes]:
    w = await Writes().start(bus)
    yield w
    await w.stop()


def raw(task_id: str, **fields: Any) -> bytes:
    """A task as any NATS client would write it: plain JSON."""
    return json.dumps({"task_id": task_id, **fields}).encode()


async def publish(bus: Bus, cluster: str, lane: str, data: bytes,
                  headers: dict[str, str] | None = None) -> None:
    await bus.js.publish(subjects.gen(cluster, lane), data,
                         headers={"Nats-Msg-Id": uuid.uuid4().hex, **(headers or {})})


async def test_oversized_and_misrouted_tasks_on_the_bus_never_start(
        door: Door, bus: Bus, writes: Writes) -> None:
    bad = {  # each published straight on gen.door.interactive; field -> the body
        "steps": dict(model="digits", class_label=1, steps=5000),
        "num_images": dict(model="digits", class_label=1, num_images=9),
        "width": dict(model="tiny-text", prompt="a fox", width=4096, height=16),
        "prompt": dict(model="tiny-text", width=16, height=16),
        "noop": dict(model="digits", class_label=1, noop=True),
        "cluster": dict(model="digits", class_label=1, cluster="elsewhere"),
        "lane": dict(model="digits", class_label=1, lane="batch"),
        "model": dict(model="not-a-model"),
    }
    # The cap on work: 2048x2048 at 10,000 steps is inside the broken spec of "huge".
    bad["work"] = dict(model="huge", class_label=1, width=2048, height=2048, steps=10000)
    ids = {field: uuid.uuid4().hex for field in bad}
    for field, body in bad.items():
        await publish(bus, DOOR, "interactive", raw(ids[field], **body))
    for field, task_id in ids.items():
        rec = await terminal(bus, task_id)
        assert rec.state == TaskState.failed, (field, rec)
        assert rec.reason.startswith("rejected: invalid task: "), (field, rec.reason)
        expected = "num_images" if field == "work" else field
        assert f"{expected}: " in rec.reason, (field, rec.reason)
        assert rec.started_at is None and rec.worker == "", (field, rec)  # never started
        # Its one write is the failure: it was never claimed (a claim of a bare publish
        # writes it queued first), let alone run.
        assert await writes.until_terminal(task_id) == ["failed"], (field, writes.states(
            task_id))
        assert door.image_keys(task_id) == []
    assert "megapixel-steps" in (await terminal(bus, ids["work"])).reason
    letters = await dead_letters(bus, f"GEN_{DOOR.upper()}", lambda ls: set(ids.values()) <= {
        decode(d.data, dict).get("task_id") for d in ls})
    reasons = {decode(d.data, dict)["task_id"]: d.reason for d in letters}
    for task_id in ids.values():
        assert reasons[task_id] == (await terminal(bus, task_id)).reason
    # The same worker goes on with a task within bounds.
    ok = uuid.uuid4().hex
    await publish(bus, DOOR, "interactive", raw(ok, model="digits", class_label=2, steps=2,
                                                width=16, height=16, cluster=DOOR))
    done = await terminal(bus, ok)
    assert done.state == TaskState.succeeded and len(done.images) == 1


async def _victim_intact(door: Door, bus: Bus, writes: Writes, task_id: str,
                         body: dict[str, Any]) -> None:
    """The victim ran with its own parameters only, and the intruder was refused."""
    rec = await terminal(bus, task_id)
    assert rec.state == TaskState.succeeded, rec
    assert rec.task.class_label == body["class_label"]
    assert rec.task.num_images == body["num_images"] == len(rec.images)
    assert door.image_keys(task_id) == sorted(rec.images)
    letters = await dead_letters(bus, f"GEN_{rec.cluster.upper()}", lambda ls: any(
        task_id.encode() in d.data for d in ls))
    [letter] = [d for d in letters if task_id.encode() in d.data]
    assert letter.reason.startswith("rejected: conflict: task id"), letter.reason
    assert decode(letter.data, dict)["class_label"] == 7  # the intruder's body
    # Every write of the victim's record: its own body, one success, never a failure.
    states = await writes.until_terminal(task_id)
    assert states.count("succeeded") == 1 and "failed" not in states, states
    assert all(r.task.class_label == body["class_label"] for r in writes.by_task[task_id])


async def test_a_raw_publish_under_a_queued_tasks_id_is_refused_and_the_task_runs_as_sent(
        door: Door, bus: Bus, writes: Writes) -> None:
    body = {"model": "digits", "class_label": 1, "steps": 2, "num_images": 2,
            "lane": "batch", "cluster": PARKED}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{door.port}") as http:
        r = await http.post("/v1/generations", json=body)
    assert r.status_code == 202, r.text
    task_id = r.json()["id"]
    # No worker pulls "parked" yet: the victim is queued when the intruder's body lands,
    # on the interactive lane, which a worker takes first.
    assert (await (await bus.typed(KV_TASKS, TaskRecord)).get(task_id))[0].state == \
        TaskState.queued  # type: ignore[index]
    # The intruder even carries the victim's seal (copied off the stream): the seal is of
    # the victim's bytes, so it says nothing of the intruder's and the worker reads first.
    sent = await bus.js.get_last_msg(f"GEN_{PARKED.upper()}", subjects.gen(PARKED, "batch"))
    stolen = {moves.RECORD_SEAL: sent.headers[moves.RECORD_SEAL]}
    await publish(bus, PARKED, "interactive", raw(
        task_id, model="digits", class_label=7, steps=3, num_images=1, width=16, height=16,
        cluster=PARKED), headers=stolen)
    door.start_worker("w-parked", PARKED)
    await _victim_intact(door, bus, writes, task_id, body)


async def test_a_raw_publish_under_a_running_tasks_id_is_refused_and_the_task_finishes(
        door: Door, bus: Bus, writes: Writes) -> None:
    body = {"model": "digits", "class_label": 3, "steps": 40, "num_images": 1,
            "cluster": DOOR}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{door.port}") as http:
        r = await http.post("/v1/generations", json=body)
    assert r.status_code == 202, r.text
    task_id = r.json()["id"]
    # Published once the victim runs; should it be done by the time the intruder is
    # handled (a fast machine), the intruder meets its finished record: a conflict too.
    await wait_started(bus, task_id)
    await publish(bus, DOOR, "interactive", raw(
        task_id, model="digits", class_label=7, steps=3, num_images=1, width=16, height=16,
        cluster=DOOR))
    await _victim_intact(door, bus, writes, task_id, body)


# ------------------------------------------------------------------------------- fuzzing

fields = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["digits", "tiny-text", "noop", "huge", "nope", "", "a.b"]),
    "prompt": st.none() | st.sampled_from(["", "a cat", "x" * 3000]) | st.integers(),
    "class_label": st.none() | st.sampled_from([0, 5, 9, 10, -1, "3"]),
    "width": st.sampled_from([8, 16, 24, 4096, 0, -8, "wide"]),
    "height": st.sampled_from([16, 15, 8192]),
    "steps": st.sampled_from([1, 2, 0, -1, 5000, 1.5, "x"]),
    "guidance": st.sampled_from([0.0, 1.0, 5.0, 1e308, -1.0]),
    "num_images": st.sampled_from([1, 2, 0, -1, 9, 300]),
    "seed": st.sampled_from([0, 7, -1, 2**40]),
    "lane": st.sampled_from(["interactive", "batch", "urgent"]),
    "cluster": st.sampled_from([DOOR, "", "other", "../x"]),
    "noop": st.booleans(),
    "extra_field": st.text(max_size=8),
})


async def _fuzz(door: Door, bodies: list[dict[str, Any]]) -> None:
    async with door.bus() as bus:
        sent: dict[str, bytes] = {}
        for body in bodies:
            task_id = uuid.uuid4().hex
            sent[task_id] = raw(task_id, **body)
            await publish(bus, DOOR, "interactive", sent[task_id])
        for task_id, data in sent.items():
            await _ends_once(bus, task_id, data)
        assert door.worker.running and door.worker.health() is not None  # no crash


async def _ends_once(bus: Bus, task_id: str, data: bytes) -> None:
    """A good task succeeds; a bad one fails with the reason, never started; one that is
    not a task at all is dead-lettered and makes no record."""
    try:
        task = decode(data, GenerationTask)
    except Exception:
        await dead_letters(bus, f"GEN_{DOOR.upper()}", lambda ls: any(
            task_id.encode() in d.data for d in ls))
        assert await (await bus.typed(KV_TASKS, TaskRecord)).get(task_id) is None
        return
    rec = await terminal(bus, task_id)
    if check_task(task, REGISTRY, JobLimits()):
        assert rec.state == TaskState.failed and rec.started_at is None, rec
        assert rec.reason.startswith("rejected: invalid task: "), rec.reason
    else:
        assert rec.state == TaskState.succeeded, (rec, data)


@pytest.mark.slow
def test_fuzzed_payloads_on_the_bus_never_crash_the_worker_and_each_ends_once(
        door: Door) -> None:
    @settings(max_examples=3, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(st.lists(fields, min_size=4, max_size=14))
    @example([{"model": "noop"}, {"model": "digits", "class_label": 1, "steps": 1,
               "width": 16, "height": 16},
              {"model": "digits", "steps": 5000}, {"steps": "x"}])
    def check(bodies: list[dict[str, Any]]) -> None:
        asyncio.run(_fuzz(door, bodies))

    check()
