"""Traces and metrics: one trace per generation across gateway and worker, OTLP export.

A tiny OTLP/HTTP receiver runs in the test (``observability_support.Receiver``).
The gateway and the worker run as real processes of a one-cluster local stack with
``TANDEM_OTLP_ENDPOINT`` pointing at it; a generation submitted over HTTP must arrive as
one trace holding the gateway's admission and the worker's phases, and every phase must
also show on the services' /metrics.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.cli.stack import Stack
from tandem.cli.stack_config import StackConfig

from .observability_support import SERVER, Receiver, metric_names, tandem_metrics
from .test_dashboard import REGISTRY, gateway_listening, http_json, wait_for

WORKER_PHASES = {"queue wait", "batching", "model load", "denoising", "upload"}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def traced_stack(tmp_path: Path, receiver: Receiver,
                 monkeypatch: pytest.MonkeyPatch) -> Iterator[Stack]:
    monkeypatch.setenv("TANDEM_MODELS", json.dumps(REGISTRY))
    monkeypatch.setenv("TANDEM_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # export within 0.2 s, not 5 s
    config = StackConfig.load().with_clusters(["east"]).free_ports()
    with open(tmp_path / "stack.log", "w") as sink, Stack(
            config, tmp_path / "stack", sink, grace=5) as s:
        health = s.start(health_timeout=120, services=["gateway", "cluster-agent",
                                                             "inference-worker"])
        assert set(health.values()) == {"healthy"}, health
        gateway_listening(s)
        yield s


def metrics_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def test_one_generation_is_one_trace_across_gateway_and_worker_exported_over_otlp(
        traced_stack: Stack, receiver: Receiver) -> None:
    base = traced_stack.url("gateway")
    task = http_json("POST", f"{base}/v1/generations",
                     {"model": "digits", "class_label": 4, "steps": 3})["id"]
    wait_for("the generation", lambda: http_json(
        "GET", f"{base}/v1/generations/{task}")["state"] == "succeeded", timeout=120)

    def complete() -> list[dict[str, Any]] | None:
        spans = receiver.trace(task)
        names = {s["name"] for s in spans}
        return spans if {"admission", "POST /v1/generations", "gen process"} | WORKER_PHASES \
            <= names else None

    spans = wait_for("the trace of the generation", complete, timeout=30)
    assert len({s["trace"] for s in spans}) == 1  # one trace, not one per service
    # One server span for the request (FastAPI's), not one more of the gateway's own.
    assert [s["name"] for s in spans if s["kind"] == SERVER] == ["POST /v1/generations"]
    by_name = {s["name"]: s for s in spans}
    assert by_name["admission"]["service"] == "tandem-gateway"
    assert by_name["POST /v1/generations"]["service"] == "tandem-gateway"
    assert by_name["admission"]["parent"] in {s["span"] for s in spans
                                              if s["name"] == "POST /v1/generations"}
    for name in WORKER_PHASES:
        assert by_name[name]["service"] == "tandem-inference-worker", name
        assert by_name[name]["end"] >= by_name[name]["start"], name
    # The worker's phases hang under its consumer span, which descends from admission.
    process = by_name["gen process"]
    parents = {s["span"]: s for s in spans}
    chain, at = [], process
    while at["parent"] in parents:
        at = parents[at["parent"]]
        chain.append(at["name"])
    assert "admission" in chain, chain  # (FastAPI may add its own spans in between)
    assert all(by_name[n]["parent"] == process["span"] for n in WORKER_PHASES)
    assert by_name["denoising"]["attrs"]["tandem.batch.images"].int_value == 1
    # The phases are ordered as the task lived them.
    order = ["queue wait", "batching", "denoising", "upload"]
    starts = [by_name[n]["start"] for n in order]
    assert starts == sorted(starts)

    worker = traced_stack.children["east/worker-0"].spec.health_url.replace("/healthz",
                                                                            "/metrics")
    text = metrics_text(worker)
    for phase in ("queue_wait", "batching", "model_load", "denoising", "upload"):
        assert f'tandem_generation_phase_seconds_count{{phase="{phase}"}} 1.0' in text, phase
    assert "tandem_worker_batch_images_bucket" in text
    assert 'tandem_generation_phase_seconds_count{phase="admission"} 1.0' in metrics_text(
        f"{base}/metrics")


def test_a_job_door_generation_is_one_trace_from_the_gateway_s_server_span(
        traced_stack: Stack, receiver: Receiver) -> None:
    """A job asked for on NATS (``tandem.jobs.generate``) gets the gateway's server span,
    and the worker's spans descend from it: no span's parent is one never exported."""
    import asyncio

    from tandem.common import subjects
    from tandem.common.bus import Bus

    async def generate() -> str:
        bus = await Bus.connect(traced_stack.settings(), "test")
        try:
            reply = await bus.nc.request(subjects.jobs("generate"), json.dumps(
                {"model": "digits", "class_label": 2, "steps": 3}).encode(), timeout=30)
        finally:
            await bus.drain()
        return json.loads(reply.data)["id"]

    task = asyncio.run(generate())
    base = traced_stack.url("gateway")
    wait_for("the generation", lambda: http_json(
        "GET", f"{base}/v1/generations/{task}")["state"] == "succeeded", timeout=120)

    def complete() -> list[dict[str, Any]] | None:
        spans = receiver.trace(task)
        return spans if {"tandem-jobs/generate", "gen process"} | WORKER_PHASES <= {
            s["name"] for s in spans} else None

    spans = wait_for("the trace of the generation", complete, timeout=30)
    [server] = [s for s in spans if s["kind"] == SERVER]
    assert (server["name"], server["service"]) == ("tandem-jobs/generate", "tandem-gateway")
    assert server["attrs"]["tandem.jobs.status"].int_value == 200
    assert server["parent"] == ""  # the request carried no trace: the gateway's is the root
    ids = {s["span"] for s in spans}
    assert [s["name"] for s in spans if s["parent"] and s["parent"] not in ids] == []


def test_spans_are_exported_only_when_an_endpoint_is_set(tmp_path: Path) -> None:
    """Without TANDEM_OTLP_ENDPOINT nothing is built or sent; with it, spans leave the
    process over OTLP/HTTP (a child process, so the global tracer provider is fresh)."""
    import subprocess
    import sys

    from .conftest import ROOT, service_env

    r = Receiver()
    try:
        script = (
            "import sys\n"
            "from tandem.common import tracing\n"
            "tracing.configure('probe', sys.argv[1] or None)\n"
            "print(tracing.recording())\n"
            "tracing.span_between('probe phase', 1.0, 2.0, {'k': 'v'})\n"
            "with tracing.new_trace('probe cycle'):\n"
            "    pass\n"
            "tracing.shutdown()\n")
        outs = {}
        for endpoint in ("", r.url):
            res = subprocess.run([sys.executable, "-c", script, endpoint], cwd=ROOT,
                                 env=service_env(), capture_output=True, text=True,
                                 timeout=60)
            assert res.returncode == 0, res.stderr
            outs[endpoint] = res.stdout.strip()
        assert outs == {"": "False", r.url: "True"}
        # shutdown() flushed synchronously and the receiver stores spans before it
        # answers, so they are all here once the child has exited.
        names = {s["name"]: s for s in r.spans}
        assert set(names) == {"probe phase", "probe cycle"}
        assert names["probe phase"]["start"] == 1_000_000_000
        assert names["probe phase"]["end"] == 2_000_000_000
        assert names["probe cycle"]["parent"] == ""  # a root: its own trace
    finally:
        r.close()


# ------------------------------------------------------------ compose profiles (no engine)


def test_compose_profiles_run_a_collector_prometheus_and_grafana_on_what_services_export(
        ) -> None:
    import subprocess
    import sys

    import yaml

    from .conftest import ROOT

    bin_dir = Path(sys.executable).parent
    res = subprocess.run([str(bin_dir / "docker-compose"), "-f", str(ROOT / "compose.yaml"),
                          "--profile", "tracing", "--profile", "metrics", "config",
                          "--format", "json"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    services = json.loads(res.stdout)["services"]
    assert {"otel-collector", "prometheus", "grafana"} <= set(services)
    collector = yaml.safe_load((ROOT / "deploy/otel/collector.yaml").read_text())
    assert collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    assert "traces" in collector["service"]["pipelines"]
    # Prometheus scrapes every Tandem service at the port its runner serves /metrics on.
    # A Tandem service is one built from the project's Dockerfile for a SERVICE.
    tandem = {name: svc for name, svc in services.items()
              if "SERVICE" in svc.get("build", {}).get("args", {})}
    assert len(tandem) == 7, sorted(tandem)
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]}
    assert targets == {f"{name}:{svc['environment']['TANDEM_METRICS_PORT']}"
                       for name, svc in tandem.items()}
    for svc in tandem.values():
        assert "TANDEM_OTLP_ENDPOINT" in svc["environment"]
    # Every metric the Grafana dashboard plots is one the code defines.
    dash = json.loads((ROOT / "deploy/grafana/dashboards/tandem.json").read_text())
    defined = tandem_metrics()
    assert len(dash["panels"]) >= 10
    for panel in dash["panels"]:
        for target in panel["targets"]:
            for name in metric_names(target["expr"]):
                assert name in defined, f"{panel['title']}: {name} is not a Tandem metric"
