"""Distributed Checkpoint (DCP) shards read without unpickling anything but DCP's own
metadata: shared by the trainer (a resume, on any number of ranks) and the inference
worker (a sharded checkpoint consolidated into one model to serve).

DCP's on-disk format pickles two things: the ``.metadata`` file (which shard holds
which chunk of which tensor) and the non-tensor values of a state (optimizer step
counts, hyper-parameters, stored as ``torch.save`` bytes). Neither is loaded the way
DCP's defaults would: the metadata goes through ``_MetadataUnpickler``, which admits only
DCP's metadata classes (and a few builtins they are made of); the values go through
``torch.load(weights_only=True)`` (``SafePlanner``). ``check_shards`` makes sure that
every file the metadata points at is one the verified manifest lists, before DCP reads
any.

Imports torch: ``tandem.common.checkpoints`` does not import this module; the services
that have torch (trainer, inference worker) import it themselves.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from tandem.common.events import CheckpointManifest

from .layout import DCP_METADATA, SHARD_DIR
from .local import CorruptCheckpoint

_ALLOWED = {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"}
_ALLOWED_NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                  ("pathlib", "PosixPath"), ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module in _ALLOWED and not name.startswith("__")) or (module, name) in _ALLOWED_NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which a "
                                     "checkpoint's metadata never holds")


def read_metadata(shards: Path) -> Metadata:
    """The DCP metadata in ``shards/`` (only DCP's own classes are unpickled)."""
    md = _MetadataUnpickler(io.BytesIO((shards / ".metadata").read_bytes())).load()
    if not isinstance(md, Metadata):
        raise pickle.UnpicklingError("DCP metadata is not a Metadata object")
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = StorageMeta()
    return md


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read by ``read_metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_metadata(Path(self.path))


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner with the non-tensor values of a state (optimizer step counts,
    hyper-parameters) loaded by ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                        loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def check_shards(path: Path, manifest: CheckpointManifest) -> Metadata:
    """The DCP metadata of the checkpoint at ``path``; ``CorruptCheckpoint`` unless every
    shard file it points at is listed in ``manifest`` (whose checksums the caller has
    verified)."""
    listed = {f.name for f in manifest.files}
    try:
        md = read_metadata(path / SHARD_DIR)
    except Exception as exc:
        raise CorruptCheckpoint(path, f"{DCP_METADATA} unreadable: {exc}") from None
    wanted = {f"{SHARD_DIR}/{info.relative_path}" for info in md.storage_data.values()}
    if lack := sorted(wanted - listed):
        raise CorruptCheckpoint(path, f"DCP metadata needs {', '.join(lack)}, which the "
                                      "manifest does not list")
    return md


def load(path: Path, state: dict[str, Any], manifest: CheckpointManifest, *,
         process_group: Any = None, single_process: bool = False) -> None:
    """Fill ``state`` (a DCP state dict: tensors or DTensors, nested) in place from the
    sharded checkpoint at ``path``, whatever world size wrote it: DCP reads, for each
    tensor asked for, the parts of the shards that overlap it. Collective over the
    default group (or ``process_group``) unless ``single_process``. Only the keys of
    ``state`` are read."""
    check_shards(path, manifest)
    reader, planner = SafeReader(path / SHARD_DIR), SafePlanner()
    if not single_process:
        dcp.load(state, storage_reader=reader, planner=planner, process_group=process_group)
        return
    with warnings.catch_warnings():
        # NOTE: DCP warns on every load without a process group; one process reading
        # the whole tensors is exactly what is meant here.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled",
                                category=UserWarning)
        dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)


def full_weights(path: Path, manifest: CheckpointManifest, model: torch.nn.Module
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The whole model state and EMA weights of a sharded checkpoint, gathered from every
    rank's shards in this one process (no process group), shaped as ``model``'s own:
    what serving loads. The optimizer state in the same shard files is not read.

    ``CorruptCheckpoint`` when the metadata points outside the manifest; a key
    ``model`` has and the checkpoint lacks (another architecture) is DCP's
    ``CheckpointException`` / ``RuntimeError``.
    """
    weights = {k: torch.empty_like(v, device="cpu") for k, v in model.state_dict().items()}
    ema = {k: torch.empty_like(p, device="cpu") for k, p in model.named_parameters()}
    state = {"model": weights, "ema": ema}
    load(path, state, manifest, single_process=True)
    return state["model"], state["ema"]
