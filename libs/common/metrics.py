"""Prometheus metrics shared by every service; each service adds its own beside these.

Served on ``/metrics`` by the service runner. Names follow Prometheus conventions
(``tandem_<thing>_<unit>``); labels are bounded sets (stream, outcome, service).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

PUBLISHED = Counter("tandem_bus_published", "JetStream publishes acknowledged", ["service"])
CONSUMED = Counter(
    "tandem_bus_consumed", "Messages settled by consumers", ["stream", "outcome"]
)
DEAD_LETTERS = Counter(
    "tandem_bus_dead_letters", "Messages copied to the DLQ", ["stream", "reason"]
)
UP = Gauge("tandem_service_up", "1 while the service runs", ["service"])
INFLIGHT = Gauge("tandem_service_inflight", "Work items being processed", ["service"])
# One generation's time by phase: admission (gateway), queue_wait, batching, model_load,
# denoising, upload (worker). Each service observes the phases it sees.
PHASE_SECONDS = Histogram(
    "tandem_generation_phase_seconds", "Generation task time by phase, seconds", ["phase"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))

__all__ = [
    "CONSUMED", "CONTENT_TYPE_LATEST", "DEAD_LETTERS", "INFLIGHT", "PHASE_SECONDS", "PUBLISHED",
    "UP",
    "Counter", "Gauge", "Histogram", "exposition",
]


def exposition() -> tuple[bytes, str]:
    return generate_latest(), CONTENT_TYPE_LATEST
