"""The coordinator itself dies (kill -9): its ranks stop, and the next coordinator adopts
the run and finishes it from the newest checkpoint."""

from __future__ import annotations

import uuid
from pathlib import Path

from tandem.common.bus import Bus
from tandem.common.events import RunState, TrainStatus, TrainStep
from tandem.common.runs import submit_run
from tandem.common.servers import NatsServer
from tandem.common.streams import core_streams
from tandem.trainer.launcher import proc_state
from tests.test_train_runs import (
    finished,
    ranks_of,
    start_coordinator,
    stop_process,
    tiny,
    until_event,
)


async def test_killed_coordinator_is_replaced_and_the_run_resumes(
        nats_server: NatsServer, bus: Bus, tmp_path: Path, uid: str) -> None:
    await bus.provision(core_streams())
    cluster, run = f"k{uid}", f"adopt-{uuid.uuid4().hex[:8]}"
    await submit_run(bus, tiny(run, steps=24, checkpoint_every=4))
    first = start_coordinator(nats_server, cluster, tmp_path, tmp_path / "trainer.log")
    second = None
    try:
        await until_event(bus, run, lambda e: isinstance(e, TrainStep) and e.step >= 6)
        old_ranks = await ranks_of(bus, run, 1)
        first.kill()
        first.wait()
        second = start_coordinator(nats_server, cluster, tmp_path, tmp_path / "trainer.log")
        rec = await finished(bus, run)
    finally:
        stop_process(first)
        if second is not None:
            stop_process(second)
    assert rec.state == RunState.succeeded, rec
    assert [i["kind"] for i in rec.incidents] == ["coordinator_restart"]
    assert rec.restarts == 0  # not the run's fault: not counted against max_restarts
    assert max(x["attempt"] for x in rec.ranks) == 2
    resumed = await until_event(bus, run, lambda e: isinstance(e, TrainStatus)
                                and e.state == RunState.starting and "attempt 2" in e.reason)
    assert "resuming from step" in resumed.reason
    # The old coordinator's ranks noticed it was gone and exited on their own.
    states = {pid: proc_state(pid) for pid in old_ranks.values()}
    assert set(states.values()) <= {"gone", "Z"}, states




async def test_run_trains_through_a_nats_restart(
        nats_server: NatsServer, bus: Bus, tmp_path: Path, uid: str) -> None:
    await bus.provision(core_streams())
    cluster, run = f"k{uid}", f"blip-{uuid.uuid4().hex[:8]}"
    await submit_run(bus, tiny(run, steps=30, checkpoint_every=5,
                               faults={"slow_rank": 0, "slow_s": 0.05}))
    coordinator = start_coordinator(nats_server, cluster, tmp_path, tmp_path / "trainer.log")
    try:
        before = await until_event(bus, run, lambda e: isinstance(e, TrainStep) and e.step >= 3)
        nats_server.kill()  # kill -9: the stream store on disk is all that survives
        nats_server.start()
        nats_server.wait_jetstream()
        rec = await finished(bus, run)
    finally:
        stop_process(coordinator)
    assert rec.state == RunState.succeeded, rec
    assert rec.incidents == [] and rec.restarts == 0  # the ranks never noticed
    last = await until_event(bus, run, lambda e: isinstance(e, TrainStep) and e.step == 30)
    assert last.attempt == before.attempt == 1
