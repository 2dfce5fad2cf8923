"""``tandem bench serve`` end to end at a tiny size: every side runs and reports.

Figures are not judged here (speed belongs in the benchmark's own runs); what is checked
is what must hold on any machine: each side did all its work, the counts add up, rates
count whole batches, every figure is finite and positive, every ratio is the quotient of
the figures it stands beside, and the rendering names each figure.
"""

from __future__ import annotations

import argparse
import math
import os
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
@pytest.mark.timeout(900)  # ~15 services and pipeline processes started, one at a time
async def test_serve_bench_counts_add_up_and_every_ratio_is_its_figures_quotient() -> None:
    # The smoke sizes, with (b)'s tasks cut to 40 a side (the last --tasks wins), and (c)
    # pinned: the calls in child processes on a CPU of their own, the bare loop there too.
    r = await bench_serve.run(_args(*bench_serve.SMOKE, "--tasks", "40", "--repeat", "1",
                                    "--pin"))
    a, t, c = r["latency"], r["protocol"], r["batching"]
    assert set(r["figures"]) == {
        "latency", "doors", "protocol", "protocol_messages", "protocol_cpu",
        "protocol_share", "validation",
        "protocol_raw", "batching", "pipeline_busy", "workers_noop_2", "workers_digits_2",
        *(f"pipeline_{m}_{k}" for m in ("digits", "tiny-text") for k in ("b1", "b2"))}
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
    assert set(sides) == {"tandem", "tandem_unchecked", "floor", "floor_unchecked"}
    for side in [*sides.values(), t["raw"]]:
        assert _positive(side["per_s"], side["wall_s"], side["wire_per_task"])
        assert side["client_us"] >= 0 and side["server_us"] >= 0
        assert math.isclose(side["cpu_us"], side["client_us"] + side["server_us"], abs_tol=0.2)
    assert sides["floor"]["writes_per_task"] == sides["floor_unchecked"]["writes_per_task"] == 1
    assert t["raw"]["writes_per_task"] == 0
    assert _quotient(t["ratio"], sides["tandem"]["per_s"], sides["floor"]["per_s"])
    assert t["cpu_us_per_task"] == sides["tandem"]["cpu_us"]
    # The proposed measure: the worker's CPU per task beyond the floor's, in percent of
    # a digits image's time in the bare pipeline at the batched size, of the same run.
    image_us = r["pipeline"]["models"]["digits"]["b2"]["bare"]["wall_per_image_ms"] * 1e3
    share = r["figures"]["protocol_share"]["tandem"]["runs"]
    assert share == [round((t["cpu_us_per_task"] - sides["floor"]["cpu_us"]) / image_us * 100,
                           4)]
    # Issue 19: the worker with its checks against the same worker without them (and the
    # same pair on the floor); both unchecked sides wrote as many records as the others.
    assert sides["tandem_unchecked"]["writes_per_task"] == sides["tandem"]["writes_per_task"]
    v = t["validation"]
    for pair, (checked, unchecked) in ((v, ("tandem", "tandem_unchecked")),
                                       (v["floor"], ("floor", "floor_unchecked"))):
        assert (pair["checked_per_s"], pair["unchecked_per_s"]) == (
            sides[checked]["per_s"], sides[unchecked]["per_s"])
        assert math.isclose(pair["drop"], 1 - pair["checked_per_s"] / pair["unchecked_per_s"],
                            abs_tol=1e-3)
        assert pair["noise"] is None and pair["within_noise"] is None  # one round: no spread
    assert _positive(v["check_task_us"]) and v["check_task_us"] == t["overheads"]["check_task"]
    # The verdict (JSON, table, text) is judged once, over the repeats: here one.
    no_verdict = {"noise": None, "within_noise": None}
    assert r["validation"] == {"drop": v["drop"], **no_verdict,
                               "floor": {"drop": v["floor"]["drop"], **no_verdict},
                               "check_task_us": v["check_task_us"]}
    assert r["figures"]["validation"]["tandem"]["runs"] == [v["checked_per_s"]]
    assert r["figures"]["validation"]["baseline"]["runs"] == [v["unchecked_per_s"]]
    assert set(t["overheads"]) == {"metrics", "keepalive", "job", "check_task"}
    assert _positive(*t["overheads"].values())

    # Whole batches: each half's 4 images in batches of 2 count the 2 after its first
    # batch (3 of 4 one at a time), 4 (6) of the 8 in all.
    assert c["images"] == 8 and c["max_batch"] == 2
    assert c["counted_images"] == {"unbatched": 6, "batched": 4}
    assert _positive(c["batched_images_per_s"], c["unbatched_images_per_s"])
    assert _quotient(c["ratio"], c["batched_images_per_s"], c["unbatched_images_per_s"])

    text = bench_serve.render(r)
    assert "protocol" in text and "CPU/task" in text and "validation" in text
    assert "beyond the floor" in text and "of a digits image" in text
    assert "bare pipeline" in text and "workers on one stream" in text
    _pipeline_counts_add_up(r)
    _workers_counts_add_up(r)


def _pipeline_counts_add_up(r: dict[str, Any]) -> None:
    """(c)-(d) of the smoke run: 8 images, batch 2, both models, both sides."""
    p = r["pipeline"]
    assert (p["images"], p["batch"], p["threads"]) == (8, 2, 1)
    cpus = sorted(os.sched_getaffinity(0))
    assert p["pinned"] == {"pipeline": cpus[:1], "others": cpus[1:]} and p["pipeline_process"]
    for model, cells in p["models"].items():
        assert set(cells) == {"b1", "b2"}, model
        for key, cell in cells.items():
            batch = int(key[1:])
            t, bare = cell["tandem"], cell["bare"]
            assert _positive(t["images_per_s"], bare["images_per_s"], cell["ratio"])
            assert _quotient(cell["ratio"], t["images_per_s"], bare["images_per_s"])
            # Every image went through one pipeline call; the bare loop made whole batches.
            assert t["images"] == 8 and t["calls"] >= 8 // batch
            assert t["whole_batches"] == (t["calls"] == 8 // batch)
            assert bare["calls"] == 8 // batch
            # Each side ran twice, on half the images, A B B A; its rate is its two
            # halves' counted images over their two windows, so it lies between theirs.
            assert cell["order"] in ("TBBT", "BTTB")
            for side in (t, bare):
                assert len(side["halves"]) == 2 and _positive(*side["halves"])
                assert min(side["halves"]) <= side["images_per_s"] <= max(side["halves"])
            assert t["torch_threads"] == bare["torch_threads"] == 1  # the same on both sides
            assert 0 < t["busy"] <= 1.0
            assert t["cpu_per_image"]["compute_ms"] > 0
            # The calls ran in a child, on the pinned CPU, and the bare loop on it too.
            assert t["apart"] and t["pipeline_cpus"] == bare["cpus"] == cpus[:1]
    # Each goal's key is the lowest model's figure.
    assert p["ratio_b1"] == min(cells["b1"]["ratio"] for cells in p["models"].values())
    assert p["ratio_b8"] == min(cells["b2"]["ratio"] for cells in p["models"].values())
    assert p["busy"] == min(c["tandem"]["busy"] for cells in p["models"].values()
                            for c in cells.values())
    # (d) is (c)'s digits at batch 2 over batch 1, whole batches on both sides.
    d = p["models"]["digits"]
    assert _batching_is_digits_b2_over_b1(r["batching"], d)


def _batching_is_digits_b2_over_b1(c: dict[str, Any], d: dict[str, Any]) -> bool:
    return (c["batched_images_per_s"] == d["b2"]["tandem"]["images_per_s"]
            and c["unbatched_images_per_s"] == d["b1"]["tandem"]["images_per_s"]
            and _quotient(c["bare_ratio"], d["b2"]["bare"]["images_per_s"],
                          d["b1"]["bare"]["images_per_s"]))


def _workers_counts_add_up(r: dict[str, Any]) -> None:
    """(e) of the smoke run: 1 and 2 workers, 40 no-op tasks, 8 digits images."""
    w = r["workers"]
    for kind, n in (("noop", 40), ("digits", 8)):
        got = w[kind]
        assert set(got["runs"]) == {"1", "2"} and got["scaling"]["1"] == 1.0
        for count, run in got["runs"].items():
            assert run["workers"] == int(count) == len(run["per_worker"])
            assert run["tasks"] == n
            # Every task's result names one of this run's workers.
            assert sum(x["tasks"] for x in run["per_worker"].values()) == n
            assert _positive(run["tasks_per_s"], run["drain_s"])
            assert 0 <= run["backlog_s"] <= run["drain_s"]
            assert _quotient(got["scaling"][count], run["tasks_per_s"],
                             got["runs"]["1"]["tasks_per_s"])
            ran = sum(x["ran_while_backlog"] for x in run["per_worker"].values())
            assert ran <= n
            if kind == "noop":
                # No-op tasks take the real path (the batcher's calls): they are counted.
                # 40 tasks cannot all be held unrun by 2 workers when the stream runs dry.
                assert ran > 0
            assert all((x["busy_until_backlog_end"] is None) == (kind == "noop")
                       for x in run["per_worker"].values())


# A batch of 0 is refused before this, when the options are read (tests/test_cli_errors.py).
@pytest.mark.parametrize("images, batch", [("5", "2"), ("2", "2")])
async def test_serve_bench_refuses_images_that_are_not_whole_batches(images: str,
                                                                     batch: str) -> None:
    with pytest.raises(SystemExit, match="whole number of batches"):
        await bench_serve.run(_args("--images", images, "--batch", batch))


@pytest.mark.parametrize("model", ["digits", "tiny-text"])
def test_the_bare_loop_makes_the_very_images_the_worker_makes(model: str) -> None:
    """The baseline does the worker's work, no less: the same pixels for the same seeds."""
    import numpy as np

    from tandem.cli.bench import bare_pipeline, serve_pipeline
    from tandem.common.models import Registry
    from tandem.inference_worker.pipelines import Item, Params, build

    batch, steps = 2, 2
    guidance = serve_pipeline.GUIDANCE[model]
    call = (bare_pipeline.digits(steps, 16) if model == "digits"
            else bare_pipeline.tiny_text(steps, 16, guidance))
    bare = call([0, 1])
    spec = Registry.parse("").get(model)
    assert spec is not None
    tasks = serve_pipeline.tasks_of(model, batch, steps, "c")
    items = [Item(seed=t.seed, prompt=t.prompt, class_label=t.class_label) for t in tasks]
    worker = build(spec, "cpu", "float32").images(
        items, Params(width=16, height=16, steps=steps, guidance=guidance), lambda s, n: None)
    assert [a.shape for a in worker] == [a.shape for a in bare]
    assert all(np.array_equal(w, b) for w, b in zip(worker, bare, strict=True))
