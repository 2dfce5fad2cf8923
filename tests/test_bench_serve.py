"""``tandem bench serve`` end to end at a tiny size: every side runs and reports.

Figures are not judged here (speed belongs in the benchmark's own runs); what is checked
is what must hold on any machine: each side did all its work, the counts add up, rates
count whole batches, every figure is finite and positive, every ratio is the quotient of
the figures it stands beside, and the rendering names each figure.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest

from tandem.cli.bench import serve as bench_serve


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    return p.parse_args(list(argv))


def _positive(*values: Any) -> bool:
    return all(isinstance(v, int | float) and math.isfinite(v) and v > 0 for v in values)


def _quotient(ratio: float, a: float, b: float) -> bool:
    """``ratio`` is ``a / b`` as the bench rounds it (3 places, from unrounded figures
    that were themselves rounded to 1-2 places: allow that rounding, nothing more)."""
    return math.isclose(ratio, a / b, rel_tol=0.02, abs_tol=2e-3)


@pytest.mark.slow
async def test_serve_bench_counts_add_up_and_every_ratio_is_its_figures_quotient() -> None:
    r = await bench_serve.run(_args("--requests", "3", "--tasks", "40", "--rounds", "1",
                                    "--images", "4", "--steps", "2", "--batch", "2",
                                    "--repeat", "1"))
    a, t, c = r["latency"], r["protocol"], r["batching"]
    assert set(r["figures"]) == {"latency", "doors", "protocol", "protocol_messages",
                                "protocol_cpu", "validation", "protocol_raw", "batching"}
    assert r["figures"]["protocol"]["ratio"]["runs"] == [t["ratio"]]

    assert a["requests"] == 3
    for side in ("tandem", "raw_round_trip", "http_hop"):
        assert _positive(a[side]["p50_ms"], a[side]["p99_ms"])
        assert a[side]["p50_ms"] <= a[side]["p99_ms"]
    assert _positive(a["goal_p50_ms"], a["ratio_to_raw_plus_hop"])
    assert a["meets_goal"] == (a["tandem"]["p50_ms"] <= a["goal_p50_ms"])
    d = a["doors"]  # the job service's and HTTP's submit round trips, same rounds
    assert _positive(d["nats_submit"]["p50_ms"], d["http_submit"]["p50_ms"], d["ratio"])
    assert _quotient(d["ratio"], d["nats_submit"]["p50_ms"], d["http_submit"]["p50_ms"])
    assert d["meets_goal"] == (d["ratio"] <= 1.0)

    # The protocol, whatever the machine: a task is three durable writes (the record the
    # gateway creates, the task, the worker's end of the record), the worker's one of
    # them; on the wire the worker takes the task, writes, reads the write's ack, acks.
    assert t["tasks"] == 40 and t["rounds"] == 1
    assert t["messages_per_task"] == a["writes_per_task"] == 3
    assert t["worker_writes_per_task"] == 1 and t["worker_wire_per_task"] >= 4
    sides = t["sides"]
    assert set(sides) == {"tandem", "floor", "floor_unchecked"}
    for side in [*sides.values(), t["raw"]]:
        assert _positive(side["per_s"], side["wall_s"], side["wire_per_task"])
        assert side["client_us"] >= 0 and side["server_us"] >= 0
        assert math.isclose(side["cpu_us"], side["client_us"] + side["server_us"], abs_tol=0.2)
    assert sides["floor"]["writes_per_task"] == sides["floor_unchecked"]["writes_per_task"] == 1
    assert t["raw"]["writes_per_task"] == 0
    assert _quotient(t["ratio"], sides["tandem"]["per_s"], sides["floor"]["per_s"])
    assert t["cpu_us_per_task"] == sides["tandem"]["cpu_us"]
    v = t["validation"]
    assert (v["checked_per_s"], v["unchecked_per_s"]) == (
        sides["floor"]["per_s"], sides["floor_unchecked"]["per_s"])
    assert math.isclose(v["drop"], 1 - v["checked_per_s"] / v["unchecked_per_s"], abs_tol=1e-3)
    assert v["noise"] is None and v["within_noise"] is None  # one round: no spread
    assert _positive(v["check_task_us"]) and v["check_task_us"] == t["overheads"]["check_task"]
    assert set(t["overheads"]) == {"metrics", "log_context", "trace_context", "task",
                                   "check_task"}
    assert _positive(*t["overheads"].values())

    # Whole batches: 4 images in batches of 2 count the 2 after the first batch.
    assert c["images"] == 4 and c["max_batch"] == 2
    assert c["counted_images"] == {"unbatched": 3, "batched": 2}
    assert _positive(c["batched_images_per_s"], c["unbatched_images_per_s"])
    assert _quotient(c["ratio"], c["batched_images_per_s"], c["unbatched_images_per_s"])

    text = bench_serve.render(r)
    assert "protocol" in text and "CPU/task" in text and "validation" in text


@pytest.mark.parametrize("images, batch", [("5", "2"), ("2", "2"), ("8", "0")])
async def test_serve_bench_refuses_images_that_are_not_whole_batches(images: str,
                                                                     batch: str) -> None:
    with pytest.raises(SystemExit, match="whole number of batches"):
        await bench_serve.run(_args("--images", images, "--batch", batch))
