"""The measuring side of ``tandem bench train``: one process, one model, one data set.

Bench code, kept out of the trainer service: it drives the trainer's own ``TrainLoop``
and rank helpers (``after_step``, ``checkpoint_writer``) as a rank would.

``python -m tandem.cli.bench.train_rank <launch.json> <out.json>`` trains segments of steps in
turn: *plain* (just ``train_step``) and *tandem* (the same step plus what a rank adds:
the step report to the coordinator's relay, which publishes it to NATS, and an
asynchronous checkpoint every ``checkpoint_every`` steps, whose background write must
have finished before the segment's clock stops). Alternating in one process keeps both
sides on the same warm caches and the same noisy neighbours.

It also times the blocking part of each checkpoint (the copy to CPU) against a
synchronous ``torch.save`` of the same state to the same disk.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec

from tandem.common.runs import RunConfig
from tandem.trainer.channel import EventChannel
from tandem.trainer.spec import LaunchSpec


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    spec = msgspec.json.decode(Path(args[0]).read_bytes(), type=LaunchSpec)
    extra = msgspec.json.decode(Path(args[0]).with_suffix(".bench.json").read_bytes())
    import torch

    from tandem.trainer.loop import TrainLoop
    from tandem.trainer.rank import after_step, checkpoint_writer

    torch.set_num_threads(spec.threads)
    cfg = RunConfig.model_validate(spec.config)
    loop = TrainLoop(cfg)
    channel = EventChannel(spec.events or None)
    writer = checkpoint_writer(spec, channel, spec.node)
    nodes = [spec.node]
    steps, rounds, warmup = int(extra["steps"]), int(extra["rounds"]), int(extra["warmup"])
    for i in range(warmup):
        loop.train_step()
        if i >= warmup - 2:
            # The writer's two buffer sets (one is copied into while the other is being
            # written) are allocated by a run's first two checkpoints, and reused by every
            # later one: those two are reported apart, not as a checkpoint's usual cost.
            loop.checkpoint(writer)
    writer.wait()
    first_blocked = [w.blocked_s for w in writer.written]
    writer.written.clear()

    def plain() -> None:
        for _ in range(steps):
            loop.train_step()

    def tandem() -> None:
        for _ in range(steps):
            after_step(loop, loop.train_step(), channel, writer, cfg.batch_size, nodes)
        writer.wait()  # the background writes are part of the cost

    # Wall time is what a run feels; process CPU time (every thread of this process,
    # the writer's included) is the same cost without the neighbours' noise.
    times: dict[str, list[float]] = {"plain": [], "tandem": [], "plain_cpu": [],
                                     "tandem_cpu": []}
    for i in range(rounds):
        order = (("plain", plain), ("tandem", tandem))
        for name, fn in order if i % 2 == 0 else order[::-1]:
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[name].append(steps / (time.perf_counter() - t0))
            times[f"{name}_cpu"].append(steps / (time.process_time() - c0))
    writer.close()
    blocked = [w.blocked_s for w in writer.written]
    state = _state(loop)
    sync: list[float] = []
    with tempfile.TemporaryDirectory(dir=spec.checkpoint_root) as tmp:
        for i in range(max(3, len(blocked))):
            t0 = time.perf_counter()
            torch.save(state, Path(tmp) / f"sync-{i}.pt")
            sync.append(time.perf_counter() - t0)
    channel.close()
    out: dict[str, Any] = {
        "plain_steps_per_s": times["plain"], "tandem_steps_per_s": times["tandem"],
        "plain_steps_per_cpu_s": times["plain_cpu"],
        "tandem_steps_per_cpu_s": times["tandem_cpu"],
        "checkpoints": len(blocked), "blocked_s": blocked, "sync_save_s": sync,
        "first_blocked_s": first_blocked,
        "state_bytes": sum(f.size for w in writer.written[:1] for f in w.manifest.files),
        "median_write_s": statistics.median(w.write_s for w in writer.written)
        if writer.written else 0.0,
    }
    Path(args[1]).write_bytes(msgspec.json.encode(out))
    return 0


def _state(loop: Any) -> dict[str, Any]:
    """What a checkpoint holds, as one object for a synchronous ``torch.save``."""
    return {"model": loop.model.state_dict(), "ema": loop.ema,
            "optimizer": loop.optimizer.state_dict(), "scheduler": loop.lr_sched.state_dict(),
            "rng": {"ranks": [loop.rng_state()]}, "trainer": loop.trainer_state()}


if __name__ == "__main__":
    sys.exit(main())
