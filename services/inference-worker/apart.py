"""The pipeline call in a process of its own (``TANDEM_PIPELINE_PROCESS``).

In one Python process, the pipeline's own Python (module calls, the scheduler loop: most
of a small model's call) and the worker's (event loop, bus, boto3, PNG encoding) take
turns holding the interpreter lock. Measured on the 2-core development VM, the worker
process never used more than about one core, and each call ran 10-15 % slower than in a
bare loop, with the rest of the worker's work waiting behind it rather than beside it.
A child process has an interpreter of its own: the call runs there alone, and the worker
gets the images back as arrays over a socket, then encodes, uploads and commits them
beside the next call.

- The child builds the pipeline itself from the registry's spec (``pipelines.build``), so
  the model's memory and device live in it only (CUDA included: nothing crosses the
  socket but items, parameters, step counts and the finished arrays).
- ``on_step`` runs in the worker as before: the child reports each step, and a hook that
  raises ``Interrupted`` (every task cancelled, the worker closing) stops the call at
  the child's next step.
- A child that dies (killed, out of memory) fails the call it was running with an error
  naming its exit status; the next call starts a fresh child. A child whose worker dies
  sees its socket close and exits, and one whose call hangs exits once it is orphaned
  (``_exit_with_worker``).
- A call the child started that then reports nothing (no step, no end) for
  ``stall_timeout`` seconds (``TANDEM_CALL_STALL_TIMEOUT``: a hung CUDA call, a driver
  deadlock) is stalled: the child is killed, that call raises ``CallStalled`` (its tasks
  are handed back, not blamed), and the calls queued behind it run on a fresh child. The
  clock is per step and starts when the child takes the call (it says so), never while
  the call waits behind another.
- Models of a run (``run:``, hot-swapped between checkpoints) and the no-op models stay
  in the worker's process; fault models (tests) run apart only where the worker allows
  fault injection, so a test can crash a child as a task's input would.
- ``TANDEM_PIPELINE_CPUS`` (or ``_CPU_COUNT``) pins the children to some CPUs and the
  worker's own threads to the others (``pin``): on a host whose cores the call uses (a
  CPU node, or the cores feeding a GPU), the worker's bursts of encoding, uploads and bus
  I/O after each batch then never take a core from the call, as they do when the
  scheduler may put them anywhere.

One module past 450 lines: the worker's side (``ProcessPipeline``, ``_Child``) and the
child's (``_serve``) are the two ends of one socket protocol, read together.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import Any

from tandem.common import log
from tandem.common.models import ModelSpec, leave_out

from .pipelines import (
    CallStalled,
    CallTime,
    Interrupted,
    Item,
    ModelLoadError,
    Params,
    Pipeline,
    StepHook,
)

_log = log.get("tandem.inference_worker.apart")

KINDS = ("builtin", "dir")  # built from the spec alone: what a child can build by itself


def cpu_list(text: str, name: str = "CPU list") -> frozenset[int]:
    """The CPUs a Linux CPU list names (``0-3,8``, as ``taskset -c`` and ``cpuset.cpus``
    take it); empty names none. ``ValueError`` naming ``name`` and the bad part."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part and not text.strip():
            continue
        lo, dash, hi = part.partition("-")
        if not (lo.isdigit() and (hi.isdigit() if dash else True)):
            raise ValueError(f"{name} {text!r}: {part!r} is not a CPU number or a range "
                             f"a-b (a CPU list looks like 0-3,8)")
        first, last = int(lo), int(hi) if dash else int(lo)
        if last < first:
            raise ValueError(f"{name} {text!r}: the range {part!r} ends before it starts")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def pinning(cpus_text: str, count: int,
            apart: bool) -> tuple[frozenset[int], frozenset[int]] | None:
    """The pipeline processes' CPUs and the worker's own, for ``TANDEM_PIPELINE_CPUS``
    (``cpus_text``) or ``TANDEM_PIPELINE_CPU_COUNT`` (``count``: the last N of the CPUs this
    process may use); None when neither is set. A ``ValueError`` naming the setting where it
    cannot be done: both set, the calls not ``apart``, CPUs this process may not use, or
    none left for the worker."""
    cpus = cpu_list(cpus_text, "TANDEM_PIPELINE_CPUS")
    if not cpus and not count:
        return None
    if cpus and count:
        raise ValueError("TANDEM_PIPELINE_CPUS and TANDEM_PIPELINE_CPU_COUNT are two ways "
                         "to say which CPUs the calls get: set one of them")
    name = (f"TANDEM_PIPELINE_CPUS {cpus_text!r}" if cpus
            else f"TANDEM_PIPELINE_CPU_COUNT {count}")
    if not apart:
        raise ValueError(f"{name} pins the pipeline processes, and there are none: it "
                         f"needs TANDEM_PIPELINE_PROCESS=1")
    allowed = frozenset(os.sched_getaffinity(0))
    if count and count < len(allowed):
        cpus = frozenset(sorted(allowed)[-count:])
    if cpus - allowed:
        raise ValueError(f"{name} names CPUs this worker may not use: "
                         f"{sorted(cpus - allowed)} (it may use {sorted(allowed)})")
    if count >= len(allowed) or not allowed - cpus:
        raise ValueError(f"{name} takes every CPU this worker may use ({sorted(allowed)}): "
                         f"none is left for its own threads")
    return cpus, allowed - cpus


def pin(cpus: frozenset[int] | set[int], pid: int | str = "self") -> None:
    """Every thread of process ``pid`` (this one by default) onto ``cpus`` (Linux sets
    affinity per thread; a thread started later takes its starter's), until a pass finds no
    thread it had not moved."""
    done: set[int] = set()
    while True:
        tids = {int(t) for t in os.listdir(f"/proc/{pid}/task")} - done
        if not tids:
            return
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.sched_setaffinity(tid, cpus)
        done |= tids


def eligible(spec: ModelSpec, fault_injection: bool = False) -> bool:
    """Whether ``spec``'s pipeline can run in a child process (a fault model's only with
    ``fault_injection``)."""
    return spec.source_kind in KINDS or (fault_injection and spec.source_kind == "fault")


class PipelineProcessDied(RuntimeError):
    """The child process running a call died before answering; ``stepped``: after it had
    reported a step of that call."""

    def __init__(self, message: str, stepped: bool) -> None:
        super().__init__(message)
        self.stepped = stepped


class ProcessPipeline(Pipeline):
    """A pipeline whose calls run in a child process; ``encode`` stays here.

    ``concurrent``: the batcher hands over the next call while one runs; the child queues
    it and starts it as the last one ends, with no round trip through the worker between.
    """

    concurrent = True

    def __init__(self, spec: ModelSpec, device: str = "auto", dtype: str = "auto",
                 threads: int = 0, start_timeout: float = 600.0,
                 cpus: frozenset[int] = frozenset(), fault_injection: bool = False,
                 stall_timeout: float = 0.0) -> None:
        """``cpus``: the child runs on these CPUs only (empty: wherever the worker may), with
        ``threads`` 0 meaning one torch thread per CPU of them. ``stall_timeout``: seconds a
        started call may go without a step before the child is killed (0: never)."""
        super().__init__(spec)
        self._args = (spec, device, dtype, threads, cpus, fault_injection)
        self._start_timeout = start_timeout
        self.stall_timeout = stall_timeout
        self._lock = threading.Lock()  # (re)starting the child
        self._child: _Child | None = None
        self._finalizer = weakref.finalize(self, _Child.close_ref, [None])
        self._live()

    @property
    def pid(self) -> int | None:
        child = self._child
        return child.proc.pid if child is not None else None

    @property
    def threads(self) -> int | None:
        """The torch intra-op threads of its calls (set in the child, where they run)."""
        child = self._child
        return child.threads if child is not None else None

    def _live(self, dead: _Child | None = None) -> _Child:
        """The child, started afresh if there is none, it exited, or it is ``dead``."""
        with self._lock:
            child = self._child
            if child is None or child is dead or not child.alive():
                if child is not None:
                    child.close()
                    _log.warning("worker.pipeline_process_restart", model=self.spec.name)
                child = self._child = _Child.start(self.spec.name, self._args,
                                                   self._start_timeout)
                self._finalizer.detach()
                self._finalizer = weakref.finalize(self, _Child.close_ref, [child])
            return child

    def images(self, items: list[Item], params: Params, on_step: StepHook) -> list[Any]:
        return self.call(items, params, on_step)[0]

    def call(self, items: list[Item], params: Params,
             on_step: StepHook) -> tuple[list[Any], CallTime]:
        child = self._live()
        try:
            return child.call(items, params, on_step, self.stall_timeout)
        except PipelineProcessDied as exc:
            # Dead before this call's first step: most likely before it reached the child
            # (killed between calls, not yet reaped, or for a call stalled ahead of this
            # one); once more, on a fresh child.
            if exc.stepped:
                raise
            return self._live(dead=child).call(items, params, on_step, self.stall_timeout)

    def close(self) -> None:
        self._finalizer()


class _Child:
    """One child process, the socket to it, and the thread that reads the socket and
    hands each message to the call it belongs to."""

    def __init__(self, model: str, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        self.model = model
        self.proc = proc
        self.sock = sock
        self.conn = Connection(os.dup(sock.fileno()))
        self._send = threading.Lock()
        self._calls: dict[int, queue.SimpleQueue[tuple[Any, ...]]] = {}
        self._next = 0
        self._dead: BaseException | None = None
        self.stalled = False  # killed for a call that stopped reporting (``kill``)
        self.threads: int | None = None  # the torch threads in force there, once ready

    @classmethod
    def start(cls, model: str, args: tuple[Any, ...], timeout: float) -> _Child:
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tandem.inference_worker.apart", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        child = cls(model, proc, ours)
        try:
            child.conn.send(("build", *args))
            if not child.conn.poll(timeout):
                raise ModelLoadError(model, f"its pipeline process did not start within "
                                     f"{timeout:.0f} s", lasting=False)
            reply = child.conn.recv()
        except (EOFError, OSError) as exc:
            child.close()
            raise ModelLoadError(model, f"its pipeline process exited while loading "
                                 f"(status {proc.poll()}): {exc!r}", lasting=False) from None
        except BaseException:
            child.close()
            raise
        if reply[0] != "ready":
            child.close()
            raise ModelLoadError(model, reply[1], lasting=reply[2])
        child.threads = reply[1]
        threading.Thread(target=child._read, name=f"pipeline-process-{proc.pid}",
                         daemon=True).start()
        _log.info("worker.pipeline_process", model=model, pid=proc.pid)
        return child

    def alive(self) -> bool:
        return not self.stalled and self._dead is None and self.proc.poll() is None

    def _read(self) -> None:
        try:
            while True:
                msg = self.conn.recv()
                q = self._calls.get(msg[1])
                if q is not None:
                    q.put(msg)
        except (EOFError, OSError) as exc:
            self._dead = exc  # first, so a call handed over after the loop below sees it
            for q in list(self._calls.values()):
                q.put(("died",))

    def call(self, items: list[Item], params: Params, on_step: StepHook,
             stall_timeout: float = 0.0) -> tuple[list[Any], CallTime]:
        """One call in the child: its images and how long it took there. Once the child
        has started it, each reply must come within ``stall_timeout`` seconds (0: no
        limit), or the child is killed and ``CallStalled`` raised."""
        replies: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        stopped = stepped = False
        wait: float | None = None  # for the next reply: none until the child starts it
        step = 0
        with self._send:
            cid = self._next
            self._next += 1
            self._calls[cid] = replies
        try:
            if self._dead is None:
                try:
                    with self._send:
                        self.conn.send(("images", cid, items, params))
                except OSError:
                    pass  # the reader sees the socket end too, and says so below
            else:
                replies.put(("died",))
            while True:
                try:
                    msg = replies.get(timeout=wait)
                except queue.Empty:
                    self.kill()
                    raise CallStalled(self.model, stall_timeout, step, params.steps,
                                      ended=True) from None
                if msg[0] == "start":
                    wait = stall_timeout or None
                    continue
                if msg[0] == "step":
                    stepped = True
                    step = msg[2]
                    if stopped:
                        continue
                    try:
                        on_step(msg[2], msg[3])
                    except Interrupted:
                        stopped = True
                        self._stop(cid)
                    continue
                break
        finally:
            self._calls.pop(cid, None)
        if msg[0] == "died":
            raise PipelineProcessDied(
                f"the pipeline process of {self.model} died during a call (exit status "
                f"{self._status()}): {self._dead!r}", stepped)
        if stopped or msg[0] == "interrupted":
            raise Interrupted()
        if msg[0] == "failed":
            raise RuntimeError(f"{msg[2]}: {msg[3]}")
        _, _, images, took = msg
        return images, took

    def _stop(self, cid: int) -> None:
        try:
            with self._send:
                self.conn.send(("stop", cid))
        except OSError:
            pass  # dead: the reader says so

    def kill(self) -> None:
        """A call here stalled: the process is killed (its calls cannot be stopped between
        steps) and every call waiting on it fails as if it had died (the socket is shut
        down, so the reader wakes even if the process does not die); the next call starts
        a fresh child."""
        self.stalled = True
        _log.error("worker.pipeline_process_stalled", model=self.model, pid=self.proc.pid)
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _status(self) -> int | None:
        try:
            return self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # the reader wakes; the child reads EOF
        self.sock.close()
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            try:
                self.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                # Killed and still there: stuck in its driver (a hung GPU), it goes when
                # that call returns, if ever. Reaped by a thread of its own: the next call,
                # which waits for this close, must not wait for that.
                _log.error("worker.pipeline_process_unkillable", model=self.model,
                           pid=self.proc.pid)
                threading.Thread(target=self.proc.wait, daemon=True).start()
        self.conn.close()

    @staticmethod
    def close_ref(ref: list[_Child | None]) -> None:
        if ref[0] is not None:
            ref[0].close()


# ------------------------------------------------------------------------- the child


def _serve(conn: Connection) -> None:
    from .pipelines import build, set_threads

    kind, spec, device, dtype, threads, cpus, fault_injection = conn.recv()
    assert kind == "build", kind
    try:
        if cpus:  # before torch starts a thread: each takes this one's CPUs
            os.sched_setaffinity(0, cpus)
            threads = threads or len(cpus)
        # After the pinning, so it runs on the child's CPUs as every other thread does.
        threading.Thread(target=_exit_with_worker, args=(os.getppid(),), daemon=True,
                         name="exit-with-worker").start()
        if not eligible(spec, fault_injection):
            raise ModelLoadError(spec.name, "not a pipeline a child process can build")
        leave_out(spec.optional)  # one model per child: before its build imports diffusers
        in_force = set_threads(threads)  # 0: torch's own count
        pipe = build(spec, device, dtype, fault_injection)
    except ModelLoadError as exc:
        conn.send(("error", exc.reason, exc.lasting))
        return
    except Exception as exc:
        conn.send(("error", repr(exc), False))
        return
    conn.send(("ready", in_force))

    queued: collections.deque[tuple[Any, ...]] = collections.deque()
    stopped: set[int] = set()
    current = -1

    def take(msg: tuple[Any, ...]) -> None:
        if msg[0] == "images":
            queued.append(msg)
        elif msg[0] == "stop" and (msg[1] == current or any(q[1] == msg[1] for q in queued)):
            stopped.add(msg[1])  # a stop for a call that already ended is dropped

    def on_step(step: int, total: int) -> None:
        while conn.poll(0):  # EOFError (the worker is gone) ends this process
            take(conn.recv())
        if current in stopped:
            raise Interrupted()
        conn.send(("step", current, step, total))

    while True:
        while not queued:
            take(conn.recv())  # EOFError: the worker is gone
        _, current, items, params = queued.popleft()
        if current in stopped:
            stopped.discard(current)
            conn.send(("interrupted", current))
            continue
        conn.send(("start", current))  # its stall clock starts now, not while it queued
        try:
            images, took = pipe.call(items, params, on_step)  # timed here, in the child
        except Interrupted:
            conn.send(("interrupted", current))
        except Exception as exc:
            conn.send(("failed", current, type(exc).__name__, str(exc)))
        else:
            conn.send(("done", current, images, took))
        stopped.discard(current)
        current = -1


def _exit_with_worker(worker: int, every: float = 1.0) -> None:
    """Exit once the worker that started this process is gone (this one is reparented),
    whatever the main thread is in. The socket tells it only between steps: a call hung
    on its device (or a fault model's pipe) kept a child of a worker killed -9 alive for
    good, its accelerator held (found behind the stall tests, 37 minutes on)."""
    while os.getppid() == worker:
        time.sleep(every)  # polling the parent: no event says it died
    os._exit(1)


if __name__ == "__main__":
    try:
        _serve(Connection(int(sys.argv[1])))
    except (EOFError, OSError, KeyboardInterrupt):
        pass
    os._exit(0)  # no interpreter teardown of torch's threads
