"""Streams, KV buckets and consumers: declared once, as data, provisioned idempotently.

``provision`` creates what is missing and compares what exists field by field. A
difference is reported as ``StreamConflict`` naming the object and the field; nothing
existing is ever deleted or purged by a starting service, and a bucket is updated only to
gain what leaves its data as it is (direct reads, the announcement of its writes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    KeyValueConfig,
    RePublish,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import NotFoundError

from tandem.common import log, subjects
from tandem.common.errors import Difference, StreamConflict

HOUR = 3600.0
DAY = 24 * HOUR


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    retention: RetentionPolicy = RetentionPolicy.LIMITS
    max_age: float = 0.0  # seconds; 0 keeps forever
    max_bytes: int = -1
    replicas: int = 1
    duplicate_window: float = 120.0
    storage: StorageType = StorageType.FILE
    discard: DiscardPolicy = DiscardPolicy.OLD

    @property
    def dedupe_window(self) -> float:
        """The server refuses a duplicate window longer than max_age."""
        return min(self.duplicate_window, self.max_age) if self.max_age else self.duplicate_window

    def config(self) -> StreamConfig:
        return StreamConfig(
            name=self.name,
            subjects=list(self.subjects),
            retention=self.retention,
            max_age=self.max_age,
            max_bytes=self.max_bytes,
            num_replicas=self.replicas,
            duplicate_window=self.dedupe_window,
            storage=self.storage,
            discard=self.discard,
        )


@dataclass(frozen=True)
class KVSpec:
    bucket: str
    ttl: float = 0.0  # seconds; a key not rewritten within ttl disappears
    history: int = 1
    replicas: int = 1
    # Each stored write republished by the server to this subject filter, headers only
    # (e.g. ``tasks.written.>``): who may not read the values still hears that one changed.
    announce: str = ""
    # Whether provisioning may bring an existing bucket's config up to this spec. False
    # for a NATS role the server would refuse (``permissions.provisionable``): the
    # difference is logged for the bucket's owner to mend, not asked for.
    update: bool = field(default=True, compare=False)

    def republish(self) -> RePublish | None:
        if not self.announce:
            return None
        return RePublish(src=f"$KV.{self.bucket}.>", dest=self.announce, headers_only=True)

    def config(self) -> KeyValueConfig:
        return KeyValueConfig(
            bucket=self.bucket, ttl=self.ttl or None, history=self.history,
            replicas=self.replicas, storage=StorageType.FILE,
            direct=True,  # reads by direct get: no JSON, no base64, any replica answers
            republish=self.republish(),
        )


@dataclass(frozen=True)
class ConsumerSpec:
    stream: str
    durable: str
    filter_subjects: tuple[str, ...] = ()
    ack_wait: float = 30.0
    max_deliver: int = 5
    max_ack_pending: int = 1000
    backoff: tuple[float, ...] = field(default=())

    def config(self) -> ConsumerConfig:
        cfg = ConsumerConfig(
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait,
            max_deliver=self.max_deliver,
            max_ack_pending=self.max_ack_pending,
            backoff=list(self.backoff) or None,
        )
        if len(self.filter_subjects) == 1:
            cfg.filter_subject = self.filter_subjects[0]
        elif self.filter_subjects:
            cfg.filter_subjects = list(self.filter_subjects)
        return cfg


Spec = StreamSpec | KVSpec | ConsumerSpec


# ------------------------------------------------------------------------------ the catalog
# Every stream and bucket Tandem uses. Functions of (replicas, clusters) so the same
# declaration serves R1 locally and R3 in production.

DLQ = "DLQ"
TELEMETRY = "TELEMETRY"
HEALTH = "HEALTH"
TRAIN = "TRAIN"
CKPT = "CKPT"
MIRROR = "MIRROR"
KV_NODES = "nodes"
KV_TASKS = "tasks"  # subjects.TASK_RECORD is its keys' subject
KV_CANCELS = "cancels"
KV_RUNS = "runs"
KV_DRAINS = "drains"
KV_IDEMPOTENCY = "idempotency"
KV_RATES = "rates"  # each API key's request rate, shared by the gateway replicas
KV_SSE = "sse"  # each API key's open event streams, counted by the gateway replicas

# KV nodes' TTL: how long a dead agent's heartbeat stays. The one truth for it: every
# service provisions the bucket with it (``provision`` refuses a bucket that differs:
# StreamConflict, so no service may declare another), and a reader's own freshness (a
# gateway's TANDEM_HEARTBEAT_TTL) may be shorter, never longer: past it the entry is gone.
HEARTBEAT_TTL = 6.0
# A GEN_<C> stream stores one message per task id this long: it covers the gateway's
# publish retries, and bounds how long a task's seal is trusted (``tasks.as_sealed``).
GEN_DEDUPE_WINDOW = 10 * 60.0


def gen_stream(cluster: str, replicas: int = 1) -> StreamSpec:
    return StreamSpec(
        name=subjects.gen_stream_name(cluster),
        subjects=(subjects.gen_cluster_filter(cluster),),
        retention=RetentionPolicy.WORK_QUEUE,
        replicas=replicas,
        duplicate_window=GEN_DEDUPE_WINDOW,
    )


def gen_consumer(cluster: str, ack_wait: float = 30.0, max_deliver: int = 5,
                 lane: str | None = None) -> ConsumerSpec:
    """A durable pull consumer of a cluster's work queue, shared by its workers.

    Without ``lane`` it takes the whole queue; with a lane, only that lane's subject
    (``workers-<cluster>-<lane>``). A work-queue stream allows only non-overlapping
    consumers, so a deployment uses one form or the other: ``cluster_streams`` and the
    inference worker use the per-lane pair (``gen_consumers``), which is what lets a
    worker take the interactive lane before the batch lane.
    """
    if lane is None:
        return ConsumerSpec(
            stream=subjects.gen_stream_name(cluster),
            durable=f"workers-{subjects.token(cluster, 'cluster')}",
            ack_wait=ack_wait,
            max_deliver=max_deliver,
        )
    return ConsumerSpec(
        stream=subjects.gen_stream_name(cluster),
        durable=f"workers-{subjects.token(cluster, 'cluster')}-{subjects.lane(lane)}",
        filter_subjects=(subjects.gen(cluster, lane),),
        ack_wait=ack_wait,
        max_deliver=max_deliver,
    )


def gen_consumers(cluster: str, ack_wait: float = 30.0,
                  max_deliver: int = 5) -> list[ConsumerSpec]:
    """The per-lane consumers of a cluster's work queue, in priority order."""
    return [gen_consumer(cluster, ack_wait, max_deliver, lane=ln) for ln in subjects.LANES]


def core_streams(replicas: int = 1) -> list[Spec]:
    """Streams and buckets every deployment has, whatever its clusters."""
    return [
        StreamSpec(DLQ, (subjects.DLQ.wildcard,), max_age=14 * DAY, replicas=replicas),
        StreamSpec(TELEMETRY, ("telemetry.*.*",), max_age=15 * 60.0, replicas=replicas,
                   storage=StorageType.FILE),
        StreamSpec(HEALTH, ("health.*.*",), max_age=90 * DAY, replicas=replicas),
        StreamSpec(TRAIN, ("train.*.*",), max_age=90 * DAY, replicas=replicas),
        StreamSpec(CKPT, ("ckpt.*.*",), max_age=365 * DAY, replicas=replicas),
        # Each node's checkpoints for that node's checkpointer: a work queue (an order is
        # gone once mirrored); a week bounds what waits for a node that never returns.
        StreamSpec(MIRROR, (subjects.MIRROR.wildcard,), retention=RetentionPolicy.WORK_QUEUE,
                   max_age=7 * DAY, replicas=replicas),
        KVSpec(KV_NODES, ttl=HEARTBEAT_TTL, replicas=replicas),
        # A task's one record: its state, moved forward by compare-and-set, its result.
        KVSpec(KV_TASKS, ttl=DAY, history=1, replicas=replicas,
               announce=subjects.TASKS_WRITTEN),
        # The gateway's notice that it cancelled a task, watched by every worker.
        KVSpec(KV_CANCELS, ttl=DAY, replicas=replicas),
        KVSpec(KV_IDEMPOTENCY, ttl=DAY, replicas=replicas),
        # A key quiet for a day has a full bucket again, whether or not its mark is there.
        KVSpec(KV_RATES, ttl=DAY, history=1, replicas=replicas),
        # Each replica's count of a key's open streams lapses on its own (``SseHolds``);
        # a day bounds what a key whose streams all closed leaves behind.
        KVSpec(KV_SSE, ttl=DAY, history=1, replicas=replicas),
        KVSpec(KV_RUNS, replicas=replicas),
        KVSpec(KV_DRAINS, replicas=replicas),
    ]


def checkpointer_consumer(ack_wait: float = 60.0, max_deliver: int = 20, *,
                          cluster: str | None = None, node: str | None = None) -> ConsumerSpec:
    """A checkpointer's durable consumer on ``MIRROR``: with ``cluster`` and ``node``, only
    the checkpoints written on that node (``checkpointer-<cluster>-<node>``: one
    checkpointer per node, each seeing only its own disk); without, every node's
    (``checkpointer``: one checkpointer that sees every node's folder, as on one box or a
    shared volume). ``MIRROR`` is a work queue, whose consumers may not overlap: the
    server refuses a per-node consumer beside the fleet-wide one (and two nodes whose
    names join to the same durable), so a deployment uses one form or the other.

    A mirror can take minutes; the handler sends in-progress acks, so ``ack_wait``
    bounds only how long a crashed checkpointer holds one.
    """
    if (cluster is None) != (node is None):
        raise ValueError("a per-node checkpointer consumer needs both cluster and node")
    if cluster is None or node is None:
        durable, only = "checkpointer", subjects.MIRROR.wildcard
    else:
        only = subjects.mirror(cluster, node)  # validates both tokens
        durable = f"checkpointer-{cluster}-{node}"
    return ConsumerSpec(stream=MIRROR, durable=durable, filter_subjects=(only,),
                        ack_wait=ack_wait, max_deliver=max_deliver)


def trainer_consumer(cluster: str) -> ConsumerSpec:
    """A cluster's trainer coordinators: run status events, to claim pending runs.

    One durable per cluster, shared by that cluster's coordinators; which one runs a
    run is settled by compare-and-set on the run's KV record, not by delivery.
    """
    return ConsumerSpec(
        stream=TRAIN,
        durable=f"trainer-{subjects.token(cluster, 'cluster')}",
        filter_subjects=(subjects.train_kind_filter("status"),),
        ack_wait=30.0,
        max_deliver=10,
    )


def cluster_streams(clusters: Iterable[str], replicas: int = 1) -> list[Spec]:
    out: list[Spec] = []
    for c in clusters:
        out += [gen_stream(c, replicas), *gen_consumers(c)]
    return out


# ----------------------------------------------------------------------------- provisioning


def _diff(kind: str, name: str, pairs: Iterable[tuple[str, object, object]]) -> None:
    diffs = [Difference(f, have, want) for f, have, want in pairs if have != want]
    if diffs:
        raise StreamConflict(kind, name, diffs)


async def _stream(js: JetStreamContext, spec: StreamSpec) -> bool:
    try:
        info = await js.stream_info(spec.name)
    except NotFoundError:
        await js.add_stream(spec.config())
        return True
    have = info.config
    _diff("stream", spec.name, [
        ("subjects", sorted(have.subjects or []), sorted(spec.subjects)),
        ("retention", have.retention, spec.retention),
        ("storage", have.storage, spec.storage),
        ("max_age", float(have.max_age or 0), float(spec.max_age)),
        ("num_replicas", have.num_replicas, spec.replicas),
        ("duplicate_window", float(have.duplicate_window or 0), float(spec.dedupe_window)),
    ])
    return False


async def _kv(js: JetStreamContext, spec: KVSpec) -> bool:
    try:
        info = await js.stream_info(f"KV_{spec.bucket}")
    except NotFoundError:
        await js.create_key_value(spec.config())
        return True
    have = info.config
    _diff("kv bucket", spec.bucket, [
        ("ttl", float(have.max_age or 0), float(spec.ttl)),
        ("history", have.max_msgs_per_subject, spec.history),
        ("replicas", have.num_replicas, spec.replicas),
    ])
    republish = spec.republish()
    if not have.allow_direct or have.republish != republish:
        # A bucket made before reads went direct, or before its writes were announced:
        # neither changes data, and until the update reads still work (STREAM.MSG.GET)
        # and only who follows the announcements waits for it, so a refusal is only
        # logged. A role that may not update it leaves it to one that may (the bucket's
        # owner, or admin) without asking: a refused request costs a timeout.
        if not spec.update:
            log.get("tandem.streams").info("streams.kv_update_left", bucket=spec.bucket,
                                           allow_direct=have.allow_direct,
                                           republish=repr(have.republish))
            return False
        have.allow_direct, have.republish = True, republish
        try:
            await js.update_stream(have)
        except Exception as exc:
            log.get("tandem.streams").warning("streams.kv_update_refused",
                                              bucket=spec.bucket, error=repr(exc))
    return False


async def _consumer(js: JetStreamContext, spec: ConsumerSpec) -> bool:
    try:
        info = await js.consumer_info(spec.stream, spec.durable)
    except NotFoundError:
        await js.add_consumer(spec.stream, spec.config())
        return True
    have = info.config
    filters = sorted(have.filter_subjects or ([have.filter_subject] if have.filter_subject else []))
    _diff("consumer", f"{spec.stream}/{spec.durable}", [
        ("filter_subjects", filters, sorted(spec.filter_subjects)),
        ("ack_wait", float(have.ack_wait or 0), float(spec.ack_wait)),
        ("max_deliver", have.max_deliver, spec.max_deliver),
        ("max_ack_pending", have.max_ack_pending, spec.max_ack_pending),
    ])
    return False


async def provision(js: JetStreamContext, specs: Sequence[Spec]) -> list[str]:
    """Create every missing object in ``specs``; return the names created.

    Raises ``StreamConflict`` for the first object whose existing config differs.
    Streams are provisioned before the consumers that bind to them.
    """
    created: list[str] = []
    ordered = [s for s in specs if not isinstance(s, ConsumerSpec)] + [
        s for s in specs if isinstance(s, ConsumerSpec)
    ]
    for spec in ordered:
        if isinstance(spec, StreamSpec):
            made, name = await _stream(js, spec), spec.name
        elif isinstance(spec, KVSpec):
            made, name = await _kv(js, spec), f"KV_{spec.bucket}"
        else:
            made, name = await _consumer(js, spec), f"{spec.stream}/{spec.durable}"
        if made:
            created.append(name)
    return created
