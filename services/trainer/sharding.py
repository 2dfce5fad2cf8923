"""FSDP2: a model sharded with ``fully_shard``, per block and then at the root.

The same code runs on gloo/CPU and NCCL/CUDA: the device mesh takes the rank's device
type, and nothing else differs. Units, innermost first:

- a DiT's per-block conditioning embedding (``transformer_blocks[i].norm1.emb``): the
  DiT calls block 0's embedding again after the last block, outside that block's
  forward, so it must gather its own parameters rather than ride on its block's;
- each transformer block (DiT) or each down, mid and up block (UNet);
- the root, which holds what is left (patch embedding, output projection).

``reshard_after_forward`` and bf16 mixed precision come from ``RunConfig.fsdp``.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from tandem.common.runs import RunConfig


class MixedPrecisionUnsupported(RuntimeError):
    """bf16 was asked for on a device that cannot compute in it."""

    def __init__(self, device: torch.device, reason: str) -> None:
        self.device = device
        super().__init__(f"fsdp.mixed_precision bf16 cannot run on {device}: {reason}")


def mixed_precision(cfg: RunConfig, device: torch.device) -> MixedPrecisionPolicy:
    """The policy for ``cfg.fsdp.mixed_precision``; ``MixedPrecisionUnsupported`` when the
    device has no bf16 (a CPU rank, or a CUDA device older than Ampere)."""
    if cfg.fsdp.mixed_precision == "none":
        return MixedPrecisionPolicy()
    if device.type != "cuda":
        raise MixedPrecisionUnsupported(device, "bf16 sharded training needs CUDA")
    if not torch.cuda.is_bf16_supported():
        raise MixedPrecisionUnsupported(device, "this CUDA device does not support bf16")
    # NOTE: gradients are reduced in fp32 so that the sum over ranks loses nothing.
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def units(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The submodules sharded as their own units, innermost first (the root not included)."""
    blocks = getattr(model, "transformer_blocks", None)
    if blocks is not None:
        for block in blocks:
            emb = getattr(getattr(block, "norm1", None), "emb", None)
            if isinstance(emb, torch.nn.Module):
                yield emb
            yield block
        return
    for name in ("down_blocks", "mid_block", "up_blocks"):
        part = getattr(model, name, None)
        if isinstance(part, torch.nn.ModuleList):
            yield from part
        elif isinstance(part, torch.nn.Module):
            yield part


def shard(model: torch.nn.Module, cfg: RunConfig, device: torch.device,
          world: int) -> torch.nn.Module:
    """``model`` sharded in place over ``world`` ranks on ``device``'s type; returns it."""
    mesh = init_device_mesh(device.type, (world,))
    options = {"mesh": mesh, "mp_policy": mixed_precision(cfg, device),
               "reshard_after_forward": cfg.fsdp.reshard_after_forward}
    for unit in list(units(model)):
        fully_shard(unit, **options)
    fully_shard(model, **options)
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_value(t: torch.Tensor) -> float:
    """A scalar that may be a replicated DTensor (``clip_grad_norm_`` of sharded
    parameters returns one) as a float."""
    return float(t.full_tensor() if isinstance(t, DTensor) else t)
