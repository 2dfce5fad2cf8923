"""Run configs across versions (a rolling upgrade, docs/bus-api.md "versioning"): what is
stored or relayed holds only the fields set, so an older reader takes it; a stored or
relayed config with a newer version's fields is run without them, naming them; a
submission with a field this version does not know is still refused, naming it.

The coordinator and the rank are real processes on a real nats-server; the doors are the
gateway's HTTP app and its job service on NATS.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from tandem.common import subjects
from tandem.common.bus import Bus
from tandem.common.errors import InvalidRunConfig
from tandem.common.events import RunRecord, RunState, TrainStatus
from tandem.common.runs import (
    RunConfig,
    get_run,
    parse_run_config,
    parse_stored_run_config,
    submit_run,
)
from tandem.common.streams import KV_RUNS, core_streams
from tandem.gateway.jobs import JobService
from tandem.trainer.spec import LaunchSpec
from tests import test_gateway, test_gateway_faults
from tests.conftest import PYTHON
from tests.test_train_runs import tiny, until
from tests.test_trainer_lifecycle import Env, env  # noqa: F401 (fixture)

gw, http = test_gateway.gw, test_gateway.http  # one gateway on real servers, both doors
jobs = test_gateway_faults.jobs
pytestmark = [pytest.mark.timeout(300)]
DEADLINE = 150.0

# What a newer version could write: a field at the top and one inside a spec.
NEWER = {"from_a_newer_version": {"on": True}, "faults": {"a_newer_fault_at_step": 1}}


def newer(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as a newer version stores it, with fields this version does not know."""
    return {**config, **NEWER, "faults": {**config.get("faults", {}), **NEWER["faults"]}}


async def test_a_submitted_run_is_stored_without_its_defaults_and_reads_back_the_same(
        bus: Bus, uid: str) -> None:
    """Every default used to be stored, so a field added since (a default of None) was in
    every record, and an older coordinator refused every run a newer gateway recorded."""
    await bus.provision(core_streams())
    run = f"r{uid}"
    sent = {"run_id": run, "steps": 1000, "lr": 1e-3, "model": {"kind": "dit"},
            "data": {"kind": "synthetic"}, "watchdog": {"max_restarts": 2},
            "faults": {"fail_checkpoint_write_at_step": None}}  # these two at their default
    rec = await submit_run(bus, sent)
    stored = (await get_run(bus, run)).config
    assert stored == rec.config == {"run_id": run, "lr": 1e-3, "model": {"kind": "dit"},
                                    "data": {"kind": "synthetic"},
                                    "watchdog": {"max_restarts": 2}}
    assert parse_stored_run_config(json.loads(json.dumps(stored))) == (
        parse_run_config(sent), [])
    again = await submit_run(bus, sent)  # idempotent still
    assert again.config == stored

    # A record an earlier version wrote holds every field: the same config resubmitted is
    # the same run, not a clash.
    full = parse_run_config({**sent, "run_id": f"f{uid}"})
    kv = await bus.typed(KV_RUNS, RunRecord)
    await kv.create(f"f{uid}", RunRecord(run_id=f"f{uid}", config=full.model_dump(mode="json")))
    assert (await submit_run(bus, full.model_dump(mode="json"))).run_id == f"f{uid}"


def test_a_stored_config_with_a_newer_versions_fields_is_read_without_them_naming_them(
) -> None:
    config = tiny("r1", faults={"crash_at_step": 3})
    cfg, unknown = parse_stored_run_config(newer(config))
    assert cfg == parse_run_config(config)
    assert unknown == ["faults.a_newer_fault_at_step", "from_a_newer_version"]
    # Only what it does not know is left out: a bad value is still refused, named.
    with pytest.raises(InvalidRunConfig) as exc:
        parse_stored_run_config(newer({**config, "steps": 0}))
    assert set(exc.value.problems) == {"steps"}
    # A submission is a request: the same fields are refused, named.
    with pytest.raises(InvalidRunConfig) as exc:
        parse_run_config(newer(config))
    assert set(exc.value.problems) == {"faults.a_newer_fault_at_step", "from_a_newer_version"}


async def test_a_submission_with_a_field_this_version_does_not_know_is_422_at_both_doors(
        http: httpx.AsyncClient, jobs: JobService, bus: Bus, uid: str) -> None:
    """Stored configs are read leniently; requests are not (docs/bus-api.md)."""
    body = newer({"run_id": f"r{uid}", "steps": 5})
    r = await http.post("/v1/training-runs", json=body)
    assert r.status_code == 422, r.text
    locs = {tuple(p["loc"]) for p in r.json()["detail"]}
    assert locs == {("body", "from_a_newer_version"), ("body", "faults", "a_newer_fault_at_step")}
    msg = await bus.nc.request(subjects.jobs("train"), json.dumps(body).encode(), timeout=30)
    assert (msg.headers or {}).get("Nats-Service-Error-Code") == "422"
    locs = {tuple(p["loc"]) for p in json.loads(msg.data)["detail"]}
    assert locs == {("body", "from_a_newer_version"), ("body", "faults", "a_newer_fault_at_step")}
    assert (await http.get(f"/v1/training-runs/r{uid}")).status_code == 404  # nothing stored

    # A run's view still shows its whole config, defaults too, though only what was set
    # is stored.
    r = await http.post("/v1/training-runs", json={"run_id": f"v{uid}", "steps": 5})
    assert r.status_code == 202, r.text
    view = (await http.get(f"/v1/training-runs/v{uid}")).json()
    assert view["config"] == RunConfig(run_id=f"v{uid}", steps=5).model_dump(mode="json")


async def test_a_stored_run_with_a_newer_versions_fields_is_run_and_its_ranks_get_no_defaults(
        env: Env) -> None:  # noqa: F811 (fixture)
    """A record as a newer gateway writes it: the coordinator used to fail the run at once
    (``invalid run config``). Its ranks' launch spec holds only what was set, which a rank
    of an older version (its node agent not yet upgraded) reads."""
    run = f"newer-{env.cluster}"
    config = newer(tiny(run, cluster=env.cluster, ranks=1, steps=2, checkpoint_every=2))
    kv = await env.bus.typed(KV_RUNS, RunRecord)
    await kv.create(run, RunRecord(run_id=run, config=config, state=RunState.pending))
    await env.bus.publish(subjects.train(run, "status"), TrainStatus(
        run_id=run, state=RunState.pending, reason="submitted"), msg_id=f"{run}-pending")
    env.coordinator()
    rec = await until(env.bus, run, lambda r: r.state.terminal, timeout=DEADLINE)
    assert rec.state == RunState.succeeded and rec.latest_step == 2, rec
    assert rec.config == config  # the record keeps what it was written with
    logged = [json.loads(line) for line in (env.root / "trainer.log").read_text().splitlines()
              if "trainer.config_fields_unknown" in line]
    assert logged and logged[0]["fields"] == ["faults.a_newer_fault_at_step",
                                              "from_a_newer_version"]
    spec = json.loads((env.root / "work" / run / "attempt-1" / "launch.json").read_bytes())
    assert spec["config"] == parse_stored_run_config(config)[0].stored()
    assert "lr" not in spec["config"] and "faults" not in spec["config"]


def test_a_rank_runs_a_launch_spec_with_a_newer_versions_fields(tmp_path: Path) -> None:
    """A newer coordinator's launch spec, read by this version's rank (its node agent
    not yet upgraded): the rank trains without those fields and names them once."""
    config = newer(tiny("r1", ranks=1, steps=2, checkpoint_every=2))
    spec = LaunchSpec(run_id="r1", attempt=1, config=config,
                      checkpoint_root=str(tmp_path / "ckpt"), attempt_dir=str(tmp_path / "a1"))
    path = tmp_path / "launch.json"
    path.write_bytes(msgspec.json.encode(spec))
    one = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "TANDEM_NODE": "n0"}  # torchrun's variables, one rank
    done = subprocess.run([PYTHON, "-m", "tandem.trainer.rank", str(path)], env=one,
                          capture_output=True, text=True, timeout=DEADLINE)
    assert done.returncode == 0, done.stderr[-3000:]
    named = [line for line in done.stderr.splitlines() if "does not know" in line]
    assert len(named) == 1, done.stderr[-3000:]
    assert "faults.a_newer_fault_at_step, from_a_newer_version" in named[0]


def test_the_views_of_a_run_fill_in_the_defaults_its_record_does_not_store() -> None:
    """A record holds only what the run set: its status line and the dashboard's progress
    bar still show the run's 1000 steps and its restart limit, not 0 and '?'."""
    from tandem.cli.train import render_status
    from tandem.gateway.observe import filled

    cfg = parse_run_config({"run_id": "r1", "ranks": 1})
    rec = RunRecord(run_id="r1", config=cfg.stored(), latest_step=10)
    assert "steps" not in rec.config  # left at its default
    text = render_status(rec)
    assert f"10/{cfg.steps}" in text and f"restarts 0/{cfg.watchdog.max_restarts}" in text
    assert filled(rec.config)["steps"] == cfg.steps
