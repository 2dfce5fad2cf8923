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
    r = await bench_serve.run(_args("--requests", "3", "--tasks", "40", "--images", "4",
                                    "--steps", "2", "--batch", "2", "--repeat", "1"))
    a, t, c = r["latency"], r["throughput"], r["batching"]
    assert set(r["figures"]) == {"latency", "doors", "throughput", "throughput_to_floor",
                                "batching"}
    assert r["figures"]["throughput"]["ratio"]["runs"] == [t["ratio"]]

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

    assert t["tasks"] == 40
    assert _positive(t["tandem_per_s"], t["floor_per_s"], t["raw_per_s"])
    assert _quotient(t["ratio"], t["tandem_per_s"], t["raw_per_s"])
    assert _quotient(t["floor_ratio"], t["floor_per_s"], t["raw_per_s"])
    assert _quotient(t["tandem_to_floor"], t["tandem_per_s"], t["floor_per_s"])
    assert set(t["cpu_per_task"]) == {"tandem", "floor", "raw"}
    for used in t["cpu_per_task"].values():
        assert set(used) == {"client_us", "server_us"}
        assert all(math.isfinite(v) and v >= 0 for v in used.values())

    # Whole batches: 4 images in batches of 2 count the 2 after the first batch.
    assert c["images"] == 4 and c["max_batch"] == 2
    assert c["counted_images"] == {"unbatched": 3, "batched": 2}
    assert _positive(c["batched_images_per_s"], c["unbatched_images_per_s"])
    assert _quotient(c["ratio"], c["batched_images_per_s"], c["unbatched_images_per_s"])

    text = bench_serve.render(r)
    assert "protocol floor" in text and "CPU per task" in text


@pytest.mark.parametrize("images, batch", [("5", "2"), ("2", "2"), ("8", "0")])
async def test_serve_bench_refuses_images_that_are_not_whole_batches(images: str,
                                                                     batch: str) -> None:
    with pytest.raises(SystemExit, match="whole number of batches"):
        await bench_serve.run(_args("--images", images, "--batch", batch))
