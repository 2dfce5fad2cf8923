"""A pipeline call that never returns (a CUDA call after the GPU fell off the bus, a
driver deadlock) must not hold its tasks for ever (``TANDEM_CALL_STALL_TIMEOUT``).

Before, the worker kept the tasks of such a call alive with in-progress acks for as long
as the call hung, so no other worker ever got them, and its ``/healthz`` stayed green.
Real nats-server, S3 and worker processes; every call here is a ``fault:gate`` model's,
which makes a step only when the test writes a byte to its named pipe: a call that hangs
is one the test stops writing to, and nothing waits on a clock to make it so."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.cli import http
from tandem.cli.devstack import S3Server
from tandem.common import subjects
from tandem.common import tasks as moves
from tandem.common.bus import Bus
from tandem.common.events import GenerationTask, TaskRecord, TaskState, encode
from tandem.common.streams import KV_TASKS, core_streams
from tandem.inference_worker.ledger import CallLedger
from tests.serving_stack import (
    DEADLINE,
    Child,
    Progress,
    ServingStack,
    Writes,
    terminal,
    wait_record,
    worker,
)

STALL = "1"  # TANDEM_CALL_STALL_TIMEOUT of the workers whose calls hang here


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[ServingStack]:
    st = ServingStack(tmp_path_factory.mktemp("stall"), s3_server, "stall")
    st.nats.start()
    yield st  # each test starts its own workers on clusters of its own
    st.stop()


@pytest.fixture
async def bus(stack: ServingStack) -> AsyncIterator[Bus]:
    async with stack.bus() as b:
        await b.provision(core_streams())  # the task records' bucket, before a worker
        yield b


class Gate:
    """The named pipe of a ``fault:gate`` model: each byte written lets one step happen;
    closed, the call reading it ends at once. Opened to read and write here, so neither
    this end nor the pipeline's waits for the other to open."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path = path
        self.fd: int | None = os.open(path, os.O_RDWR)

    def step(self) -> None:
        assert self.fd is not None
        os.write(self.fd, b"s")

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@pytest.fixture
def gate(tmp_path: Path) -> Iterator[Gate]:
    g = Gate(tmp_path / "gate")
    yield g
    g.close()  # a call still reading it (in a child that outlives a test) ends


def _start(stack: ServingStack, name: str, cluster: str, source: str, **extra: str) -> Child:
    """A worker serving one model, ``gated``, from ``source``, with fault injection."""
    models = json.dumps([{"name": "gated", "source": source, "max_steps": 10_000}])
    w = worker(stack.root, name, **stack.env(cluster=cluster, node=name, models=models,
                                             serve="gated", fault_injection="1", **extra))
    stack.children.append(w.start())
    w.wait_healthy()
    return w


async def _publish(bus: Bus, cluster: str) -> GenerationTask:
    """A ``gated`` task with its ``queued`` record, published on ``cluster``'s queue."""
    task = GenerationTask(task_id=uuid.uuid4().hex, model="gated", seed=7, steps=10_000,
                          width=16, height=16, cluster=cluster)
    await (await bus.typed(KV_TASKS, TaskRecord)).create(task.task_id,
                                                         moves.queued(task, cluster))
    await bus.publish(subjects.gen(cluster, task.lane), encode(task), msg_id=task.task_id)
    return task


async def _health(w: Child, pred: Any = lambda status, body: True) -> dict[str, Any]:
    """The worker's /healthz body (whatever its status) once ``pred(status, body)`` holds:
    polling the worker's own endpoint, with a deadline."""
    url = f"http://127.0.0.1:{w.metrics()}/healthz"
    async with asyncio.timeout(DEADLINE):
        while True:
            resp = await asyncio.to_thread(http.get, url)
            if resp is not None and pred(resp.status_code, body := resp.json()):
                return body
            await asyncio.sleep(0.05)  # polling the worker's health endpoint


async def test_a_call_hung_in_the_worker_process_is_finished_elsewhere_and_its_worker_unhealthy(
        stack: ServingStack, bus: Bus, gate: Gate) -> None:
    """The call makes its first step, then never another: after the stall timeout its
    task is handed back (not blamed: its ledger slot is cleared, so killing the hung
    worker counts no crash on it) and a second worker finishes it, while the first
    answers 503 naming the stall and pulls nothing more."""
    cluster = f"hang{uuid.uuid4().hex[:8]}"
    hung = _start(stack, "w-hang", cluster, f"fault:gate@{gate.path}",
                  call_stall_timeout=STALL, drain_timeout="2")
    writes = await Writes().start(bus)  # every write of its record (ended with the bus)
    task = await _publish(bus, cluster)
    progress = await Progress().start(bus, task.task_id)
    gate.step()
    await progress.wait(1)  # it runs on the first worker, and will make no second step
    _start(stack, "w-well", cluster, "fault:raise@1")  # the same model, on a good device
    rec = await terminal(bus, task.task_id)
    assert rec.state == TaskState.succeeded and rec.worker == "w-well", rec
    await progress.stop()
    body = await _health(hung, lambda status, h: status == 503)
    assert body["ready"] is False and "made no step for 1 s" in body["stalled"], body
    # Not alive either: only a restart frees a call hung in the process (its liveness
    # probe's path; a worker loading models is not ready, yet alive).
    live = await asyncio.to_thread(http.get, f"http://127.0.0.1:{hung.metrics()}/livez")
    assert live is not None and live.status_code == 503, live
    assert "stalled" in live.json()["why"]
    assert body["running"] == [] and body["inflight"] == 0  # nothing held any more
    # Handed back noted (a task that stalls every worker fails saying so), never blamed.
    notes = [r.reason for r in writes.by_task[task.task_id]]
    assert any(n.startswith("handed back 1 times: its pipeline call stalled on w-hang")
               for n in notes), notes
    assert all(r.crashes == 0 for r in writes.by_task[task.task_id])
    # The orchestrator's restart: told to stop, the hung worker exits, though its call's
    # thread never ends (the runner cuts it off, naming it); what the next worker on its
    # host reads in the ledger names no call of its, so no crash is counted on the task.
    assert hung.proc is not None
    hung.proc.terminate()
    assert await asyncio.to_thread(hung.proc.wait, DEADLINE) == 0
    forced = [json.loads(line) for line in hung.tail(100_000).splitlines()
              if '"runner.exit_forced"' in line]
    assert len(forced) == 1 and any(t.startswith("pipeline") for t in forced[0]["threads"])
    found = CallLedger.open(stack.root / "calls")
    try:
        assert found.dead() == []
    finally:
        found.close()


async def test_a_hung_pipeline_process_is_killed_and_its_task_runs_again_on_a_fresh_one(
        stack: ServingStack, bus: Bus, gate: Gate) -> None:
    """Apart (``PIPELINE_PROCESS``): the child whose call stops stepping is killed, the
    task goes back to the queue (noted, not failed, not split), and the worker stays
    healthy and runs it again on a fresh child."""
    cluster = f"apart{uuid.uuid4().hex[:8]}"
    w = _start(stack, "w-apart", cluster, f"fault:gate@{gate.path}",
               call_stall_timeout=STALL, pipeline_process="1")
    first = (await _health(w, lambda status, h: status == 200))["pipeline"]["processes"]
    task = await _publish(bus, cluster)
    progress = await Progress().start(bus, task.task_id)
    gate.step()
    await progress.wait(1)
    # Handed back: noted on its record before its nak.
    await wait_record(bus, task.task_id, lambda r: "stalled on w-apart" in r.reason)
    gate.step()  # the second delivery's first step, on the fresh child
    await progress.wait(2)
    gate.close()  # and its end
    rec = await terminal(bus, task.task_id)
    await progress.stop()
    assert rec.state == TaskState.succeeded and rec.worker == "w-apart", rec
    assert rec.crashes == 0
    body = await _health(w, lambda status, h: status == 200)
    assert body["stalled"] is None
    assert body["pipeline"]["processes"]["gated"] not in (None, first["gated"])


@pytest.mark.parametrize("apart", ["0", "1"], ids=["in-process", "apart"])
async def test_a_slow_call_that_keeps_stepping_is_never_declared_stalled(
        stack: ServingStack, bus: Bus, gate: Gate, apart: str) -> None:
    """The timeout is per step, not per call: a call that steps whenever it is let,
    through more than three stall timeouts in all, runs to its end on its worker (it
    would not against a timeout per call)."""
    cluster = f"slow{uuid.uuid4().hex[:8]}"
    name = f"w-slow-{apart}"
    w = _start(stack, name, cluster, f"fault:gate@{gate.path}", call_stall_timeout="2",
               pipeline_process=apart)
    task = await _publish(bus, cluster)
    progress = await Progress().start(bus, task.task_id)
    gate.step()
    await progress.wait(1)
    # One step a reading of the worker's /healthz, until the worker says its call has
    # run for three stall timeouts: no step is ever let wait for one.
    while (await _health(w))["pipeline"]["running_s"] < 3 * 2:
        gate.step()
        await progress.wait(len(progress.steps) + 1)
        await asyncio.sleep(0.05)  # polling the worker's health endpoint
    gate.close()
    rec = await terminal(bus, task.task_id)
    await progress.stop()
    assert rec.state == TaskState.succeeded and rec.worker == name, rec
    # One delivery, never handed back: its steps in order, from 1 once.
    assert progress.steps == list(range(1, len(progress.steps) + 1))
    body = await _health(w, lambda status, h: status == 200)
    assert body["stalled"] is None


async def test_a_pipeline_process_hung_in_a_call_dies_with_its_worker(
        stack: ServingStack, bus: Bus, gate: Gate) -> None:
    """A child hears its worker is gone on its socket, read between steps only: one hung
    in a call outlived a worker killed -9 for good, holding its device (one was found 37
    minutes after its test). Now it leaves once it is orphaned, whatever its call does."""
    cluster = f"orphan{uuid.uuid4().hex[:8]}"
    w = _start(stack, "w-orphan", cluster, f"fault:gate@{gate.path}",
               call_stall_timeout="0", pipeline_process="1")  # never declared stalled
    task = await _publish(bus, cluster)
    progress = await Progress().start(bus, task.task_id)
    gate.step()
    await progress.wait(1)  # the call now waits on the gate for good
    await progress.stop()
    child = os.pidfd_open((await _health(w))["pipeline"]["processes"]["gated"])
    try:
        gone = asyncio.Event()  # a pidfd turns readable when its process exits
        asyncio.get_running_loop().add_reader(child, gone.set)
        w.kill()
        await asyncio.wait_for(gone.wait(), DEADLINE)
    finally:
        asyncio.get_running_loop().remove_reader(child)
        os.close(child)
