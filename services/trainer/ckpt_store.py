"""The local checkpoint layout, manifests, verification and "newest valid" (no torch).

Layout under ``<checkpoint_root>/<run>/``::

    step-<N>.incomplete/   being written; never loaded, removed when the step is rewritten
    step-<N>/              whole: renamed from .incomplete after every file is fsynced
        model.safetensors  ema.safetensors  optimizer.pt  scheduler.pt  rng.pt
        trainer.pt  model_config.json  manifest.json
    step-<N>.corrupt/      failed verification; kept for forensics, never loaded

``manifest.json`` lists every other file with its size and sha256; it is written last,
before the rename, so a directory named ``step-<N>`` always has one.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from tandem.common import events
from tandem.common.events import CheckpointManifest, FileEntry

MANIFEST = "manifest.json"
INCOMPLETE = ".incomplete"
CORRUPT = ".corrupt"
_STEP = re.compile(r"step-(\d+)")


def run_dir(root: str | Path, run_id: str) -> Path:
    return Path(root) / run_id


def step_dir(root: str | Path, run_id: str, step: int) -> Path:
    return run_dir(root, run_id) / f"step-{step}"


def incomplete_dir(root: str | Path, run_id: str, step: int) -> Path:
    return run_dir(root, run_id) / f"step-{step}{INCOMPLETE}"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def build_manifest(run_id: str, step: int, directory: Path) -> CheckpointManifest:
    """The manifest of every file under ``directory`` except the manifest itself."""
    files = []
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files.append(FileEntry(name=p.relative_to(directory).as_posix(),
                                   size=p.stat().st_size, sha256=sha256_file(p)))
    return CheckpointManifest(run_id=run_id, step=step, files=files)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(run_id: str, step: int, tmp: Path) -> tuple[Path, CheckpointManifest]:
    """Write the manifest into ``tmp``, fsync everything and rename it to ``step-<N>``.

    A crash at any point leaves either ``step-<N>.incomplete`` (ignored) or a whole
    ``step-<N>``. An existing ``step-<N>`` (a deterministic rewrite after a resume) is
    replaced.
    """
    manifest = build_manifest(run_id, step, tmp)
    (tmp / MANIFEST).write_bytes(events.encode(manifest))
    for p in tmp.rglob("*"):
        if p.is_file():
            _fsync(p)
    final = tmp.with_name(f"step-{step}")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(final.parent)
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
        manifest = events.decode((path / MANIFEST).read_bytes(), CheckpointManifest)
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
        digest = sha256_file(f)
        if digest != entry.sha256:
            raise CorruptCheckpoint(path, f"{entry.name} sha256 {digest[:12]}… does not match "
                                          f"the manifest's {entry.sha256[:12]}…")
    return manifest


def complete_steps(root: str | Path, run_id: str) -> list[tuple[int, Path]]:
    """Whole checkpoints of the run, newest first (``.incomplete``/``.corrupt`` excluded)."""
    d = run_dir(root, run_id)
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = _STEP.fullmatch(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out, reverse=True)


@dataclass
class Resume:
    step: int
    path: Path
    manifest: CheckpointManifest


@dataclass
class Rejected:
    step: int
    path: str  # where the corrupt copy was moved to
    reason: str


def newest_valid(root: str | Path, run_id: str,
                 before: int | None = None) -> tuple[Resume | None, list[Rejected]]:
    """The newest checkpoint that verifies (optionally with step < ``before``).

    Each one that fails verification on the way is renamed ``step-<N>.corrupt`` (so it
    is never picked again, and kept for forensics) and returned in the second element.
    """
    rejected: list[Rejected] = []
    for step, path in complete_steps(root, run_id):
        if before is not None and step >= before:
            continue
        try:
            manifest = verify(path)
        except CorruptCheckpoint as exc:
            moved = path.with_name(f"step-{step}{CORRUPT}")
            if moved.exists():
                shutil.rmtree(moved)
            os.replace(path, moved)
            rejected.append(Rejected(step=step, path=str(moved), reason=exc.reason))
            continue
        return Resume(step=step, path=path, manifest=manifest), rejected
    return None, rejected


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
