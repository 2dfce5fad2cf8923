"""Starting, stopping and inspecting one attempt's ranks (no torch).

Every node of the placement gets one torchrun agent (``python -m
torch.distributed.run``), all meeting in a c10d rendezvous that the first node's agent
hosts (``is_host``) at its address; the rendezvous id names the run and the attempt, so
an agent of an earlier attempt can never join a later one. Which node rank each agent
gets is the rendezvous's to decide, so a rank knows its node from its own environment
(``TANDEM_NODE``, set per node here) and tells the coordinator (``Hello``), never from
its rank. Where it runs is the ``Launcher``'s, one interface (``start``/``poll``/``stop``)
with two kinds:

- ``LocalLauncher``: every node's torchrun is a child process of the coordinator's own
  host (the single-box stack, most tests; ``TANDEM_LAUNCHER=local``, the default).
- ``NodeLauncher`` (``nodes.py``): each node's own trainer agent (``node_agent.py``) is
  sent a launch order over the bus and runs torchrun there (``TANDEM_LAUNCHER=nodes``).

Both run exactly ``LocalLauncher.command``'s command line (``spawn``). Each torchrun is
its own session, so a stop kills every rank it forked (``kill_agent``), and dies with
the process that launched it (``PR_SET_PDEATHSIG``). Its output goes to a capped log in
the attempt's folder and to the launching process's stderr, and each launch prunes the
run's older attempt folders (``rank_output``: the same for both kinds).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import math
import os
import random
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tandem.common import ports
from tandem.trainer.rank_output import RankLogs, RankOutput, Torchrun, prefix, prune_attempts
from tandem.trainer.spec import LaunchSpec


@dataclass
class Placement:
    """Which nodes an attempt runs on, and how many ranks on each (equal counts)."""

    nodes: list[str]
    per_node: int

    @property
    def rank_nodes(self) -> list[str]:
        return [n for n in self.nodes for _ in range(self.per_node)]


def place(ranks: int, healthy: list[str]) -> Placement | None:
    """The most healthy nodes that divide ``ranks`` evenly; None when there are none.

    The world size never changes, so the data shards and a resume stay exact.
    """
    for n in range(min(len(healthy), ranks), 0, -1):
        if ranks % n == 0:
            return Placement(nodes=healthy[:n], per_node=ranks // n)
    return None


@dataclass
class Agent:
    """One node's torchrun agent: a child process here (``proc``), or one a node agent
    runs (``pid`` and ``log_path`` are then the node's)."""

    node: str
    log_path: Path | str
    proc: Torchrun | None = None
    pid: int = 0


@dataclass
class AgentEnded:
    """A node's torchrun agent ended: its exit code, or None when it was lost (its node
    agent stopped reporting), and what found it."""

    node: str
    code: int | None
    detector: str = "torchrun agent exited"


@dataclass
class Attempt:
    agents: list[Agent] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    run_id: str = ""
    number: int = 0
    cluster: str = ""
    # The NodeLauncher's bookkeeping of this attempt (reports, subscription).
    state: object = None

    def pids(self) -> list[int]:
        return [a.proc.pid if a.proc else a.pid for a in self.agents]


class LaunchFailed(Exception):
    """An attempt could not be started on ``node``: its agent is absent or refused
    (``reason``). The attempt fails like one whose agent exited; the run restarts."""

    def __init__(self, node: str, reason: str) -> None:
        super().__init__(f"launch on {node} failed: {reason}")
        self.node = node
        self.reason = reason


class Launcher(Protocol):
    """Where an attempt's torchrun agents run. ``start`` returns once every node's agent
    is started (or raises ``LaunchFailed``); ``poll`` waits for the next agent to end
    and returns each one once; ``interrupt`` asks every agent's ranks to checkpoint and
    stop (False where this launcher cannot ask: the caller stops them outright); ``stop``
    kills what is left and returns the exit codes by node (None: unknown)."""

    async def start(self, placement: Placement, spec: LaunchSpec, spec_path: Path,
                    attempt_dir: Path) -> Attempt: ...

    async def poll(self, attempt: Attempt) -> AgentEnded: ...

    def interrupt(self, attempt: Attempt) -> bool: ...

    async def stop(self, attempt: Attempt, rank_pids: Sequence[int] = (),
                   timeout: float = 10.0) -> dict[str, int | None]: ...


STOP_CHECKPOINT_S = 15.0  # with no settings: the default drain (20 s) less the report's 5 s


def rank_env(env: dict[str, str] | None, node: str,
             stop_checkpoint_s: float = STOP_CHECKPOINT_S) -> dict[str, str]:
    """The environment of ``node``'s torchrun and its ranks. torchrun, told to stop
    (SIGTERM), passes it on to its ranks and SIGKILLs those still there after
    ``stop_checkpoint_s`` (its shutdown timeout; an environment variable rather than
    ``--shutdown-timeout``, so the command line stays the node's and the launcher's)."""
    base = dict(os.environ if env is None else env)
    base.setdefault("OMP_NUM_THREADS", "1")
    base["PYTHONUNBUFFERED"] = "1"
    base["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(max(1, math.ceil(stop_checkpoint_s)))
    return {**base, "TANDEM_NODE": node}


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the forked torchrun, before exec: SIGTERM when the process that launched it
    dies (Linux). torchrun answers SIGTERM by stopping its ranks, so a node agent or a
    coordinator (the local launcher) killed -9 takes its ranks with it instead of
    leaving them training unobserved."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


async def spawn(command: list[str], log_path: Path, env: dict[str, str],
                with_parent: bool = False, logs: RankLogs = RankLogs(),
                line_prefix: str = "") -> Torchrun:
    """Start one node's torchrun agent in a session of its own, its output to the capped
    log ``log_path`` and, as ``logs`` says, to this process's stderr, each line after
    ``line_prefix`` (default: the log's name; ``rank_output``); ``with_parent``: it is
    sent SIGTERM if this process dies (``_die_with_parent``)."""
    output = RankOutput(log_path, logs, line_prefix or f"[{log_path.stem}] ")
    try:
        proc = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.DEVNULL, stdout=output.fd, stderr=output.fd,
            env=env, start_new_session=True,
            preexec_fn=_die_with_parent if with_parent and sys.platform == "linux" else None)
    except BaseException:
        output.abort()
        raise
    output.start()
    return Torchrun(proc, output)


def kill_agent(pid: int, rank_pids: Sequence[int] = ()) -> None:
    """SIGKILL a torchrun agent's ranks, then its process group.

    torchrun starts each rank in a session of its own, so killing an agent's process
    group does not reach its ranks: they are found (as the agent's children, plus the
    pids the ranks reported) and their groups killed first.
    """
    victims = set(rank_pids) | set(children(pid))
    for victim in victims:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(victim, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(victim, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


class LocalLauncher:
    """Every node's torchrun as a child process of this host (see the module docstring)."""

    def __init__(self, python: str = sys.executable, master_addr: str = "127.0.0.1",
                 monitor_interval: float = 0.5, rendezvous_ports: range | None = None,
                 stop_checkpoint_s: float = STOP_CHECKPOINT_S,
                 logs: RankLogs = RankLogs()) -> None:
        self.python = python
        self.master_addr = master_addr
        self.monitor_interval = monitor_interval
        self.rendezvous_ports = rendezvous_ports  # None: below the ephemeral range
        self.stop_checkpoint_s = stop_checkpoint_s  # ranks told to stop have this long
        self.logs = logs  # where the torchruns' output goes, attempt folders kept

    def command(self, placement: Placement, node_rank: int, port: int, spec_path: Path,
                rdzv_id: str = "tandem", local_addr: str | None = None,
                module: str = "tandem.trainer.rank") -> list[str]:
        """Node ``node_rank``'s torchrun, running ``module`` (the rank entry point; a
        bench passes its own) with ``spec_path`` on each of its ranks: a c10d rendezvous
        ``rdzv_id`` at ``master_addr:port``, hosted by node rank 0's agent;
        ``local_addr``: the address other nodes reach this one at (default
        ``master_addr``, all on one host). An attempt's id is ``rendezvous_id``; the
        default serves one-off launches (a bench, a test) whose port is theirs alone."""
        return [
            self.python, "-m", "torch.distributed.run",
            f"--nnodes={len(placement.nodes)}", f"--nproc-per-node={placement.per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={self.master_addr}:{port}",
            f"--rdzv-id={rdzv_id}",
            # NOTE: said, not guessed: torchrun would take every agent whose hostname
            # matches the endpoint for the host, and on one box that is all of them.
            f"--rdzv-conf=is_host={'true' if node_rank == 0 else 'false'}",
            f"--local-addr={local_addr or self.master_addr}",
            "--max-restarts=0", f"--monitor-interval={self.monitor_interval}",
            "-m", module, str(spec_path),
        ]

    async def start(self, placement: Placement, spec: LaunchSpec, spec_path: Path,
                    attempt_dir: Path, env: dict[str, str] | None = None) -> Attempt:
        await asyncio.to_thread(prune_attempts, attempt_dir, self.logs.attempts_kept,
                                [spec.checkpoint_root])
        port = rendezvous_port(self.master_addr, allowed=self.rendezvous_ports)
        attempt = Attempt(run_id=spec.run_id, number=spec.attempt)
        for i, node in enumerate(placement.nodes):
            log_path = attempt_dir / f"agent-{i}-{node}.log"
            command = self.command(placement, i, port, spec_path,
                                   rendezvous_id(spec.run_id, spec.attempt))
            # Dies with this process (a coordinator killed -9 leaves no ranks training).
            proc = await spawn(command, log_path,
                               rank_env(env, node, self.stop_checkpoint_s), with_parent=True,
                               logs=self.logs,
                               line_prefix=prefix(spec.run_id, spec.attempt, node))
            attempt.agents.append(Agent(node=node, proc=proc, log_path=log_path, pid=proc.pid))
        return attempt

    async def poll(self, attempt: Attempt) -> AgentEnded:
        ended: set[str] = attempt.state if isinstance(attempt.state, set) else set()
        attempt.state = ended
        waits = {asyncio.ensure_future(a.proc.wait()): a for a in attempt.agents
                 if a.proc is not None and a.node not in ended}
        if not waits:
            await asyncio.Event().wait()  # every agent reported: nothing more will end
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        agent = waits[next(iter(done))]
        ended.add(agent.node)
        assert agent.proc is not None
        return AgentEnded(agent.node, agent.proc.returncode)

    def interrupt(self, attempt: Attempt) -> bool:
        """SIGTERM every node's torchrun, which passes it on to its ranks: they
        checkpoint at their next step boundary and exit (``rank.StopRequest``)."""
        for a in attempt.agents:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(a.pid, signal.SIGTERM)
        return True

    async def stop(self, attempt: Attempt, rank_pids: Sequence[int] = (),
                   timeout: float = 10.0) -> dict[str, int | None]:
        """SIGKILL the ranks and every agent; return the agents' exit codes by node."""
        for a in attempt.agents:
            kill_agent(a.pid, rank_pids)
        codes: dict[str, int | None] = {}
        for a in attempt.agents:
            assert a.proc is not None
            try:
                codes[a.node] = await asyncio.wait_for(a.proc.wait(), timeout)
            except TimeoutError:
                codes[a.node] = None
        return codes


def rendezvous_id(run_id: str, attempt: int) -> str:
    """The c10d rendezvous of one attempt of a run (torchrun's ``--rdzv-id``)."""
    return f"{run_id}-a{attempt}"


RENDEZVOUS_LEASE_S = 120.0  # torchrun binds the store within seconds of its start


def rendezvous_port(host: str, rng: random.Random | None = None,
                    allowed: range | None = None) -> int:
    """A port for the attempt's rendezvous, which every agent must be told before any
    starts (torchrun's ``--rdzv-endpoint``); node 0's agent hosts the store there.

    Free when drawn, at random among ``allowed`` (``TANDEM_RENDEZVOUS_PORTS``: the ports
    a firewall between training nodes admits; ``OSError`` when none is free), else below
    the kernel's ephemeral range, in a band of its own (``ports.RENDEZVOUS``: no
    connection's local end and no dev stack's port comes from there). Leased for
    ``RENDEZVOUS_LEASE_S`` (``ports.lease``): two attempts starting at once on one host
    (two runs' node 0, or two agents of a test's simulated nodes, which once drew one
    port 40 ms apart) never get the same one while torchrun has not bound it yet. If a
    program that is not Tandem's takes it first, the attempt fails to rendezvous and is
    restarted like any failed attempt, with a new port."""
    if allowed is not None:
        return ports.lease(host, allowed, RENDEZVOUS_LEASE_S, rng=rng, fallback=False)
    return ports.lease(host, ports.band_range(ports.RENDEZVOUS), RENDEZVOUS_LEASE_S, rng=rng)


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def proc_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (R, S, D, T stopped, Z, ...), or "gone"."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat.rsplit(")", 1)[1].split()[0]


async def capture_stacks(pids: dict[int, int], attempt_dir: Path, timeout: float = 5.0,
                         max_chars: int = 4000, max_ranks: int = 8
                         ) -> dict[str, dict[str, str]]:
    """Ranks' Python stacks, by rank: its state, then SIGUSR1 (faulthandler).

    A stopped rank (SIGSTOP: state ``T``) is continued after the signal is queued so it
    can dump too; its state before that is recorded, which is the evidence of the hang.
    At most ``max_ranks`` ranks are dumped, those in an unusual state (stopped, in
    uninterruptible sleep, zombie, gone) first, so the record stays small on big runs.
    """
    all_states = {rank: proc_state(pid) for rank, pid in pids.items()}
    odd = ("T", "t", "D", "Z", "gone")
    chosen = sorted(pids, key=lambda r: (all_states[r] not in odd, r))[:max_ranks]
    pids = {r: pids[r] for r in sorted(chosen)}
    states = {r: all_states[r] for r in pids}
    sizes = {}
    for rank, pid in pids.items():
        path = attempt_dir / f"stacks-rank{rank}.txt"
        sizes[rank] = path.stat().st_size if path.exists() else 0
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
            if states[rank] in ("T", "t"):
                os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + timeout
    out: dict[str, dict[str, str]] = {}
    pending = set(pids)
    while pending and time.monotonic() < deadline:
        for rank in list(pending):
            path = attempt_dir / f"stacks-rank{rank}.txt"
            if path.exists() and path.stat().st_size > sizes[rank]:
                pending.discard(rank)
        if pending:
            await asyncio.sleep(0.05)  # polling files a signal handler writes
    for rank, pid in pids.items():
        path = attempt_dir / f"stacks-rank{rank}.txt"
        text = ""
        if path.exists():
            with open(path, errors="replace") as f:  # noqa: ASYNC230 - a few KiB, local
                f.seek(sizes[rank])
                text = f.read()[-max_chars:]
        out[str(rank)] = {"pid": str(pid), "state": states[rank],
                          "stack": text or "(no dump within the timeout)"}
    return out
