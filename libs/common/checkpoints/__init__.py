"""tandem.common.checkpoints: the one owner of the checkpoint layout, local and in S3 (torchtitan's
``CheckpointManager`` in Tandem's shape: the commit stays manifest-last in S3).

- ``layout``: ``step-<N>`` names, S3 keys and local paths, the manifest, retention;
  the only place that builds or parses a name or reads or writes a manifest.
- ``lineage``: which history a checkpoint belongs to after rollbacks (``Lineage``).
- ``local``: the trainer's atomic local commit, verification, the newest valid, removal.
- ``store``: S3 listing, verified download and restore (with fallback), deletion.
- ``serving``: a committed checkpoint loaded as a model (torch imported inside).
- ``dcp``: Distributed Checkpoint read safely (imports torch: not imported here; the
  trainer and the inference worker import it themselves).

Imports only ``tandem.common``; never a service. The names below are the public API
(``from tandem.common import checkpoints as ck``; ``ck.restore(...)``).
"""

from . import checksum
from .layout import (
    CHUNK,
    CORRUPT,
    DCP_METADATA,
    FULL,
    INCOMPLETE,
    MANIFEST,
    PARTS,
    SHARD_DIR,
    SHARDED,
    SHARDED_STATE,
    CheckpointId,
    check_commit,
    check_name,
    checkpoint_uri,
    checkpoints_in_listing,
    corrupt_dir,
    covers,
    decode_manifest,
    encode_manifest,
    incomplete_dir,
    lacking,
    local_checkpoints,
    local_retention,
    local_steps,
    manifest_key,
    merge_parts,
    missing,
    object_key,
    parse_checkpoint,
    parse_manifest,
    parse_step,
    part_key,
    parts_prefix,
    passed,
    retention,
    run_dir,
    run_prefix,
    same_files,
    scan,
    shard_rank,
    sharded,
    step_dir,
    step_name,
    step_prefix,
    steps_in_listing,
    validate_manifest,
)
from .lineage import Lineage
from .local import (
    CorruptCheckpoint,
    Rejected,
    Resume,
    commit,
    complete_steps,
    newest_valid,
    prepare_incomplete,
    remove_incomplete,
    remove_steps,
    verify,
)
from .serving import (
    EMA_WEIGHTS,
    MODEL_CONFIG,
    MODEL_WEIGHTS,
    ServingModel,
    config_mismatch,
    load_serving,
    load_serving_model,
    serving_files,
)
from .store import (
    FileChoice,
    Restored,
    Stopped,
    committed_steps,
    delete,
    download,
    list_checkpoints,
    list_steps,
    newest_committed,
    read_manifest,
    restore,
)

__all__ = [
    "CHUNK", "CORRUPT", "DCP_METADATA", "EMA_WEIGHTS", "FULL", "INCOMPLETE", "MANIFEST",
    "MODEL_CONFIG", "MODEL_WEIGHTS", "PARTS", "SHARDED", "SHARDED_STATE", "SHARD_DIR",
    "CheckpointId", "CorruptCheckpoint", "FileChoice", "Lineage", "Rejected", "Restored",
    "Resume", "ServingModel", "Stopped",
    "check_commit", "check_name", "checkpoint_uri", "checkpoints_in_listing", "checksum", "commit",
    "committed_steps", "complete_steps", "config_mismatch", "corrupt_dir", "covers",
    "decode_manifest", "delete", "download", "encode_manifest", "incomplete_dir", "lacking",
    "list_checkpoints", "list_steps", "load_serving", "load_serving_model",
    "local_checkpoints", "local_retention", "local_steps", "manifest_key", "merge_parts",
    "missing", "newest_committed", "newest_valid", "object_key", "parse_checkpoint",
    "parse_manifest", "parse_step", "part_key", "parts_prefix", "passed", "prepare_incomplete",
    "read_manifest", "remove_incomplete", "remove_steps", "restore", "retention", "run_dir",
    "run_prefix", "same_files", "scan", "serving_files", "shard_rank", "sharded", "step_dir",
    "step_name", "step_prefix", "steps_in_listing", "validate_manifest", "verify",
]
