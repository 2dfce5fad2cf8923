"""Prometheus metrics shared by every service; each service adds its own beside these.

Served on ``/metrics`` by the service runner. Names follow Prometheus conventions
(``tandem_<thing>_<unit>``); labels are bounded sets (stream, outcome, tandem_service).

The GPU and training series are defined here because two services set them: the
cluster-agent (its node's GPUs) and the trainer (its runs) where the figures are made,
and the gateway's observer for the whole system from the bus. A metric is registered once
per process, so both import these objects rather than defining the name twice.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString


class Phases:
    """A histogram labelled by one label (``phase``) whose ``observe_many`` records
    several observations under one lock: every task on the worker reports up to five
    phases, and five ``Histogram.observe`` calls (two locked increments and a bucket
    search in Python each) cost the task 4 us against 1.4 us here. The exposition is a
    ``Histogram``'s (``_bucket{le}``, ``_count``, ``_sum``; no ``_created``)."""

    def __init__(self, name: str, documentation: str, label: str,
                 buckets: Iterable[float], registry: Any = REGISTRY) -> None:
        self.name, self.documentation, self.label = name, documentation, label
        self.bounds = sorted(float(b) for b in buckets)
        if self.bounds[-1] != float("inf"):
            self.bounds.append(float("inf"))
        self._lock = threading.Lock()
        self._series: dict[str, tuple[list[int], list[float]]] = {}  # counts, [sum]
        if registry is not None:
            registry.register(self)

    def observe(self, value: str, amount: float) -> None:
        self.observe_many(((value, amount),))

    def observe_many(self, pairs: Iterable[tuple[str, float]]) -> None:
        """Each ``(label value, seconds)`` pair is one observation (a NaN is dropped)."""
        bounds, series = self.bounds, self._series
        with self._lock:
            for value, amount in pairs:
                if amount != amount:  # NaN: in no bucket
                    continue
                got = series.get(value)
                if got is None:
                    got = series[value] = ([0] * len(bounds), [0.0])
                got[0][bisect.bisect_left(bounds, amount)] += 1
                got[1][0] += amount

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label])
        with self._lock:
            series = {k: (list(c), s[0]) for k, (c, s) in self._series.items()}
        for value, (counts, total) in series.items():  # in first-seen order, as Histogram
            cumulative, buckets = 0, []
            for bound, n in zip(self.bounds, counts, strict=True):
                cumulative += n
                buckets.append((floatToGoString(bound), cumulative))
            family.add_metric([value], buckets, total)
        yield family

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.name, self.documentation, labels=[self.label])]


# The process's own service name is the label ``tandem_service``, not ``service``: the
# scrape adds a target label ``service`` (prometheus.yml's static labels, the
# ServiceMonitor's Service name), and a metric's own label of that name would be renamed
# ``exported_service`` on ingestion, under a name no query expects.
PUBLISHED = Counter("tandem_bus_published", "JetStream publishes acknowledged",
                    ["tandem_service"])
CONSUMED = Counter(
    "tandem_bus_consumed", "Messages settled by consumers", ["stream", "outcome"]
)
DEAD_LETTERS = Counter(
    "tandem_bus_dead_letters", "Messages copied to the DLQ", ["stream", "reason"]
)
UP = Gauge("tandem_service_up", "1 while the service runs (0 while it drains)",
           ["tandem_service"])
# One generation's time by phase: admission (gateway), queue_wait, batching, model_load,
# denoising, upload (worker). Each service observes the phases it sees.
PHASE_SECONDS = Phases(
    "tandem_generation_phase_seconds", "Generation task time by phase, seconds", "phase",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))


# Each GPU's key figures, labelled {cluster, node, gpu}.
GPU_UTIL = Gauge("tandem_gpu_utilization_percent", "GPU utilization, percent",
                 ["cluster", "node", "gpu"])
GPU_TEMP = Gauge("tandem_gpu_temperature_celsius", "GPU temperature, degrees C",
                 ["cluster", "node", "gpu"])
GPU_POWER = Gauge("tandem_gpu_power_watts", "GPU power draw, watts", ["cluster", "node", "gpu"])
GPU_MEM = Gauge("tandem_gpu_memory_used_bytes", "GPU memory in use, bytes",
                ["cluster", "node", "gpu"])

# A training run's progress, labelled {run}.
TRAIN_LOSS = Gauge("tandem_train_loss", "Latest training loss", ["run"])
TRAIN_STEP = Gauge("tandem_train_step", "Latest optimizer step", ["run"])
TRAIN_STEP_SECONDS = Histogram(
    "tandem_train_step_seconds", "Training step time (slowest rank), seconds", ["run"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
TRAIN_SAMPLES = Gauge("tandem_train_samples_per_second", "Training throughput, samples per "
                      "second", ["run"])
CKPT_BLOCKED = Histogram(
    "tandem_checkpoint_blocked_seconds", "Time a checkpoint blocked training, seconds",
    ["run"], buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5))
CKPT_WRITE_FAILURES = Counter(
    "tandem_checkpoint_write_failures", "Checkpoints a run's ranks could not write (a full "
    "disk), once per step and node", ["run"])
GOODPUT = Gauge("tandem_train_goodput_ratio", "Productive share of a run's wall-clock time "
                "(0..1)", ["run"])
RESTARTS = Gauge("tandem_train_restarts", "Restarts of a run so far", ["run"])
RUN_SERIES = (TRAIN_LOSS, TRAIN_STEP, TRAIN_STEP_SECONDS, TRAIN_SAMPLES, CKPT_BLOCKED, GOODPUT,
              RESTARTS, CKPT_WRITE_FAILURES)
GPU_SERIES = (GPU_UTIL, GPU_TEMP, GPU_POWER, GPU_MEM)

__all__ = [
    "CKPT_BLOCKED", "CKPT_WRITE_FAILURES", "CONSUMED", "CONTENT_TYPE_LATEST", "DEAD_LETTERS",
    "GOODPUT", "GPU_MEM", "GPU_POWER", "GPU_SERIES", "GPU_TEMP", "GPU_UTIL",
    "PHASE_SECONDS", "PUBLISHED", "RESTARTS", "RUN_SERIES", "TRAIN_LOSS", "TRAIN_SAMPLES",
    "TRAIN_STEP", "TRAIN_STEP_SECONDS", "UP", "Counter", "Gauge", "Histogram", "Phases",
    "exposition", "forget_gpus", "forget_run", "set_gpus", "train_step",
]


def set_gpus(cluster: str, node: str, gpus: Iterable[Any]) -> None:
    """Set the GPU gauges of one node from its samples or heartbeat briefs (anything with
    ``index``, ``util``, ``temp``, ``power``, ``mem_used``). A figure the GPU does not
    report now (``None``: a lost GPU, a field NVML lacks) drops its series rather than
    leaving the last value standing."""
    for g in gpus:
        labels = (cluster, node, str(g.index))
        for gauge, value in ((GPU_UTIL, g.util), (GPU_TEMP, g.temp), (GPU_POWER, g.power),
                             (GPU_MEM, g.mem_used)):
            if value is None:
                with contextlib.suppress(KeyError):  # older clients raise when it is absent
                    gauge.remove(*labels)
            else:
                gauge.labels(*labels).set(value)


def forget_gpus(cluster: str, node: str) -> None:
    """Drop every GPU series of a node (it is down or gone: its last figures would lie)."""
    for gauge in GPU_SERIES:
        gauge.remove_by_labels({"cluster": cluster, "node": node})


def forget_run(run: str) -> None:
    """Drop every series of a run (a view stopped showing it)."""
    for series in RUN_SERIES:
        with contextlib.suppress(KeyError):  # a run that never stepped has none
            series.remove(run)


def train_step(run: str, step: int, loss: float, samples_per_s: float,
               step_time: float) -> None:
    """One training step's figures, as in a ``TrainStep`` event (``step_time`` 0: not
    measured, so not observed)."""
    TRAIN_LOSS.labels(run).set(loss)
    TRAIN_STEP.labels(run).set(step)
    TRAIN_SAMPLES.labels(run).set(samples_per_s)
    if step_time > 0:
        TRAIN_STEP_SECONDS.labels(run).observe(step_time)


def exposition() -> tuple[bytes, str]:
    return generate_latest(), CONTENT_TYPE_LATEST
