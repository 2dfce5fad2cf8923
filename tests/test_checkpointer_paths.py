"""The checkpointer mirrors a checkpoint only from its own run's folder: an event whose
path is another run's ``step-N`` (inside the checkpoint root, with the right name) goes
to the DLQ naming the mismatch, and that run's local checkpoints are left alone."""

from __future__ import annotations

import asyncio
from typing import Any

from tandem.cli.devstack import S3Server
from tandem.common import checkpoints as ck
from tandem.common import subjects
from tandem.common.bus import Bus
from tandem.common.events import CheckpointMirrored, DeadLetter, decode
from tests.checkpoint_support import write_checkpoint
from tests.test_checkpointer import DEADLINE, Case, case, running, s3  # noqa: F401


async def test_an_event_naming_another_runs_folder_is_dead_lettered_and_that_run_kept(
        bus: Bus, case: Case, s3: Any, s3_server: S3Server) -> None:  # noqa: F811
    run, bucket = case.run, case.bucket
    other = f"{run}-other"
    other_root = case.root.parent / other
    # The other run's checkpoints, never mirrored: retention must never see them as run's.
    for step in (1, 2, 3):
        write_checkpoint(other_root, other, step, {"rng.bin": 10})
    bad = [other_root / "step-3",                           # another run's folder
           case.root / ".." / other / "step-3"]             # the same, spelt through ..
    case.root.mkdir()
    (case.root / "step-2").symlink_to(other_root / "step-2")  # a link to it
    bad.append(case.root / "step-2")
    dead: asyncio.Queue[DeadLetter] = asyncio.Queue()

    async def on_dead(msg: Any) -> None:
        dead.put_nowait(decode(msg.data, DeadLetter))

    await bus.nc.subscribe(subjects.dlq("MIRROR"), cb=on_dead)

    async def letters() -> list[DeadLetter]:
        return [await dead.get() for _ in bad]

    async with running(bus, **case.config(s3_server.url, local_keep=0)):
        for path in bad:
            step = ck.parse_step(path.name)
            assert step is not None
            # run's manifest over the other run's bytes: names and run ids all agree
            await case.publish(path, ck.scan(path, run, step))
        got = asyncio.ensure_future(letters())
        mirrored = asyncio.ensure_future(case.events.next(CheckpointMirrored))
        done, _ = await asyncio.wait({got, mirrored}, timeout=DEADLINE,
                                     return_when=asyncio.FIRST_COMPLETED)
        mirrored.cancel()
        got.cancel()
        assert got in done, (f"not dead-lettered: {mirrored.result()!r}" if mirrored in done
                             else "timed out waiting for the dead letters")
        reasons = [d.reason for d in got.result()]

    for reason in reasons:
        assert f"is not run {run!r}'s folder of step-" in reason, reason
        assert str(case.root.resolve() / "step-") in reason, reason
    assert ck.list_checkpoints(s3, bucket, run) == {}
    assert sorted(p.name for p in other_root.iterdir()) == ["step-1", "step-2", "step-3"]
