"""A stopping checkpointer still takes the checkpoint its node's stopping ranks write.

A node going away (a spot node reclaimed, a graceful node shutdown) sends SIGTERM to its
checkpointer and to its trainer's node agent at the same moment; the ranks save their
step and the coordinator hands that checkpoint to the node's checkpointer seconds later
(``mirror.<cluster>.<node>``). Real nats-server and moto S3, and a real checkpointer
process (``python -m tandem.checkpointer``, ``TANDEM_SCOPE=node``) sent SIGTERM as the
kubelet sends it; KV ``runs`` says where the run's ranks are, as the coordinator writes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tandem.checkpointer.service import Checkpointer, CheckpointerSettings
from tandem.cli.devstack import S3Server
from tandem.common import checkpoints as ck
from tandem.common import subjects
from tandem.common.bus import Bus
from tandem.common.errors import SettingsError
from tandem.common.events import CheckpointMirrored, RunRecord, RunState
from tandem.common.settings import load
from tandem.common.storage import s3_client
from tandem.common.streams import KV_RUNS, core_streams
from tests.conftest import PYTHON, ROOT, service_env
from tests.test_checkpointer import DEADLINE, Case
from tests.test_checkpointer import case as case  # the fixture

NODE = "node-0"  # where the checkpoints of ``Case.publish`` are written (cluster "local")


class Child:
    """A checkpointer process, its JSON log read as it comes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[dict[str, Any]] = []
        self._new = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            with contextlib.suppress(ValueError):
                self.lines.append(json.loads(raw))
            self._new.set()
        self._new.set()

    def events(self) -> list[str]:
        return [r.get("event", "") for r in self.lines]

    async def logged(self, event: str, timeout: float = DEADLINE) -> dict[str, Any]:
        """The first log line of ``event``, waiting for it (the process ending first
        fails)."""
        async with asyncio.timeout(timeout):
            while True:
                for r in self.lines:
                    if r.get("event") == event:
                        return r
                if self._reader.done():
                    raise AssertionError(f"exited ({self.proc.returncode}) without "
                                         f"logging {event}: {self.events()}")
                self._new.clear()
                await self._new.wait()

    async def exited(self, timeout: float = DEADLINE) -> int:
        code = await asyncio.wait_for(self.proc.wait(), timeout)
        await asyncio.wait_for(self._reader, timeout)
        return code


@contextlib.asynccontextmanager
async def checkpointer(bus: Bus, values: dict[str, Any]) -> AsyncIterator[Child]:
    """``python -m tandem.checkpointer`` with ``values``, once it pulls; killed if the
    test leaves it running."""
    await bus.provision(Checkpointer(load(CheckpointerSettings, **values)).streams())
    proc = await asyncio.create_subprocess_exec(
        PYTHON, "-m", "tandem.checkpointer", cwd=ROOT,
        env=service_env(**{k: str(v) for k, v in values.items()}),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    child = Child(proc)
    try:
        await child.logged("consumer.start")
        yield child
    finally:
        if proc.returncode is None:
            proc.kill()
        await child.exited()


async def place(bus: Bus, run: str, nodes: list[str], state: RunState = RunState.running,
                attempt: int = 1) -> None:
    """The run's record as its coordinator (on ``coord-0`` of cluster ``local``) keeps
    it: the current attempt's nodes."""
    await bus.provision(core_streams(1))  # KV runs among them
    runs = await bus.typed(KV_RUNS, RunRecord)
    await runs.put(run, RunRecord(run_id=run, state=state, nodes=nodes, attempt=attempt,
                                  coordinator=subjects.node_key("local", "coord-0")))


def node_config(case: Case, s3_server: S3Server, **extra: Any) -> dict[str, Any]:
    return case.config(s3_server.url, scope="node", node=NODE, **extra)


async def test_a_checkpoint_handed_over_after_sigterm_is_committed_before_the_exit(
        case: Case, s3_server: S3Server) -> None:
    """The node's ranks save their step after the SIGTERM both got: the checkpointer,
    still pulling, commits it in S3, then exits 0 once the run no longer has ranks on
    its node (the coordinator moved on: the next attempt is elsewhere)."""
    bus, run = case.bus, case.run
    await place(bus, run, [NODE, "node-1"])
    directory, manifest = case.checkpoint(7, {"rng.bin": 2048})  # the stop checkpoint
    async with checkpointer(bus, node_config(case, s3_server, stop_linger_s=30,
                                             drain_timeout=40)) as child:
        child.proc.send_signal(signal.SIGTERM)
        await child.logged("runner.stopping")
        await case.publish(directory, manifest)  # as the coordinator relays it

        mirrored = asyncio.create_task(case.events.next(CheckpointMirrored))
        gone = asyncio.create_task(child.proc.wait())
        await asyncio.wait({mirrored, gone}, timeout=DEADLINE,
                           return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        assert mirrored.done(), (f"the checkpointer exited ({child.proc.returncode}) "
                                 f"before the checkpoint was committed: {child.events()}")
        assert mirrored.result().step == 7
        assert child.proc.returncode is None  # still there: the run's ranks still are

        await place(bus, run, ["node-1", "node-2"], RunState.starting, attempt=2)
        assert await child.exited() == 0
    assert ck.committed_steps(s3_client(load(CheckpointerSettings, **node_config(
        case, s3_server))), case.bucket, run) == [7]
    assert "checkpointer.lingering" in child.events()
    assert "checkpointer.nothing_to_come" in child.events()  # not the window's end


async def test_a_stopping_checkpointer_that_nothing_reaches_exits_at_its_windows_end(
        case: Case, s3_server: S3Server) -> None:
    """The run still names this node (its coordinator gone too, say) and no checkpoint
    comes: the checkpointer waits out its window, no longer, and exits 0."""
    await place(case.bus, case.run, [NODE])
    async with checkpointer(case.bus, node_config(case, s3_server, stop_linger_s=2,
                                                  drain_timeout=10)) as child:
        child.proc.send_signal(signal.SIGTERM)
        over = await child.logged("checkpointer.linger_over")
        assert await child.exited() == 0
    assert case.run in over["still"]


async def test_with_no_training_on_its_node_a_stopping_checkpointer_does_not_linger(
        case: Case, s3_server: S3Server) -> None:
    """Runs on other nodes, ended or not yet claimed send this node nothing: it stops
    at SIGTERM."""
    await place(case.bus, case.run, ["node-1"])
    await place(case.bus, f"{case.run}-done", [NODE], RunState.succeeded)
    await place(case.bus, f"{case.run}-new", [NODE], RunState.pending)  # not claimed yet
    async with checkpointer(case.bus, node_config(case, s3_server, stop_linger_s=30,
                                                  drain_timeout=40)) as child:
        child.proc.send_signal(signal.SIGTERM)
        assert await child.exited() == 0
    assert "checkpointer.nothing_to_come" in child.events()
    assert "checkpointer.lingering" not in child.events()


def test_the_linger_fits_in_the_drain_and_defaults_to_the_trainers_stop_window() -> None:
    with pytest.raises(SettingsError, match=r"TANDEM_STOP_LINGER_S.*TANDEM_DRAIN_TIMEOUT"):
        load(CheckpointerSettings, stop_linger_s=60, drain_timeout=60)
    # Unset: the drain less 5 s, as the trainer's ranks get (15 s with the default 20).
    assert load(CheckpointerSettings).linger_window() == 15
    assert load(CheckpointerSettings, drain_timeout=150).linger_window() == 145
    assert load(CheckpointerSettings, stop_linger_s=0).linger_window() == 0
    assert load(CheckpointerSettings, stop_linger_s=60,
                drain_timeout=150).linger_window() == 60
