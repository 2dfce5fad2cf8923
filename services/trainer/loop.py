"""One rank's training: model, EMA, optimizer, schedule, data position, RNG, one step.

Determinism (what makes a resumed run bitwise identical to an uninterrupted one on CPU):
the model is initialised from the seed; the data order is a function of the data
position (``data.BatchPlan``); noise and timesteps come from a per-rank generator whose
state is checkpointed with every other RNG state; the loss-health window is
checkpointed too, so the same decisions are taken after a resume.

``parallelism`` picks how ranks share the model: ``ddp`` replicates it (rank 0 writes
the whole state); ``fsdp`` shards it with FSDP2 (``sharding``) and every rank writes its
own shards (``sharded_ckpt``), so a resume may change the world size.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel as DDP

from tandem.common import checkpoints as ck
from tandem.common.diffusion import (
    DiTConfig,
    UNetConfig,
    architecture,
    build_denoiser,
    build_scheduler,
    predict_noise,
)
from tandem.common.runs import RunConfig
from tandem.trainer import data as data_mod
from tandem.trainer import sharded_ckpt, sharding
from tandem.trainer.async_ckpt import AsyncCheckpointer, Snapshot, load_objects
from tandem.trainer.health import LossAnomaly, LossHealth

FORMAT = 1


@dataclass
class StepResult:
    step: int  # the step just completed (1-based count of applied updates)
    data_pos: int
    loss: float
    grad_norm: float
    lr: float
    wall_s: float  # this step's wall time on this rank
    rank_times: list[float]  # every rank's local compute time (data + forward + loss)
    anomaly: LossAnomaly | None = None
    stop: bool = False  # some rank was asked to stop (``stop_asked``): every rank sees it


def model_config(cfg: RunConfig) -> dict[str, Any]:
    """The architecture as the inference worker rebuilds it (``model_config.json``)."""
    m = cfg.model
    if m.kind == "dit":
        return {"kind": "dit", **DiTConfig(
            sample_size=m.sample_size, in_channels=m.in_channels, num_classes=m.num_classes,
            num_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
            attention_head_dim=m.attention_head_dim, patch_size=m.patch_size,
            num_train_timesteps=m.num_train_timesteps).to_dict()}
    return {"kind": "unet", **UNetConfig(
        sample_size=m.sample_size, in_channels=m.in_channels, out_channels=m.in_channels,
        num_classes=m.num_classes, block_out_channels=m.block_out_channels,
        layers_per_block=m.layers_per_block, down_block_types=m.down_block_types,
        up_block_types=m.up_block_types, norm_num_groups=m.norm_num_groups,
        num_train_timesteps=m.num_train_timesteps).to_dict()}


def build_model(cfg: RunConfig) -> torch.nn.Module:
    return build_denoiser(architecture(model_config(cfg)), seed=cfg.seed)


def lr_factor(cfg: RunConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    span = max(cfg.steps - cfg.warmup_steps, 1)
    frac = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    if cfg.lr_schedule == "linear":
        return 1.0 - 0.9 * frac
    return 0.1 + 0.45 * (1 + math.cos(math.pi * frac))


def ema_decay_at(decay: float, step: int, warmup: bool) -> float:
    """The EMA decay for the update made after ``step`` updates were already applied (the
    global step, restored on resume, so a resumed run decays exactly as an uninterrupted
    one). With ``warmup`` it is ``min(decay, (1 + step) / (10 + step))``: diffusers'
    ``EMAModel.get_decay`` (``training_utils.py``) without its ``use_ema_warmup`` power
    schedule, save that diffusers' first update copies the weights (decay 0) where this
    one keeps a tenth of the initial ones. 0.1 at the first update, 0.9 after 80, 0.999
    after 8,990: the EMA follows the weights while they move fast rather than keeping
    ``decay**steps`` of the random initial ones (0.999**300 = 74%). Without ``warmup``,
    ``decay`` from the first update."""
    if not warmup:
        return decay
    return min(decay, (1 + step) / (10 + step))


class TrainLoop:
    def __init__(self, cfg: RunConfig, *, rank: int = 0, world: int = 1,
                 device: torch.device | None = None, distributed: bool = False,
                 skipped: list[list[int]] | None = None, data_root: str = "") -> None:
        self.cfg = cfg
        self.rank = rank
        self.world = world
        self.device = device or torch.device("cpu")
        self.distributed = distributed
        self.skipped = [list(w) for w in (skipped or [])]
        m = cfg.model
        x, y = data_mod.load(cfg.data, m.sample_size, m.in_channels, m.num_classes, cfg.seed,
                             data_root)
        if m.num_classes and len(y) and int(y.max()) >= m.num_classes:
            # A DiT's class table has one row more, its null class: it would train on it.
            raise ValueError(f"the data set has labels up to {int(y.max())}, past "
                             f"model.num_classes ({m.num_classes})")
        self.x, self.y = x.to(self.device), y.to(self.device)
        self.plan = data_mod.BatchPlan(len(x), cfg.batch_size, world, rank, cfg.seed)
        self.model = build_model(cfg).to(self.device)
        self.is_dit = cfg.model.kind == "dit"
        self.sharded = cfg.parallelism == "fsdp"
        self.noise_scheduler = build_scheduler(UNetConfig(
            num_train_timesteps=m.num_train_timesteps))
        self.alphas = self.noise_scheduler.alphas_cumprod.to(self.device)
        if self.sharded:
            if not dist.is_initialized():
                raise RuntimeError("parallelism fsdp needs the process group initialised")
            self.ddp: torch.nn.Module = sharding.shard(self.model, cfg, self.device, world)
        else:
            self.ddp = (DDP(self.model, device_ids=[self.device.index]
                            if self.device.type == "cuda" else None)
                        if distributed else self.model)
        self.ema = {k: p.detach().clone() for k, p in self.model.named_parameters()}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr,
                                           weight_decay=cfg.weight_decay)
        self.lr_sched = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(cfg, s))
        self.gen = torch.Generator().manual_seed(cfg.seed * 100_003 + rank + 1)
        random.seed(cfg.seed * 100_003 + rank)
        self.health = LossHealth(cfg.loss_health.window, cfg.loss_health.min_history,
                                 cfg.loss_health.z_threshold, cfg.loss_health.enabled)
        self.step = 0
        self.data_pos = 0
        # The EMA schedule this run's EMA has followed: the config's for a fresh start,
        # the checkpoint's on a resume (``load``).
        self.ema_warmup = cfg.ema_warmup
        self.scaler = (torch.amp.GradScaler("cuda") if cfg.mixed_precision == "fp16"
                       and self.device.type == "cuda" else None)
        slow = cfg.faults.slow_rank == rank
        self._slow_s = cfg.faults.slow_s if slow else 0.0
        self._slow_factor = cfg.faults.slow_factor if slow else 1.0
        # Set (from a signal handler: ``rank.StopRequest``) when this rank is asked to stop;
        # each step tells every rank, in ``StepResult.stop``.
        self.stop_asked = False

    # ------------------------------------------------------------------------ the step

    def _autocast(self) -> Any:
        mp = self.cfg.mixed_precision
        if mp == "no":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if mp == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def _forward(self, xt: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        labels = y if self.cfg.model.num_classes else None
        return predict_noise(self.ddp, xt, t, labels, dit=self.is_dit)

    def train_step(self) -> StepResult:
        """One optimizer step over this rank's share of the next global batch.

        On a loss anomaly (judged identically on every rank from all-reduced values) the
        update is not applied and ``anomaly`` is set. ``stop`` is set on every rank when
        any rank's ``stop_asked`` was set as it reached the step's all_gather.
        """
        t0 = time.perf_counter()
        pos = data_mod.next_position(self.data_pos, self.skipped)
        idx = self.plan.indices(pos).to(self.device)
        x0, y = self.x[idx], self.y[idx]
        noise = torch.randn(x0.shape, generator=self.gen).to(self.device)
        t = torch.randint(0, len(self.alphas), (x0.shape[0],), generator=self.gen).to(
            self.device)
        a = self.alphas[t].view(-1, 1, 1, 1)
        xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
        if self._slow_s:
            time.sleep(self._slow_s)  # fault hook: a throttled node computes slower
        with self._autocast():
            pred = self._forward(xt, t, y)
        loss = F.mse_loss(pred.float(), noise)
        if self._slow_factor > 1:
            # fault hook: the step's compute stretched by the factor, so the slow rank
            # stays slow in proportion however loaded the machine is
            time.sleep((self._slow_factor - 1) * (time.perf_counter() - t0))
        if pos in self.cfg.faults.nan_at_data_pos:
            loss = loss * float("nan")  # fault hook: a poisoned batch
        local = time.perf_counter() - t0
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
        else:
            loss.backward()
        grad_norm = sharding.full_value(torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.cfg.grad_clip))
        # NOTE: the stop flag rides on the all_gather every step already makes: all ranks
        # learn at the same step that one was asked to stop, for no collective of its own.
        stats = torch.tensor([loss.detach().float().item(), local, float(self.stop_asked)],
                             dtype=torch.float64)
        if self.distributed:
            gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(self.world)]
            dist.all_gather(gathered, stats.to(self.device) if self.device.type == "cuda"
                            else stats)
            rows = [g.cpu() for g in gathered]
        else:
            rows = [stats]
        mean_loss = float(sum(r[0] for r in rows) / len(rows))
        rank_times = [float(r[1]) for r in rows]
        stop = any(float(r[2]) > 0 for r in rows)
        lr = self.optimizer.param_groups[0]["lr"]
        if self.scaler is not None and not math.isfinite(grad_norm):
            grad_norm = 0.0  # fp16 overflow: the scaler skips this step, not an anomaly
        anomaly = self.health.check(mean_loss, grad_norm)
        if anomaly is not None:
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(self.step, pos, mean_loss, grad_norm, lr,
                              time.perf_counter() - t0, rank_times, anomaly, stop)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.lr_sched.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._update_ema()
        self.step += 1
        self.data_pos = pos + 1
        return StepResult(self.step, pos, mean_loss, grad_norm, lr,
                          time.perf_counter() - t0, rank_times, stop=stop)

    @torch.no_grad()
    def _update_ema(self) -> None:
        d = ema_decay_at(self.cfg.ema_decay, self.step, self.ema_warmup)
        params = dict(self.model.named_parameters())
        keys = list(self.ema)
        torch._foreach_lerp_([self.ema[k] for k in keys], [params[k].detach() for k in keys],
                             1.0 - d)

    # ----------------------------------------------------------------------- checkpoints

    def rng_state(self) -> dict[str, Any]:
        """This rank's RNG states (generator, torch, python, numpy, cuda): what a
        checkpoint keeps per rank so a resumed run draws the same numbers."""
        import numpy as np

        np_state = np.random.get_state()
        state: dict[str, Any] = {
            "gen": self.gen.get_state(),
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": [str(np_state[0]), torch.from_numpy(np_state[1].astype("int64")),
                      int(np_state[2]), int(np_state[3]), float(np_state[4])],
        }
        if torch.cuda.is_available() and self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def _set_rng_state(self, state: dict[str, Any]) -> None:
        import numpy as np

        self.gen.set_state(state["gen"])
        torch.set_rng_state(state["torch"])
        v, keys, pos, has_gauss, gauss = state["numpy"]
        random.setstate(_tuples(state["python"]))
        np.random.set_state((v, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["cuda"], self.device)

    def trainer_state(self) -> dict[str, Any]:
        return {"format": FORMAT, "step": self.step, "data_pos": self.data_pos,
                "world_size": self.world, "skipped": self.skipped,
                "loss_window": self.health.state_dict(), "seed": self.cfg.seed,
                "ema_warmup": self.ema_warmup}

    def checkpoint(self, writer: AsyncCheckpointer | sharded_ckpt.ShardedCheckpointer | None
                   ) -> Snapshot | float | None:
        """Gather every rank's RNG state, then (rank 0) snapshot and queue the write; or,
        sharded, every rank queues its own shards. Returns the snapshot (rank 0 of a DDP
        run), the seconds blocked (sharded) or None.

        Collective: every rank must call it at the same step.
        """
        rng = self.rng_state()
        if self.distributed:
            all_rng: list[Any] = [None] * self.world
            dist.all_gather_object(all_rng, rng)
        else:
            all_rng = [rng]
        if isinstance(writer, sharded_ckpt.ShardedCheckpointer):
            rank0 = ({"scheduler": copy.deepcopy(self.lr_sched.state_dict()),
                      "rng": {"ranks": all_rng}, "trainer": self.trainer_state()}
                     if self.rank == 0 else None)
            return writer.save(
                self.step, sharded_ckpt.state_of(self.model, self.optimizer, self.ema),
                rank0, {"model_config.json": model_config(self.cfg)} if self.rank == 0
                else None)
        if self.rank != 0 or writer is None:
            return None
        sync = torch.cuda.synchronize if self.device.type == "cuda" else None
        return writer.snapshot(
            self.step,
            tensors={"model": dict(self.model.state_dict()), "ema": self.ema},
            objects={"optimizer": self.optimizer.state_dict(),
                     "scheduler": self.lr_sched.state_dict(),
                     "rng": {"ranks": all_rng},
                     "trainer": self.trainer_state()},
            jsons={"model_config.json": model_config(self.cfg)},
            sync=sync,
        )

    def load(self, path: Path) -> None:
        """Resume from the checkpoint directory ``path`` (verified by the caller).

        A sharded checkpoint loads on any world size (DCP reshards); it is collective.
        """
        # The caller verified every checksum; here the manifest says what the files are.
        manifest = (ck.parse_manifest((path / ck.MANIFEST).read_bytes()) if self.sharded
                    else None)
        if (manifest is not None) != (path / ck.DCP_METADATA).is_file() or (
                manifest is not None and manifest.kind != ck.SHARDED):
            raise ValueError(f"{path} is {'not ' if self.sharded else ''}a sharded "
                             f"checkpoint, and this run's parallelism is {self.cfg.parallelism}")
        if manifest is not None:
            objs = sharded_ckpt.load(path, self.model, self.optimizer, self.ema, manifest)
            self.lr_sched.load_state_dict(objs["scheduler"])
        else:
            dev = str(self.device)
            self.model.load_state_dict(load_file(str(path / "model.safetensors"), device=dev))
            ema = load_file(str(path / "ema.safetensors"), device=dev)
            self.ema = {k: ema[k] for k in self.ema}
            self.optimizer.load_state_dict(load_objects(path, "optimizer"))
            self.lr_sched.load_state_dict(load_objects(path, "scheduler"))
        ts = load_objects(path, "trainer")
        self.step, self.data_pos = int(ts["step"]), int(ts["data_pos"])
        # NOTE: a checkpoint written before the warm-up existed has no "ema_warmup": its
        # run goes on with the constant decay it started with, so a resume by a newer
        # trainer is the run an uninterrupted older one would have made.
        self.ema_warmup = bool(ts.get("ema_warmup", False))
        self.health.load_state_dict(ts["loss_window"])
        for w in ts.get("skipped", []):
            if list(w) not in self.skipped:
                self.skipped.append(list(w))
        ranks = load_objects(path, "rng")["ranks"]
        if ts["world_size"] == self.world:
            self._set_rng_state(ranks[self.rank])
        # A different world size re-shards the data: positions carry over, exactness not.


def _tuples(obj: Any) -> Any:
    """random.setstate wants tuples; a round trip through torch.save keeps them, but be safe."""
    if isinstance(obj, list):
        return tuple(_tuples(v) for v in obj)
    if isinstance(obj, tuple):
        return tuple(_tuples(v) for v in obj)
    return obj
