"""FSDP2 training with per-rank DCP checkpoints, on gloo ranks spawned on loopback.

Three worlds run once for the module (each a few steps of a tiny DiT):

- 2 ranks: ``ref2`` trains 4 steps, checkpointing at 2 and 4; ``same`` resumes
  ``ref2``'s step 2 on 2 ranks.
- between them ``ref2``'s checkpoints go through the checkpointer's mirror into S3
  (moto); step 4 then loses a shard there, so a restore falls back to step 2;
- 4 ranks: ``ref4`` trains 4 steps; ``up`` resumes ``ref2``'s step 2 as restored from
  S3 (2 -> 4 ranks);
- 2 ranks: ``down`` resumes ``ref4``'s step 2 (4 -> 2 ranks).

The global batch is the same in every world (16), so a resumed run trains on the same
samples. On the same world size a resume is bitwise the uninterrupted run. On another,
the state loaded is bitwise the state saved (resharding moves bytes), but each rank
draws its own noise from its own generator, so the losses that follow differ from the
uninterrupted run's by sampling: they must stay within ``RESHARD_RTOL`` of them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.checkpointer.mirror import Mirror, MirrorConfig
from tandem.cli.devstack import S3Server
from tandem.common import checkpoints as ck
from tandem.common.settings import Settings, load
from tandem.common.storage import ensure_bucket, s3_client
from tests.fsdp_support import Job, spawn

# Spawning eight ranks that each import torch is most of this module's time; on a busy
# two-core machine the module fixture alone has taken over 300 s.
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

# Relative difference allowed between a resharded run's loss and the uninterrupted
# run's at the same step (noise drawn by other generators on the same samples).
RESHARD_RTOL = 0.25


def _load(out: Path, name: str) -> dict[str, Any]:
    return torch.load(out / f"{name}.pt", weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fsdp")
    out = root / "out"
    spawn(2, [Job("ref2", str(root / "ref2")),
              Job("same", str(root / "same"), resume=str(root / "ref2/ref2/step-2"))], out)

    s3 = s3_client(load(Settings, s3_endpoint=s3_server.url, s3_access_key="tandem",
                        s3_secret_key="tandem"))
    bucket = f"fsdp-{root.name.lower().replace('_', '-')}"
    ensure_bucket(s3, bucket)
    mirror = Mirror(s3, MirrorConfig(bucket=bucket))
    try:
        for step in (2, 4):
            path = ck.step_dir(root / "ref2", "ref2", step)
            assert mirror.mirror(path, ck.verify(path)).committed
    finally:
        mirror.close()
    s3.delete_object(Bucket=bucket, Key=ck.object_key("ref2", 4, "shards/__1_0.distcp"))
    restored = ck.restore(s3, bucket, "ref2", root / "restored")

    spawn(4, [Job("ref4", str(root / "ref4")),
              Job("up", str(root / "up"), resume=str(restored.path))], out)
    spawn(2, [Job("down", str(root / "down"), resume=str(root / "ref4/ref4/step-2")),
              Job("full", str(root / "full"), steps=6, full_at=2, save_full_at=4)], out)
    return {"root": root, "restored": restored, "s3": s3, "bucket": bucket,
            **{n: _load(out, n) for n in ("ref2", "same", "ref4", "up", "down", "full")}}


def assert_bitwise(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_bitwise(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), where
    else:
        assert a == b, where


def test_every_rank_writes_its_shards_and_the_manifest_lists_each_with_its_checksum(
        runs: dict[str, Any]) -> None:
    for name, world in (("ref2", 2), ("ref4", 4)):
        path = ck.step_dir(runs["root"] / name, name, 4)
        manifest = ck.verify(path)  # every file against its size and checksum
        assert (manifest.kind, manifest.world_size, manifest.part) == (ck.SHARDED, world, "")
        shards = sorted(f.name for f in manifest.files if ck.shard_rank(f.name) is not None)
        assert shards == [f"shards/__{r}_0.distcp" for r in range(world)]
        assert {ck.DCP_METADATA, *ck.SHARDED_STATE} <= {f.name for f in manifest.files}
    assert all(b > 0 for b in runs["ref2"]["blocked"])


def test_a_sharded_write_the_disk_had_no_room_for_leaves_no_folder_and_the_next_commits(
        runs: dict[str, Any]) -> None:
    import errno

    # Step 2 failed at the node's commit, step 4 on rank 0's own files (torch.save)
    # while the other rank's shards were still being written: the node's first rank's
    # errors.
    assert runs["full"]["errors"] == [(2, errno.ENOSPC), (4, errno.ENOSPC)]
    folder = runs["root"] / "full" / "full"
    # Every rank's shards of steps 2 and 4 were removed once all had ended.
    assert sorted(p.name for p in folder.iterdir()) == ["step-6"]
    assert ck.verify(folder / "step-6").world_size == 2


def test_same_world_size_resume_is_bitwise_the_uninterrupted_run(runs: dict[str, Any]) -> None:
    ref, same = runs["ref2"], runs["same"]
    assert_bitwise(same["full"]["loaded"], ref["full"][2], "loaded")
    assert same["losses"] == {3: ref["losses"][3], 4: ref["losses"][4]}
    assert_bitwise(same["full"][4], ref["full"][4], "step 4")


def test_a_checkpoint_missing_a_shard_in_s3_is_skipped_for_the_previous_one(
        runs: dict[str, Any]) -> None:
    restored = runs["restored"]
    assert restored.step == 2
    assert restored.skipped == [(4, "shards/__1_0.distcp: missing from S3")]
    assert ck.verify(restored.path).world_size == 2


def test_a_sharded_checkpoint_is_served_whole_from_its_shards_never_one_missing_a_shard(
        runs: dict[str, Any]) -> None:
    """The inference worker's loader consolidates every rank's shards into one model
    (EMA laid over the weights), bitwise what the ranks held; step 4, a shard short in
    S3, is passed over."""
    served = ck.load_serving("ref2", s3=runs["s3"], bucket=runs["bucket"])
    assert (served.step, served.label) == (2, "ref2/step-2")
    assert served.skipped == [(4, "shards/__1_0.distcp: missing from S3")]
    full = runs["ref2"]["full"][2]
    assert_bitwise(dict(served.unet.state_dict()), {**full["model"], **full["ema"]},
                   "served")


@pytest.mark.parametrize(("run", "source"), [("down", "ref4"), ("up", "ref2")])
def test_a_resume_on_another_world_size_reshards_exactly_and_loss_continues(
        runs: dict[str, Any], run: str, source: str) -> None:
    got, ref = runs[run], runs[source]
    assert_bitwise(got["full"]["loaded"], ref["full"][2], f"{run} loaded")
    for step in (3, 4):
        assert got["losses"][step] == pytest.approx(ref["losses"][step], rel=RESHARD_RTOL)


def test_a_sharded_folder_missing_a_shard_is_never_a_valid_checkpoint(
        runs: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "step-4"
    shutil.copytree(ck.step_dir(runs["root"] / "ref4", "ref4", 4), path)
    (path / "shards/__3_0.distcp").unlink()
    with pytest.raises(ck.CorruptCheckpoint, match=r"__3_0\.distcp missing"):
        ck.verify(path)
    # Re-scanning what is left does not make it whole: it is at most a node's part.
    with pytest.raises(ValueError, match="a shard of rank 3"):
        ck.sharded(ck.scan(path, "ref4", 4), 4, "")
    assert ck.sharded(ck.scan(path, "ref4", 4), 4, "n0").part == "n0"


def _torchrun(tmp_path: Path, world: int, steps: int, resume: str = "") -> Path:
    """Run ``tandem.trainer.rank`` under torchrun as the coordinator launches it (no bus:
    the spec names no event relay) and return the run's checkpoint folder."""
    import subprocess

    import msgspec

    from tandem.cli.devstack import free_port
    from tandem.trainer.launcher import LocalLauncher, place
    from tandem.trainer.spec import LaunchSpec

    job = Job("tr", str(tmp_path / "ckpt"), steps=steps)
    spec = LaunchSpec(run_id="tr", attempt=1, config=job.config(world),
                      checkpoint_root=job.root, attempt_dir=str(tmp_path / f"a{world}"),
                      rank_nodes=["n0"] * world, resume_path=resume, node="n0")
    spec_path = tmp_path / f"launch-{world}.json"
    spec_path.write_bytes(msgspec.json.encode(spec))
    placement = place(world, ["n0"])
    assert placement is not None
    cmd = LocalLauncher().command(placement, 0, free_port(), spec_path)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return ck.run_dir(job.root, "tr")


def test_the_rank_entry_point_trains_fsdp_under_torchrun_and_resumes_on_more_ranks(
        tmp_path: Path) -> None:
    first = _torchrun(tmp_path, 1, steps=2)
    assert ck.verify(first / "step-2").world_size == 1
    second = _torchrun(tmp_path, 2, steps=4, resume=str(first / "step-2"))
    manifest = ck.verify(second / "step-4")
    assert (manifest.world_size, manifest.part) == (2, "")
    trainer = torch.load(second / "step-4" / "trainer.pt", weights_only=True)
    assert (trainer["step"], trainer["data_pos"], trainer["world_size"]) == (4, 4, 2)


def test_dcp_metadata_is_read_without_unpickling_anything_but_dcp_metadata(
        tmp_path: Path) -> None:
    import pickle

    import torch.distributed.checkpoint as dcp

    from tandem.common.checkpoints.dcp import check_shards, read_metadata
    from tandem.common.events import CheckpointManifest

    shards = tmp_path / ck.SHARD_DIR
    with pytest.warns(UserWarning, match="single process"):  # no process group here
        dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(shards), no_dist=True)
    assert "w" in read_metadata(shards).state_dict_metadata
    manifest = ck.scan(tmp_path, "r", 1)
    check_shards(tmp_path, manifest)  # every shard the metadata names is listed
    listed = [f for f in manifest.files if ck.shard_rank(f.name) is None]
    with pytest.raises(ck.CorruptCheckpoint, match="the manifest does not list"):
        check_shards(tmp_path, CheckpointManifest(run_id="r", step=1, files=listed))

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("true",))

    (shards / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ck.CorruptCheckpoint, match=r"refers to (posix|os)\.system"):
        check_shards(tmp_path, manifest)


def test_non_tensor_state_values_are_loaded_with_weights_only(tmp_path: Path) -> None:
    """DCP saves a state's non-tensor values as torch.save bytes and its own planner loads
    them with weights_only=False; Tandem's planner admits plain values only."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from tandem.common.checkpoints.dcp import SafePlanner, SafeReader

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("true",))

    good, bad = tmp_path / "good", tmp_path / "bad"
    with pytest.warns(UserWarning, match="single process"):
        dcp.save({"w": torch.ones(2), "hp": {"lr": 0.5, "betas": (0.9, 0.99)}},
                 checkpoint_id=str(good), no_dist=True)
        dcp.save({"w": torch.ones(2), "hp": Evil()}, checkpoint_id=str(bad), no_dist=True)
    state: dict[str, Any] = {"w": torch.zeros(2), "hp": {"lr": 0.0, "betas": (0.0, 0.0)}}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(state, storage_reader=SafeReader(good), planner=SafePlanner(), no_dist=True)
    assert state["hp"] == {"lr": 0.5, "betas": (0.9, 0.99)}
    assert torch.equal(state["w"], torch.ones(2))
    with (pytest.warns(UserWarning, match="single process"),
          pytest.raises(CheckpointException, match=r"unsupported GLOBAL (posix|os)\.system")):
        dcp.load({"w": torch.zeros(2), "hp": 0}, storage_reader=SafeReader(bad),
                 planner=SafePlanner(), no_dist=True)
