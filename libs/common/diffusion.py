"""Diffusion models built from config (no weights are ever downloaded).

Shared by the trainer (which trains them) and the inference worker (which serves them),
so a checkpoint written by one is loaded by the other with the same architecture.
Needs the torch extras: only services that run models import this module.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from diffusers import DDPMScheduler, UNet2DModel


@dataclass(kw_only=True)
class UNetConfig:
    """A small class-conditional UNet2DModel; the default fits 16x16 digits on a CPU."""

    sample_size: int = 16
    in_channels: int = 1
    out_channels: int = 1
    num_classes: int = 10  # 0: unconditional
    block_out_channels: tuple[int, ...] = (32, 64, 64)
    layers_per_block: int = 1
    down_block_types: tuple[str, ...] = ("DownBlock2D", "AttnDownBlock2D", "DownBlock2D")
    up_block_types: tuple[str, ...] = ("UpBlock2D", "AttnUpBlock2D", "UpBlock2D")
    norm_num_groups: int = 8
    num_train_timesteps: int = 1000
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["block_out_channels"] = list(self.block_out_channels)
        d["down_block_types"] = list(self.down_block_types)
        d["up_block_types"] = list(self.up_block_types)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> UNetConfig:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        for k in ("block_out_channels", "down_block_types", "up_block_types"):
            if k in known:
                known[k] = tuple(known[k])
        return cls(**known)


def build_unet(cfg: UNetConfig, seed: int | None = None) -> UNet2DModel:
    """A randomly initialised UNet2DModel from ``cfg`` (seeded when ``seed`` is given)."""
    if seed is not None:
        torch.manual_seed(seed)
    return UNet2DModel(
        sample_size=cfg.sample_size,
        in_channels=cfg.in_channels,
        out_channels=cfg.out_channels,
        block_out_channels=cfg.block_out_channels,
        layers_per_block=cfg.layers_per_block,
        down_block_types=cfg.down_block_types,
        up_block_types=cfg.up_block_types,
        norm_num_groups=cfg.norm_num_groups,
        num_class_embeds=cfg.num_classes or None,
        **cfg.extra,
    )


def build_scheduler(cfg: UNetConfig) -> DDPMScheduler:
    return DDPMScheduler(num_train_timesteps=cfg.num_train_timesteps)
