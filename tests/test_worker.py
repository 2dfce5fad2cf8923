"""The inference worker's parts in-process: pipelines (determinism), the batcher, and
the model registry it is built from."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tandem.common.events import GenerationTask
from tandem.common.models import Registry
from tandem.inference_worker.batcher import Batcher, JobCancelled
from tandem.inference_worker.pipelines import Item, ModelLoadError, Params, Pipeline, build


def test_class_unet_same_seed_gives_byte_identical_pngs_and_other_seeds_differ() -> None:
    spec = Registry.parse("").get("digits")
    assert spec is not None
    params = Params(width=16, height=16, steps=3, guidance=1.0)
    steps: list[int] = []
    a = build(spec, "cpu", "float32").generate(
        [Item(seed=1, class_label=3), Item(seed=2, class_label=3)], params,
        lambda s, t: steps.append(s))
    b = build(spec, "cpu", "float32").generate([Item(seed=1, class_label=3)], params,
                                               lambda s, t: None)
    assert steps == [1, 2, 3]
    assert a[0].startswith(b"\x89PNG") and a[0] != a[1]
    # A fresh process-worth of weights, a different batch: the same image for seed 1.
    assert b[0] == a[0]


def test_tiny_text_pipeline_is_deterministic_per_seed() -> None:
    spec = Registry.parse("").get("tiny-text")
    assert spec is not None
    params = Params(width=16, height=16, steps=2, guidance=3.0)
    pipe = build(spec, "cpu", "float32")
    one = pipe.generate([Item(seed=4, prompt="a boat", negative_prompt="fog")], params,
                        lambda s, t: None)
    two = pipe.generate([Item(seed=4, prompt="a boat", negative_prompt="fog")], params,
                        lambda s, t: None)
    assert one == two and len(one) == 1


def test_fault_models_are_refused_unless_enabled() -> None:
    reg = Registry.parse('[{"name": "boom", "source": "fault:kill"}]')
    spec = reg.get("boom")
    assert spec is not None
    with pytest.raises(ModelLoadError, match="fault injection is disabled"):
        build(spec)


@pytest.mark.parametrize(("value", "says"), [
    ('[{"name": "x", "source": "s3:bucket"}]', "source kind 's3' is not one of"),
    ('[{"name": "x y", "source": "noop"}]', "model x y: name"),
    ('[{"name": "x", "source": "noop", "default_width": 12}]', "default_width"),
    ('[{"name": "x", "source": "noop"}, {"name": "x", "source": "noop"}]', "declared twice"),
    ("{not json", "not JSON"),
    ("@/nonexistent/models.json", "cannot read model registry"),
])
def test_bad_model_registry_is_refused_naming_model_and_field(value: str, says: str) -> None:
    with pytest.raises(ValueError, match=says.replace("(", r"\(")):
        Registry.parse(value)


class Recording(Pipeline):
    """Records the seeds of each call; returns each seed as its "image"."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    trivial = True

    def generate(self, items: list[Item], params: Params, on_step) -> list[bytes]:  # type: ignore[no-untyped-def]
        self.calls.append([it.seed for it in items])
        on_step(1, 1)
        return [str(it.seed).encode() for it in items]


def _task(seed: int, lane: str = "interactive", steps: int = 5, n: int = 1) -> GenerationTask:
    return GenerationTask(task_id=f"t{seed}", model="m", seed=seed, lane=lane, steps=steps,
                          num_images=n)


async def test_batcher_takes_interactive_first_then_groups_compatible_tasks_up_to_max() -> None:
    pipe = Recording()
    batcher = Batcher(lambda model: _ready(pipe), max_batch=4, linger=0)
    # Queued before the loop runs, so it sees them all at once.
    jobs = [batcher.enqueue(t).future for t in [
        _task(10, "batch"), _task(20, "batch", n=2), _task(30, "batch"), _task(40, "batch"),
        _task(50, "interactive", steps=9), _task(60, "batch", steps=7)]]
    loop = asyncio.create_task(batcher.run())
    results = await asyncio.gather(*jobs)
    batcher.close()
    await loop
    assert pipe.calls == [[50], [10, 20, 21, 30], [40], [60]]
    assert results[1] == [b"20", b"21"]


async def test_cancelling_a_waiting_task_removes_it_from_the_batch() -> None:
    pipe = Recording()
    batcher = Batcher(lambda model: _ready(pipe), max_batch=8, linger=0)
    a = batcher.enqueue(_task(1)).future
    b = batcher.enqueue(_task(2)).future
    assert batcher.cancel("t2")
    loop = asyncio.create_task(batcher.run())
    assert await a == [b"1"]
    with pytest.raises(JobCancelled):
        await b
    batcher.close()
    await loop
    assert pipe.calls == [[1]]


class Gated(Pipeline):
    """Runs in the batcher's thread; step 3 blocks until the test opens ``go``, so the
    cancel lands while that step is in flight, whatever the machine's speed."""

    def __init__(self) -> None:
        self.reached, self.go = threading.Event(), threading.Event()
        self.completed = 0

    def generate(self, items: list[Item], params: Params, on_step) -> list[bytes]:  # type: ignore[no-untyped-def]
        for i in range(params.steps):
            if i == 2:
                self.reached.set()
                assert self.go.wait(60)
            self.completed += 1
            on_step(i + 1, params.steps)
        return [b"done" for _ in items]


async def test_cancelling_a_running_task_stops_it_after_the_step_in_flight() -> None:
    pipe = Gated()
    steps: list[int] = []
    batcher = Batcher(lambda model: _ready(pipe), max_batch=1, linger=0,
                      on_step=lambda jobs, step, total: steps.append(step))
    job = batcher.enqueue(_task(1, steps=1000)).future
    loop = asyncio.create_task(batcher.run())
    assert await asyncio.to_thread(pipe.reached.wait, 60)
    assert batcher.cancel("t1")
    pipe.go.set()
    with pytest.raises(JobCancelled):
        await job
    batcher.close()
    await loop
    assert pipe.completed == 3  # the step in flight finished; none after it began
    assert steps == [1, 2]  # and no progress was reported for it


async def _ready(pipe: Pipeline) -> Pipeline:
    return pipe
