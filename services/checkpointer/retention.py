"""Retention: which of a run's checkpoints go, in S3 and on local disk.

The rules (which steps) are ``tandem.common.checkpoints``' (``retention``, ``passed``,
``local_retention``); this module applies them with what the checkpointer knows at the
moment it matters: its listing of the run's checkpoints in S3, the run's history
(``checkpoints.Lineage``) and which checkpoints it has seen committed.

- ``Retention.prune``, after a commit: in S3, the committed checkpoints of the history
  beyond the newest ``keep_last`` (multiples of ``keep_every`` kept), those never
  committed that retention has passed once nothing was written to them for
  ``stale_upload_age``, and every one a rollback abandoned; ``ckpt.<run>.pruned`` names
  them.
- ``Retention.passed``, before a mirror: whether retention has already passed a
  checkpoint handed over (committed, it would be deleted at once).
- ``delete_local``: the local copies, only once committed (or passed, or abandoned).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from tandem.common import checkpoints as ck
from tandem.common import subjects
from tandem.common.bus import Bus
from tandem.common.events import CheckpointPruned, CheckpointWritten

from .settings import CheckpointerSettings


def committed_history(listed: dict[ck.CheckpointId, bool], line: ck.Lineage) -> set[int]:
    """The steps of ``line``'s history committed in S3 (``listed``: ``list_checkpoints``)."""
    return {c.step for c, done in listed.items() if done and line.holds(*c)}


class Retention:
    """The run's retention in S3, with the checkpointer's client, bus and settings."""

    def __init__(self, s3: Any, bus: Bus, settings: CheckpointerSettings) -> None:
        self.s3 = s3
        self.bus = bus
        self.settings = settings

    async def passed(self, ev: CheckpointWritten, line: ck.Lineage, lg: Any) -> bool:
        """Whether retention has passed ``ev``'s checkpoint (``checkpoints.passed``) over
        the run's committed history in S3. S3 unreachable: not known here, so False (the
        mirror's own retries wait for S3)."""
        s = self.settings
        try:
            listed = await asyncio.to_thread(ck.list_checkpoints, self.s3, s.s3_bucket,
                                             ev.run_id)
        except Exception as exc:
            lg.warning("checkpoint.listing_failed", error=repr(exc))
            return False
        committed = committed_history(listed, line)
        if ev.step in committed or not ck.passed(ev.step, committed, s.keep_last,
                                                 s.keep_every):
            return False
        lg.info("checkpoint.passed", committed=sorted(committed), keep_last=s.keep_last,
                keep_every=s.keep_every, part=ev.manifest.part or None)
        return True

    async def prune(self, run: str, listed: dict[ck.CheckpointId, bool],
                    written: dict[ck.CheckpointId, float], line: ck.Lineage,
                    lg: Any) -> None:
        """Retention over the committed checkpoints of the run's history; every checkpoint
        of it never committed that retention has passed (the parts of a node whose others
        never came, or that came after the rest was pruned) once nothing was written to
        it for ``stale_upload_age`` (``written``: its newest object's time; a younger one
        may be an upload still running); every checkpoint (committed or not) a rollback
        abandoned."""
        s = self.settings
        history = sorted(committed_history(listed, line))
        drop = [ck.CheckpointId(step, line.owner(step))
                for step in ck.retention(history, s.keep_last, s.keep_every)]
        stale = time.time() - s.stale_upload_age
        partial = [c for c, done in listed.items() if not done and line.holds(*c)
                   and ck.passed(c.step, history, s.keep_last, s.keep_every)
                   and written.get(c, 0.0) < stale]
        abandoned = [c for c in listed if line.abandoned(*c)]
        if not drop and not partial and not abandoned:
            return
        for c in drop + partial + abandoned:
            await asyncio.to_thread(ck.delete, self.s3, s.s3_bucket, run, c.step, c.lineage)
        reason = (f"retention: keep the newest {s.keep_last}" + (
            f" and every multiple of {s.keep_every}" if s.keep_every else "")) if drop else ""
        if partial:
            reason += ("; " if reason else "") + "never committed, older than retention keeps"
        if abandoned:
            reason += ("; " if reason else "") + "abandoned by a rollback"
        gone = sorted(drop + partial + abandoned)
        names = [c.name for c in gone]
        digest = hashlib.sha256(",".join(names).encode()).hexdigest()[:16]
        await self.bus.publish(subjects.ckpt(run, "pruned"),
                               CheckpointPruned(run_id=run, steps=[c.step for c in gone],
                                                names=names, reason=reason),
                               msg_id=f"ckpt-{run}-pruned-{digest}", retry_for=30.0)
        lg.info("checkpoint.pruned", checkpoints=names, reason=reason)


def delete_local(parent: Path, committed: set[int], keep: int, lg: Any,
                 line: ck.Lineage | None = None,
                 passed: Collection[int] = ()) -> list[ck.CheckpointId]:
    """Delete the checkpoint folders in ``parent`` of ``line``'s history (default:
    lineage 0's) beyond the newest ``keep`` — only those whose commit this checkpointer
    has seen (``committed``, steps of that history, was listed before pruning, so a
    pruned step counts) — those retention has ``passed`` (newer ones are kept in S3:
    this one would be deleted there as it was committed), and every one a rollback
    abandoned. A checkpoint of the history that failed to mirror is never deleted here.

    NOTE: this is the one place that decides a whole local checkpoint may go (the rule
    is ``checkpoints.local_retention``). It is the checkpointer's because only the
    checkpointer knows, at the moment it matters, that the S3 copy is committed: the
    trainer would have to learn it back from ``ckpt.<run>.mirrored``, and a local copy
    deleted on a guess is a checkpoint lost. The trainer removes only its own
    unfinished ``.incomplete`` writes (``checkpoints.local``).
    """
    line = line or ck.Lineage()
    local = ck.local_checkpoints(parent)
    history = [c.step for c, _ in local if line.holds(*c)]
    steps = set(ck.local_retention(history, committed, keep)) | (set(history) & set(passed))
    old = [ck.CheckpointId(s, line.owner(s)) for s in sorted(steps)]
    gone = ck.remove_steps(parent, old + [c for c, _ in local if line.abandoned(*c)])
    if gone:
        lg.info("checkpoint.local_deleted", checkpoints=[c.name for c in gone],
                dir=str(parent))
    return gone
