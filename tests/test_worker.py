"""The inference worker's parts in-process: pipelines (determinism), the batcher, and
the model registry it is built from."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import uuid

import pytest
from prometheus_client import REGISTRY

from tandem.common import fleet
from tandem.common.bus import Bus
from tandem.common.events import GenerationTask
from tandem.common.models import Registry
from tandem.common.streams import core_streams
from tandem.inference_worker.batcher import Batcher, HandedBack, Job, JobCancelled, Turns, Usage
from tandem.inference_worker.drain import Drain
from tandem.inference_worker.pipelines import (
    CallStalled,
    Item,
    ModelLoadError,
    Params,
    Pipeline,
    build,
)
from tests.conftest import PYTHON, service_env


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


LEFT_OUT = """
import sys
from tandem.common.settings import load
from tandem.inference_worker.pipelines import Item, Params, build
from tandem.inference_worker.service import InferenceWorker, WorkerSettings

worker = InferenceWorker(load(WorkerSettings))
made = [build(worker.registry.get(m), "cpu", "float32").generate(
    [Item(seed=1, class_label=3, prompt="a boat")], Params(16, 16, 2, 1.0), lambda s, t: None)
    for m in worker.served]
print(all(len(i) == 1 and i[0][:4] == b"\\x89PNG" for i in made), "diffusers" in sys.modules,
      *(p in sys.modules and sys.modules[p] is None for p in ("transformers", "scipy")))
"""


def test_a_worker_leaves_out_the_optional_packages_its_models_never_use() -> None:
    """diffusers imports Hugging Face transformers and scipy whenever they are installed
    (1-2 s each of a process's start): a worker leaves out those none of its models uses,
    and they still build and generate; only the built-in text model (transformers) and
    pipeline folders (both) may use them."""
    reg = Registry.parse("")
    assert {m: sorted(spec.optional) for m in reg.names() if (spec := reg.get(m))} == {
        "digits": [], "tiny-text": ["transformers"], "noop": []}
    folder = Registry.parse('[{"name": "f", "source": "dir:/models/f"}]').get("f")
    assert folder is not None and folder.optional == {"transformers", "scipy"}
    # What is printed per package: whether it was left out (hidden from diffusers).
    for serve, out in (("digits", "True True"), ("digits,tiny-text", "False True")):
        res = subprocess.run([PYTHON, "-c", LEFT_OUT], capture_output=True,
                             text=True, timeout=300, env=service_env(serve=serve))
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.startswith(f"True True {out}"), (serve, res.stdout)


def test_fault_models_are_refused_unless_enabled() -> None:
    reg = Registry.parse('[{"name": "boom", "source": "fault:kill"}]')
    spec = reg.get("boom")
    assert spec is not None
    with pytest.raises(ModelLoadError, match="fault injection is disabled") as err:
        build(spec)
    assert err.value.lasting


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

    def images(self, items: list[Item], params: Params, on_step) -> list[bytes]:  # type: ignore[no-untyped-def]
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
    calls0, images0 = _batch_images()
    loop = asyncio.create_task(batcher.run())
    results = await asyncio.gather(*jobs)
    batcher.close()
    await loop
    assert pipe.calls == [[50], [10, 20, 21, 30], [40], [60]]
    assert results[1] == [b"20", b"21"]
    # Observed once per call with the call's images (not once per task with its own).
    calls1, images1 = _batch_images()
    assert (calls1 - calls0, images1 - images0) == (4, 7)


class Poisoned(Recording):
    """A call holding seed 13 raises, as a model choking on one task's input fails the
    whole call; it runs on the batcher's thread."""

    trivial = False

    def images(self, items: list[Item], params: Params, on_step) -> list[bytes]:  # type: ignore[no-untyped-def]
        got = super().images(items, params, on_step)
        if any(it.seed == 13 for it in items):
            raise RuntimeError("the model choked on seed 13")
        return got


async def test_a_failed_call_of_several_tasks_fails_only_the_task_that_fails_alone() -> None:
    pipe = Poisoned()
    batcher = Batcher(lambda model: _ready(pipe), max_batch=8, linger=0)
    splits0 = REGISTRY.get_sample_value("tandem_worker_batch_splits_total") or 0.0
    jobs = [batcher.enqueue(_task(seed)).future for seed in (11, 13, 15)]
    loop = asyncio.create_task(batcher.run())
    results = await asyncio.gather(*jobs, return_exceptions=True)
    batcher.close()
    await loop
    assert results[0] == [b"11"] and results[2] == [b"15"]
    assert isinstance(results[1], RuntimeError) and "seed 13" in str(results[1])
    # The failed call, then each of its tasks in a call of its own, oldest first.
    assert pipe.calls == [[11, 13, 15], [11], [13], [15]]
    assert (REGISTRY.get_sample_value("tandem_worker_batch_splits_total") or 0.0) == splits0 + 1


async def test_a_failed_call_of_one_task_fails_it_without_another_call() -> None:
    pipe = Poisoned()
    batcher = Batcher(lambda model: _ready(pipe), max_batch=8, linger=0)
    job = batcher.enqueue(_task(13)).future
    loop = asyncio.create_task(batcher.run())
    with pytest.raises(RuntimeError, match="seed 13"):
        await job
    batcher.close()
    await loop
    assert pipe.calls == [[13]]


def _batch_images() -> tuple[float, float]:
    """``tandem_worker_batch_images``: (calls, images) so far in this process."""
    got = [REGISTRY.get_sample_value(f"tandem_worker_batch_images_{s}") for s in ("count", "sum")]
    return got[0] or 0.0, got[1] or 0.0


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

    def images(self, items: list[Item], params: Params, on_step) -> list[bytes]:  # type: ignore[no-untyped-def]
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


class FirstCallGated(Pipeline):
    """The first call blocks until the test opens ``go``; every call records its seeds
    and the thread it ran on."""

    def __init__(self, concurrent: bool = False) -> None:
        self.concurrent = concurrent
        self.reached, self.go = threading.Event(), threading.Event()
        self.calls: list[list[int]] = []
        self.threads: set[str] = set()
        self.lock = threading.Lock()
        self.in_call = self.most_at_once = 0
        self.two_at_once = threading.Event()

    def images(self, items: list[Item], params: Params, on_step) -> list[bytes]:  # type: ignore[no-untyped-def]
        with self.lock:
            self.calls.append([it.seed for it in items])
            self.threads.add(threading.current_thread().name)
            self.in_call += 1
            self.most_at_once = max(self.most_at_once, self.in_call)
            if self.in_call == 2:
                self.two_at_once.set()
            first = len(self.calls) == 1
        try:
            if first:
                self.reached.set()
                assert self.go.wait(60)
            on_step(1, 1)
            return [str(it.seed).encode() for it in items]
        finally:
            with self.lock:
                self.in_call -= 1


async def _first_call_running(n: int, concurrent: bool = False
                             ) -> tuple[FirstCallGated, Batcher, list[Job], asyncio.Task[None]]:
    """``n`` single-image tasks, max_batch 1: returns once call 1 runs (held) and call 2
    is formed and queued behind it."""
    pipe = FirstCallGated(concurrent)
    formed = 0
    second = asyncio.Event()

    async def get_pipeline(model: str) -> Pipeline:
        # Called once per batch formed; nothing in forming a batch of one waits after
        # this returns, so the batch is queued by the time the test resumes.
        nonlocal formed
        formed += 1
        if formed == 2:
            second.set()
        return pipe

    batcher = Batcher(get_pipeline, max_batch=1, linger=0)
    jobs = [batcher.enqueue(_task(i + 1)) for i in range(n)]
    loop = asyncio.create_task(batcher.run())
    assert await asyncio.to_thread(pipe.reached.wait, 60)
    await asyncio.wait_for(second.wait(), 60)
    return pipe, batcher, jobs, loop


async def test_the_next_batch_is_queued_while_a_call_runs_and_every_call_has_its_own_thread(
        ) -> None:
    pipe, batcher, jobs, loop = await _first_call_running(3)
    # Call 1 runs, call 2 is formed and queued behind it; task 3 waits for a slot.
    assert [j.task.task_id for j in batcher.running] == ["t1", "t2"]
    assert [j.task.task_id for j in batcher.pending] == ["t3"]
    pipe.go.set()
    assert await asyncio.gather(*(j.future for j in jobs)) == [[b"1"], [b"2"], [b"3"]]
    batcher.close()
    await loop
    assert pipe.calls == [[1], [2], [3]]
    # The batcher's own threads ran them, one call at a time, never the event loop's.
    assert all(t.startswith("pipeline") for t in pipe.threads) and pipe.most_at_once == 1
    u = batcher.usage
    assert (u.calls, u.images) == (3, 3)
    assert u.first_start is not None and u.last_end is not None
    assert 0 < u.busy_s <= u.last_end - u.first_start + 1e-6
    assert u.json()["busy"] <= 1.0 + 1e-6


def test_resumed_start_is_the_first_calls_start_since_the_last_undrain() -> None:
    u = Usage()
    for started in (10.0, 11.0):  # two calls of 0.5 s, never drained: since the start
        u.begin(started)
        u.add(1, started, 0.5, 0.4)
    assert (u.first_start, u.resumed_start, u.last_end) == (10.0, 10.0, 11.5)
    u.resume()  # held, then let go: no call since
    assert u.json()["resumed_start"] is None and u.json()["first_start"] == 10.0
    for started in (20.0, 20.5):
        u.begin(started)
        u.add(1, started, 0.5, 0.4)
    got = u.json()
    assert (got["first_start"], got["resumed_start"], got["last_end"]) == (10.0, 20.0, 21.0)
    assert got["calls"] == 4 and got["busy_s"] == 2.0


async def test_only_an_undrain_of_a_drained_node_resets_the_resumed_start(bus: Bus) -> None:
    """An undrain is written even for a node that was not drained (the agent reads it as
    "faults dealt with"): the worker's ``on_undrain`` (``Usage.resume``) must not run
    for it, or a busy span measured from ``resumed_start`` would restart mid-work."""
    await bus.provision(core_streams())
    cluster = f"c{uuid.uuid4().hex[:8]}"
    resumed: list[bool] = []
    drain = Drain(bus, cluster, "n1", on_undrain=lambda: resumed.append(True))
    await drain.start()
    try:
        await fleet.undrain(bus, cluster, "n1")  # not drained: changes nothing
        await fleet.drain(bus, cluster, "n1", "held")
        assert await drain.watch.wait(True, timeout=10)
        assert resumed == []
        await fleet.undrain(bus, cluster, "n1")
        assert await drain.watch.wait(False, timeout=10)
        assert resumed == [True]
        # Once more while not drained, then a drain behind it: the drain is seen after
        # the undrain (one key, in order), so the undrain has been handled by then.
        await fleet.undrain(bus, cluster, "n1")
        await fleet.drain(bus, cluster, "n1", "held again")
        assert await drain.watch.wait(True, timeout=10)
        assert resumed == [True]
    finally:
        await drain.stop()


def test_calls_take_the_accelerator_in_the_order_they_were_handed_over() -> None:
    """The queued call runs next even when the thread of a call handed over after it asks
    first (a plain lock lets whoever asks take it: a suite saw calls 1, 3, 2)."""
    turns = Turns()
    queued, later = turns.ticket(), turns.ticket()
    order: list[str] = []
    asking = threading.Event()

    def late() -> None:
        asking.set()
        with turns.turn(later):
            order.append("later")

    thread = threading.Thread(target=late)
    thread.start()
    assert asking.wait(10)
    with turns.turn(queued):
        order.append("queued")
    thread.join(10)
    assert not thread.is_alive() and order == ["queued", "later"]
    with turns.turn():  # a warm-up: behind every call handed over, then the next one
        order.append("warm-up")
    assert order[-1] == "warm-up"


def test_a_call_that_never_runs_gives_up_its_turn() -> None:
    """A queued call's work cancelled before its thread took it (the batcher stopping)
    must not leave the calls behind it waiting forever."""
    turns = Turns()
    running, cancelled, after = turns.ticket(), turns.ticket(), turns.ticket()
    done = threading.Event()

    def last() -> None:
        with turns.turn(after):
            done.set()

    thread = threading.Thread(target=last)
    thread.start()
    turns.skip(cancelled)  # while the running call still holds its turn
    with turns.turn(running):
        assert not done.is_set()
    assert done.wait(10)
    thread.join(10)
    turns.skip(turns.ticket())  # skipped as it comes up: the next goes at once
    with turns.turn():
        pass


async def test_a_concurrent_pipeline_is_handed_the_next_call_while_one_runs() -> None:
    """``apart``'s child queues calls itself: the batcher hands the queued call over at
    once instead of holding it until the running one ends."""
    pipe, batcher, jobs, loop = await _first_call_running(3, concurrent=True)
    assert await asyncio.to_thread(pipe.two_at_once.wait, 60)
    assert batcher.usage.inflight >= 1  # the first, held
    pipe.go.set()
    assert await asyncio.gather(*(j.future for j in jobs)) == [[b"1"], [b"2"], [b"3"]]
    batcher.close()
    await loop
    assert batcher.usage.inflight == 0 and batcher.usage.running_since is None


async def test_a_queued_batch_whose_tasks_are_all_cancelled_never_starts() -> None:
    pipe, batcher, jobs, loop = await _first_call_running(2)
    assert batcher.cancel("t2")
    with pytest.raises(JobCancelled):
        await jobs[1].future
    pipe.go.set()
    assert await jobs[0].future == [b"1"]
    batcher.close()
    await loop
    assert pipe.calls == [[1]]


async def test_close_hands_back_the_queued_batch_and_lets_the_running_call_finish() -> None:
    pipe, batcher, jobs, loop = await _first_call_running(3)
    batcher.close()
    with pytest.raises(HandedBack):
        await jobs[2].future  # waiting: handed back at once
    pipe.go.set()
    assert await jobs[0].future == [b"1"]
    with pytest.raises(HandedBack):
        await jobs[1].future  # queued, not started: handed back too
    await loop
    assert pipe.calls == [[1]]


async def test_between_calls_waits_for_the_running_call_and_no_call_runs_beside_it(
        ) -> None:
    """A new pipeline's warm-up (a hot swap's) goes between two calls, never beside one."""
    pipe, batcher, jobs, loop = await _first_call_running(2)  # call 1 held, call 2 queued
    ran = threading.Event()
    seen: list[int] = []

    def warm() -> str:
        seen.append(pipe.in_call)  # calls running while it runs
        ran.set()
        return "warmed"

    warming = asyncio.create_task(asyncio.to_thread(batcher.between_calls, warm))
    # Call 1 is held: the warm-up must not start within this window (unlocked, it would
    # start at once and see the held call).
    assert not await asyncio.to_thread(ran.wait, 1.0)
    pipe.go.set()
    assert await warming == "warmed"
    assert await asyncio.gather(*(j.future for j in jobs)) == [[b"1"], [b"2"]]
    batcher.close()
    await loop
    assert seen == [0] and pipe.most_at_once == 1


class WarmHangs(Pipeline):
    """Its warm-up makes one step (its one-image call), then hangs in its full batch's
    until ``go`` opens (a hot-swapped checkpoint's warm-up meeting a hung device); its
    calls return at once."""

    def __init__(self) -> None:
        spec = Registry.parse("").get("digits")
        assert spec is not None
        super().__init__(spec)
        self.go, self.hung = threading.Event(), threading.Event()
        self.calls = 0

    def warm(self, max_batch: int, on_step=None) -> None:  # type: ignore[no-untyped-def]
        assert on_step is not None  # watched, as a call is
        on_step(1, 1)
        self.hung.set()
        self.go.wait()  # the test opens it as it ends, whatever happened

    def images(self, items: list[Item], params: Params, on_step) -> list[bytes]:  # type: ignore[no-untyped-def]
        self.calls += 1
        on_step(1, 1)
        return [b"x" for _ in items]


async def test_a_warm_up_that_hangs_stalls_the_batcher_and_hands_back_what_waits_on_it(
        ) -> None:
    """A warm-up holds the accelerator as a call does: one that makes no step for the
    stall timeout is given up on as a hung call is (the batcher stalls: the worker turns
    unhealthy and hands back its tasks), not left holding the calls behind it for ever."""
    pipe = WarmHangs()

    async def get_pipeline(model: str) -> Pipeline:
        return pipe

    batcher = Batcher(get_pipeline, max_batch=2, linger=0, stall_timeout=0.5)
    loop = asyncio.create_task(batcher.run())
    warming = asyncio.create_task(batcher.warm(pipe, 2))
    try:
        assert await asyncio.to_thread(pipe.hung.wait, 60)
        queued = batcher.enqueue(_task(1))  # a call that would wait behind it for good
        with pytest.raises(CallStalled, match="pipeline call of digits made no step"):
            await asyncio.wait_for(warming, 60)
        assert batcher.stalled is not None
        with pytest.raises(HandedBack):
            await asyncio.wait_for(queued.future, 60)
        await asyncio.wait_for(loop, 60)  # nothing left waiting: the loop ends
        assert pipe.calls == 0
    finally:
        pipe.go.set()
        batcher.close()
        loop.cancel()


def test_images_are_the_call_alone_and_encode_gives_generates_pngs() -> None:
    spec = Registry.parse("").get("digits")
    assert spec is not None
    pipe = build(spec, "cpu", "float32")
    params = Params(width=16, height=16, steps=2, guidance=1.0)
    items = [Item(seed=5, class_label=1), Item(seed=6, class_label=2)]
    arrays = pipe.images(items, params, lambda s, t: None)
    assert [(a.shape, str(a.dtype)) for a in arrays] == [((16, 16, 1), "uint8")] * 2
    assert [pipe.encode(a) for a in arrays] == pipe.generate(items, params, lambda s, t: None)


async def _ready(pipe: Pipeline) -> Pipeline:
    return pipe


def test_warm_runs_one_step_for_one_image_and_for_a_full_batch() -> None:
    spec = Registry.parse("").get("digits")
    assert spec is not None

    class Counting(Pipeline):
        def __init__(self) -> None:
            super().__init__(spec)
            self.calls: list[tuple[int, Params]] = []

        def images(self, items: list[Item], params: Params, on_step) -> list[bytes]:  # type: ignore[no-untyped-def]
            self.calls.append((len(items), params))
            return [b"" for _ in items]

    pipe = Counting()
    pipe.warm(4)
    one_step = Params(width=16, height=16, steps=1, guidance=spec.default_guidance)
    assert pipe.calls == [(1, one_step), (4, one_step)]
