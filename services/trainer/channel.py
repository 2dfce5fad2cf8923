"""Rank → coordinator messages: JSON lines over one TCP connection per rank (no torch).

Every message is a msgspec Struct of the tagged union ``RankMessage``; ``kind`` names it
on the wire (``{"kind": "step", ...}``). The rank sends them in this order::

    hello                                   every rank, once connected
    resumed                                 rank 0, when the nodes fetched a checkpoint
    step / checkpoint / checkpoint_failed   rank 0, while training
    anomaly                                 rank 0, instead of the step that ended in it
    preempted                               every rank, once the ranks agreed to stop
                                            (SIGTERM); its checkpoint and step follow
    invalid                                 any rank whose config cannot build or train
    done                                    rank 0, after the last step
    bye                                     every rank, just before it closes

The coordinator decodes each line with one typed decoder (``decode``) and dispatches on
the type (``supervisor``/``watch``); a line that does not decode raises
``EventDecodeError`` with the reason, never a half-read dict.

Rank and coordinator come from the same install (the coordinator launches the ranks),
so the union is not versioned like bus events; fields the reader does not know are still
ignored, as for every Tandem payload. ``checkpoint`` reuses the bus event
``CheckpointWritten`` (the coordinator only completes ``run_id`` and ``cluster`` before
publishing it); ``step`` is not ``TrainStep``: the rank reports what only it knows
(``data_pos``, ``blocked_s``) and the coordinator adds the run and the attempt.

The training step only enqueues; a background thread writes to the socket, so a slow
coordinator never stalls a step. Losing the coordinator means nobody supervises the
rank any more, so the rank exits (``ORPHANED``) rather than train unobserved.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import time
from typing import Any

import msgspec

from tandem.common.errors import EventDecodeError
from tandem.common.events import CheckpointWritten

ORPHANED = 17  # exit code of a rank whose coordinator went away
# The longest line the coordinator reads (``watch.listen``). The largest legal message is
# a StepReport of RunConfig's most ranks (1024), each with its step time and node name (a
# token of up to 64 characters): about 95 KB; a sharded checkpoint's manifest lists a
# file per rank. Past this a line ends the rank's connection, as a broken one does.
LINE_LIMIT = 4 * 1024 * 1024
ERROR_CHARS = 4000  # the longest error an ``Invalid`` carries (the run's record cuts it again)
_STOP = object()


class _Message(msgspec.Struct, kw_only=True, tag_field="kind"):
    """Base of the rank's own messages; ``kind`` is the tag (``CheckpointWritten``'s too)."""


class Hello(_Message, tag="hello"):
    """Every rank, first thing after connecting: who it is. The coordinator learns the
    pid (for stack dumps and kills) and, once every rank said hello, records the ranks in
    KV ``runs``. Its ``attempt`` tells messages of a dying earlier attempt apart."""

    rank: int  # global rank
    pid: int
    node: str  # the node the rank runs on
    attempt: int  # the restart cycle that launched the rank (``LaunchSpec.attempt``)
    world: int  # world size


class Resumed(_Message, tag="resumed"):
    """Rank 0, once every node has fetched the checkpoint this attempt resumes from out of
    S3 (``LaunchSpec.resume_steps``, ``fetch.py``): which step, and the newer committed
    ones skipped because a node found them corrupt (by step: each node's reason)."""

    step: int  # 0: none of the committed steps verified on every node; from scratch
    skipped: dict[int, str] = {}


class StepReport(_Message, tag="step"):
    """Rank 0, after every optimizer step that was applied. The coordinator feeds the
    hang watch, goodput, stragglers and metrics, and publishes every
    ``step_event_every``-th as ``TrainStep``."""

    step: int  # steps done, this one included
    data_pos: int  # position in the data order of the batch this step used
    loss: float | None  # mean over ranks; None when not finite (JSON has no NaN)
    grad_norm: float | None  # after clipping; None when not finite
    lr: float
    step_time: float  # seconds, wall time of the step on rank 0
    samples_per_s: float  # over every rank
    rank_step_times: list[float]  # seconds of local compute, index = rank
    rank_nodes: list[str]  # node of each rank
    blocked_s: float = 0.0  # seconds this step was blocked taking a checkpoint snapshot
    at: float = msgspec.field(default_factory=time.time)  # when the rank sent it


class CheckpointWriteFailed(_Message, tag="checkpoint_failed"):
    """A rank's background checkpoint write failed (rank 0's; sharded, any rank's) and
    what it wrote of the step is removed; training goes on and the coordinator reports
    it (status event, KV ``checkpoint_failures``, a counter): the next checkpoint may
    succeed, and a resume uses the newest whole one."""

    step: int
    error: str  # repr of the exception


class Anomaly(_Message, tag="anomaly"):
    """Rank 0: the loss or grad norm of a step is NaN/inf or a spike, so every rank
    stopped before applying the update. The coordinator restarts the run from the newest
    checkpoint, skipping the data window that ends at ``data_pos``."""

    step: int  # the step that was not applied
    data_pos: int  # position in the data order of the bad batch
    anomaly: str  # "nonfinite" or "spike"
    loss: float | str  # a non-finite number is sent as its name ("nan", "inf")
    grad_norm: float | str
    evidence: dict[str, Any] = {}  # what the loss health check saw (z-score, median, ...)


class Preempted(_Message, tag="preempted"):
    """Every rank, as soon as the ranks agreed to stop at ``step`` because one of them was
    told to (SIGTERM: its node agent or torchrun stopping; ``rank.StopRequest``). Each
    then checkpoints ``step`` as a periodic checkpoint is (its ``checkpoint`` follows, or
    ``checkpoint_failed``), waits until every node's writes ended, says goodbye and exits
    ``rank.PREEMPTED``. The coordinator restarts the run from that checkpoint, and the
    restart is not the run's failure (not counted against ``max_restarts``)."""

    rank: int
    node: str  # the node the rank runs on
    step: int  # the step every rank checkpoints and stops after
    signalled: bool  # this rank itself got the SIGTERM: its node is the one stopping


class Invalid(_Message, tag="invalid"):
    """A rank whose run cannot be built or trained as configured: building its data or
    model, loading the resume checkpoint or its attempt's first step raised (a data set
    that cannot be read, a shape the model refuses). Sent before it exits
    (``rank.INVALID``); the coordinator ends the run ``failed`` at once with an incident
    ``invalid_config`` and this reason, not restarting an attempt that would fail alike."""

    rank: int
    error: str  # the exception, its type and text (cut to ``ERROR_CHARS``)


class Done(_Message, tag="done"):
    """Rank 0: every step is trained and the last checkpoint written; the run succeeds
    once the agents exit 0."""

    step: int


class Bye(_Message, tag="bye"):
    """Every rank, last message before closing: the close that follows is not a death."""

    rank: int
    code: int  # the exit code the rank is about to return


RankMessage = (Hello | Resumed | StepReport | CheckpointWritten | CheckpointWriteFailed
               | Anomaly | Preempted | Invalid | Done | Bye)

_decoder = msgspec.json.Decoder(RankMessage)


def decode(line: bytes) -> RankMessage:
    """One line from a rank as its message; ``EventDecodeError`` (with msgspec's reason,
    e.g. an unknown ``kind`` or a field of the wrong type) when it is not one."""
    try:
        return _decoder.decode(line)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise EventDecodeError("rank message", str(exc), bytes(line[:1024])) from None


class EventChannel:
    """A non-blocking sender of rank messages; ``None`` address makes it a no-op."""

    def __init__(self, address: str | None, *, exit_on_loss: bool = True) -> None:
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._enc = msgspec.json.Encoder()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self.exit_on_loss = exit_on_loss
        if address:
            host, _, port = address.rpartition(":")
            self._sock = socket.create_connection((host, int(port)), timeout=30)
            self._sock.settimeout(None)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._thread = threading.Thread(target=self._pump, name="tandem-events", daemon=True)
            self._thread.start()

    def send(self, message: RankMessage, /) -> None:
        if self._sock is not None:
            self._q.put(message)

    def _pump(self) -> None:
        assert self._sock is not None
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            try:
                self._sock.sendall(self._enc.encode(item) + b"\n")
            except OSError as exc:
                if self.exit_on_loss:
                    print(f"tandem rank: coordinator connection lost ({exc}); exiting",
                          file=sys.stderr, flush=True)
                    os._exit(ORPHANED)
                return

    def close(self, timeout: float = 10.0) -> None:
        """Flush what is queued, then close."""
        if self._sock is None or self._thread is None:
            return
        self._q.put(_STOP)
        self._thread.join(timeout)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._sock = None
