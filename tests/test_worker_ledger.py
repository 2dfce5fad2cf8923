"""The worker's call ledger (``ledger.py``): which tasks were in the call running when a
worker process died, and how the batcher runs them when they come back."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from pathlib import Path

from prometheus_client import REGISTRY

from tandem.common.events import GenerationTask
from tandem.inference_worker import ledger
from tandem.inference_worker.batcher import Batcher
from tandem.inference_worker.ledger import CallLedger
from tandem.inference_worker.pipelines import Item, Params, Pipeline
from tests.conftest import PYTHON

DIE_IN_CALLS = """
import os, signal, sys
from tandem.inference_worker.ledger import CallLedger
held = []
for call in sys.argv[2:]:
    held.append(CallLedger.open(sys.argv[1]))
    held[-1].begin(call.split(","))
os.kill(os.getpid(), signal.SIGKILL)
"""


def die_in_calls(directory: Path, *calls: str) -> None:
    """A process that takes a slot for each of ``calls`` (workers side by side: task ids
    joined by commas), starts each call, and is killed in them."""
    out = subprocess.run([PYTHON, "-c", DIE_IN_CALLS, str(directory), *calls],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr


def test_the_next_ledger_finds_the_call_a_dead_worker_was_running(tmp_path: Path) -> None:
    die_in_calls(tmp_path, "a,b,c", "d")
    found = CallLedger.open(tmp_path)
    assert sorted(found.dead()) == [["a", "b", "c"], ["d"]]
    found.clear()
    found.begin(["e"])  # its own slot works after the dead ones are let go
    # Counted once: a ledger opened next finds no dead call, and not the live one's.
    again = CallLedger.open(tmp_path)
    assert again.dead() == [] and again.path != found.path
    found.close()
    again.close()


def test_a_live_workers_call_and_an_ended_call_are_nobodys_crash(tmp_path: Path) -> None:
    live = CallLedger.open(tmp_path)
    live.begin(["running"])  # a live worker mid-call: its slot is locked
    ended = CallLedger.open(tmp_path)
    ended.begin(["done"])
    ended.end()
    ended.close()  # a worker that stopped after its call ended
    # A slot that is not a ledger's (torn, or garbage): nobody is blamed.
    (tmp_path / "slot-9.calls").write_bytes(b'["half\n')
    (tmp_path / "slot-10.calls").write_bytes(b'{"not": "a list"}\n')
    third = CallLedger.open(tmp_path)
    assert third.dead() == []
    for each in (live, third):
        each.close()


async def test_start_counts_each_dead_call_on_its_tasks_then_clears_it(tmp_path: Path) -> None:
    die_in_calls(tmp_path, "a,b", "c")
    counted: list[tuple[list[str], bool]] = []

    async def count(ids: list[str], alone: bool) -> None:
        counted.append((ids, alone))

    before = REGISTRY.get_sample_value("tandem_worker_dead_calls_total") or 0.0
    first = await ledger.start(str(tmp_path), count)
    assert first is not None
    assert sorted(counted) == [(["a", "b"], False), (["c"], True)]
    assert REGISTRY.get_sample_value("tandem_worker_dead_calls_total") == before + 2
    counted.clear()
    second = await ledger.start(str(tmp_path), count)
    assert second is not None and counted == []
    assert second.path != first.path  # the first keeps its slot (a dead one it took over)
    first.close()
    second.close()


async def test_a_folder_the_ledger_cannot_use_leaves_the_worker_without_one(
        tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")

    async def count(ids: list[str], alone: bool) -> None:
        raise AssertionError("nothing to count")

    assert await ledger.start(str(tmp_path / "file" / "calls"), count) is None


class Slots(Pipeline):
    """Records each call's seeds and what the worker's slot said while it ran."""

    trivial = False

    def __init__(self, slot: Path) -> None:
        self.slot = slot
        self.calls: list[list[int]] = []
        self.during: list[list[str]] = []

    def images(self, items: list[Item], params: Params, on_step) -> list[bytes]:  # type: ignore[no-untyped-def]
        self.calls.append([it.seed for it in items])
        self.during.append(json.loads(self.slot.read_bytes().split(b"\n")[0]))
        return [str(it.seed).encode() for it in items]


def _task(seed: int) -> GenerationTask:
    return GenerationTask(task_id=f"t{seed}", model="m", seed=seed, steps=1)


async def test_calls_are_in_the_slot_while_they_run_and_crashed_tasks_run_alone(
        tmp_path: Path) -> None:
    own = CallLedger.open(tmp_path)
    pipe = Slots(own.path)
    batcher = Batcher(lambda model: _ready(pipe), max_batch=8, linger=0, ledger=own)
    # Two tasks that were in a call when a worker died (one of them died alone since),
    # and three that were not: those three share a call; the others run alone, the one
    # that died alone before last.
    jobs = [batcher.enqueue(_task(1), crashes=2, crashes_alone=1),
            batcher.enqueue(_task(2)), batcher.enqueue(_task(3), crashes=1),
            batcher.enqueue(_task(4)), batcher.enqueue(_task(5))]
    loop = asyncio.create_task(batcher.run())
    results = await asyncio.gather(*(j.future for j in jobs))
    batcher.close()
    await loop
    assert results == [[b"1"], [b"2"], [b"3"], [b"4"], [b"5"]]
    assert pipe.calls == [[2, 4, 5], [3], [1]]
    assert pipe.during == [["t2", "t4", "t5"], ["t3"], ["t1"]]
    assert own.path.read_bytes().split(b"\n")[0] == b""  # nothing runs now
    own.close()


async def _ready(pipe: Pipeline) -> Pipeline:
    return pipe


def test_a_slot_that_is_a_link_is_never_read_nor_written(tmp_path: Path) -> None:
    """In a shared folder another user may plant a slot: a link is not followed (its
    target is not written to, its ids blame nobody)."""
    target = tmp_path / "target"
    target.write_bytes(b'["planted"]\n')
    calls = tmp_path / "calls"
    calls.mkdir()
    (calls / "slot-0.calls").symlink_to(target)
    mine = CallLedger.open(calls)
    assert mine.dead() == [] and mine.path.name == "slot-1.calls"
    mine.begin(["t"])
    mine.close()
    assert target.read_bytes() == b'["planted"]\n'
