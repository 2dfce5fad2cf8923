"""A worker on a drained node pulls nothing new and finishes what it holds.

``Drain`` is the node's drain flag as the pull loop reads it (``fleet.DrainWatch``
underneath), exported as the ``tandem_worker_drained`` gauge. A fetch already waiting
when the drain arrives can still return tasks; the loop (``bus.Poller``, paused while
drained) hands those back (nak, so another worker or this one once undrained takes them)
instead of starting them.
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.common import log, metrics
from tandem.common.bus import Bus
from tandem.common.events import DrainRecord
from tandem.common.fleet import DrainWatch

_log = log.get("tandem.inference_worker.drain")

DRAINED = metrics.Gauge("tandem_worker_drained", "1 while this worker's node is drained")


class Drain:
    """``on_undrain`` runs when a drained node is undrained (before the loop can pull
    again); not for an undrain of a node that was not drained, which changes nothing
    here (the watch hands every undrain on: the agent reads any as "faults dealt
    with")."""

    def __init__(self, bus: Bus, cluster: str, node: str,
                 on_undrain: Callable[[], None] | None = None) -> None:
        self.watch = DrainWatch(bus, cluster, node, on_change=self._changed)
        self.on_undrain = on_undrain
        self._was_drained = False

    @property
    def drained(self) -> bool:
        return self.watch.drained

    async def start(self) -> None:
        await self.watch.start()
        self._was_drained = self.drained
        DRAINED.set(int(self.drained))
        if self.watch.record is not None:
            _log.warning("worker.drained", reason=self.watch.record.reason)

    async def stop(self) -> None:
        await self.watch.stop()

    async def _changed(self, record: DrainRecord | None) -> None:
        was, self._was_drained = self._was_drained, record is not None
        DRAINED.set(int(record is not None))
        if record is not None:
            _log.warning("worker.drained", reason=record.reason, by=record.by)
        elif was:
            _log.info("worker.undrained")
            if self.on_undrain is not None:
                self.on_undrain()
