"""A generation's phases on the worker: spans in the task's trace, and a histogram.

The gateway publishes each task inside its ``admission`` span, so the task's
``traceparent`` header names the trace; the bus's consumer opens ``gen process`` in it
while the handler runs. ``record`` adds one child span per phase, from wall-clock marks
taken as the task went through the worker (the batcher sets ``load_*`` and ``run_*`` on
its job)::

    queue wait   task submitted at the gateway  -> a worker took it
    batching     taken                          -> its pipeline call started (linger,
                                                   the running and queued calls ahead)
    model load   fetching the pipeline for the batch (a hit on a loaded model is ~0)
    denoising    the pipeline call alone (its batch: ``tandem.batch.images``)
    upload       its PNGs encoded and put in S3, beside the next call

Each phase's length also goes to ``tandem_generation_phase_seconds{phase}``.
"""

from __future__ import annotations

from typing import Any

from tandem.common import metrics, tracing
from tandem.common.events import GenerationTask


def record(task: GenerationTask, marks: dict[str, float], **attributes: Any) -> None:
    """Report the phases ``marks`` allow (missing marks skip their phase). Spans only
    while they are exported: this runs for every task, a no-op one too."""
    get = marks.get
    seen = [(name, label, start, end) for name, label, start, end in (
        ("queue wait", "queue_wait", task.submitted_at, get("taken")),
        ("batching", "batching", get("taken"), get("run_start")),
        ("model load", "model_load", get("load_start"), get("load_end")),
        ("denoising", "denoising", get("run_start"), get("run_end")),
        ("upload", "upload", get("upload_start"), get("upload_end")),
    ) if start is not None and end is not None]
    metrics.PHASE_SECONDS.observe_many([(label, end - start if end > start else 0.0)
                                        for _, label, start, end in seen])
    if tracing.recording():
        attrs = {"tandem.task_id": task.task_id, "tandem.model": task.model,
                 "tandem.lane": task.lane, **attributes}
        if "batch_images" in marks:
            attrs["tandem.batch.images"] = int(marks["batch_images"])
        for name, _, start, end in seen:
            tracing.span_between(name, start, end, attrs)
