"""The benches' shared statistics (``tandem.cli.bench.stats``), saturation notes and
``tandem bench all``: interleaving order, spread, goals judged on the median, the JSON
shape, the Markdown table, and one real run of the smallest benchmark through ``all``."""

from __future__ import annotations

import argparse
import importlib
import json
import time
from pathlib import Path

import pytest

from tandem.cli.bench import BENCHES, saturation, stats, suite
from tandem.cli.main import main
from tests.conftest import ROOT

# ----------------------------------------------------------------------------- repeats


def test_schedule_interleaves_the_sides_in_every_repeat_and_alternates_who_goes_first() -> None:
    order = stats.schedule(3, ["raw", "tandem"])
    assert order == [(0, "raw"), (0, "tandem"), (1, "tandem"), (1, "raw"),
                     (2, "raw"), (2, "tandem")]
    sides = [side for _, side in order]
    assert sides != sorted(sides)  # not every raw run, then every tandem run
    for r in range(3):
        assert sorted(s for i, s in order if i == r) == ["raw", "tandem"]


def test_schedule_refuses_no_repeats() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        stats.schedule(0, ["a", "b"])


async def test_interleaved_runs_the_sides_in_schedule_order_and_keeps_runs_per_side() -> None:
    calls: list[tuple[str, int]] = []

    def side(name: str):  # type: ignore[no-untyped-def]
        async def run(r: int) -> str:
            calls.append((name, r))
            return f"{name}{r}"
        return run

    runs = await stats.interleaved(2, {"a": side("a"), "b": side("b")})
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1)]
    assert runs == {"a": ["a0", "a1"], "b": ["b0", "b1"]}


def test_median_run_is_the_run_with_the_median_key_lower_middle_when_even() -> None:
    runs = [{"r": 3.0}, {"r": 1.0}, {"r": 2.0}]
    assert stats.median_run(runs, lambda x: x["r"]) == {"r": 2.0}
    assert stats.median_run([*runs, {"r": 4.0}], lambda x: x["r"]) == {"r": 2.0}


# ------------------------------------------------------------------------------ figures


def test_ratio_pairs_tandem_and_baseline_of_the_same_repeat() -> None:
    f = stats.Figure("x", "x", "msg/s", [90, 40, 100], [100, 50, 200], "raw")
    assert f.ratio == [0.9, 0.8, 0.5]
    assert (f.ratio_spread.min, f.ratio_spread.median, f.ratio_spread.max) == (0.5, 0.8, 0.9)
    with pytest.raises(ValueError, match="pair repeats"):
        stats.Figure("x", "x", "msg/s", [1, 2], [1], "raw")
    with pytest.raises(ValueError, match="needs a baseline"):
        stats.Figure("x", "x", "s", [1.0], goal=stats.Goal(">=", 1))


def test_goal_is_judged_on_the_median_not_the_best_or_the_mean() -> None:
    best_run_passes = stats.Figure("x", "x", "u", [0.95, 0.70, 0.75], [1, 1, 1], "raw",
                                   goal=stats.Goal(">=", 0.8))
    assert best_run_passes.met is False  # max 0.95 but median 0.75
    mean_fails = stats.Figure("x", "x", "u", [0.5, 0.85, 0.9], [1, 1, 1], "raw",
                              goal=stats.Goal(">=", 0.8))
    assert mean_fails.met is True  # mean 0.75 but median 0.85
    even = stats.Figure("t", "t", "s", [1.0, 3.0], goal=stats.Goal("<=", 2.0, on="tandem"))
    assert even.spread.median == 2.0 and even.met is True
    assert stats.Figure("t", "t", "s", [1.0]).met is None  # no goal: nothing judged


def test_figure_json_carries_spread_goal_met_and_why_only_when_not_met() -> None:
    missed = stats.Figure("pub", "publish", "msg/s", [70, 80, 75], [100, 100, 100], "raw",
                          goal=stats.Goal(">=", 0.8), why="saturated: bench process")
    j = stats.figures_json([missed, stats.Figure("t", "took", "s", [2.0, 1.0],
                                                 notes=[stats.NO_BASELINE])])
    p = j["pub"]
    assert set(p) == {"label", "unit", "tandem", "baseline", "baseline_label", "ratio",
                      "goal", "met", "why"}
    assert p["tandem"] == {"min": 70, "median": 75, "max": 80, "runs": [70, 80, 75]}
    assert p["ratio"]["median"] == 0.75 and p["met"] is False
    assert p["goal"] == {"on": "ratio", "op": ">=", "value": 0.8}
    assert p["why"] == "saturated: bench process"
    assert j["t"]["baseline"] is None and j["t"]["ratio"] is None and j["t"]["met"] is None
    assert j["t"]["why"] is None and j["t"]["notes"] == [stats.NO_BASELINE]
    met = stats.Figure("ok", "ok", "u", [1.0], [1.0], "raw", goal=stats.Goal(">=", 0.8),
                       why="stale")
    assert met.json()["why"] is None  # a met goal needs no excuse
    assert stats.all_met(j) is False and stats.all_met({"ok": met.json()}) is True
    with pytest.raises(ValueError, match="repeat"):
        stats.figures_json([met, met])


def test_render_prints_spread_baseline_goal_met_and_why() -> None:
    j = stats.figures_json([
        stats.Figure("pub", "publish", "msg/s", [70, 80, 75], [100, 100, 100], "raw nats-py",
                     goal=stats.Goal(">=", 0.8), why="saturated: bench process at 0.99 cores"),
        stats.Figure("f", "failover", "s", [7.0, 8.0, 9.0],
                     goal=stats.Goal("<=", 12, on="tandem"))])
    text = stats.render(j)
    assert "3 repeats" in text
    assert "tandem 75 [70-80]; raw nats-py 100 [100-100]  ratio 0.75 [0.7-0.8]" in text
    assert "goal ratio >= 0.8: NOT MET" in text
    assert "why not met: saturated: bench process at 0.99 cores" in text
    assert "failover (s): tandem 8 [7-9]; no baseline  goal tandem <= 12: met" in text


def test_markdown_table_has_a_row_per_figure_and_marks_failures_and_no_baseline() -> None:
    bus = {"figures": stats.figures_json([
        stats.Figure("pub", "publish | pipelined", "msg/s", [90.0], [100.0], "raw",
                     goal=stats.Goal(">=", 0.8))])}
    fail = {"figures": stats.figures_json([
        stats.Figure("f", "failover", "s", [7.0, 9.0], goal=stats.Goal("<=", 12, on="tandem"))])}
    table = stats.markdown({"bus": bus, "failover": fail, "scale": {"error": "boom"}})
    lines = table.strip().splitlines()
    assert lines[0] == "| bench | figure | Tandem | baseline | ratio | goal | met |"
    assert lines[2] == ("| bus | publish \\| pipelined (msg/s) | 90 | raw: 100 | 0.9 | "
                        "ratio >= 0.8 | met |")
    assert lines[3] == "| failover | failover (s) | 8 [7-9] | none | - | tandem <= 12 | met |"
    assert lines[4].startswith("| scale | (failed: boom)")
    assert all(line.count("|") - line.count("\\|") == 8 for line in lines)


# --------------------------------------------------------------------------- saturation


def test_why_names_the_saturated_machine_and_process_with_their_readings() -> None:
    busy = {"cores": {"nats-server": 0.9, "bench process": 0.95}, "cpus": 2,
            "machine_busy_cores": 1.98, "loop_busy": 0.93}
    text = saturation.why(busy, loop="bench process", extra=["hashing: 1 CPU-s"])
    assert text.startswith("saturated: the machine, 1.98 of 2 cores busy (0.13 of them not")
    assert "bench process at 0.95 cores (its event loop 93% busy" in text
    assert "nats-server at 0.90 cores" in text and text.endswith("hashing: 1 CPU-s")
    idle = saturation.why({"cores": {"worker": 0.3}, "cpus": 2, "machine_busy_cores": 0.6})
    assert idle.startswith("nothing measured saturated (machine 0.60 of 2 cores busy)")
    assert "worker 0.30" in idle


def test_meter_reads_this_process_and_its_loop_thread_over_a_window() -> None:
    meter = saturation.Meter({"bench": saturation.this_process}, loop="bench").start()
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:  # burn CPU in this (the loop's) thread
        pass
    w = meter.stop()
    assert w.cores["bench"] > 0 and w.loop_busy is not None and w.loop_busy > 0
    assert w.machine_cores is None or 0 <= w.machine_cores <= w.cpus + 0.01
    assert set(w.json()) == {"wall_s", "cores", "machine_busy_cores", "cpus", "loop_busy"}
    assert saturation.crc32_mib_per_s(8) > 0


# ---------------------------------------------------------------------------- the suite


@pytest.mark.parametrize("name", list(BENCHES))
def test_every_bench_takes_repeat_and_has_smoke_settings(name: str) -> None:
    mod = importlib.import_module(BENCHES[name])
    args = suite.bench_args(mod, name, 2, smoke=True)
    assert args.repeat == 2
    assert suite.bench_args(mod, name, None, smoke=False).repeat >= 1


def test_all_refuses_unknown_benchmarks() -> None:
    with pytest.raises(SystemExit, match="unknown benchmarks"):
        suite.selected("bus,nope", "")
    assert suite.selected("", "scale,failover") == [n for n in BENCHES
                                                    if n not in ("scale", "failover")]


def test_bench_all_writes_one_json_and_a_markdown_table(tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    out, md = tmp_path / "out.json", tmp_path / "out.md"
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "all", "--only", "bus", "--smoke", "--repeat", "2", "--json", str(out),
              "--markdown", str(md)])
    assert exit_.value.code == 0
    report = json.loads(out.read_text())
    assert report["machine"]["cpus"] >= 1 and report["repeat"] == 2 and report["smoke"]
    figures = report["benches"]["bus"]["figures"]
    assert set(figures) == {"publish", "fetch_ack"}
    for f in figures.values():
        assert len(f["tandem"]["runs"]) == len(f["baseline"]["runs"]) == 2
        assert f["ratio"]["min"] <= f["ratio"]["median"] <= f["ratio"]["max"]
        assert f["met"] == (f["ratio"]["median"] >= 0.8)
    table = md.read_text()
    assert "2 repeats each" in table and "| bus | JetStream publish" in table
    assert "figures over 2 repeats" in capsys.readouterr().out


def test_bench_args_are_what_the_cli_parses() -> None:
    from tandem.cli.bench import bus

    p = argparse.ArgumentParser()
    bus.add_arguments(p)
    assert p.parse_args(["--rounds", "4"]).repeat == 4  # the older name still works


def test_bench_all_writes_its_figures_into_the_readmes_from_a_saved_run(
        tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit):
        main(["bench", "all", "--only", "bus", "--smoke", "--repeat", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    report["benches"]["checkpoint"] = {"error": "RuntimeError('s3 down')", "ok": False}
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(report))
    root = tmp_path / "repo"
    for rel in ["README.md", *(f"services/{s}/README.md" for s in suite.SERVICE_BENCHES)]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text((ROOT / rel).read_text())
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "all", "--from", str(saved), "--readmes", str(root)])
    assert exit_.value.code == 1  # a bench of the saved run failed: so says the exit
    top = (root / "README.md").read_text()
    assert "| bus | JetStream publish" in top and "| checkpoint | (failed: " in top
    assert "1 repeat each" in top and "(not measured yet)" not in top
    mirror = (root / "services/checkpointer/README.md").read_text()
    assert "| checkpoint | (failed: " in mirror and "| bus |" not in mirror
    assert "| bus |" not in (root / "services/trainer/README.md").read_text()
    # The text around the markers is kept as it was.
    assert top.split(suite.BEGIN)[0] == (ROOT / "README.md").read_text().split(suite.BEGIN)[0]
    # A README without the markers: an error naming it, and nothing written anywhere.
    (root / "services/trainer/README.md").write_text("# trainer\n")
    report["date"] = "1999-01-01T00:00:00+00:00"  # a write would show this date
    saved.write_text(json.dumps(report))
    before = (root / "README.md").read_text()
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "all", "--from", str(saved), "--readmes", str(root)])
    assert exit_.value.code == 2
    assert (root / "README.md").read_text() == before


def test_bench_all_makes_one_table_of_benches_run_one_at_a_time(tmp_path: Path) -> None:
    one = tmp_path / "bus.json"
    with pytest.raises(SystemExit):
        main(["bench", "all", "--only", "bus", "--smoke", "--repeat", "1", "--json", str(one)])
    report = json.loads(one.read_text())
    later = json.loads(one.read_text())
    later["benches"] = {"checkpoint": {"error": "RuntimeError('s3 down')", "ok": False}}
    later["met"], later["seconds"] = {"checkpoint": None}, {"checkpoint": 1.0}
    later["date"] = report["date"][:11] + "23:59:00+00:00"
    later["machine"]["load_avg_1m"] = round(report["machine"]["load_avg_1m"] + 5, 2)
    two = tmp_path / "checkpoint.json"
    two.write_text(json.dumps(later))
    md = tmp_path / "all.md"
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "all", "--from", str(one), str(two), "--markdown", str(md)])
    assert exit_.value.code == 1  # one of them failed
    table = md.read_text()
    assert "| bus | JetStream publish" in table and "| checkpoint | (failed: " in table
    loads = f"{report['machine']['load_avg_1m']}-{later['machine']['load_avg_1m']}"
    assert f"load average {loads} at the starts of the benches" in table
    assert "-23:59 UTC" in table
    # What cannot be one table is refused, naming the file: a bench twice, another commit.
    with pytest.raises(SystemExit, match="more than one file"):
        main(["bench", "all", "--from", str(one), str(one)])
    later["machine"]["commit"] = "0000000"
    two.write_text(json.dumps(later))
    with pytest.raises(SystemExit, match=f"{two}.*commit"):
        main(["bench", "all", "--from", str(one), str(two)])
