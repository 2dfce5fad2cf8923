"""``python -m tandem.cli.bench.unchecked_worker``: the inference worker with its task
checks left out (``InferenceWorker._check``: ``check_task``, the per-call image cap, the
subject's cluster and lane), for one purpose: ``tandem bench serve`` measures what
those checks cost the real worker (issue 19) by draining the same no-op tasks through
it and through the worker as shipped, turn about, in the same run.

It lives with the bench drivers, not with the worker: a worker that could skip
validation would be a way around the limits it enforces, so nothing the worker reads
(settings, environment) turns the checks off, and nothing but the bench starts this.
"""

from __future__ import annotations

from typing import Any

from tandem.common.runner import main
from tandem.inference_worker.service import InferenceWorker


class UncheckedWorker(InferenceWorker):
    def _check(self, d: Any) -> None:
        return None  # the one difference: every delivered task is taken as valid


if __name__ == "__main__":
    main(UncheckedWorker)
