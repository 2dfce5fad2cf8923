"""What the inference worker loads from a trainer checkpoint, verified, as a model.

``load_serving`` goes through ``store.restore`` (every byte checked, fallback to the
previous committed checkpoint of the run's current history); the architecture is the
checkpoint's own ``model_config.json``. torch is imported inside ``load_serving`` only,
so importing this module (the checkpointer does, through the package) needs no torch.

A sharded checkpoint (an FSDP run: DCP shards of every rank, ``layout``) is consolidated
on load: the worker downloads and verifies every shard file, and ``dcp.full_weights``
reads the model and EMA tensors out of them into one whole model in this process.
Consolidating here, rather than having the checkpointer write a safetensors copy
before the commit, keeps the checkpointer free of torch (it only moves bytes) and the
commit as fast as the shards' upload, and costs the training ranks nothing (no
all-gather of a model that fits no single GPU); the price is on the worker's side: it
downloads the optimizer state too (the shard files hold every part of the state), about
twice the bytes it serves, once per checkpoint it loads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.common.errors import CheckpointCorrupt
from tandem.common.events import CheckpointManifest

from .layout import DCP_METADATA, SHARDED, shard_rank, step_name
from .lineage import Lineage
from .store import Restored, restore

MODEL_WEIGHTS = "model.safetensors"
EMA_WEIGHTS = "ema.safetensors"
MODEL_CONFIG = "model_config.json"


def serving_files(manifest: CheckpointManifest) -> list[str]:
    """What a worker needs from a trainer checkpoint: weights (model, EMA) and config;
    of a sharded one, every rank's shards (which hold the weights), the DCP metadata and
    the config."""
    names = {f.name for f in manifest.files}
    if manifest.kind == SHARDED:
        shards = sorted(n for n in names if shard_rank(n) is not None)
        return [*shards, DCP_METADATA, *([MODEL_CONFIG] if MODEL_CONFIG in names else [])]
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
    lineage: int = 0

    @property
    def label(self) -> str:
        return f"{self.run_id}/{step_name(self.step, self.lineage)}"


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
                 fallback: bool = True, line: Lineage | None = None,
                 stop: threading.Event | None = None) -> ServingModel:
    """The newest committed checkpoint of ``run_id`` (or ``step``) in ``line``'s history
    (without it: lineage 0's), verified, as a model.

    The architecture comes from the checkpoint's ``model_config.json`` (else ``config``);
    an architecture field that ``config`` declares differently is a ``CheckpointError``
    naming each field, never a model of the wrong shape. The weights are
    ``model.safetensors`` with the EMA weights laid over it when the checkpoint has
    them. A sharded checkpoint's weights come from its DCP shards (``dcp.full_weights``:
    DCP's metadata through an allow-listing unpickler). Otherwise tensors only, from
    safetensors: nothing is unpickled. A checkpoint whose files fail their checksums, or
    pass them but hold nothing that builds (a config that is not an object or describes
    no model that can be built, weights that do not read or do not fit) is corrupt
    (``CheckpointCorrupt`` naming the file and what is wrong), and skipped for the
    previous committed one unless ``fallback`` is False (``restore``). Imports torch, so
    only the inference worker calls it. S3 comes from ``TANDEM_S3_*`` unless given;
    ``stop`` stops the download (``restore``).
    """
    import tempfile

    if s3 is None or bucket is None:
        from tandem.common.settings import Settings, load
        from tandem.common.storage import s3_client

        settings = load(Settings, "checkpoint loader")
        s3 = s3 if s3 is not None else s3_client(settings)
        bucket = bucket or settings.s3_bucket
    declared = dict(config or {})
    built: list[ServingModel] = []

    def build(r: Restored) -> None:
        built.append(_built(r, declared))

    with tempfile.TemporaryDirectory(prefix="tandem-serving-") as tmp:
        restore(s3, bucket, run_id, Path(tmp), step=step, fallback=fallback,
                files=serving_files, line=line, check=build, stop=stop)
    return built[-1]


def _built(r: Restored, declared: dict[str, Any]) -> ServingModel:
    """The model ``r``'s files describe; ``CheckpointCorrupt`` naming the file when they
    hold none (the bytes are the manifest's: the trainer wrote them so)."""
    import json

    from safetensors.torch import load_file

    from tandem.common.diffusion import architecture, build_denoiser, build_scheduler
    from tandem.common.errors import CheckpointError

    run_id = r.run_id

    def corrupt(name: str, what: str) -> CheckpointCorrupt:
        return CheckpointCorrupt(run_id, r.step, name, what[:500])

    cfg_path = r.path / MODEL_CONFIG
    try:
        mc = json.loads(cfg_path.read_text()) if cfg_path.exists() else dict(declared)
    except ValueError as exc:
        raise corrupt(MODEL_CONFIG, f"not JSON: {exc}") from None
    if not isinstance(mc, dict):
        raise corrupt(MODEL_CONFIG, f"not a JSON object: {type(mc).__name__}")
    try:
        cfg = architecture(mc)
        stored = {"kind": mc.get("kind", "unet"), **cfg.to_dict()}
    except MemoryError:
        raise
    except Exception as exc:
        raise corrupt(MODEL_CONFIG, f"describes no architecture: {exc!r}") from None
    wrong = config_mismatch(declared, stored, stored)
    if wrong:  # the registry's entry, not the checkpoint: no older one is tried
        raise CheckpointError(run_id, r.step, "the registry declares another architecture "
                              f"than the checkpoint's {MODEL_CONFIG}: " + "; ".join(wrong))
    try:
        unet = build_denoiser(cfg)
        scheduler = build_scheduler(cfg)
    except MemoryError:
        raise
    except Exception as exc:
        raise corrupt(MODEL_CONFIG, f"describes no model that can be built: {exc!r}") from None
    if r.manifest.kind == SHARDED:
        try:
            weights, ema = _consolidated(r.path, r.manifest, unet)
        except (MemoryError, CheckpointCorrupt):
            raise
        except Exception as exc:  # missing/unexpected keys, shapes that do not fit
            raise corrupt(DCP_METADATA, f"weights do not fit the architecture of "
                          f"{MODEL_CONFIG}: {exc}") from None
        files = [(DCP_METADATA, weights, True), (DCP_METADATA, ema, False)]
    else:
        files = []
        for name, strict in ((MODEL_WEIGHTS, True), (EMA_WEIGHTS, False)):
            if not (r.path / name).exists():
                continue
            try:
                files.append((name, load_file(str(r.path / name)), strict))
            except MemoryError:
                raise
            except Exception as exc:  # a truncated or malformed file
                raise corrupt(name, f"not a safetensors file: {exc!r}") from None
    for name, tensors, strict in files:
        try:
            _, unexpected = unet.load_state_dict(tensors, strict=strict)
        except MemoryError:
            raise
        except Exception as exc:  # missing/unexpected keys, shapes that do not fit
            raise corrupt(name, f"weights do not fit the architecture of {MODEL_CONFIG}: "
                          f"{exc}") from None
        if unexpected and not strict:
            raise corrupt(name, f"EMA weights for unknown parameters: {sorted(unexpected)[:5]}")
    return ServingModel(unet=unet.eval(), scheduler=scheduler, config=stored, run_id=run_id,
                        step=r.step, skipped=r.skipped, lineage=r.lineage)


def _consolidated(path: Path, manifest: CheckpointManifest, model: Any) -> tuple[Any, Any]:
    """A sharded checkpoint's whole weights and EMA for ``model``. A key the checkpoint
    lacks or a shape that differs (DCP's errors) is a ``RuntimeError``, as the
    safetensors path's are; a metadata file that points outside the manifest or holds
    more than DCP's classes is ``CheckpointCorrupt``."""
    from torch.distributed.checkpoint.api import CheckpointException

    from tandem.common.errors import CheckpointCorrupt as Corrupt

    from .dcp import full_weights
    from .local import CorruptCheckpoint

    try:
        return full_weights(path, manifest, model)
    except CorruptCheckpoint as exc:
        raise Corrupt(manifest.run_id, manifest.step, DCP_METADATA, exc.reason) from None
    except (CheckpointException, ValueError) as exc:
        raise RuntimeError(str(exc)) from None


def load_serving_model(run_id: str, config: dict[str, Any] | None = None, *,
                       s3: Any = None, bucket: str | None = None,
                       step: int | None = None) -> tuple[Any, Any, str, int]:
    """``load_serving`` as ``(unet, scheduler, label, step)``, ``label`` = ``<run>/step-<N>``."""
    m = load_serving(run_id, config, s3=s3, bucket=bucket, step=step)
    return m.unet, m.scheduler, m.label, m.step
