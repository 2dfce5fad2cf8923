"""A torchrun's output under faults (``tandem.trainer.rank_output``): a stderr nobody
reads, a launcher started with no stderr, a log that cannot grow, a progress bar, a
report loop waiting again and again, a checkpoint root reached through a link in an
attempt folder, a rank whose launcher is gone, and a coordinator of node agents keeping
its own attempt folders bounded.

Real processes: a launcher (``spawn``, as the coordinator's and the node agents' run
it) in a child interpreter where the fault is its own (its stderr, its file size limit),
commands standing in for torchrun, a real coordinator and node agent on a real
nats-server. Every wait is on a process exit, a KV update or a line read, with a
deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tandem.common.events import RunState
from tandem.common.runs import submit_run
from tandem.trainer import rank_output
from tandem.trainer.launcher import spawn
from tandem.trainer.rank import INVALID
from tandem.trainer.rank_output import RankLogs, prune_attempts
from tests.conftest import PYTHON, service_env
from tests.test_train_runs import stop_process, tiny, until
from tests.test_trainer_lifecycle import Env, env, until_true  # noqa: F401 (fixture)
from tests.test_trainer_rank_logs import fake_python

pytestmark = [pytest.mark.timeout(300)]
DEADLINE = 120.0
CAP = 1 << 20  # TANDEM_RANK_LOG_MAX_BYTES: the least it may be

# A launcher: ``times`` torchruns of ``command`` one after the other, each to its own
# capped log under ``root``; what it saw goes to ``root/result.json``. The first file it
# opens is ``root/opened-first.txt`` (started with fd 2 closed, that file gets fd 2).
LAUNCHER = """
import asyncio, json, os, resource, sys, threading
from pathlib import Path
root, command = Path(sys.argv[1]), json.loads(sys.argv[2])
times, fsize, cap = (int(a) for a in sys.argv[3:6])
first = open(root / "opened-first.txt", "wb")
if fsize:
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
from tandem.trainer.launcher import spawn
from tandem.trainer.rank_output import RankLogs

async def main():
    fds = len(os.listdir("/proc/self/fd"))
    codes = []
    for i in range(times):
        proc = await spawn(command, root / f"agent-{i}.log", dict(os.environ),
                           logs=RankLogs(max_bytes=cap), line_prefix=f"[attempt={i}] ")
        codes.append(await proc.wait())
    # A pump sets its output's end just before its thread returns: wait for those
    # returns (a leaked pump, blocked on a pipe, is still there after the join's bound).
    for t in threading.enumerate():
        if t.name == "rank output":
            t.join(60)
    return {"codes": codes, "fds": [fds, len(os.listdir("/proc/self/fd"))],
            "threads": sorted(t.name for t in threading.enumerate()),
            "first_fd": first.fileno()}

(root / "result.json").write_text(json.dumps(asyncio.run(main())))
"""


def launch(root: Path, command: list[str], times: int = 1, fsize: int = 0,
           stderr: Any = None, no_stderr: bool = False) -> dict[str, Any]:
    """Run ``LAUNCHER`` to its end (``no_stderr``: with fd 2 closed); what it saw."""
    root.mkdir(parents=True, exist_ok=True)
    argv = [PYTHON, "-c", LAUNCHER, str(root), json.dumps(command), str(times), str(fsize),
            str(CAP)]
    if no_stderr:
        argv = ["sh", "-c", 'exec "$0" "$@" 2>&-', *argv]
    proc = subprocess.Popen(argv, stderr=stderr if stderr is not None else subprocess.DEVNULL)
    try:
        assert proc.wait(DEADLINE) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result: dict[str, Any] = json.loads((root / "result.json").read_text())
    assert result["codes"] == [0] * times, result
    return result


def prints(code: str) -> list[str]:
    return [PYTHON, "-c", code]


def test_a_stderr_nobody_reads_holds_one_echo_thread_and_no_fd_however_many_torchruns(
        tmp_path: Path) -> None:
    """Five torchruns one after the other, each printing twice the echo's budget, and
    the launcher's stderr a pipe nobody reads: the torchruns all end, and what is left
    of them in the launcher is the one thread that writes to stderr (blocked there),
    not one per torchrun, and no descriptor."""
    chatty = prints('import sys; sys.stdout.write(("x" * 99 + "\\n") * 20_000)')
    r, w = os.pipe()
    try:
        result = launch(tmp_path, chatty, times=5, stderr=w)
    finally:
        os.close(w)
        os.close(r)
    echoes = [t for t in result["threads"] if "echo" in t]
    assert len(echoes) == 1, result["threads"]
    assert "rank output" not in result["threads"], "a pump outlived its torchrun's output"
    assert result["fds"][0] == result["fds"][1], result


def test_a_launcher_started_without_stderr_echoes_nothing_into_the_file_given_fd_2(
        tmp_path: Path) -> None:
    """fd 2 closed at the launcher's start: the first file it opens takes that number.
    The ranks' lines go to their log, and none into that file."""
    result = launch(tmp_path, prints("print('a rank line')"), no_stderr=True)
    assert result["first_fd"] == 2, "the launcher's first file did not get fd 2"
    assert (tmp_path / "agent-0.log").read_text() == "a rank line\n"
    assert (tmp_path / "opened-first.txt").read_bytes() == b""


def test_a_log_that_cannot_grow_keeps_the_newest_output_in_whole_lines(
        tmp_path: Path) -> None:
    """The launcher may write no file past 300 kB (RLIMIT_FSIZE: a full disk, as far as
    the log is concerned), under the half of the cap at which the log rotates; torchrun
    prints 4 MB, then its traceback. The log ends with that traceback after the newest
    lines, every line of the log and of the one rotated out of it whole."""
    lines = 40_000
    loud = prints("import sys\n"
                  f"for i in range({lines}):\n"
                  "    sys.stdout.write(f'line {i:06d} ' + 'y' * 88 + '\\n')\n"
                  "sys.stdout.write('FakeRankError: the end\\n')")
    launch(tmp_path, loud, fsize=300_000)
    log = tmp_path / "agent-0.log"
    rotated = log.with_name(log.name + ".1")
    text = log.read_text()
    assert text.endswith(f"line {lines - 1:06d} {'y' * 88}\nFakeRankError: the end\n"), \
        text[-300:]
    for part in (text, rotated.read_text()):
        torn = [x for x in part.splitlines()
                if not re.fullmatch(r"line \d{6} y{88}|FakeRankError: the end", x)]
        assert not torn, torn[:3]
    assert log.stat().st_size + rotated.stat().st_size <= CAP


def test_a_progress_bar_is_echoed_as_a_terminal_shows_it_and_kept_whole_in_the_log(
        tmp_path: Path) -> None:
    """A line redrawn 3000 times with ``\\r`` (a progress bar), then one ending
    ``\\r\\n``: each is echoed as its last drawing after the prefix (a terminal would
    draw the bar over the prefix), while the log keeps every drawing."""
    bar = prints("import sys\n"
                 "for i in range(3000): sys.stdout.write(f'\\r{i:4d}%|####')\n"
                 "sys.stdout.write('\\ndone\\r\\n')")
    with open(tmp_path / "stderr.log", "wb") as err:
        launch(tmp_path, bar, stderr=err)
    # Written by the launcher's echo thread before it exited; read after the exit.
    echoed = (tmp_path / "stderr.log").read_bytes()
    assert b"\r" not in echoed, echoed[:200]
    assert echoed.decode().splitlines()[-2:] == ["[attempt=0] 2999%|####",
                                                 "[attempt=0] done"]
    assert (tmp_path / "agent-0.log").read_bytes().count(b"\r") == 3001


async def test_a_torchrun_waited_on_again_and_again_holds_one_wait_and_drains_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node agent's report loop waits for its torchrun with a timeout, again and again:
    that adds no waiter each time. Once torchrun has exited with a process of its own
    still holding the pipe, the first wait gives the drain up (``DRAIN_S``) and every
    later one returns at once."""
    monkeypatch.setattr(rank_output, "DRAIN_S", 0.2)
    proc = await spawn(["sh", "-c", "sleep 600 & echo orphan $!; exec sleep 600"],
                       tmp_path / "agent.log", dict(os.environ), logs=RankLogs(echo=False))
    try:
        log = tmp_path / "agent.log"
        await until_true("the orphan started", lambda: "orphan" in log.read_text())
        before = len(asyncio.all_tasks())
        for _ in range(50):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(asyncio.shield(proc.wait()), 0.01)
        assert len(asyncio.all_tasks()) - before <= 1
        os.kill(proc.pid, signal.SIGKILL)
        assert await asyncio.wait_for(proc.wait(), DEADLINE) == -signal.SIGKILL
        assert proc.wait().done(), "a second wait drains again"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the orphan, in torchrun's group


def test_pruning_spares_an_attempt_folder_holding_the_checkpoint_root_through_a_link(
        tmp_path: Path) -> None:
    """The checkpoint root named as ``<run>/attempt-1/ckpt``, a link to the checkpoints'
    folder: attempt 1's folder is not removed with the link in it."""
    run = tmp_path / "work" / "r"
    store = tmp_path / "store"
    store.mkdir()
    (store / "step-3").mkdir()
    for n in (1, 2, 3):
        (run / f"attempt-{n}").mkdir(parents=True)
    (run / "attempt-1" / "ckpt").symlink_to(store)
    removed = prune_attempts(run / "attempt-3", 1, [run / "attempt-1" / "ckpt"])
    assert removed == [run / "attempt-2"]
    assert (run / "attempt-1" / "ckpt" / "step-3").is_dir()


def test_a_rank_whose_launcher_is_gone_still_tells_a_bad_config_and_exits_invalid(
        tmp_path: Path) -> None:
    """The rank's stdout and stderr are a pipe no one reads any more (its launcher killed
    -9): a config that cannot be built is still told (``Invalid``) and the rank exits
    ``INVALID``, not as a crash on the traceback it prints."""
    code = ("from tandem.trainer.channel import EventChannel\n"
            "from tandem.trainer.rank import configured\n"
            "configured(EventChannel(None), 0, lambda: int('not a number'))\n")
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=w, stderr=w)
    finally:
        os.close(w)
    try:
        assert proc.wait(DEADLINE) == INVALID
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def node_agent(e: Env, root: Path) -> subprocess.Popen[bytes]:
    """Node n0's agent, its torchrun the fake one of ``test_trainer_rank_logs`` (prints
    three times the cap and exits 1), its folders under ``root/nodes``."""
    config = service_env(nats_url=e.nats.url, cluster=e.cluster, node="n0",
                         trainer_role="node", checkpoint_root=str(root / "ckpt"),
                         work_root=str(root / "nodes"), python=fake_python(root),
                         rank_log_max_bytes=str(CAP), orphan_after_s="30")
    with open(root / "agent.log", "ab") as out:
        return subprocess.Popen([PYTHON, "-m", "tandem.trainer"], env=config, stdout=out,
                                stderr=subprocess.STDOUT)


async def test_a_coordinator_of_node_agents_prunes_its_own_attempt_folders(
        env: Env, tmp_path: Path) -> None:  # noqa: F811 (fixture)
    """LAUNCHER=nodes: each attempt's torchrun (on node n0's agent) fails; the run fails
    after 3 restarts. The coordinator's own attempt folders (its launch specs) are the
    newest ``ATTEMPTS_KEPT`` (the coordinator's own setting, 2 here), as the node
    agent's are (3, its default)."""
    run = f"pruned-{env.cluster}"
    agent = node_agent(env, tmp_path)
    try:
        env.coordinator(launcher="nodes", attempts_kept="2")
        await submit_run(env.bus, tiny(run, cluster=env.cluster, ranks=1, nodes=["n0"],
                                       watchdog={"max_restarts": 3, "backoff_s": 0.1}))
        rec = await until(env.bus, run, lambda r: r.state.terminal, timeout=DEADLINE)
        assert rec.state == RunState.failed and rec.attempt == 4, rec
        folder = tmp_path / "work" / run
        assert sorted(p.name for p in folder.iterdir()) == ["attempt-3", "attempt-4"]
        assert sorted(p.name for p in (tmp_path / "nodes" / run).iterdir()) == [
            "attempt-2-node0", "attempt-3-node0", "attempt-4-node0"]
    finally:
        await asyncio.to_thread(stop_process, agent)
