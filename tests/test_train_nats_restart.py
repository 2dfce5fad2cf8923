"""The bus itself dies (kill -9 of nats-server) in the middle of a run: the ranks train
on, the coordinator catches up when NATS is back, and the run never restarts."""

from __future__ import annotations

import uuid
from pathlib import Path

from tandem.cli.devstack import NatsServer
from tandem.common.bus import Bus
from tandem.common.events import RunState, TrainStep
from tandem.common.runs import submit_run
from tandem.common.streams import core_streams
from tests.test_train_runs import (
    finished,
    start_coordinator,
    stop_process,
    tiny,
    until_event,
)


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
