"""FSDP runs for the tests: a gloo world of spawned ranks on loopback runs ``Job``s one
after another with the trainer's own ``TrainLoop`` and ``ShardedCheckpointer``, and
rank 0 saves what each job saw (losses and the full, gathered state at the points that
matter) for the test process to compare."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.cli.devstack import free_port

# A tiny DiT on 8x8 synthetic images: a step takes milliseconds, a checkpoint ~1 MB.
TINY_DIT = {"kind": "dit", "sample_size": 8, "num_classes": 4, "num_layers": 2,
            "num_attention_heads": 2, "attention_head_dim": 8, "patch_size": 2}
GLOBAL_BATCH = 16


@dataclass
class Job:
    name: str
    root: str  # checkpoint root of this job
    steps: int = 4
    checkpoint_every: int = 2
    resume: str = ""  # checkpoint folder to resume from
    fsdp: dict[str, Any] = field(default_factory=dict)
    full_at: int = 0  # a step whose write fails as on a full disk (the node's commit)
    # A step whose write fails on rank 0's own files (torch.save), before DCP's shards of
    # every rank are known written.
    save_full_at: int = 0

    def config(self, world: int) -> dict[str, Any]:
        return {"run_id": self.name, "model": TINY_DIT, "parallelism": "fsdp",
                "fsdp": self.fsdp, "device": "cpu", "ranks": world, "steps": self.steps,
                "batch_size": GLOBAL_BATCH // world, "checkpoint_every": self.checkpoint_every,
                "warmup_steps": 1, "lr": 1e-3, "ema_decay": 0.9,
                "data": {"kind": "synthetic", "synthetic_size": 64}}


def full_state(loop: Any) -> dict[str, Any]:
    """The whole model, EMA and optimizer state gathered from the shards (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model, optim = get_state_dict(loop.model, loop.optimizer, options=opts)
    ema = {k: v.full_tensor() for k, v in loop.ema.items()}
    return {"model": model, "ema": ema, "optim": optim.get("state", {})}  # rank 0 has it


def run_jobs(rank: int, world: int, port: int, jobs: list[Job], out: str) -> None:
    """One rank of the world: each job in turn; rank 0 writes ``<out>/<job>.pt``."""
    import torch
    import torch.distributed as dist

    from tandem.common.runs import RunConfig
    from tandem.trainer.loop import TrainLoop
    from tandem.trainer.sharded_ckpt import ShardedCheckpointer

    torch.set_num_threads(1)
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        for job in jobs:
            cfg = RunConfig.model_validate(job.config(world))
            loop = TrainLoop(cfg, rank=rank, world=world, distributed=True)
            seen: dict[str, Any] = {"losses": {}, "blocked": [], "full": {}}
            if job.resume:
                loop.load(Path(job.resume))
                seen["full"]["loaded"] = full_state(loop)
            writer = ShardedCheckpointer(job.root, job.name, rank=rank, local_rank=rank,
                                         world=world, node="n0",
                                         before_commit=full_disk(job.full_at))
            if job.save_full_at:
                writer.save = no_room_for_rank0(writer.save, job.save_full_at)  # type: ignore[method-assign]
            while loop.step < cfg.steps:
                r = loop.train_step()
                assert r.anomaly is None, r.anomaly
                seen["losses"][r.step] = r.loss
                if r.step % cfg.checkpoint_every == 0:
                    seen["blocked"].append(loop.checkpoint(writer))
                    seen["full"][r.step] = full_state(loop)
            writer.close()
            seen["errors"] = [(step, getattr(exc, "errno", None))
                              for step, exc in writer.errors]
            assert job.full_at or job.save_full_at or not writer.errors, writer.errors
            if rank == 0:
                torch.save(seen, Path(out) / f"{job.name}.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()


def full_disk(at: int) -> Any:
    """A ``before_commit`` hook failing step ``at``'s write as a full disk would."""
    import errno

    def hook(step: int) -> None:
        if step == at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return hook if at else None


class _NoRoom:
    """A rank-0 payload that ``torch.save`` fails to write as on a full disk."""

    def __reduce__(self) -> Any:
        import errno

        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def no_room_for_rank0(save: Any, at: int) -> Any:
    """``ShardedCheckpointer.save`` whose rank-0 files of step ``at`` cannot be written."""
    def wrapped(step: int, state: Any, rank0: Any = None, jsons: Any = None) -> float:
        if step == at and rank0:
            rank0 = {**rank0, "no_room": _NoRoom()}
        return save(step, state, rank0, jsons)

    return wrapped


def spawn(world: int, jobs: list[Job], out: Path) -> None:
    """Run ``jobs`` in a ``world`` of ranks, forked from a forkserver that imported torch,
    diffusers and the trainer once: spawned, every rank imported them itself (about 4 s
    of CPU each, 8 ranks per test module)."""
    import multiprocessing

    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    multiprocessing.set_forkserver_preload(["tests.fsdp_support", "tandem.trainer.loop",
                                            "tandem.trainer.sharded_ckpt"])
    mp.start_processes(run_jobs, args=(world, free_port(), jobs, str(out)), nprocs=world,
                       start_method="forkserver")
