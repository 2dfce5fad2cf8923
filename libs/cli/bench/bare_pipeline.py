"""The bare side of ``tandem bench serve``'s pipeline part: the diffusers pipeline in a loop.

Bench code, run as a child process (``python -m tandem.cli.bench.bare_pipeline``), one
process per model, so nothing else in it competes with the loop: what a user with the
model and nothing else would do to make the same images.

- ``digits`` (``builtin:class-unet``): the same ``UNet2DModel`` (``diffusion.build_unet``
  of the default ``UNetConfig``, seed 0) and ``DDPMScheduler``, sampled in the plain
  diffusers loop (``unet(x, t, class_labels).sample``, ``scheduler.step``), to uint8 pixels;
- ``tiny-text`` (``builtin:tiny-text``): the same ``StableDiffusionPipeline``
  (``diffusion.build_tiny_text_pipeline``, seed 0) called with ``output_type="np"``, to
  uint8 pixels.

Each call makes ``len(seeds)`` images with a generator per image (as the worker does), the
same steps, size and guidance as the worker's tasks; torch runs on ``threads`` intra-op
threads (the worker's ``TANDEM_TORCH_THREADS``), on ``--cpus`` when given (the CPU
``--pin`` gives the worker's calls). No PNG, no upload, no bus: the limit the worker is
measured against.

The model is built once; then each line on stdin (``{"batch": b, "images": n}``) is one
run: one uncounted call of ``b`` images (as the worker warms its pipeline before it
serves), then ``n / b`` calls, answered by one JSON line on stdout: when each call ended
(``time.perf_counter``), so the bench counts whole batches the way it counts the worker's
results, and the CPU and wall seconds of the counted calls. Stdin's end ends the process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

Call = Callable[[list[int]], Any]


def digits(steps: int, size: int) -> Call:
    """A call making one digits image per seed (labels 0, 1, ... in the batch)."""
    import torch
    from diffusers.utils.torch_utils import randn_tensor

    from tandem.common.diffusion import UNetConfig, build_scheduler, build_unet

    cfg = UNetConfig()
    unet = build_unet(cfg, seed=0).eval()
    scheduler = build_scheduler(cfg)

    def call(seeds: list[int]) -> Any:
        batch = len(seeds)
        labels = torch.tensor([i % 10 for i in range(batch)])
        scheduler.set_timesteps(steps)
        gens = [torch.Generator("cpu").manual_seed(s) for s in seeds]
        with torch.inference_mode():
            x = randn_tensor((batch, cfg.in_channels, size, size), generator=gens)
            for t in scheduler.timesteps:
                eps = unet(x, t, class_labels=labels).sample
                x = scheduler.step(eps, t, x, generator=gens).prev_sample
            pixels = ((x / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
            return pixels.permute(0, 2, 3, 1).numpy()

    return call


def tiny_text(steps: int, size: int, guidance: float) -> Call:
    """A call making one tiny-text image per seed ("a red boat <i>", i its place in the
    batch)."""
    import numpy as np
    import torch

    from tandem.common.diffusion import build_tiny_text_pipeline

    pipe = build_tiny_text_pipeline(seed=0)

    def call(seeds: list[int]) -> Any:
        prompts = [f"a red boat {i}" for i in range(len(seeds))]
        gens = [torch.Generator("cpu").manual_seed(s) for s in seeds]
        with torch.inference_mode():
            out = pipe(prompt=prompts, num_inference_steps=steps, height=size, width=size,
                       guidance_scale=guidance, generator=gens, output_type="np")
        return (np.clip(out.images, 0, 1) * 255).round().astype(np.uint8)

    return call


def run(call: Call, batch: int, images: int) -> dict[str, Any]:
    """One run: the warm-up call, then ``images`` in calls of ``batch``; its clocks."""
    if batch < 1 or images % batch:
        raise ValueError(f"{images} images are not a whole number of batches of {batch}")
    call(list(range(batch)))  # the warm-up, not counted
    ends = []
    cpu0, t0 = time.process_time(), time.perf_counter()
    for first in range(0, images, batch):
        made = call(list(range(first, first + batch)))
        assert len(made) == batch
        ends.append(time.perf_counter())
    return {"batch": batch, "images": images, "ends": ends,
            "cpu_s": time.process_time() - cpu0, "wall_s": ends[-1] - t0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tandem.cli.bench.bare_pipeline")
    p.add_argument("--model", choices=("digits", "tiny-text"), required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--size", type=int, default=16)
    p.add_argument("--guidance", type=float, default=1.0)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--cpus", default="", help="CPU list this loop runs on (empty: any)")
    a = p.parse_args(argv)
    if a.cpus:  # before torch starts a thread: each takes this one's CPUs
        from tandem.inference_worker.apart import cpu_list

        os.sched_setaffinity(0, cpu_list(a.cpus, "--cpus"))
    import torch

    if a.threads > 0:
        torch.set_num_threads(a.threads)
    call = (digits(a.steps, a.size) if a.model == "digits"
            else tiny_text(a.steps, a.size, a.guidance))
    for line in sys.stdin:
        order = json.loads(line)
        got = run(call, int(order["batch"]), int(order["images"]))
        print(json.dumps({"model": a.model, "threads": torch.get_num_threads(),
                          "cpus": sorted(os.sched_getaffinity(0)), **got}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
