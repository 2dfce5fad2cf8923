"""`tandem demo` (interim): runs every end-to-end path that exists, says what is missing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tandem.cli.stack import StackConfig, built_services

from .conftest import ROOT, service_env


def test_demo_runs_every_built_path_and_says_where_its_output_is(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    res = subprocess.run([sys.executable, "-m", "tandem.cli.main", "demo", "--out", str(out),
                          "--timeout", "120"], cwd=ROOT, env=service_env(),
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert f"output: {out.resolve()}" in res.stdout
    summary = json.loads((out / "summary.json").read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert all(s["status"] in ("passed", "skipped") for s in steps.values()), steps
    built, missing = built_services([k.service for k in StackConfig.load().processes])
    assert summary["not_built"] == missing  # and it says so
    for svc, why in missing.items():
        assert f"{svc}: {why}" in res.stdout
    if "cluster-agent" in built:
        assert steps["heartbeats"]["status"] == "passed"
    if {"gateway", "inference-worker"} <= set(built):
        assert steps["generation"]["status"] == "passed"
        pngs = list((out / "images").glob("*.png"))
        assert pngs and all(p.read_bytes().startswith(b"\x89PNG") for p in pngs)
    if {"trainer", "checkpointer"} <= set(built):
        assert steps["training"]["status"] == "passed"
        assert "committed at s3://" in steps["training"]["detail"]
    assert not (out / "stack" / "stack.json").exists()  # the stack was stopped


def test_demo_gives_up_on_each_wait_with_a_clear_message_and_still_stops_the_stack(
        tmp_path: Path) -> None:
    out = tmp_path / "demo"
    res = subprocess.run([sys.executable, "-m", "tandem.cli.main", "demo", "--out", str(out),
                          "--timeout", "0.5", "--grace", "3"], cwd=ROOT, env=service_env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stdout[-4000:] + res.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    failed = [s for s in summary["steps"] if s["status"] == "failed"]
    assert failed and all("after 0.5s" in s["detail"] or "not healthy" in s["detail"]
                          for s in failed), failed
    assert f"output: {out.resolve()}" in res.stdout
    assert not (out / "stack" / "stack.json").exists()
