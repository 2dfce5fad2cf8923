"""The pipeline call in a child process (``TANDEM_PIPELINE_PROCESS``): the same images as
in the worker's own process, steps and stops across the socket, and what a dead child
or a dead worker leaves."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tandem.common.models import ModelSpec, Registry
from tandem.inference_worker import apart
from tandem.inference_worker.pipelines import Interrupted, Item, ModelLoadError, Params, build
from tests.conftest import PYTHON, ROOT, service_env, thread_cpus

pytestmark = pytest.mark.slow  # a child process that imports torch per test

PARAMS = Params(width=16, height=16, steps=3, guidance=1.0)
ITEMS = [Item(seed=5, class_label=1), Item(seed=6, class_label=2)]


def _spec(name: str) -> ModelSpec:
    spec = Registry.parse("").get(name)
    assert spec is not None
    return spec


@pytest.fixture(scope="module")
def digits() -> Iterator[apart.ProcessPipeline]:
    pipe = apart.ProcessPipeline(_spec("digits"), "cpu", "float32", threads=1)
    yield pipe
    pipe.close()


def _in_process_images(name: str, items: list[Item], params: Params) -> list[bytes]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the child's: the same kernels, the same bits
    try:
        pipe = build(_spec(name), "cpu", "float32")
        return [pipe.encode(a) for a in pipe.images(items, params, lambda s, t: None)]
    finally:
        torch.set_num_threads(threads)


def test_a_child_makes_the_images_the_worker_s_own_process_makes(
        digits: apart.ProcessPipeline) -> None:
    steps: list[tuple[int, int]] = []
    t0 = time.time()
    arrays, took = digits.call(ITEMS, PARAMS, lambda s, t: steps.append((s, t)))
    assert [digits.encode(a) for a in arrays] == _in_process_images("digits", ITEMS, PARAMS)
    assert steps == [(1, 3), (2, 3), (3, 3)]  # every step reported, in order
    assert digits.pid is not None and digits.pid != os.getpid()
    # Timed in the child: its start, wall and CPU (not this thread's, which only waited).
    assert t0 <= took.started <= time.time() and 0 < took.cpu_s and 0 < took.wall_s

    text = apart.ProcessPipeline(_spec("tiny-text"), "cpu", "float32", threads=1)
    try:
        items = [Item(seed=9, prompt="a lighthouse")]
        params = Params(width=16, height=16, steps=2, guidance=3.0)
        got = [text.encode(a) for a in text.images(items, params, lambda s, t: None)]
        assert got == _in_process_images("tiny-text", items, params)
    finally:
        text.close()


def test_calls_handed_over_together_run_one_after_the_other_in_the_child(
        digits: apart.ProcessPipeline) -> None:
    """The batcher hands the next call over while one runs: the child queues it and
    starts it as the last ends, each call's steps and images going to its own caller."""
    items = [[Item(seed=s, class_label=s % 10)] for s in (11, 12, 13)]
    steps: dict[int, list[int]] = {0: [], 1: [], 2: []}
    with ThreadPoolExecutor(3) as pool:
        calls = [pool.submit(digits.call, its, PARAMS,
                             lambda s, t, k=k: steps[k].append(s))
                 for k, its in enumerate(items)]
        results = [c.result(timeout=120) for c in calls]
    for k, (arrays, _) in enumerate(results):
        assert [digits.encode(a) for a in arrays] == _in_process_images("digits", items[k],
                                                                        PARAMS)
        assert steps[k] == [1, 2, 3]
    spans = sorted((t.started, t.started + t.wall_s) for _, t in results)
    assert all(a[1] <= b[0] + 1e-3 for a, b in itertools.pairwise(spans))


def test_a_hook_that_stops_the_call_stops_it_and_the_next_call_runs(
        digits: apart.ProcessPipeline) -> None:
    seen: list[int] = []

    def stop_at_2(step: int, total: int) -> None:
        seen.append(step)
        if step == 2:
            raise Interrupted()

    long = Params(width=16, height=16, steps=50, guidance=1.0)
    with pytest.raises(Interrupted):
        digits.images(ITEMS, long, stop_at_2)
    assert seen[:2] == [1, 2] and len(seen) == 2  # no step reported after the stop
    assert len(digits.images(ITEMS, PARAMS, lambda s, t: None)) == 2


def test_a_child_killed_mid_call_fails_that_call_naming_it_and_the_next_gets_a_new_one(
        digits: apart.ProcessPipeline) -> None:
    first = digits.pid
    assert first is not None

    def kill_at_1(step: int, total: int) -> None:
        if step == 1:
            os.kill(first, signal.SIGKILL)

    with pytest.raises(apart.PipelineProcessDied, match=r"digits died.*exit status -9"):
        digits.images(ITEMS, Params(width=16, height=16, steps=50, guidance=1.0), kill_at_1)
    arrays = digits.images(ITEMS, PARAMS, lambda s, t: None)
    assert [digits.encode(a) for a in arrays] == _in_process_images("digits", ITEMS, PARAMS)
    assert digits.pid not in (None, first)
    # Killed between calls: noticed before the next call, which runs on a fresh child.
    second = digits.pid
    assert second is not None
    os.kill(second, signal.SIGKILL)
    assert len(digits.images(ITEMS, PARAMS, lambda s, t: None)) == 2
    assert digits.pid not in (None, first, second)


async def test_a_batched_call_whose_child_dies_runs_each_task_again_alone_on_a_new_child(
        digits: apart.ProcessPipeline) -> None:
    """The child dies in a call of three tasks (as of one task's input): the batcher runs
    each again in a call of its own, on a fresh child, and each gets its own images."""
    import asyncio

    from tandem.common.events import GenerationTask
    from tandem.inference_worker.batcher import Batcher
    from tandem.inference_worker.pipelines import Pipeline

    dead: list[int] = []

    class KillsItsBatchedCall(Pipeline):
        """``digits``, whose child is killed at the first step of a call of three."""

        concurrent = True

        def call(self, items, params, on_step):  # type: ignore[no-untyped-def]
            def hook(step: int, total: int) -> None:
                if len(items) == 3 and not dead and digits.pid is not None:
                    dead.append(digits.pid)
                    os.kill(digits.pid, signal.SIGKILL)
                on_step(step, total)

            return digits.call(items, params, hook)

    pipe = KillsItsBatchedCall(digits.spec)

    async def ready(model: str) -> Pipeline:
        return pipe

    batcher = Batcher(ready, max_batch=8, linger=0)
    tasks = [GenerationTask(task_id=f"t{seed}", model="digits", seed=seed, class_label=seed % 10,
                            steps=PARAMS.steps, width=PARAMS.width, height=PARAMS.height,
                            guidance=PARAMS.guidance) for seed in (21, 22, 23)]
    jobs = [batcher.enqueue(t) for t in tasks]
    loop = asyncio.create_task(batcher.run())
    results = await asyncio.wait_for(asyncio.gather(*(j.future for j in jobs)), 300)
    batcher.close()
    await loop
    assert dead and digits.pid not in (None, *dead)
    assert batcher.batches == 4  # the batched call, then one call per task
    for task, arrays in zip(tasks, results, strict=True):
        item = Item(seed=task.seed, class_label=task.class_label)
        assert [digits.encode(a) for a in arrays] == _in_process_images("digits", [item], PARAMS)


def test_closing_ends_the_child_and_a_model_it_cannot_build_is_refused_naming_why(
        tmp_path: os.PathLike[str]) -> None:
    pipe = apart.ProcessPipeline(_spec("digits"), "cpu", "float32", threads=1)
    child = pipe._child
    assert child is not None
    pipe.close()
    assert child.proc.poll() is not None  # gone, not left behind
    missing = ModelSpec(name="folder", source=f"dir:{tmp_path}/nothing-here")
    with pytest.raises(ModelLoadError, match="nothing-here is not a directory") as err:
        apart.ProcessPipeline(missing, "cpu", "float32")
    assert err.value.lasting  # the child says so: its tasks fail at once
    assert apart.eligible(_spec("digits")) and not apart.eligible(_spec("noop"))
    fault = ModelSpec(name="f", source="fault:kill")
    assert apart.eligible(fault, fault_injection=True) and not apart.eligible(fault)


def test_a_pinned_child_runs_every_thread_on_its_cpus_and_makes_the_same_images() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    assert len(cpus) >= 2, f"pinning needs 2 CPUs to be told apart; this process may use {cpus}"
    pipe = apart.ProcessPipeline(_spec("digits"), "cpu", "float32", cpus=frozenset(cpus[-1:]))
    try:
        arrays = pipe.images(ITEMS, PARAMS, lambda s, t: None)
        # threads 0 with cpus: one torch thread per CPU of them, so the same kernels as a
        # one-thread process, and the same bits
        assert [pipe.encode(a) for a in arrays] == _in_process_images("digits", ITEMS, PARAMS)
        assert pipe.pid is not None
        assert thread_cpus(pipe.pid) == {cpus[-1]}
        assert os.sched_getaffinity(0) == set(cpus)  # the caller's own CPUs are untouched
    finally:
        pipe.close()


def test_a_cpu_list_is_read_as_linux_writes_it_and_a_bad_one_is_named() -> None:
    assert apart.cpu_list("0-3,8") == {0, 1, 2, 3, 8}
    assert apart.cpu_list(" 2 , 0-1 ") == {0, 1, 2}
    assert apart.cpu_list("") == frozenset() == apart.cpu_list("  ")
    for bad, why in (("a", "'a' is not a CPU number"), ("3-1", "ends before it starts"),
                     ("0,,1", "'' is not a CPU number"), ("-1", "'-1' is not a CPU number"),
                     ("0-", "'0-' is not a CPU number")):
        with pytest.raises(ValueError, match=why) as err:
            apart.cpu_list(bad, "TANDEM_PIPELINE_CPUS")
        assert str(err.value).startswith(f"TANDEM_PIPELINE_CPUS {bad!r}")


def test_a_worker_refuses_pinning_it_cannot_do_at_start_naming_the_setting() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    every = ",".join(map(str, cpus))
    for values, why in (
            (dict(pipeline_cpus="0"), "needs TANDEM_PIPELINE_PROCESS=1"),
            (dict(pipeline_process="1", pipeline_cpus=every), "none is left for its own"),
            (dict(pipeline_process="1", pipeline_cpus=str(max(cpus) + 1)),
             f"names CPUs this worker may not use: [{max(cpus) + 1}]"),
            (dict(pipeline_process="1", pipeline_cpus="0-"), "'0-' is not a CPU number"),
            (dict(pipeline_cpu_count="1"), "needs TANDEM_PIPELINE_PROCESS=1"),
            (dict(pipeline_process="1", pipeline_cpu_count=str(len(cpus))),
             "none is left for its own"),
            (dict(pipeline_process="1", pipeline_cpus="0", pipeline_cpu_count="1"),
             "set one of them")):
        out = subprocess.run([PYTHON, "-m", "tandem.inference_worker"], cwd=ROOT,
                             env=service_env(s3_secret_key="do-not-print-me", **values),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, (values, out.stderr[-2000:])
        assert "TANDEM_PIPELINE_CPU" in out.stderr and why in out.stderr, out.stderr
        assert "do-not-print-me" not in out.stderr  # a check across settings echoes none
