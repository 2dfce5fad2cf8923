"""The checkpointer's log lines name a run as the trainer's do (``run_id``), and the node
that wrote a checkpoint under a key of its own (``ckpt_node``): the process's own
``node`` field (where the checkpointer runs) is never written over."""

from __future__ import annotations

from typing import Any

import structlog

from tandem.cli.devstack import S3Server
from tandem.common.bus import Bus
from tandem.common.events import CheckpointMirrored
from tests.test_checkpointer import Case, case, running  # noqa: F401  (the case fixture)


async def test_checkpoint_lines_carry_run_id_and_ckpt_node_never_run_or_node(
        bus: Bus, case: Case, s3_server: S3Server) -> None:  # noqa: F811  (the fixture)
    directory, manifest = case.checkpoint(3, {"model.bin": 10})
    with structlog.testing.capture_logs() as logs:
        async with running(bus, **case.config(s3_server.url)):
            await case.publish(directory, manifest)
            assert (await case.events.next(CheckpointMirrored)).step == 3
    lines: list[dict[str, Any]] = [x for x in logs if x.get("step") == 3]
    assert "checkpoint.committed" in {x["event"] for x in lines}
    for line in lines:
        assert line["run_id"] == case.run and "run" not in line, line
        assert line["ckpt_node"] == "node-0" and "node" not in line, line
