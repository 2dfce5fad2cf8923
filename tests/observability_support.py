"""What a test sees of a service's telemetry: the spans it exports, the series it serves.

``Receiver`` is a tiny OTLP/HTTP traces endpoint running in the test (protobuf, as the
SDK's exporter sends it): point a service's ``TANDEM_OTLP_ENDPOINT`` at ``receiver.url``
and every exported span lands in ``receiver.spans``, stored before the export is
answered. ``scrape(url)`` reads a ``/metrics`` page into ``{(name, labels): value}``.
``tandem_metrics()`` and ``metric_names(expr)``: the metrics the code defines, and those a
PromQL expression (a Grafana panel, an alert) names.
"""

from __future__ import annotations

import re
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# OTLP's enums as they come on the wire: a span's kind, its status code.
SERVER, CONSUMER = 2, 5
UNSET, ERROR = 0, 2


class Receiver:
    """OTLP/HTTP traces endpoint: decodes each export into (service, trace id, span)."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceRequest,
                )

                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                receiver.add(req)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, req: Any) -> None:
        with self.lock:
            for rs in req.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes
                                if a.key == "service.name"), "")
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        self.spans.append({
                            "service": service, "name": span.name,
                            "trace": span.trace_id.hex(), "span": span.span_id.hex(),
                            "parent": span.parent_span_id.hex(),
                            "start": span.start_time_unix_nano, "end": span.end_time_unix_nano,
                            "kind": span.kind, "status": (span.status.code,
                                                          span.status.message),
                            "attrs": {a.key: a.value for a in span.attributes},
                            "events": [(e.name, {a.key: a.value for a in e.attributes})
                                       for e in span.events]})

    def trace(self, task_id: str) -> list[dict[str, Any]]:
        """Every span of the trace whose worker spans name ``task_id``."""
        return self.traces_with("tandem.task_id", task_id)

    def traces_with(self, key: str, value: str) -> list[dict[str, Any]]:
        """Every span of the traces holding a span whose attribute ``key`` is ``value``."""
        with self.lock:
            ids = {s["trace"] for s in self.spans
                   if key in s["attrs"] and s["attrs"][key].string_value == value}
            return [s for s in self.spans if s["trace"] in ids]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus ``/metrics`` page as ``{(sample name, sorted labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def tandem_metrics() -> set[str]:
    """Every metric name the code defines: each quoted ``tandem_...`` string under libs/
    and services/ (a metric's name is given once, where it is made)."""
    root = Path(__file__).resolve().parent.parent
    source = "\n".join(p.read_text() for folder in ("libs", "services")
                       for p in (root / folder).rglob("*.py"))
    return set(re.findall(r'"(tandem_[a-z_]+)"', source))


def metric_names(expr: str) -> set[str]:
    """The Tandem metrics a PromQL expression reads, by the name they are defined under
    (a sample's ``_bucket``, ``_count``, ``_sum`` or ``_total`` taken off)."""
    return {re.sub(r"_(bucket|count|sum|total)$", "", name)
            for name in re.findall(r"tandem_[a-z_]+", expr)}
