"""Health rules and hysteresis on simulated GPUs: pure, sample by sample, no bus."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.cluster_agent import faults
from tandem.cluster_agent.backend import AgentDeath
from tandem.cluster_agent.health import Tracker
from tandem.cluster_agent.rules import RULES, XIDS
from tandem.cluster_agent.service import AgentSettings
from tandem.cluster_agent.sim import SimBackend
from tandem.common.errors import SettingsError
from tandem.common.events import GpuSample, Health
from tandem.common.settings import load

FAULT_AT = 5


def run(script: str, samples: int, gpus: int = 8, load_: float = 0.95, seed: int = 7
        ) -> list[tuple[int, Health, list[str]]]:
    """Drive a sim node through ``samples`` 1-second samples; return each health change."""
    sim = SimBackend(gpus=gpus, load=load_, faults=faults.parse(script), seed=seed)
    sim.open(0.0)
    tracker = Tracker()
    health, out = Health.healthy, []
    for t in range(1, samples + 1):
        tracker.observe(sim.sample(float(t)), float(t))
        if tracker.health != health:
            health = tracker.health
            out.append((t, health, tracker.active()))
    return out


# (script, expected health, rule that must be active, samples allowed after the fault)
FAULTS = [
    *[(f"{FAULT_AT} xid gpu=1 code={c}", Health.unhealthy, f"xid-{c}@1", 1)
      for c in (48, 74, 79, 94, 95, 119, 120)],
    (f"{FAULT_AT} xid gpu=2 code=63", Health.degraded, "xid-63@2", 1),
    (f"{FAULT_AT} xid gpu=2 code=64", Health.degraded, "xid-64@2", 1),
    (f"{FAULT_AT} xid gpu=2 code=64; {FAULT_AT + 3} xid gpu=2 code=64", Health.unhealthy,
     "xid-64-repeated@2", 4),
    (f"{FAULT_AT} xid gpu=0 code=500", Health.degraded, "xid-unknown@0", 1),
    (f"{FAULT_AT} ecc gpu=3 count=1", Health.unhealthy, "ecc-uncorrected@3", 1),
    (f"{FAULT_AT} ecc-corrected gpu=3 count=500", Health.degraded, "ecc-corrected-burst@3", 1),
    (f"{FAULT_AT} remap-failure gpu=3", Health.unhealthy, "remap-failure@3", 1),
    (f"{FAULT_AT} thermal gpu=4", Health.degraded, "thermal-throttle@4", 12),
    (f"{FAULT_AT} thermal gpu=4 temp=97", Health.unhealthy, "temp-critical@4", 15),
    (f"{FAULT_AT} power-brake gpu=5", Health.degraded, "power-brake@5", 12),
    (f"{FAULT_AT} slow gpu=6 factor=0.5", Health.degraded, "straggler-clock@6", 12),
    (f"{FAULT_AT} off-bus gpu=7", Health.unhealthy, "gpu-lost@7", 1),
    (f"{FAULT_AT} nvlink gpu=0 count=200", Health.degraded, "nvlink-errors@0", 1),
    (f"{FAULT_AT} pcie-replay gpu=0 count=500", Health.degraded, "pcie-replay-burst@0", 1),
]


@pytest.mark.parametrize(("script", "health", "rule", "bound"), FAULTS,
                         ids=[f[0].split(" ", 1)[1] for f in FAULTS])
def test_each_scripted_fault_produces_its_transition_within_a_bounded_number_of_samples(
        script: str, health: Health, rule: str, bound: int) -> None:
    changes = run(script, FAULT_AT + bound + 5)
    assert changes, f"{script!r} produced no transition"
    _, first, active = changes[-1]
    assert first == health, changes
    assert rule in active, changes
    reached = next(t for t, h, _ in changes if h == health)
    assert FAULT_AT <= reached <= FAULT_AT + bound, changes


@pytest.mark.parametrize("code", sorted(c for c, x in XIDS.items() if x.severity == "healthy"))
def test_application_xids_never_mark_the_node(code: int) -> None:
    assert XIDS[code].severity == Health.healthy
    assert run(f"{FAULT_AT} xid gpu=0 code={code} count=5", 40) == []


def test_a_fault_that_ends_recovers_once_after_the_clear_window_without_flapping() -> None:
    changes = run(f"{FAULT_AT} power-brake gpu=1 duration=40", 150)
    assert [h for _, h, _ in changes] == [Health.degraded, Health.healthy]
    recovered = changes[1][0]
    assert recovered == FAULT_AT + 40 - 1 + 30  # clean from t=45: the 30-sample clear window


def test_latched_faults_stay_until_undrain_clears_them() -> None:
    sim = SimBackend(gpus=4, load=0.95, faults=faults.parse("2 xid gpu=0 code=79"), seed=1)
    sim.open(0.0)
    tracker = Tracker()
    for t in range(1, 500):
        tracker.observe(sim.sample(float(t)), float(t))
    assert tracker.health == Health.unhealthy
    cleared = tracker.clear_latched(500.0)
    assert [c.key for c in cleared] == ["xid-79@0"]
    assert tracker.health == Health.healthy


@pytest.mark.parametrize(("script", "kept"), [
    ("2 off-bus gpu=1", "gpu-lost@1"),
    ("2 ecc gpu=1 count=2; 2 xid gpu=1 code=48", "ecc-uncorrected@1"),
    ("2 remap-failure gpu=1; 2 xid gpu=1 code=64", "remap-failure@1"),
])
def test_an_undrain_keeps_a_state_fault_the_gpu_still_shows_and_clears_its_xid(
        script: str, kept: str) -> None:
    sim = SimBackend(gpus=4, load=0.95, faults=faults.parse(script), seed=1)
    sim.open(0.0)
    tracker = Tracker()
    for t in range(1, 6):
        tracker.observe(sim.sample(float(t)), float(t))
    xid = next(k for k in tracker.active() if k.startswith("xid-"))
    cleared = tracker.clear_latched(6.0)
    assert [c.key for c in cleared] == [xid]  # the event: the operator's word clears it
    assert kept in tracker.active()
    assert tracker.health == Health.unhealthy  # never healthy while the GPU shows it
    for t in range(6, 10):
        assert tracker.observe(sim.sample(float(t)), float(t)) == []
    assert kept in tracker.active() and xid not in tracker.active()


def test_an_undrain_clears_a_state_fault_the_gpu_no_longer_shows() -> None:
    tracker = Tracker()
    tracker.observe([GpuSample(index=0, ecc_volatile=2)], 1.0)
    tracker.observe([GpuSample(index=0, ecc_volatile=0)], 2.0)  # the GPU was reset
    assert tracker.active() == ["ecc-uncorrected@0"]  # latched: only an undrain clears it
    assert [c.key for c in tracker.clear_latched(3.0)] == ["ecc-uncorrected@0"]
    assert tracker.health == Health.healthy


@pytest.mark.parametrize("before", ["restored at start, no sample yet", "shown by the last sample"])
@pytest.mark.parametrize("still_lost", [True, False])
def test_a_state_fault_an_undrain_kept_is_judged_once_more_by_the_next_sample(
        before: str, still_lost: bool) -> None:
    tracker = Tracker()
    if before.startswith("restored"):
        tracker.restore(["gpu-lost@1", "xid-79@1"], 0.0)
    else:
        tracker.observe([GpuSample(index=0), GpuSample(index=1, lost=True, xids=[79])], 0.0)
    assert [c.key for c in tracker.clear_latched(0.5)] == ["xid-79@1"]
    assert tracker.active() == ["gpu-lost@1"]

    changes = tracker.observe([GpuSample(index=0), GpuSample(index=1, lost=still_lost)], 1.0)
    if still_lost:  # latched again: a later sample without it does not clear it
        assert changes == []
        assert tracker.observe([GpuSample(index=0), GpuSample(index=1)], 2.0) == []
        assert tracker.active() == ["gpu-lost@1"]
    else:  # reset just after the sample the undrain judged: the undrain stands
        assert [(c.key, c.fired) for c in changes] == [("gpu-lost@1", False)]
        assert tracker.health == Health.healthy


def test_temperature_hovering_at_the_limit_fires_once_and_does_not_flap() -> None:
    tracker = Tracker()
    health = []
    for t in range(200):
        temp = 84.0 if t % 3 == 2 else 86.0  # straddles the 85 °C warning limit
        tracker.observe([GpuSample(index=0, temp=temp)], float(t))
        health.append(tracker.health)
    flips = sum(1 for a, b in itertools.pairwise(health) if a != b)
    assert flips == 1 and health[-1] == Health.degraded


def test_a_slow_gpu_is_no_straggler_while_its_peers_are_idle() -> None:
    assert run(f"{FAULT_AT} slow gpu=1 factor=0.5", 60, load_=0.0) == []


GIB = 1 << 30


def busy(i: int, sm: int = 1970, util: float = 95.0) -> GpuSample:
    return GpuSample(index=i, util=util, sm_clock=sm, mem_used=60 * GIB, mem_total=80 * GIB,
                     throttle=0)


def unused(i: int) -> GpuSample:  # a slot a partial-node job leaves unused
    return GpuSample(index=i, util=0.0, sm_clock=345, mem_used=GIB // 2, mem_total=80 * GIB,
                     throttle=0x1)


def waiting(i: int) -> GpuSample:  # an inference worker waiting for requests, model loaded
    return GpuSample(index=i, util=0.0, sm_clock=345, mem_used=30 * GIB, mem_total=80 * GIB,
                     throttle=0x1)


STRAGGLERS = {
    "5 busy, 3 unused": ([busy(i) for i in range(5)] + [unused(i) for i in range(5, 8)], []),
    "5 busy, 1 unused, 2 workers waiting": (
        [busy(i) for i in range(5)] + [unused(5), waiting(6), waiting(7)], []),
    "5 busy, one at half clock, 3 unused": (
        [busy(i, sm=985 if i == 2 else 1970) for i in range(5)] + [unused(i) for i in (5, 6, 7)],
        ["straggler-clock@2"]),
    "8 busy, one at half clock": ([busy(i, sm=985 if i == 3 else 1970) for i in range(8)],
                                  ["straggler-clock@3"]),
    "8 busy, one starved at 30 % util": ([busy(i, util=30.0 if i == 5 else 95.0)
                                          for i in range(8)], ["straggler-util@5"]),
    "8 busy, all at half clock": ([busy(i, sm=985) for i in range(8)], []),
    "3 busy, one at a third of the clock, 5 unused": (
        [busy(i, sm=660 if i == 0 else 1970) for i in range(3)] + [unused(i) for i in range(3, 8)],
        []),
    "3-GPU node, one at a third of the clock": (
        [busy(i, sm=660 if i == 0 else 1970) for i in range(3)], []),
}


@pytest.mark.parametrize("node", list(STRAGGLERS))
def test_stragglers_are_judged_only_among_busy_gpus(node: str) -> None:
    samples, expected = STRAGGLERS[node]
    tracker = Tracker()
    for t in range(40):
        tracker.observe(samples, float(t))
    assert tracker.active() == expected


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), load_=st.sampled_from([0.0, 0.3, 0.95, 1.0]))
def test_noisy_healthy_gpus_never_transition(seed: int, load_: float) -> None:
    assert run("", 900, load_=load_, seed=seed) == []


def test_agent_die_fault_raises_at_its_time() -> None:
    sim = SimBackend(gpus=2, faults=faults.parse("3 agent-die"))
    sim.open(100.0)
    sim.sample(101.0)
    sim.sample(102.0)
    with pytest.raises(AgentDeath):
        sim.sample(103.0)


def test_every_rule_states_its_reason_and_a_known_action() -> None:
    for rule in RULES:
        assert rule.reason and rule.action in ("", "drain", "reset", "replace"), rule.name
        assert rule.severity in (Health.degraded, Health.unhealthy), rule.name
        assert rule.latched or not rule.state, rule.name  # only a latched rule waits for undrain


@pytest.mark.parametrize(("script", "message"), [
    ("10 xid gpu=0", "line 1 ('10 xid gpu=0'): xid needs code"),
    ("1 thermal gpu=0\n2 meltdown gpu=1", "line 2 ('2 meltdown gpu=1'): Invalid enum value"),
    ("1 slow gpu=zero", "line 1 ('1 slow gpu=zero'): Expected `int`"),
    ("1 slow gpu=0 factor=3", "line 1 ('1 slow gpu=0 factor=3'): factor must be in (0, 1]"),
    ("1 slow gpu=0 bogus", "line 1 ('1 slow gpu=0 bogus'): expected key=value, got 'bogus'"),
    ("[1, 2]", "item 1 of the JSON list: expected an object"),
    # A NaN time sorts first and would block every later fault.
    ("nan xid gpu=0 code=79; 5 xid gpu=1 code=48",
     "line 1 ('nan xid gpu=0 code=79'): at must be a finite number of seconds >= 0, got nan"),
    ("1 xid gpu=0 code=48; inf xid gpu=0 code=79", "line 2 ('inf xid gpu=0 code=79'): at must"),
    ("1 slow gpu=0 duration=nan", "duration must be > 0 seconds, got nan"),
    ("1 thermal gpu=0 temp=nan", "temp must be in [0, 150] degrees C, got nan"),
    ("1 thermal gpu=0 temp=1e308", "temp must be in [0, 150] degrees C, got 1e+308"),
    ("1 thermal gpu=0 temp=-500", "temp must be in [0, 150] degrees C, got -500.0"),
    ("1 xid gpu=0 code=79 count=1000000000", "count must be in 1..1024, got 1000000000"),
    # An XID is a small number: one no XID can have is a typo, not an unknown XID.
    ("1 xid gpu=0 code=31337", "line 1 ('1 xid gpu=0 code=31337'): xid needs code=<XID "
     "number>, 1 to 999, got 31337"),
    ('[{"at": 1, "kind": "xid", "code": 18446744073709551615}]',
     "item 1 of the JSON list: xid needs code=<XID number>, 1 to 999, got 18446744073709551615"),
    ('{"at": 1, "kind": "xid", "code": 79}', "fault script: a JSON script is a list of faults"),
    ('[{"at": 1, "kind": "xid", "code": 79}, {"at": NaN, "kind": "xid", "code": 48}]',
     "item 2 of the JSON list: at must be a finite number"),
])
def test_a_bad_fault_script_is_refused_naming_the_line_and_field(script: str,
                                                                  message: str) -> None:
    with pytest.raises(faults.FaultScriptError) as err:
        faults.parse(script)
    assert message in str(err.value)


def test_a_bad_fault_script_in_settings_names_the_variable() -> None:
    with pytest.raises(SettingsError) as err:
        load(AgentSettings, sim_gpus=2, sim_faults="5 off-bus gpu=3")
    assert "TANDEM_SIM_FAULTS" in err.value.problems
    assert "gpu 3" in err.value.problems["TANDEM_SIM_FAULTS"]


def test_a_fault_script_file_and_json_parse_alike(tmp_path: Path) -> None:
    path = tmp_path / "faults.txt"
    path.write_text("# a comment\n10s xid gpu=1 code=79   # trailing\n\n"
                    "30 thermal gpu=2 duration=5\n")
    from_file = faults.load(str(path))
    from_json = faults.load('[{"at": 30, "kind": "thermal", "gpu": 2, "duration": 5},'
                            ' {"at": 10, "kind": "xid", "gpu": 1, "code": 79}]')
    assert from_file == from_json
    assert [f.kind for f in from_file] == ["xid", "thermal"]
