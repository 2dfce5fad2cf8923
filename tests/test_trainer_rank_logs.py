"""A torchrun's output stays bounded on the disk of the node that runs it, and is seen
where a pod's logs are read (``tandem.trainer.rank_output``): each attempt's log is
capped (the newest output kept, the last traceback at its end), every line also goes to
the launching process's stderr with a prefix naming the run, attempt and node (dropped
and counted, never blocking the ranks, when stderr is slow), and a launch removes the
run's attempt folders past the newest ``ATTEMPTS_KEPT``, never a checkpoint.

Real processes: a node agent or a coordinator (``python -m tandem.trainer``), a real
nats-server, and in place of torchrun a fake (``TANDEM_PYTHON`` names it) that prints
three times the cap, then a traceback, and exits 1. Every wait is on a reply, a report,
a KV update or a line read, with a deadline.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import msgspec
import pytest

from tandem.cli.devstack import NatsServer
from tandem.common.errors import SettingsError
from tandem.common.events import RunState
from tandem.common.runs import submit_run
from tandem.common.settings import load
from tandem.trainer.service import TrainerSettings
from tests.conftest import PYTHON, service_env
from tests.test_train_runs import stop_process, tiny, until
from tests.test_trainer_lifecycle import Env, env  # noqa: F401 (fixture)
from tests.test_trainer_node_agent import (  # noqa: F401 (fixture)
    NODE,
    Coordinator,
    coordinator,
    launch,
    order,
    until_true,
)

pytestmark = [pytest.mark.timeout(300)]
DEADLINE = 120.0
CAP = 1 << 20  # TANDEM_RANK_LOG_MAX_BYTES: the least it may be
LINES = 30_000  # of about 100 bytes: three times the cap

FAKE_TORCHRUN = f"""
import sys
rdzv = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--rdzv-id="))
sys.stdout.write("".join(f"{{rdzv}} chatter {{i:07d}} {{'x' * 80}}\\n" for i in range({LINES})))
sys.stdout.flush()
sys.stderr.write('Traceback (most recent call last):\\n  File "loop.py", line 1, in step\\n'
                 f"FakeRankError: {{rdzv}} ended\\n")
sys.exit(1)
"""


def fake_python(root: Path) -> str:
    """An "interpreter" whose ``-m torch.distributed.run ...`` is the fake torchrun."""
    script = root / "fake_torchrun.py"
    script.write_text(FAKE_TORCHRUN)
    shim = root / "fake-python"
    shim.write_text(f'#!/bin/sh\nexec {PYTHON} {script} "$@"\n')
    shim.chmod(0o755)
    return str(shim)


def the_end(rdzv: str) -> str:
    return f"FakeRankError: {rdzv} ended\n"


def assert_capped_with_its_end(log: Path, rdzv: str) -> None:
    """``log`` and the part rotated out of it hold at most the cap, and the log ends with
    the attempt's last lines: its traceback after its newest chatter."""
    rotated = log.with_name(log.name + ".1")
    assert rotated.is_file(), f"{log} never rotated: the fake printed three times the cap"
    assert log.stat().st_size + rotated.stat().st_size <= CAP
    text = log.read_text()
    assert text.endswith(f"Traceback (most recent call last):\n"
                         f'  File "loop.py", line 1, in step\n{the_end(rdzv)}'), text[-500:]
    assert f"{rdzv} chatter {LINES - 1:07d} " in text


# ------------------------------------------------------------------- the node agent


@pytest.fixture
def agent_proc(nats_server: NatsServer, tmp_path: Path, uid: str,
               request: pytest.FixtureRequest) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A node agent on node n1 of its own cluster running the fake torchrun, its work
    root also its checkpoint root (checkpoints beside the attempt folders), stdout to a
    file and stderr to ``stderr.log`` or, parametrized ``"pipe"``, a pipe the test reads
    only when it says. Yields the cluster and the process."""
    cluster = f"c{uid}"
    root = tmp_path / "node"
    config = service_env(nats_url=nats_server.url, cluster=cluster, node=NODE,
                         trainer_role="node", checkpoint_root=str(root),
                         work_root=str(root), orphan_after_s="30",
                         python=fake_python(tmp_path), rank_log_max_bytes=str(CAP),
                         attempts_kept="2")
    err: IO[bytes] | int = subprocess.PIPE
    if getattr(request, "param", "file") == "file":
        err = open(tmp_path / "stderr.log", "wb")
    with open(tmp_path / "agent.log", "ab") as out:
        proc = subprocess.Popen([PYTHON, "-m", "tandem.trainer"], env=config, stdout=out,
                                stderr=err)
    try:
        yield cluster, proc
    finally:
        if proc.stderr is not None:  # read to its end: a write blocked there holds it up
            threading.Thread(target=proc.stderr.read, daemon=True).start()
        stop_process(proc)
        if not isinstance(err, int):
            err.close()


@pytest.fixture
def agent(agent_proc: tuple[str, subprocess.Popen[bytes]]) -> str:
    return agent_proc[0]


async def ended(c: Coordinator, attempt: int) -> None:
    """Until the agent reports attempt ``attempt``'s torchrun exited (with 1)."""
    while True:
        report = await asyncio.wait_for(c.heard.get(), DEADLINE)
        if report.attempt == attempt and not report.running:
            assert report.exit_code == 1, report
            return


async def test_a_node_agent_caps_each_attempts_log_echoes_it_and_keeps_the_newest_attempts(
        agent: str, coordinator: Coordinator,  # noqa: F811 (fixture)
        tmp_path: Path) -> None:
    run = "chatty"
    folder = tmp_path / "node" / run
    # A checkpoint of the run, and one being written, beside the attempt folders: the
    # work root is the checkpoint root here (checkpoint_root/<run>/step-<N>).
    for name in ("step-5", "step-6.incomplete"):
        (folder / name).mkdir(parents=True)
        (folder / name / "manifest.json").write_text("{}")
    first = launch(agent, run, tmp_path)
    for attempt in (1, 2, 3, 4):
        reply = await order(coordinator.bus, agent, msgspec.structs.replace(
            first, attempt=attempt, spec={**first.spec, "attempt": attempt}))
        assert reply.ok, reply.error
        await ended(coordinator, attempt)
    # The newest two attempts' folders are left, the checkpoints untouched.
    assert sorted(p.name for p in folder.iterdir()) == [
        "attempt-3-node0", "attempt-4-node0", "step-5", "step-6.incomplete"]
    assert (folder / "step-5" / "manifest.json").read_text() == "{}"
    log = Path(reply.log_path)
    assert log.parent.name == "attempt-4-node0"
    assert_capped_with_its_end(log, f"{run}-a4")
    # Every line on the agent's stderr too, prefixed with the run, attempt and node
    # (written there by a thread of its own: the last ones may come after the exit).
    stderr = tmp_path / "stderr.log"
    end = f"[run={run} attempt=4 node={NODE}] {the_end(f'{run}-a4')}"
    await until_true("the last line on the agent's stderr", lambda: end in stderr.read_text())
    assert f"[run={run} attempt=1 node={NODE}] {run}-a1 chatter 0000000 " in stderr.read_text()


@pytest.mark.parametrize("agent_proc", ["pipe"], indirect=True)
async def test_a_stderr_nobody_reads_drops_and_counts_lines_and_never_blocks_the_ranks(
        agent_proc: tuple[str, subprocess.Popen[bytes]],
        coordinator: Coordinator, tmp_path: Path) -> None:  # noqa: F811 (fixture)
    """The agent's stderr is a pipe nobody reads while torchrun prints three times the
    cap: torchrun still ends (its exit is reported) with its whole log's end on disk;
    read afterwards, the agent's stderr has the first lines, then how many were
    dropped."""
    cluster, proc = agent_proc
    reply = await order(coordinator.bus, cluster, launch(cluster, "unread", tmp_path))
    assert reply.ok, reply.error
    await ended(coordinator, 1)
    assert_capped_with_its_end(Path(reply.log_path), "unread-a1")
    assert proc.stderr is not None
    stream = proc.stderr
    prefix = f"[run=unread attempt=1 node={NODE}] "

    async def line() -> str:
        got = (await asyncio.wait_for(asyncio.to_thread(stream.readline), DEADLINE)).decode()
        assert got, "the agent's stderr ended with no line saying lines were dropped"
        return got

    while not (first := await line()).startswith(prefix):
        pass  # the agent's own, if any
    assert first.startswith(f"{prefix}unread-a1 chatter 0000000 "), first
    while "lines dropped here" not in (last := await line()):
        assert last.startswith(f"{prefix}unread-a1 chatter "), last
    assert last.startswith(f"{prefix}(") and int(last[len(prefix) + 1:].split()[0]) > 0


# ------------------------------------------------------------- the local launcher


async def test_a_local_coordinator_caps_the_log_its_incident_names_and_prunes_attempts(
        env: Env, tmp_path: Path) -> None:  # noqa: F811
    """LAUNCHER=local: every attempt's torchrun fails after printing three times the cap;
    the run fails after its restarts. Each incident names a log whose end is that
    attempt's traceback, the newest two attempts' folders are left, and the
    coordinator's own output has the ranks' lines, prefixed."""
    run = f"loud-{env.cluster}"
    env.coordinator(python=fake_python(tmp_path), rank_log_max_bytes=str(CAP),
                    attempts_kept="2")
    await submit_run(env.bus, tiny(run, cluster=env.cluster, ranks=1, nodes=["n0"],
                                   watchdog={"max_restarts": 3, "backoff_s": 0.1}))
    rec = await until(env.bus, run, lambda r: r.state.terminal, timeout=DEADLINE)
    assert rec.state == RunState.failed and rec.attempt == 4, rec
    last = rec.incidents[-1]
    [log] = [Path(p) for p in last["logs"]]
    assert log.parent.name == "attempt-4" and last["attempt"] == 4, last
    assert_capped_with_its_end(log, f"{run}-a4")
    folder = tmp_path / "work" / run
    assert sorted(p.name for p in folder.iterdir()) == ["attempt-3", "attempt-4"]
    # The coordinator's stderr (its log file here) has the ranks' lines, the last ones
    # written there by a thread of its own, maybe after the run's end.
    output = tmp_path / "trainer.log"
    end = f"[run={run} attempt=4 node=n0] {the_end(f'{run}-a4')}"
    await until_true("the last line on the coordinator's stderr",
                     lambda: end in output.read_text())


@pytest.mark.parametrize(("name", "value"), [("rank_log_max_bytes", "1000"),
                                             ("attempts_kept", "0")])
def test_a_rank_log_cap_under_a_mib_or_no_attempt_kept_is_refused_naming_it(
        name: str, value: str) -> None:
    with pytest.raises(SettingsError, match=f"TANDEM_{name.upper()}"):
        load(TrainerSettings, **{name: value})
