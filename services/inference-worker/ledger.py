"""Which tasks were in the pipeline call running when a worker process died.

A task whose input kills the worker's own process (a native crash, the OOM killer on one
input) takes the worker's whole call with it, and every task held beside it. Delivered
again together, they would be batched together again and die together until the bus
gives up on all of them. The ledger lets the next worker tell the tasks that ran from
the tasks that waited, and the tasks that ran alone from those that shared a call:

- each live worker holds one slot file in ``dir`` under an exclusive ``flock`` (the
  kernel releases it when the process dies, however it dies);
- before each in-process pipeline call the worker writes the call's task ids into its
  slot (``begin``), and clears it when the call ends (``end``): one ``pwrite`` each, no
  fsync (a process that dies leaves its writes in the page cache; only a host crash
  loses them, and then nothing is blamed);
- a worker that starts locks every slot no live worker holds and reads what each says
  was running (``dead``); the service counts a crash on each of those tasks' records
  (``tasks.to_crashed``), and each slot is emptied as soon as its own count lands
  (``counted``): a worker stopped between two counts leaves only the uncounted slots,
  so the next one never counts a death twice.

A slot names only the call that was running: a task that waited, or whose call had
ended and whose images were being stored, is not blamed. The directory must outlive the
process and be private to the host (a Kubernetes ``emptyDir`` survives a container
restart; a restarted container in compose keeps its filesystem).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from tandem.common import log, metrics

_log = log.get("tandem.inference_worker.ledger")
SUFFIX = ".calls"
DEAD_CALLS = metrics.Counter("tandem_worker_dead_calls", "Pipeline calls a worker process "
                             "died in, found by the next worker on the host")


def default_dir() -> Path:
    """Where slots go unless ``TANDEM_CALLS_DIR`` says: this user's, under the temp dir."""
    return Path(tempfile.gettempdir()) / f"tandem-worker-calls-{os.getuid()}"


async def start(directory: str, count: Callable[[list[str], bool], Awaitable[None]]
                ) -> CallLedger | None:
    """This worker's ledger, once each dead worker's call is counted on its tasks
    (``count(task_ids, alone)``); None (logged) where the directory cannot be used: the
    worker then runs without one, as before it existed."""
    try:
        ledger = CallLedger.open(directory or default_dir())
    except OSError as exc:
        _log.warning("worker.ledger_unusable", dir=str(directory or default_dir()),
                     error=repr(exc))
        return None
    for ids in ledger.dead():
        DEAD_CALLS.inc()
        _log.warning("worker.dead_call", tasks=ids,
                     detail="a worker process died while this call ran")
        try:
            await count(ids, len(ids) == 1)
        except Exception as exc:  # counted nowhere: the tasks are retried as before
            _log.warning("worker.dead_call_uncounted", tasks=ids, error=repr(exc))
        ledger.counted()  # at once: stopped before the next, this one is not counted again
    return ledger


class CallLedger:
    """This worker's slot, and the calls dead workers left in theirs."""

    def __init__(self, fd: int, path: Path, dead: list[tuple[Path, int, list[str]]]) -> None:
        self.fd = fd
        self.path = path
        self._dead = dead  # (slot, its locked fd, the ids its call held)

    @classmethod
    def open(cls, directory: str | Path) -> CallLedger:
        """Take a free slot in ``directory`` (created if missing), and every other free
        slot that names a call: a dead worker's."""
        root = Path(directory)
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        mine: tuple[int, Path] | None = None
        dead: list[tuple[Path, int, list[str]]] = []
        for path in sorted(root.glob(f"slot-*{SUFFIX}"), key=_index):
            fd = _locked(path)
            if fd is None:
                continue  # a live worker's
            ids = _read(fd)
            if ids:
                dead.append((path, fd, ids))
                if mine is None:
                    mine = (os.dup(fd), path)
            elif mine is None:
                mine = (fd, path)
            else:
                os.close(fd)
        first = max((_index(p) for p in root.glob(f"slot-*{SUFFIX}")), default=-1) + 1
        for index in range(first, first + 64):  # every slot is taken: a new one
            if mine is not None:
                break
            path = root / f"slot-{index}{SUFFIX}"
            fd = _locked(path)
            if fd is not None:
                mine = (fd, path)
        if mine is None:
            raise PermissionError(f"no slot of this user's can be made in {root}")
        return cls(mine[0], mine[1], dead)

    def dead(self) -> list[list[str]]:
        """The task ids of each call a dead worker was running, as its slot says."""
        return [ids for _, _, ids in self._dead]

    def clear(self) -> None:
        """Every dead call is counted: empty their slots and let them go (but this one's)."""
        while self._dead:
            self.counted()

    def counted(self) -> None:
        """The first dead call left (in ``dead``'s order) is counted: empty its slot and
        let it go (but this one's)."""
        _, fd, _ = self._dead.pop(0)
        os.pwrite(fd, b"\n", 0)
        os.close(fd)

    def begin(self, task_ids: list[str]) -> None:
        """A call of ``task_ids`` starts now (called on the thread that makes it)."""
        os.pwrite(self.fd, json.dumps(task_ids).encode() + b"\n", 0)

    def end(self) -> None:
        """The call ended, whatever its outcome."""
        os.pwrite(self.fd, b"\n", 0)

    def close(self) -> None:
        """This worker stops: its slot is free (and empty: nothing runs)."""
        with contextlib.suppress(OSError):
            self.end()
            os.close(self.fd)
        for _, fd, _ in self._dead:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._dead = []


def _index(path: Path) -> int:
    number = path.name[len("slot-"):-len(SUFFIX)]
    return int(number) if number.isdigit() else 1 << 30


def _locked(path: Path) -> int | None:
    """``path`` opened and locked, or None if another process holds it, or it is not a
    plain file of this user's (a link, or planted by another user in a shared folder: its
    ids are nobody's crash, and nothing is written through it)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        return None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        os.close(fd)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _read(fd: int) -> list[str]:
    """The ids on a slot's first line (the rest is an older, longer call's tail)."""
    line = os.pread(fd, 1 << 20, 0).split(b"\n", 1)[0]
    if not line.strip():
        return []
    try:
        ids = json.loads(line)
    except ValueError:
        return []  # not one of ours, or torn: blame nobody
    return [i for i in ids if isinstance(i, str)] if isinstance(ids, list) else []
