"""The trainer end to end: a real coordinator process, real torchrun ranks, real NATS.

One coordinator (``python -m tandem.trainer``) serves the whole module. Every scenario
starts when the module does and they run side by side (on two cores, most of a run's
cost is its ranks importing torch): runs that need no interaction (the uninterrupted
reference, the NaN run, the always-crashing run) are simply submitted; the interactive
ones (kill -9, SIGSTOP, a node turning bad) are coroutines that act on their run and
return what they saw. Each test awaits its scenario and checks it. Every wait is on a
KV update or a stream event, with a deadline.

The coordinator exports its spans to an OTLP receiver in the test and serves /metrics on
a known port, so the same runs also show what it traces and what it measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import random
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from safetensors.torch import load_file

from tandem.cli.devstack import NatsServer, logged_metrics_port
from tandem.cli.train import follow, render_status, watch
from tandem.common import events, subjects, tracing
from tandem.common.bus import Bus
from tandem.common.events import (
    CheckpointWritten,
    Health,
    HealthTransition,
    RunRecord,
    RunState,
    TrainStatus,
    TrainStep,
)
from tandem.common.runs import parse_run_config, submit_run
from tandem.common.settings import Settings, load
from tandem.common.streams import KV_RUNS
from tandem.trainer.launcher import proc_state
from tests.conftest import PYTHON, service_env
from tests.observability_support import ERROR, UNSET, Receiver, scrape
from tests.serving_stack import stream_messages

TERMINAL = (RunState.succeeded, RunState.failed, RunState.cancelled)
RUN_TIMEOUT = 480.0

# A tiny UNet on 8x8 digits: a step takes milliseconds, a checkpoint ~3 MB.
TINY_MODEL = {"sample_size": 8, "block_out_channels": [16, 32],
              "down_block_types": ["DownBlock2D", "DownBlock2D"],
              "up_block_types": ["UpBlock2D", "UpBlock2D"]}
# A tiny DiT for the FSDP run (sharded per block, checkpointed per rank).
TINY_DIT = {"kind": "dit", "sample_size": 8, "num_classes": 10, "num_layers": 2,
            "num_attention_heads": 2, "attention_head_dim": 8, "patch_size": 2}


def tiny(run_id: str, **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "run_id": run_id, "steps": 16, "batch_size": 8, "ranks": 2, "device": "cpu",
        "checkpoint_every": 3, "warmup_steps": 2, "model": TINY_MODEL, "seed": 7,
        # Two shared cores run several runs at once here: only the hang test judges hangs.
        "watchdog": {"hang_floor_s": 120, "backoff_s": 0.2, "startup_timeout_s": 200,
                     "max_restarts": 4},
        "loss_health": {"min_history": 5},
    }
    cfg.update(over)
    return cfg


@dataclass
class Stack:
    nats: NatsServer
    cluster: str
    ckpt_root: Path
    work_root: Path
    log: Path
    background: dict[str, str]
    metrics_url: str
    otlp: Receiver

    def settings(self) -> Settings:
        return load(Settings, nats_url=self.nats.url, cluster=self.cluster, node="n0")


async def _submit_all(url: str, configs: list[dict[str, Any]]) -> None:
    bus = await Bus.connect(load(Settings, nats_url=url), "test")
    try:
        from tandem.common.streams import core_streams

        await bus.provision(core_streams())
        for cfg in configs:
            await submit_run(bus, cfg)
    finally:
        await bus.drain()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("train")
    nats = NatsServer(name="train", log_path=root / "nats.log", store_dir=root / "js")
    nats.start()
    uid = uuid.uuid4().hex[:8]
    st = Stack(nats=nats, cluster=f"t{uid}", ckpt_root=root / "ckpt", work_root=root / "work",
               log=root / "trainer.log", background={
                   "reference": f"ref-{uid}", "nan": f"nan-{uid}", "crash": f"crash-{uid}",
                   "linger": f"linger-{uid}", "fsdp": f"fsdp-{uid}", "full": f"full-{uid}",
                   "lost": f"lost-{uid}"},
               metrics_url="", otlp=Receiver())
    bg = st.background
    asyncio.run(_submit_all(nats.url, [
        tiny(bg["reference"], cluster=st.cluster),
        tiny(bg["nan"], cluster=st.cluster, ranks=1, steps=10, checkpoint_every=2,
             faults={"nan_at_data_pos": [5]}, loss_health={"min_history": 5, "skip_batches": 3}),
        tiny(bg["crash"], cluster=st.cluster, steps=10,
             faults={"crash_at_step": 3, "crash_rank": 1},
             watchdog={"hang_floor_s": 120, "backoff_s": 0.2, "max_restarts": 1,
                       "startup_timeout_s": 200}),
        tiny(bg["linger"], cluster=st.cluster, ranks=1, steps=2, checkpoint_every=2,
             faults={"hang_on_exit_rank": 0},
             watchdog={"hang_floor_s": 120, "startup_timeout_s": 200, "teardown_grace_s": 1}),
        tiny(bg["full"], cluster=st.cluster, ranks=1, steps=6, checkpoint_every=2,
             faults={"fail_checkpoint_write_at_step": 4}),
        tiny(bg["lost"], cluster=st.cluster, ranks=1, steps=4, checkpoint_every=2,
             faults={"fail_checkpoint_write_at_step": 4},
             watchdog={"hang_floor_s": 120, "backoff_s": 0.2, "max_restarts": 1,
                       "startup_timeout_s": 200}),
        tiny(bg["fsdp"], cluster=st.cluster, steps=8, checkpoint_every=2, model=TINY_DIT,
             parallelism="fsdp", faults={"nan_at_data_pos": [5]},
             loss_health={"min_history": 5, "skip_batches": 2}),
    ]))
    # Every run of the module keeps its series on /metrics until the module ends.
    proc = start_coordinator(nats, st.cluster, root, st.log, max_runs="8",
                             metrics_port="0", otlp_endpoint=st.otlp.url,
                             metrics_keep_ended="64")
    try:
        st.metrics_url = f"http://127.0.0.1:{logged_metrics_port(proc, st.log)}/metrics"
        yield st
    finally:
        stop_process(proc)
        nats.stop()
        st.otlp.close()


def start_coordinator(nats: NatsServer, cluster: str, root: Path, log: Path,
                      **settings: str) -> subprocess.Popen[bytes]:
    """``python -m tandem.trainer`` on node n0 of ``cluster``, its files under ``root``."""
    # No S3 here: a coordinator told to resume from S3 fails each attempt it cannot ask.
    env = service_env(nats_url=nats.url, cluster=cluster, node="n0",
                      checkpoint_root=str(root / "ckpt"), work_root=str(root / "work"),
                      status_every_s="0.5", restore_from_s3="false", **settings)
    env["OTEL_BSP_SCHEDULE_DELAY"] = "200"  # spans leave within 0.2 s of ending, not 5 s
    with open(log, "ab") as out:
        return subprocess.Popen([PYTHON, "-m", "tandem.trainer"], env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the service drains), SIGKILL if it is still there after 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# The first test waits for runs that share two cores with everything else on the machine:
# generous deadlines cost nothing when things go well.
pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600),
              pytest.mark.slow]


@pytest_asyncio.fixture(loop_scope="module")
async def tbus(stack: Stack) -> AsyncIterator[Bus]:
    b = await Bus.connect(stack.settings(), "test")
    yield b
    await b.drain()


async def until(bus: Bus, run_id: str, pred: Callable[[RunRecord], bool],
                timeout: float = RUN_TIMEOUT) -> RunRecord:
    """The run's record once ``pred`` holds (KV watch, no polling); fails at the deadline."""
    kv = await bus.kv(KV_RUNS)
    deadline = time.monotonic() + timeout
    while True:
        try:  # the first request after a NATS restart can be lost with the old connection
            watcher = await kv.watch(run_id)
            break
        except TimeoutError:
            if time.monotonic() > deadline:
                raise
    last: RunRecord | None = None
    try:
        while (left := deadline - time.monotonic()) > 0:
            try:
                entry = await watcher.updates(timeout=left)
            except TimeoutError:
                break
            if entry is None or not entry.value:
                continue
            last = events.decode(entry.value, RunRecord)
            if pred(last):
                return last
    finally:
        await watcher.stop()
    raise AssertionError(f"run {run_id} never reached the condition; last record: {last}")


async def until_event(bus: Bus, run_id: str, pred: Callable[[Any], bool],
                      timeout: float = RUN_TIMEOUT) -> Any:
    async def scan() -> Any:
        async for ev in follow(bus, run_id):
            if pred(ev):
                return ev
        return None

    return await asyncio.wait_for(scan(), timeout)


async def finished(bus: Bus, run_id: str) -> RunRecord:
    return await until(bus, run_id, lambda r: r.state in TERMINAL)


async def events_of(bus: Bus, run_id: str) -> list[Any]:
    """Every event of a finished run, up to its terminal status."""
    out: list[Any] = []

    def collect(ev: Any) -> bool:
        out.append(ev)
        return isinstance(ev, TrainStatus) and ev.state in TERMINAL

    await until_event(bus, run_id, collect)
    return out


def run_series(series: dict[Any, float], run_id: str) -> dict[str, float]:
    """One run's samples from a scrape, by sample name."""
    return {name: value for (name, labels), value in series.items() if labels == (("run", run_id),)}


async def ranks_of(bus: Bus, run_id: str, attempt: int) -> dict[int, int]:
    rec = await until(bus, run_id, lambda r: any(x.get("attempt") == attempt for x in r.ranks))
    return {int(x["rank"]): int(x["pid"]) for x in rec.ranks}


def final_weights(stack: Stack, run_id: str, steps: int) -> dict[str, Any]:
    d = stack.ckpt_root / run_id / f"step-{steps}"
    return {"model": load_file(str(d / "model.safetensors")),
            "ema": load_file(str(d / "ema.safetensors"))}


def assert_bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    for part in ("model", "ema"):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            assert a[part][k].dtype == b[part][k].dtype
            assert a[part][k].view(-1).view(dtype=_int_view(a[part][k])).equal(
                b[part][k].view(-1).view(dtype=_int_view(b[part][k]))), f"{part}.{k} differs"


def _int_view(t: Any) -> Any:
    import torch

    return {4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()]


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


# ------------------------------------------------------------------------------- scenarios


async def kill_scenario(stack: Stack, bus: Bus) -> dict[str, Any]:
    """kill -9 a random rank at a random step, twice; before the second restart, corrupt
    the newest checkpoint (the restart's 5 s backoff leaves the time to do it, even on a
    busy machine: with 1 s the restart sometimes loaded the checkpoint first)."""
    run = f"kill-{uuid.uuid4().hex[:8]}"
    rng = random.Random()
    await submit_run(bus, tiny(run, cluster=stack.cluster, watchdog={
        "hang_floor_s": 120, "backoff_s": 5.0, "startup_timeout_s": 200}))
    kills = []
    for attempt, lo, hi in ((1, 2, 5), (2, 7, 10)):
        at = rng.randint(lo, hi)
        await until_event(bus, run, lambda e, a=attempt, s=at: isinstance(e, TrainStep)
                          and e.attempt == a and e.step >= s)
        pids = await ranks_of(bus, run, attempt)
        victim = rng.choice(sorted(pids))
        os.kill(pids[victim], signal.SIGKILL)
        kills.append((at, victim))
    # Once the run says it is restarting after attempt 2, every rank of it is gone (the
    # survivors too, which could still be renaming a checkpoint just after the kill), so
    # nothing newer can appear while the restart waits out its backoff.
    await until_event(bus, run, lambda e: isinstance(e, TrainStatus)
                      and e.state == RunState.restarting and e.incident is not None
                      and e.incident.get("attempt") == 2)
    on_disk = sorted(int(p.name.split("-")[1]) for p in (stack.ckpt_root / run).glob("step-*")
                     if p.name.split("-")[1].isdigit())
    newest = on_disk[-1]
    flip_byte(stack.ckpt_root / run / f"step-{newest}" / "model.safetensors")
    return {"record": await finished(bus, run), "kills": kills, "corrupted": newest,
            "previous": on_disk[-2] if len(on_disk) > 1 else None}


async def hang_scenario(stack: Stack, bus: Bus) -> dict[str, Any]:
    """SIGSTOP rank 1 once the run trains; let it go again when the watchdog has acted."""
    run = f"hang-{uuid.uuid4().hex[:8]}"
    await submit_run(bus, tiny(run, cluster=stack.cluster, steps=30, watchdog={
        "hang_multiple": 10, "hang_floor_s": 4, "backoff_s": 0.2, "startup_timeout_s": 200}))
    ev = await until_event(bus, run, lambda e: isinstance(e, TrainStep) and e.step >= 4)
    pids = await ranks_of(bus, run, ev.attempt)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        await until(bus, run, lambda r: any(
            i["kind"] == "hang" and i["stopped_ranks"] == [1] for i in r.incidents))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[1], signal.SIGCONT)
    return {"record": await finished(bus, run)}


async def node_scenario(stack: Stack, bus: Bus) -> dict[str, Any]:
    """Two nodes; rank 1 (on nb) is slow until flagged, then nb turns unhealthy."""
    run = f"node-{uuid.uuid4().hex[:8]}"
    await submit_run(bus, tiny(run, cluster=stack.cluster, steps=60, checkpoint_every=5,
                               nodes=["na", "nb"],
                               faults={"slow_rank": 1, "slow_s": 0.15, "slow_factor": 4},
                               straggler={"ratio": 1.5, "window": 5}))
    flagged = await until(bus, run, lambda r: bool(r.stragglers))
    await bus.publish(subjects.health(stack.cluster, "nb"), HealthTransition(
        cluster=stack.cluster, node="nb", previous=Health.healthy, current=Health.unhealthy,
        rule="xid", reason="XID 79: GPU fell off the bus (test)"))
    return {"flagged": flagged, "record": await finished(bus, run)}


async def adopt_scenario(stack: Stack, bus: Bus) -> dict[str, Any]:
    """A coordinator of its own (another cluster), killed -9 mid-run, then replaced."""
    cluster, run = f"{stack.cluster}b", f"adopt-{uuid.uuid4().hex[:8]}"
    root = stack.ckpt_root.parent / "adopt"
    await submit_run(bus, tiny(run, steps=24, checkpoint_every=4, cluster=cluster))
    first = start_coordinator(stack.nats, cluster, root, root.parent / "adopt-1.log")
    second = None
    try:
        await until_event(bus, run, lambda e: isinstance(e, TrainStep) and e.step >= 6)
        old_ranks = await ranks_of(bus, run, 1)
        first.kill()
        first.wait()
        second = start_coordinator(stack.nats, cluster, root, root.parent / "adopt-2.log")
        rec = await finished(bus, run)
    finally:
        stop_process(first)
        if second is not None:
            stop_process(second)
    return {"record": rec, "old_rank_states": {p: proc_state(p) for p in old_ranks.values()}}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def scenarios(stack: Stack) -> AsyncIterator[dict[str, asyncio.Task[dict[str, Any]]]]:
    bus = await Bus.connect(stack.settings(), "test")
    tasks = {name: asyncio.create_task(fn(stack, bus)) for name, fn in (
        ("kill", kill_scenario), ("hang", hang_scenario), ("node", node_scenario),
        ("adopt", adopt_scenario))}
    yield tasks
    for t in tasks.values():
        t.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    await bus.drain()


# ----------------------------------------------------------------------------------- tests


async def test_run_killed_at_random_steps_resumes_bitwise_identical_to_uninterrupted(
        stack: Stack, tbus: Bus, scenarios: dict[str, Any]) -> None:
    got = await scenarios["kill"]
    rec, kills = got["record"], got["kills"]
    assert rec.state == RunState.succeeded, render_status(rec)
    deaths = [i for i in rec.incidents if i["kind"] == "rank_exit"]
    assert len(deaths) == 2, (kills, rec.incidents)
    for inc, (_, victim) in zip(deaths, kills, strict=True):
        # Found by the rank's connection dropping, not by a timeout.
        assert inc["detector"] == "rank connection closed without goodbye"
        assert inc["rank"] == victim
    ref = await finished(tbus, stack.background["reference"])
    assert ref.state == RunState.succeeded, render_status(ref)
    assert_bitwise_equal(final_weights(stack, rec.run_id, 16),
                         final_weights(stack, stack.background["reference"], 16))


async def test_corrupt_newest_checkpoint_is_reported_and_previous_one_used(
        stack: Stack, tbus: Bus, scenarios: dict[str, Any]) -> None:
    got = await scenarios["kill"]
    rec, newest = got["record"], got["corrupted"]
    assert [c["step"] for c in rec.corrupt_checkpoints] == [newest]
    assert "model.safetensors crc32" in rec.corrupt_checkpoints[0]["reason"]
    assert (stack.ckpt_root / rec.run_id / f"step-{newest}.corrupt").is_dir()
    expect = f"resuming from step {got['previous']}" if got["previous"] else "from scratch"
    reported = await until_event(tbus, rec.run_id, lambda e: isinstance(e, TrainStatus)
                                 and e.incident is not None
                                 and e.incident.get("kind") == "corrupt_checkpoint")
    assert reported.incident["checkpoints"][0]["step"] == newest
    await until_event(tbus, rec.run_id, lambda e: isinstance(e, TrainStatus)
                      and e.state == RunState.starting and "attempt 3" in e.reason
                      and expect in e.reason)


async def test_hung_rank_is_detected_with_stacks_captured_and_run_restarted(
        scenarios: dict[str, Any]) -> None:
    rec = (await scenarios["hang"])["record"]
    hang = next(i for i in rec.incidents if i["kind"] == "hang" and i["stopped_ranks"] == [1])
    assert hang["waited_s"] >= hang["limit_s"] >= 4
    assert hang["stacks"]["1"]["state"] == "T"
    assert "File " in hang["stacks"]["1"]["stack"]
    # The healthy rank is stuck waiting for the stopped one: in a step (DDP's gradient
    # all-reduce runs inside backward) or, if the stop came while they checkpointed, in
    # the checkpoint's own collective (seen under load: loop.checkpoint's all_gather).
    healthy = hang["stacks"]["0"]["stack"]
    assert "train_step" in healthy or "distributed_c10d.py" in healthy, healthy
    assert rec.state == RunState.succeeded, render_status(rec)


async def test_unhealthy_node_restarts_run_without_it(
        tbus: Bus, scenarios: dict[str, Any]) -> None:
    rec = (await scenarios["node"])["record"]
    assert rec.state == RunState.succeeded, render_status(rec)
    lost = [i for i in rec.incidents if i["kind"] == "node_lost"]
    assert len(lost) == 1 and lost[0]["node"] == "nb" and lost[0]["health"] == "unhealthy"
    assert rec.nodes == ["na"]
    assert {x["node"] for x in rec.ranks} == {"na"}
    last = await until_event(tbus, rec.run_id,
                             lambda e: isinstance(e, TrainStep) and e.step == 60)
    assert last.rank_nodes == ["na", "na"]


async def test_straggler_is_flagged_with_score_and_node(
        tbus: Bus, scenarios: dict[str, Any]) -> None:
    rec = (await scenarios["node"])["flagged"]
    s = rec.stragglers[0]
    assert s["rank"] == 1 and s["node"] == "nb"
    assert s["score"] >= 1.5
    assert "telemetry" in s
    alert = await until_event(tbus, rec.run_id, lambda e: isinstance(e, TrainStatus)
                              and e.reason.startswith("straggler"))
    assert alert.incident["node"] == "nb"


async def test_killed_coordinator_is_replaced_and_the_run_resumes(
        tbus: Bus, scenarios: dict[str, Any]) -> None:
    got = await scenarios["adopt"]
    rec = got["record"]
    assert rec.state == RunState.succeeded, render_status(rec)
    assert [i["kind"] for i in rec.incidents] == ["coordinator_restart"]
    assert rec.restarts == 0  # not the run's fault: not counted against max_restarts
    assert max(x["attempt"] for x in rec.ranks) == 2
    resumed = await until_event(tbus, rec.run_id, lambda e: isinstance(e, TrainStatus)
                                and e.state == RunState.starting and "attempt 2" in e.reason)
    assert "resuming from step" in resumed.reason
    # The old coordinator's ranks noticed it was gone and exited on their own.
    assert set(got["old_rank_states"].values()) <= {"gone", "Z"}, got["old_rank_states"]


async def test_restarts_are_bounded_then_run_fails_with_incident_history(
        stack: Stack, tbus: Bus) -> None:
    rec = await finished(tbus, stack.background["crash"])
    assert rec.state == RunState.failed
    assert rec.restarts == 2  # the first failure, one restart (max_restarts=1), then over
    assert [i["kind"] for i in rec.incidents] == ["rank_exit", "rank_exit"]
    assert all(i["rank"] == 1 for i in rec.incidents)
    final = await until_event(tbus, rec.run_id, lambda e: isinstance(e, TrainStatus)
                              and e.state == RunState.failed)
    assert "gave up after 1 restarts" in final.reason


async def test_a_rank_that_hangs_on_exit_after_its_goodbye_is_stopped_and_the_run_succeeds(
        stack: Stack, tbus: Bus) -> None:
    rec = await finished(tbus, stack.background["linger"])
    assert rec.state == RunState.succeeded, render_status(rec)
    assert rec.restarts == 0 and rec.incidents == []
    [rank] = rec.ranks
    assert proc_state(int(rank["pid"])) in ("gone", "Z")  # stopped, not left behind
    assert (stack.ckpt_root / rec.run_id / "step-2" / "model.safetensors").is_file()
    assert "run.exit_hung_after_goodbye" in stack.log.read_text()


async def test_a_checkpoint_the_disk_had_no_room_for_is_reported_and_training_goes_on(
        stack: Stack, tbus: Bus) -> None:
    run = stack.background["full"]
    rec = await finished(tbus, run)
    assert rec.state == RunState.succeeded, render_status(rec)
    assert rec.restarts == 0 and rec.incidents == []
    [failure] = rec.checkpoint_failures
    assert {k: failure[k] for k in ("kind", "step", "rank", "node", "attempt",
                                    "last_written")} == {
        "kind": "checkpoint_write_failed", "step": 4, "rank": 0, "node": "n0", "attempt": 1,
        "last_written": 2}
    assert "No space left on device" in failure["error"]
    # Its files are gone (on a full disk they would hold the next one's room); the
    # checkpoints before and after it are whole, and training went on past it.
    folder = stack.ckpt_root / run
    assert sorted(p.name for p in folder.iterdir()) == ["step-2", "step-6"]
    evs = await events_of(tbus, run)
    said = [e for e in evs if isinstance(e, TrainStatus) and e.incident
            and e.incident.get("kind") == "checkpoint_write_failed"]
    assert len(said) == 1 and said[0].reason.startswith("checkpoint step 4 not written on n0")
    assert "training goes on, the newest written is step 2" in said[0].reason
    assert [e.step for e in evs if isinstance(e, CheckpointWritten)] == [2, 6]
    got = run_series(await asyncio.to_thread(scrape, stack.metrics_url), run)
    assert got["tandem_checkpoint_write_failures_total"] == 1
    assert "checkpoint step 4 not written on n0 (rank 0, attempt 1)" in render_status(rec)


async def test_a_run_whose_last_checkpoint_cannot_be_written_does_not_succeed(
        stack: Stack, tbus: Bus) -> None:
    # The last step's checkpoint is the run's result: every step trained without it is
    # not a success. Each attempt resumes from step 2, trains to 4 and cannot write it.
    rec = await finished(tbus, stack.background["lost"])
    assert rec.state == RunState.failed, render_status(rec)
    assert [(i["kind"], i["attempt"], i["node"], i["checkpoint_step"], i["resume_from"])
            for i in rec.incidents] == [("final_checkpoint_unwritten", 1, "n0", 4, 2),
                                        ("final_checkpoint_unwritten", 2, "n0", 4, 2)]
    assert [(f["step"], f["attempt"]) for f in rec.checkpoint_failures] == [(4, 1), (4, 2)]
    final = await until_event(tbus, rec.run_id, lambda e: isinstance(e, TrainStatus)
                              and e.state == RunState.failed)
    assert "gave up after 1 restarts; last: final_checkpoint_unwritten" in final.reason
    assert sorted(p.name for p in (stack.ckpt_root / rec.run_id).iterdir()) == ["step-2"]


async def test_nan_loss_rolls_back_past_a_newer_checkpoint_into_a_lineage_of_its_own(
        stack: Stack, tbus: Bus) -> None:
    run = stack.background["nan"]
    rec = await finished(tbus, run)
    assert rec.state == RunState.succeeded, render_status(rec)
    inc = [i for i in rec.incidents if i["kind"] == "loss_anomaly"]
    assert len(inc) == 1
    inc0 = inc[0]
    # Data position 5 is the 6th batch: the update of step 6 was never applied. The
    # window to skip is positions 3..5, and the checkpoint at step 4 holds 3, so the run
    # went back past it, to step 2, in lineage 1 forked at step 3.
    assert inc0["anomaly"] == "nonfinite" and inc0["data_pos"] == 5 and inc0["at_step"] == 6
    assert inc0["evidence"]["loss_finite"] is False
    assert inc0["resume_from"] == 2 and inc0["skip_window"] == [3, 5]
    assert (inc0["lineage"], inc0["forked_at"], rec.forks) == (1, 3, [3])
    assert rec.skipped == [[3, 5]]
    event = await until_event(tbus, run, lambda e: isinstance(e, TrainStatus)
                              and e.incident is not None
                              and e.incident.get("kind") == "loss_anomaly")
    assert event.state == RunState.restarting
    import torch

    # Step 4 exists twice, under names of its own: the abandoned lineage's and the new.
    d = stack.ckpt_root / run
    old, new = (torch.load(d / name / "trainer.pt", weights_only=True)
                for name in ("step-4", "step-4-l1"))
    assert (old["data_pos"], new["data_pos"]) == (4, 7)
    trainer = torch.load(d / "step-10-l1" / "trainer.pt", weights_only=True)
    assert trainer["data_pos"] == 13 and trainer["skipped"] == [[3, 5]]
    assert not (d / "step-10").exists()
    # On the bus every step and checkpoint says its lineage, and none is deduplicated:
    # step 3 (before the fork) is trained again bitwise as it was; 4 and 5 are others.
    evs = await events_of(tbus, run)
    steps = [(e.step, e.lineage, e.attempt, e.loss) for e in evs if isinstance(e, TrainStep)]
    assert [(s, li, a) for s, li, a, _ in steps if 3 <= s <= 5] == [
        (3, 0, 1), (4, 0, 1), (5, 0, 1), (3, 0, 2), (4, 1, 2), (5, 1, 2)]
    loss = {(s, a): x for s, _, a, x in steps}
    assert loss[3, 1] == loss[3, 2] and loss[4, 1] != loss[4, 2]
    written = [(e.step, e.manifest.lineage, Path(e.path).name) for e in evs
               if isinstance(e, CheckpointWritten)]
    assert written == [(2, 0, "step-2"), (4, 0, "step-4"), (4, 1, "step-4-l1"),
                       (6, 1, "step-6-l1"), (8, 1, "step-8-l1"), (10, 1, "step-10-l1")]


async def test_an_fsdp_run_rolls_back_through_its_sharded_checkpoint_and_succeeds(
        stack: Stack, tbus: Bus) -> None:
    import torch

    from tandem.common import checkpoints as ck

    run = stack.background["fsdp"]
    rec = await finished(tbus, run)
    assert rec.state == RunState.succeeded, render_status(rec)
    (inc,) = rec.incidents
    assert inc["kind"] == "loss_anomaly" and inc["resume_from"] == 4 and rec.forks == [4]
    written = await until_event(tbus, run, lambda e: isinstance(e, CheckpointWritten)
                                and e.step == 8)
    assert (written.manifest.kind, written.manifest.world_size) == (ck.SHARDED, 2)
    assert written.manifest.lineage == 1
    final = stack.ckpt_root / run / "step-8-l1"
    assert ck.verify(final).files == written.manifest.files
    trainer = torch.load(final / "trainer.pt", weights_only=True)
    assert trainer["data_pos"] == 10 and trainer["skipped"] == [[4, 5]]


async def test_a_run_recorded_but_never_announced_is_claimed_from_kv_and_runs(
        stack: Stack, tbus: Bus) -> None:
    """A gateway that died between writing a run's record and announcing it: a
    coordinator (of a cluster of its own) claims the record once it stayed pending
    ``unclaimed_after_s`` (2 s here) and runs it. A refused submission's record, deleted
    at once, is never claimed."""
    cluster = f"{stack.cluster}u"
    run, refused = f"unannounced-{uuid.uuid4().hex[:8]}", f"refused-{uuid.uuid4().hex[:8]}"
    kv = await tbus.typed(KV_RUNS, RunRecord)
    for run_id in (refused, run):
        cfg = parse_run_config(tiny(run_id, cluster=cluster, ranks=1, steps=2,
                                    checkpoint_every=2))
        revision = await kv.create(run_id, RunRecord(
            run_id=run_id, config=cfg.model_dump(mode="json"), state=RunState.pending))
        assert revision is not None
        if run_id == refused:
            await kv.delete(run_id, last=revision)
    root, log = stack.ckpt_root.parent / "unclaimed", stack.ckpt_root.parent / "unclaimed.log"
    proc = start_coordinator(stack.nats, cluster, root, log, unclaimed_after_s="2")
    try:
        rec = await finished(tbus, run)
    finally:
        stop_process(proc)
    assert rec.state == RunState.succeeded and rec.coordinator == f"{cluster}.n0"
    assert rec.latest_step == 2
    statuses = [e for e in await events_of(tbus, run) if isinstance(e, TrainStatus)]
    assert statuses and all(e.state != RunState.pending for e in statuses)  # never announced
    claimed = [line for line in log.read_text().splitlines()
               if "trainer.claim_unannounced" in line]
    assert any(run in line for line in claimed) and not any(refused in line for line in claimed)
    assert await kv.get(refused) is None


async def test_goodput_is_recorded_and_shown_in_status(stack: Stack, tbus: Bus) -> None:
    rec = await finished(tbus, stack.background["reference"])
    g = rec.goodput
    assert 0 < g["goodput"] <= 1
    accounted = g["productive_s"] + sum(v for k, v in g.items() if k.startswith("badput_"))
    assert accounted == pytest.approx(g["elapsed_s"], rel=0.1, abs=1.0)
    assert g["badput_startup_s"] > 0 and g["badput_checkpoint_s"] > 0
    text = render_status(rec)
    assert "goodput" in text and "badput: startup" in text and "succeeded" in text
    crash = await finished(tbus, stack.background["crash"])
    assert crash.goodput["badput_restart_s"] > 0


async def test_watch_prints_progress_until_the_run_ends(stack: Stack, tbus: Bus) -> None:
    run = stack.background["reference"]
    await finished(tbus, run)
    out = io.StringIO()
    code = await watch(tbus, run, out)
    text = out.getvalue()
    assert code == 0
    assert "[" + "#" * 30 + "] 16/16 100.0%" in text
    assert "checkpoint step 15" in text and "training blocked" in text
    assert "succeeded: trained 16 steps" in text


async def test_the_coordinators_metrics_show_a_runs_last_step_checkpoints_and_goodput(
        stack: Stack, tbus: Bus) -> None:
    run = stack.background["reference"]
    rec = await finished(tbus, run)
    evs = await events_of(tbus, run)
    last = [e for e in evs if isinstance(e, TrainStep)][-1]
    ckpts = [e for e in evs if isinstance(e, CheckpointWritten)]
    got = run_series(await asyncio.to_thread(scrape, stack.metrics_url), run)
    assert last.step == 16 and got["tandem_train_step"] == last.step
    assert got["tandem_train_loss"] == last.loss
    assert got["tandem_train_samples_per_second"] == last.samples_per_s
    assert got["tandem_train_step_seconds_count"] == 16  # every step, each timed
    assert got["tandem_checkpoint_blocked_seconds_count"] == len(ckpts) > 0
    assert got["tandem_checkpoint_blocked_seconds_sum"] == pytest.approx(
        sum(c.blocked_s for c in ckpts))
    assert got["tandem_train_goodput_ratio"] == rec.goodput["goodput"] > 0
    assert got["tandem_train_restarts"] == rec.restarts == 0


async def test_each_restart_cycle_is_one_trace_that_names_the_incident_it_restarts_after(
        stack: Stack, scenarios: dict[str, Any], tbus: Bus) -> None:
    got = await scenarios["kill"]
    rec, kills = got["record"], got["kills"]
    assert rec.state == RunState.succeeded, render_status(rec)

    def roots() -> list[dict[str, Any]] | None:
        spans = [s for s in stack.otlp.traces_with("tandem.run_id", rec.run_id)
                 if s["name"] == "train attempt"]
        return spans if len(spans) == 3 else None

    attempts = await until_true(roots, "the three attempts' traces")
    attempts.sort(key=lambda s: s["attrs"]["tandem.attempt"].int_value)
    assert len({s["trace"] for s in attempts}) == 3  # one trace per cycle
    assert [s["parent"] for s in attempts] == ["", "", ""]  # each a root
    assert [s["attrs"]["tandem.attempt"].int_value for s in attempts] == [1, 2, 3]
    assert [s["attrs"]["tandem.outcome"].string_value for s in attempts] == [
        "rank_exit", "rank_exit", "succeeded"]
    # A failed attempt's span says so (it was UNSET like a good one).
    assert [s["status"][0] for s in attempts] == [ERROR, ERROR, UNSET]
    assert attempts[0]["status"][1].startswith("rank_exit")
    assert "tandem.restart.reason" not in attempts[0]["attrs"] and not attempts[0]["events"]
    deaths = [i for i in rec.incidents if i["kind"] == "rank_exit"]
    for span, inc, (_, victim) in zip(attempts[1:], deaths, kills, strict=True):
        attrs = span["attrs"]
        assert attrs["tandem.restart.incident"].string_value == "rank_exit"
        assert attrs["tandem.restart.after_attempt"].int_value == inc["attempt"]
        reason = attrs["tandem.restart.reason"].string_value
        assert f"rank={victim}" in reason and "closed without goodbye" in reason, reason
        [(name, event)] = span["events"]
        assert name == "restart" and event["tandem.incident.rank"].int_value == victim
        assert event["tandem.incident.resume_from"].int_value == inc["resume_from"]
    # Each cycle's own restore and launch hang under its root, in its trace.
    for span in attempts:
        children = {s["name"]: s for s in stack.otlp.spans if s["parent"] == span["span"]}
        assert {"restore", "launch"} <= set(children), children
        assert {c["trace"] for c in children.values()} == {span["trace"]}
    third = {s["name"]: s for s in stack.otlp.spans if s["parent"] == attempts[2]["span"]}
    restore = third["restore"]["attrs"]
    skipped = [v.int_value for v in restore["tandem.corrupt_skipped"].array_value.values]
    assert skipped == [got["corrupted"]]
    assert restore["tandem.resume_step"].int_value == (got["previous"] or 0)
    assert run_series(await asyncio.to_thread(scrape, stack.metrics_url),
                      rec.run_id)["tandem_train_restarts"] == rec.restarts == 2
    # The status event that reports how a cycle ended is in that cycle's trace: each
    # restart after its incident's attempt, and the success in the last one.
    traces = [s["trace"] for s in attempts]
    ends = [(ev.state, tracing.trace_id(msg.headers), ev.incident) for msg in
            await stream_messages(tbus, "TRAIN", subjects.train(rec.run_id, "status"))
            if (ev := events.decode(msg.data, TrainStatus)).state == RunState.succeeded
            or (ev.incident or {}).get("kind") == "rank_exit"]
    assert ends == [(RunState.restarting, traces[0], deaths[0]),
                    (RunState.restarting, traces[1], deaths[1]),
                    (RunState.succeeded, traces[2], None)]


async def until_true(cond: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """``cond()`` once it is truthy (spans arrive from another process), with a deadline."""
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)  # polling a condition, with the deadline above
    return value
