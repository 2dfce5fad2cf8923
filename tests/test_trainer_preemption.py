"""A training run told to stop (SIGTERM: a rolling upgrade, a spot node reclaimed) saves
first and resumes where it stopped, against a real nats-server, a real coordinator
(``python -m tandem.trainer``) and real torchrun ranks.

- LAUNCHER=local: one node's torchrun gets SIGTERM mid-run, between periodic checkpoints
  (it passes the signal on to its rank): every rank checkpoints the step they agree on,
  the next attempt resumes from it, and the run, allowed no restart, succeeds.
- LAUNCHER=nodes: one node's agent gets SIGTERM (its pod replaced): the same, and the
  agent reports its torchrun's exit itself (the coordinator never waits for its silence).
- A rank killed outright (SIGKILL) is still a failure: counted, and resumed from the
  last periodic checkpoint.

Every wait is on a KV update, a stream event or a process exit, with a deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tandem.common.errors import SettingsError
from tandem.common.events import RunRecord, RunState, TrainStatus, TrainStep
from tandem.common.runs import submit_run
from tandem.common.settings import load
from tandem.trainer.service import TrainerSettings
from tests.conftest import PYTHON, service_env
from tests.test_train_runs import TINY_DIT, events_of, tiny, until
from tests.test_trainer_lifecycle import Env, env  # noqa: F401 (fixture)

pytestmark = [pytest.mark.timeout(300)]
DEADLINE = 150.0


def agent(e: Env, node: str) -> subprocess.Popen[bytes]:
    """A node agent of ``node``, sharing the coordinator's checkpoint folder (one host)."""
    config = service_env(nats_url=e.nats.url, cluster=e.cluster, node=node,
                         trainer_role="node", checkpoint_root=str(e.root / "ckpt"),
                         work_root=str(e.root / "nodes" / node), orphan_after_s="30")
    with open(e.root / f"agent-{node}.log", "ab") as out:
        proc = subprocess.Popen([PYTHON, "-m", "tandem.trainer"], env=config, stdout=out,
                                stderr=subprocess.STDOUT)
    e.procs.append(proc)
    return proc


def long_run(run_id: str, cluster: str, **over: Any) -> dict[str, Any]:
    """Two ranks on n0 and n1 (rank 1 slowed, so the test acts mid-run), every step an
    event; periodic checkpoints far apart unless ``over`` says otherwise."""
    return tiny(run_id, **{"cluster": cluster, "nodes": ["n0", "n1"], "steps": 30,
                           "checkpoint_every": 1000, "step_event_every": 1,
                           "faults": {"slow_rank": 1, "slow_s": 0.1}, **over})


async def training(e: Env, run_id: str, past: int) -> tuple[RunRecord, dict[str, int]]:
    """The record once attempt 1 has trained past step ``past``, and its ranks' pids by
    node."""
    rec = await until(e.bus, run_id, lambda r: r.latest_step > past and len(r.ranks) == 2,
                      timeout=DEADLINE)
    assert rec.attempt == 1, rec
    return rec, {str(x["node"]): int(x["pid"]) for x in rec.ranks}


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


async def adopted_and_finished(e: Env, run: str,
                               **settings: str) -> tuple[list[str], dict[int, int]]:
    """A new coordinator (``settings``) adopts ``run``, which must succeed with no
    restart counted; the reasons of its ``restarting`` statuses and the first step each
    attempt trained. Any launcher's (the nodes one's test uses it too)."""
    e.coordinator(**settings)
    rec = await until(e.bus, run, lambda r: r.state.terminal, timeout=DEADLINE)
    assert rec.state == RunState.succeeded and rec.restarts == 0, rec
    assert [i["kind"] for i in rec.incidents] == ["coordinator_restart"], rec.incidents
    evs = await events_of(e.bus, run)
    reasons = [ev.reason for ev in evs if isinstance(ev, TrainStatus)
               and ev.state == RunState.restarting]
    first: dict[int, int] = {}
    for ev in evs:
        if isinstance(ev, TrainStep):
            first.setdefault(ev.attempt, ev.step)
    return reasons, first


async def preempted_and_resumed(e: Env, run_id: str, seen: int) -> dict[str, Any]:
    """The run's end, its preemption incident and the first step each attempt trained;
    checks what every preemption must show."""
    rec = await until(e.bus, run_id, lambda r: r.state.terminal, timeout=DEADLINE)
    evs = await events_of(e.bus, run_id)
    assert rec.state == RunState.succeeded, rec
    assert rec.restarts == 0, "a preemption counted against max_restarts"
    [incident] = rec.incidents
    assert incident["kind"] == "preempted" and incident["node"] == "n1", incident
    step = incident["checkpoint_step"]
    # The step the ranks were at when told (or later), not a periodic one (every 1000).
    assert step is not None and step >= seen, (incident, seen)
    assert incident["resume_from"] == step
    assert f"preempted: node n1 stopping; checkpointed at step {step}" in incident["reason"]
    restarting = [ev for ev in evs if isinstance(ev, TrainStatus)
                  and ev.state == RunState.restarting]
    assert restarting and restarting[0].reason == incident["reason"]
    first: dict[int, int] = {}
    for ev in evs:
        if isinstance(ev, TrainStep):
            first.setdefault(ev.attempt, ev.step)
    # Nothing lost: attempt 2 trained on from the step after the checkpoint.
    assert first == {1: 1, 2: step + 1}, first
    assert (e.root / "ckpt" / run_id / f"step-{step}" / "manifest.json").is_file()
    return incident


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
async def test_a_run_whose_torchrun_gets_sigterm_checkpoints_where_it_is_and_resumes_there(
        env: Env, parallelism: str) -> None:  # noqa: F811 (fixture)
    """LAUNCHER=local. torchrun of n1 passes SIGTERM on to its rank; both ranks (n0's got
    nothing) stop at one step and save it (``fsdp``: each rank its shards, committed
    once). ``max_restarts`` 0: not counted."""
    env.coordinator()
    run = f"sigterm-torchrun-{parallelism}"
    model = {"model": TINY_DIT} if parallelism == "fsdp" else {}
    await submit_run(env.bus, long_run(run, env.cluster, parallelism=parallelism, **model,
                                       watchdog={"max_restarts": 0, "backoff_s": 0.2,
                                                 "hang_floor_s": 120,
                                                 "startup_timeout_s": 200}))
    rec, pids = await training(env, run, 3)
    torchrun = parent(pids["n1"])
    os.kill(torchrun, signal.SIGTERM)
    incident = await preempted_and_resumed(env, run, rec.latest_step)
    assert incident["nodes"] == ["n1"]  # only n1's rank got the signal


async def test_a_node_agent_stopped_lets_its_ranks_save_and_reports_their_exit_itself(
        env: Env) -> None:  # noqa: F811 (fixture)
    """LAUNCHER=nodes, one agent per node. n1's agent gets SIGTERM (its pod replaced):
    its ranks save, it reports torchrun's exit and exits 0; a new agent takes n1 and
    the run resumes from that step. The coordinator gives a silent agent up only after
    10 minutes here: the attempt ended on the agent's own report."""
    agents = {n: agent(env, n) for n in ("n0", "n1")}
    env.coordinator(launcher="nodes", agent_lost_after_s="600")
    run = "sigterm-agent"
    await submit_run(env.bus, long_run(run, env.cluster, watchdog={
        "max_restarts": 0, "backoff_s": 0.2, "hang_floor_s": 120, "startup_timeout_s": 200}))
    rec, _ = await training(env, run, 3)
    agents["n1"].terminate()
    assert await asyncio.to_thread(agents["n1"].wait, DEADLINE) == 0
    agent(env, "n1")  # the replacement, as the DaemonSet brings it
    incident = await preempted_and_resumed(env, run, rec.latest_step)
    assert incident["exit_codes"].get("n1") is not None, incident  # reported, not lost


async def test_a_local_coordinator_stopped_lets_its_ranks_save_for_the_one_that_adopts(
        env: Env) -> None:  # noqa: F811 (fixture)
    """LAUNCHER=local: a coordinator's SIGTERM asks its torchruns to stop (rather than
    killing them), waits for the checkpoint, and exits 0; the coordinator that adopts the
    run resumes from that step."""
    first = env.coordinator()
    run = "sigterm-coordinator"
    await submit_run(env.bus, long_run(run, env.cluster, watchdog={
        "max_restarts": 0, "backoff_s": 0.2, "hang_floor_s": 120, "startup_timeout_s": 200}))
    rec, _ = await training(env, run, 3)
    first.terminate()
    assert await asyncio.to_thread(first.wait, DEADLINE) == 0
    stopped = await until(env.bus, run, lambda r: r.state == RunState.restarting,
                          timeout=DEADLINE)
    written = sorted(int(p.name.split("-")[1]) for p in (env.root / "ckpt" / run).glob("step-*"))
    assert len(written) == 1, f"checkpoints written before the coordinator went: {written}"
    saved = written[0]
    assert saved >= rec.latest_step
    reasons, first_steps = await adopted_and_finished(env, run)
    assert f"coordinator stopping (ranks checkpointed at step {saved})" in reasons[0], reasons
    assert first_steps == {1: 1, 2: saved + 1}, (first_steps, stopped.latest_step)


async def test_a_rank_killed_outright_is_still_a_counted_restart_from_the_last_checkpoint(
        env: Env) -> None:  # noqa: F811 (fixture)
    """SIGKILL gives a rank no say: the attempt fails (counted) and resumes from the
    newest periodic checkpoint, as before any of this."""
    env.coordinator()
    run = "sigkill-rank"
    await submit_run(env.bus, long_run(run, env.cluster, checkpoint_every=3, watchdog={
        "max_restarts": 1, "backoff_s": 0.2, "hang_floor_s": 120, "startup_timeout_s": 200}))
    rec, pids = await training(env, run, 4)
    os.kill(pids["n1"], signal.SIGKILL)
    rec = await until(env.bus, run, lambda r: r.state.terminal, timeout=DEADLINE)
    assert rec.state == RunState.succeeded, rec
    assert rec.restarts == 1
    [incident] = rec.incidents
    assert incident["kind"] == "rank_exit", incident
    assert incident["resume_from"] % 3 == 0 and incident["resume_from"] >= 3, incident


def test_a_stop_checkpoint_bound_the_drain_cannot_hold_is_refused_naming_both() -> None:
    with pytest.raises(SettingsError, match=r"TANDEM_STOP_CHECKPOINT_S.*TANDEM_DRAIN_TIMEOUT"):
        load(TrainerSettings, stop_checkpoint_s=30, drain_timeout=20)
    assert load(TrainerSettings, drain_timeout=60).stop_bound() == 55
    assert load(TrainerSettings, stop_checkpoint_s=10, drain_timeout=60).stop_bound() == 10
