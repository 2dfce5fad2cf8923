"""Simulated GPUs: H100-like numbers with noise, plus the faults of a script.

Noise is what a healthy busy fleet shows: utilisation and power jitter, temperature
that drifts toward a power-dependent target, boost clocks a few MHz apart, the odd
power-cap clock event, a rare one-sample thermal blip and a trickle of corrected ECC
and PCIe replays. None of it lasts long enough to cross a health rule; faults do.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tandem.cluster_agent.backend import AgentDeath
from tandem.cluster_agent.faults import Fault, check_gpus
from tandem.common.events import GpuSample

GIB = 1 << 30
MEM_TOTAL = 80 * GIB
POWER_IDLE, POWER_LIMIT = 70.0, 700.0
SM_MAX, SM_IDLE, MEM_CLOCK = 1980, 345, 2619

# NVML clocks-event reason bits (nvmlClocksEventReason*).
IDLE, SW_POWER_CAP, HW_SLOWDOWN = 0x1, 0x4, 0x8
SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE = 0x20, 0x40, 0x80


@dataclass
class _Gpu:
    index: int
    uuid: str
    temp_offset: float
    power_offset: float
    temp: float
    energy: float = 0.0
    ecc_volatile: int = 0
    ecc_aggregate: int = 0
    ecc_corrected: int = 0
    remap_uncorrectable: int = 0
    remap_pending: bool = False
    remap_failure: bool = False
    pcie_replay: int = 0
    nvlink_errors: int = 0
    lost: bool = False


class SimBackend:
    name = "sim"
    blocking = False

    def __init__(self, gpus: int = 8, load: float = 0.0, faults: list[Fault] | None = None,
                 seed: int = 0) -> None:
        if gpus < 1:
            raise ValueError("a simulated node needs at least one GPU")
        if not 0.0 <= load <= 1.0:
            raise ValueError("load must be in [0, 1]")
        self.n = gpus
        self.load = load
        self.faults = list(faults or [])
        check_gpus(self.faults, gpus)
        self.rng = random.Random(seed)
        self.t0 = 0.0
        self.last = 0.0
        self._next = 0  # index of the first one-shot fault not yet applied
        self._gpus: list[_Gpu] = []

    def open(self, now: float) -> int:
        r = self.rng
        self.t0 = self.last = now
        self._gpus = [
            _Gpu(index=i, uuid=f"GPU-sim-{r.getrandbits(64):016x}",
                 temp_offset=r.uniform(-2.5, 2.5), power_offset=r.uniform(-12, 12),
                 temp=30.0 + r.uniform(-1, 1))
            for i in range(self.n)
        ]
        return self.n

    def close(self) -> None:
        pass

    # ----------------------------------------------------------------------------- faults

    def _one_shots(self, t: float) -> dict[int, list[int]]:
        """Apply faults whose time has come; return XIDs per GPU raised this sample."""
        xids: dict[int, list[int]] = {}
        while self._next < len(self.faults) and self.faults[self._next].at <= t:
            f = self.faults[self._next]
            self._next += 1
            g = self._gpus[f.gpu]
            match f.kind:
                case "xid":
                    xids.setdefault(f.gpu, []).extend([f.code] * f.count)
                case "ecc":
                    g.ecc_volatile += f.count
                    g.ecc_aggregate += f.count
                    g.remap_uncorrectable += f.count
                    g.remap_pending = True
                case "ecc-corrected":
                    g.ecc_corrected += f.count
                case "nvlink":
                    g.nvlink_errors += f.count
                case "pcie-replay":
                    g.pcie_replay += f.count
                case "remap-failure":
                    g.remap_failure = True
                case "off-bus":
                    g.lost = True
                    xids.setdefault(f.gpu, []).append(79)
                case "agent-die":
                    raise AgentDeath(f"fault script: agent-die at {f.at:g}s")
        return xids

    def _lasting(self, t: float, gpu: int) -> list[Fault]:
        return [f for f in self.faults
                if f.gpu == gpu and f.kind in ("thermal", "power-brake", "slow") and f.active(t)]

    # ----------------------------------------------------------------------------- sample

    def sample(self, now: float) -> list[GpuSample]:
        t = now - self.t0
        dt = max(now - self.last, 0.0)
        self.last = now
        xids = self._one_shots(t)
        lasting = {f.gpu for f in self.faults if f.kind in ("thermal", "power-brake", "slow")}
        return [self._sample(g, t, dt, xids.get(g.index, []),
                             self._lasting(t, g.index) if g.index in lasting else [])
                for g in self._gpus]

    def _sample(self, g: _Gpu, t: float, dt: float, xids: list[int],
                lasting: list[Fault]) -> GpuSample:
        if g.lost:
            return GpuSample(index=g.index, uuid=g.uuid, xids=xids, lost=True)
        r = self.rng
        busy = self.load > 0.02
        util = min(100.0, max(0.0, self.load * 100 + r.gauss(0, 1.5))) if busy else \
            float(r.random() < 0.05)
        power = POWER_IDLE + (POWER_LIMIT - POWER_IDLE) * 0.9 * util / 100
        power = max(POWER_IDLE * 0.8, power + g.power_offset * util / 100 + r.gauss(0, 6))
        target = 30.0 + power * 0.055 + g.temp_offset
        sm = SM_MAX - r.randrange(0, 30) if busy else SM_IDLE
        throttle = 0 if busy else IDLE
        if busy and r.random() < 0.08:
            throttle |= SW_POWER_CAP  # routine under load: never a fault by itself
        if busy and r.random() < 0.002:
            throttle |= SW_THERMAL  # a one-sample blip; hysteresis must ignore it
        for f in lasting:
            if f.kind == "thermal":
                target = f.temp
                throttle |= SW_THERMAL | HW_THERMAL
                sm = int(sm * 0.7)
            elif f.kind == "power-brake":
                throttle |= HW_POWER_BRAKE | HW_SLOWDOWN
                sm = int(sm * 0.4)
                power *= 0.5
            elif f.kind == "slow":
                sm = int(sm * f.factor)
        # First-order lag toward the target (a few seconds), plus sensor noise.
        g.temp += (target - g.temp) * min(1.0, dt / 4.0 if dt else 1.0)
        temp = round(g.temp + r.gauss(0, 0.4), 1)
        g.energy += power * dt
        if r.random() < 0.001:
            g.ecc_corrected += 1
        if r.random() < 0.0005:
            g.pcie_replay += 1
        mem = int(MEM_TOTAL * (0.82 + r.uniform(-0.02, 0.02))) if busy else 600 << 20
        return GpuSample(
            index=g.index, uuid=g.uuid, util=round(util, 1), mem_used=mem, mem_total=MEM_TOTAL,
            temp=temp, power=round(power, 1), energy=round(g.energy, 1), sm_clock=sm,
            mem_clock=MEM_CLOCK, throttle=throttle, ecc_volatile=g.ecc_volatile,
            ecc_aggregate=g.ecc_aggregate, ecc_corrected=g.ecc_corrected,
            remap_correctable=0, remap_uncorrectable=g.remap_uncorrectable,
            remap_pending=g.remap_pending, remap_failure=g.remap_failure,
            pcie_replay=g.pcie_replay, nvlink_errors=g.nvlink_errors, xids=xids,
        )
