"""The nvml backend through a fake NVML module at the pynvml boundary (the only fake):
fields and units, unsupported calls skipped per field, a lost GPU, XIDs from the event
set, and the whole agent on a real nats-server."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import structlog
from prometheus_client import REGISTRY

from tandem.cluster_agent.agent import NodeAgent
from tandem.cluster_agent.clock import ManualClock
from tandem.cluster_agent.health import Tracker
from tandem.cluster_agent.nvml import NvmlBackend
from tandem.common import subjects
from tandem.common.bus import Bus
from tandem.common.events import Health, NodeTelemetry, decode
from tandem.common.streams import TELEMETRY, core_streams
from tests.test_agent import transitions

GIB = 1 << 30


class FakeNVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


@dataclass
class FakeGpu:
    uuid: str
    unsupported: set[str] = field(default_factory=set)
    lost: bool = False
    links: int = 2
    values: dict[str, Any] = field(default_factory=lambda: {
        "util": 97, "mem": (70 * GIB, 80 * GIB), "temp": 66, "power_mw": 650_000,
        "energy_mj": 12_345_000, "sm": 1980, "mem_clock": 2619, "reasons": 0x4,
        "ecc": {(1, 0): 0, (1, 1): 2, (0, 0): 7}, "remap": (3, 1, 0, 0), "pcie": 5,
        "nvlink": 1,
    })


class FakeNvml:
    """The surface of ``pynvml`` the backend uses, with the real constants."""

    def __init__(self, gpus: list[FakeGpu]) -> None:
        for name in dir(pynvml):
            if name.startswith(("NVML_", "nvmlEventType")):
                setattr(self, name, getattr(pynvml, name))
        self.NVMLError = FakeNVMLError
        self.gpus = gpus
        self.events: list[tuple[int, int]] = []
        self.calls: Counter[str] = Counter()

    def _gpu(self, h: int, what: str) -> FakeGpu:
        self.calls[what] += 1
        g = self.gpus[h]
        if g.lost:
            raise FakeNVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        if what in g.unsupported:
            raise FakeNVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return g

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: return len(self.gpus)
    def nvmlDeviceGetHandleByIndex(self, i: int) -> int: return i
    def nvmlDeviceGetIndex(self, h: int) -> int: return h
    def nvmlDeviceGetUUID(self, h: int) -> bytes: return self.gpus[h].uuid.encode()

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=self._gpu(h, "util").values["util"], memory=40)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        used, total = self._gpu(h, "mem").values["mem"]
        return SimpleNamespace(used=used, total=total, free=total - used)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return self._gpu(h, "temp").values["temp"]

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._gpu(h, "power").values["power_mw"]

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        return self._gpu(h, "energy").values["energy_mj"]

    def nvmlDeviceGetClockInfo(self, h: int, kind: int) -> int:
        g = self._gpu(h, "clock")
        return g.values["sm"] if kind == pynvml.NVML_CLOCK_SM else g.values["mem_clock"]

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self._gpu(h, "reasons").values["reasons"]

    def nvmlDeviceGetTotalEccErrors(self, h: int, error_type: int, counter: int) -> int:
        return self._gpu(h, "ecc").values["ecc"][(error_type, counter)]

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        return self._gpu(h, "remap").values["remap"]

    def nvmlDeviceGetPcieReplayCounter(self, h: int) -> int:
        return self._gpu(h, "pcie").values["pcie"]

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        g = self._gpu(h, "nvlink_state")
        if link >= g.links:
            raise FakeNVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, h: int, link: int, counter: int) -> int:
        return self._gpu(h, "nvlink").values["nvlink"]

    def nvmlEventSetCreate(self) -> str: return "event-set"
    def nvmlEventSetFree(self, es: str) -> None: ...

    def nvmlDeviceRegisterEvents(self, h: int, types: int, es: str) -> None:
        self._gpu(h, "events")

    def nvmlEventSetWait_v2(self, es: str, timeout_ms: int) -> Any:
        if not self.events:
            raise FakeNVMLError(pynvml.NVML_ERROR_TIMEOUT)
        gpu, xid = self.events.pop(0)
        return SimpleNamespace(device=gpu, eventType=pynvml.nvmlEventTypeXidCriticalError,
                               eventData=xid, gpuInstanceId=0, computeInstanceId=0)


def test_nvml_backend_reads_every_field_in_units_and_xids_from_the_event_set() -> None:
    nv = FakeNvml([FakeGpu("GPU-a"), FakeGpu("GPU-b")])
    backend = NvmlBackend(nv)
    assert backend.open(0.0) == 2
    nv.events += [(1, 48), (1, 13)]
    a, b = backend.sample(1.0)
    assert (a.uuid, a.util, a.mem_used, a.mem_total, a.temp) == ("GPU-a", 97.0, 70 * GIB,
                                                                80 * GIB, 66.0)
    assert (a.power, a.energy, a.sm_clock, a.mem_clock, a.throttle) == (650.0, 12345.0, 1980,
                                                                        2619, 0x4)
    assert (a.ecc_volatile, a.ecc_aggregate, a.ecc_corrected) == (0, 2, 7)
    assert (a.remap_correctable, a.remap_uncorrectable, a.remap_pending, a.remap_failure) == (
        3, 1, False, False)
    assert (a.pcie_replay, a.nvlink_errors) == (5, 2 * 4)  # 2 links x 4 counters
    assert a.xids == [] and b.xids == [48, 13]
    assert backend.sample(2.0)[1].xids == []  # each XID is reported once
    backend.close()


def test_unsupported_nvml_calls_are_skipped_per_field_and_not_retried() -> None:
    old = FakeGpu("GPU-old", unsupported={"ecc", "remap", "energy", "nvlink_state", "events"})
    nv = FakeNvml([old, FakeGpu("GPU-new")])
    backend = NvmlBackend(nv)
    backend.open(0.0)
    for t in range(1, 4):
        s_old, s_new = backend.sample(float(t))
    assert s_old.util == 97.0 and s_old.temp == 66.0
    assert (s_old.ecc_volatile, s_old.remap_pending, s_old.energy, s_old.nvlink_errors) == (
        None, None, None, None)
    assert s_new.ecc_volatile == 0 and s_new.nvlink_errors == 8
    # ECC: 3 counters x 1 refusal on the old GPU, 3 x 3 samples on the new one.
    assert nv.calls["ecc"] == 3 + 9 and nv.calls["remap"] == 1 + 3


def test_a_gpu_that_falls_off_the_bus_is_reported_lost_and_the_rules_see_it() -> None:
    nv = FakeNvml([FakeGpu("GPU-a"), FakeGpu("GPU-b")])
    backend = NvmlBackend(nv)
    backend.open(0.0)
    tracker = Tracker()
    tracker.observe(backend.sample(1.0), 1.0)
    nv.gpus[0].lost = True
    nv.events.append((0, 79))
    lost, ok = backend.sample(2.0)
    assert lost.lost and lost.util is None and lost.xids == [79] and not ok.lost
    tracker.observe([lost, ok], 2.0)
    assert tracker.health == Health.unhealthy
    assert tracker.active() == ["gpu-lost@0", "xid-79@0"]
    backend.close()


async def test_the_agent_on_the_nvml_backend_publishes_the_transition(
        bus: Bus, uid: str) -> None:
    await bus.provision(core_streams())
    nv = FakeNvml([FakeGpu(f"GPU-{i}") for i in range(4)])
    clock = ManualClock(time.time())
    agent = NodeAgent(bus, f"c{uid}", "gpu-host", NvmlBackend(nv), clock, auto_drain=False)
    await agent.start()
    clock.advance(1.0)
    await agent.tick()
    nv.events.append((2, 95))
    clock.advance(1.0)
    await agent.tick()
    trs = await transitions(bus, f"c{uid}", "gpu-host")
    assert [(t.current, t.rule, t.gpu, t.action) for t in trs] == [
        (Health.unhealthy, "xid-95", 2, "reset")]
    hb = agent.heartbeat_value()
    assert (hb.backend, hb.gpus_total, hb.gpus_usable, hb.gpus_free) == ("nvml", 4, 3, 0)
    await agent.close()


async def test_xid_codes_no_xid_can_have_are_dropped_counted_and_logged_once(
        bus: Bus, uid: str) -> None:
    await bus.provision(core_streams())
    cluster = f"c{uid}"
    nv = FakeNvml([FakeGpu(f"GPU-{i}") for i in range(4)])
    clock = ManualClock(time.time())
    agent = NodeAgent(bus, cluster, "gpu-host", NvmlBackend(nv), clock, auto_drain=False)
    await agent.start()
    before = REGISTRY.get_sample_value("tandem_agent_xids_invalid_total") or 0.0
    with structlog.testing.capture_logs() as logs:
        # NVML hands an XID over as a 64-bit word: a garbled one is no XID at all.
        nv.events += [(1, 2**64 - 1), (1, 48), (2, 0)]
        clock.advance(1.0)
        await agent.tick()
        nv.events += [(3, 100_000)]
        clock.advance(1.0)
        await agent.tick()
    subject = subjects.telemetry(cluster, "gpu-host")
    sub = await bus.js.subscribe(subject, stream=TELEMETRY, ordered_consumer=True)
    sent = [decode((await sub.next_msg(timeout=5)).data, NodeTelemetry) for _ in range(2)]
    await sub.unsubscribe()
    assert [[g.xids for g in t.gpus] for t in sent] == [[[], [48], [], []], [[], [], [], []]]
    trs = await transitions(bus, cluster, "gpu-host")
    assert [(t.current, t.rule, t.active) for t in trs] == [
        (Health.unhealthy, "xid-48", ["xid-48@1"])]  # no xid-unknown from the garbage
    assert agent.xids_invalid == 3
    assert REGISTRY.get_sample_value("tandem_agent_xids_invalid_total") == before + 3
    [said] = [x for x in logs if x["event"] == "agent.xid_invalid"]
    assert said["gpu"] == 1 and said["codes"] == [str(2**64 - 1)]
    await agent.close()
