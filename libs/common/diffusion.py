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


def build_scheduler(cfg: UNetConfig | DiTConfig) -> DDPMScheduler:
    return DDPMScheduler(num_train_timesteps=cfg.num_train_timesteps)


def architecture(mc: dict[str, Any]) -> UNetConfig | DiTConfig:
    """The config a ``model_config.json`` describes: its ``kind`` picks the family (a
    file without one is a UNet's). ``ValueError`` for a kind there is no model for."""
    kind = mc.get("kind", "unet")
    if kind == "unet":
        return UNetConfig.from_dict(mc)
    if kind == "dit":
        return DiTConfig.from_dict(mc)
    raise ValueError(f"model kind {kind!r} cannot be served")


def build_denoiser(cfg: UNetConfig | DiTConfig, seed: int | None = None) -> torch.nn.Module:
    """A randomly initialised model of either family from ``cfg``."""
    return build_unet(cfg, seed) if isinstance(cfg, UNetConfig) else build_dit(cfg, seed)


def predict_noise(model: Any, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor | None,
                  *, dit: bool) -> torch.Tensor:
    """One noise prediction for a batch, whichever family ``model`` is: a UNet2DModel takes
    one timestep or one per sample; a DiT takes one per sample (``timestep=``)."""
    if dit:
        if t.dim() == 0 or t.numel() != x.shape[0]:
            t = t.reshape(-1)[:1].expand(x.shape[0])
        return model(x, timestep=t, class_labels=labels).sample
    return model(x, t, class_labels=labels).sample


@dataclass(kw_only=True)
class DiTConfig:
    """A small class-conditional DiT (diffusers ``DiTTransformer2DModel``)."""

    sample_size: int = 16
    in_channels: int = 1
    num_classes: int = 10
    num_layers: int = 4
    num_attention_heads: int = 4
    attention_head_dim: int = 16
    patch_size: int = 2
    num_train_timesteps: int = 1000

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DiTConfig:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def build_dit(cfg: DiTConfig, seed: int | None = None) -> torch.nn.Module:
    """A randomly initialised DiTTransformer2DModel from ``cfg``; call it with
    ``model(x, timestep=t, class_labels=y).sample``."""
    from diffusers import DiTTransformer2DModel

    if seed is not None:
        torch.manual_seed(seed)
    return DiTTransformer2DModel(
        num_attention_heads=cfg.num_attention_heads,
        attention_head_dim=cfg.attention_head_dim,
        in_channels=cfg.in_channels,
        out_channels=cfg.in_channels,
        num_layers=cfg.num_layers,
        sample_size=cfg.sample_size,
        patch_size=cfg.patch_size,
        num_embeds_ada_norm=cfg.num_classes,
        norm_num_groups=1,
    )


# ------------------------------------------------------------------ tiny text-to-image pipeline


def _tiny_vocab() -> dict[str, int]:
    """A character-level CLIP BPE vocabulary: every prompt tokenises, nothing is downloaded."""
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)]
    chars += list(".,!?'-")
    for ch in chars:
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    return vocab


def build_tiny_text_pipeline(seed: int = 0, max_tokens: int = 32) -> Any:
    """A tiny randomly initialised StableDiffusionPipeline, built in-process.

    Built as diffusers' own tests build theirs (small UNet2DConditionModel, CLIP text
    model and tokenizer from a generated vocabulary, a VAE and a DDIM scheduler), so the
    text-to-image path runs on a CPU in milliseconds. The same ``seed`` gives the same
    weights in every process, so a redelivered task produces the same images.
    """
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab = _tiny_vocab()
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_tokens)
    torch.manual_seed(seed)
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4,
        out_channels=4, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), cross_attention_dim=32,
        norm_num_groups=4, attention_head_dim=2,
    )
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        block_out_channels=[8, 16], in_channels=3, out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
        latent_channels=4, norm_num_groups=4,
    )
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        bos_token_id=0, eos_token_id=1, pad_token_id=1, hidden_size=32, intermediate_size=64,
        num_attention_heads=4, num_hidden_layers=2, vocab_size=len(vocab),
        max_position_embeddings=max_tokens,
    ))
    scheduler = DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
        set_alpha_to_one=False, steps_offset=1,
    )
    pipe = StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe
