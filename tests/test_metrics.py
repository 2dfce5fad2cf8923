"""``metrics.Phases``: the phase histogram the worker and gateway observe on every task,
exposed exactly as prometheus_client's own ``Histogram`` would expose it."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from tandem.common import metrics

BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
LABELS = ("admission", "queue_wait", "upload")
# Bucket bounds themselves (an observation equal to ``le`` counts in that bucket), their
# neighbours, zero, values past the last bound, and anything finite between.
EDGES = [b for x in BUCKETS for b in (x, math.nextafter(x, 0), math.nextafter(x, math.inf))]
AMOUNTS = st.one_of(st.sampled_from([0.0, 1e9, *EDGES]),
                    st.floats(min_value=0, max_value=1e4, allow_nan=False))
CHUNKS = st.lists(st.lists(st.tuples(st.sampled_from(LABELS), AMOUNTS), max_size=6),
                  max_size=12)


def _lines(registry: CollectorRegistry) -> list[str]:
    # prometheus_client's Histogram also writes a _created gauge per series; Phases
    # writes none (no process start time belongs to a task's phase).
    return [line for line in generate_latest(registry).decode().splitlines()
            if "_created" not in line]


@settings(max_examples=200, deadline=None)
@given(chunks=CHUNKS)
def test_phases_expose_what_a_prometheus_histogram_of_the_same_observations_does(
        chunks: list[list[tuple[str, float]]]) -> None:
    ours_registry, theirs_registry = CollectorRegistry(), CollectorRegistry()
    ours = metrics.Phases("t_phase_seconds", "phases", "phase", BUCKETS,
                          registry=ours_registry)
    theirs = Histogram("t_phase_seconds", "phases", ["phase"], buckets=BUCKETS,
                       registry=theirs_registry)
    for chunk in chunks:  # a task's phases, observed together
        ours.observe_many(chunk)
        for label, amount in chunk:
            theirs.labels(label).observe(amount)
    assert _lines(ours_registry) == _lines(theirs_registry)


def test_a_nan_is_in_no_bucket_and_the_others_of_its_call_are_kept() -> None:
    registry = CollectorRegistry()
    phases = metrics.Phases("t_nan_seconds", "phases", "phase", BUCKETS, registry=registry)
    phases.observe_many([("upload", math.nan), ("upload", 0.002)])
    text = generate_latest(registry).decode()
    assert 't_nan_seconds_count{phase="upload"} 1.0' in text
    assert 't_nan_seconds_sum{phase="upload"} 0.002' in text
    assert 't_nan_seconds_bucket{le="0.001",phase="upload"} 0.0' in text
    assert 't_nan_seconds_bucket{le="0.005",phase="upload"} 1.0' in text


def test_every_worker_task_outcome_is_exported_from_zero() -> None:
    """A series born at 1 has no rate() until it grows again: the dashboard's failed
    tasks line stayed flat after a task failed (observability red team)."""
    import tandem.inference_worker.service  # noqa: F401  (defines the worker's metrics)

    body = metrics.exposition()[0].decode()
    for outcome in ("succeeded", "cancelled", "failed"):
        assert f'tandem_worker_tasks_total{{outcome="{outcome}"}}' in body, outcome
