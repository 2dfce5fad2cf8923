"""What was saturated while a bench measured: CPU per process, the machine, the loop.

A bench that misses its goal says why, from readings taken over the measured window
rather than from guesses: each process's CPU (``/proc/<pid>/stat``; this process by
``time.process_time``), the whole machine's busy cores (``/proc/stat``: the neighbours
too), the fraction of the window this process's event-loop thread was on a CPU
(``time.thread_time`` read from the loop's own thread), and for checkpoint benches the
rate one core computes a checkpoint file's checksum (CRC32) at.

A Python service runs its event loop on one thread, so a process near one core of CPU
(``SATURATED``) is bound there whatever the machine has spare; a machine whose cores are
all busy bounds everyone on it.
"""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.cli.devstack import proc_cpu

SATURATED = 0.85  # of one core (a process), or of every core (the machine)


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine from /proc/stat: how much of the box
    everything, this bench and every other process, used between two readings."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0, 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return float(sum(fields) - idle), float(sum(fields))


def this_process() -> float:
    return time.process_time()


@dataclass
class Window:
    """CPU used over one measured window: cores per named process (CPU seconds over wall
    seconds), the machine's busy cores, and this process's loop-thread busy fraction."""

    wall_s: float
    cores: dict[str, float]
    machine_cores: float | None
    cpus: int
    loop_busy: float | None = None

    def json(self) -> dict[str, Any]:
        return {"wall_s": round(self.wall_s, 3),
                "cores": {k: round(v, 3) for k, v in self.cores.items()},
                "machine_busy_cores": (round(self.machine_cores, 3)
                                       if self.machine_cores is not None else None),
                "cpus": self.cpus,
                "loop_busy": round(self.loop_busy, 3) if self.loop_busy is not None else None}


@dataclass
class Meter:
    """Reads CPU of ``procs`` (name -> a pid, or a function returning CPU seconds) and of
    the machine at ``start`` and ``stop``. ``loop`` names the process whose event loop
    runs the meter (this one): its loop-thread busy fraction is read too.

    Use it from the thread that runs the loop being measured; ``start``/``stop`` cost a
    few ``/proc`` reads, nothing within the window."""

    procs: Mapping[str, int | Callable[[], float]]
    loop: str | None = None
    _t0: tuple[float, dict[str, float], tuple[float, float], float] | None = field(
        default=None, repr=False)

    def _read(self) -> dict[str, float]:
        return {name: (src() if callable(src) else proc_cpu(src))
                for name, src in self.procs.items()}

    def start(self) -> Meter:
        self._t0 = (time.perf_counter(), self._read(), machine_cpu(), time.thread_time())
        return self

    def stop(self) -> Window:
        if self._t0 is None:
            raise RuntimeError("Meter.stop before start")
        wall1, cpu1, (busy1, total1), thread1 = (time.perf_counter(), self._read(),
                                                 machine_cpu(), time.thread_time())
        wall0, cpu0, (busy0, total0), thread0 = self._t0
        wall = max(wall1 - wall0, 1e-9)
        cpus = os.cpu_count() or 1
        machine = ((busy1 - busy0) / (total1 - total0) * cpus) if total1 > total0 else None
        return Window(wall_s=wall, cores={k: (cpu1[k] - cpu0[k]) / wall for k in cpu1},
                      machine_cores=machine, cpus=cpus,
                      loop_busy=(thread1 - thread0) / wall if self.loop else None)


def crc32_mib_per_s(mib: int = 64) -> float:
    """MiB/s one core computes CRC32 at (zlib, the manifests' checksum; 4 MiB blocks,
    ``mib`` MiB in all)."""
    block = os.urandom(4 << 20)
    crc = 0
    t0 = time.perf_counter()
    for _ in range(max(1, mib // 4)):
        crc = zlib.crc32(block, crc)
    return max(1, mib // 4) * 4 / (time.perf_counter() - t0)


def why(window: Window | Mapping[str, Any], loop: str | None = None,
        extra: list[str] | None = None) -> str:
    """A sentence naming what was saturated in ``window`` (a ``Window`` or its JSON),
    with the readings behind it: the machine (every core busy, and how much of that was
    not the bench's own processes), any process near one core (``loop``: the one whose
    event loop the busy fraction is of), then the biggest users; ``extra`` adds the
    bench's own measured bounds (a hashing rate)."""
    w = window.json() if isinstance(window, Window) else dict(window)
    cores: dict[str, float] = dict(w["cores"])
    cpus, machine = int(w["cpus"]), w.get("machine_busy_cores")
    parts = []
    if machine is not None and machine >= SATURATED * cpus:
        others = max(0.0, machine - sum(cores.values()))
        parts.append(f"the machine, {machine:.2f} of {cpus} cores busy "
                     f"({others:.2f} of them not this bench's processes)")
    hot = sorted((n for n, c in cores.items() if c >= SATURATED), key=lambda n: -cores[n])
    for name in hot:
        loop_note = ""
        if name == loop and w.get("loop_busy") is not None:
            loop_note = (f" (its event loop {w['loop_busy']:.0%} busy: one thread, so one "
                         "core is its most)")
        parts.append(f"{name} at {cores[name]:.2f} cores{loop_note}")
    if parts:
        text = "saturated: " + "; ".join(parts)
    else:
        busy = "unknown" if machine is None else f"{machine:.2f}"
        text = (f"nothing measured saturated (machine {busy} of {cpus} cores busy): the "
                "gap is cost per item, not a full resource")
    top = ", ".join(f"{n} {c:.2f}" for n, c in sorted(cores.items(), key=lambda x: -x[1])[:4])
    if top:
        text += f". CPU cores over the window: {top}"
    if loop and w.get("loop_busy") is not None and loop not in hot:
        text += f"; {loop}'s event loop {w['loop_busy']:.0%} busy"
    for e in extra or []:
        text += f"; {e}"
    return text


def per_task(sides: Mapping[str, Mapping[str, float]], raw: Mapping[str, float],
             goal_us: float | None = None,
             overheads: Mapping[str, float] | None = None) -> list[str]:
    """Where a durable task's cost lies, from the serve bench's sides (``tandem``,
    ``floor``, each with ``client_us``, ``server_us``, ``wire_per_task``) and ``raw``
    fetch + ack: what a client pays per wire message, what the floor (the same durable
    steps, nothing else) costs against ``goal_us``, and what Tandem adds over the floor,
    with ``overheads`` (microseconds a task of each thing the worker does that the floor
    does not, measured in the bench's process). The floor bounds every worker written
    with that client: none goes below it."""
    t, f = sides["tandem"], sides["floor"]
    out = []
    for name, s in (("raw fetch + ack", raw), ("the floor", f)):
        wire = s["wire_per_task"] or 1.0
        out.append(f"{name}: {s['client_us'] + s['server_us']:.1f} us a task (client "
                   f"{s['client_us']:.1f} over {wire:g} wire messages, "
                   f"{s['client_us'] / wire:.1f} us each; nats-server {s['server_us']:.1f})")
    floor_us = f["client_us"] + f["server_us"]
    if goal_us is not None and floor_us > goal_us:
        out.append(f"the floor alone is {floor_us / goal_us:.2f}x the {goal_us:g} us goal: "
                   "no worker doing these steps with this client and server meets it")
    out.append(f"Tandem adds {t['client_us'] - f['client_us']:+.1f} us of client and "
               f"{t['server_us'] - f['server_us']:+.1f} us of nats-server CPU a task over "
               f"the floor ({t['wire_per_task']:g} wire messages against "
               f"{f['wire_per_task']:g})")
    if overheads:
        parts = {k: v for k, v in overheads.items() if k != "check_task"}  # both pay it
        out.append("of which, measured one at a time: " + ", ".join(
            f"{k.replace('_', ' ')} {v:.1f} us" for k, v in parts.items())
            + f" ({sum(parts.values()):.1f} us together; the rest is the consumer, "
            "batcher and record code around them)")
    return out
