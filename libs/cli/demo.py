"""``tandem demo`` (``make demo``): the local stack and the end-to-end paths built so far.

Interim until the demo issue lands: it starts the local stack (two simulated clusters)
on free ports, runs each path whose services exist, and says plainly what it ran, what
passed, and what is not built yet. Every wait is bounded; it never hangs. Everything
it writes (summary, the stack's logs, generated images) goes under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.cli.dev import add_stack_arguments, load_config
from tandem.cli.stack import Cancelled, Stack

TERMINAL = {"succeeded", "failed", "cancelled"}


@dataclass
class Step:
    name: str
    status: str  # "passed" | "failed" | "skipped"
    detail: str


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo", help="start the local stack and run the end-to-end paths built so far",
        description="Start the local stack (nats-server, S3, every built service, two "
        "simulated clusters) on free ports, run each end-to-end path that exists, print "
        "what ran and what is not built yet, stop everything, and say where the output is.")
    add_stack_arguments(p)
    p.add_argument("--out", type=Path, default=Path("out/demo"),
                   help="output folder: summary, stack logs, images (default out/demo)")
    p.add_argument("--timeout", type=float, default=240.0,
                   help="seconds any one wait may take before the demo gives up on it")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    out: Path = args.out
    root = out / "stack"
    shutil.rmtree(root, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    config = load_config(args).free_ports()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"[demo {time.monotonic() - t0:6.1f}s] {msg}", flush=True)

    say("interim demo: the local stack and whatever end-to-end path exists so far "
        "(the full demo arrives with the demo issue)")
    say(f"starting the local stack, clusters {', '.join(c.name for c in config.clusters)}; "
        f"its logs go to {root / 'stack.log'}")
    steps: list[Step] = []
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "stack.log", "w") as sink:
        stack = Stack(config, root, sink, grace=args.grace)
        try:
            health = stack.start(cancel=stop, health_timeout=args.timeout)
            for name, state in health.items():
                say(f"  {name:<22} {state}")
            for svc, why in stack.missing.items():
                say(f"  {svc:<22} {why}")
            steps.append(_services_step(health))
            for path in (_nodes_step, _generation_step, _training_step):
                if stop.is_set():
                    raise Cancelled("interrupted")
                step = path(stack, health, args.timeout, out, say, stop)
                say(f"{step.name}: {step.status} - {step.detail}")
                steps.append(step)
        except Cancelled:
            say("interrupted; stopping")
            steps.append(Step("demo", "failed", "interrupted"))
        finally:
            say("stopping the stack")
            killed = stack.stop()
            if killed:
                say(f"had to SIGKILL {', '.join(killed)}")
    missing = dict(stack.missing)
    report = _write_summary(out, steps, missing, time.monotonic() - t0)
    say("summary:")
    for line in report:
        print("  " + line)
    say(f"output: {out.resolve()} (summary.txt, stack/stack.log, stack/logs/, images)")
    return 1 if any(s.status == "failed" for s in steps) else 0


def _write_summary(out: Path, steps: list[Step], missing: dict[str, str],
                   elapsed: float) -> list[str]:
    lines = [f"{s.status.upper():<8} {s.name}: {s.detail}" for s in steps]
    lines += [f"{'NOT BUILT':<8} {svc}: {why}" for svc, why in missing.items()]
    lines.append(f"took {elapsed:.1f}s")
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps({
        "steps": [s.__dict__ for s in steps], "not_built": missing, "seconds": elapsed},
        indent=2))
    return lines


def _services_step(health: dict[str, str]) -> Step:
    if not health:
        return Step("services", "skipped", "no service is built yet: servers only")
    bad = {n: s for n, s in health.items() if s != "healthy"}
    if bad:
        return Step("services", "failed",
                    "; ".join(f"{n} {s}" for n, s in bad.items()))
    return Step("services", "passed", f"{len(health)} processes answer /healthz")


# ----------------------------------------------------------------------------------- paths

Say = Callable[[str], None]


def _nodes_step(stack: Stack, health: dict[str, str], timeout: float, out: Path, say: Say,
                stop: threading.Event) -> Step:
    """Every started cluster-agent's heartbeat appears in KV ``nodes``."""
    agents = [c for c in stack.children.values() if c.spec.service == "cluster-agent"]
    if not agents:
        return Step("heartbeats", "skipped", "cluster-agent is not built yet")
    want = {f"{c.spec.cluster}.{c.spec.env['TANDEM_NODE']}" for c in agents}
    say(f"waiting (up to {timeout:g}s) for heartbeats of {', '.join(sorted(want))} "
        "in KV nodes")

    async def wait() -> set[str]:
        import nats
        from nats.js.errors import NoKeysError, NotFoundError

        nc = await nats.connect(stack.nats_url, connect_timeout=5)
        try:
            deadline = time.monotonic() + timeout
            seen: set[str] = set()
            while time.monotonic() < deadline and not stop.is_set():
                try:
                    kv = await nc.jetstream().key_value("nodes")
                    seen = set(await kv.keys())
                except (NoKeysError, NotFoundError):
                    seen = set()
                if want <= seen:
                    break
                await asyncio.sleep(0.5)  # polling KV, as an operator's dashboard would
            return seen
        finally:
            await nc.close()

    seen = asyncio.run(wait())
    if want <= seen:
        return Step("heartbeats", "passed", f"{len(want)} node heartbeats in KV nodes")
    return Step("heartbeats", "failed", f"missing after {timeout:g}s: "
                f"{', '.join(sorted(want - seen))}")


def _http(method: str, url: str, body: dict | None = None, timeout: float = 10) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
        return json.loads(raw) if raw else None


def _requests(models: Any) -> list[dict[str, Any]]:
    """One small request per model with a pipeline, as each one's conditioning wants."""
    items = models.get("models", []) if isinstance(models, dict) else models
    out: list[dict[str, Any]] = []
    for i, model in enumerate(items):
        if model.get("source") == "noop" or str(model.get("name", "")).startswith("fault"):
            continue
        req: dict[str, Any] = {"model": model["name"], "seed": 7 + i, "num_images": 1}
        if model.get("conditioning") == "class_label":
            req["class_label"] = 3
        elif model.get("conditioning") == "text":
            req["prompt"] = "a red circle on a white square"
        out.append(req)
    return out


def _generation_step(stack: Stack, health: dict[str, str], timeout: float, out: Path,
                     say: Say, stop: threading.Event) -> Step:
    """One generation per model through the gateway's HTTP API, waited for, images saved."""
    gw = stack.children.get("gateway")
    if gw is None:
        return Step("generation", "skipped", "gateway is not built yet")
    if not any(c.spec.service == "inference-worker" for c in stack.children.values()):
        return Step("generation", "skipped", "inference-worker is not built yet")
    if health.get("gateway") != "healthy":
        return Step("generation", "failed", f"gateway {health.get('gateway')}")
    base = gw.spec.url or ""
    states: dict[str, dict[str, Any]] = {}
    try:
        requests = _requests(_http("GET", f"{base}/v1/models"))
        if not requests:
            return Step("generation", "skipped", "the gateway lists no model with a pipeline")
        for req in requests:
            say(f"POST {base}/v1/generations {json.dumps(req)}")
            states[_http("POST", f"{base}/v1/generations", req)["id"]] = {"state": "queued"}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not stop.is_set():
            for tid, st in states.items():
                if st.get("state") not in TERMINAL:
                    states[tid] = _http("GET", f"{base}/v1/generations/{tid}")
            if all(st.get("state") in TERMINAL for st in states.values()):
                break
            stop.wait(0.5)  # polling the status URLs, as a client would
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError) as exc:
        return Step("generation", "failed", f"HTTP API error: {exc}")
    done, problems = [], []
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    for tid, st in states.items():
        if st.get("state") not in TERMINAL:
            problems.append(f"task {tid} still {st.get('state')} after {timeout:g}s")
            continue
        if st.get("state") != "succeeded":
            problems.append(f"task {tid} {st.get('state')}: {st.get('reason') or '?'}")
            continue
        for img in st.get("images", []):
            path = images / f"{st['model']}-{tid}-{img['index']}.png"
            try:
                with urllib.request.urlopen(img["url"], timeout=30) as resp:
                    path.write_bytes(resp.read())
            except (urllib.error.URLError, OSError) as exc:
                problems.append(f"image of {tid} not downloadable: {exc}")
                continue
            done.append(f"{st['model']} on {st['cluster']} -> images/{path.name}")
    if problems:
        return Step("generation", "failed", "; ".join(problems))
    return Step("generation", "passed", "; ".join(done))


# A run small enough for the interim demo on two CPU cores: two checkpoints.
DEMO_RUN = {"steps": 20, "checkpoint_every": 10, "ranks": 1, "batch_size": 16,
            "warmup_steps": 0, "device": "cpu"}


def _training_step(stack: Stack, health: dict[str, str], timeout: float, out: Path,
                   say: Say, stop: threading.Event) -> Step:
    """A short training run: trained by the trainer, its checkpoints committed to S3."""
    services = {c.spec.service for c in stack.children.values()}
    for svc in ("trainer", "checkpointer"):
        if svc not in services:
            return Step("training", "skipped", f"{svc} is not built yet")
    from tandem.common import log
    from tandem.common.bus import Bus
    from tandem.common.runs import get_run, submit_run

    log.configure("json", "error")  # the demo's console is for the demo's own lines
    terminal = {"succeeded", "failed", "cancelled"}

    async def run() -> Step:
        bus = await Bus.connect(stack.settings(), "demo")
        try:
            rec = await submit_run(bus, DEMO_RUN)
            say(f"submitted training run {rec.run_id}: {json.dumps(DEMO_RUN)}; waiting up to "
                f"{timeout:g}s for it to finish and its last checkpoint to be committed")
            deadline = time.monotonic() + timeout
            seen = ""
            while time.monotonic() < deadline and not stop.is_set():
                rec = await get_run(bus, rec.run_id)
                if rec.state.value != seen:
                    seen = rec.state.value
                    say(f"  run {rec.run_id}: {seen} (step {rec.latest_step})")
                committed = rec.latest_checkpoint_step or 0
                if rec.state.value in terminal and (
                        rec.state.value != "succeeded" or committed >= DEMO_RUN["steps"]):
                    break
                await asyncio.sleep(0.5)  # polling KV runs, as `tandem train status` does
            else:
                return Step("training", "failed", f"run {rec.run_id} {rec.state.value} at "
                            f"step {rec.latest_step}, committed checkpoint "
                            f"{rec.latest_checkpoint_step} after {timeout:g}s")
            if rec.state.value != "succeeded":
                why = rec.incidents[-1] if rec.incidents else "no incident recorded"
                return Step("training", "failed", f"run {rec.run_id} {rec.state.value}: {why}")
            return Step("training", "passed", f"run {rec.run_id} trained {rec.latest_step} "
                        f"steps; checkpoint step {rec.latest_checkpoint_step} committed at "
                        f"{rec.latest_checkpoint_uri}")
        finally:
            await bus.drain()

    return asyncio.run(run())
