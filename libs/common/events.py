"""Every payload on the bus: msgspec Structs, JSON on the wire.

Rules (msgspec's schema-evolution guide): each event carries ``v``, its schema version;
new fields always get defaults; a field's type never changes; unknown fields are ignored
on decode, so old and new services coexist. A stream that carries several kinds uses a
tagged union (``TrainEvent``, ``CkptEvent``) decoded by one typed decoder.

One module by design, past 600 lines: it is the wire's one contract
(``tandem schema`` and docs/bus-api.md are generated from it), and splitting it would
only scatter the types every service decodes.
"""

from __future__ import annotations

import time
from enum import StrEnum
from functools import cache
from typing import Any, TypeVar

import msgspec

from tandem.common.errors import EventDecodeError
from tandem.common.subjects import token


class Event(msgspec.Struct, kw_only=True):
    """Base of every event. ``v`` is the schema version of the concrete type."""

    v: int = 1


E = TypeVar("E")

_encoder = msgspec.json.Encoder()


def encode(event: Any) -> bytes:
    return _encoder.encode(event)


@cache
def _decoder(event_type: Any) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(event_type)


def decode(data: bytes, event_type: type[E]) -> E:
    """Decode ``data`` as ``event_type`` or raise ``EventDecodeError`` with the reason."""
    try:
        return _decoder(event_type).decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        name = getattr(event_type, "__name__", str(event_type))
        raise EventDecodeError(name, str(exc), bytes(data[:1024])) from None


def now() -> float:
    return time.time()


def struct_replace(obj: E, **changes: Any) -> E:
    """A copy of the event ``obj`` with ``changes`` (KV compare-and-set updates)."""
    return msgspec.structs.replace(obj, **changes)  # type: ignore[type-var]


# ---------------------------------------------------------------------------- bus plumbing


class DeadLetter(Event, kw_only=True):
    """A message that was terminated: undecodable, invalid, or out of deliveries."""

    stream: str
    subject: str
    seq: int
    num_delivered: int
    reason: str
    data: bytes
    headers: dict[str, str] = {}
    consumer: str = ""
    at: float = msgspec.field(default_factory=now)


# ------------------------------------------------------------------------------ generation


class TaskState(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (TaskState.succeeded, TaskState.failed, TaskState.cancelled)


# The order in which a task's state may move; a terminal state never moves again.
TASK_ORDER = {
    TaskState.queued: 0,
    TaskState.running: 1,
    TaskState.succeeded: 2,
    TaskState.failed: 2,
    TaskState.cancelled: 2,
}


class GenerationTask(Event, kw_only=True):
    """One generation request, as enqueued on ``gen.<cluster>.<lane>``."""

    task_id: str
    model: str
    prompt: str | None = None
    negative_prompt: str | None = None
    class_label: int | None = None
    width: int = 32
    height: int = 32
    steps: int = 20
    guidance: float = 1.0
    seed: int = 0
    num_images: int = 1
    lane: str = "interactive"
    cluster: str = ""
    submitted_at: float = msgspec.field(default_factory=now)
    noop: bool = False  # a task of a no-op model (benchmarks): its call makes no images
    # The API key (its name) that submitted it, set by the door that checked the key;
    # empty for an open door. A bare publisher's claim is its own: deployments with keys
    # deny clients direct publishes on gen.* (docs/security.md).
    owner: str = ""

    def __post_init__(self) -> None:
        # Ids end up in subjects and S3 keys: reject anything but safe tokens at decode.
        token(self.task_id, "task id")
        token(self.model, "model")
        if self.cluster:
            token(self.cluster, "cluster")
        if self.owner:
            token(self.owner, "owner")

    def batch_key(self) -> tuple[Any, ...]:
        """Tasks with equal keys can share one pipeline call."""
        return (self.model, self.width, self.height, self.steps, self.guidance, self.noop)


class GenerationProgress(Event, kw_only=True):
    """Core NATS (not stored): one per denoising step."""

    task_id: str
    step: int
    total: int
    at: float = msgspec.field(default_factory=now)


class TaskRecord(Event, kw_only=True):
    """Value of KV ``tasks``: the one source of truth of a task, moved only forward by
    compare-and-set (``tasks.py``). Each write is also a message on
    ``$KV.tasks.<task>`` (``subjects.task_record``): the task's state changes, for
    services (a write the bucket refused is published there too: the stored record, read
    or watched, is the truth); clients hear each stored write on ``tasks.written.<task>``
    with headers only and read their own record through the job service. ``succeeded``
    carries the result (``images``, ``checkpoint``, ``timings``); ``failed`` and
    ``cancelled`` the ``reason``.
    """

    task: GenerationTask
    state: TaskState = TaskState.queued
    created_at: float = msgspec.field(default_factory=now)
    updated_at: float = msgspec.field(default_factory=now)
    started_at: float | None = None
    finished_at: float | None = None
    cluster: str = ""
    worker: str = ""
    progress: float = 0.0
    images: list[str] = []
    checkpoint: str = ""
    checkpoint_step: int | None = None
    reason: str = ""
    attempts: int = 0
    timings: dict[str, float] = {}  # succeeded: where the worker's time went, seconds
    # Deliveries whose worker process died while the task's pipeline call ran
    # (``tasks.to_crashed``), and those of them in a call of the task's own.
    crashes: int = 0
    crashes_alone: int = 0


class CancelNotice(Event, kw_only=True):
    """Value of KV ``cancels``, key ``<task>``: the gateway cancelled the task (its record
    says ``cancelled`` already). Every worker watches the bucket, so a queued task
    cancelled is never run and a running one stops at its next step, without a read of
    the record per task."""

    task_id: str
    reason: str = ""
    at: float = msgspec.field(default_factory=now)


class IdempotencyRecord(Event, kw_only=True):
    """Value of KV ``idempotency``: an ``Idempotency-Key`` (hashed) and the task it made.

    ``fingerprint`` hashes the request body, so the same key with a different request
    is refused instead of silently returning an unrelated task.
    """

    task_id: str
    fingerprint: str
    at: float = msgspec.field(default_factory=now)


class RateMark(Event, kw_only=True):
    """Value of KV ``rates``, key ``<API key name>``: the key's request rate, shared by
    every gateway replica (GCRA: ``tat`` is the theoretical arrival time, in Unix
    seconds, of the key's next request at its rate; one is let through while ``tat`` is
    less than a burst's worth of intervals ahead of now). Moved by compare-and-set, so
    requests through several replicas take from one budget."""

    tat: float


class SseHold(msgspec.Struct, kw_only=True):
    """One gateway replica's share of ``SseHolds``: its open streams of the key, counted
    until ``until`` (Unix seconds; the replica renews it while it holds any)."""

    count: int
    until: float


class SseHolds(Event, kw_only=True):
    """Value of KV ``sse``, key ``<API key name>``: the key's open event streams (SSE),
    each gateway replica's count under its own id, moved by compare-and-set, so a key's
    limit of open streams is the fleet's. A replica that stops renewing (killed) stops
    counting once its ``until`` has passed."""

    held: dict[str, SseHold] = msgspec.field(default_factory=dict)

    def open_streams(self, at: float, but: str = "") -> int:
        """Streams open at ``at`` by every replica but ``but``."""
        return sum(h.count for r, h in self.held.items() if r != but and h.until > at)


# ------------------------------------------------------------------------- fleet and health


class GpuSample(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One GPU at one instant. ``None`` means the GPU does not report that field."""

    index: int
    uuid: str = ""
    util: float | None = None  # percent
    mem_used: int | None = None  # bytes
    mem_total: int | None = None  # bytes
    temp: float | None = None  # degrees C
    power: float | None = None  # watts
    energy: float | None = None  # joules since driver load
    sm_clock: int | None = None  # MHz
    mem_clock: int | None = None  # MHz
    throttle: int | None = None  # clocks-event reasons bitmask
    ecc_volatile: int | None = None  # uncorrected, since boot
    ecc_aggregate: int | None = None  # uncorrected, lifetime
    ecc_corrected: int | None = None
    remap_correctable: int | None = None
    remap_uncorrectable: int | None = None
    remap_pending: bool | None = None
    remap_failure: bool | None = None
    pcie_replay: int | None = None
    nvlink_errors: int | None = None
    xids: list[int] = []  # XID events since the previous sample
    lost: bool = False  # fell off the bus


class NodeTelemetry(Event, kw_only=True):
    """One sample of every GPU of one node, on ``telemetry.<cluster>.<node>``."""

    cluster: str
    node: str
    gpus: list[GpuSample]
    at: float = msgspec.field(default_factory=now)
    seq: int = 0


class Health(StrEnum):
    healthy = "healthy"
    degraded = "degraded"
    unhealthy = "unhealthy"
    drained = "drained"


class HealthTransition(Event, kw_only=True):
    """A node's health changed, on ``health.<cluster>.<node>``, with the evidence."""

    cluster: str
    node: str
    previous: Health
    current: Health
    rule: str
    reason: str
    action: str = ""  # drain, reset, replace, or empty
    gpu: int | None = None
    evidence: dict[str, Any] = {}
    at: float = msgspec.field(default_factory=now)
    seq: int = 0
    active: list[str] = []  # rules active after the change ("rule" or "rule@gpu")
    # Hard rules ("rule@gpu") whose drain is done or was the operator's call (an undrain)
    # when this was published; what is active and not in it, a restarted agent still owes.
    # None from an agent older than this field: every active rule counts as handled.
    handled: list[str] | None = None


class NodeHeartbeat(Event, kw_only=True):
    """Value of KV ``nodes`` at ``<cluster>.<node>``; the bucket's TTL expires it."""

    cluster: str
    node: str
    health: Health = Health.healthy
    gpus_total: int = 0
    gpus_free: int = 0
    models: list[str] = []
    drained: bool = False
    drain_reason: str = ""
    at: float = msgspec.field(default_factory=now)
    gpus_usable: int = 0  # on the bus and not held by a GPU-level fault
    findings: list[str] = []  # active health rules, "rule" or "rule@gpu"
    gpus: list[GpuBrief] = []  # latest key metrics per GPU, for fleet views
    backend: str = ""  # "nvml" or "sim"
    interval: float = 0.0  # telemetry interval, seconds
    seq: int = 0  # heartbeat number since the agent started
    # The writing agent's instance id (host-pid-random); one instance per node: another
    # one's fresh heartbeat stops an agent from starting. "" from an older agent.
    instance: str = ""


class GpuBrief(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A GPU's key metrics in a heartbeat (the full sample is on ``telemetry.*``)."""

    index: int
    util: float | None = None
    mem_used: int | None = None
    mem_total: int | None = None
    temp: float | None = None
    power: float | None = None
    sm_clock: int | None = None
    lost: bool = False


class ModelsLoaded(Event, kw_only=True):
    """Core NATS on ``models.<cluster>.<node>``: what one worker on a node has loaded.

    Workers repeat it every few seconds; the node's agent folds the fresh ones into the
    heartbeat's ``models``.
    """

    cluster: str
    node: str
    worker: str
    models: list[str]
    at: float = msgspec.field(default_factory=now)


class DrainRecord(Event, kw_only=True):
    """Value of KV ``drains``: an operator's drain of a node, kept until undrained."""

    cluster: str
    node: str
    reason: str
    by: str = ""
    at: float = msgspec.field(default_factory=now)


# -------------------------------------------------------------------- training and checkpoints


class RunState(StrEnum):
    pending = "pending"
    starting = "starting"
    running = "running"
    restarting = "restarting"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (RunState.succeeded, RunState.failed, RunState.cancelled)


class TrainStatus(Event, kw_only=True, tag="status", tag_field="kind"):
    """A run's state changed, on ``train.<run>.status``."""

    run_id: str
    state: RunState
    reason: str = ""
    restarts: int = 0
    incident: dict[str, Any] | None = None
    at: float = msgspec.field(default_factory=now)


class TrainStep(Event, kw_only=True, tag="step", tag_field="kind"):
    """One optimizer step (or every k-th), on ``train.<run>.step``."""

    run_id: str
    step: int
    loss: float
    grad_norm: float = 0.0
    lr: float = 0.0
    samples_per_s: float = 0.0
    step_time: float = 0.0  # seconds, slowest rank
    rank_step_times: list[float] = []  # seconds, index = rank
    rank_nodes: list[str] = []  # node of each rank
    attempt: int = 0  # restart cycle the step belongs to
    # the lineage whose history the step is in: a rollback trains the same step numbers
    # again in a new lineage (tandem.common.checkpoints.lineage)
    lineage: int = 0
    at: float = msgspec.field(default_factory=now)


class FileEntry(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One file of a checkpoint's manifest: its size and checksum, ``crc32`` (S3's CRC32
    of the whole file, 8 lowercase hex digits) or, in manifests written before 2026-12-05,
    ``sha256`` (64 lowercase hex digits)."""

    name: str  # relative to the checkpoint directory, '/'-separated
    size: int
    crc32: str = ""  # S3's CRC32 of the whole file, 8 hex digits: what manifests record
    sha256: str = ""  # 64 hex digits: what manifests written before 2026-12-05 record


class CheckpointManifest(msgspec.Struct, kw_only=True):
    """``manifest.json`` of a checkpoint: uploading it to S3 is the commit."""

    run_id: str
    step: int
    files: list[FileEntry]
    created_at: float = msgspec.field(default_factory=now)
    format: int = 1
    kind: str = "full"  # "full": one writer; "sharded": DCP shards of world_size ranks
    world_size: int = 0  # sharded: how many ranks wrote it (a restore may use others)
    part: str = ""  # sharded: the node this is one share of; "" for a whole checkpoint
    lineage: int = 0  # the history it belongs to; > 0 is named step-<N>-l<lineage>


class CheckpointWritten(Event, kw_only=True, tag="checkpoint", tag_field="kind"):
    """A checkpoint (or, sharded over several nodes, one node's part of it: ``manifest``'s
    ``part``) is whole on ``node``'s disk. The coordinator publishes it twice: on
    ``train.<run>.checkpoint``, the run's history, and on ``mirror.<cluster>.<node>``, the
    order to that node's checkpointer."""

    run_id: str
    step: int
    path: str  # local directory (``.../step-N``), already renamed from ``.incomplete``
    manifest: CheckpointManifest
    blocked_s: float = 0.0  # how long training was blocked (copy to CPU)
    write_s: float = 0.0  # background write time
    node: str = ""
    cluster: str = ""
    at: float = msgspec.field(default_factory=now)
    # The restart cycle that wrote it: the parts of one sharded checkpoint are merged
    # only within one attempt, never a node's part of an earlier, abandoned write.
    attempt: int = 0


TrainEvent = TrainStatus | TrainStep | CheckpointWritten


class CheckpointMirrored(Event, kw_only=True, tag="mirrored", tag_field="kind"):
    """A checkpoint is committed in S3 (its manifest stored), on ``ckpt.<run>.mirrored``."""

    run_id: str
    step: int
    uri: str  # s3://bucket/runs/<run>/checkpoints/step-<N>[-l<lineage>]/
    bytes: int = 0
    seconds: float = 0.0  # written -> committed
    lineage: int = 0  # with ``step``, which checkpoint (a rollback reuses step numbers)
    at: float = msgspec.field(default_factory=now)


class CheckpointFailed(Event, kw_only=True, tag="failed", tag_field="kind"):
    run_id: str
    step: int
    reason: str
    attempts: int = 0
    lineage: int = 0
    at: float = msgspec.field(default_factory=now)


class CheckpointPruned(Event, kw_only=True, tag="pruned", tag_field="kind"):
    run_id: str
    steps: list[int]
    reason: str = ""
    names: list[str] = []  # the checkpoints' names (step-<N>[-l<lineage>]), as ``steps``
    at: float = msgspec.field(default_factory=now)


class CheckpointPartMirrored(Event, kw_only=True, tag="part", tag_field="kind"):
    """One node's part of a sharded checkpoint is in S3 and verified, on
    ``ckpt.<run>.part``: not a commit. ``lacks`` says what the checkpoint still needs
    (the parts of other nodes); empty when this part completed it, in which case
    ``ckpt.<run>.mirrored`` follows."""

    run_id: str
    step: int
    node: str
    attempt: int = 0
    files: int = 0
    bytes: int = 0
    lacks: list[str] = []
    lineage: int = 0  # with ``step``, which checkpoint (a rollback reuses step numbers)
    at: float = msgspec.field(default_factory=now)


CkptEvent = CheckpointMirrored | CheckpointFailed | CheckpointPruned | CheckpointPartMirrored


class RunRecord(Event, kw_only=True):
    """Value of KV ``runs``: a run's config, state and latest committed checkpoint."""

    run_id: str
    config: dict[str, Any] = {}
    state: RunState = RunState.pending
    restarts: int = 0
    latest_step: int = 0
    latest_checkpoint_step: int | None = None  # newest committed in S3 of the current lineage
    latest_checkpoint_uri: str = ""
    latest_checkpoint_lineage: int = 0  # with latest_checkpoint_step, which checkpoint
    # Each failure (kind, attempt, step, detector, ...), the newest 32, long fields cut:
    # the record must fit max_payload (the trainer's supervisor says how).
    incidents: list[dict[str, Any]] = []
    goodput: dict[str, float] = {}
    nodes: list[str] = []
    created_at: float = msgspec.field(default_factory=now)
    updated_at: float = msgspec.field(default_factory=now)
    coordinator: str = ""  # "<cluster>.<node>" of the trainer coordinator that owns the run
    stragglers: list[dict[str, Any]] = []  # ranks flagged slow (score, node, telemetry), newest 20
    skipped: list[list[int]] = []  # data windows [first, last] skipped after loss anomalies
    corrupt_checkpoints: list[dict[str, Any]] = []  # skipped as they failed verification, newest 20
    # Checkpoints a rank could not write (a full disk), the newest 20: step, rank, node,
    # error, attempt, the newest written before it. Training went on past each.
    checkpoint_failures: list[dict[str, Any]] = []
    ranks: list[dict[str, Any]] = []  # current attempt: rank, pid, node of each rank
    # The newest attempt launched, written as it starts (before any rank says hello): a
    # coordinator that adopts the run starts the next one, never one a node still runs.
    attempt: int = 0
    owner: str = ""  # the API key (its name) that submitted the run; empty: an open door
    # A client asked to stop the run, and why: its coordinator stops the ranks and ends
    # the run ``cancelled`` (a run not yet claimed is cancelled at once).
    cancel: str = ""
    # One step per rollback: lineage i+1 forked from lineage i's history at forks[i]
    # (``tandem.common.checkpoints.Lineage``); the current lineage is len(forks).
    forks: list[int] = []


# --------------------------------------------------------------- trainer coordinator <-> nodes


class NodeLaunch(Event, kw_only=True, tag="launch", tag_field="kind"):
    """Coordinator → one node's trainer agent: run torchrun for this node of an attempt.

    ``master_port`` 0 asks the agent (then node rank 0) to pick the rendezvous port on its
    own address and say it in its reply; the other nodes are told node 0's address/port.
    ``spec`` is the attempt's ``LaunchSpec`` (``tandem.trainer.spec``) as JSON builtins:
    both ends are the trainer's, and the agent rebases its paths onto its own disk.
    """

    run_id: str
    attempt: int
    node: str
    node_rank: int
    nnodes: int
    per_node: int
    master_addr: str = ""
    master_port: int = 0
    spec: dict[str, Any] = {}
    report_every_s: float = 1.0  # how often the agent reports while the ranks run


class NodeStop(Event, kw_only=True, tag="stop", tag_field="kind"):
    """Coordinator → a node's agent: kill this attempt's ranks and torchrun (SIGKILL)."""

    run_id: str
    attempt: int
    reason: str = ""


class NodeInterrupt(Event, kw_only=True, tag="interrupt", tag_field="kind"):
    """Coordinator → a node's agent: let this attempt's ranks checkpoint and stop, as the
    agent's own stop does (SIGTERM to torchrun, passed on to the ranks; SIGKILL past its
    ``stop_bound``). Answered at once; torchrun's exit is reported (``NodeReport``) when
    it comes.

    A tag of its own rather than a field on ``NodeStop``: an agent older than this order
    would ignore an unknown field and kill the ranks while answering ``ok``, whereas an
    unknown ``kind`` it refuses (``ok`` False, "bad order"), and the coordinator, told so,
    stops the ranks outright (``NodeStop``).
    """

    run_id: str
    attempt: int
    reason: str = ""


NodeOrder = NodeLaunch | NodeStop | NodeInterrupt


class NodeReply(Event, kw_only=True):
    """A node agent's answer to an order. ``ok`` False: refused (``error`` says why)."""

    node: str
    ok: bool = True
    error: str = ""
    master_addr: str = ""  # a launch: the rendezvous it used (chosen by node rank 0)
    master_port: int = 0
    pid: int = 0  # the torchrun agent's pid
    exit_code: int | None = None  # a stop: torchrun's exit code; None if it held nothing
    log_path: str = ""  # where this node's torchrun output goes (on the node)


class NodeReport(Event, kw_only=True):
    """A node agent → the run's coordinator, on ``trainer.report.<cluster>.<run>``: every
    ``report_every_s`` while torchrun runs (liveness) and once when it exits."""

    run_id: str
    attempt: int
    node: str
    running: bool = True
    exit_code: int | None = None  # set once torchrun exited
    pid: int = 0
    at: float = msgspec.field(default_factory=now)


class NodeReportReply(Event, kw_only=True):
    """The coordinator's answer to a report: ``keep`` False tells the agent its attempt
    is no longer the run's (a stop it missed, a newer attempt), so it kills the ranks."""

    keep: bool = True
