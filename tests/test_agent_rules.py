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
    (f"{FAULT_AT} xid gpu=0 code=31337", Health.degraded, "xid-unknown@0", 1),
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


@pytest.mark.parametrize(("script", "message"), [
    ("10 xid gpu=0", "line 1: xid needs code"),
    ("1 thermal gpu=0\n2 meltdown gpu=1", "line 2: Invalid enum value 'meltdown'"),
    ("1 slow gpu=zero", "line 1: Expected `int`"),
    ("1 slow gpu=0 factor=3", "line 1: factor must be in (0, 1]"),
    ("1 slow gpu=0 bogus", "line 1: expected key=value, got 'bogus'"),
    ("[1, 2]", "line 1: expected an object"),
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
