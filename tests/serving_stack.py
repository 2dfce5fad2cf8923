"""Serving tests' helpers: the gateway and workers as real child processes, and waits.

Everything waits on an event from the system itself (a KV watch, a progress message,
a readiness endpoint) with a deadline; nothing sleeps to synchronise.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.cli.devstack import NatsServer, Process, S3Server, log_offset, logged_metrics_port
from tandem.common import subjects
from tandem.common.bus import Bus
from tandem.common.events import DeadLetter, TaskRecord, TaskState, decode
from tandem.common.settings import Settings, load
from tandem.common.streams import KV_TASKS
from tests.conftest import PYTHON, service_env

# A wait here often spans a service's start (torch imported, models built) as well as
# its work. In the suite, beside the training module's ranks on 2 cores, a worker's
# digits model once took more than 86 s to load (6 s alone), so 90 s was not generous.
DEADLINE = 180.0


@dataclass
class Child(Process):
    """A Tandem service as a child process (``python -m tandem.<module>``)."""

    module: str = ""
    env: dict[str, str] = field(default_factory=dict)
    # 0: the service binds a free port itself and says which in its log; a restart
    # keeps the port it had.
    metrics_port: int = 0
    _log_from: int = 0

    def start(self) -> Child:
        self._log_from = log_offset(self.log_path)
        env = service_env(**{**self.env, "metrics_port": str(self.metrics_port)})
        self._spawn([PYTHON, "-m", self.module], env=env)
        return self

    def metrics(self, timeout: float = DEADLINE) -> int:
        """The port of the child's /healthz and /metrics (waits for it to listen)."""
        if not self.metrics_port:
            assert self.proc is not None, f"{self.name} was never started"
            self.metrics_port = logged_metrics_port(self.proc, self.log_path, self._log_from,
                                                    timeout)
        return self.metrics_port

    def health(self, url: str | None = None) -> dict[str, Any] | None:
        url = url or f"http://127.0.0.1:{self.metrics()}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
            return None

    def wait_healthy(self, pred: Callable[[dict[str, Any]], bool] = lambda h: True,
                     timeout: float = DEADLINE, url: str | None = None) -> dict[str, Any]:
        """Poll the child's own /healthz until ``pred`` holds (readiness, not a sleep)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.running:
                raise AssertionError(f"{self.name} exited: {self.tail()}")
            h = self.health(url)
            if h is not None and h.get("status") == "ok" and pred(h):
                return h
            time.sleep(0.05)  # polling the child's readiness endpoint
        raise AssertionError(f"{self.name} not ready in {timeout}s: {self.tail()}")

    def tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""


class ServingStack:
    """A NATS server of its own, a bucket of its own on the session's S3, and the
    children a test module starts (killed by ``stop``)."""

    def __init__(self, root: Path, s3: S3Server, name: str, models: str = "") -> None:
        self.root = root
        self.s3 = s3
        self.nats = NatsServer(name=name, log_path=root / "nats.log", store_dir=root / "js")
        self.bucket = f"{name}-{uuid.uuid4().hex[:8]}"
        self.models = models
        self.seal_key = uuid.uuid4().hex
        self.children: list[Child] = []

    def env(self, **extra: str) -> dict[str, str]:
        """Settings every child of this stack shares, with ``extra`` on top."""
        base = {"nats_url": self.nats.url, "s3_endpoint": self.s3.url,
                "s3_bucket": self.bucket, "s3_access_key": "tandem", "s3_secret_key": "tandem",
                # The gateway seals what it enqueues; the workers move sealed tasks unread.
                "task_seal_key": self.seal_key,
                # The stack's own call ledger: its workers' dead calls are its own.
                "calls_dir": str(self.root / "calls")}
        return {**base, **({"models": self.models} if self.models else {}), **extra}

    def settings(self) -> Settings:
        return load(Settings, **{k: v for k, v in self.env().items() if k != "models"})

    @contextlib.asynccontextmanager
    async def bus(self) -> AsyncIterator[Bus]:
        """A test's own connection to this stack's NATS."""
        b = await Bus.connect(self.settings(), "test")
        try:
            yield b
        finally:
            await b.drain()

    def stop(self) -> None:
        for c in self.children:
            c.kill()
        self.nats.stop()


def worker(root: Path, name: str, **env: str) -> Child:
    return Child(name=name, log_path=root / f"{name}.log", module="tandem.inference_worker",
                 env={"worker_id": name, **env})


def gateway(root: Path, name: str, port: int = 0, **env: str) -> Child:
    """A gateway child; with ``port`` 0 it binds a free one (``http_port(child)`` tells)."""
    return Child(name=name, log_path=root / f"{name}.log", module="tandem.gateway",
                 env={"http_port": str(port), **env})


def http_port(gw: Child) -> int:
    """The port a ready gateway serves its API on, as its /healthz reports it."""
    h = gw.wait_healthy(lambda h: bool(h.get("http_port")))
    return int(h["http_port"])


async def wait_record(bus: Bus, task_id: str, pred: Callable[[TaskRecord], bool],
                      timeout: float = DEADLINE, seen: list[TaskRecord] | None = None
                      ) -> TaskRecord:
    """Watch the task's KV record until ``pred`` holds; every version goes to ``seen``."""
    kv = await bus.kv(KV_TASKS)
    watcher = await kv.watch(task_id)
    try:
        async with asyncio.timeout(timeout):
            async for entry in watcher:
                if entry is None or not entry.value:
                    continue
                rec = decode(entry.value, TaskRecord)
                if seen is not None:
                    seen.append(rec)
                if pred(rec):
                    return rec
    finally:
        with contextlib.suppress(Exception):
            await watcher.stop()
    raise AssertionError("watch ended")


async def terminal(bus: Bus, task_id: str, timeout: float = DEADLINE,
                   seen: list[TaskRecord] | None = None) -> TaskRecord:
    return await wait_record(bus, task_id, lambda r: r.state.terminal, timeout, seen)


class Progress:
    """Collects ``gen.progress.<task>`` messages; ``wait(n)`` returns once n arrived."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self._changed = asyncio.Event()
        self._sub: Any = None

    async def start(self, bus: Bus, task_id: str) -> Progress:
        async def on(msg: Any) -> None:
            self.steps.append(json.loads(msg.data)["step"])
            self._changed.set()

        self._sub = await bus.nc.subscribe(subjects.gen_progress(task_id), cb=on)
        return self

    async def wait(self, n: int = 1, timeout: float = DEADLINE) -> None:
        async with asyncio.timeout(timeout):
            while len(self.steps) < n:
                self._changed.clear()
                await self._changed.wait()

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()


async def wait_started(bus: Bus, task_id: str, timeout: float = DEADLINE) -> None:
    """Until the task runs (its first progress step) or its record left ``queued``: a
    record says ``running`` only once a task has run for the worker's progress interval,
    and a short task may end before a subscriber sees a step."""
    progress = await Progress().start(bus, task_id)
    try:
        stepped = asyncio.ensure_future(progress.wait(1, timeout))
        moved = asyncio.ensure_future(wait_record(
            bus, task_id, lambda rec: rec.state != TaskState.queued, timeout))
        done, pending = await asyncio.wait({stepped, moved},
                                           return_when=asyncio.FIRST_COMPLETED)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in done:
            t.result()
    finally:
        await progress.stop()


async def counts_on(bus: Bus, stream: str, subject: str) -> dict[str, int]:
    """How many messages ``stream`` holds on each subject that ``subject`` matches."""
    info = await bus.js.stream_info(stream, subjects_filter=subject)
    return dict(info.state.subjects or {})


async def count_on(bus: Bus, stream: str, subject: str) -> int:
    """How many messages ``stream`` holds on ``subject``."""
    return sum((await counts_on(bus, stream, subject)).values())


async def stream_messages(bus: Bus, stream: str, subject: str) -> list[Any]:
    """Every message stored in ``stream`` on ``subject``, oldest first."""
    want = await count_on(bus, stream, subject)
    out: list[Any] = []
    if want == 0:
        return out
    sub = await bus.js.subscribe(subject, stream=stream, ordered_consumer=True)
    try:
        while len(out) < want:
            out.append(await sub.next_msg(timeout=10))
    finally:
        await sub.unsubscribe()
    return out


class Writes:
    """Every write of every task record, as the bucket stored it: an ordered consumer on
    the bucket's stream from now on (a KV watch keeps only the latest value of each; a
    core subscription would also see a compare-and-set the stream refused, which is no
    write). ``states(task)`` is each state a task's record was written with, in order,
    so a second success, or a write the protocol does not make, would show."""

    def __init__(self) -> None:
        self.by_task: dict[str, list[TaskRecord]] = {}
        self._changed = asyncio.Event()
        self._sub: Any = None

    async def start(self, bus: Bus) -> Writes:
        from nats.js.api import DeliverPolicy

        async def on(msg: Any) -> None:
            if not msg.data:  # a delete or purge marker
                return
            rec = decode(msg.data, TaskRecord)
            self.by_task.setdefault(rec.task.task_id, []).append(rec)
            self._changed.set()

        # Created before this returns: every write stored after it is delivered.
        self._sub = await bus.js.subscribe(
            subjects.TASK_RECORD.wildcard, stream=f"KV_{KV_TASKS}", cb=on,
            ordered_consumer=True, deliver_policy=DeliverPolicy.NEW)
        return self

    def states(self, task_id: str) -> list[str]:
        return [r.state.value for r in self.by_task.get(task_id, [])]

    async def until_terminal(self, task_id: str, timeout: float = DEADLINE) -> list[str]:
        """The states written once a terminal one was (a KV watch may see it first)."""
        async with asyncio.timeout(timeout):
            while not any(r.state.terminal for r in self.by_task.get(task_id, [])):
                self._changed.clear()
                await self._changed.wait()
        return self.states(task_id)

    async def stop(self) -> None:
        if self._sub is not None:
            await self._sub.unsubscribe()


async def dead_letters(bus: Bus, stream: str, pred: Callable[[list[DeadLetter]], bool],
                       timeout: float = DEADLINE) -> list[DeadLetter]:
    """Dead letters of ``stream`` (oldest first), read until ``pred`` holds for them."""
    sub = await bus.js.subscribe(subjects.dlq(stream), stream="DLQ", ordered_consumer=True)
    out: list[DeadLetter] = []
    try:
        async with asyncio.timeout(timeout):
            while not pred(out):
                out.append(decode((await sub.next_msg(timeout=timeout)).data, DeadLetter))
    finally:
        await sub.unsubscribe()
    return out
