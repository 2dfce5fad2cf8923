"""Sharded checkpoints of an FSDP run: every rank saves its own shards with Distributed
Checkpoint (DCP) into its node's local checkpoint folder, and loads them back on any
number of ranks (DCP reshards on load).

Save (``ShardedCheckpointer.save``, collective: every rank calls it at the same step):

1. wait for the previous save (one in flight at a time; the wait counts as blocked);
2. every rank makes ``step-<N>.incomplete/shards/`` if it is not there yet: leftovers
   of an interrupted attempt were removed when the checkpointer was made (by the node's
   first rank, ``LOCAL_RANK`` 0, before every rank passed a barrier), so the folder
   holds only this attempt's files, and the step needs no barrier of its own;
3. ``dcp.async_save`` stages this rank's shards (model, optimizer, EMA) into CPU
   buffers the stager keeps between checkpoints: the step is blocked for that copy
   only. Writing, the exchange of write results and rank 0's ``.metadata`` run on a
   background thread over a gloo group of their own, apart from training's collectives;
4. on that thread rank 0 also writes the scheduler, RNG states of every rank, trainer
   state and model config; when DCP's future is done every rank's shards and the
   metadata are on disk (rank 0 writes the metadata only after every rank reported its
   writes), so the node's first rank commits the folder (``ck.commit`` with
   ``world_size``): a whole checkpoint, or this node's part of one. Nodes that share
   rank 0's folder (the local launcher: one host, one checkpoint root) leave it to
   rank 0's node: one folder, one committer (``_shares_rank0s_folder``).

Load (``load``) goes through ``tandem.common.checkpoints.dcp``: before DCP reads
anything, the DCP metadata must name only shard files the verified manifest lists; the
metadata (a pickle, DCP's format) is read with an unpickler that admits only DCP's
metadata classes, and the non-tensor values of the state (``torch.save`` bytes, which
DCP's own planner loads with ``weights_only=False``) with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from tandem.common import checkpoints as ck
from tandem.common.checkpoints import dcp as safe_dcp
from tandem.common.events import CheckpointManifest
from tandem.trainer.async_ckpt import Written, load_objects


class ShardedCheckpointer:
    """One rank's side of sharded checkpoints (every rank of an FSDP run has one).

    Constructing it is collective (it makes the gloo group the background saves use).
    ``on_written`` is called on the node's first rank once the node's folder is committed
    (a folder shared with rank 0's node: on rank 0 only).
    """

    def __init__(self, root: str | Path, run_id: str, *, rank: int, local_rank: int,
                 world: int, node: str = "", pin: bool = False,
                 on_written: Callable[[Written], None] | None = None,
                 on_error: Callable[[int, BaseException], None] | None = None,
                 line: ck.Lineage | None = None,
                 before_commit: Callable[[int], None] | None = None) -> None:
        self.root = Path(root)
        self.before_commit = before_commit  # a fault hook (drills): called with the step
        self.run_id = run_id
        self.line = line or ck.Lineage()  # each step is written in the lineage owning it
        self.rank, self.local_rank, self.world, self.node = rank, local_rank, world, node
        self.on_written = on_written
        self.on_error = on_error
        # NOTE: a group of its own, so the background thread's collectives (plan, write
        # results, metadata) never interleave with training's on the default group.
        self.group = dist.new_group(backend="gloo")
        if local_rank == 0:
            # A leftover could hold shards of another world size, which would then be
            # listed as this checkpoint's.
            ck.remove_incomplete(self.root, run_id)
        dist.barrier(group=self.group)
        shared = self._shares_rank0s_folder()  # collective: every rank calls it
        self.commits = local_rank == 0 and (rank == 0 or not shared)
        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=pin, use_shared_memory=False, use_async_staging=False,
            use_non_blocking_copy=pin))
        self._thread: threading.Thread | None = None
        self.written: list[Written] = []
        self.errors: list[tuple[int, BaseException]] = []

    def _shares_rank0s_folder(self) -> bool:
        """Collective: whether this rank sees the run folder rank 0 writes in (nodes on
        one host, or one shared volume: the local launcher), found by looking, not
        guessed from the launcher: rank 0 makes a folder of a name only it drew, and
        every rank looks for it.

        NOTE: a shared folder is then committed by rank 0's node alone. When every
        node's first rank committed the same ``step-<N>.incomplete``, the second found
        the folder gone (or the first one's ``step-<N>`` in its way): a failed write
        reported for a checkpoint that was whole, or, before ``ck.commit`` refused a
        second committer, no checkpoint left at all."""
        token = [uuid.uuid4().hex if self.rank == 0 else ""]
        dist.broadcast_object_list(token, src=0, group=self.group)
        # Ends in ``.incomplete``: a crash's leftover goes with ``remove_incomplete``.
        probe = ck.run_dir(self.root, self.run_id) / f".shared-{token[0]}{ck.INCOMPLETE}"
        if self.rank == 0:
            probe.mkdir(parents=True)
        dist.barrier(group=self.group)
        shared = probe.is_dir()
        dist.barrier(group=self.group)
        if self.rank == 0:
            probe.rmdir()
        return shared

    def save(self, step: int, state: dict[str, Any], rank0: dict[str, Any] | None = None,
             jsons: dict[str, Any] | None = None) -> float:
        """Queue checkpoint ``step`` of this rank's ``state`` (DCP state dict: tensors or
        DTensors, nested); rank 0 passes ``rank0`` (``torch.save`` payloads by file stem)
        and ``jsons``. Returns the seconds the caller was blocked."""
        t0 = time.perf_counter()
        self.wait()
        tmp = ck.incomplete_dir(self.root, self.run_id, step, self.line.owner(step))
        (tmp / ck.SHARD_DIR).mkdir(parents=True, exist_ok=True)
        writer = FileSystemWriter(tmp / ck.SHARD_DIR, single_file_per_rank=True,
                                  thread_count=1, sync_files=True)
        future = dcp.async_save(state, storage_writer=writer, process_group=self.group,
                                async_stager=self.stager)
        blocked = time.perf_counter() - t0
        self._thread = threading.Thread(
            target=self._finish, args=(step, tmp, future, rank0 or {}, jsons or {}, blocked),
            name="tandem-dcp", daemon=True)
        self._thread.start()
        return blocked

    def _finish(self, step: int, tmp: Path, future: Future, rank0: dict[str, Any],
                jsons: dict[str, Any], blocked: float) -> None:
        t0 = time.perf_counter()
        try:
            for stem, obj in rank0.items():
                torch.save(obj, tmp / f"{stem}.pt")
            for name, obj in jsons.items():
                (tmp / name).write_text(json.dumps(obj, indent=1, sort_keys=True))
            future.result()
            if not self.commits:
                return
            if self.before_commit is not None:
                self.before_commit(step)
            path, manifest = ck.commit(self.run_id, step, tmp, world_size=self.world,
                                       node=self.node, lineage=self.line.owner(step))
            written = Written(run_id=self.run_id, step=step, path=path, manifest=manifest,
                              blocked_s=blocked, write_s=time.perf_counter() - t0)
            self.written.append(written)
            if self.on_written is not None:
                self.on_written(written)
        except BaseException as exc:
            self.errors.append((step, exc))
            if self.commits:
                # Never a checkpoint, and on a full disk its files hold the room the next
                # one needs: the node's first rank removes them once every rank's writes
                # have ended (DCP's future settles after its collective finish).
                with contextlib.suppress(BaseException):
                    future.exception()
                shutil.rmtree(tmp, ignore_errors=True)
            if self.on_error is not None:
                self.on_error(step, exc)

    def wait(self, timeout: float | None = None) -> bool:
        """Until the save in flight (if any) is committed or has failed; True if idle."""
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return False
            self._thread = None
        return True

    def close(self, timeout: float | None = None) -> None:
        """Wait for the save in flight, then free the staging buffers."""
        if self.wait(timeout):
            self.stager.close()


def state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             ema: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The DCP state of an FSDP model: sharded model and optimizer state and the EMA."""
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd, "ema": ema}


def load(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         ema: dict[str, torch.Tensor], manifest: CheckpointManifest) -> dict[str, Any]:
    """Load the sharded checkpoint at ``path`` into ``model``, ``optimizer`` and ``ema``
    (in place) on this run's ranks, whatever world size wrote it. Collective.

    Returns rank 0's objects (``scheduler``, ``rng``, ``trainer``).
    """
    state = state_of(model, optimizer, ema)
    safe_dcp.load(path, state, manifest)
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return {stem: load_objects(path, stem) for stem in ("scheduler", "rng", "trainer")}
