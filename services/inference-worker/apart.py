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
  sees its socket close and exits.
- Models of a run (``run:``, hot-swapped between checkpoints) and the no-op and fault
  models stay in the worker's process.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection
from typing import Any

from tandem.common import log
from tandem.common.models import ModelSpec

from .pipelines import Interrupted, Item, ModelLoadError, Params, Pipeline, StepHook

_log = log.get("tandem.inference_worker.apart")

KINDS = ("builtin", "dir")  # built from the spec alone: what a child can build by itself


def eligible(spec: ModelSpec) -> bool:
    """Whether ``spec``'s pipeline can run in a child process."""
    return spec.source_kind in KINDS


class PipelineProcessDied(RuntimeError):
    """The child process running a call died before answering; ``stepped``: after it had
    reported a step of that call."""

    def __init__(self, message: str, stepped: bool) -> None:
        super().__init__(message)
        self.stepped = stepped


class ProcessPipeline(Pipeline):
    """A pipeline whose calls run in a child process; ``encode`` stays here."""

    def __init__(self, spec: ModelSpec, device: str = "auto", dtype: str = "auto",
                 threads: int = 0, start_timeout: float = 600.0) -> None:
        super().__init__(spec)
        self._args = (spec, device, dtype, threads)
        self._start_timeout = start_timeout
        self._lock = threading.Lock()
        self._child: _Child | None = None
        self._cpu_s = 0.0  # the children's CPU seconds inside calls, summed
        self._finalizer = weakref.finalize(self, _Child.close_ref, [None])
        self._start()

    @property
    def pid(self) -> int | None:
        child = self._child
        return child.proc.pid if child is not None else None

    def cpu_clock(self) -> float:
        return self._cpu_s

    def _start(self) -> None:
        child = _Child.start(self.spec.name, self._args, self._start_timeout)
        self._child = child
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _Child.close_ref, [child])

    def images(self, items: list[Item], params: Params, on_step: StepHook) -> list[Any]:
        with self._lock:
            for attempt in (1, 2):
                if self._child is None or not self._child.alive():
                    _log.warning("worker.pipeline_process_restart", model=self.spec.name)
                    self._start()
                child = self._child
                assert child is not None
                try:
                    images, cpu_s = child.call(items, params, on_step)
                except PipelineProcessDied as exc:
                    child.close()
                    self._child = None
                    # Dead before its first step: most likely before this call reached it
                    # (killed between calls, not yet reaped); once more on a fresh child.
                    if exc.stepped or attempt == 2:
                        raise
                    continue
                self._cpu_s += cpu_s
                return images
            raise AssertionError("unreachable")

    def close(self) -> None:
        self._finalizer()


class _Child:
    """One child process and the socket to it."""

    def __init__(self, model: str, proc: subprocess.Popen[bytes], conn: Connection) -> None:
        self.model = model
        self.proc = proc
        self.conn = conn

    @classmethod
    def start(cls, model: str, args: tuple[Any, ...], timeout: float) -> _Child:
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tandem.inference_worker.apart", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        child = cls(model, proc, Connection(ours.detach()))
        try:
            child.conn.send(("build", *args))
            if not child.conn.poll(timeout):
                raise ModelLoadError(model, f"its pipeline process did not start within "
                                     f"{timeout:.0f} s")
            reply = child.conn.recv()
        except (EOFError, OSError) as exc:
            child.close()
            raise ModelLoadError(model, f"its pipeline process exited while loading "
                                 f"(status {proc.poll()}): {exc!r}") from None
        except BaseException:
            child.close()
            raise
        if reply[0] != "ready":
            child.close()
            raise ModelLoadError(model, reply[1])
        _log.info("worker.pipeline_process", model=model, pid=proc.pid)
        return child

    def alive(self) -> bool:
        return self.proc.poll() is None and not self.conn.closed

    def call(self, items: list[Item], params: Params,
             on_step: StepHook) -> tuple[list[Any], float]:
        """One call in the child: its images and the CPU seconds it took there."""
        stopped = stepped = False
        try:
            self.conn.send(("images", items, params))
            while True:
                msg = self.conn.recv()
                if msg[0] == "step":
                    stepped = True
                    if stopped:
                        continue
                    try:
                        on_step(msg[1], msg[2])
                    except Interrupted:
                        stopped = True
                        self.conn.send(("stop",))
                    continue
                break
        except (EOFError, OSError) as exc:
            status = self._status()
            raise PipelineProcessDied(f"the pipeline process of {self.model} died during "
                                      f"a call (exit status {status}): {exc!r}",
                                      stepped) from None
        if stopped or msg[0] == "interrupted":
            raise Interrupted()
        if msg[0] == "failed":
            raise RuntimeError(f"{msg[1]}: {msg[2]}")
        return msg[1], msg[2]

    def _status(self) -> int | None:
        try:
            return self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            return None

    def close(self) -> None:
        if not self.conn.closed:
            self.conn.close()  # the child's next read ends: it exits
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    @staticmethod
    def close_ref(ref: list[_Child | None]) -> None:
        if ref[0] is not None:
            ref[0].close()


# ------------------------------------------------------------------------- the child


def _serve(conn: Connection) -> None:
    from .pipelines import build, set_threads

    kind, spec, device, dtype, threads = conn.recv()
    assert kind == "build", kind
    try:
        if threads:
            set_threads(threads)
        pipe = build(spec, device, dtype)
        if isinstance(pipe, ProcessPipeline) or not eligible(spec):
            raise ModelLoadError(spec.name, "not a pipeline a child process can build")
    except ModelLoadError as exc:
        conn.send(("error", exc.reason))
        return
    except Exception as exc:
        conn.send(("error", repr(exc)))
        return
    conn.send(("ready",))

    def on_step(step: int, total: int) -> None:
        while conn.poll(0):  # EOFError (the worker is gone) ends this process
            if conn.recv()[0] == "stop":
                raise Interrupted()
        conn.send(("step", step, total))

    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] != "images":
            continue  # a stop that came after its call ended
        cpu0 = time.thread_time()
        try:
            images = pipe.images(msg[1], msg[2], on_step)
        except Interrupted:
            conn.send(("interrupted",))
        except EOFError:
            return
        except Exception as exc:
            conn.send(("failed", type(exc).__name__, str(exc)))
        else:
            conn.send(("done", images, time.thread_time() - cpu0))


if __name__ == "__main__":
    try:
        _serve(Connection(int(sys.argv[1])))
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    os._exit(0)  # no interpreter teardown of torch's threads
