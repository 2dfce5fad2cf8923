"""The health tracker: runs the rules of ``rules.py`` over each sample, with hysteresis.

It keeps, per (rule, GPU), a leaky count of samples the condition held and of clean
samples since, and reports a ``Change`` whenever a rule fires or clears. The node's
health is the worst severity among active rules; the agent turns changes of that into
published transitions.

An undrain (``clear_latched``) forgets latched faults, except a state fault
(``Rule.state``) the GPU's latest sample still shows; each state fault it keeps is judged
once more on the next sample, and cleared then if that sample no longer shows it.
"""

from __future__ import annotations

import statistics
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tandem.cluster_agent.rules import (
    RULES,
    SEVERITY,
    Evidence,
    GpuView,
    Limits,
    Rule,
    is_busy,
)
from tandem.common.events import GpuSample, Health


@dataclass(slots=True)
class _Track:
    on: int = 0  # leaky count of samples the condition held
    off: int = 0  # clean samples in a row while active
    active: bool = False
    evidence: Evidence = field(default_factory=dict)
    since: float = 0.0


@dataclass(frozen=True, slots=True)
class Change:
    """A rule fired (``fired``) or cleared on ``gpu`` at ``at``, with its evidence."""

    rule: Rule
    gpu: int
    fired: bool
    evidence: Evidence
    at: float

    @property
    def key(self) -> str:
        return f"{self.rule.name}@{self.gpu}"


def _median(values: Iterable[float | int | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(statistics.median(vals)) if vals else None


class Tracker:
    def __init__(self, rules: Sequence[Rule] = RULES, limits: Limits | None = None) -> None:
        self.rules = tuple(rules)
        self.limits = limits or Limits()
        self._by_name = {r.name: r for r in self.rules}
        self.samples = 0
        self._tracks: dict[tuple[str, int], _Track] = {}
        self._last: dict[int, GpuView] = {}  # each GPU's view at the latest sample
        # Per GPU, the XIDs of each sample within the window and their totals: bounded by
        # the window's samples and the distinct codes, however many XIDs a sample brings.
        self._xids: dict[int, tuple[deque[tuple[int, Counter[int]]], Counter[int]]] = {}
        # State faults an undrain kept, judged again by the next sample (clear_latched).
        self._recheck: set[tuple[str, int]] = set()

    # ----------------------------------------------------------------------------- state

    @property
    def health(self) -> Health:
        worst = Health.healthy
        for (name, _), tr in self._tracks.items():
            severity = self._by_name[name].severity
            if tr.active and SEVERITY[severity] > SEVERITY[worst]:
                worst = severity
        return worst

    def active(self) -> list[str]:
        """Active rules as ``rule@gpu``, sorted."""
        return sorted(f"{n}@{g}" for (n, g), tr in self._tracks.items() if tr.active)

    def active_rules(self) -> list[tuple[Rule, int]]:
        """Active rules with their GPU, in ``active()``'s order."""
        return sorted(((self._by_name[n], g) for (n, g), tr in self._tracks.items() if tr.active),
                      key=lambda rg: (rg[0].name, rg[1]))

    def gpus_with(self, severity: Health) -> set[int]:
        """GPUs with an active rule of ``severity``."""
        return {g for (n, g), tr in self._tracks.items()
                if tr.active and self._by_name[n].severity == severity}

    def evidence(self, rule: str, gpu: int) -> Evidence:
        tr = self._tracks.get((rule, gpu))
        return dict(tr.evidence) if tr else {}

    # --------------------------------------------------------------------------- observe

    def observe(self, samples: Sequence[GpuSample], at: float) -> list[Change]:
        """Run every rule over one sample of the node; return what fired or cleared."""
        self.samples += 1
        lim = self.limits
        busy = [s for s in samples if is_busy(s, lim)]
        median_clock = _median(s.sm_clock for s in busy)
        median_util = _median(s.util for s in busy)
        changes: list[Change] = []
        tracks = self._tracks
        for s in samples:
            counts: dict[int, int] = {}
            if s.xids:
                counts = self._remember_xids(s)
            last = self._last.get(s.index)
            view = GpuView(s, last.s if last is not None else None, median_clock, median_util,
                           len(busy), counts)
            for rule in self.rules:
                key = (rule.name, s.index)
                tr = tracks.get(key)
                test = rule.hold if (tr is not None and tr.active and rule.hold) else rule.fire
                ev = test(view, lim)
                if ev is not None:
                    if tr is None:
                        tr = tracks[key] = _Track()
                    tr.on = min(tr.on + 1, rule.sustain)
                    tr.off = 0
                    if not tr.active and tr.on >= rule.sustain:
                        tr.active, tr.evidence, tr.since = True, ev, at
                        changes.append(Change(rule, s.index, True, ev, at))
                elif tr is not None:
                    if tr.active:
                        if rule.clear:
                            tr.off += 1
                            if tr.off >= rule.clear:
                                del tracks[key]
                                changes.append(Change(rule, s.index, False, tr.evidence, at))
                        elif key in self._recheck:  # kept by an undrain, gone now
                            del tracks[key]
                            changes.append(Change(rule, s.index, False, tr.evidence, at))
                    else:
                        tr.on -= 1
                        if tr.on <= 0:
                            del tracks[key]
            self._last[s.index] = view
        self._recheck.clear()  # judged once: a state fault still shown is latched again
        return changes

    def _remember_xids(self, s: GpuSample) -> dict[int, int]:
        """Each code's count on GPU ``s.index`` within the last ``xid_window`` samples."""
        window, totals = self._xids.setdefault(s.index, (deque(), Counter()))
        seen = Counter(s.xids)
        window.append((self.samples, seen))
        totals.update(seen)
        while window and window[0][0] <= self.samples - self.limits.xid_window:
            for code, n in window.popleft()[1].items():
                totals[code] -= n
                if totals[code] <= 0:
                    del totals[code]
        return dict(totals)

    # ----------------------------------------------------------------- restart and undrain

    def restore(self, keys: Iterable[str], at: float) -> None:
        """Re-activate rules published as active before a restart (``rule@gpu``).

        A latched rule stays until undrain; any other clears by itself once its
        condition has been absent for its ``clear`` samples.
        """
        for key in keys:
            name, _, gpu = key.partition("@")
            rule = self._by_name.get(name)
            if rule is None or not gpu.isdigit():
                continue
            self._tracks[(name, int(gpu))] = _Track(on=rule.sustain, active=True,
                                                    evidence={"restored": True}, since=at)

    def clear_latched(self, at: float) -> list[Change]:
        """The operator returned the node to service: forget latched faults and XIDs,
        except the state faults the GPUs still show; return what cleared.

        An XID is an event: the undrain is the only sign it was dealt with, so it clears. A
        state fault (``Rule.state``: a lost GPU, uncorrectable ECC errors, a failed row
        remap) is in every sample until a reset or a replacement: one the GPU's latest
        sample still shows, or that no sample has judged yet (an undrain seen at start,
        before the first sample), stays active, so the node never reads healthy while it
        is visibly broken. The next sample judges each kept fault once more and clears it
        if it no longer shows it (a reset just after the latest sample); one still shown
        stays latched until the next undrain.
        """
        changes = []
        for (name, gpu), tr in list(self._tracks.items()):
            rule = self._by_name[name]
            if not (tr.active and rule.latched):
                continue
            if rule.state:
                last = self._last.get(gpu)
                if last is None or rule.fire(last, self.limits) is not None:
                    self._recheck.add((name, gpu))
                    continue
            del self._tracks[(name, gpu)]
            changes.append(Change(rule, gpu, False, tr.evidence, at))
        self._xids.clear()
        return changes
