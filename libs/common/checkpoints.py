"""Checkpoints in S3: the layout, the commit marker, listing, and verified restore.

Layout (``run`` and file names are validated; nothing can escape the prefix)::

    runs/<run>/checkpoints/step-<N>/<file>            every file of the checkpoint
    runs/<run>/checkpoints/step-<N>/manifest.json     names, sizes, sha256; written LAST

The manifest is the commit: a step without one is an upload in progress (or abandoned)
and is never listed as committed or loaded. The checkpointer writes it once, with a
conditional put, and never overwrites it.

Readers (``tandem checkpoints restore``, the trainer resuming without local copies, the
inference worker loading a run's weights) call ``restore`` or ``download``: every byte
is checked against the manifest's size and sha256 before the directory is handed over,
and ``restore`` falls back to the previous committed checkpoint when one is corrupt.

Blocking (boto3); call from a thread in async code. No torch here: the files are bytes;
what loads them uses safetensors (tensors) or ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import base64
import hashlib
import re
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from tandem.common.errors import CheckpointCorrupt, CheckpointNotFound
from tandem.common.events import CheckpointManifest, FileEntry
from tandem.common.storage import s3_uri
from tandem.common.subjects import token

MANIFEST = "manifest.json"
INCOMPLETE = ".incomplete"
CHUNK = 1 << 20
_STEP = re.compile(r"step-(0|[1-9][0-9]{0,17})")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_NAME_PART = re.compile(r"[A-Za-z0-9_.+=-]{1,128}")
MAX_NAME = 512


# ---------------------------------------------------------------------------------- layout


def run_prefix(run_id: str) -> str:
    return f"runs/{token(run_id, 'run id')}/checkpoints/"


def step_name(step: int) -> str:
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint step must be an integer >= 0, got {step!r}")
    return f"step-{step}"


def parse_step(name: str) -> int | None:
    """``step-12`` -> 12; anything else (``step-12.incomplete``, ``latest``) -> None."""
    m = _STEP.fullmatch(name)
    return int(m.group(1)) if m else None


def step_prefix(run_id: str, step: int) -> str:
    return f"{run_prefix(run_id)}{step_name(step)}/"


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
    return name


def object_key(run_id: str, step: int, name: str) -> str:
    return step_prefix(run_id, step) + (name if name == MANIFEST else check_name(name))


def manifest_key(run_id: str, step: int) -> str:
    return step_prefix(run_id, step) + MANIFEST


def checkpoint_uri(bucket: str, run_id: str, step: int) -> str:
    return s3_uri(bucket, step_prefix(run_id, step))


# -------------------------------------------------------------------------------- manifest


def validate_manifest(manifest: CheckpointManifest, run_id: str | None = None,
                      step: int | None = None) -> CheckpointManifest:
    """Return ``manifest`` if it is well formed (and for ``run_id``/``step``), else ValueError."""
    token(manifest.run_id, "run id")
    if run_id is not None and manifest.run_id != run_id:
        raise ValueError(f"manifest is for run {manifest.run_id!r}, expected {run_id!r}")
    if step is not None and manifest.step != step:
        raise ValueError(f"manifest is for step {manifest.step}, expected {step}")
    step_name(manifest.step)
    if not manifest.files:
        raise ValueError("manifest lists no files")
    seen: set[str] = set()
    for f in manifest.files:
        check_name(f.name)
        if f.name in seen:
            raise ValueError(f"manifest lists {f.name!r} twice")
        seen.add(f.name)
        if f.size < 0:
            raise ValueError(f"{f.name}: negative size {f.size}")
        if not _SHA256.fullmatch(f.sha256):
            raise ValueError(f"{f.name}: sha256 must be 64 lowercase hex digits, got {f.sha256!r}")
    return manifest


def encode_manifest(manifest: CheckpointManifest) -> bytes:
    return msgspec.json.encode(manifest)


def decode_manifest(data: bytes, run_id: str, step: int) -> CheckpointManifest:
    """Decode and validate a stored manifest; ``CheckpointCorrupt`` if it is not one."""
    try:
        manifest = msgspec.json.decode(data, type=CheckpointManifest)
        return validate_manifest(manifest, run_id, step)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        raise CheckpointCorrupt(run_id, step, MANIFEST, f"invalid manifest: {exc}") from None


def same_files(a: CheckpointManifest, b: CheckpointManifest) -> bool:
    """Whether two manifests describe the same bytes (timestamps aside)."""
    key = lambda m: sorted((f.name, f.size, f.sha256) for f in m.files)  # noqa: E731
    return (a.run_id, a.step, key(a)) == (b.run_id, b.step, key(b))


def sha256_file(path: Path, chunk: int = 8 * CHUNK) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def b64(hex_digest: str) -> str:
    """A hex sha256 as S3's ``ChecksumSHA256`` (base64 of the raw digest)."""
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


def scan(directory: Path, run_id: str, step: int) -> CheckpointManifest:
    """Build the manifest of a local checkpoint directory (every file but a manifest)."""
    files = []
    for p in sorted(directory.rglob("*")):
        if p.is_file():
            name = p.relative_to(directory).as_posix()
            if name == MANIFEST:
                continue
            files.append(FileEntry(name=check_name(name), size=p.stat().st_size,
                                   sha256=sha256_file(p)))
    return validate_manifest(CheckpointManifest(run_id=run_id, step=step, files=files))


# --------------------------------------------------------------------------------- listing


def _is_missing(exc: Exception) -> bool:
    code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
    return code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket")


def list_steps(s3: Any, bucket: str, run_id: str) -> dict[int, bool]:
    """Every step with objects under the run's prefix -> whether it is committed."""
    prefix = run_prefix(run_id)
    out: dict[int, bool] = {}
    paginator = s3.get_paginator("list_objects_v2")
    try:
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                head, _, rest = obj["Key"][len(prefix):].partition("/")
                step = parse_step(head)
                if step is not None:
                    out[step] = out.get(step, False) or rest == MANIFEST
    except Exception as exc:
        if _is_missing(exc):
            return {}
        raise
    return dict(sorted(out.items()))


def committed_steps(s3: Any, bucket: str, run_id: str) -> list[int]:
    """Committed steps of a run (those whose manifest is stored), oldest first."""
    return [s for s, done in list_steps(s3, bucket, run_id).items() if done]


def newest_committed(s3: Any, bucket: str, run_id: str) -> int | None:
    """The newest committed step of a run, or None. (Not yet verified: see ``download``.)"""
    steps = committed_steps(s3, bucket, run_id)
    return steps[-1] if steps else None


def read_manifest(s3: Any, bucket: str, run_id: str, step: int) -> CheckpointManifest:
    """The committed manifest of ``step``; ``CheckpointNotFound`` / ``CheckpointCorrupt``."""
    try:
        data = s3.get_object(Bucket=bucket, Key=manifest_key(run_id, step))["Body"].read()
    except Exception as exc:
        if _is_missing(exc):
            raise CheckpointNotFound(run_id, step, "not committed (no manifest.json)",
                                     committed_steps(s3, bucket, run_id)) from None
        raise
    return decode_manifest(data, run_id, step)


# -------------------------------------------------------------------------------- download


def _download_file(s3: Any, bucket: str, run_id: str, step: int, entry: FileEntry,
                   dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    size = 0
    try:
        body = s3.get_object(Bucket=bucket, Key=object_key(run_id, step, entry.name))["Body"]
    except Exception as exc:
        if _is_missing(exc):
            raise CheckpointCorrupt(run_id, step, entry.name, "missing from S3") from None
        raise
    with open(dest, "wb") as f:
        for chunk in body.iter_chunks(CHUNK):
            h.update(chunk)
            size += len(chunk)
            f.write(chunk)
    if size != entry.size:
        raise CheckpointCorrupt(run_id, step, entry.name,
                                f"size {size} bytes, manifest says {entry.size}")
    got = h.hexdigest()
    if got != entry.sha256:
        raise CheckpointCorrupt(run_id, step, entry.name,
                                f"sha256 {got}, manifest says {entry.sha256}")


def download(s3: Any, bucket: str, run_id: str, step: int, dest: Path, *,
             files: Iterable[str] | None = None, manifest: CheckpointManifest | None = None,
             concurrency: int = 8) -> Path:
    """Download committed ``step`` into ``dest/step-<N>/`` and verify every byte.

    Files land in ``step-<N>.incomplete/`` first and the directory is renamed only when
    every file matches the manifest's size and sha256, so ``dest/step-<N>`` is always
    whole (a previous copy there is replaced). ``files`` limits the download to some
    names (the inference worker needs only the weights). Writes the manifest beside the
    files. Raises ``CheckpointNotFound`` or ``CheckpointCorrupt`` (naming the file).
    """
    manifest = manifest or read_manifest(s3, bucket, run_id, step)
    entries = manifest.files
    if files is not None:
        wanted = set(files)
        missing = wanted - {f.name for f in entries}
        if missing:
            raise CheckpointNotFound(run_id, step, f"no file(s) {sorted(missing)} in manifest")
        entries = [f for f in entries if f.name in wanted]
    dest = Path(dest)
    final = dest / step_name(step)
    tmp = dest / (step_name(step) + INCOMPLETE)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with ThreadPoolExecutor(max(1, min(concurrency, len(entries)))) as pool:
            futures = [pool.submit(_download_file, s3, bucket, run_id, step, e, tmp / e.name)
                       for e in entries]
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


FileChoice = Iterable[str] | Callable[[CheckpointManifest], Iterable[str]]


def restore(s3: Any, bucket: str, run_id: str, dest: Path, *, step: int | None = None,
            fallback: bool = True, files: FileChoice | None = None,
            on_skip: Callable[[int, str], None] | None = None) -> Restored:
    """Download and verify the newest committed checkpoint (or ``step``), falling back.

    Tries ``step`` (default: the newest committed) and, when a file or the manifest is
    corrupt or missing, each older committed checkpoint in turn (unless ``fallback`` is
    False). ``files`` limits the download (names, or a function of the manifest that
    may raise ``CheckpointCorrupt`` when the checkpoint lacks what is needed).
    ``on_skip(step, reason)`` is called for each checkpoint passed over. Raises
    ``CheckpointNotFound`` when no committed checkpoint verifies.
    """
    committed = committed_steps(s3, bucket, run_id)
    if step is not None and step not in committed:
        raise CheckpointNotFound(run_id, step, f"not committed; committed steps: {committed}",
                                 committed)
    candidates = [s for s in reversed(committed) if step is None or s <= step]
    if not fallback:
        candidates = candidates[:1]
    skipped: list[tuple[int, str]] = []
    for s in candidates:
        try:
            manifest = read_manifest(s3, bucket, run_id, s)
            wanted = files(manifest) if callable(files) else files
            path = download(s3, bucket, run_id, s, dest, files=wanted, manifest=manifest)
            return Restored(run_id, s, path, manifest, skipped)
        except (CheckpointCorrupt, CheckpointNotFound) as exc:
            skipped.append((s, exc.reason))
            if on_skip is not None:
                on_skip(s, exc.reason)
    why = "; ".join(f"step {s}: {r}" for s, r in skipped) or "none committed"
    raise CheckpointNotFound(run_id, step, f"no committed checkpoint verifies ({why})",
                             committed)


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


def delete(s3: Any, bucket: str, run_id: str, step: int) -> int:
    """Delete a checkpoint: the manifest first (it stops being committed), then its files.

    Returns the number of objects deleted. Idempotent.
    """
    s3.delete_object(Bucket=bucket, Key=manifest_key(run_id, step))
    prefix = step_prefix(run_id, step)
    n = 1
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
            n += len(keys)
    return n


# --------------------------------------------------------------------------------- serving

MODEL_WEIGHTS = "model.safetensors"
EMA_WEIGHTS = "ema.safetensors"
MODEL_CONFIG = "model_config.json"


def serving_files(manifest: CheckpointManifest) -> list[str]:
    """What a worker needs from a trainer checkpoint: weights (model, EMA) and config."""
    names = {f.name for f in manifest.files}
    if MODEL_WEIGHTS not in names:
        raise CheckpointCorrupt(manifest.run_id, manifest.step, MODEL_WEIGHTS,
                                "missing from the manifest")
    return [n for n in (MODEL_WEIGHTS, EMA_WEIGHTS, MODEL_CONFIG) if n in names]


@dataclass
class ServingModel:
    """A committed checkpoint loaded for serving (``load_serving``)."""

    unet: Any  # the denoiser: a UNet2DModel or a DiTTransformer2DModel (config["kind"])
    scheduler: Any
    config: dict[str, Any]  # the architecture it was built from (its model_config.json)
    run_id: str
    step: int
    skipped: list[tuple[int, str]] = field(default_factory=list)  # newer ones passed over

    @property
    def label(self) -> str:
        return f"{self.run_id}/{step_name(self.step)}"


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def config_mismatch(declared: dict[str, Any], stored: dict[str, Any],
                    fields: Iterable[str]) -> list[str]:
    """The architecture ``fields`` that ``declared`` (a registry entry's config) sets to
    something other than ``stored`` (a checkpoint's ``model_config.json``), each as
    ``"<field>: declared <x>, checkpoint has <y>"``. Fields ``declared`` leaves out are
    taken from the checkpoint and never differ."""
    out = []
    for k in fields:
        if k in declared and _plain(declared[k]) != _plain(stored.get(k)):
            out.append(f"{k}: declared {declared[k]!r}, checkpoint has {stored.get(k)!r}")
    return out


def load_serving(run_id: str, config: dict[str, Any] | None = None, *, s3: Any = None,
                 bucket: str | None = None, step: int | None = None,
                 fallback: bool = True) -> ServingModel:
    """The newest committed checkpoint of ``run_id`` (or ``step``), verified, as a model.

    The architecture comes from the checkpoint's ``model_config.json`` (else ``config``);
    an architecture field that ``config`` declares differently is a ``CheckpointError``
    naming each field, never a model of the wrong shape. The weights are
    ``model.safetensors`` with the EMA weights laid over it when the checkpoint has
    them; weights that do not fit the architecture are a ``CheckpointError`` too.
    Tensors only, from safetensors: nothing is unpickled. A corrupt checkpoint is
    skipped for the previous committed one unless ``fallback`` is False (``restore``).
    Imports torch, so only the inference worker calls it. S3 comes from ``TANDEM_S3_*``
    unless given.
    """
    import json
    import tempfile

    from safetensors.torch import load_file

    from tandem.common.diffusion import architecture, build_denoiser, build_scheduler
    from tandem.common.errors import CheckpointError

    if s3 is None or bucket is None:
        from tandem.common.settings import Settings, load
        from tandem.common.storage import s3_client

        settings = load(Settings, "checkpoint loader")
        s3 = s3 if s3 is not None else s3_client(settings)
        bucket = bucket or settings.s3_bucket
    declared = dict(config or {})
    with tempfile.TemporaryDirectory(prefix="tandem-serving-") as tmp:
        r = restore(s3, bucket, run_id, Path(tmp), step=step, fallback=fallback,
                    files=serving_files)
        cfg_path = r.path / MODEL_CONFIG
        try:
            mc = json.loads(cfg_path.read_text()) if cfg_path.exists() else dict(declared)
        except ValueError as exc:
            raise CheckpointError(run_id, r.step, f"{MODEL_CONFIG} is not JSON: {exc}") from None
        try:
            cfg = architecture(mc)
        except ValueError as exc:
            raise CheckpointError(run_id, r.step, str(exc)) from None
        stored = {"kind": mc.get("kind", "unet"), **cfg.to_dict()}
        wrong = config_mismatch(declared, stored, stored)
        if wrong:
            raise CheckpointError(run_id, r.step, "the registry declares another architecture "
                                  f"than the checkpoint's {MODEL_CONFIG}: " + "; ".join(wrong))
        unet = build_denoiser(cfg)
        try:
            unet.load_state_dict(load_file(str(r.path / MODEL_WEIGHTS)))
            ema = load_file(str(r.path / EMA_WEIGHTS)) if (r.path / EMA_WEIGHTS).exists() \
                else {}
            _, unexpected = unet.load_state_dict(ema, strict=False)
        except RuntimeError as exc:  # missing/unexpected keys, shapes that do not fit
            raise CheckpointError(run_id, r.step, f"weights do not fit the architecture of "
                                  f"{MODEL_CONFIG}: {str(exc)[:500]}") from None
        if unexpected:
            raise CheckpointError(run_id, r.step, f"EMA weights for unknown parameters: "
                                  f"{sorted(unexpected)[:5]}")
    return ServingModel(unet=unet.eval(), scheduler=build_scheduler(cfg), config=stored,
                        run_id=run_id, step=r.step, skipped=r.skipped)


def load_serving_model(run_id: str, config: dict[str, Any] | None = None, *,
                       s3: Any = None, bucket: str | None = None,
                       step: int | None = None) -> tuple[Any, Any, str, int]:
    """``load_serving`` as ``(unet, scheduler, label, step)``, ``label`` = ``<run>/step-<N>``."""
    m = load_serving(run_id, config, s3=s3, bucket=bucket, step=step)
    return m.unet, m.scheduler, m.label, m.step
