"""``tandem bench checkpoint`` at its smallest, for real (moto and nats-server started by
the bench): both sides upload the same files and are counted by the same formula; with
``--pin-s3`` moto runs on one CPU and the uploaders on the others."""

from __future__ import annotations

import json
import os

import pytest

from tandem.cli.bench import checkpoint
from tandem.cli.main import main


def test_the_checkpoint_bench_compares_like_with_like_and_pins_s3_on_request(
        capsys: pytest.CaptureFixture[str]) -> None:
    before = os.sched_getaffinity(0)
    with pytest.raises(SystemExit):  # 1 when the goal is missed: smoke sizes may miss it
        main(["bench", "checkpoint", *checkpoint.SMOKE, "--repeat", "2", "--pin-s3",
              "--json"])
    r = json.loads(capsys.readouterr().out)
    assert os.sched_getaffinity(0) == before  # given back for whatever runs next
    cpus = sorted(before)
    assert r["pinned"] == {"moto (S3)": cpus[:1], "bench process": cpus[1:]}
    assert sum(r["files"].values()) == 12 << 20
    m = r["figures"]["mirror"]
    assert len(r["raw_s"]) == len(r["tandem_s"]) == 2
    for side, secs in (("tandem", r["tandem_s"]), ("baseline", r["raw_s"])):
        # MiB over seconds on both sides (the seconds are printed to the ms)
        assert [12 / t for t in secs] == pytest.approx(m[side]["runs"], rel=0.01)
    assert m["notes"] == [f"S3 pinned: {r['pinned']}"]
