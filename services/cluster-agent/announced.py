"""The models loaded on the node: the static ones and what its workers announce.

Workers announce what they have loaded on ``models.<cluster>.<node>`` (core NATS); the
fresh announcements (heard within the heartbeat's TTL) are folded into the heartbeat's
``models``. An announcement naming another cluster or node, a worker or model that is not
a token, more than ``MAX_MODELS`` models, or a worker past ``MAX_WORKERS`` is logged and
ignored. The bounds keep the heartbeat within the server's max_payload: at most
``MAX_MODELS`` names of at most 64 characters (subject tokens), about 17 kB.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from nats.aio.msg import Msg

from tandem.common import subjects
from tandem.common.errors import EventDecodeError, InvalidToken
from tandem.common.events import ModelsLoaded, decode

MAX_MODELS = 256
MAX_WORKERS = 64


class AnnouncedModels:
    """What the node reports as loaded: ``static`` first, then the workers' fresh ones."""

    def __init__(self, cluster: str, node: str, static: Iterable[str], ttl: float,
                 log: Any) -> None:
        self.cluster, self.node, self.ttl, self.log = cluster, node, ttl, log
        self.static = {subjects.token(m, "model name") for m in static}
        if len(self.static) > MAX_MODELS:
            raise ValueError(f"{len(self.static)} models always reported: at most "
                             f"{MAX_MODELS}")
        self._workers: dict[str, tuple[list[str], float]] = {}
        self._capped = False  # the last list left announced models out

    def names(self) -> list[str]:
        """The static models, then the workers' fresh ones: at most ``MAX_MODELS``."""
        fresh = time.monotonic() - self.ttl
        self._workers = {w: v for w, v in self._workers.items() if v[1] >= fresh}
        announced = set().union(*(names for names, _ in self._workers.values()))
        extra = sorted(announced - self.static)
        room = MAX_MODELS - len(self.static)
        capped = len(extra) > room
        if capped and not self._capped:  # said once, until it fits again
            self.log.warning("agent.models_capped", announced=len(announced),
                             left_out=extra[room:room + 10], most=MAX_MODELS)
        self._capped = capped
        return sorted(self.static.union(extra[:room]))

    async def on_message(self, msg: Msg) -> None:
        """Fold one worker's announcement in; one that is not this node's, or names
        what no task can ask for (not a token), or too much, is logged and ignored."""
        try:
            ev = decode(msg.data, ModelsLoaded)
            problem = self._problem(ev)
        except (EventDecodeError, InvalidToken) as exc:
            problem = str(exc)
        if problem:
            self.log.warning("agent.bad_models_message", error=problem)
            return
        self._workers[ev.worker] = (list(ev.models), time.monotonic())

    def _problem(self, ev: ModelsLoaded) -> str:
        """What is wrong with ``ev`` for this node ("" if nothing); raises
        ``InvalidToken`` for a node, worker or model that is not a token."""
        if ev.cluster != self.cluster or subjects.node(ev.node) != self.node:
            return (f"worker {ev.worker!r} announces for {ev.cluster}/{ev.node}, not this "
                    f"agent's {self.cluster}/{self.node}")
        subjects.token(ev.worker, "worker")
        if len(ev.models) > MAX_MODELS:
            return f"worker {ev.worker!r} announces {len(ev.models)} models: at most {MAX_MODELS}"
        for m in ev.models:
            subjects.token(m, "model name")
        fresh = time.monotonic() - self.ttl
        if ev.worker not in self._workers and sum(
                t >= fresh for _, t in self._workers.values()) >= MAX_WORKERS:
            return f"worker {ev.worker!r}: {MAX_WORKERS} workers already announce on this node"
        return ""
