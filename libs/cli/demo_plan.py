"""What ``tandem demo`` trains and generates (``DemoPlan``), and its command-line options.

Apart from ``demo.py`` (the five steps it runs) so that module reads as its steps; the
plan is data: a run config and a model registry made from a few numbers.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.cli.dev import add_stack_arguments

TERMINAL = {"succeeded", "failed", "cancelled"}
MODEL = "digits"


@dataclass(kw_only=True)
class DemoPlan:
    """What the demo trains and generates; the defaults fit 2 CPU cores in minutes."""

    steps: int = 600
    batch_size: int = 64
    lr: float = 1e-3
    ema_decay: float = 0.99
    warmup_steps: int = 20
    checkpoint_every: int = 100
    sample_steps: int = 50  # DDPM denoising steps per image
    images_per_digit: int = 8
    backlog: int = 24  # extra single-image tasks queued on east before it is killed
    incident: bool = True  # SIGKILL a training rank midway
    failover: bool = True  # SIGKILL cluster east while it works through its backlog
    failover_timeout: float = 90.0

    def run_config(self, run_id: str) -> dict[str, Any]:
        return {"run_id": run_id, "steps": self.steps, "batch_size": self.batch_size,
                "lr": self.lr, "ema_decay": self.ema_decay, "warmup_steps": self.warmup_steps,
                "checkpoint_every": self.checkpoint_every, "ranks": 1, "device": "cpu",
                "lr_schedule": "cosine", "step_event_every": 1,
                "watchdog": {"backoff_s": 0.5}}

    def registry(self, run_id: str) -> list[dict[str, Any]]:
        return [
            {"name": MODEL, "source": f"run:{run_id}", "conditioning": "class_label",
             "num_classes": 10, "default_width": 16, "default_height": 16, "sizes": [16],
             "default_steps": self.sample_steps, "max_steps": 1000,
             "description": f"the digits model trained by this demo (run {run_id}), "
             "newest committed checkpoint"},
            {"name": "noop", "source": "noop", "default_steps": 1, "max_steps": 1,
             "description": "No pipeline: measures dispatch overhead."},
        ]


def add_arguments(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``demo`` parser with every option; the caller sets what it runs."""
    p = sub.add_parser(
        "demo", help="the main job end to end on a local stack, with a report",
        description="Start the local stack with two simulated clusters, train the digits "
        "model (recovering from a killed rank), mirror its checkpoints, serve the newest "
        "from workers in both clusters, generate a grid of every digit over HTTP while "
        "cluster east is killed and its backlog finishes on west, stop everything, and "
        "write a report (HTML with PNGs). Takes a few minutes on 2 CPU cores.")
    add_stack_arguments(p)
    p.add_argument("--out", type=Path, default=Path("out/demo"),
                   help="output folder: report, demo.json, images, stack logs "
                   "(default out/demo)")
    p.add_argument("--timeout", type=float, default=1200.0,
                   help="seconds any one phase may wait before the demo gives up on it "
                   "(default 1200)")
    plan = DemoPlan()
    p.add_argument("--steps", type=int, default=plan.steps,
                   help=f"training steps (default {plan.steps})")
    p.add_argument("--checkpoint-every", type=int, default=plan.checkpoint_every,
                   help=f"steps between checkpoints (default {plan.checkpoint_every})")
    p.add_argument("--batch-size", type=int, default=plan.batch_size,
                   help=f"training batch size (default {plan.batch_size})")
    p.add_argument("--sample-steps", type=int, default=plan.sample_steps,
                   help=f"denoising steps per image (default {plan.sample_steps})")
    p.add_argument("--images-per-digit", type=int, default=plan.images_per_digit,
                   help=f"grid columns (default {plan.images_per_digit})")
    p.add_argument("--backlog", type=int, default=plan.backlog,
                   help=f"extra tasks queued on east before it is killed (default "
                   f"{plan.backlog})")
    p.add_argument("--failover-timeout", type=float, default=plan.failover_timeout,
                   help="seconds to wait for east's backlog to finish on west before "
                   f"restarting east (default {plan.failover_timeout:g})")
    p.add_argument("--no-incident", action="store_true",
                   help="do not kill a training rank midway")
    p.add_argument("--no-failover", action="store_true", help="do not kill cluster east")
    return p


def plan_from_args(args: argparse.Namespace) -> DemoPlan:
    return DemoPlan(steps=args.steps, checkpoint_every=args.checkpoint_every,
                    batch_size=args.batch_size, sample_steps=args.sample_steps,
                    images_per_digit=args.images_per_digit, backlog=args.backlog,
                    failover_timeout=args.failover_timeout, incident=not args.no_incident,
                    failover=not args.no_failover)
