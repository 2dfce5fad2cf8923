"""serving against the bare pipeline: images/s, the pipeline's busy time, batching, workers.

The compute side of ``tandem bench serve`` (``serve.py`` runs these parts in each of its
repeats, on its servers):

(c) pipeline: images/s of Tandem serving ``digits`` (``builtin:class-unet``) and
    ``tiny-text`` (``builtin:tiny-text``) at batch 1 and batch ``--batch``, against the
    same pipeline called in a plain loop in one process (``bare_pipeline``): the same
    steps, size, guidance, a generator per image, and the same torch intra-op threads
    (``--threads``; the worker's ``TANDEM_TORCH_THREADS``). Tandem's side is a worker
    draining a queue filled beforehand with single-image tasks (``max_batch`` 1 or
    ``--batch``; the worker held, its node drained, until its counters are read, then
    let go), each task recorded, claimed, run, encoded, uploaded, committed and
    acked. Each side runs twice on half the images, in the order A B B A (``_cell``), so
    a machine whose speed drifts during the cell (a shared host's does, by 10% over
    minutes here) weighs on both alike; Tandem's side is one worker per cell, kept
    across its halves and held between them (``_Held``), the bare loop one process per
    model (``_Bare``: its model built once, a warm-up call a half).
    Both sides count whole batches the same way: in each half, ``images/2 - batch``
    over the window from the first batch's end (bare) or first result (Tandem) to the
    last; a side's rate is the counted images of its two halves over their two windows.
    Goal: Tandem/bare >= 0.95 for each model and batch size. Beside it, the pipeline's
    busy time as a fraction of wall time while the worker drained the backlog, measured
    in the worker (``/healthz`` ``pipeline``: the sum of its pipeline calls over the span
    from the first call's start since the release, ``resumed_start``, to the last call's
    end, summed over both halves); goal >= 0.95. And the CPU the
    rest cost, per image: the worker's CPU beside its compute thread's (encoding, upload,
    the bus), nats-server's and the S3 server's, from ``/proc`` over the drain: on a
    machine with few cores, that is what competes with the pipeline for them.
(d) batching: Tandem's digits images/s at ``--batch`` against batch 1, from (c)'s runs
    (the same whole-batch count on both sides); goal >= 1.8. The bare loop's own
    ratio is given beside it.
(e) workers: 1, 2 and 4 workers (``--workers``) on one cluster's stream, no-op and digits
    tasks (the same workers, ``max_batch`` ``--batch``, one backlog after the other): the
    workers start held (their node drained, looking for a release every 50 ms), the
    backlog is queued, and all are let go at once (undrained); tasks/s from the release
    to the last result, and the scaling against one worker of the same run. Whether any
    worker idled while the stream still had a backlog is shown per worker: its results,
    the tasks its pipeline ran and (for digits) its pipeline's busy fraction from the
    release to the moment the stream's backlog ran out (the consumer's pending count,
    polled), and the machine's CPU over the run (``saturation``): on a small machine the
    digits scaling is bound by cores.

Tandem and bare take turns for each model and batch size (A B B A), the side going first
alternating between repeats (``stats.order``).

``--pin`` gives (c)'s pipeline a CPU of its own, as an accelerator is its own: the worker's
calls run in a child process pinned to the first CPU (``TANDEM_PIPELINE_CPUS``) and the bare
loop runs on that CPU too; the worker's own threads, nats-server and the S3 server run on
the others. On a machine of few cores this is what separates the design
(is the pipeline kept fed, with encoding, upload and bus off its path?) from the
scheduler's placing of bursts of other work on the call's core, which a GPU node's call
never sees. (e) is not pinned.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from typing import TYPE_CHECKING, Any

from tandem.cli.bench import saturation, stats
from tandem.common import fleet, streams
from tandem.common.events import GenerationTask
from tandem.inference_worker.apart import pin as pin_threads

if TYPE_CHECKING:
    from tandem.cli.bench.serve import Bench
    from tandem.cli.devstack import Process
    from tandem.common.bus import Bus

GOAL_PIPELINE = 0.95
GOAL_BUSY = 0.95
GOAL_BATCHING = 1.8
MODELS = ("digits", "tiny-text")
SIZE = 16
GUIDANCE = {"digits": 1.0, "tiny-text": 5.0}  # each model's default
# The first call waits up to this for a whole batch (later ones are whole under a
# backlog without waiting), so every call of a run has the same size.
LINGER = "1.0"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", type=stats.positive_int, default=64,
                   help="images per side, model and batch size for (c) and (d)")
    p.add_argument("--steps", type=stats.positive_int, default=10,
                   help="denoising steps for (c)-(e)")
    p.add_argument("--batch", type=stats.positive_int, default=8,
                   help="the batched side's batch size")
    p.add_argument("--threads", type=stats.whole_number, default=1,
                   help="torch intra-op threads of the "
                   "worker and of the bare loop alike (0: torch's default, one per core)")
    p.add_argument("--workers", default="1,2,4", help="worker counts for (e)")
    p.add_argument("--pipeline-process", action="store_true",
                   help="(c) and (e): the workers run their pipeline calls in a child process "
                   "(TANDEM_PIPELINE_PROCESS=1)")
    p.add_argument("--pin", action="store_true",
                   help="(c): the calls (in a child process) and the bare loop on the first "
                   "CPU, everything else on the others: a CPU of its own, as a device")
    p.add_argument("--worker-tasks", type=stats.positive_int, default=4000,
                   help="no-op tasks per worker count for (e)")
    p.add_argument("--worker-images", type=stats.positive_int, default=192,
                   help="digits images per worker count for (e)")


def check(args: argparse.Namespace) -> None:
    """Refuse sizes whose rates would not count whole batches, and pinning with one CPU."""
    if getattr(args, "pin", False) and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit(f"--pin needs 2 CPUs (one for the calls, the rest for the others); "
                         f"this process may use {sorted(os.sched_getaffinity(0))}")
    if args.batch < 1 or args.images % (2 * args.batch) or args.images < 4 * args.batch:
        raise SystemExit(f"--images {args.images} must be a whole number of batches of "
                         f"--batch {args.batch}, at least two in each half (each side runs "
                         f"twice, on half the images; rates count whole batches)")
    counts = worker_counts(args)
    if args.worker_images % (args.batch * max(counts)) or args.worker_tasks < max(counts):
        raise SystemExit(f"--worker-images {args.worker_images} must be whole batches of "
                         f"--batch {args.batch} for each of {max(counts)} workers, and "
                         f"--worker-tasks {args.worker_tasks} at least one per worker")


def worker_counts(args: argparse.Namespace) -> list[int]:
    try:
        counts = sorted({int(x) for x in args.workers.split(",") if x.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] != 1 or any(c < 1 for c in counts):
        raise SystemExit(f"--workers {args.workers!r}: comma-separated counts, 1 among them")
    return counts


# ---------------------------------------------------------------------------- (c) pipeline


def apart(args: argparse.Namespace) -> dict[str, str]:
    """The worker settings ``--pipeline-process`` asks for."""
    return {"pipeline_process": "1"} if getattr(args, "pipeline_process", False) else {}


def pinned(args: argparse.Namespace) -> tuple[int, list[int]] | None:
    """With ``--pin``: (c)'s pipeline CPU, and the CPUs of everything else."""
    if not getattr(args, "pin", False):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[0], cpus[1:]


def tasks_of(model: str, n: int, steps: int, cluster: str) -> list[GenerationTask]:
    """``n`` single-image tasks of ``model``: seed ``i``, label ``i % 10``, prompt "a red boat
    <i>" (the images the bare loop makes too)."""
    return [GenerationTask(task_id=uuid.uuid4().hex, model=model, seed=i, steps=steps,
                           width=SIZE, height=SIZE, guidance=GUIDANCE[model],
                           class_label=i % 10 if model == "digits" else None,
                           prompt=f"a red boat {i}" if model == "tiny-text" else None,
                           cluster=cluster) for i in range(n)]


class _Held:
    """Tandem's side of one cell: one worker, kept across the cell's two halves as the bare
    side keeps its process (``_Bare``), held (its node drained) whenever its counters are
    read, and let go (undrained) on a queue filled while it was held."""

    def __init__(self, b: Bench, bus: Bus, model: str, batch: int, args: argparse.Namespace,
                 tag: str) -> None:
        self.b, self.bus, self.model, self.batch, self.args = b, bus, model, batch, args
        self.cluster = f"pipe{tag}"
        self.name = f"w-{self.cluster}"
        self.proc: Process | None = None

    async def run(self, n: int) -> dict[str, Any]:
        """One half: the worker drains ``n`` queued single-image tasks; its sums."""
        b, args, pin = self.b, self.args, pinned(self.args)
        await b.hold(self.bus, self.cluster, self.name, [self.name] if self.proc else [],
                     "bench: held until its counters are read")
        tasks = tasks_of(self.model, n, args.steps, self.cluster)
        await b.prefill(self.bus, self.cluster, tasks)
        if self.proc is None:
            self.proc = await b.worker(
                self.name, self.cluster, serve=self.model, max_batch=str(self.batch),
                device="cpu", torch_threads=str(args.threads), linger=LINGER, idle_poll="0.05",
                **apart(args), **({"pipeline_process": "1", "pipeline_cpus": str(pin[0])}
                                  if pin else {}))
        before = (await b.health(self.name))["pipeline"]
        child = before.get("processes", {}).get(self.model)  # the calls' process, when apart
        pids = {"worker": self.proc.pid or 0, "nats-server": b.nats.pid or 0,
                "s3": b.s3.pid or 0, "bench": saturation.this_process,
                **({"pipeline process": child} if child else {})}
        meter = saturation.Meter(pids).start()
        await fleet.undrain(self.bus, self.cluster, self.name)
        rate = await b.drain_rate([t.task_id for t in tasks], 1, batch=self.batch)
        window = meter.stop()
        after = (await b.health(self.name))["pipeline"]
        wall = window.wall_s
        calls = after["calls"] - before["calls"]
        return {"counted": n - self.batch, "window_s": (n - self.batch) / rate,
                "images": after["images"] - before["images"], "calls": calls,
                "whole_batches": calls * self.batch == n,
                "busy_s": after["busy_s"] - before["busy_s"],
                # From the first call since the release (the worker's ``resumed_start``).
                "span_s": after["last_end"] - after["resumed_start"],
                "compute_cpu_s": after["cpu_s"] - before["cpu_s"],
                # The worker's own CPU: with the calls in a child process, all of it is
                # beside them; with one torch thread in the worker, that thread is all of
                # the compute.
                "worker_cpu_s": window.cores["worker"] * wall,
                "nats_cpu_s": window.cores["nats-server"] * wall,
                "s3_cpu_s": window.cores["s3"] * wall,
                "apart": bool(child), "pipeline_cpus": after.get("cpus"),
                "torch_threads": after["torch_threads"], "window": window.json()}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stop(10)


def _tandem_side(halves: list[dict[str, Any]]) -> dict[str, Any]:
    """Tandem's figures over its halves: counted images over their windows, busy seconds
    over their spans, CPU per image over every image."""
    images = sum(h["images"] for h in halves)
    child = halves[0]["apart"]

    def per_image(key: str, minus: str | None = None) -> float | None:
        total = sum(h[key] - (h[minus] if minus else 0) for h in halves)
        return round(total / images * 1e3, 3) if images else None

    slower = min(halves, key=lambda h: h["counted"] / h["window_s"])
    return {
        "images_per_s": round(sum(h["counted"] for h in halves)
                              / sum(h["window_s"] for h in halves), 3),
        "busy": round(sum(h["busy_s"] for h in halves) / sum(h["span_s"] for h in halves), 6),
        "calls": sum(h["calls"] for h in halves), "images": images,
        "whole_batches": all(h["whole_batches"] for h in halves), "apart": child,
        "pipeline_cpus": halves[0]["pipeline_cpus"], "torch_threads": halves[0]["torch_threads"],
        "cpu_per_image": {
            # Wall against CPU of the calls: how much of a call its thread was not on a
            # core (waiting for one, or for the interpreter lock).
            "compute_wall_ms": per_image("busy_s"), "compute_ms": per_image("compute_cpu_s"),
            "worker_rest_ms": per_image("worker_cpu_s", None if child else "compute_cpu_s"),
            "nats_server_ms": per_image("nats_cpu_s"), "s3_ms": per_image("s3_cpu_s")},
        "halves": [round(h["counted"] / h["window_s"], 3) for h in halves],
        "window": slower["window"]}  # the slower half's: what its "why" reads


class _Bare:
    """The bare side's loop of one model: one process (``bare_pipeline``), the model built
    once, a run per half asked for on its stdin (its warm-up call, then the counted ones),
    as a user's own loop would keep its model between batches."""

    def __init__(self, model: str, args: argparse.Namespace) -> None:
        self.model, self.args = model, args
        self.proc: asyncio.subprocess.Process | None = None
        self.err = tempfile.TemporaryFile()  # closed in close

    async def run(self, batch: int, n: int) -> dict[str, Any]:
        """One half: ``n`` images in calls of ``batch``; its sums."""
        if self.proc is None:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tandem.cli.bench.bare_pipeline", "--model",
                self.model, "--steps", str(self.args.steps), "--size", str(SIZE),
                "--guidance", str(GUIDANCE[self.model]), "--threads", str(self.args.threads),
                "--cpus", str(pin[0]) if (pin := pinned(self.args)) else "",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=self.err)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"batch": batch, "images": n}).encode() + b"\n")
        await self.proc.stdin.drain()
        line = await self.proc.stdout.readline()
        if not line:
            self.err.seek(0)
            raise RuntimeError(f"bare pipeline {self.model} batch {batch} failed: "
                               f"{self.err.read().decode(errors='replace')[-2000:]}")
        got = json.loads(line)
        ends = got["ends"]
        return {"counted": n - batch, "window_s": ends[-1] - ends[0], "images": n,
                "calls": len(ends), "cpu_s": got["cpu_s"], "wall_s": got["wall_s"],
                "torch_threads": got["threads"], "cpus": got["cpus"]}

    async def close(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # its loop ends at stdin's end
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        self.err.close()


def _bare_side(halves: list[dict[str, Any]]) -> dict[str, Any]:
    images = sum(h["images"] for h in halves)
    return {"images_per_s": round(sum(h["counted"] for h in halves)
                                  / sum(h["window_s"] for h in halves), 3),
            "calls": sum(h["calls"] for h in halves), "torch_threads": halves[0]["torch_threads"],
            "cpus": halves[0]["cpus"],
            "cpu_per_image_ms": round(sum(h["cpu_s"] for h in halves) / images * 1e3, 3),
            "wall_per_image_ms": round(sum(h["wall_s"] for h in halves) / images * 1e3, 3),
            "halves": [round(h["counted"] / h["window_s"], 3) for h in halves]}


async def _cell(b: Bench, bus: Bus, bare: _Bare, model: str, batch: int,
                args: argparse.Namespace, r: int) -> dict[str, Any]:
    """Both sides of one model and batch size, each in two halves of ``--images``, in the
    order A B B A (A the side going first in repeat ``r``): a machine whose speed drifts
    while the cell runs (other work, a shared host) weighs on both sides alike."""
    half = args.images // 2
    first = stats.order(r, ["tandem", "bare"])
    halves: dict[str, list[dict[str, Any]]] = {"tandem": [], "bare": []}
    held = _Held(b, bus, model, batch, args, f"{r}{MODELS.index(model)}b{batch}")
    try:
        for side in [*first, *reversed(first)]:
            halves[side].append(await held.run(half) if side == "tandem"
                                else await bare.run(batch, half))
    finally:
        await asyncio.to_thread(held.close)
    got = {"tandem": _tandem_side(halves["tandem"]), "bare": _bare_side(halves["bare"])}
    ratio = got["tandem"]["images_per_s"] / got["bare"]["images_per_s"]
    return {**got, "ratio": round(ratio, 3), "order": "".join(
        "TB"[s == "bare"] for s in [*first, *reversed(first)])}


async def _pipeline(b: Bench, bus: Bus, args: argparse.Namespace, r: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    pin = pinned(args)
    # Not this process: the workers it starts would take its CPUs (it waits, mostly: under
    # 0.02 of a core in (c)'s windows, in the figures' "bench").
    others = {"nats-server": b.nats.pid, "s3": b.s3.pid}
    try:
        if pin:  # the servers off the pipeline's CPU, for (c) only
            for pid in others.values():
                assert pid is not None
                pin_threads(set(pin[1]), pid)
        for model in MODELS:
            bare = _Bare(model, args)
            try:
                out[model] = {f"b{batch}": await _cell(b, bus, bare, model, batch, args, r)
                              for batch in (1, args.batch)}
            finally:
                await bare.close()
    finally:
        if pin:
            for pid in others.values():
                assert pid is not None
                pin_threads({pin[0], *pin[1]}, pid)
    big = f"b{args.batch}"
    return {"models": out, "images": args.images, "steps": args.steps, "size": f"{SIZE}x{SIZE}",
            "batch": args.batch, "threads": args.threads,
            "pipeline_process": bool(apart(args) or pin),
            "pinned": {"pipeline": [pin[0]], "others": pin[1]} if pin else None,
            "counted_images": {"b1": args.images - 2, big: args.images - 2 * args.batch},
            # The goals hold for every model: each key is the lowest model's.
            "ratio_b1": min(m["b1"]["ratio"] for m in out.values()),
            "ratio_b8": min(m[big]["ratio"] for m in out.values()),
            "busy": min(m[k]["tandem"]["busy"] for m in out.values() for k in ("b1", big))}


# --------------------------------------------------------------------------- (d) batching


def _batching(pipe: dict[str, Any]) -> dict[str, Any]:
    d = pipe["models"]["digits"]
    big = f"b{pipe['batch']}"
    batched, unbatched = d[big]["tandem"]["images_per_s"], d["b1"]["tandem"]["images_per_s"]
    ratio = batched / unbatched
    bare = d[big]["bare"]["images_per_s"] / d["b1"]["bare"]["images_per_s"]
    return {"model": "digits", "images": pipe["images"], "steps": pipe["steps"],
            "size": pipe["size"], "max_batch": pipe["batch"],
            "counted_images": {"unbatched": pipe["images"] - 2,
                               "batched": pipe["images"] - 2 * pipe["batch"]},
            "batched_images_per_s": batched, "unbatched_images_per_s": unbatched,
            "ratio": round(ratio, 3), "bare_ratio": round(bare, 3),
            "meets_goal": ratio >= GOAL_BATCHING}


# ---------------------------------------------------------------------------- (e) workers


async def _backlog_end(b: Bench, bus: Bus, cluster: str, names: list[str]
                       ) -> tuple[float, dict[str, dict[str, Any]]]:
    """When the stream's backlog ran out: the first poll (every 20 ms) that finds no
    message left to deliver on the lane's consumer (``time.perf_counter``), and each
    worker's pipeline figures read right then."""
    spec = streams.gen_consumer(cluster, lane="interactive")  # the tasks' lane
    while True:
        info = await bus.js.consumer_info(spec.stream, spec.durable)
        if not info.num_pending:
            break
        await asyncio.sleep(0.02)  # polling the consumer's pending count, the backlog
    at = time.perf_counter()
    got = await asyncio.gather(*(b.health(nm) for nm in names))
    return at, {nm: h["pipeline"] for nm, h in zip(names, got, strict=True)}


async def _release(b: Bench, bus: Bus, cluster: str, node: str, names: list[str],
                   tasks: list[GenerationTask], busy: bool) -> dict[str, Any]:
    """Queue ``tasks`` while the workers ``names`` are held (their node drained), let them
    go at once, and measure until every result is in; hold them again after. ``busy``:
    report each worker's pipeline busy fraction (not for no-op tasks: no pipeline)."""
    await b.prefill(bus, cluster, tasks)
    before = {nm: (await b.health(nm))["pipeline"] for nm in names}
    meter = saturation.Meter({**{nm: b.procs_by_name[nm].pid or 0 for nm in names},
                              "nats-server": b.nats.pid or 0, "s3": b.s3.pid or 0,
                              "bench": saturation.this_process}).start()
    ids = [t.task_id for t in tasks]
    t0 = time.perf_counter()
    await fleet.undrain(bus, cluster, node)
    async with asyncio.TaskGroup() as tg:
        watch = tg.create_task(_backlog_end(b, bus, cluster, names))
        await b.drain_rate(ids, 1)
    ended, at_end = watch.result()
    window = meter.stop()
    await b.hold(bus, cluster, node, names, "bench: held until the next backlog")
    n = len(tasks)
    last = max(b.results[i] for i in ids)
    # Polled, the empty stream may be seen after the last result: it was empty by then.
    backlog_s = min(ended, last) - t0
    per_worker = {}
    for nm in names:
        mine = [b.results[i] for i in ids if b.result_worker.get(i) == nm]
        ran = at_end[nm]["busy_s"] + at_end[nm]["running_s"] - before[nm]["busy_s"]
        per_worker[nm] = {
            "tasks": len(mine), "ran_while_backlog": at_end[nm]["images"] - before[nm]["images"],
            "first_result_s": round(min(mine) - t0, 3) if mine else None,
            "last_result_s": round(max(mine) - t0, 3) if mine else None,
            "busy_until_backlog_end": round(ran / backlog_s, 3) if busy and backlog_s > 0
            else None}
    return {"workers": len(names), "tasks": n, "tasks_per_s": round(n / (last - t0), 2),
            "backlog_s": round(backlog_s, 3), "drain_s": round(last - t0, 3),
            "per_worker": per_worker, "window": window.json()}


async def _workers(b: Bench, bus: Bus, args: argparse.Namespace, r: int) -> dict[str, Any]:
    """For each worker count: that many workers, held, serving both kinds; a no-op
    backlog, then a digits one, each released at once."""
    runs: dict[str, dict[str, Any]] = {"noop": {}, "digits": {}}
    for count in worker_counts(args):
        cluster = node = f"w{r}n{count}"
        # Held workers look for a release every idle_poll: 50 ms (not the default
        # 0.5 s), so they start together. max_batch is --batch for both kinds.
        await fleet.drain(bus, cluster, node, reason="bench: held until the backlog is queued")
        names = [f"w-{cluster}-{i}" for i in range(count)]
        await asyncio.gather(*(b.worker(
            nm, cluster, node=node, serve="noop,digits", max_batch=str(args.batch),
            device="cpu", torch_threads=str(args.threads), idle_poll="0.05", **apart(args))
            for nm in names))
        try:
            runs["noop"][str(count)] = await _release(b, bus, cluster, node, names, [
                GenerationTask(task_id=uuid.uuid4().hex, model="noop", noop=True, steps=1,
                               cluster=cluster) for _ in range(args.worker_tasks)], busy=False)
            runs["digits"][str(count)] = await _release(
                b, bus, cluster, node, names,
                tasks_of("digits", args.worker_images, args.steps, cluster), busy=True)
        finally:
            await asyncio.gather(*(asyncio.to_thread(b.procs_by_name[nm].stop, 10)
                                   for nm in names))
    out: dict[str, Any] = {}
    for kind, got in runs.items():
        one = got["1"]["tasks_per_s"]
        out[kind] = {"runs": got, "scaling": {c: round(x["tasks_per_s"] / one, 3)
                                              for c, x in got.items()}}
    return out


# ------------------------------------------------------------------------------- the parts


async def measure(b: Bench, bus: Bus, args: argparse.Namespace, r: int) -> dict[str, Any]:
    """One repeat's (c), (d) and (e)."""
    pipe = await _pipeline(b, bus, args, r)
    return {"pipeline": pipe, "batching": _batching(pipe), "workers": await _workers(
        b, bus, args, r)}


def figures(runs: list[dict[str, Any]], args_batch: int) -> list[stats.Figure]:
    """(c), (d) and (e) as figures over the repeats; a goal not met says what was
    saturated over its median run's drain."""
    big = f"b{args_batch}"
    pin = runs[0]["pipeline"].get("pinned")
    out = []
    for model in MODELS:
        for key in ("b1", big):
            cells = [x["pipeline"]["models"][model][key] for x in runs]
            fig = stats.Figure(
                f"pipeline_{model}_{key}", f"(c) {model}, batch {key[1:]}: Tandem"
                + (" (calls in a child process)" if runs[0]["pipeline"].get("pipeline_process")
                   else "") + " against the bare pipeline"
                + (", both on a CPU of their own" if pin else ""), "img/s",
                [c["tandem"]["images_per_s"] for c in cells],
                [c["bare"]["images_per_s"] for c in cells],
                "the same pipeline in a plain loop, same torch threads"
                + (f", pinned as the calls: {pin}" if pin else ""),
                ratio=[c["ratio"] for c in cells], goal=stats.Goal(">=", GOAL_PIPELINE),
                digits=2)
            # The same process twice in one cell: how far apart the bare loop's own
            # halves are is the noise the ratio's distance from its goal is read against.
            apart_pct = [round((1 - min(c["bare"]["halves"]) / max(c["bare"]["halves"])) * 100,
                               1) for c in cells]
            noise = stats.spread_text(stats.Spread(tuple(apart_pct)).json(1))
            fig.notes.append(f"the bare loop's two halves of a cell (one process, the same "
                             f"work) were {noise} % apart; halves' img/s, Tandem "
                             f"{[c['tandem']['halves'] for c in cells]}, bare "
                             f"{[c['bare']['halves'] for c in cells]}")
            if fig.met is False:
                c = stats.median_run(cells, lambda x: x["ratio"])
                cpu = c["tandem"]["cpu_per_image"]
                fig.why = saturation.why(c["tandem"]["window"], extra=[
                    f"a call took {cpu['compute_wall_ms']} ms per image "
                    + ("in a child process " if c["tandem"].get("apart") else "on a thread ")
                    + f"that was on a core {cpu['compute_ms']} ms of it (bare "
                    f"{c['bare']['wall_per_image_ms']} / {c['bare']['cpu_per_image_ms']} ms); "
                    f"CPU per image beside the calls: the rest of the worker "
                    f"{cpu['worker_rest_ms']} ms, nats-server {cpu['nats_server_ms']} ms, "
                    f"S3 server {cpu['s3_ms']} ms"])
            out.append(fig)
    busy = stats.Figure(
        "pipeline_busy", "(c) pipeline busy under a backlog, lowest of the models and batch "
        "sizes", "fraction", [x["pipeline"]["busy"] for x in runs],
        goal=stats.Goal(">=", GOAL_BUSY, on="tandem"))
    bat = [x["batching"] for x in runs]
    batching = stats.Figure(
        "batching", f"(d) digits, batch {args_batch} against 1 (Tandem)", "img/s",
        [c["batched_images_per_s"] for c in bat], [c["unbatched_images_per_s"] for c in bat],
        "batch 1, same worker settings", ratio=[c["ratio"] for c in bat],
        goal=stats.Goal(">=", GOAL_BATCHING), digits=2,
        notes=[f"the bare loop's own batch {args_batch}/1: "
               f"{stats.spread_text(stats.Spread(tuple(c['bare_ratio'] for c in bat)).json(3))}"])
    out += [busy, batching]
    for kind in ("noop", "digits"):
        counts = list(runs[0]["workers"][kind]["runs"])
        for c in counts[1:]:
            cells = [x["workers"][kind] for x in runs]
            fig = stats.Figure(
                f"workers_{kind}_{c}", f"(e) {kind} tasks, {c} workers on one stream", "tasks/s",
                [x["runs"][c]["tasks_per_s"] for x in cells],
                [x["runs"]["1"]["tasks_per_s"] for x in cells], "1 worker, same run",
                ratio=[x["scaling"][c] for x in cells], digits=1)
            fig.notes.append(saturation.why(stats.median_run(
                cells, lambda x, c=c: x["scaling"][c])["runs"][c]["window"]))
            out.append(fig)
    return out


def render(r: dict[str, Any]) -> list[str]:
    """The lines of (c), (d) and (e) for the bench's text."""
    p, c, w = r["pipeline"], r["batching"], r["workers"]
    lines = [f"(c) against the bare pipeline, {p['size']}, {p['steps']} steps, {p['images']} "
             f"images per side, torch threads {p['threads']} on both sides"
             + (f"; pinned: {p['pinned']}" if p.get("pinned") else "")]
    for model, cells in p["models"].items():
        for key, cell in cells.items():
            t, bare, cpu = cell["tandem"], cell["bare"], cell["tandem"]["cpu_per_image"]
            lines.append(
                f"    {model:9s} batch {key[1:]:>2}: tandem {t['images_per_s']:8.2f} img/s   "
                f"bare {bare['images_per_s']:8.2f} img/s   ratio {cell['ratio']:.3f}   "
                f"busy {t['busy']:.3f}")
            lines.append(
                f"        per image: call {cpu['compute_wall_ms']} ms wall / {cpu['compute_ms']} "
                f"ms CPU (bare {bare['wall_per_image_ms']} / {bare['cpu_per_image_ms']}); "
                f"CPU beside it: rest of the worker {cpu['worker_rest_ms']} ms, nats-server "
                f"{cpu['nats_server_ms']} ms, S3 {cpu['s3_ms']} ms")
    lines += [f"    lowest ratio: batch 1 {p['ratio_b1']:.3f}, batch {p['batch']} "
              f"{p['ratio_b8']:.3f} (goal >= {GOAL_PIPELINE}); lowest busy {p['busy']:.3f} "
              f"(goal >= {GOAL_BUSY})",
              f"(d) batching, {c['model']}: batch {c['max_batch']} {c['batched_images_per_s']:.2f} "
              f"img/s, batch 1 {c['unbatched_images_per_s']:.2f} img/s: ratio {c['ratio']:.2f}x "
              f"(goal >= {GOAL_BATCHING}x; the bare loop's {c['bare_ratio']:.2f}x)",
              "(e) workers on one stream, released together on a queued backlog"]
    for kind, got in w.items():
        for count, run in got["runs"].items():
            shares = ", ".join(
                f"{x['tasks']}" + (f" busy {x['busy_until_backlog_end']:.2f}"
                                   if x["busy_until_backlog_end"] is not None else "")
                for x in run["per_worker"].values())
            lines.append(f"    {kind:6s} x{count}: {run['tasks_per_s']:10.1f} tasks/s "
                         f"(x{got['scaling'][count]:.2f} of one)   per worker: {shares}")
    return lines
