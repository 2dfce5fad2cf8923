"""Real GPUs through nvidia-ml-py (``pynvml``), imported only when this backend is chosen.

Every field is read by its own guarded call. A call that answers NOT_SUPPORTED (or is
missing from the driver) is remembered and never made again for that GPU, so an older
or smaller GPU reports what it has and ``None`` for the rest. GPU_IS_LOST marks the GPU
``lost`` (fell off the bus). XIDs come from an NVML event set, drained without waiting
at each sample.

NVML that cannot start (nvidia-ml-py not installed, no driver) is ``NvmlUnavailable``,
raised by ``probe`` (the service's settings check, before it connects) and by ``open``.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from tandem.cluster_agent.backend import NvmlUnavailable
from tandem.common import log
from tandem.common.events import GpuSample

_log = log.get("tandem.cluster_agent.nvml")

NVLINK_COUNTERS = ("NVML_NVLINK_ERROR_DL_REPLAY", "NVML_NVLINK_ERROR_DL_RECOVERY",
                   "NVML_NVLINK_ERROR_DL_CRC_FLIT", "NVML_NVLINK_ERROR_DL_CRC_DATA")


class _GpuLost(Exception):
    pass


def initialised(module: ModuleType | Any | None = None) -> Any:
    """The pynvml module (or ``module``, a fake) with NVML initialised; raises
    ``NvmlUnavailable`` naming why it cannot be."""
    try:
        nv = module or importlib.import_module("pynvml")
    except ImportError as exc:
        raise NvmlUnavailable(f"nvidia-ml-py is not installed: {exc}") from None
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        raise NvmlUnavailable(f"{type(exc).__name__}: {exc}") from None
    return nv


def probe(module: ModuleType | Any | None = None) -> int:
    """How many GPUs NVML sees on this host (initialised and shut down again)."""
    nv = initialised(module)
    try:
        return int(nv.nvmlDeviceGetCount())
    except nv.NVMLError as exc:
        raise NvmlUnavailable(f"{type(exc).__name__}: {exc}") from None
    finally:
        with contextlib.suppress(Exception):
            nv.nvmlShutdown()


class NvmlBackend:
    name = "nvml"
    blocking = True

    def __init__(self, module: ModuleType | Any | None = None) -> None:
        # ``module`` is the pynvml module; tests pass a fake with the same surface.
        self._module = module
        self.nv: Any = None
        self.handles: list[Any] = []
        self.uuids: list[str] = []
        self.unsupported: list[set[str]] = []
        self.lost: list[bool] = []
        self.links: list[list[int]] = []
        self.events: Any = None
        self._warned: set[tuple[int, str]] = set()

    # --------------------------------------------------------------------------- lifecycle

    def open(self, now: float) -> int:
        nv = self.nv = initialised(self._module)
        count = nv.nvmlDeviceGetCount()
        self.handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self.unsupported = [set() for _ in range(count)]
        self.lost = [False] * count
        self.uuids = []
        for i, h in enumerate(self.handles):
            uuid = self._call(i, "uuid", nv.nvmlDeviceGetUUID, h)
            self.uuids.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid or ""))
        self.links = [self._active_links(i) for i in range(count)]
        self._open_events()
        return count

    def close(self) -> None:
        if self.nv is None:
            return
        # Best effort at shutdown: a GPU that fell off the bus may fail both.
        if self.events is not None:
            with contextlib.suppress(Exception):
                self.nv.nvmlEventSetFree(self.events)
        with contextlib.suppress(Exception):
            self.nv.nvmlShutdown()
        self.nv = None

    def _open_events(self) -> None:
        nv = self.nv
        try:
            self.events = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            _log.warning("nvml.no_event_set", error=str(exc))
            self.events = None
            return
        for i, h in enumerate(self.handles):
            try:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self.events)
            except nv.NVMLError as exc:
                _log.warning("nvml.no_xid_events", gpu=i, error=str(exc))

    def _active_links(self, i: int) -> list[int]:
        nv = self.nv
        links = []
        for link in range(getattr(nv, "NVML_NVLINK_MAX_LINKS", 0)):
            try:
                if nv.nvmlDeviceGetNvLinkState(self.handles[i], link) == nv.NVML_FEATURE_ENABLED:
                    links.append(link)
            except nv.NVMLError:
                break  # links are numbered densely: the first failure ends the list
        return links

    # ---------------------------------------------------------------------------- helpers

    def _call(self, i: int, field: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One guarded NVML call: None when unsupported or failing; raises _GpuLost."""
        if field in self.unsupported[i]:
            return None
        nv = self.nv
        try:
            return fn(*args)
        except nv.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == nv.NVML_ERROR_GPU_IS_LOST:
                raise _GpuLost() from None
            if code in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND):
                self.unsupported[i].add(field)
            elif (i, field) not in self._warned:
                self._warned.add((i, field))
                _log.warning("nvml.field_failed", gpu=i, field=field, error=str(exc))
            return None
        except AttributeError:  # an older pynvml without this function
            self.unsupported[i].add(field)
            return None

    def _xids(self) -> dict[int, list[int]]:
        if self.events is None:
            return {}
        nv = self.nv
        out: dict[int, list[int]] = {}
        for _ in range(1024):  # bounded: a storm of events cannot stall a sample
            try:
                data = nv.nvmlEventSetWait_v2(self.events, 0)
            except nv.NVMLError as exc:
                if getattr(exc, "value", None) != nv.NVML_ERROR_TIMEOUT:
                    _log.warning("nvml.event_wait_failed", error=str(exc))
                break
            if data.eventType != nv.nvmlEventTypeXidCriticalError:
                continue
            try:
                idx = nv.nvmlDeviceGetIndex(data.device)
            except nv.NVMLError:
                continue
            out.setdefault(idx, []).append(int(data.eventData))
        return out

    # ----------------------------------------------------------------------------- sample

    def sample(self, now: float) -> list[GpuSample]:
        xids = self._xids()
        return [self._sample(i, xids.get(i, [])) for i in range(len(self.handles))]

    def _sample(self, i: int, xids: list[int]) -> GpuSample:
        s = GpuSample(index=i, uuid=self.uuids[i], xids=xids)
        if self.lost[i]:
            s.lost = True
            return s
        try:
            self._fill(i, s)
        except _GpuLost:
            self.lost[i] = True
            _log.error("nvml.gpu_lost", gpu=i, uuid=self.uuids[i])
            return GpuSample(index=i, uuid=self.uuids[i], xids=xids, lost=True)
        return s

    def _fill(self, i: int, s: GpuSample) -> None:
        nv, h, call = self.nv, self.handles[i], self._call
        util = call(i, "util", nv.nvmlDeviceGetUtilizationRates, h)
        if util is not None:
            s.util = float(util.gpu)
        mem = call(i, "mem", nv.nvmlDeviceGetMemoryInfo, h)
        if mem is not None:
            s.mem_used, s.mem_total = int(mem.used), int(mem.total)
        temp = call(i, "temp", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
        if temp is not None:
            s.temp = float(temp)
        power = call(i, "power", nv.nvmlDeviceGetPowerUsage, h)  # mW
        if power is not None:
            s.power = power / 1000.0
        energy = call(i, "energy", nv.nvmlDeviceGetTotalEnergyConsumption, h)  # mJ
        if energy is not None:
            s.energy = energy / 1000.0
        s.sm_clock = call(i, "sm_clock", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
        s.mem_clock = call(i, "mem_clock", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)
        s.throttle = call(i, "throttle", nv.nvmlDeviceGetCurrentClocksEventReasons, h)
        unc, cor = nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED
        ecc = nv.nvmlDeviceGetTotalEccErrors
        s.ecc_volatile = call(i, "ecc_volatile", ecc, h, unc, nv.NVML_VOLATILE_ECC)
        s.ecc_aggregate = call(i, "ecc_aggregate", ecc, h, unc, nv.NVML_AGGREGATE_ECC)
        s.ecc_corrected = call(i, "ecc_corrected", ecc, h, cor, nv.NVML_VOLATILE_ECC)
        rows = call(i, "remap", nv.nvmlDeviceGetRemappedRows, h)
        if rows is not None:
            corr, unc_rows, pending, failure = rows
            s.remap_correctable, s.remap_uncorrectable = int(corr), int(unc_rows)
            s.remap_pending, s.remap_failure = bool(pending), bool(failure)
        s.pcie_replay = call(i, "pcie_replay", nv.nvmlDeviceGetPcieReplayCounter, h)
        if self.links[i]:
            total, seen = 0, False
            for link in self.links[i]:
                for name in NVLINK_COUNTERS:
                    v = call(i, f"nvlink:{name}", nv.nvmlDeviceGetNvLinkErrorCounter, h, link,
                             getattr(nv, name))
                    if v is not None:
                        total, seen = total + int(v), True
            s.nvlink_errors = total if seen else None
