"""A run's lineages: which history each checkpoint belongs to, so that a rollback never
reuses a checkpoint's identity.

A run starts in lineage 0. A rollback (a loss anomaly: the run goes back to an older
checkpoint on purpose and trains the same step numbers again, on other data) starts a
new lineage, numbered 1, 2, ... in order and *forked* at a step of the history it leaves:
the new history is the old one up to that step, then the new lineage's own steps. Every
checkpoint carries its lineage (``CheckpointManifest.lineage``) and is named by it
(``step-<N>`` in lineage 0, ``step-<N>-l<L>`` after; ``layout.step_name``), on local disk
and in S3 alike, so the new history never overwrites, collides with or is mistaken for
the old one; events carry it too (``TrainStep``, ``CheckpointMirrored``).

The run's record in KV ``runs`` keeps ``forks``: lineage ``i + 1`` forked from lineage
``i`` at step ``forks[i]``. From them ``Lineage`` answers, for the current lineage, which
lineage *owns* each step of its history (``owner``): steps after the last fork are the
current lineage's, steps up to it are the previous lineage's history, and so on down to
lineage 0. On that history each step number names one checkpoint, so readers that list
steps (the newest, retention, restore) work on plain step numbers once they have kept
only the checkpoints the history holds (``holds``). A checkpoint of a lineage the
history has left behind is *abandoned* (``abandoned``): it is never resumed from, never
served, and retention deletes it. Histories only move forward (a new fork starts from
the current history), so an abandoned checkpoint stays abandoned; a checkpoint of a
lineage newer than a reader's record is neither held nor abandoned for it: the record
is behind, and nothing is decided about it.

Why a fork at a step and not at a checkpoint: the coordinator decides a rollback (the
newest step whose state holds none of the skipped data) before it knows which
checkpoint at or below that step will verify. The ranks name each checkpoint by the
owner of its step, so steps up to the fork that an attempt trains again (from an older
checkpoint, with the same data and RNG states) rewrite their old lineage's checkpoints
bitwise, as any resume does.

A crash, a hang or a lost node resumes in the same lineage: its rewrite of a step is the
same checkpoint again (bitwise, at the same world size).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Lineage:
    """The current lineage of a run and the history it sees (from ``RunRecord.forks``)."""

    forks: tuple[int, ...] = ()

    @classmethod
    def of(cls, forks: Iterable[int] | None) -> Lineage:
        """From a run record's ``forks``; ValueError naming a step that is not >= 0."""
        steps = tuple(forks or ())
        for i, step in enumerate(steps):
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise ValueError(f"fork of lineage {i + 1} must be a step >= 0, got {step!r}")
        return cls(steps)

    @property
    def current(self) -> int:
        """The lineage new checkpoints are written in."""
        return len(self.forks)

    def owner(self, step: int) -> int:
        """The lineage whose checkpoint at ``step`` belongs to the current history."""
        for lineage in range(self.current, 0, -1):
            if step > self.forks[lineage - 1]:
                return lineage
        return 0

    def holds(self, step: int, lineage: int) -> bool:
        """Whether checkpoint ``step`` of ``lineage`` is in the current history."""
        return lineage <= self.current and self.owner(step) == lineage

    def abandoned(self, step: int, lineage: int) -> bool:
        """Whether checkpoint ``step`` of ``lineage`` was left behind by a rollback
        (never loaded again). False for a lineage newer than this record knows."""
        return lineage <= self.current and self.owner(step) != lineage

    def fork(self, step: int) -> Lineage:
        """The history after a rollback to ``step`` (below 0: from scratch): a new
        lineage, which owns every step after ``step``."""
        return Lineage((*self.forks, max(0, step)))

    def json(self) -> list[int]:
        """As ``RunRecord.forks``."""
        return list(self.forks)
