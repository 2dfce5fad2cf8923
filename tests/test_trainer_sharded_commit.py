"""Two nodes that share one checkpoint folder (the local launcher: every node's torchrun
on one host, one checkpoint root) commit each sharded checkpoint once, on rank 0's node;
and ``ck.commit`` never removes a checkpoint another writer committed."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from tandem.cli.devstack import free_port
from tandem.common import checkpoints as ck

WORLD = 4  # 2 nodes x 2 ranks
STEPS = (2, 4)


def _rank(rank: int, world: int, port: int, root: str, out: str) -> None:
    """One rank of 2 simulated nodes sharing ``root``; writes what it saw to ``out``."""
    import torch
    import torch.distributed as dist

    from tandem.trainer.sharded_ckpt import ShardedCheckpointer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        written: list[int] = []
        writer = ShardedCheckpointer(root, "r", rank=rank, local_rank=rank % 2, world=world,
                                     node=f"n{rank // 2}",
                                     on_written=lambda w: written.append(w.step))
        for step in STEPS:
            state = {f"t{rank}": torch.full((4096,), float(rank + step))}
            writer.save(step, state,
                        rank0={"scheduler": {}, "rng": {}, "trainer": {"step": step}}
                        if rank == 0 else None,
                        jsons={"model_config.json": {}} if rank == 0 else None)
        writer.close()
        dist.barrier()
        Path(out, f"{rank}.json").write_text(json.dumps({
            "written": written, "errors": [f"{s}: {e!r}" for s, e in writer.errors]}))
    finally:
        dist.destroy_process_group()


def test_nodes_sharing_rank0s_folder_leave_its_commit_to_rank0s_node(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import torch.multiprocessing as mp

    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    mp.spawn(_rank, args=(WORLD, free_port(), str(root), str(out)), nprocs=WORLD)
    seen = {r: json.loads((out / f"{r}.json").read_text()) for r in range(WORLD)}

    assert {r: s["errors"] for r, s in seen.items()} == {r: [] for r in range(WORLD)}
    # rank 0 announces each checkpoint; node n1's first rank (rank 2) commits nothing
    assert {r: s["written"] for r, s in seen.items()} == {0: list(STEPS), 1: [], 2: [], 3: []}
    for step in STEPS:
        manifest = ck.verify(ck.step_dir(root, "r", step))
        assert manifest.part == "" and manifest.world_size == WORLD
        assert ck.missing(manifest) == []
    assert sorted(p.name for p in (root / "r").iterdir()) == ["step-2", "step-4"]


def _shared_folder(root: Path) -> Path:
    tmp = ck.prepare_incomplete(root, "r", 40)
    (tmp / ck.SHARD_DIR).mkdir()
    for r in range(WORLD):
        (tmp / f"{ck.SHARD_DIR}/__{r}_0.distcp").write_bytes(os.urandom(200_000))
    (tmp / ck.DCP_METADATA).write_bytes(b"m")
    for name in ck.SHARDED_STATE:
        (tmp / name).write_bytes(b"x")
    return tmp


def test_a_second_commit_of_the_same_folder_removes_nothing(tmp_path: Path) -> None:
    tmp = _shared_folder(tmp_path)
    final, _ = ck.commit("r", 40, tmp, world_size=WORLD, node="n0")
    with pytest.raises(FileNotFoundError):  # committed already: ``tmp`` is gone
        ck.commit("r", 40, tmp, world_size=WORLD, node="n1")
    assert ck.verify(final).part == ""


def test_two_commits_of_the_same_folder_at_once_leave_one_whole_checkpoint(
        tmp_path: Path) -> None:
    """The red team's race (two nodes' first ranks commit one shared folder together):
    whichever way the two interleave, one commits and ``step-40`` verifies."""
    for i in range(50):
        root = tmp_path / str(i)
        tmp = _shared_folder(root)
        errors: list[BaseException] = []
        start = threading.Barrier(2)

        def node(name: str, tmp: Path = tmp, errors: list[BaseException] = errors,
                 start: threading.Barrier = start) -> None:
            start.wait()
            try:
                ck.commit("r", 40, tmp, world_size=WORLD, node=name)
            except (FileExistsError, FileNotFoundError) as exc:
                errors.append(exc)

        threads = [threading.Thread(target=node, args=(n,)) for n in ("n0", "n1")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(errors) == 1, errors
        assert ck.verify(ck.step_dir(root, "r", 40)).part == ""
