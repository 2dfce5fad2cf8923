"""The call ledger counts each dead call once (``ledger.start``): a worker stopped while
it counts the dead calls it found leaves the ones it counted cleared, so the next worker
on the host counts only what is left."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path

from tandem.inference_worker import ledger
from tests.conftest import PYTHON, ROOT

# A worker that counts the first dead call it finds and is stopped during the second
# (SIGTERM past its drain timeout: its start is cancelled) before that count lands.
STOPPED_WHILE_COUNTING = """
import asyncio, json, sys
from tandem.inference_worker import ledger
counted = []
async def count(ids, alone):
    if counted:
        raise asyncio.CancelledError
    counted.append(ids)
try:
    asyncio.run(ledger.start(sys.argv[1], count))
except asyncio.CancelledError:
    pass
print(json.dumps(counted))
"""


def dead_worker_slot(root: Path, index: int, ids: list[str]) -> None:
    """What a worker killed in a call of ``ids`` leaves (``CallLedger.begin``)."""
    root.mkdir(mode=0o700, exist_ok=True)
    (root / f"slot-{index}{ledger.SUFFIX}").write_text(json.dumps(ids) + "\n")


async def test_a_worker_stopped_while_it_counts_dead_calls_leaves_none_counted_twice(
        tmp_path: Path) -> None:
    root = tmp_path / "calls"
    dead_worker_slot(root, 0, ["task-a"])  # a call of its own that killed its worker
    dead_worker_slot(root, 1, ["task-b", "task-c"])
    first = await asyncio.to_thread(
        subprocess.run, [PYTHON, "-c", STOPPED_WHILE_COUNTING, str(root)],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout.splitlines()[-1]) == [["task-a"]]  # after its log
    again: list[list[str]] = []

    async def count(ids: list[str], alone: bool) -> None:
        again.append(ids)

    led = await ledger.start(str(root), count)
    assert led is not None
    led.close()
    assert again == [["task-b", "task-c"]]  # task-a's one death is not counted again
