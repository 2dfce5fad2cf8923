"""The checkpoint layout, local and in S3: names, the manifest, the newest, retention.

The one place that builds and parses ``step-<N>`` names and writes and reads manifests;
the trainer (``local``), the checkpointer (``store``, its mirror) and the inference
worker (``serving``) all go through it. No I/O here beyond hashing a local file and
listing a local run folder.

Locally, under ``<checkpoint_root>/<run>/``::

    step-<N>.incomplete/   being written; never loaded, removed when the step is rewritten
    step-<N>/              whole: renamed from .incomplete after every file is fsynced
        model.safetensors  ema.safetensors  optimizer.pt  scheduler.pt  rng.pt
        trainer.pt  model_config.json  manifest.json
    step-<N>.corrupt/      failed verification; kept for forensics, never loaded
    step-<N>-l<L>/         the same, written in lineage L >= 1 (after L rollbacks)

A checkpoint's identity is its step *and* its lineage (``CheckpointId``, ``lineage``):
a rollback trains the same step numbers again in a new lineage, whose checkpoints get
names, keys and manifests of their own. Readers keep only those of the run's current
history (a ``Lineage``, the ``line`` argument of the listing functions; without one,
lineage 0's), on which a step number names one checkpoint again.

In S3 (``run`` and file names are validated; nothing can escape the prefix)::

    runs/<run>/checkpoints/step-<N>/<file>            every file of the checkpoint
    runs/<run>/checkpoints/step-<N>/manifest.json     names, sizes, CRC32s; written LAST
    runs/<run>/checkpoints/step-<N>-l<L>/...          the same, of lineage L >= 1

``manifest.json`` lists every other file with its size and CRC32 (``checksum``: why
CRC32; manifests written before record SHA-256, still verified). Locally it is
written before the rename, so a folder named ``step-<N>`` always has one; in S3 it is
the commit: a step without one is an upload in progress (or abandoned) and is never
listed as committed or loaded.

A sharded checkpoint (``kind="sharded"``, an FSDP run) holds Distributed Checkpoint
shards instead of the model, EMA and optimizer files::

    step-<N>/shards/__<rank>_<i>.distcp   rank <rank>'s shards (every rank writes its own)
    step-<N>/shards/.metadata             which shard holds what (written by rank 0, last)
    step-<N>/scheduler.pt  rng.pt  trainer.pt  model_config.json   (rank 0)

Its manifest records ``world_size``. It is whole only when it lists ``.metadata``, a
shard of every rank below ``world_size`` and rank 0's files (``missing``); a manifest
that says it is whole and is not is invalid everywhere, so such a checkpoint is never
restorable. A node that holds only some ranks commits its share locally with ``part``
set to its name; a part is never a commit (``decode_manifest`` refuses it), and
``merge_parts`` builds the one commit manifest from every node's part.

In S3, each node's checkpointer records its part once every file of it is stored and
verified, beside the files::

    runs/<run>/checkpoints/step-<N>/parts/a<attempt>/<node>.json   the node's part manifest
    runs/<run>/checkpoints/step-<N>-l<L>/parts/a<attempt>/<node>.json   the same, lineage L

The checkpoint is committed (``manifest.json``, the merge of the parts of one attempt)
only when those records together make it whole. ``parts/`` is reserved: no checkpoint
file is named under it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import msgspec

from tandem.common.errors import CheckpointCorrupt
from tandem.common.events import CheckpointManifest, FileEntry
from tandem.common.storage import s3_uri
from tandem.common.subjects import token

from . import checksum
from .lineage import Lineage

MANIFEST = "manifest.json"
INCOMPLETE = ".incomplete"
CORRUPT = ".corrupt"
CHUNK = 1 << 20
_STEP = re.compile(r"step-(0|[1-9][0-9]{0,17})(?:-l([1-9][0-9]{0,8}))?")
_NAME_PART = re.compile(r"[A-Za-z0-9_.+=-]{1,128}")
MAX_NAME = 512
FULL = "full"
SHARDED = "sharded"
SHARD_DIR = "shards"
DCP_METADATA = f"{SHARD_DIR}/.metadata"
PARTS = "parts"  # S3 only: step-<N>/parts/a<attempt>/<node>.json, each node's part
# What rank 0 writes beside the shards of a sharded checkpoint.
SHARDED_STATE = ("scheduler.pt", "rng.pt", "trainer.pt", "model_config.json")
_SHARD = re.compile(rf"{SHARD_DIR}/__(0|[1-9][0-9]{{0,5}})_(0|[1-9][0-9]{{0,5}})\.distcp")


# ----------------------------------------------------------------------------------- names


def step_name(step: int, lineage: int = 0) -> str:
    """``step-<N>`` (lineage 0) or ``step-<N>-l<lineage>``: a checkpoint's folder name."""
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be an integer >= 0, got {step!r}")
    if not isinstance(lineage, int) or lineage < 0:
        raise ValueError(f"checkpoint lineage must be an integer >= 0, got {lineage!r}")
    return f"step-{step}-l{lineage}" if lineage else f"step-{step}"


class CheckpointId(NamedTuple):
    """Which checkpoint: its step and the lineage that wrote it (``lineage``)."""

    step: int
    lineage: int = 0

    @property
    def name(self) -> str:
        return step_name(self.step, self.lineage)


def parse_checkpoint(name: str) -> CheckpointId | None:
    """``step-12`` -> (12, 0), ``step-12-l2`` -> (12, 2); anything else
    (``step-12.incomplete``, ``latest``) -> None."""
    m = _STEP.fullmatch(name)
    return CheckpointId(int(m.group(1)), int(m.group(2) or 0)) if m else None


def parse_step(name: str) -> int | None:
    """The step of a checkpoint's name (``parse_checkpoint``), of any lineage; else None."""
    c = parse_checkpoint(name)
    return c.step if c else None


def check_name(name: str) -> str:
    """A file name inside a checkpoint: relative, '/'-separated, no '..', not the manifest."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise ValueError(f"invalid checkpoint file name {name!r}: 1..{MAX_NAME} characters")
    parts = name.split("/")
    for part in parts:
        if part in ("", ".", "..") or not _NAME_PART.fullmatch(part):
            raise ValueError(
                f"invalid checkpoint file name {name!r}: each '/'-separated part must be "
                "letters, digits, '_', '.', '+', '=', '-' and not '.' or '..'")
    if name == MANIFEST:
        raise ValueError(f"invalid checkpoint file name {name!r}: reserved for the manifest")
    if parts[0] == PARTS:
        raise ValueError(f"invalid checkpoint file name {name!r}: {PARTS}/ is reserved for "
                         "the records of nodes' parts")
    return name


# -------------------------------------------------------------------------------- S3 keys


def run_prefix(run_id: str) -> str:
    return f"runs/{token(run_id, 'run id')}/checkpoints/"


def step_prefix(run_id: str, step: int, lineage: int = 0) -> str:
    return f"{run_prefix(run_id)}{step_name(step, lineage)}/"


def object_key(run_id: str, step: int, name: str, lineage: int = 0) -> str:
    return step_prefix(run_id, step, lineage) + (name if name == MANIFEST else check_name(name))


def manifest_key(run_id: str, step: int, lineage: int = 0) -> str:
    return step_prefix(run_id, step, lineage) + MANIFEST


def parts_prefix(run_id: str, step: int, attempt: int, lineage: int = 0) -> str:
    """Where the records of the parts of ``step`` of ``lineage`` written by ``attempt``
    are (inside that checkpoint's own prefix, so a rollback's step N never shares them)."""
    if not isinstance(attempt, int) or attempt < 0:
        raise ValueError(f"attempt must be an integer >= 0, got {attempt!r}")
    return f"{step_prefix(run_id, step, lineage)}{PARTS}/a{attempt}/"


def part_key(run_id: str, step: int, attempt: int, node: str, lineage: int = 0) -> str:
    """The record of ``node``'s part of ``step`` of ``lineage`` (written by ``attempt``)."""
    return f"{parts_prefix(run_id, step, attempt, lineage)}{token(node, 'node')}.json"


def checkpoint_uri(bucket: str, run_id: str, step: int, lineage: int = 0) -> str:
    return s3_uri(bucket, step_prefix(run_id, step, lineage))


def checkpoints_in_listing(keys: Iterable[str], run_id: str) -> dict[CheckpointId, bool]:
    """The checkpoints (of every lineage) that S3 keys under ``run_prefix(run_id)``
    belong to -> whether each is committed (its manifest is among the keys), oldest
    first."""
    prefix = run_prefix(run_id)
    out: dict[CheckpointId, bool] = {}
    for key in keys:
        head, _, rest = key[len(prefix):].partition("/")
        cid = parse_checkpoint(head)
        if key.startswith(prefix) and cid is not None:
            out[cid] = out.get(cid, False) or rest == MANIFEST
    return dict(sorted(out.items()))


def steps_in_listing(keys: Iterable[str], run_id: str,
                     line: Lineage | None = None) -> dict[int, bool]:
    """``checkpoints_in_listing`` of the checkpoints ``line``'s history holds (without
    it: lineage 0's), by step."""
    line = line or Lineage()
    return {c.step: done for c, done in checkpoints_in_listing(keys, run_id).items()
            if line.holds(*c)}


# ---------------------------------------------------------------------------- local paths


def run_dir(root: str | Path, run_id: str) -> Path:
    return Path(root) / run_id


def step_dir(root: str | Path, run_id: str, step: int, lineage: int = 0) -> Path:
    return run_dir(root, run_id) / step_name(step, lineage)


def incomplete_dir(root: str | Path, run_id: str, step: int, lineage: int = 0) -> Path:
    return run_dir(root, run_id) / (step_name(step, lineage) + INCOMPLETE)


def corrupt_dir(path: Path) -> Path:
    """Where a whole ``step-<N>`` folder that failed verification is moved."""
    return path.with_name(path.name + CORRUPT)


def local_checkpoints(parent: str | Path) -> list[tuple[CheckpointId, Path]]:
    """The whole checkpoint folders of every lineage in ``parent`` (one run's folder),
    newest first; ``.incomplete`` and ``.corrupt`` ones are not checkpoints."""
    d = Path(parent)
    if not d.is_dir():
        return []
    return sorted(((c, p) for p in d.iterdir()
                   if (c := parse_checkpoint(p.name)) is not None and p.is_dir()),
                  reverse=True)


def local_steps(parent: str | Path, line: Lineage | None = None) -> list[tuple[int, Path]]:
    """The whole checkpoint folders in ``parent`` that ``line``'s history holds (without
    it: lineage 0's), by step, newest first."""
    line = line or Lineage()
    return [(c.step, p) for c, p in local_checkpoints(parent) if line.holds(*c)]


# -------------------------------------------------------------------------------- manifest


def validate_manifest(manifest: CheckpointManifest, run_id: str | None = None,
                      step: int | None = None, lineage: int | None = None
                      ) -> CheckpointManifest:
    """Return ``manifest`` if it is well formed (and for ``run_id``/``step``/``lineage``),
    else ValueError."""
    token(manifest.run_id, "run id")
    if run_id is not None and manifest.run_id != run_id:
        raise ValueError(f"manifest is for run {manifest.run_id!r}, expected {run_id!r}")
    if step is not None and manifest.step != step:
        raise ValueError(f"manifest is for step {manifest.step}, expected {step}")
    if lineage is not None and manifest.lineage != lineage:
        raise ValueError(f"manifest is of lineage {manifest.lineage}, expected {lineage}")
    step_name(manifest.step, manifest.lineage)
    if not manifest.files:
        raise ValueError("manifest lists no files")
    if manifest.kind not in (FULL, SHARDED):
        raise ValueError(f"manifest kind must be {FULL!r} or {SHARDED!r}, got {manifest.kind!r}")
    seen: set[str] = set()
    for f in manifest.files:
        check_name(f.name)
        if f.name in seen:
            raise ValueError(f"manifest lists {f.name!r} twice")
        seen.add(f.name)
        if f.size < 0:
            raise ValueError(f"{f.name}: negative size {f.size}")
        checksum.validate(f)
    if manifest.kind == SHARDED:
        _validate_sharded(manifest)
    elif manifest.part or manifest.world_size:
        raise ValueError("only a sharded manifest has a world_size or a part")
    return manifest


def shard_rank(name: str) -> int | None:
    """The rank that wrote shard file ``name`` (``shards/__3_0.distcp`` -> 3), or None."""
    m = _SHARD.fullmatch(name)
    return int(m.group(1)) if m else None


def missing(manifest: CheckpointManifest) -> list[str]:
    """What a sharded manifest lacks to be a whole checkpoint (empty when whole)."""
    names = {f.name for f in manifest.files}
    have = {r for n in names if (r := shard_rank(n)) is not None}
    lack = [n for n in (DCP_METADATA, *SHARDED_STATE) if n not in names]
    lack += [f"a shard of rank {r}" for r in range(manifest.world_size) if r not in have]
    return lack


def _validate_sharded(manifest: CheckpointManifest) -> None:
    if manifest.world_size < 1:
        raise ValueError(f"a sharded manifest needs world_size >= 1, got {manifest.world_size}")
    for f in manifest.files:
        if not f.name.startswith(f"{SHARD_DIR}/") or f.name == DCP_METADATA:
            continue
        rank = shard_rank(f.name)
        if rank is None:
            raise ValueError(f"{f.name}: not a shard file (shards/__<rank>_<i>.distcp)")
        if rank >= manifest.world_size:
            raise ValueError(f"{f.name}: rank {rank} outside world size {manifest.world_size}")
    if manifest.part:
        token(manifest.part, "node")
    elif lack := missing(manifest):
        raise ValueError(f"sharded checkpoint of {manifest.world_size} ranks is not whole: "
                         f"it lacks {', '.join(lack)}")


def sharded(manifest: CheckpointManifest, world_size: int, node: str) -> CheckpointManifest:
    """``manifest`` (a ``scan`` of one node's folder) as a sharded one of ``world_size``
    ranks: whole when the folder holds every shard, else ``node``'s part."""
    out = msgspec.structs.replace(manifest, kind=SHARDED, world_size=world_size, part="")
    if missing(out):
        if not node:
            raise ValueError(f"a folder without every shard ({', '.join(missing(out))}) "
                             "is one node's part, and needs the node's name")
        out = msgspec.structs.replace(out, part=node)
    return validate_manifest(out)


def merge_parts(parts: Iterable[CheckpointManifest]) -> CheckpointManifest:
    """The one commit manifest of a sharded checkpoint from every node's part (or whole
    manifests); ValueError when they disagree or together still lack a shard."""
    return validate_manifest(_union(parts))


def lacking(parts: Iterable[CheckpointManifest]) -> list[str]:
    """What the union of ``parts`` still lacks to be a whole checkpoint (``missing``);
    ValueError when the parts disagree."""
    return missing(_union(parts))


def _union(parts: Iterable[CheckpointManifest]) -> CheckpointManifest:
    parts = list(parts)
    if not parts:
        raise ValueError("no parts to merge")
    first = parts[0]
    files: dict[str, FileEntry] = {}
    for p in parts:
        if (p.kind, p.run_id, p.step, p.lineage, p.world_size) != (
                SHARDED, first.run_id, first.step, first.lineage, first.world_size):
            raise ValueError(f"part {p.part!r} is not of the same sharded checkpoint "
                             f"({p.run_id} {step_name(p.step, p.lineage)}, "
                             f"{p.world_size} ranks)")
        for f in p.files:
            seen = files.setdefault(f.name, f)
            if checksum.identity(seen) != checksum.identity(f):
                raise ValueError(f"{f.name} differs between parts")
    return CheckpointManifest(
        run_id=first.run_id, step=first.step, files=sorted(files.values(), key=lambda f: f.name),
        kind=SHARDED, world_size=first.world_size, lineage=first.lineage)


def encode_manifest(manifest: CheckpointManifest) -> bytes:
    return msgspec.json.encode(manifest)


def parse_manifest(data: bytes, run_id: str | None = None, step: int | None = None,
                   lineage: int | None = None) -> CheckpointManifest:
    """Decode and validate a stored manifest; ValueError (saying why) if it is not one."""
    try:
        manifest = msgspec.json.decode(data, type=CheckpointManifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(str(exc)) from None
    return validate_manifest(manifest, run_id, step, lineage)


def decode_manifest(data: bytes, run_id: str, step: int, lineage: int = 0
                    ) -> CheckpointManifest:
    """``parse_manifest`` for a stored commit (of ``step`` in ``lineage``);
    ``CheckpointCorrupt`` if it is not one."""
    try:
        manifest = parse_manifest(data, run_id, step, lineage)
    except ValueError as exc:
        raise CheckpointCorrupt(run_id, step, MANIFEST, f"invalid manifest: {exc}") from None
    try:
        return check_commit(manifest)
    except ValueError as exc:
        raise CheckpointCorrupt(run_id, step, MANIFEST, f"invalid manifest: {exc}") from None


def check_commit(manifest: CheckpointManifest) -> CheckpointManifest:
    """``manifest`` if it may be a commit: ValueError for one node's part of a sharded
    checkpoint (``merge_parts`` of every node's part is the commit)."""
    if manifest.part:
        raise ValueError(f"node {manifest.part}'s part of a sharded checkpoint is not a "
                         "commit")
    return manifest


def covers(whole: CheckpointManifest, part: CheckpointManifest) -> bool:
    """Whether ``whole`` lists every file of ``part`` with the same size and checksum (a
    node's part of a checkpoint already committed with these bytes)."""
    listed = {f.name: checksum.identity(f) for f in whole.files}
    return (whole.run_id, whole.step, whole.lineage) == (
        part.run_id, part.step, part.lineage) and all(
        listed.get(f.name) == checksum.identity(f) for f in part.files)


def same_files(a: CheckpointManifest, b: CheckpointManifest) -> bool:
    """Whether two manifests describe the same bytes (timestamps aside)."""
    key = lambda m: (m.run_id, m.step, m.lineage, m.kind, m.world_size, m.part,  # noqa: E731
                     sorted((f.name, *checksum.identity(f)) for f in m.files))
    return key(a) == key(b)


def scan(directory: Path, run_id: str, step: int, lineage: int = 0) -> CheckpointManifest:
    """Build the manifest of a local checkpoint directory (every file but a manifest)."""
    files = []
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            name = p.relative_to(directory).as_posix()
            if name == MANIFEST:
                continue
            files.append(FileEntry(name=check_name(name), size=p.stat().st_size,
                                   crc32=checksum.file_crc32(p)))
    return validate_manifest(CheckpointManifest(run_id=run_id, step=step, files=files,
                                                lineage=lineage))


# ------------------------------------------------------------------------------- retention


def retention(steps: Iterable[int], keep_last: int, keep_every: int = 0) -> list[int]:
    """The committed steps retention removes: all but the newest ``keep_last`` and every
    step that is a multiple of ``keep_every`` (0: none kept that way). The newest is
    always kept."""
    ordered = sorted(set(steps))
    keep = set(ordered[-max(keep_last, 1):])
    if keep_every > 0:
        keep |= {s for s in ordered if s % keep_every == 0}
    return [s for s in ordered if s not in keep]


def passed(step: int, committed: Iterable[int], keep_last: int, keep_every: int = 0) -> bool:
    """Whether retention, over the ``committed`` steps with ``step`` among them, removes
    ``step``: a checkpoint it has passed is not worth mirroring (it would be deleted as it
    is committed) and one of its parts left in S3 will never be whole."""
    return step in retention([*committed, step], keep_last, keep_every)


def local_retention(local: Iterable[int], committed: set[int], keep: int) -> list[int]:
    """The local steps that may go: all but the newest ``keep`` on disk (0: none kept),
    and of those only the ones committed in S3. A step that never committed (a mirror
    that failed) is never on this list: the local copy is then the only one."""
    ordered = sorted(set(local))
    kept = set(ordered[max(0, len(ordered) - keep):]) if keep else set()
    return [s for s in ordered if s not in kept and s in committed]
