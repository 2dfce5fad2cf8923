"""``tandem bench checkpoint`` at its smallest, for real (moto and nats-server started by
the bench): every side uploads the same files and is counted by the same formula; with
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
    same = r["figures"]["mirror_same_check"]  # boto3 doing the mirror's SHA-256 check too
    assert len(r["raw_s"]) == len(r["tandem_s"]) == len(r["verified_s"]) == 2
    for fig, side, secs in ((m, "tandem", r["tandem_s"]), (m, "baseline", r["raw_s"]),
                            (same, "tandem", r["tandem_s"]),
                            (same, "baseline", r["verified_s"])):
        # MiB over seconds on every side; the seconds are printed to the ms and the
        # rates to 0.1 (or finer), so each rate lies between 12 MiB over the rounded
        # time's bounds, give or take 0.05 (a 40 ms transfer's rounding alone is 1.2%:
        # a relative tolerance of 1% flaked)
        assert len(secs) == len(fig[side]["runs"])
        for t, rate in zip(secs, fig[side]["runs"], strict=True):
            assert 12 / (t + 0.0005) - 0.05 <= rate <= 12 / (t - 0.0005) + 0.05, (side, t)
    assert same["goal"] is None and same["ratio"]["median"] == r["same_check_ratio"]
    assert m["notes"] == [f"S3 pinned: {r['pinned']}"]
