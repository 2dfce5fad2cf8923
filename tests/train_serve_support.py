"""Train -> serve test support: checkpoints written as the trainer writes them.

``TinyTrainer`` runs the trainer's own one-rank ``TrainLoop`` on synthetic data and
writes checkpoints with its own ``AsyncCheckpointer`` (model + EMA safetensors,
optimizer/scheduler/RNG/trainer state, ``model_config.json``, manifest), so what the
worker loads is exactly what a training run leaves behind. ``sharded_checkpoint`` does
the same for an FSDP run: two gloo ranks, each saving its own DCP shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tandem.common import checkpoints as ck
from tandem.common.events import CheckpointWritten

TINY_UNET = {"sample_size": 8, "block_out_channels": [16, 32],
             "down_block_types": ["DownBlock2D", "DownBlock2D"],
             "up_block_types": ["UpBlock2D", "UpBlock2D"]}
TINY_DIT = {"kind": "dit", "sample_size": 8, "num_layers": 1, "num_attention_heads": 2,
            "attention_head_dim": 8, "patch_size": 2}


class TinyTrainer:
    """A one-rank training run of a tiny class-conditional UNet, checkpointing on demand."""

    def __init__(self, root: Path, run_id: str, seed: int = 0,
                 model: dict[str, Any] | None = None) -> None:
        from tandem.common.runs import parse_run_config
        from tandem.trainer.async_ckpt import AsyncCheckpointer
        from tandem.trainer.loop import TrainLoop

        self.run_id = run_id
        self.cfg = parse_run_config({
            "run_id": run_id, "model": model or TINY_UNET, "ranks": 1, "batch_size": 4,
            "steps": 1000, "device": "cpu", "seed": seed, "lr": 1e-2,
            "data": {"kind": "synthetic", "synthetic_size": 64}})
        self.loop = TrainLoop(self.cfg)
        self.writer = AsyncCheckpointer(root, run_id)

    def checkpoint(self, steps: int = 1, poison: bool = False) -> CheckpointWritten:
        """Train ``steps`` steps, write a checkpoint (with NaN weights if ``poison``) and
        return the event the trainer publishes for it."""
        import torch

        for _ in range(steps):
            self.loop.train_step()
        saved = {}
        if poison:  # NaN weights that pass every checksum: only loading them can tell
            with torch.no_grad():
                for name, p in self.loop.model.named_parameters():
                    saved[name] = p.detach().clone()
                    p.fill_(float("nan"))
                    self.loop.ema[name] = p.detach().clone()
        self.loop.checkpoint(self.writer)  # returns once the state is copied
        if poison:
            with torch.no_grad():
                for name, p in self.loop.model.named_parameters():
                    p.copy_(saved[name])
                    self.loop.ema[name] = saved[name]
        assert self.writer.wait(60), "checkpoint write did not finish"
        w = self.writer.written[-1]
        return CheckpointWritten(run_id=w.run_id, step=w.step, path=str(w.path),
                                 manifest=w.manifest, cluster="local", node="node-0")

    def close(self) -> None:
        self.writer.close()


def sharded_checkpoint(root: Path, run_id: str, out: Path) -> CheckpointWritten:
    """Train ``tests.fsdp_support.TINY_DIT`` (4 classes) 2 steps with FSDP2 on 2 spawned
    gloo ranks (the trainer's ``TrainLoop`` and ``ShardedCheckpointer``) and return the
    event for its committed ``step-2`` under ``root``."""
    from tests.fsdp_support import Job, spawn

    spawn(2, [Job(run_id, str(root), steps=2, checkpoint_every=2)], out)
    path = ck.step_dir(root, run_id, 2)
    return CheckpointWritten(run_id=run_id, step=2, path=str(path), manifest=ck.verify(path),
                             cluster="local", node="node-0")


def mirror(s3: Any, bucket: str, ev: CheckpointWritten) -> None:
    """Commit a written checkpoint to S3 with the checkpointer's own mirror code."""
    from tandem.checkpointer.mirror import Mirror, MirrorConfig

    m = Mirror(s3, MirrorConfig(bucket=bucket))
    try:
        m.mirror(Path(ev.path), ev.manifest)
    finally:
        m.close()


def rot(s3: Any, bucket: str, run_id: str, step: int, name: str = ck.MODEL_WEIGHTS) -> None:
    """Flip one byte of a committed checkpoint's file in S3 (bit rot after the commit)."""
    key = ck.object_key(run_id, step, name)
    data = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x01
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))
