"""A resume on nodes that share no disk: every node fetches its checkpoint from S3.

With the node agents (``TANDEM_LAUNCHER=nodes``) each node has a disk of its own, and the
checkpoint an attempt resumes from is the one committed in S3, which no single node
holds (each wrote only its part). The coordinator lists the committed steps and names
them in the launch spec (``LaunchSpec.resume_steps``, newest first); ``fetch`` is then
collective (every rank calls it, before training):

- for each step in turn, the node's first rank (``LOCAL_RANK`` 0) makes
  ``<checkpoint_root>/<run>/step-<N>[-l<L>]`` the committed checkpoint of the run's
  current history (``LaunchSpec.forks`` say which lineage owns each step, so a
  checkpoint a rollback abandoned is never fetched), on this node's disk: a
  copy already there is kept if it verifies against the committed manifest, else the
  step is downloaded and every byte checked against the manifest's checksum
  (``checkpoints.download``: renamed into place only when whole);
- every rank learns every node's outcome (``all_gather_object`` on a gloo group of its
  own, with a timeout long enough for a download); the first step that every node
  verified is the one every rank loads. A step that any node found corrupt or missing
  is skipped by all, with each node's reason, so the ranks never load different steps;
- an error that says nothing about the checkpoint (S3 unreachable) fails the attempt on
  every rank instead: falling back past a good checkpoint because of an outage would
  throw work away. The coordinator restarts the attempt, with its backoff.

Every node downloads the whole checkpoint: DCP's resharding load decides which shard
files each rank reads only while it loads, so a node cannot know its files beforehand.
Downloading is blocking and bounded by the run's ``watchdog.startup_timeout_s`` (launch
to first step); raise it for checkpoints that take longer to fetch.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from tandem.common import checkpoints as ck
from tandem.common import storage
from tandem.common.errors import CheckpointCorrupt, CheckpointNotFound
from tandem.common.settings import Settings, load
from tandem.trainer.spec import LaunchSpec

FETCH_TIMEOUT = timedelta(hours=2)  # the group's collectives wait for the slowest download


class FetchFailed(RuntimeError):
    """A node could not fetch a checkpoint for a reason other than the checkpoint itself
    (``errors``: each such node's); the attempt fails on every rank."""

    def __init__(self, step: int, errors: dict[str, str]) -> None:
        super().__init__(f"fetching step {step} from S3 failed: " + "; ".join(
            f"{node}: {why}" for node, why in sorted(errors.items())))
        self.step = step
        self.errors = errors


def fetch_step(s3: Any, bucket: str, root: Path, run_id: str, step: int,
               lineage: int = 0) -> tuple[str, str]:
    """Make ``root/<run>/step-<N>[-l<L>]`` this node's verified copy of committed
    ``step`` of ``lineage``: ``("ok", how)``, ``("corrupt", reason)`` (corrupt or missing
    in S3: skip it) or ``("error", what)`` (anything else)."""
    try:
        manifest = ck.read_manifest(s3, bucket, run_id, step, lineage)
        here = ck.step_dir(root, run_id, step, lineage)
        if here.is_dir():
            try:
                if ck.same_files(ck.verify(here), manifest):
                    return "ok", "kept the copy on this node"
            except ck.CorruptCheckpoint:
                pass  # this node's part, or a copy that rotted: replaced below
        ck.download(s3, bucket, run_id, step, ck.run_dir(root, run_id), manifest=manifest)
        return "ok", "downloaded"
    except (CheckpointCorrupt, CheckpointNotFound) as exc:
        return "corrupt", exc.reason
    except Exception as exc:
        return "error", f"{type(exc).__name__}: {exc}"


def fetch(spec: LaunchSpec, *, local_rank: int, world: int,
          node: str) -> tuple[Path | None, int, dict[int, str]]:
    """Collective: the checkpoint every rank resumes from (its path on this node, its
    step) and the steps skipped (step -> each node's reason); ``(None, 0, skipped)`` when
    no committed step verified on every node (the run starts afresh). Raises
    ``FetchFailed`` on every rank when a node failed for another reason."""
    import torch.distributed as dist

    group = dist.new_group(backend="gloo", timeout=FETCH_TIMEOUT) \
        if dist.is_initialized() else None
    settings = load(Settings)  # the agent's TANDEM_S3_* reach its ranks' environment
    s3 = storage.s3_client(settings) if local_rank == 0 else None
    bucket = settings.s3_bucket
    root = Path(spec.checkpoint_root)
    line = ck.Lineage.of(spec.forks)
    skipped: dict[int, str] = {}
    for step in spec.resume_steps:
        lineage = line.owner(step)
        mine = (node, *fetch_step(s3, bucket, root, spec.run_id, step, lineage)) \
            if s3 is not None else (node, "ok", "its node's first rank fetches")
        outcomes: list[Any] = [mine]
        if group is not None:
            outcomes = [None] * world
            dist.all_gather_object(outcomes, mine, group=group)
        errors = {n: why for n, kind, why in outcomes if kind == "error"}
        if errors:
            raise FetchFailed(step, errors)
        bad = {n: why for n, kind, why in outcomes if kind == "corrupt"}
        if not bad:
            return ck.step_dir(root, spec.run_id, step, lineage), step, skipped
        skipped[step] = "; ".join(f"{n}: {why}" for n, why in sorted(bad.items()))
    return None, 0, skipped
