"""Asynchronous checkpoints: the step blocks only for the copy of state to CPU.

``snapshot`` copies every tensor of the state into CPU buffers allocated once and reused
(pinned on CUDA), then a background thread writes the files into
``step-<N>.incomplete/``, commits them (manifest, fsync, rename) and calls ``on_written``.
One write is in flight at a time: a snapshot taken while the previous write is still
running waits for it first, and that wait counts as blocked time.

Tensors go to safetensors (model, EMA); the rest (optimizer, LR scheduler, RNG states,
data position) goes through ``torch.save`` and is read back with ``weights_only=True``,
so loading a checkpoint never unpickles arbitrary objects.
"""

from __future__ import annotations

import json
import queue
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tandem.common import checkpoints as ck
from tandem.common.events import CheckpointManifest


@dataclass
class Snapshot:
    """A CPU copy of one checkpoint, ready to be written."""

    run_id: str
    step: int
    tensors: dict[str, dict[str, torch.Tensor]]  # file stem -> safetensors dict
    objects: dict[str, Any]  # file stem -> torch.save payload
    jsons: dict[str, Any] = field(default_factory=dict)  # file name -> JSON payload
    blocked_s: float = 0.0


@dataclass
class Written:
    run_id: str
    step: int
    path: Path
    manifest: CheckpointManifest
    blocked_s: float
    write_s: float


class _Buffers:
    """CPU tensors allocated on first use and copied into afterwards, keyed by path."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._bufs: dict[str, torch.Tensor] = {}

    def copy(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
            self._bufs[key] = buf
        buf.copy_(t.detach(), non_blocking=self.pin)
        return buf

    def tree(self, key: str, obj: Any) -> Any:
        """``obj`` with every tensor replaced by its buffer copy (dicts, lists, tuples)."""
        if isinstance(obj, torch.Tensor):
            return self.copy(key, obj)
        if isinstance(obj, dict):
            return {k: self.tree(f"{key}/{k}", v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return type(obj)(self.tree(f"{key}/{i}", v) for i, v in enumerate(obj))
        return obj


class AsyncCheckpointer:
    """Takes snapshots on the training thread and writes them on one background thread."""

    def __init__(self, root: str | Path, run_id: str, *, pin: bool = False,
                 on_written: Callable[[Written], None] | None = None,
                 on_error: Callable[[int, BaseException], None] | None = None,
                 line: ck.Lineage | None = None,
                 before_commit: Callable[[int], None] | None = None) -> None:
        self.root = Path(root)
        self.run_id = run_id
        self.before_commit = before_commit  # a fault hook (drills): called with the step
        self.line = line or ck.Lineage()  # each step is written in the lineage owning it
        self.on_written = on_written
        self.on_error = on_error
        self._bufs = [_Buffers(pin), _Buffers(pin)]  # double-buffered: copy while writing
        self._next = 0
        self._free = [threading.Event(), threading.Event()]
        for ev in self._free:
            ev.set()
        self._q: queue.SimpleQueue[tuple[Snapshot, int] | None] = queue.SimpleQueue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._loop, name="tandem-ckpt", daemon=True)
        self._thread.start()
        self.written: list[Written] = []

    def snapshot(self, step: int, tensors: dict[str, dict[str, torch.Tensor]],
                 objects: dict[str, Any], jsons: dict[str, Any] | None = None,
                 sync: Callable[[], None] | None = None) -> Snapshot:
        """Copy the state to CPU and queue it for writing; returns once the copy is done.

        ``sync`` (e.g. ``torch.cuda.synchronize``) runs after the copies are issued.
        """
        t0 = time.perf_counter()
        slot = self._next
        self._next = 1 - slot
        # This buffer set still being written means two writes are pending: wait for it.
        self._free[slot].wait()
        bufs = self._bufs[slot]
        snap = Snapshot(
            run_id=self.run_id, step=step,
            tensors={stem: {k: bufs.copy(f"{stem}/{k}", v) for k, v in d.items()}
                     for stem, d in tensors.items()},
            objects={stem: bufs.tree(stem, o) for stem, o in objects.items()},
            jsons=dict(jsons or {}),
        )
        if sync is not None:
            sync()
        snap.blocked_s = time.perf_counter() - t0
        self._free[slot].clear()
        self._idle.clear()
        self._q.put((snap, slot))
        return snap

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            snap, slot = item
            try:
                written = self.write(snap)
                self.written.append(written)
                if self.on_written is not None:
                    self.on_written(written)
            except BaseException as exc:
                if self.on_error is not None:
                    self.on_error(snap.step, exc)
            finally:
                self._free[slot].set()
                if all(f.is_set() for f in self._free):
                    self._idle.set()

    def write(self, snap: Snapshot) -> Written:
        """Write ``snap`` to ``step-<N>.incomplete/`` and commit it (any thread). A write
        that fails (a full disk) removes what it wrote: those files are never a
        checkpoint, and on a full disk they hold the room the next one needs."""
        t0 = time.perf_counter()
        lineage = self.line.owner(snap.step)
        tmp = ck.prepare_incomplete(self.root, snap.run_id, snap.step, lineage)
        try:
            for stem, tensors in snap.tensors.items():
                save_file(tensors, str(tmp / f"{stem}.safetensors"))
            for stem, obj in snap.objects.items():
                torch.save(obj, tmp / f"{stem}.pt")
            for name, obj in snap.jsons.items():
                (tmp / name).write_text(json.dumps(obj, indent=1, sort_keys=True))
            if self.before_commit is not None:
                self.before_commit(snap.step)
            path, manifest = ck.commit(snap.run_id, snap.step, tmp, lineage=lineage)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return Written(run_id=snap.run_id, step=snap.step, path=path, manifest=manifest,
                       blocked_s=snap.blocked_s, write_s=time.perf_counter() - t0)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every queued write is on disk; True if idle."""
        return self._idle.wait(timeout)

    def close(self, timeout: float | None = 60.0) -> None:
        self.wait(timeout)
        self._q.put(None)
        self._thread.join(timeout)


def load_objects(path: Path, stem: str) -> Any:
    """A ``torch.save`` file of a checkpoint, loaded without unpickling arbitrary code."""
    return torch.load(path / f"{stem}.pt", map_location="cpu", weights_only=True)
