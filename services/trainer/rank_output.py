"""What becomes of a torchrun agent's output (its ranks' prints, warnings, tracebacks),
and of the attempt folders it is kept in: bounded on disk, and seen where logs are read.

Both launchers (``launcher.spawn``: the coordinator's local one and each node agent's)
start torchrun through this module, so the rules are the same wherever ranks run:

- **Into a pipe this process reads** (``RankOutput``): torchrun's stdout and stderr are
  one pipe, which a thread (``_pump``) reads to its end. Nothing the ranks print waits on
  anything of this process but that read. The thread never stops reading before the end:
  a closed pipe would kill the ranks with SIGPIPE at their next print.
- **Capped on disk** (``CappedLog``): each line goes to the attempt's log
  (``agent-<node rank>-<node>.log``). Once it would pass half of ``max_bytes``
  (``TANDEM_RANK_LOG_MAX_BYTES``) it is renamed ``<log>.1``, replacing the one before, and
  a new one started, between two lines. The two hold at most ``max_bytes`` and always the
  newest output: a failing attempt's last traceback is at the end of the log its
  incident names (``<log>.1`` is what came before). A write that fails (a full disk, a
  file size limit) is undone to its last whole line and tried once more after a
  rotation (the older half makes room for the newest); failing again, those lines are
  lost, not the ranks, and the next line written after them says how many bytes.
- **Echoed to this process's stderr** (``_Echo``, ``TANDEM_RANK_LOG_ECHO``): each line
  prefixed ``[run=<run> attempt=<n> node=<node>] ``, so ``kubectl logs`` and a cluster's
  log pipeline see the ranks' output, which outlives the pod there; stdout stays the
  service's structured log. A line redrawn with ``\\r`` (a progress bar) is echoed as a
  terminal shows it, its last drawing: the prefix stays in sight. One thread per
  process (``_Stderr``) writes every torchrun's lines, so a stderr nobody reads holds
  that one thread and at most ``ECHO_BUFFER`` bytes, however many attempts start: lines
  past those waiting are dropped and counted, and a line where they were says how many,
  rather than torchrun's pipe filling up. A process started with no stderr (fd 2
  closed: the next file opened takes its number) echoes nothing.
- ``Torchrun``: the process with its output; its ``wait`` returns once it has exited
  and its output is in the log (at most ``DRAIN_S`` later: a rank that outlived it still
  holds the pipe), so a log read after the exit has the end of it. Every caller shares
  one wait: a report loop's timed-out waits add nothing, and the drain is waited once.
- ``prune_attempts``: a run's folder keeps the newest ``attempts_kept``
  (``TANDEM_ATTEMPTS_KEPT``) attempts' folders; each launch removes the older ones,
  never the attempt it starts (nor a newer one: another process's), and never anything
  not named as an attempt folder (``attempt-<n>``, a node agent's ``attempt-<n>-node<r>``):
  a checkpoint folder (``step-<n>``, ``tandem.common.checkpoints``) beside them, where
  the checkpoint root is the work root, or a folder holding the checkpoint root (as
  named or as resolved), stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import select
import shutil
import sys
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from tandem.common.settings import Settings

MIB = 1 << 20
CHUNK = 64 * 1024  # one read of the pipe
LINE_MAX = 64 * 1024  # a longer "line" (no newline yet) is cut there
ECHO_BUFFER = MIB  # bytes of lines waiting for stderr, per process, before lines drop
DRAIN_S = 5.0  # how long ``Torchrun.wait`` waits past the exit for the end of the output
ROTATED = ".1"
STDERR_FD = 2

_ATTEMPT = re.compile(r"attempt-([1-9][0-9]{0,9})(?:-node(?:0|[1-9][0-9]{0,5}))?")


class RankLogSettings(Settings):
    """The trainer's settings of its ranks' output (``TrainerSettings`` has them)."""

    rank_log_max_bytes: int = Field(
        64 * MIB, ge=MIB, le=1 << 40, description="The most bytes one torchrun's output "
        "(all its node's ranks) keeps on disk per attempt: its log and the <log>.1 it "
        "rotates into at half of this; the newest output is kept.")
    rank_log_echo: bool = Field(
        True, description="Also write each line of the ranks' output to this process's "
        "stderr, prefixed [run=<run> attempt=<n> node=<node>] (lines dropped and counted "
        "when stderr is slower than the ranks).")
    attempts_kept: int = Field(
        3, ge=1, le=10_000, description="Attempt folders (launch spec, logs, stack dumps) "
        "kept per run under work_root, the newest; each launch removes older ones.")


@dataclass(frozen=True)
class RankLogs:
    """How a launcher keeps its torchruns' output (``RankLogSettings``, as values)."""

    max_bytes: int = 64 * MIB
    echo: bool = True
    attempts_kept: int = 3

    @classmethod
    def of(cls, settings: RankLogSettings) -> RankLogs:
        return cls(max_bytes=settings.rank_log_max_bytes, echo=settings.rank_log_echo,
                   attempts_kept=settings.attempts_kept)


def prefix(run_id: str, attempt: int, node: str) -> str:
    """What each echoed line of one torchrun starts with."""
    return f"[run={run_id} attempt={attempt} node={node}] "


class CappedLog:
    """A log file of at most ``max_bytes`` with the one before it (``<path>.1``); written
    whole lines at a time by one thread (see the module docstring)."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self.path = path
        self.half = max(1, max_bytes // 2)
        self.fd = self._open()
        self.size = os.fstat(self.fd).st_size

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def write(self, data: bytes) -> None:
        """Append ``data`` (whole lines); ``OSError``: none of it is in the log."""
        if self.size and self.size + len(data) > self.half:
            self._rotate()
        try:
            self._append(data)
        except OSError:
            if not self.size:
                raise
            # NOTE: a full disk (or a file size limit): the older half makes room for the
            # newest, which is what the log promises to keep.
            self._rotate()
            self._append(data)

    def _append(self, data: bytes) -> None:
        if self.fd < 0:  # a rotation could not reopen it
            self.fd = self._open()
        view = memoryview(data)
        try:
            while view:  # unbuffered: readable at once, as when torchrun wrote the file
                view = view[os.write(self.fd, view):]
        except OSError:
            with contextlib.suppress(OSError):  # no torn line for the next write to follow
                os.ftruncate(self.fd, self.size)
            raise
        self.size += len(data)

    def _rotate(self) -> None:
        self.close()
        with contextlib.suppress(FileNotFoundError):
            os.replace(self.path, self.path.with_name(self.path.name + ROTATED))
        self.size = 0
        self.fd = self._open()

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def as_shown(line: bytes) -> bytes:
    """``line`` as a terminal shows it: after its last ``\\r`` (a progress bar's last
    drawing), a ``\\r`` ending it (``\\r\\n``) left out."""
    return line.rstrip(b"\r").rpartition(b"\r")[2]


class _Echo:
    """One torchrun's lines on their way to stderr: its prefix, and its lines dropped
    (``_Stderr``, which queues and writes them)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.gap = 0  # lines dropped since the last one queued
        self.dropped = 0  # all lines dropped

    def offer(self, lines: Iterable[bytes]) -> None:
        STDERR.offer(self, [as_shown(line) for line in lines])

    def note(self, text: str) -> None:
        """A line of this module's own, queued whatever the budget."""
        STDERR.note(self, text)

    def close(self) -> None:
        STDERR.note(self, "")


class _Stderr:
    """Every torchrun's lines on their way to this process's stderr: one queue of at most
    ``budget`` bytes, filled by the pumps (never waiting) and emptied by the one thread
    of the process (which may wait on stderr; started with the first line)."""

    def __init__(self, budget: int = ECHO_BUFFER) -> None:
        self.budget = budget
        self.lines: deque[tuple[_Echo, bytes]] = deque()
        self.queued = 0  # bytes in ``lines``
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None

    def offer(self, echo: _Echo, lines: Iterable[bytes]) -> None:
        with self.cond:
            for line in lines:
                if self.queued + len(line) > self.budget:
                    echo.gap += 1
                    echo.dropped += 1
                    continue
                self._note_gap(echo)
                self.lines.append((echo, line))
                self.queued += len(line)
            self._wake()

    def note(self, echo: _Echo, text: str) -> None:
        """``echo``'s lines dropped, then ``text`` (if any), queued whatever the budget."""
        with self.cond:
            self._note_gap(echo)
            if text:
                self.lines.append((echo, f"({text})".encode()))
            self._wake()

    def _note_gap(self, echo: _Echo) -> None:
        if echo.gap:
            self.lines.append((echo, f"({echo.gap} lines dropped here: stderr was slower "
                                     f"than the ranks; the log has them)".encode()))
            echo.gap = 0

    def _wake(self) -> None:
        if self.thread is None:
            self.thread = threading.Thread(target=self._write, name="rank output echo",
                                           daemon=True)
            self.thread.start()
        self.cond.notify()

    def _write(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.lines)
                batch, self.lines, self.queued = self.lines, deque(), 0
            text = "".join(f"{echo.prefix}{line.decode('utf-8', 'replace')}\n"
                           for echo, line in batch).encode()
            # NOTE: to the descriptor, not through sys.stderr: a write blocked on a slow
            # stderr then holds no lock of the interpreter's, whose exit would wait on it.
            with contextlib.suppress(OSError):  # stderr closed: no one to tell
                view = memoryview(text)
                while view:
                    try:
                        view = view[os.write(STDERR_FD, view):]
                    except BlockingIOError:  # a stderr another process made non-blocking
                        select.select([], [STDERR_FD], [])


STDERR = _Stderr()


class RankOutput:
    """One torchrun's stdout and stderr: the pipe it writes (``fd``, given to the child),
    and once it is started (``start``, after the child has its copy) the thread that reads
    it into the capped log and the echo. ``ended`` is set when the pipe is read to its
    end and the log closed."""

    def __init__(self, log_path: Path, logs: RankLogs, prefix: str) -> None:
        self.log = CappedLog(log_path, logs.max_bytes)
        # No stderr at this process's start: fd 2 is whatever file was opened next.
        self.echo = _Echo(prefix) if logs.echo and sys.__stderr__ is not None else None
        try:
            self.read_fd, self.fd = os.pipe()
        except OSError:  # out of descriptors: the log's is not left open
            self.log.close()
            raise
        self.lost = 0  # bytes the log could not take (a full disk)
        self.unsaid = 0  # of those, bytes the log has not said it lost
        self.ended = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Future[None] | None = None

    def start(self) -> None:
        """The child has its end of the pipe: close ours (so the read ends when the child
        and its ranks have all closed theirs) and start reading."""
        self._loop = asyncio.get_running_loop()
        self._done = self._loop.create_future()
        os.close(self.fd)
        threading.Thread(target=self._pump, name="rank output", daemon=True).start()

    def abort(self) -> None:
        """No child was started: close everything."""
        for fd in (self.fd, self.read_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.log.close()
        if self.echo:
            self.echo.close()

    async def drained(self, timeout: float) -> bool:
        """Whether the output was read to its end within ``timeout`` seconds."""
        assert self._done is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._done), timeout)
        return self.ended.is_set()

    def _pump(self) -> None:
        partial = b""
        try:
            while chunk := os.read(self.read_fd, CHUNK):
                data = partial + chunk
                cut = data.rfind(b"\n") + 1 or (len(data) if len(data) >= LINE_MAX else 0)
                whole, partial = data[:cut], data[cut:]
                if whole:
                    self._take(whole)
            if partial:
                self._take(partial)
        finally:
            os.close(self.read_fd)
            self.log.close()
            if self.echo:
                self.echo.close()
            self.ended.set()
            if self._loop is not None and self._done is not None:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                    self._loop.call_soon_threadsafe(_finish, self._done)

    def _take(self, whole: bytes) -> None:
        # NOTE: nothing here may end the loop that reads the pipe (see the docstring).
        said = (f"(tandem: {self.unsaid} bytes of the ranks' output lost here: the log "
                f"could not be written)\n".encode() if self.unsaid else b"")
        try:
            self.log.write(said + whole)
        except Exception as exc:
            if not self.lost and self.echo:
                self.echo.note(f"rank log {self.log.path} not written: {exc!r}")
            self.lost += len(whole)
            self.unsaid += len(whole)
        else:
            self.unsaid = 0
        if self.echo:
            lines = whole.split(b"\n")
            if not lines[-1]:
                lines.pop()
            self.echo.offer(lines)


def _finish(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


class Torchrun:
    """A started torchrun agent and its output (``RankOutput``): its ``pid`` and
    ``returncode`` are the process's; ``wait`` returns its exit code once its output is
    in the log too (or ``DRAIN_S`` after the exit)."""

    def __init__(self, proc: asyncio.subprocess.Process, output: RankOutput) -> None:
        self.proc = proc
        self.output = output
        self.pid = proc.pid
        self._ended: asyncio.Task[int] | None = None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def wait(self) -> asyncio.Future[int]:
        """The exit code, once the output is in the log: one wait shared by every caller,
        so cancelling a caller's (a timeout) cancels no other, and a loop that waits
        with a timeout again and again (a node agent's reports) adds no waiter each
        time, nor a drain of its own once torchrun has exited."""
        if self._ended is None:
            self._ended = asyncio.ensure_future(self._wait())
        return asyncio.shield(self._ended)

    async def _wait(self) -> int:
        code = await self.proc.wait()
        await self.output.drained(DRAIN_S)
        return code


def prune_attempts(current: Path, keep: int, protect: Iterable[str | Path] = ()
                   ) -> list[Path]:
    """Remove the folders of ``current``'s run (its parent) older than its newest
    ``keep`` attempts, ``current``'s counted; return those removed.

    Only folders named as attempts (``attempt-<n>``, ``attempt-<n>-node<r>``) and numbered
    below ``current``'s are candidates, never a symlink, nor a folder that is or holds one
    of ``protect`` (the checkpoint root), as named or resolved. Nothing is done when
    ``current`` is not named as an attempt (a bench's folder). A folder that cannot be
    removed is left (the next launch tries again)."""
    m = _ATTEMPT.fullmatch(current.name)
    if m is None or keep < 1:
        return []
    number = int(m.group(1))
    older: dict[int, list[Path]] = {}
    with contextlib.suppress(OSError):
        for path in current.parent.iterdir():
            if (a := _ATTEMPT.fullmatch(path.name)) and int(a.group(1)) < number \
                    and path.is_dir() and not path.is_symlink():
                older.setdefault(int(a.group(1)), []).append(path)
    kept = sorted(older, reverse=True)[:keep - 1]
    guarded = {q for p in protect if str(p) for q in (Path(p).absolute(), Path(p).resolve())}
    removed = []
    for n in sorted(set(older) - set(kept)):
        for path in older[n]:
            if any(g == p or p in g.parents for g in guarded
                   for p in (path.absolute(), path.resolve())):
                continue
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                removed.append(path)
    return removed
