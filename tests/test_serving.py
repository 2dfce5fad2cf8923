"""Generation end to end: HTTP in, images out, with the gateway and workers as real
child processes on a real NATS server and S3 endpoint, and what each survives."""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.cli.devstack import S3Server, free_port
from tandem.common import streams, subjects
from tandem.common import tasks as moves
from tandem.common.bus import Bus
from tandem.common.events import GenerationTask, TaskRecord, TaskState, encode
from tandem.common.storage import s3_client
from tandem.common.streams import KV_TASKS, core_streams
from tests.checkpoint_support import FaultProxy
from tests.conftest import FILL, PYTHON, fill_store, small_store, thread_cpus, torch_loaded
from tests.serving_stack import (
    DEADLINE,
    Child,
    Progress,
    ServingStack,
    Writes,
    dead_letters,
    gateway,
    http_port,
    terminal,
    wait_record,
    worker,
)

MAIN = "main"
FAULT_MODELS = json.dumps([
    {"name": "digits", "source": "builtin:class-unet", "conditioning": "class_label",
     "num_classes": 10, "sizes": [16], "max_steps": 1000},
    {"name": "tiny-text", "source": "builtin:tiny-text", "conditioning": "text",
     "max_size": 64, "default_steps": 4, "max_guidance": 20, "default_guidance": 3.0},
    {"name": "crasher", "source": "fault:kill", "max_steps": 10},
    {"name": "poisoned", "source": "fault:raise@666", "max_steps": 10},
    {"name": "poison-kill", "source": "fault:kill@666", "max_steps": 10},
])


class Stack(ServingStack):
    """One NATS server, the session's S3, a gateway and the main cluster's worker."""

    def __init__(self, root: Path, s3: S3Server) -> None:
        super().__init__(root, s3, "serving", FAULT_MODELS)
        self.port = 0  # the first gateway picks it; a restarted one serves on the same
        self.gateway: Child | None = None

    def start_gateway(self) -> Child:
        clusters = ",".join([MAIN, "prio", "kill", "crash", "s3down", "idle", "term", "apart",
                             "held", "overlap", "poison", "poisonkill", "poisonself"])
        gw = gateway(self.root, f"gateway-{len(self.children)}", self.port,
                     **self.env(clusters=clusters, cluster=MAIN, sse_ping="1",
                                routing="static"))  # no cluster agents in this stack
        self.children.append(gw.start())
        self.port = http_port(gw)
        self.gateway = gw
        return gw

    def start_worker(self, name: str, cluster: str, **extra: str) -> Child:
        w = worker(self.root, name, **self.env(cluster=cluster, node=name, **extra))
        self.children.append(w.start())
        return w

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[Stack]:
    st = Stack(tmp_path_factory.mktemp("serving"), s3_server)
    st.nats.start()
    try:
        st.start_gateway()
        st.start_worker("w-main", MAIN, serve="digits,tiny-text", max_batch="8",
                        ack_wait="10")
        yield st
    finally:
        st.stop()


@pytest.fixture
async def bus(stack: Stack) -> AsyncIterator[Bus]:
    async with stack.bus() as b:
        yield b


@pytest.fixture
async def writes(bus: Bus) -> AsyncIterator[Writes]:
    w = await Writes().start(bus)
    yield w
    await w.stop()


@pytest.fixture
async def http(stack: Stack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        yield client


async def submit(http: httpx.AsyncClient, **body: Any) -> str:
    r = await http.post("/v1/generations", json=body)
    assert r.status_code == 202, r.text
    return r.json()["id"]


async def sse(http: httpx.AsyncClient, task_id: str) -> list[tuple[str, Any]]:
    """Every SSE event of a task until the stream ends."""
    events: list[tuple[str, Any]] = []
    async with http.stream("GET", f"/v1/generations/{task_id}/events") as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        kind = None
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((kind or "message", json.loads(line[6:])))
    return events


async def images_of(http: httpx.AsyncClient, view: dict[str, Any]) -> list[bytes]:
    out = []
    for ref in view["images"]:
        r = await http.get(ref["url"])
        assert r.status_code == 200, r.text
        out.append(r.content)
    return out


def s3_keys(stack: Stack, task_id: str) -> list[str]:
    s3 = s3_client(stack.settings())
    listed = s3.list_objects_v2(Bucket=stack.bucket, Prefix=f"images/{task_id}/")
    return sorted(o["Key"] for o in listed.get("Contents", []))


# ------------------------------------------------------------------------------ happy path


@pytest.mark.slow
async def test_text_task_streams_every_step_then_final_state_with_presigned_images(
        stack: Stack, http: httpx.AsyncClient, bus: Bus, writes: Writes) -> None:
    task_id = await submit(http, model="tiny-text", prompt="a red fox", num_images=2,
                           steps=5, seed=11)
    events = await sse(http, task_id)
    kinds = [k for k, _ in events]
    assert kinds[-1] == "final"
    final = events[-1][1]
    assert final["state"] == "succeeded", final
    # A client may connect after a few steps ran; the steps it saw are in order, one each.
    steps = [d["step"] for k, d in events if k == "progress"]
    assert steps == sorted(set(steps)) and all(1 <= s <= 5 for s in steps)
    assert final["cluster"] == MAIN and final["worker"] == "w-main"
    assert final["started_at"] and final["finished_at"] and final["progress"] == 1.0
    pngs = await images_of(http, final)
    assert len(pngs) == 2 and all(p.startswith(b"\x89PNG\r\n\x1a\n") for p in pngs)
    assert s3_keys(stack, task_id) == [f"images/{task_id}/0.png", f"images/{task_id}/1.png"]
    # The record is the task's one source of truth and its result: written queued by the
    # gateway, succeeded once by the worker, and running between only if the run lasted
    # longer than the worker's progress interval.
    states = await writes.until_terminal(task_id)
    assert states[0] == "queued" and states[-1] == "succeeded", states
    assert set(states[1:-1]) <= {"running"}, states


async def test_same_seed_and_parameters_give_byte_identical_pngs(
        stack: Stack, http: httpx.AsyncClient, bus: Bus) -> None:
    bodies = [dict(model="digits", class_label=3, steps=8, seed=5),
              dict(model="digits", class_label=3, steps=8, seed=5),
              dict(model="digits", class_label=3, steps=8, seed=6),
              dict(model="tiny-text", prompt="a lighthouse", steps=3, seed=9),
              dict(model="tiny-text", prompt="a lighthouse", steps=3, seed=9)]
    ids = [await submit(http, **b) for b in bodies]
    for task_id in ids:
        assert (await terminal(bus, task_id)).state == TaskState.succeeded
    pngs = []
    for task_id in ids:
        view = (await http.get(f"/v1/generations/{task_id}")).json()
        pngs.append((await images_of(http, view))[0])
    assert pngs[0] == pngs[1]
    assert pngs[0] != pngs[2]
    assert pngs[3] == pngs[4]


async def test_interactive_runs_before_older_batch_tasks_and_compatible_ones_share_a_call(
        stack: Stack, http: httpx.AsyncClient, bus: Bus) -> None:
    # Queued before any worker of cluster "prio" exists, so the worker sees them all at once.
    batch = [await submit(http, model="digits", class_label=i, steps=6, seed=i,
                          lane="batch", cluster="prio") for i in range(3)]
    urgent = await submit(http, model="digits", class_label=9, steps=7, seed=1,
                          cluster="prio")
    progress = await Progress().start(bus, urgent)
    # Every task's steps on one subscription, in the order the worker sent them: it runs
    # one call at a time and sends a call's steps as they run, so the order of the steps
    # is the order of the calls. (A record's finished_at is not: a task ends after its
    # own upload, which runs beside the next call.)
    stepped: list[str] = []
    ours = {urgent, *batch}

    async def on_step(msg: Any) -> None:
        task_id = msg.subject.rsplit(".", 1)[-1]
        if task_id in ours:
            stepped.append(task_id)

    steps = await bus.nc.subscribe(subjects.GEN_PROGRESS.wildcard, cb=on_step)
    w = stack.start_worker("w-prio", "prio", serve="digits", linger="0.5")
    try:
        recs = {t: await terminal(bus, t) for t in [urgent, *batch]}
        assert all(r.state == TaskState.succeeded for r in recs.values())
        health = w.wait_healthy()
        assert health["batches"] == 2  # the urgent task alone, then the three batch tasks
        # Subscribed before the task ran: every step's progress, once, in order.
        assert progress.steps == list(range(1, 8))
        await bus.synced()  # every step sent before the records' ends has arrived
        urgent_at = [i for i, t in enumerate(stepped) if t == urgent]
        batch_at = [i for i, t in enumerate(stepped) if t != urgent]
        assert urgent_at and batch_at and max(urgent_at) < min(batch_at), stepped
    finally:
        await steps.unsubscribe()
        await progress.stop()
        w.kill()


async def test_cancel_queued_task_never_runs(stack: Stack, http: httpx.AsyncClient,
                                            bus: Bus) -> None:
    # Cluster "idle" has no worker yet: the task stays queued.
    task_id = await submit(http, model="digits", class_label=1, steps=3, cluster="idle")
    r = await http.delete(f"/v1/generations/{task_id}")
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    assert (await http.delete(f"/v1/generations/{task_id}")).json()["state"] == "cancelled"
    w = stack.start_worker("w-idle", "idle", serve="digits")
    try:
        # The worker takes the message, reads the record, and acks without running it.
        nxt = await submit(http, model="digits", class_label=2, steps=2, cluster="idle")
        assert (await terminal(bus, nxt)).state == TaskState.succeeded
        rec = await terminal(bus, task_id)
        assert rec.state == TaskState.cancelled and rec.started_at is None
        assert s3_keys(stack, task_id) == []
    finally:
        w.kill()


async def test_cancel_running_task_stops_it_before_its_end_and_frees_the_worker(
        stack: Stack, http: httpx.AsyncClient, bus: Bus, writes: Writes) -> None:
    task_id = await submit(http, model="digits", class_label=2, steps=1000, seed=3)
    progress = await Progress().start(bus, task_id)
    try:
        await progress.wait(3)
        r = await http.delete(f"/v1/generations/{task_id}")
        assert r.status_code == 200 and r.json()["state"] == "cancelled"
        # The worker is free again: a new task runs to completion right after.
        nxt = await submit(http, model="digits", class_label=2, steps=2, seed=3)
        assert (await terminal(bus, nxt)).state == TaskState.succeeded
    finally:
        await progress.stop()
    health = stack.children[1].wait_healthy()
    assert task_id not in health["running"]
    # It stopped long before its last step (the batcher's own test shows it stops after
    # the step in flight: tests/test_worker.py).
    assert progress.steps and max(progress.steps) < 1000
    rec = await terminal(bus, task_id)
    assert rec.state == TaskState.cancelled and rec.images == []
    assert "succeeded" not in writes.states(task_id)
    assert s3_keys(stack, task_id) == []
    assert (await http.delete(f"/v1/generations/{nxt}")).status_code == 409


async def test_a_task_cancelled_in_its_record_alone_while_it_runs_leaves_no_image(
        stack: Stack, http: httpx.AsyncClient, bus: Bus) -> None:
    """A gateway that dies between writing ``cancelled`` and the cancel notice: the
    worker never hears of it, the call runs to its end, and the record still decides.
    The worker's S3 goes through a proxy that parks its image uploads: the cancel is
    written once the call has ended and its first image is on its way (and the task not
    yet finished: it cannot be, its images are not stored), so the worker's commit of
    ``succeeded`` is refused and the images it stored are deleted."""
    from tandem.common import tasks as moves

    proxy = FaultProxy(stack.s3.url).start()
    proxy.hold(lambda method, path: method == "PUT" and "/images/" in path)
    w = stack.start_worker("w-held", "held", serve="digits", s3_endpoint=proxy.url)
    try:
        task_id = await submit(http, model="digits", class_label=4, steps=4, seed=8,
                               num_images=2, cluster="held")
        assert await asyncio.to_thread(proxy.holding.wait, DEADLINE), "no image upload"
        kv = await bus.typed(KV_TASKS, TaskRecord)
        rec = await kv.update(task_id, moves.to_cancelled("the gateway died before its notice"))
        assert rec is not None and rec.state == TaskState.cancelled
        proxy.release()
        await asyncio.to_thread(w.wait_healthy, lambda h: h["running"] == []
                                and not h["inflight"])
        # What is stored, once the worker is done with it.
        got = await kv.get(task_id)
        assert got is not None and got[0].state == TaskState.cancelled and got[0].images == []
        assert s3_keys(stack, task_id) == []
        # The images were stored, then deleted (one DeleteObjects request).
        assert ("POST", f"/{stack.bucket}?delete") in proxy.requests
    finally:
        w.kill()
        proxy.stop()


async def test_a_slow_upload_holds_up_no_other_call_of_the_same_fetch(
        stack: Stack, http: httpx.AsyncClient, bus: Bus) -> None:
    """Each pipeline call's end (upload, commit) runs beside the others of its fetch: a
    task whose upload hangs keeps its own result back, not its neighbours'. Two tasks
    queued before the worker starts come in one fetch; with one image per call they
    are two calls, the first one's upload parked by the S3 proxy until the second task
    has succeeded."""
    proxy = FaultProxy(stack.s3.url).start()
    try:
        slow, quick = [await submit(http, model="digits", class_label=i, steps=2, seed=i,
                                    cluster="overlap") for i in (1, 2)]
        proxy.hold(lambda method, path: method == "PUT" and f"/images/{slow}/" in path)
        w = stack.start_worker("w-overlap", "overlap", serve="digits", max_batch="1",
                               s3_endpoint=proxy.url)
        try:
            assert await asyncio.to_thread(proxy.holding.wait, DEADLINE), "no image upload"
            rec = await terminal(bus, quick)
            assert rec.state == TaskState.succeeded and len(rec.images) == 1
            kv = await bus.typed(KV_TASKS, TaskRecord)
            got = await kv.get(slow)  # still parked: not ended, and no image stored
            assert got is not None and not got[0].state.terminal, got
            assert s3_keys(stack, slow) == []
            proxy.release()
            rec = await terminal(bus, slow)
            assert rec.state == TaskState.succeeded and len(rec.images) == 1
            # One call each (a fetch takes up to max_batch + 2 x max_batch = 3 tasks).
            health = w.wait_healthy(lambda h: not h["inflight"])
            assert health["batches"] == 2, health
        finally:
            w.kill()
    finally:
        proxy.stop()


# -------------------------------------------------------------------------------- failures


async def test_worker_killed_mid_generation_task_is_redelivered_with_exactly_one_result(
        stack: Stack, http: httpx.AsyncClient, bus: Bus, writes: Writes) -> None:
    env = dict(serve="digits", ack_wait="2")
    first = stack.start_worker("w-kill-1", "kill", **env)
    task_id = await submit(http, model="digits", class_label=7, steps=60, seed=2,
                           num_images=2, cluster="kill")
    progress = await Progress().start(bus, task_id)
    try:
        await progress.wait(2)
        first.kill()
    finally:
        await progress.stop()
    second = stack.start_worker("w-kill-2", "kill", **env)
    try:
        rec = await terminal(bus, task_id)
        assert rec.state == TaskState.succeeded, rec.reason
        assert rec.worker == "w-kill-2" and rec.attempts == 2
        assert (await writes.until_terminal(task_id)).count("succeeded") == 1
        assert s3_keys(stack, task_id) == [f"images/{task_id}/0.png", f"images/{task_id}/1.png"]
        view = (await http.get(f"/v1/generations/{task_id}")).json()
        assert len(view["images"]) == 2
    finally:
        second.kill()


async def test_a_pipeline_apart_makes_the_same_images_and_its_killed_child_loses_no_task(
        stack: Stack, http: httpx.AsyncClient, bus: Bus, writes: Writes) -> None:
    """TANDEM_PIPELINE_PROCESS: the calls run in a child process of the worker's, pinned
    (TANDEM_PIPELINE_CPU_COUNT: the last of its CPUs) to a CPU the worker's own threads
    leave to it."""
    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= 2, f"pinning needs 2 CPUs to be told apart; this process may use {cpus}"
    w = stack.start_worker("w-apart", "apart", serve="digits", pipeline_process="1",
                           pipeline_cpu_count="1")
    try:
        body = dict(model="digits", class_label=3, steps=8, seed=5)
        same = [await submit(http, **body), await submit(http, **body, cluster="apart")]
        pngs = []
        for task_id in same:
            assert (await terminal(bus, task_id)).state == TaskState.succeeded
            view = (await http.get(f"/v1/generations/{task_id}")).json()
            pngs.append((await images_of(http, view))[0])
        assert pngs[0] == pngs[1]  # the worker's own process and the child: the same bits
        health = w.wait_healthy()["pipeline"]
        pid = health["processes"]["digits"]
        assert pid != w.proc.pid
        assert health["cpus"] == cpus[-1:] and health["worker_cpus"] == cpus[:-1]
        assert thread_cpus(pid) == {cpus[-1]} and thread_cpus(w.proc.pid) == set(cpus[:-1])
        # torch is the child's alone (the worker's start and memory), one thread a CPU.
        assert torch_loaded(pid) and not torch_loaded(w.proc.pid)
        assert health["torch_threads"] == 1

        # 100 steps: at rest ~6.6 ms each, so the kill, sent on step 2, lands mid-call
        # (attempts == 2 below says it did); the attempt after it runs them all again,
        # and a loaded box took over 0.25 s a step (300 steps outlasted the deadline).
        task_id = await submit(http, model="digits", class_label=7, steps=100, seed=2,
                               cluster="apart")
        progress = await Progress().start(bus, task_id)
        try:
            await progress.wait(2)  # running in the child: kill it mid-call
            os.kill(pid, signal.SIGKILL)
        finally:
            await progress.stop()
        rec = await terminal(bus, task_id)
        assert rec.state == TaskState.succeeded, rec.reason
        assert rec.worker == "w-apart" and rec.attempts == 2  # delivered again, here
        assert (await writes.until_terminal(task_id)).count("succeeded") == 1
        assert s3_keys(stack, task_id) == [f"images/{task_id}/0.png"]
        again = w.wait_healthy()["pipeline"]["processes"]["digits"]
        assert again not in (None, pid) and thread_cpus(again) == {cpus[-1]}  # the new child too
        assert "died during a call (exit status -9)" in w.tail(20000)
    finally:
        w.kill()


async def test_malformed_tasks_go_to_dlq_the_worker_goes_on_and_no_record_is_touched(
        stack: Stack, http: httpx.AsyncClient, bus: Bus) -> None:
    # A recorded task's id on a payload that is not a task: dead-lettered with the
    # reason; the record is not its to end (it belongs to the body recorded under it).
    tasks = TypedKVTasks(bus)
    bad_id = uuid.uuid4().hex
    await tasks.create(bad_id, GenerationTask(task_id=bad_id, model="digits", cluster=MAIN))
    subject = subjects.gen(MAIN, "interactive")
    await bus.publish(subject, json.dumps(
        {"task_id": bad_id, "model": "digits", "width": "wide"}).encode(), msg_id=bad_id)
    await bus.publish(subject, b"\x00not json at all", msg_id=uuid.uuid4().hex)
    letters = await dead_letters(bus, f"GEN_{MAIN.upper()}", lambda ls: any(
        d.data.startswith(b"\x00not json") for d in ls) and any(
        bad_id.encode() in d.data for d in ls))
    mine = [d for d in letters if bad_id.encode() in d.data]
    assert len(mine) == 1
    assert "undecodable" in mine[0].reason and "width" in mine[0].reason
    ok = await submit(http, model="digits", class_label=0, steps=2)
    assert (await terminal(bus, ok)).state == TaskState.succeeded  # the worker went on
    got = await (await bus.typed(KV_TASKS, TaskRecord)).get(bad_id)
    assert got is not None and got[0].state == TaskState.queued and got[0].reason == ""


async def until_ended(stack: Stack, done: asyncio.Future[Any], name: str, cluster: str,
                      most: int, **env: str) -> list[Child]:
    """Start a worker again each time it dies (a supervisor's restart), until ``done``;
    the workers started, at most ``most``."""
    started: list[Child] = []
    while not done.done():
        w = stack.start_worker(f"{name}-{len(started)}", cluster, **env)
        started.append(w)
        # The worker dies on a task (SIGKILL from inside) or the tasks end.
        while w.running and not done.done():
            await asyncio.wait({done}, timeout=0.2)
        w.kill()
        assert len(started) <= most, "the tasks never ended"
    return started


async def test_task_that_keeps_killing_its_worker_fails_naming_the_deaths(
        stack: Stack, http: httpx.AsyncClient, bus: Bus) -> None:
    """A task that kills its worker's process in a call of its own: the next worker on
    the host finds it in the dead worker's ledger slot and counts the death on its
    record, and its failure says so. (Before, it failed as ``exhausted: delivered 3
    times``, saying nothing of why.)"""
    env = dict(serve="crasher", fault_injection="1", ack_wait="1", max_deliver="3")
    task_id = await submit(http, model="crasher", steps=2, cluster="crash")
    seen: list[TaskRecord] = []
    done = asyncio.ensure_future(terminal(bus, task_id, seen=seen))
    try:
        starts = await until_ended(stack, done, "w-crash", "crash", 5, **env)
        rec = done.result()
    finally:
        done.cancel()
    assert rec.state == TaskState.failed
    # Its third delivery is the bus's last, kept for the dead letter: exhausted, and why.
    assert rec.reason == ("exhausted: delivered 3 times; the worker process died in 2 of "
                          "its pipeline calls (2 of them its own)"), rec.reason
    assert (rec.crashes, rec.crashes_alone) == (2, 2)
    assert len(starts) == 3
    assert [task_id] in [d["tasks"] for d in logged(starts[1], "worker.dead_call")]
    assert TaskState.succeeded not in {r.state for r in seen}
    # The dead letter says what the bus knew; the record adds what the ledger found.
    await dead_letters(bus, "GEN_CRASH", lambda ls: any(
        task_id.encode() in d.data and d.reason == "exhausted: delivered 3 times"
        for d in ls))


@pytest.mark.parametrize(("model", "cluster", "apart", "error"), [
    ("poisoned", "poison", "0", "RuntimeError(\"injected fault 'raise@666'\")"),
    # The pipeline apart: the poison kills the model's child process, not the worker.
    ("poison-kill", "poisonkill", "1",
     "PipelineProcessDied(*the pipeline process of poison-kill died during a call (exit "
     "status -9)*"),
], ids=["raises", "kills-its-child"])
async def test_a_task_that_fails_its_batched_call_fails_alone_and_its_batch_mates_succeed(
        stack: Stack, http: httpx.AsyncClient, bus: Bus, model: str, cluster: str,
        apart: str, error: str) -> None:
    """Three compatible tasks queued before the worker starts share its first call; the
    call fails on one (seed 666). Each then runs alone: the other two succeed on their
    first delivery, the poison fails naming its error. (Before, the failed call's error
    was every task's, and the three, delivered again together, failed together.)"""
    ids = [await submit(http, model=model, steps=2, seed=seed, cluster=cluster)
           for seed in (1, 666, 2)]
    w = stack.start_worker(f"w-{cluster}", cluster, serve=model, fault_injection="1",
                           max_batch="8", max_deliver="2", pipeline_process=apart)
    try:
        good = [await terminal(bus, ids[0]), await terminal(bus, ids[2])]
        bad = await terminal(bus, ids[1])
        assert w.running, w.tail()
    finally:
        w.kill()
    for rec in good:
        assert rec.state == TaskState.succeeded and rec.attempts == 1, rec
        assert len(rec.images) == 1
    assert bad.state == TaskState.failed, bad
    assert fnmatch.fnmatchcase(bad.reason, f"failed 1 times: {error}"), bad.reason
    [split] = logged(w, "worker.batch_split")
    assert split["tasks"] == ids


async def test_a_task_that_kills_its_worker_in_a_batched_call_takes_no_batch_mate_with_it(
        stack: Stack, http: httpx.AsyncClient, bus: Bus) -> None:
    """Three compatible tasks queued before the worker starts share its first call, and
    seed 666 kills the worker's own process in it (the model in the worker, not apart).
    The next worker finds the call's three tasks in the dead worker's ledger slot: each
    comes back alone, the batch-mates succeed, and the poison, after it killed the
    worker twice more alone, is refused. (Before, the three came back together, were
    batched together and died together until the bus gave up on all of them.)"""
    ids = [await submit(http, model="poison-kill", steps=2, seed=seed, cluster="poisonself")
           for seed in (1, 666, 2)]
    done = asyncio.ensure_future(asyncio.gather(*(terminal(bus, t) for t in ids)))
    try:
        starts = await until_ended(stack, done, "w-poisonself", "poisonself", 6,
                                   serve="poison-kill", fault_injection="1", max_batch="8",
                                   ack_wait="1", pipeline_process="0")
        good1, bad, good2 = done.result()
    finally:
        done.cancel()
    for rec in (good1, good2):
        assert rec.state == TaskState.succeeded and len(rec.images) == 1, rec
        assert (rec.crashes, rec.crashes_alone) == (1, 0)  # their one call with the poison
    assert bad.state == TaskState.failed and (bad.crashes, bad.crashes_alone) == (3, 2), bad
    shown = (await http.get(f"/v1/generations/{ids[1]}")).json()
    assert (shown["crashes"], shown["crashes_alone"], shown["reason"]) == (3, 2, bad.reason)
    assert bad.reason == ("rejected: the worker process died in 3 of its pipeline calls (2 of "
                          "them its own): refused after TANDEM_MAX_CRASHES=2 in a call of its "
                          "own"), bad
    # The batched death, two deaths alone, then a worker that refused it and lived.
    assert len(starts) == 4
    assert ids in [d["tasks"] for d in logged(starts[1], "worker.dead_call")]
    assert [ids[1]] in [d["tasks"] for d in logged(starts[2], "worker.dead_call")]


async def test_s3_unreachable_retries_then_fails_and_never_succeeds_without_images(
        stack: Stack, http: httpx.AsyncClient, bus: Bus, writes: Writes) -> None:
    dead_s3 = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    # Retrying for longer than the ack wait: the task's in-progress acks hold it through
    # its upload, so its one delivery fails on the upload (a redelivery meanwhile would
    # be dead-lettered as exhausted instead).
    w = stack.start_worker("w-s3down", "s3down", serve="digits", s3_endpoint=dead_s3,
                           s3_max_attempts="1", upload_retry_for="4", max_deliver="2",
                           ack_wait="2")
    try:
        task_id = await submit(http, model="digits", class_label=5, steps=2,
                               cluster="s3down")
        seen: list[TaskRecord] = []
        rec = await terminal(bus, task_id, seen=seen)
        assert rec.state == TaskState.failed
        assert "image upload failed after" in rec.reason, rec.reason
        assert all(r.state != TaskState.succeeded for r in seen) and rec.images == []
        assert "upload_retry" in w.tail(100_000)
        assert "succeeded" not in writes.states(task_id)
        await dead_letters(bus, "GEN_S3DOWN", lambda ls: any(
            task_id.encode() in d.data and d.reason == rec.reason for d in ls))
    finally:
        w.kill()


async def test_sigterm_hands_a_long_running_task_back_and_the_worker_exits_cleanly(
        stack: Stack, http: httpx.AsyncClient, bus: Bus) -> None:
    w = stack.start_worker("w-term", "term", serve="digits", drain_timeout="3",
                           progress_kv_interval="0.2")
    task_id = await submit(http, model="digits", class_label=6, steps=1000, cluster="term")
    # Running for longer than the progress interval: the record says so.
    await wait_record(bus, task_id, lambda rec: rec.state == TaskState.running)
    assert w.proc is not None
    w.proc.terminate()
    assert await asyncio.to_thread(w.proc.wait, 60) == 0
    # Handed back (nak), not left to its 30 s AckWait: the queue offers it again at once.
    sub = await bus.js.pull_subscribe_bind(durable="workers-term-interactive",
                                           stream="GEN_TERM")
    try:
        [msg] = await sub.fetch(1, timeout=10)
        assert msg.metadata.num_delivered == 2
        await msg.ack()
    finally:
        await sub.unsubscribe()
    rec = (await http.get(f"/v1/generations/{task_id}")).json()
    assert rec["state"] == "running" and rec["images"] == []
    assert (await http.delete(f"/v1/generations/{task_id}")).json()["state"] == "cancelled"


async def test_gateway_restart_keeps_status_results_and_sse_for_earlier_tasks(
        stack: Stack, http: httpx.AsyncClient, bus: Bus) -> None:
    done = await submit(http, model="digits", class_label=8, steps=2, seed=4)
    assert (await terminal(bus, done)).state == TaskState.succeeded
    before = (await http.get(f"/v1/generations/{done}")).json()
    queued = await submit(http, model="digits", class_label=8, steps=2, cluster="idle")
    assert stack.gateway is not None
    stack.gateway.kill()
    stack.start_gateway()
    after = (await http.get(f"/v1/generations/{done}")).json()
    assert after["state"] == "succeeded" and after["images"][0]["key"] == \
        before["images"][0]["key"]
    assert await images_of(http, after) == await images_of(http, before)
    events = await sse(http, done)
    assert events == [("final", events[0][1])] and events[0][1]["state"] == "succeeded"
    assert (await http.get(f"/v1/generations/{queued}")).json()["state"] == "queued"
    assert (await http.delete(f"/v1/generations/{queued}")).json()["state"] == "cancelled"


class TypedKVTasks:
    """The gateway's first step, done by hand: record a task as queued."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def create(self, task_id: str, task: GenerationTask) -> None:
        from tandem.common import tasks as moves

        kv = await self.bus.typed(KV_TASKS, TaskRecord)
        await kv.create(task_id, moves.queued(task, task.cluster))


def test_generate_command_writes_the_images_of_a_task(stack: Stack, tmp_path: Path) -> None:
    out = subprocess.run(
        [PYTHON, "-m", "tandem.cli.main", "generate", "3", "-n", "2", "-o", str(tmp_path),
         "--steps", "2", "--url", stack.url], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    written = sorted(tmp_path.glob("*.png"))
    assert len(written) == 2 and all(p.read_bytes().startswith(b"\x89PNG") for p in written)


def test_a_worker_is_not_ready_while_its_models_load(stack: Stack, tmp_path: Path) -> None:
    # A model folder whose model_index.json is a FIFO: loading blocks in open() until a
    # writer comes, so the worker is caught mid-load for as long as the test needs.
    folder = tmp_path / "slow-model"
    folder.mkdir()
    os.mkfifo(folder / "model_index.json")
    models = json.dumps([{"name": "slow", "source": f"dir:{folder}", "max_steps": 10}])
    w = stack.start_worker("w-slow", "idle", serve="slow", models=models,
                           model_root=str(tmp_path))
    url = f"http://127.0.0.1:{w.metrics()}/healthz"
    try:
        deadline = time.monotonic() + DEADLINE
        while True:
            assert w.running, w.tail()
            assert time.monotonic() < deadline, f"never seen loading: {w.tail()}"
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    raise AssertionError(f"ready while loading: {resp.read()!r}")
            except urllib.error.HTTPError as err:
                health = json.loads(err.read())
                if health.get("loading") == ["slow"]:
                    assert err.code == 503
                    break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass  # /healthz not up yet
            time.sleep(0.05)  # polling the child's readiness endpoint
        assert health["status"] == "unavailable" and health["ready"] is False
        assert health["models_loaded"] == []
    finally:
        w.kill()


async def test_a_full_bus_holds_a_made_task_until_its_commit_fits_and_runs_it_once(
        tmp_path: Path, s3_server: S3Server) -> None:
    """A JetStream store with no room for a result (1 MB, filled by another program's
    stream once the task is queued): the worker makes the task and holds it, trying its
    commit again in place, rather than hand it back to be run again until the DLQ takes
    it; once room is made, the task succeeds on its first delivery."""
    st = ServingStack(tmp_path, s3_server, "full")
    st.nats.config_path = small_store(tmp_path)
    st.nats.start()
    try:
        async with st.bus() as bus:
            await bus.provision([*core_streams(), streams.gen_stream("c1"),
                                 *streams.gen_consumers("c1", ack_wait=5.0)])
            task = GenerationTask(task_id=uuid.uuid4().hex, model="noop", noop=True, steps=1,
                                  cluster="c1")
            kv = await bus.typed(KV_TASKS, TaskRecord)
            rev = await kv.create(task.task_id, moves.queued(task, "c1"))
            data = encode(task)
            await bus.send([(subjects.gen("c1", task.lane), data, bus.headers(
                task.task_id, moves.seal(st.seal_key.encode(), rev, data)))])
            await fill_store(bus)
            w = worker(tmp_path, "w-full", **st.env(cluster="c1", node="w-full", serve="noop",
                                                    ack_wait="5"))
            st.children.append(w.start())
            # Its fifth try comes 7.5 s after the first: past its ack_wait (5 s), so
            # only its keepalive has kept the task from being delivered again.
            deadline = time.monotonic() + DEADLINE
            while max((line.get("tries", 0) for line in logged(w, "worker.commit_no_room")),
                      default=0) < 5:
                assert w.running and time.monotonic() < deadline, w.tail()
                await asyncio.sleep(0.05)  # polling the worker's log for its retries
            got = await kv.get(task.task_id)
            assert got is not None and got[0].state == TaskState.queued
            # An operator sees the stall on the worker's /healthz and /metrics.
            assert await waiting(w) == (1, 1.0)
            await bus.js.purge_stream(FILL)
            rec = await terminal(bus, task.task_id)
            assert rec.state == TaskState.succeeded and rec.attempts == 1, rec
            # The record is written before the worker reads the server's ack of it.
            while (now := await waiting(w)) != (0, 0.0):
                assert time.monotonic() < deadline, now
                await asyncio.sleep(0.05)  # polling the worker's /healthz
            info = await bus.js.consumer_info(subjects.gen_stream_name("c1"),
                                              streams.gen_consumer("c1", lane=task.lane).durable)
            assert info.num_redelivered == 0
            assert {line.get("error") for line in logged(w, "worker.commit_no_room")} == {
                "insufficient resources (JetStream error 503/10023)"}
    finally:
        st.stop()


async def test_a_model_that_fails_to_load_for_a_passing_reason_is_tried_again(
        tmp_path: Path, s3_server: S3Server) -> None:
    """A model folder still being copied (its ``model_index.json`` not there yet): the
    load error is not the task's, so the task is delivered again, and once the file is
    there the model loads and the task succeeds. (Before, any load error failed every
    task for the model at once.)"""
    folder = tmp_path / "models" / "flaky"
    save = ("import sys; from tandem.common.diffusion import build_tiny_text_pipeline; "
            "build_tiny_text_pipeline(seed=0).save_pretrained(sys.argv[1], "
            "safe_serialization=True)")
    await asyncio.to_thread(subprocess.run, [PYTHON, "-c", save, str(folder)], check=True,
                            capture_output=True, timeout=DEADLINE)
    index = folder / "model_index.json"
    real = index.read_bytes()
    index.unlink()
    models = json.dumps([{"name": "flaky", "source": f"dir:{folder}", "conditioning": "text",
                          "max_size": 64, "default_steps": 2, "max_guidance": 20,
                          "default_guidance": 3.0}])
    st = ServingStack(tmp_path, s3_server, "flaky", models)
    st.nats.start()
    try:
        async with st.bus() as bus:
            await bus.provision([*core_streams(), streams.gen_stream("c1"),
                                 *streams.gen_consumers("c1")])
            task = GenerationTask(task_id=uuid.uuid4().hex, model="flaky", prompt="a boat",
                                  steps=2, width=16, height=16, guidance=3.0, cluster="c1")
            kv = await bus.typed(KV_TASKS, TaskRecord)
            rev = await kv.create(task.task_id, moves.queued(task, "c1"))
            data = encode(task)
            await bus.send([(subjects.gen("c1", task.lane), data, bus.headers(
                task.task_id, moves.seal(st.seal_key.encode(), rev, data)))])
            w = worker(tmp_path, "w-flaky", **st.env(cluster="c1", node="w-flaky",
                                                     serve="flaky", preload="0",
                                                     model_root=str(tmp_path / "models")))
            st.children.append(w.start())
            deadline = time.monotonic() + DEADLINE
            while not logged(w, "consumer.handler_failed"):
                assert w.running and time.monotonic() < deadline, w.tail()
                await asyncio.sleep(0.05)  # polling the worker's log for the first failure
            index.write_bytes(real)  # the copy completes
            rec = await terminal(bus, task.task_id)
    finally:
        st.stop()
    assert rec.state == TaskState.succeeded and len(rec.images) == 1, rec
    # Each delivery before the file came failed on the load alone, and was delivered again.
    failed = logged(w, "consumer.handler_failed")
    assert rec.attempts == len(failed) + 1 >= 2, (rec.attempts, failed)
    assert all("cannot load model flaky" in line["error"] for line in failed), failed


async def waiting(w: Child) -> tuple[int, float]:
    """A worker's commits waiting for room: its /healthz count and its gauge."""
    base = f"http://127.0.0.1:{w.metrics()}"
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        health = (await client.get("/healthz")).json()
        text = (await client.get("/metrics")).text
    gauge = [float(line.split()[-1]) for line in text.splitlines()
             if line.startswith("tandem_worker_commits_waiting ")]
    assert len(gauge) == 1, text
    return health["commit_waiting"], gauge[0]


def logged(child: Child, event: str = "") -> list[dict[str, Any]]:
    """The JSON lines of a child's log so far (``event``: only those of that event)."""
    out = []
    for line in child.tail(1_000_000).splitlines():
        with contextlib.suppress(ValueError):
            got = json.loads(line)
            if isinstance(got, dict) and (not event or got.get("event") == event):
                out.append(got)
    return out
