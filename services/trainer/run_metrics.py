"""This coordinator's own series for the runs it supervises, on its ``/metrics``.

The series are libs/common/metrics.py's (``tandem_train_*``,
``tandem_checkpoint_blocked_seconds``), which the gateway also derives from the bus; here
they are set where the figures are made: every step the ranks report (not only the
published ones, ``step_event_every``), every checkpoint written, and goodput and restarts
each time the run's record is written to KV ``runs``.

Series are labelled by run. A run's stay after it ends, so a scrape after the end still
reads its final figures, but only for the last ``KEEP_ENDED`` ended runs
(``TANDEM_METRICS_KEEP_ENDED``, set by the service): a coordinator that lives through
many runs keeps a bounded ``/metrics``.
"""

from __future__ import annotations

from collections import OrderedDict

from tandem.common import metrics

KEEP_ENDED = 8  # the service sets it from its settings
_ended: OrderedDict[str, None] = OrderedDict()  # run ids whose series remain, oldest first


class RunMetrics:
    """One run's series; ``ended()`` when its supervisor stops."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        _ended.pop(run_id, None)  # supervised again (adopted): live, not up for eviction

    def step(self, step: int, loss: float, samples_per_s: float, step_time: float) -> None:
        metrics.train_step(self.run_id, step, loss, samples_per_s, step_time)

    def checkpoint(self, blocked_s: float) -> None:
        metrics.CKPT_BLOCKED.labels(self.run_id).observe(blocked_s)

    def checkpoint_failed(self) -> None:
        metrics.CKPT_WRITE_FAILURES.labels(self.run_id).inc()

    def progress(self, restarts: int, goodput: float | None) -> None:
        metrics.RESTARTS.labels(self.run_id).set(restarts)
        if goodput is not None:
            metrics.GOODPUT.labels(self.run_id).set(goodput)

    def ended(self) -> None:
        _ended[self.run_id] = None
        _ended.move_to_end(self.run_id)
        while len(_ended) > KEEP_ENDED:
            old, _ = _ended.popitem(last=False)
            metrics.forget_run(old)
