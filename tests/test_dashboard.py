"""The live dashboard at the gateway's ``/``, end to end in headless Chromium.

A real local stack (gateway, an agent and a worker per cluster) runs; the test submits
generations over HTTP, stops west's worker so west's queue builds up, publishes a
training run's step and checkpoint events on the bus (as a trainer does), and then
asserts on what the page shows: both clusters healthy with GPU gauges, west's queue
depth, the run with its loss curve, and the generated images. It saves a screenshot.

Chromium is Debian's package (`apt-get install -y chromium`; `make test` installs it
when run as root), driven by Playwright without `playwright install`.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.cli.stack import Stack
from tandem.cli.stack_config import StackConfig

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--no-first-run"]
REGISTRY = [
    {"name": "digits", "source": "builtin:class-unet", "conditioning": "class_label",
     "num_classes": 10, "default_width": 16, "default_height": 16, "sizes": [16],
     "default_steps": 4, "max_steps": 50},
    {"name": "noop", "source": "noop", "default_steps": 1, "max_steps": 1},
]
SCREENSHOTS = Path(os.environ.get("TANDEM_SCREENSHOTS", "out/screenshots"))


def chromium() -> str:
    """Debian's chromium, or a failure that says how to install it (never a skip)."""
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("Chromium is not installed, so the dashboard cannot be tested end to end. "
                "Install Debian's package: `apt-get install -y chromium` (as root; "
                "`make test` does this itself when run as root).")


def http_json(method: str, url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def wait_for(what: str, cond: Callable[[], Any], timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not true after {timeout:g}s")
        time.sleep(0.3)  # polling a live HTTP endpoint, as the page itself does


def gateway_listening(stack: Stack) -> None:
    """The runner answers /healthz before the gateway's HTTP API binds: wait for it."""

    def up() -> bool:
        try:
            return http_json("GET", f"{stack.url('gateway')}/healthz")["status"] == "ok"
        except OSError:
            return False

    wait_for("the gateway's HTTP API", up, timeout=60)
    clusters = {c.name for c in stack.config.clusters}
    wait_for("every cluster healthy (the gateway routes only to those)", lambda: clusters == {
        c["name"] for c in http_json("GET", f"{stack.url('gateway')}/v1/dashboard")["fleet"][
            "clusters"] if c["healthy"]}, timeout=60)


@pytest.fixture
def stack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    monkeypatch.setenv("TANDEM_MODELS", json.dumps(REGISTRY))
    monkeypatch.setenv("TANDEM_LOG_LEVEL", "warning")
    with open(tmp_path / "stack.log", "w") as sink, Stack(
            StackConfig.load().free_ports(), tmp_path / "stack", sink, grace=5) as s:
        health = s.start(health_timeout=120,
                         services=["gateway", "cluster-agent", "inference-worker"])
        assert set(health.values()) == {"healthy"}, health
        gateway_listening(s)
        yield s


async def publish_training(stack: Stack, run_id: str, steps: int) -> None:
    """A run's record and its step and checkpoint events, as a trainer publishes them."""
    from tandem.common import subjects
    from tandem.common.bus import Bus
    from tandem.common.events import CheckpointManifest, CheckpointWritten, TrainStep
    from tandem.common.runs import submit_run

    bus = await Bus.connect(stack.settings(), "test")
    try:
        await submit_run(bus, {"run_id": run_id, "steps": steps, "ranks": 1,
                               "cluster": "nowhere"})
        for step in range(1, steps + 1):
            await bus.publish(subjects.train(run_id, "step"), TrainStep(
                run_id=run_id, step=step, loss=1.0 / step, step_time=0.05))
        await bus.publish(subjects.train(run_id, "checkpoint"), CheckpointWritten(
            run_id=run_id, step=steps // 2, path="/nowhere",
            manifest=CheckpointManifest(run_id=run_id, step=steps // 2, files=[])))
    finally:
        await bus.drain()


def test_dashboard_shows_clusters_queues_training_and_generations_in_chromium(
        stack: Stack) -> None:
    from playwright.sync_api import sync_playwright

    browser_path = chromium()
    base = stack.url("gateway")
    # Generations on east, then stop west's worker so west's tasks wait in its queue.
    done = [http_json("POST", f"{base}/v1/generations",
                      {"model": "digits", "class_label": d, "cluster": "east", "seed": d})["id"]
            for d in (3, 7)]
    wait_for("east's generations", lambda: all(
        http_json("GET", f"{base}/v1/generations/{t}")["state"] == "succeeded" for t in done))
    stack.kill("west/worker-0")
    for d in range(3):
        http_json("POST", f"{base}/v1/generations",
                  {"model": "digits", "class_label": d, "cluster": "west", "lane": "batch"})
    asyncio.run(publish_training(stack, "dash-run", steps=40))

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100})
            page.goto(f"{base}/")
            expect = 10_000  # ms for the page's own polling to show each fact
            page.wait_for_selector("#status[data-live=true]", timeout=expect)
            for cluster in ("east", "west"):
                page.wait_for_selector(f".cluster[data-cluster={cluster}][data-healthy=true]",
                                       timeout=expect)
            gpus = page.locator(".gpu[data-gpu^='east/node-0/']")
            assert gpus.count() == 2  # the simulated agent's two GPUs, each with a gauge
            assert page.locator(".gpu .gauge").count() >= 4
            page.wait_for_function(
                "() => { const c = document.querySelector(\"tr[data-queue='west/batch'] "
                ".depth\"); return c && Number(c.textContent) === 3; }", timeout=expect)
            run = page.wait_for_selector(".run[data-run=dash-run][data-step='40']",
                                         timeout=expect)
            points = run.query_selector("svg.loss-curve polyline").get_attribute("points")
            assert len(points.split()) == 40  # the whole loss curve, one point per step
            assert run.query_selector("svg.loss-curve line") is not None  # the checkpoint
            for task in done:
                page.wait_for_selector(f".gen[data-task='{task}'] img", timeout=expect)
            page.wait_for_function(  # the images really loaded from S3
                "() => [...document.querySelectorAll('.gen img')]"
                ".every(i => i.complete && i.naturalWidth === 16)", timeout=expect)
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            shot = SCREENSHOTS / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
        finally:
            browser.close()


def test_dashboard_json_and_metrics_expose_queue_gpu_and_training_state(stack: Stack) -> None:
    base = stack.url("gateway")
    stack.kill("east/worker-0")
    http_json("POST", f"{base}/v1/generations",
              {"model": "digits", "class_label": 1, "cluster": "east"})
    asyncio.run(publish_training(stack, "metrics-run", steps=5))

    def state() -> Any:
        s = http_json("GET", f"{base}/v1/dashboard")
        q = {(x["cluster"], x["lane"]): x for x in s["queues"]}
        runs = {r["run_id"]: r for r in s["runs"]}
        ok = (q.get(("east", "interactive"), {}).get("depth") == 1
              and runs.get("metrics-run", {}).get("latest_step") == 5)
        return s if ok else None

    snap = wait_for("dashboard state", state, timeout=30)
    assert {c["name"] for c in snap["fleet"]["clusters"]} == {"east", "west"}
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for line in ('tandem_queue_depth{cluster="east",lane="interactive"} 1.0',
                 'tandem_train_loss{run="metrics-run"} 0.2',
                 'tandem_train_step{run="metrics-run"} 5.0',
                 'tandem_cluster_healthy{cluster="west"} 1.0'):
        assert line in text, line
    assert 'tandem_gpu_utilization_percent{cluster="west",gpu="0",node="node-0"}' in text
    assert 'tandem_queue_oldest_age_seconds{cluster="east",lane="interactive"}' in text
    assert "tandem_train_step_seconds_bucket" in text
    assert 'tandem_checkpoint_blocked_seconds_count{run="metrics-run"} 1.0' in text
