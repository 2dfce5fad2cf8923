"""Local checkpoints: the atomic commit, verification, the newest valid, and removal.

The trainer writes ``step-<N>.incomplete/`` and calls ``commit``; on restart it resumes
from ``newest_valid``. Names and the manifest come from ``layout``. Every removal of a
local checkpoint folder is a function here, and each says who may call it:

- ``commit`` replaces a ``step-<N>`` the same step is rewritten over (a deterministic
  rewrite after a resume) and ``newest_valid`` a stale ``.corrupt`` copy;
- ``prepare_incomplete`` / ``remove_incomplete`` delete the trainer's own unfinished
  writes, never a whole checkpoint;
- ``remove_steps`` deletes whole, committed copies: only the checkpointer calls it
  (see ``tandem.checkpointer.retention.delete_local`` for why it is that one).

No torch: the files are bytes.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tandem.common.events import CheckpointManifest

from . import checksum
from .layout import (
    INCOMPLETE,
    MANIFEST,
    CheckpointId,
    corrupt_dir,
    encode_manifest,
    incomplete_dir,
    local_steps,
    parse_checkpoint,
    parse_manifest,
    run_dir,
    scan,
    sharded,
    step_name,
)
from .lineage import Lineage

COMMITTING = ".commit" + INCOMPLETE  # ``step-<N>.commit.incomplete``: a commit under way


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare_incomplete(root: str | Path, run_id: str, step: int, lineage: int = 0) -> Path:
    """An empty ``step-<N>.incomplete/`` (of ``lineage``) to write a checkpoint into (a
    leftover of an interrupted write of the same checkpoint is removed first)."""
    tmp = incomplete_dir(root, run_id, step, lineage)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(run_id: str, step: int, tmp: Path, *, world_size: int = 0,
           node: str = "", lineage: int = 0) -> tuple[Path, CheckpointManifest]:
    """Write the manifest into ``tmp``, fsync everything and rename it to ``step-<N>``
    (``step-<N>-l<lineage>`` in a lineage after a rollback).

    A crash at any point leaves either ``step-<N>.incomplete`` (ignored) or a whole
    ``step-<N>``. An existing ``step-<N>`` (a deterministic rewrite after a resume) is
    replaced. One commit of a ``tmp`` at a time: another at once raises
    ``FileExistsError``, one after it ``FileNotFoundError`` (``tmp`` is gone), and
    neither removes or rewrites anything. ``world_size`` > 0 commits a sharded
    checkpoint (``layout.sharded``): the manifest is a whole one when ``tmp`` holds
    every rank's shards, else ``node``'s part.
    """
    # NOTE: one committer of a folder at a time (mkdir is atomic): two that commit the
    # same ``tmp`` (a folder the nodes share) would write the manifest over each other,
    # and the second would find the first one's ``step-<N>`` where its own was to go.
    # A leftover of a crash ends in ``.incomplete``: ``remove_incomplete`` clears it.
    lock = tmp.with_name(step_name(step, lineage) + COMMITTING)
    try:
        lock.mkdir()
    except FileExistsError:
        raise FileExistsError(f"{tmp} is being committed by another writer") from None
    try:
        if not tmp.is_dir():  # another writer committed it (or removed it) already
            raise FileNotFoundError(f"{tmp} is gone: committed or removed by another writer")
        manifest = scan(tmp, run_id, step, lineage)
        if world_size:
            manifest = sharded(manifest, world_size, node)
        (tmp / MANIFEST).write_bytes(encode_manifest(manifest))
        for p in tmp.rglob("*"):
            if p.is_file():
                _fsync(p)
        final = tmp.with_name(step_name(step, lineage))
        if final.exists():
            # Ours to replace: a deterministic rewrite of the step after a resume, and
            # ``tmp``, whole, is still here to take its place.
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(final.parent)
    finally:
        lock.rmdir()
    return final, manifest


class CorruptCheckpoint(Exception):
    """A local checkpoint failed verification; ``reason`` names the file."""

    def __init__(self, path: Path, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


def verify(path: Path) -> CheckpointManifest:
    """Check every file of the checkpoint at ``path`` against its manifest."""
    try:
        manifest = parse_manifest((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise CorruptCheckpoint(path, "manifest.json missing") from None
    except Exception as exc:
        raise CorruptCheckpoint(path, f"manifest.json unreadable: {exc}") from None
    for entry in manifest.files:
        f = path / entry.name
        if not f.is_file():
            raise CorruptCheckpoint(path, f"{entry.name} missing")
        if f.stat().st_size != entry.size:
            raise CorruptCheckpoint(path, f"{entry.name} has {f.stat().st_size} bytes, "
                                          f"manifest says {entry.size}")
        if problem := checksum.check_file(f, entry).problem():
            raise CorruptCheckpoint(path, f"{entry.name} {problem}")
    return manifest


def complete_steps(root: str | Path, run_id: str,
                   line: Lineage | None = None) -> list[tuple[int, Path]]:
    """Whole checkpoints of the run that ``line``'s history holds (without it: lineage
    0's), by step, newest first (``.incomplete``/``.corrupt`` excluded)."""
    return local_steps(run_dir(root, run_id), line)


@dataclass
class Resume:
    step: int
    path: Path
    manifest: CheckpointManifest


@dataclass
class Rejected:
    step: int
    path: str  # where the corrupt copy was moved to (a node's part: left where it is)
    reason: str


def newest_valid(root: str | Path, run_id: str, before: int | None = None,
                 line: Lineage | None = None) -> tuple[Resume | None, list[Rejected]]:
    """The newest checkpoint of ``line``'s history (without it: lineage 0's) that
    verifies (optionally with step < ``before``); an abandoned lineage's is never one.

    Each one that fails verification on the way, or whose manifest is of another run,
    step or lineage than its folder's name says, is renamed ``step-<N>.corrupt`` (so it
    is never picked again, and kept for forensics) and returned in the second element.
    A node's part of a sharded checkpoint (``manifest.part``) is never one to resume
    from, since the other nodes' shards are not in it: it is returned there too, left in
    place (its node's checkpointer may still have to mirror it).
    """
    rejected: list[Rejected] = []
    for step, path in complete_steps(root, run_id, line):
        if before is not None and step >= before:
            continue
        try:
            manifest = verify(path)
            if manifest.part:
                rejected.append(Rejected(step=step, path=str(path), reason=(
                    f"node {manifest.part}'s part of a sharded checkpoint, not a whole one")))
                continue
            _check_folder(path, manifest, run_id)
        except CorruptCheckpoint as exc:
            moved = corrupt_dir(path)
            if moved.exists():
                shutil.rmtree(moved)
            os.replace(path, moved)
            rejected.append(Rejected(step=step, path=str(moved), reason=exc.reason))
            continue
        return Resume(step=step, path=path, manifest=manifest), rejected
    return None, rejected


def _check_folder(path: Path, manifest: CheckpointManifest, run_id: str) -> None:
    """``CorruptCheckpoint`` unless ``manifest`` is of the run, step and lineage that
    ``path`` (``<root>/<run>/step-<N>[-l<L>]``) is the folder of."""
    c = parse_checkpoint(path.name)
    if c is None or (manifest.run_id, manifest.step, manifest.lineage) != (
            run_id, c.step, c.lineage):
        raise CorruptCheckpoint(path, f"manifest is of run {manifest.run_id!r} "
                                f"{step_name(manifest.step, manifest.lineage)}, not of this "
                                f"folder's run {run_id!r} {path.name}")


def remove_incomplete(root: str | Path, run_id: str) -> list[str]:
    """Delete leftovers of writes a crash interrupted; return their names."""
    d = run_dir(root, run_id)
    gone = []
    if d.is_dir():
        for p in d.iterdir():
            if p.name.endswith(INCOMPLETE):
                shutil.rmtree(p, ignore_errors=True)
                gone.append(p.name)
    return gone


def remove_steps(parent: Path, checkpoints: Iterable[CheckpointId]) -> list[CheckpointId]:
    """Delete the whole checkpoint folders of ``checkpoints`` in ``parent`` (one run's
    folder); return those deleted. The caller has decided they are committed, or
    abandoned by a rollback."""
    gone = []
    for c in checkpoints:
        shutil.rmtree(parent / c.name, ignore_errors=True)
        gone.append(c)
    return gone
