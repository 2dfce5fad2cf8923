"""How big a run's model is, from its config alone (no torch here, so the gateway can
refuse a run too big to train before it is recorded).

``check`` refuses at submission (``runs.submit_run``, every door's one path) a model of
more than ``MAX_MODEL_PARAMS`` parameters; a coordinator refuses when it claims a run
whose rank would hold more training state than its nodes take (``rank_state_over``, the
trainer's ``TANDEM_MAX_RANK_STATE_GB``).

``parameters`` counts the parameters of the model ``tandem.common.diffusion`` builds for
a ``ModelSpec``, as diffusers lays it out: exact for every block type the spec allows
(``tests/test_model_size.py`` compares it with ``sum(p.numel())`` of the built model
over a range of configs, so a diffusers upgrade that changes a layout fails there, not
silently here). ``rank_state_bytes`` is the training state one rank holds for them.
Activations are not estimated: they depend on the attention's kernel and the batch in
ways no short formula states honestly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.common.errors import InvalidRunConfig

if TYPE_CHECKING:
    from tandem.common.runs import ModelSpec, RunConfig

# RunConfig's bounds on each field still let through models no node trains (a UNet of 8
# blocks of 1280 channels, 8 layers each: 7.4e9 parameters; a DiT of 64 layers with
# 100,000 classes: 1.8e10). Past this one, a run is refused at submission. DiT-XL/2 (the
# DiT paper's largest: 7.5e8 as diffusers builds it) and a UNet of Stable Diffusion's
# widths (320 to 1280 channels, 2 layers a block: 6.7e8) fit; how much a rank may hold
# is each cluster's trainer's to say, from its nodes' memory.
MAX_MODEL_PARAMS = 1_000_000_000
# What a rank keeps for each parameter, in bytes: the fp32 weight, its gradient,
# AdamW's two moments and the EMA (``TrainLoop``). A floor: DDP's gradient buckets and
# the activations come on top. Mixed precision changes none of it (the master weights
# stay fp32).
BYTES_PER_PARAM = 4 + 4 + 8 + 4
UNET_HEAD_DIM = 8  # UNet2DModel's attention_head_dim (its default: build_unet keeps it)
DIT_TIME_FREQS = 256  # the sinusoid a DiT's timestep embedder projects (diffusers' Timesteps)


def _linear(n_in: int, n_out: int) -> int:  # a 1x1 convolution counts the same
    return n_in * n_out + n_out


def _conv3(c_in: int, c_out: int) -> int:
    return 9 * c_in * c_out + c_out


def _norm(c: int) -> int:  # GroupNorm: a scale and a shift per channel
    return 2 * c


def _resnet(c_in: int, c_out: int, temb: int) -> int:
    """ResnetBlock2D, the 1x1 shortcut only where the channels change (as an up block's
    skip concatenation does)."""
    return (_norm(c_in) + _conv3(c_in, c_out) + _linear(temb, c_out) + _norm(c_out)
            + _conv3(c_out, c_out) + (_linear(c_in, c_out) if c_in != c_out else 0))


def _attention(c: int) -> int:
    """A UNet's self-attention: ``c // 8`` heads of 8 (none below 8 channels: its q, k
    and v are then empty, its output projection a bias)."""
    inner = c // UNET_HEAD_DIM * UNET_HEAD_DIM
    return _norm(c) + 3 * _linear(c, inner) + _linear(inner, c)


def unet_parameters(m: ModelSpec) -> int:
    """UNet2DModel's parameters: ``layers_per_block`` resnets (and attentions) per down
    block, one more per up block (its skip), a mid block of two resnets and an attention."""
    chans, layers, last = m.block_out_channels, m.layers_per_block, len(m.block_out_channels) - 1
    temb = 4 * chans[0]
    n = (_conv3(m.in_channels, chans[0]) + _linear(chans[0], temb) + _linear(temb, temb)
         + m.num_classes * temb + _norm(chans[0]) + _conv3(chans[0], m.in_channels))
    out = chans[0]
    for i, kind in enumerate(m.down_block_types):
        c_in, out = out, chans[i]
        for j in range(layers):
            n += _resnet(c_in if j == 0 else out, out, temb)
            n += _attention(out) if kind == "AttnDownBlock2D" else 0
        if i < last:  # every block but the deepest halves the image
            n += (_resnet(out, out, temb) if kind == "ResnetDownsampleBlock2D"
                  else _conv3(out, out))
    n += 2 * _resnet(chans[-1], chans[-1], temb) + _attention(chans[-1])
    up = chans[::-1]
    prev = up[0]
    for i, kind in enumerate(m.up_block_types):
        out, skip = up[i], up[min(i + 1, last)]
        for j in range(layers + 1):
            n += _resnet((prev if j == 0 else out) + (skip if j == layers else out), out, temb)
            n += _attention(out) if kind == "AttnUpBlock2D" else 0
        if i < last:
            n += (_resnet(out, out, temb) if kind == "ResnetUpsampleBlock2D"
                  else _conv3(out, out))
        prev = out
    return n


def dit_parameters(m: ModelSpec) -> int:
    """DiTTransformer2DModel's parameters. Each block has its own adaLN-Zero conditioning,
    a timestep MLP and a class table (one row more: the null class), which is why
    ``num_classes`` weighs ``num_layers`` times."""
    d = m.num_attention_heads * m.attention_head_dim
    patch = m.patch_size ** 2 * m.in_channels
    block = (_linear(DIT_TIME_FREQS, d) + _linear(d, d) + (m.num_classes + 1) * d
             + _linear(d, 6 * d)  # adaLN-Zero: shift, scale and gate of both sublayers
             + 4 * _linear(d, d)  # q, k, v, out
             + _linear(d, 4 * d) + _linear(4 * d, d))  # the MLP
    return _linear(patch, d) + m.num_layers * block + _linear(d, 2 * d) + _linear(d, patch)


def parameters(m: ModelSpec) -> int:
    """The parameters of the model ``m`` builds, exactly."""
    return dit_parameters(m) if m.kind == "dit" else unet_parameters(m)


def rank_state_bytes(cfg: RunConfig) -> int:
    """The training state one rank of ``cfg`` holds (``BYTES_PER_PARAM`` a parameter):
    all of it with ``ddp``; with ``fsdp`` its share, as every rank holds one shard of the
    weights, gradients, moments and EMA."""
    total = parameters(cfg.model) * BYTES_PER_PARAM
    return -(-total // cfg.ranks) if cfg.parallelism == "fsdp" else total


def figure(n: float) -> str:
    """``n`` to three figures as an error message says it: ``1.62e9``, ``2e8``, ``512``."""
    mantissa, _, exponent = f"{n:.3g}".partition("e")
    return f"{mantissa}e{int(exponent)}" if exponent else mantissa


def gigabytes(n: float) -> str:
    return f"{n / 1e9:.3g} GB"


def check(cfg: RunConfig, max_params: int = MAX_MODEL_PARAMS) -> None:
    """Refuse (``InvalidRunConfig``, naming ``model``) a run whose model has more than
    ``max_params`` parameters, saying both figures and the training state it would take
    (each rank would run out of memory or crawl, attempt after attempt).

    Called by ``submit_run``, not by ``RunConfig``'s validation: a coordinator adopting a
    run and its ranks validate the config again, and a run accepted before must not fail
    there."""
    params = parameters(cfg.model)
    if params > max_params:
        raise InvalidRunConfig({"model": (
            f"model has {figure(params)} parameters ({params:,}), more than the limit "
            f"{figure(max_params)} (MAX_MODEL_PARAMS); training it takes "
            f"{gigabytes(params * BYTES_PER_PARAM)} of state ({BYTES_PER_PARAM} bytes a "
            "parameter: fp32 weights, gradients, AdamW's two moments, the EMA)")})


def rank_state_over(cfg: RunConfig, limit_gb: float) -> str | None:
    """Why a rank of ``cfg`` would hold more training state than ``limit_gb`` (a
    trainer's ``TANDEM_MAX_RANK_STATE_GB``); None when it fits."""
    state = rank_state_bytes(cfg)
    if state <= limit_gb * 1e9:
        return None
    shared = (f"fsdp: its share over {cfg.ranks} ranks" if cfg.parallelism == "fsdp"
              else "ddp: every rank holds all of it; fsdp over more ranks shares it out")
    return (f"a rank would hold {gigabytes(state)} of training state "
            f"({figure(parameters(cfg.model))} parameters x {BYTES_PER_PARAM} bytes; "
            f"{shared}), more than this trainer's limit of {limit_gb:g} GB a rank "
            "(TANDEM_MAX_RANK_STATE_GB)")
