"""Checkpoints in S3: listing, the verified download and restore, deletion.

Keys and the manifest come from ``layout``. The manifest is the commit: a step without
one is an upload in progress (or abandoned) and is never listed as committed or loaded.
The checkpointer writes it once, with a conditional put, and never overwrites it
(``tandem.checkpointer.mirror``).

Readers (``tandem checkpoints restore``, the trainer resuming without local copies, the
inference worker loading a run's weights) call ``restore`` or ``download``: every byte
is checked against the manifest's size and checksum before the directory is handed over,
and ``restore`` falls back to the previous committed checkpoint when one is corrupt.
A reader that already knows the step (the worker, told by ``ckpt.<run>.mirrored``)
passes it with ``fallback=False`` and nothing is listed.

Listing and restore see one history: the checkpoints that ``line`` (the run's
``Lineage``, from its record's ``forks``) holds; without it, lineage 0's. A checkpoint
of an abandoned lineage is never restored.

Blocking (boto3); call from a thread in async code. No torch here: the files are bytes;
what loads them uses safetensors (tensors) or ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.common.errors import CheckpointCorrupt, CheckpointNotFound
from tandem.common.events import CheckpointManifest, FileEntry

from . import checksum
from .layout import (
    CHUNK,
    INCOMPLETE,
    MANIFEST,
    CheckpointId,
    checkpoints_in_listing,
    decode_manifest,
    encode_manifest,
    manifest_key,
    object_key,
    run_prefix,
    step_name,
    step_prefix,
)
from .lineage import Lineage

# --------------------------------------------------------------------------------- listing


def _is_missing(exc: Exception) -> bool:
    code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
    return code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket")


def list_checkpoints(s3: Any, bucket: str, run_id: str,
                     written: dict[CheckpointId, float] | None = None
                     ) -> dict[CheckpointId, bool]:
    """Every checkpoint (of every lineage) with objects under the run's prefix ->
    whether it is committed, oldest first. ``written``, when given, is filled with when
    each one's newest object was written (its ``LastModified``, epoch seconds): from the
    same listing, for retention, which leaves an upload still in progress alone."""
    objects: list[dict[str, Any]] = []
    paginator = s3.get_paginator("list_objects_v2")
    try:
        for page in paginator.paginate(Bucket=bucket, Prefix=run_prefix(run_id)):
            objects += page.get("Contents", [])
    except Exception as exc:
        if _is_missing(exc):
            return {}
        raise
    if written is not None:
        for obj in objects:
            for cid in checkpoints_in_listing([obj["Key"]], run_id):  # its checkpoint
                written[cid] = max(written.get(cid, 0.0), obj["LastModified"].timestamp())
    return checkpoints_in_listing([obj["Key"] for obj in objects], run_id)


def list_steps(s3: Any, bucket: str, run_id: str,
               line: Lineage | None = None) -> dict[int, bool]:
    """Every step of ``line``'s history with objects under the run's prefix -> whether
    it is committed."""
    line = line or Lineage()
    return {c.step: done for c, done in list_checkpoints(s3, bucket, run_id).items()
            if line.holds(*c)}


def committed_steps(s3: Any, bucket: str, run_id: str,
                    line: Lineage | None = None) -> list[int]:
    """Committed steps of ``line``'s history (manifest stored), oldest first."""
    return [s for s, done in list_steps(s3, bucket, run_id, line).items() if done]


def newest_committed(s3: Any, bucket: str, run_id: str,
                     line: Lineage | None = None) -> int | None:
    """The newest committed step of ``line``'s history, or None. (Not yet verified: see
    ``download``.)"""
    steps = committed_steps(s3, bucket, run_id, line)
    return steps[-1] if steps else None


class _NotCommitted(CheckpointNotFound):
    """The step has no manifest (``read_manifest``), as opposed to lacking a file."""


def read_manifest(s3: Any, bucket: str, run_id: str, step: int,
                  lineage: int = 0) -> CheckpointManifest:
    """The committed manifest of ``step`` (of ``lineage``); ``CheckpointNotFound`` /
    ``CheckpointCorrupt``."""
    try:
        data = s3.get_object(Bucket=bucket,
                             Key=manifest_key(run_id, step, lineage))["Body"].read()
    except Exception as exc:
        if _is_missing(exc):
            listed = list_checkpoints(s3, bucket, run_id)
            raise _NotCommitted(run_id, step, f"{step_name(step, lineage)} not committed "
                                "(no manifest.json)", sorted(
                                    {c.step for c, done in listed.items() if done})) from None
        raise
    return decode_manifest(data, run_id, step, lineage)


# -------------------------------------------------------------------------------- download


class Stopped(Exception):
    """A download was stopped (its ``stop`` event set) before it ended: nobody waits for
    it any more (a worker stopping while it loads)."""


def _download_file(s3: Any, bucket: str, run_id: str, step: int, lineage: int,
                   entry: FileEntry, dest: Path, stop: threading.Event | None = None) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    check = checksum.Check(entry)
    try:
        body = s3.get_object(Bucket=bucket,
                             Key=object_key(run_id, step, entry.name, lineage))["Body"]
    except Exception as exc:
        if _is_missing(exc):
            raise CheckpointCorrupt(run_id, step, entry.name, "missing from S3") from None
        raise
    with open(dest, "wb") as f:
        for chunk in body.iter_chunks(CHUNK):
            if stop is not None and stop.is_set():
                raise Stopped(f"download of {entry.name} stopped")
            check.update(chunk)
            f.write(chunk)
    if problem := check.problem():
        raise CheckpointCorrupt(run_id, step, entry.name, problem)


def download(s3: Any, bucket: str, run_id: str, step: int, dest: Path, *,
             files: Iterable[str] | None = None, manifest: CheckpointManifest | None = None,
             concurrency: int = 8, lineage: int = 0,
             stop: threading.Event | None = None) -> Path:
    """Download committed ``step`` (of ``lineage``, or ``manifest``'s) into
    ``dest/step-<N>/`` (``step-<N>-l<L>/``) and verify every byte.

    Files land in ``step-<N>.incomplete/`` first and the directory is renamed only when
    every file matches the manifest's size and checksum, so ``dest/step-<N>`` is always
    whole (a previous copy there is replaced). ``files`` limits the download to some
    names (the inference worker needs only the weights). Writes the manifest beside the
    files. Raises ``CheckpointNotFound`` or ``CheckpointCorrupt`` (naming the file), and
    ``Stopped`` at the next chunk of every file once ``stop`` is set.
    """
    manifest = manifest or read_manifest(s3, bucket, run_id, step, lineage)
    lineage = manifest.lineage
    entries = manifest.files
    if files is not None:
        wanted = set(files)
        missing = wanted - {f.name for f in entries}
        if missing:
            raise CheckpointNotFound(run_id, step, f"no file(s) {sorted(missing)} in manifest")
        entries = [f for f in entries if f.name in wanted]
    dest = Path(dest)
    final = dest / step_name(step, lineage)
    tmp = dest / (step_name(step, lineage) + INCOMPLETE)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with ThreadPoolExecutor(max(1, min(concurrency, len(entries)))) as pool:
            futures = [pool.submit(_download_file, s3, bucket, run_id, step, lineage, e,
                                   tmp / e.name, stop) for e in entries]
            for fut in futures:
                fut.result()
        (tmp / MANIFEST).write_bytes(encode_manifest(manifest))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


@dataclass
class Restored:
    """What ``restore`` handed over, and which newer checkpoints it had to skip."""

    run_id: str
    step: int
    path: Path
    manifest: CheckpointManifest
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (step, reason)

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.manifest.files)

    @property
    def lineage(self) -> int:
        return self.manifest.lineage


def _asked_not_committed(run_id: str, step: int, committed: list[int]) -> CheckpointNotFound:
    return CheckpointNotFound(run_id, step, f"not committed; committed steps: {committed}",
                              committed)


FileChoice = Iterable[str] | Callable[[CheckpointManifest], Iterable[str]]


def restore(s3: Any, bucket: str, run_id: str, dest: Path, *, step: int | None = None,
            fallback: bool = True, files: FileChoice | None = None,
            on_skip: Callable[[int, str], None] | None = None,
            line: Lineage | None = None, check: Callable[[Restored], None] | None = None,
            stop: threading.Event | None = None) -> Restored:
    """Download and verify the newest committed checkpoint of ``line``'s history (or
    ``step``'s, the checkpoint that history holds at that step), falling back.

    Tries ``step`` (default: the newest committed) and, when a file or the manifest is
    corrupt or missing, each older committed checkpoint in turn (unless ``fallback`` is
    False). ``files`` limits the download (names, or a function of the manifest that
    may raise ``CheckpointCorrupt`` when the checkpoint lacks what is needed).
    ``check(restored)``, when given, reads the verified files before they are handed
    over: a ``CheckpointCorrupt`` it raises (the bytes are the manifest's, but what they
    hold cannot be used) passes the checkpoint over as a corrupt download is.
    ``on_skip(step, reason)`` is called for each checkpoint passed over. Raises
    ``CheckpointNotFound`` when no committed checkpoint verifies; ``Stopped`` once
    ``stop`` is set (``download``).

    With ``step`` and ``fallback=False`` nothing is listed unless it fails: the caller
    knows which step it wants (the worker, from ``ckpt.<run>.mirrored``).
    """
    line = line or Lineage()
    committed: list[int] | None = None  # listed only when needed
    if step is not None and not fallback:
        candidates = [step]
    else:
        committed = committed_steps(s3, bucket, run_id, line)
        if step is not None and step not in committed:
            raise _asked_not_committed(run_id, step, committed)
        candidates = [s for s in reversed(committed) if step is None or s <= step]
        if not fallback:
            candidates = candidates[:1]
    skipped: list[tuple[int, str]] = []
    for s in candidates:
        try:
            manifest = read_manifest(s3, bucket, run_id, s, line.owner(s))
            wanted = files(manifest) if callable(files) else files
            path = download(s3, bucket, run_id, s, dest, files=wanted, manifest=manifest,
                            stop=stop)
            restored = Restored(run_id, s, path, manifest, skipped)
            if check is not None:
                try:
                    check(restored)
                except CheckpointCorrupt:
                    shutil.rmtree(path, ignore_errors=True)  # room for the next one
                    raise
            return restored
        except CheckpointNotFound as exc:
            if committed is None and isinstance(exc, _NotCommitted):
                raise _asked_not_committed(run_id, s, exc.available) from None
            reason = exc.reason
        except CheckpointCorrupt as exc:
            reason = exc.reason
        skipped.append((s, reason))
        if on_skip is not None:
            on_skip(s, reason)
    why = "; ".join(f"step {s}: {r}" for s, r in skipped) or "none committed"
    raise CheckpointNotFound(run_id, step, f"no committed checkpoint verifies ({why})",
                             committed)  # None (not listed) when the caller named the step


# ---------------------------------------------------------------------------------- delete


class DeleteFailed(Exception):
    """S3 kept objects that ``delete`` asked it to remove (``DeleteObjects`` answers 200
    and names each key it could not delete, with a code, in ``Errors``)."""

    def __init__(self, prefix: str, errors: list[tuple[str, str]], deleted: int) -> None:
        self.errors = errors  # (key, code)
        self.deleted = deleted
        kept = ", ".join(f"{key} ({code})" for key, code in errors)
        super().__init__(f"S3 kept {len(errors)} object(s) under {prefix} "
                         f"({deleted} deleted): {kept}")


def delete(s3: Any, bucket: str, run_id: str, step: int, lineage: int = 0) -> int:
    """Delete a checkpoint: the manifest first (it stops being committed), then its files.

    Returns the number of objects deleted. Idempotent. Raises ``DeleteFailed``, naming
    the keys and their codes, when S3 kept any (the checkpoint is then no longer
    committed, but not gone: call again).
    """
    s3.delete_object(Bucket=bucket, Key=manifest_key(run_id, step, lineage))
    prefix = step_prefix(run_id, step, lineage)
    n = 1
    errors: list[tuple[str, str]] = []
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            resp = s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            failed = [(e.get("Key", "?"), e.get("Code", "?")) for e in resp.get("Errors", [])]
            errors += failed
            n += len(keys) - len(failed)
    if errors:
        raise DeleteFailed(prefix, errors, n)
    return n
