"""`tandem demo` (`make demo`), shortened: the whole tour end to end, and its report.

The real demo trains for longer (readable digits); here a 20-step run keeps the test
short while every phase still runs: fleet, training with checkpoints mirrored to S3,
both clusters serving the newest checkpoint, a grid of every digit over HTTP while
cluster east is killed with a backlog, a clean stop, and the report.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT, service_env

DEMO = [sys.executable, "-m", "tandem.cli.main", "demo"]
SHORT = ["--steps", "20", "--checkpoint-every", "10", "--batch-size", "32",
         "--sample-steps", "8", "--images-per-digit", "1", "--backlog", "40",
         "--failover-timeout", "60", "--no-incident", "--grace", "10"]


@pytest.mark.slow
def test_demo_trains_serves_generates_every_digit_survives_a_dead_cluster_and_reports(
        tmp_path: Path) -> None:
    out = tmp_path / "demo"
    res = subprocess.run([*DEMO, "--out", str(out), "--timeout", "400", *SHORT], cwd=ROOT,
                         env=service_env(), capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    rec = json.loads((out / "demo.json").read_text())
    phases = {r["phase"]: r for r in rec["results"]}
    assert list(phases) == ["fleet", "training", "serving", "generation and failover"]
    assert all(r["status"] == "passed" for r in phases.values()), phases
    # Training: every step recorded, checkpoints written and committed in S3.
    assert rec["run"]["state"] == "succeeded"
    assert rec["run"]["latest_checkpoint_step"] == 20
    assert {s[0] for s in rec["steps"]} >= set(range(1, 21))
    assert {m["step"] for m in rec["mirrored"]} >= {10, 20}
    # Both clusters served the newest checkpoint; the grid came from it.
    assert {c: s["checkpoint_step"] for c, s in rec["serving"].items() if c != "grid"} == {
        "east": 20, "west": 20}
    assert rec["serving"]["grid"]["checkpoint_steps"] == [20]
    grid = sorted(p.name for p in (out / "images").glob("*.png"))
    assert grid == [f"digit{d}-0.png" for d in range(10)]
    # East was killed with unfinished tasks; every task still succeeded, and the ones it
    # stranded finished elsewhere (failover) or after east came back (no failover).
    f = rec["failover"]
    assert f["cluster"] == "east" and f["stranded"] >= 1
    assert f["finished_elsewhere"] + f["finished_after_restart"] == f["stranded"]
    assert all(g["state"] == "succeeded" for g in rec["generations"])
    assert len(rec["generations"]) == 10 + 40
    # GPU telemetry of both clusters' simulated nodes was recorded.
    assert {k.split("/")[0] for k in rec["telemetry"]} == {"east", "west"}
    # The report: one page and its figures, and where it is, printed at the end.
    page = (out / "report.html").read_text()
    for png in ("loss.png", "grid.png", "gpus.png", "failover.png"):
        assert (out / png).read_bytes().startswith(b"\x89PNG"), png
        assert f'src="{png}"' in page
    assert f"report: {(out / 'report.html').resolve()}" in res.stdout
    assert "training [" in res.stdout  # progress bars on the long phases
    # Stopped: cleanly, or (on a busy machine) SIGKILL after the grace period, never left.
    assert "] stopped cleanly" in res.stdout or "] stopped; had to SIGKILL" in res.stdout
    assert not (out / "stack" / "stack.json").exists()  # the stack was stopped


def test_demo_gives_up_on_a_wait_with_a_clear_message_and_still_stops_the_stack(
        tmp_path: Path) -> None:
    out = tmp_path / "demo"
    res = subprocess.run([*DEMO, "--out", str(out), "--timeout", "0.5", *SHORT], cwd=ROOT,
                         env=service_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout[-4000:] + res.stderr[-4000:]
    rec = json.loads((out / "demo.json").read_text())
    failed = [r for r in rec["results"] if r["status"] == "failed"]
    assert failed and all("after 0.5s" in r["detail"] or "not healthy" in r["detail"]
                          for r in failed), failed
    assert f"output: {out.resolve()}" in res.stdout
    assert (out / "report.html").exists()  # a report even of a failed run
    assert not (out / "stack" / "stack.json").exists()
