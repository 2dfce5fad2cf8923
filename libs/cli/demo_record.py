"""What ``tandem demo`` shows and keeps: the console (lines and one progress bar), the
record that becomes ``demo.json`` and the report, and the recorder that fills it from
the bus (every task's progress, every checkpoint, every health transition)."""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.common import subjects


class Console:
    """Timestamped lines, and progress bars: redrawn in place on a TTY, else a line per
    tenth of the way (logs stay readable)."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stdout
        self.t0 = time.monotonic()
        self.tty = self.stream.isatty()
        self._bar: str | None = None
        self._bar_decile = -1

    def say(self, msg: str) -> None:
        self._end_bar()
        print(f"[demo {time.monotonic() - self.t0:6.1f}s] {msg}", file=self.stream, flush=True)

    def bar(self, label: str, done: float, total: float, extra: str = "") -> None:
        frac = min(max(done / total, 0.0), 1.0) if total else 1.0
        width = 30
        full = int(frac * width)
        line = (f"[demo {time.monotonic() - self.t0:6.1f}s] {label} "
                f"[{'#' * full}{'.' * (width - full)}] {done:g}/{total:g} {frac:4.0%} {extra}")
        if self.tty:
            self.stream.write("\r" + line.ljust(100)[:160])
            self.stream.flush()
            self._bar = label
            return
        decile = int(frac * 10)
        if decile != self._bar_decile or label != self._bar:
            self._bar_decile, self._bar = decile, label
            print(line, file=self.stream, flush=True)

    def _end_bar(self) -> None:
        if self.tty and self._bar is not None:
            self.stream.write("\n")
        self._bar = None
        self._bar_decile = -1


class PhaseFailed(Exception):
    """A phase of the demo could not complete; the message says what and why."""


# ----------------------------------------------------------------------------- recording


@dataclass
class Record:
    """Everything the report draws, as plain JSON-able data (times are wall clock)."""

    run_id: str
    plan: dict[str, Any]
    started_at: float = field(default_factory=time.time)
    steps: list[list[float]] = field(default_factory=list)  # step, loss, step_time, sps, at, att
    checkpoints: list[dict[str, Any]] = field(default_factory=list)  # written
    mirrored: list[dict[str, Any]] = field(default_factory=list)
    statuses: list[dict[str, Any]] = field(default_factory=list)
    incidents: list[dict[str, Any]] = field(default_factory=list)
    telemetry: dict[str, list[list[float]]] = field(default_factory=dict)  # node/gpu -> rows
    health: list[dict[str, Any]] = field(default_factory=list)
    generations: list[dict[str, Any]] = field(default_factory=list)
    serving: dict[str, Any] = field(default_factory=dict)  # cluster -> checkpoint it serves
    failover: dict[str, Any] = field(default_factory=dict)
    timeline: list[list[Any]] = field(default_factory=list)  # [at, text]
    run: dict[str, Any] = field(default_factory=dict)  # final RunRecord
    results: list[dict[str, Any]] = field(default_factory=list)  # phase, status, detail
    stack: dict[str, Any] = field(default_factory=dict)
    finished_at: float | None = None

    def mark(self, text: str) -> None:
        self.timeline.append([time.time(), text])

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Recorder:
    """Core-NATS subscriptions that copy the run's events and the fleet's telemetry into
    the record as they happen (the services publish; nothing here is polled)."""

    def __init__(self, nc: Any, record: Record) -> None:
        self.nc = nc
        self.rec = record
        self.subs: list[Any] = []
        self.last_step = 0
        self.last_loss: float | None = None

    async def start(self) -> None:

        run = subjects.token(self.rec.run_id, "run id")
        for subject, cb in ((f"train.{run}.*", self._train), (f"ckpt.{run}.*", self._ckpt),
                            (subjects.TELEMETRY.wildcard, self._telemetry),
                            (subjects.HEALTH.wildcard, self._health)):
            self.subs.append(await self.nc.subscribe(subject, cb=cb))

    async def stop(self) -> None:
        for sub in self.subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _train(self, msg: Any) -> None:
        from tandem.common.events import CheckpointWritten, TrainEvent, TrainStatus, TrainStep
        from tandem.common.events import decode as decode_event

        try:
            ev = decode_event(msg.data, TrainEvent)  # type: ignore[arg-type]
        except Exception:
            return
        if isinstance(ev, TrainStep):
            self.rec.steps.append([ev.step, ev.loss, ev.step_time, ev.samples_per_s, ev.at,
                                   ev.attempt])
            self.last_step, self.last_loss = ev.step, ev.loss
        elif isinstance(ev, CheckpointWritten):
            self.rec.checkpoints.append({"step": ev.step, "at": ev.at, "blocked_s": ev.blocked_s,
                                         "write_s": ev.write_s,
                                         "bytes": sum(f.size for f in ev.manifest.files)})
        elif isinstance(ev, TrainStatus):
            self.rec.statuses.append({"at": ev.at, "state": ev.state.value, "reason": ev.reason,
                                      "restarts": ev.restarts})
            if ev.incident:
                self.rec.incidents.append({"at": ev.at, "step": self.last_step, **ev.incident})

    async def _ckpt(self, msg: Any) -> None:
        from tandem.common.events import CheckpointMirrored, CkptEvent
        from tandem.common.events import decode as decode_event

        try:
            ev = decode_event(msg.data, CkptEvent)  # type: ignore[arg-type]
        except Exception:
            return
        if isinstance(ev, CheckpointMirrored):
            self.rec.mirrored.append({"step": ev.step, "at": ev.at, "seconds": ev.seconds,
                                      "bytes": ev.bytes, "uri": ev.uri})

    async def _telemetry(self, msg: Any) -> None:
        from tandem.common.events import NodeTelemetry
        from tandem.common.events import decode as decode_event

        try:
            ev = decode_event(msg.data, NodeTelemetry)
        except Exception:
            return
        for g in ev.gpus:
            rows = self.rec.telemetry.setdefault(f"{ev.cluster}/{ev.node}/gpu{g.index}", [])
            rows.append([ev.at, g.util if g.util is not None else -1,
                         g.temp if g.temp is not None else -1,
                         g.power if g.power is not None else -1,
                         (g.mem_used or 0) / 2**30, (g.mem_total or 0) / 2**30])

    async def _health(self, msg: Any) -> None:
        from tandem.common.events import HealthTransition
        from tandem.common.events import decode as decode_event

        try:
            ev = decode_event(msg.data, HealthTransition)
        except Exception:
            return
        self.rec.health.append({"at": ev.at, "node": f"{ev.cluster}/{ev.node}",
                                "from": ev.previous.value, "to": ev.current.value,
                                "rule": ev.rule, "reason": ev.reason})


# -------------------------------------------------------------------------------- phases
