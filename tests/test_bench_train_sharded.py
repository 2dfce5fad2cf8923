"""``tandem bench train --sharded`` at its smallest (``train_sharded.SMOKE``), for real: two
torchrun node groups of two gloo ranks, NATS and moto started by the bench itself. It
checks the JSON's shape and that its figures hold together, never how fast anything is."""

from __future__ import annotations

import json

import pytest

from tandem.cli.bench import train_sharded
from tandem.cli.main import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_sharded_train_bench_reports_its_three_ratios_from_paired_repeats(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):  # 1 when a goal is missed: smoke sizes miss some
        main(["bench", "train", *train_sharded.SMOKE, "--repeat", "2", "--json"])
    r = json.loads(capsys.readouterr().out)
    figures = r["figures"]
    assert set(figures) == {"sharded_steps_per_s", "sharded_checkpoint_blocked",
                            "sharded_mirror"}
    for key, name in (("steps_ratio", "sharded_steps_per_s"),
                      ("block_ratio", "sharded_checkpoint_blocked"),
                      ("mirror_ratio", "sharded_mirror")):
        f = figures[name]
        assert r["sharded"][key] == f["ratio"]["median"]
        assert len(f["tandem"]["runs"]) == len(f["baseline"]["runs"]) == len(f["ratio"]["runs"])
        assert f["met"] == (f["ratio"]["median"] >= f["goal"]["value"] if f["goal"]["op"] == ">="
                            else f["ratio"]["median"] <= f["goal"]["value"])
    assert len(figures["sharded_steps_per_s"]["ratio"]["runs"]) == 2  # one per repeat
    # --steps 2 --every 2: one checkpoint per tandem segment, two segments.
    assert r["checkpoints"] == 2 == len(figures["sharded_checkpoint_blocked"]["ratio"]["runs"])
    # Each node wrote its own shards (node 0 with the DCP metadata and rank 0's files).
    sizes = r["state_bytes_per_node"]
    assert set(sizes) == {"node-0", "node-1"} and sizes["node-0"] > sizes["node-1"] > 0
    assert r["mirror_bytes_per_node"] == sizes
    # Every step of both tandem segments was published (2 x 2), and each checkpoint.
    assert r["events_published"] >= 2 * 2 + 2
    # Each tandem segment's wait after its last step (saves, mirrors) is inside it.
    tails = r["raw"]["ranks"]["tail_s"]
    segs = [2 / x for x in r["raw"]["ranks"]["tandem_steps_per_s"]]
    assert len(tails) == 2 and all(0 < t < s for t, s in zip(tails, segs, strict=True))
    assert any("last step ended" in n for n in figures["sharded_steps_per_s"]["notes"])
    assert r["ok"] == all(f["met"] is not False for f in figures.values())
