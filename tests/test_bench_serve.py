"""``tandem bench serve`` end to end at a tiny size: every side runs and reports.

Figures are not judged here (speed belongs in the benchmark's own runs); what is checked
is that each side did its work: every no-op task came back, the protocol floor's record
writes and results were all accepted, and the rendering names each figure.
"""

from __future__ import annotations

import argparse

from tandem.cli.bench import serve as bench_serve


async def test_serve_bench_runs_every_side_and_reports_every_figure() -> None:
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    args = p.parse_args(["--requests", "3", "--tasks", "40", "--images", "4", "--steps", "2",
                         "--batch", "2"])
    r = await bench_serve.run(args)
    a, t, c = r["latency"], r["throughput"], r["batching"]
    assert a["requests"] == 3 and a["tandem"]["p50_ms"] > 0 and a["raw_round_trip"]["p50_ms"] > 0
    assert t["tasks"] == 40
    assert t["tandem_per_s"] > 0 and t["floor_per_s"] > 0 and t["raw_per_s"] > 0
    assert set(t["cpu_per_task"]) == {"tandem", "floor", "raw"}
    assert all(set(v) == {"client_us", "server_us"} for v in t["cpu_per_task"].values())
    assert c["batched_images_per_s"] > 0 and c["unbatched_images_per_s"] > 0
    text = bench_serve.render(r)
    assert "protocol floor" in text and "CPU per task" in text
