"""``tandem demo`` (``make demo``): the main job, end to end, on the local stack.

1. Start the local stack (nats-server, S3, every service, clusters east and west) on
   free ports, so it runs beside a ``tandem dev up``.
2. Train the class-conditional digits model (scikit-learn's bundled digits) long enough
   that its samples are readable; midway, SIGKILL a training rank (an incident the
   trainer recovers from by itself, resuming from the newest checkpoint). The
   checkpointer mirrors each checkpoint to S3.
3. The model registry serves ``digits`` from ``run:<run_id>``: the inference workers of
   both clusters load the newest committed checkpoint; one request pinned to each
   cluster shows which checkpoint step each one serves.
4. Generate a grid of every digit through the gateway's HTTP API, with a backlog of more
   tasks queued on east; once east has started on them, SIGKILL all of east (agent and
   worker) and watch the backlog finish on west (cross-cluster failover). If it does
   not within ``--failover-timeout``, east is restarted so nothing is left behind, and
   the report says so.
5. Stop everything (services drain first, then S3 and NATS), write ``demo.json`` and
   the report (``report.html`` with its PNGs), and print where they are.

Every wait is bounded by ``--timeout``; Ctrl-C stops the stack cleanly. The stack's own
logs are under ``<out>/stack/``.

One module past ~450 lines on purpose: ``Demo`` is the five steps above, in that
order, one method each, and reads top to bottom like this list; what it shows and
records (console, record, recorder) is in ``tandem.cli.demo_record``, what it trains
and generates and its options in ``tandem.cli.demo_plan``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

from tandem.cli.demo_plan import MODEL, TERMINAL, DemoPlan, add_arguments, plan_from_args
from tandem.cli.demo_record import Console, PhaseFailed, Record, Recorder
from tandem.cli.dev import load_config
from tandem.cli.stack import Cancelled, Stack
from tandem.common import subjects


def register(sub: argparse._SubParsersAction) -> None:
    add_arguments(sub).set_defaults(func=_demo)


# ------------------------------------------------------------------------------ console


class Demo:
    def __init__(self, stack: Stack, plan: DemoPlan, record: Record, out: Path,
                 console: Console, stop: threading.Event, timeout: float) -> None:
        self.stack = stack
        self.plan = plan
        self.rec = record
        self.out = out
        self.c = console
        self.stop = stop
        self.timeout = timeout
        self.base = stack.url("gateway") or ""
        self.bus: Any = None
        self.http: Any = None
        self.worker_cluster: dict[str, str] = {}  # worker pid -> cluster

    def _check(self) -> None:
        if self.stop.is_set():
            raise Cancelled("interrupted")

    async def _wait(self, what: str, cond: Any, interval: float = 0.5,
                    timeout: float | None = None) -> Any:
        """Poll ``cond()`` (async) until truthy; PhaseFailed after the timeout."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            self._check()
            value = await cond()
            if value:
                return value
            if time.monotonic() > deadline:
                raise PhaseFailed(f"{what}: not done after {limit:g}s")
            await asyncio.sleep(interval)  # polling the stack's own state, as a client does

    async def run(self) -> None:
        import httpx

        from tandem.common import log
        from tandem.common.bus import Bus

        log.configure("json", "error")  # the console is for the demo's own lines
        self.bus = await Bus.connect(self.stack.settings(), "demo")
        recorder = Recorder(self.bus.nc, self.rec)
        await recorder.start()
        self.recorder = recorder
        from tandem.client import HttpClient, NatsClient

        try:
            # Jobs go in as any client's would (tandem.client): training through the NATS
            # job service, generations through the HTTP API.
            self.jobs = HttpClient(self.base)
            self.train_jobs = await NatsClient.connect(self.stack.settings().nats_url)
            async with httpx.AsyncClient(base_url=self.base, timeout=30) as http:
                self.http = http
                for name, phase in (("fleet", self.fleet), ("training", self.training),
                                    ("serving", self.serving),
                                    ("generation and failover", self.generation)):
                    self._check()
                    t = time.monotonic()
                    try:
                        detail = await phase()
                    except PhaseFailed as exc:
                        self._result(name, "failed", str(exc), t)
                        break
                    except (httpx.HTTPError, OSError) as exc:
                        self._result(name, "failed", f"HTTP API error: {exc!r}", t)
                        break
                    self._result(name, "passed", detail, t)
        finally:
            await recorder.stop()
            for client in (getattr(self, "jobs", None), getattr(self, "train_jobs", None)):
                if client is not None:
                    await client.close()
            with contextlib.suppress(Exception):
                await self.bus.drain()

    def _result(self, name: str, status: str, detail: str, t: float) -> None:
        self.rec.results.append({"phase": name, "status": status, "detail": detail,
                                 "seconds": round(time.monotonic() - t, 1)})
        self.c.say(f"{name}: {status.upper()} - {detail}")

    # ---------------------------------------------------------------------------- fleet

    async def fleet(self) -> str:
        from tandem.common.fleet import read_fleet

        want = {c.name for c in self.stack.config.clusters}
        self.c.say(f"waiting for the agents' heartbeats (clusters {', '.join(sorted(want))})")

        async def healthy() -> Any:
            view = await read_fleet(self.bus)
            ok = {c.name for c in view.clusters if c.healthy}
            return view if want <= ok else None

        view = await self._wait("heartbeats of every cluster", healthy)
        gpus = sum(c.gpus_total for c in view.clusters)
        self.rec.mark("fleet up")
        return (f"{len(view.clusters)} clusters healthy, "
                f"{sum(c.nodes_up for c in view.clusters)} nodes, {gpus} simulated GPUs")

    # ------------------------------------------------------------------------- training

    async def training(self) -> str:
        from tandem.client import JobError
        from tandem.common.runs import get_run

        p = self.plan
        try:
            submitted = await self.train_jobs.train(**p.run_config(self.rec.run_id))
        except JobError as exc:
            raise PhaseFailed(f"tandem.jobs.train: {exc}") from None
        run_id = submitted["run_id"]
        self.rec.mark(f"training run {run_id} submitted")
        self.c.say(f"training run {run_id}: {p.steps} steps, batch {p.batch_size}, "
                   f"lr {p.lr:g}, EMA {p.ema_decay}, checkpoint every {p.checkpoint_every}; "
                   "the checkpointer mirrors each checkpoint to S3")
        # Between two checkpoints, so the restart visibly replays the steps since the last.
        kill_at = (p.steps // 2 + p.checkpoint_every // 4) if p.incident else None
        killed = False
        deadline = time.monotonic() + self.timeout
        while True:
            self._check()
            run = await get_run(self.bus, run_id)
            loss = self.recorder.last_loss
            self.c.bar("training", self.recorder.last_step, p.steps,
                       f"loss {loss:.4f}" if loss is not None else run.state.value)
            if (kill_at is not None and not killed and self.recorder.last_step >= kill_at
                    and run.latest_checkpoint_step):
                killed = self._kill_rank(run)
            done = run.state.value in TERMINAL
            if done and (run.state.value != "succeeded"
                         or (run.latest_checkpoint_step or 0) >= p.steps):
                break
            if time.monotonic() > deadline:
                raise PhaseFailed(f"run {run_id} {run.state.value} at step "
                                  f"{run.latest_step} (committed checkpoint "
                                  f"{run.latest_checkpoint_step}) after {self.timeout:g}s")
            await asyncio.sleep(0.5)  # polling KV runs, as `tandem train status` does
        self.rec.run = _builtins(run)
        self.rec.mark(f"training {run.state.value}")
        if run.state.value != "succeeded":
            from tandem.cli.train import format_incident

            # One line, as `tandem train status` gives it (the whole incident, ranks'
            # stacks and all, is in demo.json and the report).
            why = format_incident(run.incidents[-1]) if run.incidents else \
                "no incident recorded"
            raise PhaseFailed(f"run {run.run_id} {run.state.value} after {run.restarts} "
                              f"restart(s): {why}")
        g = run.goodput.get("goodput")
        return (f"run {run.run_id} trained {run.latest_step} steps with {run.restarts} "
                f"restart(s); newest committed checkpoint step {run.latest_checkpoint_step} "
                f"({run.latest_checkpoint_uri})"
                + (f"; goodput {g:.1%}" if g is not None else ""))

    def _kill_rank(self, run: Any) -> bool:
        pids = [r.get("pid") for r in run.ranks if r.get("pid")]
        if not pids:
            return False
        pid = int(pids[0])
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
            self.rec.mark(f"incident: SIGKILL training rank 0 (pid {pid}) at step "
                          f"{self.recorder.last_step}")
            self.c.say(f"incident: SIGKILL training rank 0 (pid {pid}) at step "
                       f"{self.recorder.last_step}; the trainer should restart it from "
                       f"checkpoint step {run.latest_checkpoint_step}")
            return True
        return False

    # -------------------------------------------------------------------------- serving

    async def _submit(self, body: dict[str, Any]) -> dict[str, Any]:
        from tandem.client import JobError

        try:
            return await self.jobs.generate(**body)
        except JobError as exc:
            raise PhaseFailed(f"POST /v1/generations {json.dumps(body)}: {exc}") from None

    async def _states(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        return {tid: await self.jobs.status(tid) for tid in ids}

    async def serving(self) -> str:
        """One small request pinned to each cluster: each cluster's worker loads the
        newest committed checkpoint of the run and says which step it is."""
        clusters = [c.name for c in self.stack.config.clusters]
        want = self.rec.run.get("latest_checkpoint_step")
        ids = {}
        for c in clusters:
            acc = await self._submit({"model": MODEL, "class_label": 0, "seed": 1,
                                      "cluster": c, "lane": "interactive"})
            ids[acc["id"]] = c
        self.c.say(f"asked each cluster ({', '.join(clusters)}) for one image: each worker "
                   f"loads run {self.rec.run_id}'s newest committed checkpoint")

        async def done() -> Any:
            st = await self._states(list(ids))
            return st if all(s["state"] in TERMINAL for s in st.values()) else None

        states = await self._wait("one generation per cluster", done)
        problems = []
        for tid, s in states.items():
            cluster = ids[tid]
            self.rec.serving[cluster] = {"worker": s["worker"], "checkpoint": s["checkpoint"],
                                         "checkpoint_step": s["checkpoint_step"],
                                         "state": s["state"], "reason": s["reason"]}
            if s["state"] != "succeeded":
                problems.append(f"{cluster}: {s['state']} {s['reason']}")
            elif s["checkpoint_step"] != want:
                problems.append(f"{cluster} serves step {s['checkpoint_step']}, not the "
                                f"newest ({want})")
        if problems:
            raise PhaseFailed("; ".join(problems))
        self.rec.mark("both clusters serve the newest checkpoint")
        return "; ".join(f"{c} serves {v['checkpoint']} ({v['worker']})"
                         for c, v in sorted(self.rec.serving.items()))

    # ---------------------------------------------------------------------- generation

    async def generation(self) -> str:
        p = self.plan
        clusters = [c.name for c in self.stack.config.clusters]
        victim = clusters[0] if p.failover and len(clusters) > 1 else None
        tasks: dict[str, dict[str, Any]] = {}
        # The first result from the victim's queue is the moment to kill it: in the middle
        # of its work, however fast that work goes (an event, not a poll that may miss it).
        first_result = asyncio.Event()
        subs = [await self.bus.nc.subscribe(subjects.TASK_RECORD.wildcard,
                                            cb=self._first_result(victim, first_result))]
        self._note_workers()
        try:
            return await self._generate(tasks, clusters, victim, first_result)
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    def _note_workers(self) -> None:
        """Which cluster each worker process is in (worker ids end in their pid)."""
        for child in self.stack.children.values():
            if child.spec.service == "inference-worker" and child.pid:
                self.worker_cluster[str(child.pid)] = child.spec.cluster

    def ran_on(self, worker: str) -> str:
        return self.worker_cluster.get(worker.rsplit("-", 1)[-1], "")

    @staticmethod
    def _first_result(victim: str | None, seen: asyncio.Event) -> Any:
        async def on_result(msg: Any) -> None:  # each write of a record: its success
            from tandem.common.tasks import succeeded

            rec = succeeded(msg.data)
            if rec is not None and rec.cluster == victim:
                seen.set()

        return on_result

    async def _generate(self, tasks: dict[str, dict[str, Any]], clusters: list[str],
                        victim: str | None, first_result: asyncio.Event) -> str:
        p = self.plan
        # The grid: one request per digit, spread over the clusters, batch lane.
        for digit in range(10):
            cluster = clusters[digit % len(clusters)]
            acc = await self._submit({"model": MODEL, "class_label": digit,
                                      "num_images": p.images_per_digit, "seed": 1000 + digit,
                                      "cluster": cluster, "lane": "batch"})
            tasks[acc["id"]] = {"kind": "grid", "digit": digit, "routed": cluster}
        # The backlog east is working through when it dies.
        for i in range(p.backlog if victim else 0):
            acc = await self._submit({"model": MODEL, "class_label": i % 10, "seed": 5000 + i,
                                      "cluster": victim, "lane": "batch"})
            tasks[acc["id"]] = {"kind": "backlog", "digit": i % 10, "routed": victim}
        self.rec.mark(f"{len(tasks)} generation tasks queued")
        self.c.say(f"queued {len(tasks)} tasks over HTTP: a grid of every digit "
                   f"({p.images_per_digit} images each)"
                   + (f" and a backlog of {p.backlog} more on {victim}" if victim else ""))
        ids = list(tasks)
        states: dict[str, dict[str, Any]] = {}
        killed_at: float | None = None
        restarted = False
        deadline = time.monotonic() + self.timeout
        # The kill follows east's first result at once, not the next poll of the status
        # URLs: east works through its backlog in about a second at the test's settings,
        # and a kill that waited for the poll (up to 0.5 s, plus the poll) once found it
        # all done, with nothing left to strand.
        killing = (asyncio.ensure_future(self._kill_on(first_result, victim, ids))
                   if victim else None)
        try:
            while True:
                self._check()
                if killing is not None and killed_at is None and killing.done():
                    killed_at = killing.result()
                states = await self._states(ids)
                finished = sum(s["state"] in TERMINAL for s in states.values())
                self.c.bar("generation", finished, len(ids),
                           f"{victim} killed" if killed_at else "")
                if finished == len(ids):
                    break
                if (killed_at and not restarted
                        and time.time() - killed_at > p.failover_timeout):
                    restarted = await self._restart(victim or "")
                if time.monotonic() > deadline:
                    raise PhaseFailed(f"{len(ids) - finished} of {len(ids)} tasks unfinished "
                                      f"after {self.timeout:g}s")
                await asyncio.sleep(0.5)  # polling the status URLs, as a client would
            if killing is not None and killed_at is None and first_result.is_set():
                killed_at = await killing  # the kill began: it ends in a moment
        finally:
            if killing is not None and not killing.done():
                killing.cancel()
        self._collect(tasks, states)
        if killed_at is not None:
            self._failover_figures(victim or "", killed_at, restarted)
            if not restarted:
                # Bring east back for the rest of the demo (and to show it rejoins).
                await self._restart(victim or "", why="rejoins after the backlog finished")
        failed = [s for s in states.values() if s["state"] != "succeeded"]
        if failed:
            raise PhaseFailed(f"{len(failed)} tasks did not succeed: "
                              + "; ".join(f"{s['id']} {s['state']} {s['reason']}"
                                          for s in failed[:3]))
        await self._download_grid(tasks, states)
        by: dict[str, int] = {}
        for g in self.rec.generations:
            where = g["ran_on"] or g["cluster"]
            by[where] = by.get(where, 0) + 1
        f = self.rec.failover
        detail = (f"{len(ids)} tasks succeeded ("
                  + ", ".join(f"{n} ran on {c}" for c, n in sorted(by.items())) + ")")
        if f:
            detail += (f"; {victim} killed with {f['stranded']} of its tasks unfinished: "
                       + (f"failover took {f['failover_s']:.1f}s, {f['finished_elsewhere']} "
                          f"finished on other clusters" if f.get("failover_s") is not None
                          else "no failover: they finished after it was restarted"))
        return detail

    async def _kill_on(self, first_result: asyncio.Event, victim: str, ids: list[str]
                       ) -> float:
        await first_result.wait()
        return await self._kill_cluster(victim, ids)

    async def _kill_cluster(self, victim: str, ids: list[str]) -> float:
        names = await asyncio.to_thread(self.stack.kill, victim)
        at = time.time()
        states = await self._states(ids)
        stranded = [t for t, s in states.items() if s["cluster"] == victim
                    and s["state"] not in TERMINAL]
        self.rec.failover = {"cluster": victim, "killed_at": at, "processes": names,
                             "stranded_ids": stranded, "stranded": len(stranded)}
        self.rec.mark(f"SIGKILL cluster {victim} ({', '.join(names)}) with "
                      f"{len(stranded)} tasks unfinished")
        self.c.say(f"SIGKILL every process of cluster {victim} ({', '.join(names)}) with "
                   f"{len(stranded)} of its tasks unfinished")
        return at

    async def _restart(self, victim: str, why: str = "") -> bool:
        why = why or (f"its backlog did not move elsewhere within "
                      f"{self.plan.failover_timeout:g}s")
        self.c.say(f"restarting cluster {victim}: {why}")
        await asyncio.to_thread(self.stack.restart, victim)
        self._note_workers()
        self.rec.failover.setdefault("restarted_at", time.time())
        self.rec.failover["restart_reason"] = why
        self.rec.mark(f"cluster {victim} restarted ({why})")
        return True

    def _collect(self, tasks: dict[str, Any], states: dict[str, Any]) -> None:
        for tid, s in states.items():
            self.rec.generations.append({
                "id": tid, **tasks[tid], "state": s["state"], "cluster": s["cluster"],
                "worker": s["worker"], "ran_on": self.ran_on(s["worker"]),
                "checkpoint": s["checkpoint"],
                "checkpoint_step": s["checkpoint_step"], "attempts": s["attempts"],
                "created_at": _ts(s["created_at"]), "started_at": _ts(s["started_at"]),
                "finished_at": _ts(s["finished_at"]), "num_images": s["params"]["num_images"]})

    def _failover_figures(self, victim: str, killed_at: float, restarted: bool) -> None:
        f = self.rec.failover
        stranded = [g for g in self.rec.generations if g["id"] in set(f["stranded_ids"])]
        elsewhere = [g for g in stranded if g["ran_on"] not in ("", victim)]
        restart_at = f.get("restarted_at")
        # The record's start is its first worker's: a task the victim had started keeps
        # the victim's, so the first start elsewhere is a queued task's.
        first = min((g["started_at"] for g in elsewhere
                     if g["started_at"] is not None and g["started_at"] >= killed_at),
                    default=None)
        f.update(finished_elsewhere=len(elsewhere),
                 finished_after_restart=len(stranded) - len(elsewhere),
                 failover_s=(first - killed_at) if first is not None else None,
                 backlog_done_s=max((g["finished_at"] or killed_at for g in stranded),
                                    default=killed_at) - killed_at,
                 restarted_for_backlog=bool(restart_at) and not elsewhere)

    async def _download_grid(self, tasks: dict[str, Any], states: dict[str, Any]) -> None:
        images = self.out / "images"
        shutil.rmtree(images, ignore_errors=True)
        images.mkdir(parents=True)
        grid = [t for t in tasks if tasks[t]["kind"] == "grid"]
        for tid in grid:
            digit = tasks[tid]["digit"]
            for ref in states[tid]["images"]:
                r = await self.http.get(ref["url"])
                r.raise_for_status()
                (images / f"digit{digit}-{ref['index']}.png").write_bytes(r.content)
        steps = {states[t]["checkpoint_step"] for t in grid}
        self.rec.serving["grid"] = {"checkpoint_steps": sorted(s for s in steps if s is not None),
                                    "images": str(images)}


def _ts(value: str | None) -> float | None:
    if not value:
        return None
    from datetime import datetime

    return datetime.fromisoformat(value).timestamp()


def _builtins(obj: Any) -> dict[str, Any]:
    import msgspec

    return msgspec.to_builtins(obj)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------- main


def _demo(args: argparse.Namespace) -> int:
    out: Path = args.out
    plan = plan_from_args(args)
    root = out / "stack"
    shutil.rmtree(root, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    config = load_config(args).free_ports()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    console = Console()
    say = console.say
    run_id = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    record = Record(run_id=run_id, plan=dict(plan.__dict__))
    # The stack's services inherit this process's TANDEM_* settings: the gateway and
    # the workers read the same registry, whose digits model is this run's checkpoints.
    os.environ["TANDEM_MODELS"] = json.dumps(plan.registry(run_id))
    os.environ["TANDEM_PRELOAD"] = "false"  # no checkpoint exists until training writes one
    say(f"starting the local stack (clusters {', '.join(c.name for c in config.clusters)}) "
        f"on free ports; its logs go to {root}")
    root.mkdir(parents=True, exist_ok=True)
    code = 1
    with open(root / "stack.log", "w") as sink:
        stack = Stack(config, root, sink, grace=args.grace)
        try:
            health = stack.start(cancel=stop, health_timeout=args.timeout)
            bad = {n: s for n, s in health.items() if s != "healthy"}
            missing = dict(stack.missing)
            record.stack = {"processes": health, "not_built": missing,
                            "gateway": stack.url("gateway"), "nats": stack.nats_url}
            for name, state in health.items():
                say(f"  {name:<22} {state}")
            if bad or missing:
                record.results.append({"phase": "stack", "status": "failed", "detail": "; ".join(
                    [f"{n} {s}" for n, s in bad.items()]
                    + [f"{n} {w}" for n, w in missing.items()]), "seconds": 0})
                say(f"stack: FAILED - {record.results[-1]['detail']}")
            else:
                say(f"stack up: gateway {stack.url('gateway')} (dashboard at /), "
                    f"NATS {stack.nats_url}")
                record.mark("stack up")
                demo = Demo(stack, plan, record, out, console, stop, args.timeout)
                asyncio.run(demo.run())
        except Cancelled:
            say("interrupted; stopping")
            record.results.append({"phase": "demo", "status": "failed",
                                   "detail": "interrupted", "seconds": 0})
        finally:
            say("stopping the stack: services drain first, then S3 and NATS")
            killed = stack.stop()
            record.mark("stack stopped")
            say("stopped" + (f"; had to SIGKILL {', '.join(killed)}" if killed else " cleanly"))
    record.finished_at = time.time()
    (out / "demo.json").write_text(json.dumps(record.to_json(), indent=1))
    ok = bool(record.results) and all(r["status"] == "passed" for r in record.results)
    code = 0 if ok else 1
    try:
        from tandem.cli.report import write_report

        report = write_report(out)
    except Exception as exc:  # the record is kept either way
        say(f"report: could not be written: {exc!r}")
        report = None
    say("summary:")
    for r in record.results:
        print(f"  {r['status'].upper():<7} {r['phase']} ({r['seconds']:g}s): {r['detail']}")
    print(f"  took {time.monotonic() - console.t0:.0f}s")
    if report is not None:
        say(f"report: {report.resolve()}")
    say(f"output: {out.resolve()} (report.html, demo.json, images/, stack/logs/)")
    return code
