"""Starting, stopping and inspecting one attempt's ranks (no torch).

Every node of the placement gets one torchrun agent (``python -m
torch.distributed.run``) with a static rendezvous at the first node's address: this is
the multi-node launch, done here for nodes that share this host (the local stack, the
tests). On a real fleet the same command line runs on each node; ``LocalLauncher`` is
the seam. Each agent is its own process group, so a stop kills every rank it forked.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


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
    node: str
    proc: asyncio.subprocess.Process
    log_path: Path


@dataclass
class Attempt:
    agents: list[Agent] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)

    def pids(self) -> list[int]:
        return [a.proc.pid for a in self.agents]


class LocalLauncher:
    def __init__(self, python: str = sys.executable, master_addr: str = "127.0.0.1",
                 monitor_interval: float = 0.5) -> None:
        self.python = python
        self.master_addr = master_addr
        self.monitor_interval = monitor_interval

    def command(self, placement: Placement, node_rank: int, port: int,
                spec_path: Path) -> list[str]:
        return [
            self.python, "-m", "torch.distributed.run",
            f"--nnodes={len(placement.nodes)}", f"--node-rank={node_rank}",
            f"--nproc-per-node={placement.per_node}",
            "--rdzv-backend=static", f"--master-addr={self.master_addr}",
            f"--master-port={port}", "--max-restarts=0",
            f"--monitor-interval={self.monitor_interval}",
            "-m", "tandem.trainer.rank", str(spec_path),
        ]

    async def start(self, placement: Placement, spec_path: Path, attempt_dir: Path,
                    env: dict[str, str] | None = None) -> Attempt:
        port = rendezvous_port(self.master_addr)
        attempt = Attempt()
        base = dict(os.environ if env is None else env)
        base.setdefault("OMP_NUM_THREADS", "1")
        base["PYTHONUNBUFFERED"] = "1"
        for i, node in enumerate(placement.nodes):
            log_path = attempt_dir / f"agent-{i}-{node}.log"
            with open(log_path, "ab") as log:  # noqa: ASYNC230 - local file, instant
                proc = await asyncio.create_subprocess_exec(
                    *self.command(placement, i, port, spec_path),
                    stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                    env={**base, "TANDEM_NODE": node}, start_new_session=True)
            attempt.agents.append(Agent(node=node, proc=proc, log_path=log_path))
        return attempt

    async def stop(self, attempt: Attempt, rank_pids: list[int] = (),  # type: ignore[assignment]
                   timeout: float = 10.0) -> dict[str, int | None]:
        """SIGKILL the ranks and every agent; return the agents' exit codes by node.

        torchrun starts each rank in a session of its own, so killing an agent's process
        group does not reach its ranks: they are found (as the agents' children, plus the
        pids the ranks reported) and their groups killed first.
        """
        victims = set(rank_pids)
        for a in attempt.agents:
            victims.update(children(a.proc.pid))
        for pid in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for a in attempt.agents:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(a.proc.pid, signal.SIGKILL)
        codes: dict[str, int | None] = {}
        for a in attempt.agents:
            try:
                codes[a.node] = await asyncio.wait_for(a.proc.wait(), timeout)
            except TimeoutError:
                codes[a.node] = None
        return codes


def rendezvous_port(host: str) -> int:
    """A port for the attempt's static rendezvous, which every agent must be told before
    any starts (torchrun's ``--master-port``); node 0's agent binds it. If another
    process takes it in between, the attempt fails to rendezvous and is restarted like
    any failed attempt, with a new port."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
