"""The S3 checkpoint layout, listing and verified restore (``tandem.common.checkpoints``),
a checkpoint file's checksum (CRC32 in the manifests written now, SHA-256 in those written
before, each checked on the way to S3, on restore and on the local disk), and the
``tandem checkpoints`` commands, against a real S3 endpoint (moto)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import zlib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tandem.checkpointer.mirror import LocalCheckpointError, Mirror, MirrorConfig
from tandem.cli import checkpoints as cli
from tandem.cli.devstack import S3Server
from tandem.common import checkpoints as ck
from tandem.common.checkpoints import checksum
from tandem.common.errors import CheckpointCorrupt, CheckpointNotFound
from tandem.common.events import CheckpointManifest, FileEntry
from tandem.common.settings import Settings, load
from tandem.common.storage import ensure_bucket, s3_client
from tests.checkpoint_support import MiB, write_checkpoint


@pytest.fixture
def s3(s3_server: S3Server) -> Any:
    return s3_client(load(Settings, s3_endpoint=s3_server.url, s3_access_key="tandem",
                          s3_secret_key="tandem"))


@pytest.fixture
def bucket(s3: Any, uid: str) -> str:
    name = f"ckpt-{uid}"
    ensure_bucket(s3, name)
    return name


def commit(s3: Any, bucket: str, root: Path, run: str, step: int,
           sizes: dict[str, int] | None = None, lineage: int = 0) -> None:
    directory, manifest = write_checkpoint(root, run, step, sizes, lineage)
    mirror = Mirror(s3, MirrorConfig(bucket=bucket, multipart_threshold=5 * MiB,
                                     part_size=5 * MiB))
    try:
        assert mirror.mirror(directory, manifest).committed
    finally:
        mirror.close()


def flip_byte(s3: Any, bucket: str, key: str) -> None:
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))


def test_file_names_that_could_escape_a_checkpoint_are_rejected() -> None:
    assert ck.object_key("run-1", 40, "ema/model.safetensors") == \
        "runs/run-1/checkpoints/step-40/ema/model.safetensors"
    for bad in ("../x", "/abs", "a//b", "a/./b", "", "manifest.json", "sp ace", "a\\b"):
        with pytest.raises(ValueError, match="invalid checkpoint file name"):
            ck.check_name(bad)
    with pytest.raises(ValueError, match="run id"):
        ck.run_prefix("a/b")
    assert ck.parse_step("step-12") == 12
    assert ck.parse_step("step-12.incomplete") is None
    assert ck.parse_step("step-012") is None


def test_retention_keeps_the_newest_n_and_every_multiple_of_k() -> None:
    assert ck.retention([1, 2, 3, 4, 5, 6, 7, 8], keep_last=2, keep_every=4) == [1, 2, 3, 5, 6]
    assert ck.retention([10, 20, 30], keep_last=3) == []
    assert ck.retention([10, 20, 30], keep_last=1) == [10, 20]


def test_layout_names_local_and_s3_sides_alike(tmp_path: Path) -> None:
    assert ck.step_dir(tmp_path, "r", 7).name == ck.step_prefix("r", 7).split("/")[-2]
    assert ck.parse_step(ck.incomplete_dir(tmp_path, "r", 7).name) is None
    for name in ("step-3", "step-10", "step-10.incomplete", "step-9.corrupt", "latest"):
        (tmp_path / "r" / name).mkdir(parents=True)
    assert [s for s, _ in ck.local_steps(tmp_path / "r")] == [10, 3]
    keys = [ck.object_key("r", 5, "a.bin"), ck.manifest_key("r", 5),
            ck.object_key("r", 6, "a.bin")]
    assert ck.steps_in_listing(keys, "r") == {5: True, 6: False}
    assert ck.local_retention([1, 2, 3, 4], committed={1, 3, 4}, keep=2) == [1]
    assert ck.local_retention([1, 2], committed={1, 2}, keep=0) == [1, 2]


def test_a_lineage_owns_the_steps_after_its_fork_and_abandons_its_parents_later_ones() -> None:
    root = ck.Lineage()
    assert (root.current, root.owner(7), root.holds(7, 0), root.holds(7, 1)) == (0, 0, True, False)
    # Lineage 1 forked at step 10; lineage 2 forked from lineage 1's history at step 4.
    line = root.fork(10).fork(4)
    assert line.json() == [10, 4] and line.current == 2
    assert [line.owner(s) for s in (2, 4, 5, 10, 11)] == [0, 0, 2, 2, 2]
    assert line.holds(4, 0) and not line.holds(6, 0) and not line.holds(12, 1)
    assert line.abandoned(6, 0) and line.abandoned(12, 1) and not line.abandoned(4, 0)
    assert not line.abandoned(20, 3) and not line.holds(20, 3)  # newer than the record
    assert root.fork(-2).forks == (0,)  # a rollback before the first step: from scratch
    with pytest.raises(ValueError, match="fork of lineage 2 must be a step >= 0"):
        ck.Lineage.of([3, -1])


def test_a_checkpoints_name_key_and_listing_carry_its_lineage(tmp_path: Path) -> None:
    assert ck.step_name(4, 1) == "step-4-l1" and ck.step_name(4) == "step-4"
    assert ck.parse_checkpoint("step-4-l1") == (4, 1) == ck.CheckpointId(4, 1)
    assert ck.parse_checkpoint("step-4-l0") is None  # lineage 0 has one name only
    assert ck.parse_checkpoint("step-4-l1.incomplete") is None
    assert ck.object_key("r", 4, "a.bin", 1) == "runs/r/checkpoints/step-4-l1/a.bin"
    keys = [ck.manifest_key("r", s, lin) for s, lin in ((2, 0), (4, 0), (4, 1), (6, 2))]
    assert ck.checkpoints_in_listing(keys, "r") == {(2, 0): True, (4, 0): True,
                                                    (4, 1): True, (6, 2): True}
    assert ck.steps_in_listing(keys, "r") == {2: True, 4: True}  # lineage 0's history
    line = ck.Lineage((2,))
    assert ck.steps_in_listing(keys, "r", line) == {2: True, 4: True}  # 4 of lineage 1
    for step, lineage in ((2, 0), (4, 0), (4, 1)):
        tmp = ck.prepare_incomplete(tmp_path, "r", step, lineage)
        (tmp / "a.bin").write_bytes(b"x" * step)
        path, manifest = ck.commit("r", step, tmp, lineage=lineage)
        assert path.name == ck.step_name(step, lineage) and manifest.lineage == lineage
    resume, _ = ck.newest_valid(tmp_path, "r", line=line)
    assert resume is not None and resume.path.name == "step-4-l1"
    assert resume.manifest.lineage == 1
    resume, _ = ck.newest_valid(tmp_path, "r", line=line.fork(3))  # lineage 2 at 3
    assert resume is not None and resume.path.name == "step-2"  # never the abandoned 4


def test_restore_verifies_every_file_and_falls_back_past_a_corrupt_checkpoint(
        s3: Any, bucket: str, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    run = "run-a"
    for step in (100, 200, 300):
        commit(s3, bucket, tmp_path / "local", run, step)
    # An upload in progress (no manifest) is never listed or restored.
    s3.put_object(Bucket=bucket, Key=ck.object_key(run, 400, "rng.bin"), Body=b"x")
    assert ck.list_steps(s3, bucket, run) == {100: True, 200: True, 300: True, 400: False}
    assert ck.committed_steps(s3, bucket, run) == [100, 200, 300]
    assert ck.newest_committed(s3, bucket, run) == 300

    flip_byte(s3, bucket, ck.object_key(run, 300, "optimizer.bin"))  # multipart file
    s3.delete_object(Bucket=bucket, Key=ck.object_key(run, 200, "rng.bin"))

    restored = ck.restore(s3, bucket, run, tmp_path / "out")
    assert restored.step == 100
    assert [s for s, _ in restored.skipped] == [300, 200]
    assert "optimizer.bin: crc32" in restored.skipped[0][1]
    assert "rng.bin: missing" in restored.skipped[1][1]
    assert restored.path == tmp_path / "out" / "step-100"
    assert ck.scan(restored.path, run, 100).files == restored.manifest.files
    assert not (tmp_path / "out" / "step-300").exists()  # a corrupt one is never handed over
    assert not (tmp_path / "out" / "step-300.incomplete").exists()
    assert load_file(str(restored.path / "model.safetensors"))["b"][0] == 100

    with pytest.raises(CheckpointNotFound, match=r"step 300: optimizer\.bin: crc32"):
        ck.restore(s3, bucket, run, tmp_path / "out", step=300, fallback=False)
    with pytest.raises(CheckpointNotFound, match=r"committed steps: \[100, 200, 300\]"):
        ck.restore(s3, bucket, run, tmp_path / "out", step=400)


def test_restore_takes_only_checkpoints_of_the_runs_current_lineage(
        s3: Any, bucket: str, tmp_path: Path) -> None:
    run = "run-l"
    for step, lineage in ((100, 0), (200, 0), (300, 0), (200, 1)):
        commit(s3, bucket, tmp_path / "local", run, step, lineage=lineage)
    line = ck.Lineage((100,))  # lineage 1 forked at 100: 200 and 300 of lineage 0 abandoned
    assert ck.committed_steps(s3, bucket, run, line) == [100, 200]
    restored = ck.restore(s3, bucket, run, tmp_path / "out", line=line)
    assert (restored.step, restored.lineage, restored.path.name) == (200, 1, "step-200-l1")
    flip_byte(s3, bucket, ck.object_key(run, 200, "model.safetensors", 1))
    restored = ck.restore(s3, bucket, run, tmp_path / "out", line=line)
    assert (restored.step, restored.lineage) == (100, 0)  # falls back along its history
    assert ck.restore(s3, bucket, run, tmp_path / "out").step == 300  # lineage 0's own


def test_a_worker_downloads_only_the_weights_of_the_newest_committed_checkpoint(
        s3: Any, bucket: str, tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    run = "run-w"
    assert ck.newest_committed(s3, bucket, run) is None
    commit(s3, bucket, tmp_path / "local", run, 7, sizes={"rng.bin": 10})
    step = ck.newest_committed(s3, bucket, run)
    assert step == 7
    path = ck.download(s3, bucket, run, step, tmp_path / "w", files=["model.safetensors"])
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "model.safetensors"]
    assert load_file(str(path / "model.safetensors"))["w"].shape == (16, 16)


def test_a_corrupt_manifest_is_skipped_like_a_corrupt_file(
        s3: Any, bucket: str, tmp_path: Path) -> None:
    run = "run-m"
    for step in (1, 2):
        commit(s3, bucket, tmp_path / "local", run, step, sizes={"rng.bin": 10})
    s3.put_object(Bucket=bucket, Key=ck.manifest_key(run, 2), Body=b'{"run_id": "run-m"')
    restored = ck.restore(s3, bucket, run, tmp_path / "out")
    assert restored.step == 1
    assert "manifest.json: invalid manifest" in restored.skipped[0][1]


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_lists_committed_checkpoints_and_restores_with_fallback(
        s3: Any, s3_server: S3Server, bucket: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    run = "run-cli"
    for step in (5, 10):
        commit(s3, bucket, tmp_path / "local", run, step, sizes={"rng.bin": 1000})
    for k, v in {"S3_ENDPOINT": s3_server.url, "S3_BUCKET": bucket, "S3_ACCESS_KEY": "tandem",
                 "S3_SECRET_KEY": "tandem"}.items():
        monkeypatch.setenv(f"TANDEM_{k}", v)

    assert _cli(["checkpoints", "list", run, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [c["step"] for c in listed["checkpoints"]] == [5, 10]
    assert listed["checkpoints"][1]["uri"] == f"s3://{bucket}/runs/{run}/checkpoints/step-10/"

    flip_byte(s3, bucket, ck.object_key(run, 10, "model.safetensors"))
    out = tmp_path / "restored"
    assert _cli(["checkpoints", "restore", run, "-o", str(out)]) == 0
    text = capsys.readouterr()
    assert "restored step-5 " in text.out
    assert "skipped step 10" in text.err and "model.safetensors: crc32" in text.err
    assert (out / "step-5" / "rng.bin").stat().st_size == 1000

    assert _cli(["checkpoints", "restore", run, "--step", "10", "--no-fallback",
                 "-o", str(out)]) == 1
    assert "no committed checkpoint verifies" in capsys.readouterr().err
    assert _cli(["checkpoints", "list", "no-such-run"]) == 0
    assert "no committed checkpoints" in capsys.readouterr().out

    # A rollback forked lineage 1 at step 5: its step 10 is listed beside lineage 0's
    # and restored from the history the run's forks name.
    commit(s3, bucket, tmp_path / "local", run, 10, sizes={"rng.bin": 7}, lineage=1)
    assert _cli(["checkpoints", "list", run, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["checkpoints"]
    assert [(c["step"], c["lineage"]) for c in listed] == [(5, 0), (10, 0), (10, 1)]
    assert _cli(["checkpoints", "restore", run, "--forks", "5", "-o", str(out)]) == 0
    assert "restored step-10-l1 " in capsys.readouterr().out
    assert (out / "step-10-l1" / "rng.bin").stat().st_size == 7


def test_a_worker_loads_the_newest_verified_checkpoint_with_ema_weights(
        s3: Any, bucket: str, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from tandem.common.diffusion import UNetConfig, build_unet

    run = "run-serve"
    cfg = UNetConfig(sample_size=8, block_out_channels=(8, 8, 8), norm_num_groups=4)
    for step in (10, 20):
        d = tmp_path / "local" / f"step-{step}"
        d.mkdir(parents=True)
        unet = build_unet(cfg, seed=step)
        save_file(dict(unet.state_dict()), str(d / "model.safetensors"))
        ema = {k: torch.full_like(p, float(step)) for k, p in unet.named_parameters()}
        save_file(ema, str(d / "ema.safetensors"))
        (d / "model_config.json").write_text(json.dumps({"kind": "unet", **cfg.to_dict()}))
        (d / "optimizer.pt").write_bytes(b"not needed to serve")
        mirror = Mirror(s3, MirrorConfig(bucket=bucket))
        try:
            mirror.mirror(d, ck.scan(d, run, step))
        finally:
            mirror.close()

    unet, scheduler, label, step = ck.load_serving_model(run, s3=s3, bucket=bucket)
    assert (label, step) == (f"{run}/step-20", 20)
    assert all(float(p.detach().flatten()[0]) == 20.0 for p in unet.parameters())  # EMA laid over
    assert scheduler.config.num_train_timesteps == cfg.num_train_timesteps

    flip_byte(s3, bucket, ck.object_key(run, 20, "ema.safetensors"))
    unet, _, label, step = ck.load_serving_model(run, s3=s3, bucket=bucket)
    assert (label, step) == (f"{run}/step-10", 10)
    assert all(float(p.detach().flatten()[0]) == 10.0 for p in unet.parameters())


def _sharded_part(node: str, ranks: list[int], world: int, rank0: bool) -> Any:
    from tandem.common.events import CheckpointManifest, FileEntry

    names = [f"shards/__{r}_0.distcp" for r in ranks]
    if rank0:
        names += [ck.DCP_METADATA, *ck.SHARDED_STATE]
    files = [FileEntry(name=n, size=len(n), sha256=f"{i:064x}") for i, n in enumerate(names)]
    return ck.sharded(CheckpointManifest(run_id="r", step=8, files=files), world, node)


def test_a_sharded_checkpoint_commits_only_whole_from_every_nodes_part(
        s3: Any, bucket: str, tmp_path: Path) -> None:
    a = _sharded_part("na", [0, 1], 4, rank0=True)
    b = _sharded_part("nb", [2, 3], 4, rank0=False)
    assert (a.part, b.part) == ("na", "nb")  # neither node holds every shard
    with pytest.raises(CheckpointCorrupt, match=r"node na's part .* is not a commit"):
        ck.decode_manifest(ck.encode_manifest(a), "r", 8)
    whole = ck.merge_parts([a, b])
    assert (whole.part, whole.world_size, ck.missing(whole)) == ("", 4, [])
    assert ck.decode_manifest(ck.encode_manifest(whole), "r", 8).files == whole.files
    with pytest.raises(ValueError, match="lacks a shard of rank 2, a shard of rank 3"):
        ck.merge_parts([a])
    bad = ck.encode_manifest(whole).replace(
        b"shards/__3_0.distcp", b"shards/__9_0.distcp")
    with pytest.raises(CheckpointCorrupt, match="rank 9 outside world size 4"):
        ck.decode_manifest(bad, "r", 8)

    # The checkpointer's mirror never commits a part as a checkpoint; it mirrors and
    # records it, and commits the merge only once every node's part is recorded.
    parts = {}
    for node, manifest in (("nb", b), ("na", a)):
        directory = tmp_path / node / "step-8"
        for f in manifest.files:
            (directory / f.name).parent.mkdir(parents=True, exist_ok=True)
            (directory / f.name).write_bytes(f"{node} {f.name}".encode())
        parts[node] = (directory, ck.sharded(ck.scan(directory, "r", 8), 4, node))
    mirror = Mirror(s3, MirrorConfig(bucket=bucket))
    try:
        with pytest.raises(ValueError, match="not a commit"):
            mirror.mirror(*parts["nb"])
        assert ck.list_steps(s3, bucket, "r") == {}  # refused before sending anything
        first = mirror.mirror_part(*parts["nb"], attempt=2)
        assert (first.committed, first.lacks) == (False, [ck.DCP_METADATA, *ck.SHARDED_STATE,
                                                          "a shard of rank 0",
                                                          "a shard of rank 1"])
        assert ck.list_steps(s3, bucket, "r") == {8: False}
        # A part of another attempt never completes this one's.
        stale = mirror.mirror_part(*parts["na"], attempt=1)
        assert stale.lacks and ck.list_steps(s3, bucket, "r") == {8: False}
        last = mirror.mirror_part(*parts["na"], attempt=2)
        assert (last.committed, last.lacks) == (True, [])
    finally:
        mirror.close()
    committed = ck.read_manifest(s3, bucket, "r", 8)
    assert committed == last.manifest and committed.part == ""
    assert ck.same_files(committed, ck.merge_parts([p for _, p in parts.values()]))
    assert ck.restore(s3, bucket, "r", tmp_path / "restored").step == 8


def test_the_mirror_reuses_its_part_buffers_and_stores_every_byte_as_read(
        s3: Any, bucket: str, tmp_path: Path) -> None:
    """Parts are read into buffers the mirror keeps (two at concurrency 1): a buffer
    handed back before its part was sent or hashed would store or hash the next part's
    bytes. Two checkpoints of 4-part files (the last part short), one mirror: every
    object equals its file, and the buffers are the same two throughout."""
    mirror = Mirror(s3, MirrorConfig(bucket=bucket, multipart_threshold=5 * MiB,
                                     part_size=5 * MiB, concurrency=1))
    seen: set[int] = set()
    taken = mirror._buffer

    def buffer() -> bytearray:
        buf = taken()
        seen.add(id(buf))
        return buf

    mirror._buffer = buffer  # type: ignore[method-assign]
    try:
        for step in (1, 2):
            sizes = {"optimizer.bin": 17 * MiB + 3, "ema.bin": 15 * MiB}
            directory, manifest = write_checkpoint(tmp_path, "reuse", step, sizes)
            assert mirror.mirror(directory, manifest).committed
            for name in sizes:
                stored = s3.get_object(Bucket=bucket,
                                       Key=ck.object_key("reuse", step, name))["Body"].read()
                assert stored == (directory / name).read_bytes(), (step, name)
    finally:
        mirror.close()
    assert 1 <= len(seen) <= 2  # 8 parts of 5 MiB went through the same buffers


def test_crc32_of_parts_combines_into_the_crc32_of_the_whole() -> None:
    """The mirror never reads a file twice: its CRC32 is combined from its parts'."""
    rnd = random.Random(7)
    for _ in range(50):
        a, b = rnd.randbytes(rnd.randint(0, 4096)), rnd.randbytes(rnd.randint(0, 4096))
        assert checksum.combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    parts = [os.urandom(5 * MiB), os.urandom(5 * MiB), os.urandom(123)]
    whole = checksum.PartsCheck(FileEntry(name="f", size=sum(map(len, parts)),
                                          crc32=checksum.crc32_hex(zlib.crc32(b"".join(parts)))),
                                None)
    for p in parts:
        assert whole.feed(p).done()  # a CRC32 entry reads no block: the parts' CRCs do
        whole.part(zlib.crc32(p).to_bytes(4, "big"), len(p))
    assert whole.problem() == ""
    swapped = checksum.PartsCheck(whole.entry, None)
    for p in (parts[1], parts[0], parts[2]):  # the same bytes in another order
        swapped.part(zlib.crc32(p).to_bytes(4, "big"), len(p))
    assert swapped.problem().startswith("crc32 ")


def test_a_manifest_without_a_well_formed_checksum_is_refused_naming_the_file() -> None:
    def manifest(**entry: Any) -> bytes:
        return ck.encode_manifest(CheckpointManifest(run_id="r", step=1, files=[
            FileEntry(name="a.bin", size=1, **entry)]))

    for entry, why in (({}, r"a\.bin: no checksum \(crc32 or sha256\)"),
                       ({"crc32": "ABCDEF01"}, r"a\.bin: crc32 must be 8 lowercase hex"),
                       ({"crc32": "abc"}, r"a\.bin: crc32 must be 8 lowercase hex"),
                       ({"sha256": "0" * 63}, r"a\.bin: sha256 must be 64 lowercase hex")):
        with pytest.raises(ValueError, match=why):
            ck.parse_manifest(manifest(**entry))
    # What is written now records CRC32 alone; a manifest written before, SHA-256 alone.
    assert b'"sha256"' not in manifest(crc32="0badc0de")
    assert ck.parse_manifest(manifest(sha256="0" * 64)).files[0].crc32 == ""


def as_sha256(directory: Path, manifest: CheckpointManifest) -> CheckpointManifest:
    """``manifest`` as a trainer wrote it before CRC32: each file's SHA-256 alone."""
    files = [FileEntry(name=f.name, size=f.size,
                       sha256=hashlib.sha256((directory / f.name).read_bytes()).hexdigest())
             for f in manifest.files]
    return msgspec.structs.replace(manifest, files=files)


def flip(path: Path) -> bytes:
    """Flip one bit in the middle of ``path`` (same size); returns what it held."""
    data = path.read_bytes()
    rotted = bytearray(data)
    rotted[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(rotted))
    return data


@pytest.mark.parametrize("algorithm", ["crc32", "sha256"])
def test_only_bytes_that_match_the_manifest_are_committed_restored_or_resumed(
        s3: Any, bucket: str, tmp_path: Path, algorithm: str) -> None:
    """A file that rotted on the node's disk after its manifest was written, a multipart
    one (its CRC32 combined from the parts', or its SHA-256 hashed beside them) or a
    single put, is never committed; the same checkpoint whole is. A byte flipped in S3
    is caught on restore, one flipped on disk by the local check: under a CRC32
    manifest as under a SHA-256 one written before."""
    run = f"sum-{algorithm}"
    sizes = {"optimizer.bin": 12 * MiB + 5, "rng.bin": 1000}

    def written(step: int) -> tuple[Path, CheckpointManifest]:
        directory, manifest = write_checkpoint(tmp_path / "local", run, step, sizes)
        if algorithm == "sha256":
            manifest = as_sha256(directory, manifest)
        assert {checksum.algorithm(f) for f in manifest.files} == {algorithm}
        return directory, manifest

    mirror = Mirror(s3, MirrorConfig(bucket=bucket, multipart_threshold=5 * MiB,
                                     part_size=5 * MiB))
    try:
        for step, name in ((1, "optimizer.bin"), (2, "rng.bin")):
            directory, manifest = written(step)
            flip(directory / name)
            with pytest.raises(LocalCheckpointError,
                               match=f"{name}: local file differs from the manifest: "
                                     f"{algorithm} "):
                mirror.mirror(directory, manifest)
        assert ck.committed_steps(s3, bucket, run) == []
        directory, manifest = written(4)
        assert mirror.mirror(directory, manifest).committed
    finally:
        mirror.close()
    assert ck.read_manifest(s3, bucket, run, 4) == manifest
    restored = ck.restore(s3, bucket, run, tmp_path / "restored")
    assert restored.step == 4
    for name in sizes:
        assert (restored.path / name).read_bytes() == (directory / name).read_bytes()

    key = ck.object_key(run, 4, "optimizer.bin")
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 3] ^= 0x80
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    with pytest.raises(CheckpointNotFound, match=rf"step 4: optimizer\.bin: {algorithm} "):
        ck.restore(s3, bucket, run, tmp_path / "again", step=4, fallback=False)

    (directory / ck.MANIFEST).write_bytes(ck.encode_manifest(manifest))
    assert ck.verify(directory) == manifest
    flip(directory / "rng.bin")
    with pytest.raises(ck.CorruptCheckpoint, match=f"rng.bin {algorithm} "):
        ck.verify(directory)
