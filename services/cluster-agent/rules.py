"""The health rules, as data: what marks a GPU (and so its node) degraded or unhealthy.

Each ``Rule`` names its severity, the action an operator should take (``drain``,
``reset``, ``replace`` or none), the reason in words, a ``fire`` test returning the
evidence (the values that matched) or None, and its hysteresis:

- ``sustain``: how many samples the condition must hold before the rule fires. The
  count leaks (one clean sample takes one off), so a one-sample blip never fires and a
  condition that is on most of the time still does.
- ``clear``: how many clean samples in a row before an active rule clears; ``0`` means
  latched: the fault stays until the operator undrains the node (after a reset or a
  replacement), because an XID or a lost GPU does not heal on its own.
- ``state``: for a latched rule, its condition is a state the GPU shows in every sample
  until a reset or a replacement (a lost GPU, a non-zero volatile uncorrectable-ECC
  count, a failed row remap), not an event reported once (an XID). An undrain clears a
  latched event rule, since the operator's word is the only sign it was dealt with, but
  keeps a latched state rule the GPU still shows: a node visibly broken is not returned
  to service, not even for one sample (``Tracker.clear_latched``).
- ``hold``: the test that keeps an active rule active, looser than ``fire`` for
  thresholds (a temperature rule fires at the limit and clears only ``temp_band``
  below it), so a value hovering at the limit cannot flap.

Stragglers (``straggler-clock``, ``straggler-util``) are judged only among *busy* GPUs
(``is_busy``: utilisation at least ``busy_util``, 10 %), against the medians of the
node's busy GPUs, and only while at least ``straggler_min_gpus`` (4) GPUs are busy at a
median utilisation of at least ``straggler_busy`` (50 %). An idle GPU (a slot a
partial-node job leaves unused, an inference worker waiting for requests) is not slow:
it has nothing to do. So a node with fewer than 4 GPUs is never judged, a GPU so starved
that it falls under 10 % reads as idle, and a whole node uniformly slow is no straggler
(its own GPUs are the only peers).

XIDs are classified in ``XIDS`` (NVIDIA's XID catalogue): application-level XIDs are
recorded in telemetry but never mark a node; the rest fire their own rule, and one
outside the catalogue fires ``xid-unknown``. An XID is a small positive number
(``valid_xid``: 1 to ``XID_MAX``); the agent drops any other value a backend reports
before the rules, telemetry or a transition see it.
Sustain and clear counts are in samples (1 s each by default).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from tandem.common.events import GpuSample, Health

Action = Literal["", "drain", "reset", "replace"]
Evidence = dict[str, Any]

# NVML clocks-event reason bits.
HW_SLOWDOWN, SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE = 0x8, 0x20, 0x40, 0x80

SEVERITY = {Health.healthy: 0, Health.degraded: 1, Health.unhealthy: 2}


@dataclass(frozen=True, slots=True)
class Limits:
    """Thresholds the rules compare against."""

    temp_warn: float = 85.0  # degrees C: degraded
    temp_crit: float = 92.0  # degrees C: unhealthy (drain before the GPU shuts itself down)
    temp_band: float = 5.0  # a temperature rule clears only this far below its limit
    ecc_corrected_burst: int = 100  # corrected ECC errors within one sample
    remap_rows_max: int = 8  # uncorrectable remapped rows: plan a replacement
    pcie_replay_burst: int = 100  # PCIe replays within one sample
    nvlink_burst: int = 50  # NVLink error counter increase within one sample
    xid64_repeat: int = 2  # XID 64 this many times within xid_window samples: replace
    xid_window: int = 3600
    straggler_clock: float = 0.75  # SM clock below this fraction of the peers' median
    straggler_util: float = 0.6  # utilisation below this fraction of the peers' median
    busy_util: float = 10.0  # a GPU at this utilisation or more is busy: judged for stragglers
    straggler_busy: float = 50.0  # only judge stragglers while the busy GPUs' median util is this
    straggler_min_gpus: int = 4  # and at least this many GPUs are busy


@dataclass(slots=True)
class GpuView:
    """What a rule sees of one GPU at one sample."""

    s: GpuSample
    prev: GpuSample | None
    median_clock: float | None  # over the node's busy GPUs (``is_busy``)
    median_util: float | None  # over the node's busy GPUs
    busy: int  # GPUs of the node busy in this sample
    xid_counts: dict[int, int]  # XIDs of this GPU within the window (only when s.xids)


Test = Callable[[GpuView, Limits], Evidence | None]


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    severity: Health
    action: Action
    reason: str
    fire: Test
    sustain: int = 1
    clear: int = 30
    hold: Test | None = None
    state: bool = False

    @property
    def latched(self) -> bool:
        return self.clear == 0


# NVIDIA's XID catalogue ends below 200; three digits leave room for the XIDs to come.
XID_MAX = 999


def valid_xid(code: object) -> bool:
    """``code`` can be an XID: an ``int`` from 1 to ``XID_MAX``. NVML hands each XID over
    as a 64-bit word, so nothing else bounds what a driver or a binding may send."""
    return type(code) is int and 1 <= code <= XID_MAX


class XidClass(NamedTuple):
    severity: Health
    action: Action
    reason: str


XIDS: dict[int, XidClass] = {
    # Application-level: the job crashed or misbehaved, the GPU is fine.
    13: XidClass(Health.healthy, "", "graphics engine exception (application fault)"),
    31: XidClass(Health.healthy, "", "GPU memory page fault (application fault)"),
    43: XidClass(Health.healthy, "", "GPU stopped processing (application killed or faulted)"),
    45: XidClass(Health.healthy, "", "preemptive cleanup after an earlier error"),
    68: XidClass(Health.healthy, "", "video processor exception (application fault)"),
    109: XidClass(Health.healthy, "", "context switch timeout (usually the application)"),
    # Hardware: the GPU needs attention.
    48: XidClass(Health.unhealthy, "reset", "double-bit ECC error"),
    63: XidClass(Health.degraded, "reset", "row remapping recorded: reset pending"),
    64: XidClass(Health.degraded, "reset", "row remapping failed to record"),
    74: XidClass(Health.unhealthy, "reset", "NVLink error"),
    79: XidClass(Health.unhealthy, "replace", "GPU has fallen off the bus"),
    94: XidClass(Health.unhealthy, "drain",
                 "contained ECC error: the application died; reset when drained"),
    95: XidClass(Health.unhealthy, "reset", "uncontained ECC error: every context is affected"),
    119: XidClass(Health.unhealthy, "reset", "GSP RPC timeout"),
    120: XidClass(Health.unhealthy, "reset", "GSP error"),
}


# -------------------------------------------------------------------------------- the tests


def _xid(code: int) -> Test:
    def test(v: GpuView, lim: Limits) -> Evidence | None:
        return {"xid": code} if code in v.s.xids else None

    return test


def _xid64_repeated(v: GpuView, lim: Limits) -> Evidence | None:
    n = v.xid_counts.get(64, 0)
    if 64 in v.s.xids and n >= lim.xid64_repeat:
        return {"xid": 64, "count": n, "window_samples": lim.xid_window}
    return None


def _xid_unknown(v: GpuView, lim: Limits) -> Evidence | None:
    unknown = [x for x in v.s.xids if x not in XIDS]
    return {"xids": unknown} if unknown else None


def _delta(v: GpuView, field: str) -> int:
    now, before = getattr(v.s, field), getattr(v.prev, field, None) if v.prev else None
    if now is None or before is None:
        return 0
    return max(0, now - before)  # a counter that went back (driver reload) is not an error


def _lost(v: GpuView, lim: Limits) -> Evidence | None:
    return {"lost": True} if v.s.lost else None


def _ecc_uncorrected(v: GpuView, lim: Limits) -> Evidence | None:
    n = v.s.ecc_volatile
    return {"ecc_volatile": n, "ecc_aggregate": v.s.ecc_aggregate} if n else None


def _ecc_corrected(v: GpuView, lim: Limits) -> Evidence | None:
    d = _delta(v, "ecc_corrected")
    return {"ecc_corrected_delta": d, "limit": lim.ecc_corrected_burst} \
        if d >= lim.ecc_corrected_burst else None


def _remap_failure(v: GpuView, lim: Limits) -> Evidence | None:
    return {"remap_failure": True} if v.s.remap_failure else None


def _remap_pending(v: GpuView, lim: Limits) -> Evidence | None:
    return {"remap_pending": True, "remap_uncorrectable": v.s.remap_uncorrectable} \
        if v.s.remap_pending else None


def _remap_rows(v: GpuView, lim: Limits) -> Evidence | None:
    n = v.s.remap_uncorrectable
    return {"remap_uncorrectable": n, "limit": lim.remap_rows_max} \
        if n is not None and n >= lim.remap_rows_max else None


def _pcie(v: GpuView, lim: Limits) -> Evidence | None:
    d = _delta(v, "pcie_replay")
    return {"pcie_replay_delta": d, "limit": lim.pcie_replay_burst} \
        if d >= lim.pcie_replay_burst else None


def _nvlink(v: GpuView, lim: Limits) -> Evidence | None:
    d = _delta(v, "nvlink_errors")
    return {"nvlink_errors_delta": d, "limit": lim.nvlink_burst} if d >= lim.nvlink_burst else None


def _throttle(mask: int, without: int = 0) -> Test:
    def test(v: GpuView, lim: Limits) -> Evidence | None:
        t = v.s.throttle
        if t and t & mask and not t & without:
            return {"throttle": t, "sm_clock": v.s.sm_clock, "temp": v.s.temp,
                    "power": v.s.power}
        return None

    return test


def _temp(limit: str, band: float = 0.0) -> Test:
    def test(v: GpuView, lim: Limits) -> Evidence | None:
        at = getattr(lim, limit) - (lim.temp_band if band else 0.0)
        t = v.s.temp
        return {"temp": t, "limit": getattr(lim, limit)} if t is not None and t >= at else None

    return test


def is_busy(s: GpuSample, lim: Limits) -> bool:
    """The GPU runs work in this sample: it reports a utilisation of ``busy_util`` or more.

    Utilisation (the share of the sample period a kernel ran) rather than memory in use:
    an inference worker waiting for requests keeps its model in memory while its clocks
    drop to idle, and it is no straggler.
    """
    return not s.lost and s.util is not None and s.util >= lim.busy_util


def _judged(v: GpuView, lim: Limits) -> bool:
    """A straggler rule judges this GPU: it is busy, among enough busy peers that are
    busy enough for their medians to mean something."""
    return (v.busy >= lim.straggler_min_gpus and v.median_util is not None
            and v.median_util >= lim.straggler_busy and is_busy(v.s, lim))


def _straggler(metric: str, slack: float = 0.0) -> Test:
    """``metric`` ("sm_clock" or "util") below its limit's fraction of the busy GPUs'
    median; ``slack`` loosens the fraction for holding an active rule."""
    median, limit = {"sm_clock": ("median_clock", "straggler_clock"),
                     "util": ("median_util", "straggler_util")}[metric]

    def test(v: GpuView, lim: Limits) -> Evidence | None:
        x, m = getattr(v.s, metric), getattr(v, median)
        if x is None or not m or not _judged(v, lim):
            return None
        if x < (getattr(lim, limit) + slack) * m:
            return {metric: x, "peers_median": m, "ratio": round(x / m, 3)}
        return None

    return test


# ------------------------------------------------------------------------------- the table

U, D = Health.unhealthy, Health.degraded

RULES: tuple[Rule, ...] = (
    *(Rule(f"xid-{code}", c.severity, c.action, f"XID {code}: {c.reason}", _xid(code), clear=0)
      for code, c in XIDS.items() if c.severity != Health.healthy),
    Rule("xid-64-repeated", U, "replace", "XID 64 repeated: row remapping keeps failing",
         _xid64_repeated, clear=0),
    Rule("xid-unknown", D, "", "an XID outside the catalogue", _xid_unknown, clear=300),
    Rule("gpu-lost", U, "replace", "GPU fell off the bus (NVML: GPU is lost)", _lost, clear=0,
         state=True),
    Rule("ecc-uncorrected", U, "reset", "uncorrectable ECC errors since the last reset",
         _ecc_uncorrected, clear=0, state=True),
    Rule("ecc-corrected-burst", D, "", "a burst of corrected ECC errors", _ecc_corrected),
    Rule("remap-failure", U, "replace", "row remapping failed: no spare rows left",
         _remap_failure, clear=0, state=True),
    Rule("remap-pending", D, "reset", "remapped rows take effect at the next GPU reset",
         _remap_pending, clear=3),
    Rule("remap-rows-high", D, "replace", "many uncorrectable remapped rows", _remap_rows,
         clear=3),
    Rule("pcie-replay-burst", D, "", "PCIe replays: a marginal link", _pcie),
    Rule("nvlink-errors", D, "reset", "NVLink error counters rising", _nvlink),
    Rule("thermal-throttle", D, "", "sustained thermal slowdown",
         _throttle(SW_THERMAL | HW_THERMAL), sustain=10),
    Rule("power-brake", D, "", "sustained power-brake slowdown (external power signal)",
         _throttle(HW_POWER_BRAKE), sustain=10),
    Rule("hw-slowdown", D, "", "sustained hardware slowdown",
         _throttle(HW_SLOWDOWN, without=HW_THERMAL | HW_POWER_BRAKE), sustain=10),
    Rule("temp-high", D, "", "temperature above the warning limit", _temp("temp_warn"),
         sustain=5, clear=10, hold=_temp("temp_warn", band=1)),
    Rule("temp-critical", U, "drain", "temperature above the critical limit",
         _temp("temp_crit"), sustain=3, hold=_temp("temp_crit", band=1)),
    Rule("straggler-clock", D, "drain", "SM clock well below the node's other GPUs",
         _straggler("sm_clock"), sustain=10, hold=_straggler("sm_clock", 0.1)),
    Rule("straggler-util", D, "drain", "utilisation well below the node's other GPUs",
         _straggler("util"), sustain=10, hold=_straggler("util", 0.1)),
)

BY_NAME: dict[str, Rule] = {r.name: r for r in RULES}
XID_RULES = frozenset(r.name for r in RULES if r.name.startswith("xid-"))
