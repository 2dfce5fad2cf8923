"""Judgements over a run's step stream (no torch): loss health, hangs, stragglers, goodput.

``LossHealth`` runs inside every rank on the all-reduced loss, so all ranks reach the
same verdict on the same step and stop before applying a bad update. The others run in
the coordinator.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# 1.4826 * MAD estimates the standard deviation of normal data, so the robust z-score
# reads like an ordinary one; a small floor keeps a flat history from dividing by zero.
_MAD_SCALE = 1.4826
_MAD_FLOOR = 1e-8


def robust_z(value: float, history: Sequence[float]) -> tuple[float, float, float]:
    """``(z, median, mad)`` of ``value`` against ``history``: (x - median) / (1.4826 MAD)."""
    med = statistics.median(history)
    mad = statistics.median(abs(h - med) for h in history)
    scale = max(_MAD_SCALE * mad, _MAD_FLOOR, 1e-3 * abs(med))
    return (value - med) / scale, med, mad


@dataclass
class LossAnomaly:
    kind: str  # "nonfinite" or "spike"
    loss: float
    grad_norm: float
    evidence: dict[str, Any]


class LossHealth:
    """NaN/inf loss or grad norm, and spikes over a robust z-score of recent losses."""

    def __init__(self, window: int = 50, min_history: int = 20, z_threshold: float = 12.0,
                 enabled: bool = True) -> None:
        self.window = window
        self.min_history = min_history
        self.z_threshold = z_threshold
        self.enabled = enabled
        self.history: deque[float] = deque(maxlen=window)

    def check(self, loss: float, grad_norm: float) -> LossAnomaly | None:
        """The anomaly this step shows, if any; a healthy loss joins the history."""
        if not self.enabled:
            return None
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return LossAnomaly("nonfinite", loss, grad_norm,
                               {"loss_finite": math.isfinite(loss),
                                "grad_norm_finite": math.isfinite(grad_norm)})
        if len(self.history) >= self.min_history:
            z, med, mad = robust_z(loss, self.history)
            if z > self.z_threshold:
                return LossAnomaly("spike", loss, grad_norm,
                                   {"z": z, "median": med, "mad": mad,
                                    "threshold": self.z_threshold, "window": len(self.history)})
        self.history.append(loss)
        return None

    def state_dict(self) -> list[float]:
        return list(self.history)

    def load_state_dict(self, state: Sequence[float]) -> None:
        self.history = deque((float(x) for x in state), maxlen=self.window)


class HangWatch:
    """When the next step is overdue: a multiple of the median step interval, floored."""

    def __init__(self, multiple: float, floor_s: float, keep: int = 50) -> None:
        self.multiple = multiple
        self.floor_s = floor_s
        self.intervals: deque[float] = deque(maxlen=keep)

    def observe(self, interval: float) -> None:
        if interval > 0:
            self.intervals.append(interval)

    def median(self) -> float | None:
        return statistics.median(self.intervals) if self.intervals else None

    def limit(self) -> float:
        med = self.median()
        return self.floor_s if med is None else max(self.floor_s, self.multiple * med)

    def reset(self) -> None:
        self.intervals.clear()


@dataclass
class Straggler:
    rank: int
    node: str
    score: float  # median over the window of (rank's step time / the others' median)
    rank_time: float
    median_time: float  # the other ranks' median step time, at the flagging step
    steps: int


class StragglerDetector:
    """Flags a rank whose step time stays well above the other ranks'.

    A rank's score at a step is its time over the median time of the *other* ranks (so
    two ranks compare with each other, not with their own mean). It is flagged when the
    median of its last ``window`` scores reaches ``ratio``: persistent, robust to a few
    noisy steps. A flagged rank is reported once, until that median drops below
    ``ratio`` again (or the detector is reset at a restart).
    """

    def __init__(self, ratio: float = 1.5, window: int = 20) -> None:
        self.ratio = ratio
        self.window = window
        self._scores: dict[int, deque[float]] = {}
        self._flagged: set[int] = set()

    def reset(self) -> None:
        self._scores.clear()
        self._flagged.clear()

    def observe(self, rank_times: Sequence[float], rank_nodes: Sequence[str]) -> list[Straggler]:
        if len(rank_times) < 2:
            return []
        flagged = []
        times = list(rank_times)
        for rank, t in enumerate(times):
            others = statistics.median(times[:rank] + times[rank + 1:])
            if others <= 0:
                continue
            q = self._scores.setdefault(rank, deque(maxlen=self.window))
            q.append(t / others)
            score = statistics.median(q)
            slow = len(q) == self.window and score >= self.ratio
            if slow and rank not in self._flagged:
                self._flagged.add(rank)
                node = rank_nodes[rank] if rank < len(rank_nodes) else ""
                flagged.append(Straggler(rank=rank, node=node, score=score, rank_time=t,
                                         median_time=others, steps=len(q)))
            elif rank in self._flagged and score < self.ratio:
                self._flagged.discard(rank)
        return flagged


BADPUT = ("startup", "checkpoint", "lost", "restart")


@dataclass
class Goodput:
    """Where a run's wall time went.

    Phases: ``startup`` (launch to first step of an attempt), training (first step on;
    productive unless blocked by a checkpoint or later thrown away by a rollback), and
    ``restart`` (failure detected, ranks killed, backoff, until the next launch).
    ``lost`` is training time whose steps were redone after resuming from an earlier
    checkpoint, plus the time from the last step to the failure's detection.
    """

    started_at: float = field(default_factory=time.time)
    productive: float = 0.0
    badput: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BADPUT, 0.0))
    _attempt_steps: list[tuple[int, float]] = field(default_factory=list)
    _last: float | None = None
    _phase: str = "startup"

    @classmethod
    def resumed(cls, summary: dict[str, float], last_seen: float) -> Goodput:
        """Continue from a recorded ``summary`` (a coordinator adopting a run); the time
        since ``last_seen``, the record's last update, counts as restart downtime."""
        g = cls(started_at=last_seen - summary.get("elapsed_s", 0.0))
        g.productive = summary.get("productive_s", 0.0)
        for k in BADPUT:
            g.badput[k] = summary.get(f"badput_{k}_s", 0.0)
        g._last = last_seen
        g._phase = "down"
        return g

    def launched(self, at: float | None = None) -> None:
        at = time.time() if at is None else at
        if self._last is not None:
            self.badput["restart"] += max(0.0, at - self._last)
        self._last = at
        self._attempt_steps = []
        self._phase = "startup"

    def step(self, step: int, at: float | None = None) -> None:
        at = time.time() if at is None else at
        if self._last is None:
            self._last = at
        dt = max(0.0, at - self._last)
        if self._phase == "startup":
            self.badput["startup"] += dt
            self._phase = "training"
        else:
            self.productive += dt
            self._attempt_steps.append((step, dt))
        self._last = at

    def checkpoint_blocked(self, seconds: float) -> None:
        moved = min(seconds, self.productive)
        self.productive -= moved
        self.badput["checkpoint"] += moved

    def failed(self, resume_step: int, at: float | None = None) -> None:
        """The attempt failed; training resumes from ``resume_step``."""
        at = time.time() if at is None else at
        redo = sum(dt for s, dt in self._attempt_steps if s > resume_step)
        redo = min(redo, self.productive)
        self.productive -= redo
        tail = max(0.0, at - self._last) if self._last is not None else 0.0
        phase = self._phase
        self.badput["startup" if phase == "startup" else "lost"] += tail
        self.badput["lost"] += redo
        self._attempt_steps = []
        self._last = at
        self._phase = "down"

    def finished(self, at: float | None = None) -> None:
        at = time.time() if at is None else at
        if self._last is not None:
            self.productive += max(0.0, at - self._last)
            self._last = at

    def summary(self, at: float | None = None) -> dict[str, float]:
        at = time.time() if at is None else at
        elapsed = max(at - self.started_at, 1e-9)
        out = {"elapsed_s": round(elapsed, 3), "productive_s": round(self.productive, 3),
               "goodput": round(self.productive / elapsed, 4)}
        out.update({f"badput_{k}_s": round(v, 3) for k, v in self.badput.items()})
        return out
