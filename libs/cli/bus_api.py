"""``docs/bus-api.md``'s generated blocks: subjects, streams, consumers, headers, schemas.

The doc is hand-written prose with generated blocks between marker comments::

    <!-- generated: subjects -->
    ...
    <!-- end generated -->

``rewrite(text)`` replaces each block's body with ``BLOCKS[name]()``; ``tandem schema
--write-docs`` writes the result, ``--check`` (and ``tests/test_bus_api.py``) fail when
the file differs from it. Every table is read from the declarations themselves:
subjects from ``subjects``, streams, buckets and consumers from ``streams``, who
publishes and who reads from ``permissions``, the ack policy from ``bus.acks``'s table,
payload schemas from ``wire_types.WIRE_TYPES``. What is written here is only what the
declarations cannot say: which payload a subject carries and one line on what it is for.

Per-cluster names are computed for one cluster named ``_cluster_`` and shown as
``<cluster>`` (``GEN__CLUSTER_`` as ``GEN_<CLUSTER>``).
"""

from __future__ import annotations

import itertools
import json
import re
import string
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tandem.cli import wire_types
from tandem.common import permissions, streams, subjects
from tandem.common import tasks as moves
from tandem.common.bus import acks, headers
from tandem.common.streams import ConsumerSpec, KVSpec, StreamSpec
from tandem.common.subjects import Subject

CLUSTER = "_cluster_"  # the stand-in cluster the per-cluster declarations are made for
NODE = "_node_"  # and node, for the per-node ones
DOC = "docs/bus-api.md"
REGENERATE = "tandem schema --write-docs"


@dataclass(frozen=True)
class Route:
    """One subject as a client meets it (for TRAIN and CKPT, one kind of it)."""

    subject: Subject
    payload: str | None  # a ``WIRE_TYPES`` name; None: the body is empty
    builder: str  # the ``subjects`` function that builds it, as called
    client: str  # what a client does with it: publish, subscribe, or "" (internal)
    what: str
    kind: str | None = None  # the ``{kind}`` token, for subjects that have one

    @property
    def form(self) -> str:
        """The subject as the doc writes it: ``train.<run>.status``."""
        t = self.subject.template
        if self.kind is not None:
            t = t.replace("{kind}", self.kind)
        return re.sub(r"\{(\w+)\}", r"<\1>", t)


ROUTES: list[Route] = [
    Route(subjects.GEN, "GenerationTask", "gen(cluster, lane)", "publish",
          "submit a generation; `Nats-Msg-Id` = `task_id`"),
    Route(subjects.TASK_RECORD, "TaskRecord", "task_record(task)", "",
          "each write of a task's record, its one source of truth (services only: every "
          "tenant's whole record): queued, running (once it has run a while), then "
          "succeeded with the images, failed or cancelled with the reason. A write the "
          "bucket refused (a compare-and-set that lost, made again from a fresh read) is "
          "published here too: a wake-up to read the stored record, or watch the bucket, "
          "which delivers stored writes only"),
    Route(subjects.TASK_WRITTEN, None, "task_written(task)", "subscribe",
          "each stored write of a task's record, announced by the server with headers "
          "only (`Nats-Sequence`, `KV-Operation` on a delete), never the record: what a "
          "program with the `client` NATS user follows (the job service's "
          "`record_subject`), then reads its record with `tandem.jobs.status`, which "
          "checks its owner. The record itself (`$KV.tasks.<task>`) is every tenant's, "
          "for services only"),
    Route(subjects.GEN_PROGRESS, "GenerationProgress", "gen_progress(task)", "subscribe",
          "one per denoising step while the task runs"),
    *(Route(subjects.TRAIN, name, f'train(run, "{kind}")', "subscribe", what, kind)
      for kind, name, what in [
          ("status", "TrainStatus", "a run's state: pending (submitted), running, "
           "restarting, succeeded, failed, cancelled"),
          ("step", "TrainStep", "loss, grad norm, lr, throughput, per-rank step times"),
          ("checkpoint", "CheckpointWritten", "a checkpoint (or a node's part of one) is "
           "whole on a node's disk: the run's history (that node's checkpointer is sent it "
           "on `mirror.<cluster>.<node>`)")]),
    *(Route(subjects.CKPT, name, f'ckpt(run, "{kind}")', "subscribe", what, kind)
      for kind, name, what in [
          ("mirrored", "CheckpointMirrored", "committed in S3 (manifest stored): servable"),
          ("failed", "CheckpointFailed", "the mirror gave up, with the reason"),
          ("pruned", "CheckpointPruned", "steps removed by retention"),
          ("part", "CheckpointPartMirrored", "one node's part of a sharded checkpoint is in "
           "S3 and verified (not a commit: `mirrored` follows once every node's is)")]),
    *(Route(subjects.JOBS, name, f'jobs("{kind}")', "request", what, kind)
      for kind, name, what in [
          ("generate", "GenerationRequest", "queue a generation; reply: the accepted record "
           "and the subjects that follow it"),
          ("train", "RunConfig", "submit a training run; reply: the run's record"),
          ("cancel", None, 'body `{"id": task}` or `{"run_id": run}`; reply: the record'),
          ("status", None, 'body `{"id": task}` or `{"run_id": run}`; reply: the record'),
          ("models", None, "body `{}`; reply: the model registry")]),
    Route(subjects.DLQ, "DeadLetter", "dlq(stream)", "subscribe",
          "a message terminated undecodable, rejected or out of deliveries, with the reason"),
    Route(subjects.TELEMETRY, "NodeTelemetry", "telemetry(cluster, node)", "",
          "GPU samples of one node"),
    Route(subjects.HEALTH, "HealthTransition", "health(cluster, node)", "",
          "a node's health changed, with the evidence"),
    Route(subjects.MODELS, "ModelsLoaded", "models(cluster, node)", "",
          "the models a worker has loaded, for its node's heartbeat"),
    Route(subjects.MIRROR, "CheckpointWritten", "mirror(cluster, node)", "",
          "a checkpoint (or a node's part of one) on that node's disk: the order to that "
          "node's checkpointer"),
    Route(subjects.TRAINER_NODE, "NodeLaunch", "trainer_node(cluster, node)", "",
          "the coordinator's orders to one node's trainer agent (`NodeLaunch`, "
          "`NodeStop` or `NodeInterrupt`); reply `NodeReply`"),
    Route(subjects.TRAINER_REPORT, "NodeReport", "trainer_report(cluster, run)", "",
          "node agents' liveness and exit reports of a run's attempt; reply "
          "`NodeReportReply`"),
]

# Filters over many subjects: built by these functions, listed with the subjects they cover.
FILTERS: dict[str, str] = {
    "gen_cluster_filter(cluster)": "every lane of one cluster (the `GEN_<CLUSTER>` stream)",
    "train_kind_filter(kind)": "one kind of training event, every run",
    "ckpt_kind_filter(kind)": "one kind of checkpoint event, every run",
    "kv_changes(bucket, key)": "`$KV.<bucket>.<key>`: every put of one KV key (no key: "
    "every key): a core subscription hears each write as it is published, before the "
    "bucket stores it and even when the bucket refuses it (a lost compare-and-set), so a "
    "wake-up to read the stored record again, never the record itself (the worker hears "
    "a run's rollback, `forks` in KV `runs`); to follow records as stored, watch the "
    "bucket",
}

# KV buckets: the key of an entry and the ``WIRE_TYPES`` name of its value.
KV_VALUES: dict[str, tuple[str, str]] = {
    streams.KV_TASKS: ("`<task>`", "TaskRecord"),
    streams.KV_CANCELS: ("`<task>`", "CancelNotice"),
    streams.KV_RUNS: ("`<run>`", "RunRecord"),
    streams.KV_NODES: ("`<cluster>.<node>`", "NodeHeartbeat"),
    streams.KV_DRAINS: ("`<cluster>.<node>`", "DrainRecord"),
    streams.KV_IDEMPOTENCY: ("`k<sha256 of the Idempotency-Key>`", "IdempotencyRecord"),
    streams.KV_RATES: ("`<API key name>`", "RateMark"),
    streams.KV_SSE: ("`<API key name>`", "SseHolds"),
}

HEADERS: list[tuple[str, str, str]] = [
    (headers.MSG_ID, "every publish that must not duplicate",
     "the stream stores one message per id within its dedupe window (table above); "
     "a task's is its `task_id`"),
    (headers.TRACEPARENT, "every message Tandem sends",
     "W3C trace context: a consumer's span joins the producer's trace"),
    (headers.EXPECTED_LAST, "KV writes: a record's creation (`0`), each move (its revision)",
     "compare-and-set: stored only if the subject's last sequence is that one"),
    (moves.RECORD_SEAL, "a task the gateway enqueued (`gen.<cluster>.<lane>`)",
     "`<revision>.<issued at, Unix ms>.<HMAC-SHA256>` of the revision, the time and the "
     "task bytes, keyed by `TANDEM_TASK_SEAL_KEY`: the record at that revision is the one "
     "the gateway created for this body, so the worker needs no read before its "
     "compare-and-set. Trusted only with `Nats-Msg-Id` the task id and for the stream's "
     "dedupe window less 60 s (a copy published again is read: its task may have ended); "
     "absent, wrong or stale, the worker reads the record first (a bare publish needs "
     "none)"),
]


# ------------------------------------------------------------------------ the declarations


def placeholder(text: str) -> str:
    """A per-cluster (or per-node) name as the doc shows it."""
    return (text.replace(CLUSTER.upper(), "<CLUSTER>").replace(CLUSTER, "<cluster>")
            .replace(NODE, "<node>"))


def stream_specs() -> list[StreamSpec]:
    specs = [streams.gen_stream(CLUSTER), *streams.core_streams()]
    return [s for s in specs if isinstance(s, StreamSpec)]


def kv_specs() -> list[KVSpec]:
    return [s for s in streams.core_streams() if isinstance(s, KVSpec)]


def consumer_specs() -> list[ConsumerSpec]:
    return [*streams.gen_consumers(CLUSTER), streams.checkpointer_consumer(),
            streams.checkpointer_consumer(cluster=CLUSTER, node=NODE),
            streams.trainer_consumer(CLUSTER)]


def _roles() -> list[permissions.Role]:
    roles = permissions.declaration([CLUSTER])
    return [r for name, r in roles.items() if name != permissions.ADMIN]


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, ``>`` the rest (at least one)."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or tok not in ("*", s[i]):
            return False
    return len(p) == len(s)


def _examples(route: Route) -> list[str]:
    """Concrete subjects of ``route`` for the declarations' one cluster."""
    values = {"cluster": [CLUSTER], "node": [NODE], "task": ["_task_"], "run": ["_run_"],
              "lane": list(subjects.LANES), "kind": [route.kind or "_kind_"],
              "stream": [s.name for s in stream_specs()]}
    fields = [f for _, f, _, _ in string.Formatter().parse(route.subject.template) if f]
    return [route.subject.template.format(**dict(zip(fields, combo, strict=True)))
            for combo in itertools.product(*(values[f] for f in fields))]


def _covers(patterns: Iterable[str], route: Route) -> bool:
    """True if one of ``patterns`` matches one of ``route``'s concrete subjects."""
    examples = _examples(route)
    return any(_matches(p, x) for p in patterns for x in examples)


def stream_of(route: Route) -> StreamSpec | None:
    """The stream that stores ``route``'s messages (a KV bucket's ``KV_<bucket>``); None
    for core NATS."""
    kv = [StreamSpec(f"KV_{b.bucket}", (f"$KV.{b.bucket}.>",)) for b in kv_specs()]
    return next((s for s in [*stream_specs(), *kv] if _covers(s.subjects, route)), None)


def _stored_in(stream: StreamSpec | None) -> str:
    if stream is None:
        return "core NATS, not stored"
    if stream.name.startswith("KV_"):
        return f"KV `{stream.name[3:]}`"
    return f"`{placeholder(stream.name)}`"


def publishers(route: Route) -> list[str]:
    return [r.name for r in _roles() if _covers(r.publish, route)]


def readers(route: Route) -> list[str]:
    """Each role that reads ``route``: a core subscription, a durable it pulls, a replay."""
    out: list[str] = []
    stream = stream_of(route)
    for role in _roles():
        if _covers(role.subscribe, route):
            out.append(f"{role.name} (subscribes)")
        if stream is None:
            continue
        for c in consumer_specs():
            pulls = f"{permissions.API}.CONSUMER.MSG.NEXT.{c.stream}.{c.durable}"
            if c.stream == stream.name and any(_matches(p, pulls) for p in role.publish) and (
                    not c.filter_subjects or _covers(c.filter_subjects, route)):
                out.append(f"{role.name} (pulls `{placeholder(c.durable)}`)")
        if f"{permissions.API}.CONSUMER.CREATE.{stream.name}" in role.publish:
            out.append(f"{role.name} (replays)")
    return out


# ------------------------------------------------------------------------------- rendering


def _duration(seconds: float) -> str:
    if not seconds:
        return "forever"
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0 and not (unit == "d" and seconds < 2 * 86400):
            return f"{int(seconds // size)} {unit}"
    return f"{seconds:g} s"


def _table(head: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    head = list(head)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _list(items: Iterable[str]) -> str:
    return ", ".join(items) or "—"


def _payload(name: str | None) -> str:
    return f"[`{name}`](#{name.lower()})" if name else "(empty)"


def client_may(route: Route) -> str:
    """The subjects table's ``client`` cell: what a program outside Tandem does with
    ``route``, and "(admin)" where the ``client`` NATS user may not (the bare door, the
    dead letters: for trusted tools), as its permissions say."""
    if not route.client:
        return "—"
    role = permissions.declaration([CLUSTER])[permissions.CLIENT]
    lists = role.subscribe if route.client == "subscribe" else role.publish
    return route.client if _covers(lists, route) else f"{route.client} (admin)"


def render_subjects() -> str:
    rows = []
    for r in ROUTES:
        stream = stream_of(r)
        rows.append([f"`{r.form}`", client_may(r), _payload(r.payload),
                     _stored_in(stream),
                     _list(publishers(r)), _list(readers(r)), f"`subjects.{r.builder}`",
                     r.what])
    table = _table(["subject", "client", "payload", "stored in", "published by",
                    "read by", "built by", "what"], rows)
    filters = _table(["filter", "covers"],
                     [[f"`subjects.{f}`", what] for f, what in FILTERS.items()])
    return f"{table}\n\nFilters over several subjects:\n\n{filters}"


def render_streams() -> str:
    holds: dict[str, list[str]] = {}
    for r in ROUTES:
        if (s := stream_of(r)) is not None and r.payload:
            holds.setdefault(s.name, []).append(f"`{r.payload}`")
    stream_rows = [[f"`{placeholder(s.name)}`", _list(f"`{placeholder(x)}`" for x in s.subjects),
                    s.retention.value, _duration(s.max_age), _duration(s.dedupe_window),
                    s.storage.value, _list(holds.get(s.name, []))] for s in stream_specs()]
    kv_rows = []
    for kv in kv_specs():
        key, value = KV_VALUES[kv.bucket]
        kv_rows.append([f"`{kv.bucket}`", key, _payload(value),
                        _duration(kv.ttl) if kv.ttl else "none", str(kv.history)])
    return (_table(["stream", "subjects", "retention", "max age", "dedupe window", "storage",
                    "holds"], stream_rows)
            + "\n\n" + _table(["KV bucket", "key", "value", "TTL", "history"], kv_rows))


def render_consumers() -> str:
    rows = [[f"`{placeholder(c.stream)}`", f"`{placeholder(c.durable)}`",
             ", ".join(f"`{placeholder(f)}`" for f in c.filter_subjects) or "all",
             _duration(c.ack_wait), str(c.max_deliver), str(c.max_ack_pending)]
            for c in consumer_specs()]
    return _table(["stream", "durable", "filter", "AckWait", "MaxDeliver", "MaxAckPending"],
                  rows)


def render_headers() -> str:
    return _table(["header", "on", "meaning"],
                  [[f"`{name}`", on, meaning] for name, on, meaning in HEADERS])


def render_ack_policy() -> str:
    """The table of ``bus.acks``'s docstring (reStructuredText) as Markdown."""
    doc = acks.__doc__ or ""
    lines = doc.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("====")]
    cut = lines[rules[0]].index(" ") + 2  # the second column starts after the gap
    rows = [[line[:cut].strip(), line[cut:].strip()] for line in lines[rules[0] + 1:rules[-1]]
            if line.strip() and not line.startswith("====")]
    head, body = rows[0], rows[1:]
    return _table(head, [[c.replace("``", "`") for c in row] for row in body])


def render_schemas() -> str:
    parts = []
    for w in wire_types.WIRE_TYPES:
        # A class's own docstring, first paragraph; a union has none of its own.
        doc = (w.type.__doc__ or "") if isinstance(w.type, type) else ""
        doc = " ".join(doc.strip().split("\n\n")[0].split()).replace("``", "`")
        body = json.dumps(wire_types.schema(w), indent=2)
        lines = [f"### {w.name}", "", f"Travels on: {w.travels}.", ""]
        if doc:
            lines += [doc, ""]
        lines += ["<details><summary>JSON Schema</summary>", "", "```json", body, "```", "",
                  "</details>"]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


BLOCKS: dict[str, Callable[[], str]] = {
    "subjects": render_subjects,
    "streams": render_streams,
    "consumers": render_consumers,
    "headers": render_headers,
    "ack-policy": render_ack_policy,
    "schemas": render_schemas,
}

_BLOCK = re.compile(r"(<!-- generated: ([\w-]+) -->\n)(.*?)(<!-- end generated -->)", re.S)


class DocError(ValueError):
    """The doc's marker comments do not match ``BLOCKS``."""


def rewrite(text: str) -> str:
    """``text`` with every generated block's body regenerated.

    Raises ``DocError`` for a block name not in ``BLOCKS`` or a block of ``BLOCKS`` that
    the doc lacks, so no table can silently drop out of the doc.
    """
    found = [m.group(2) for m in _BLOCK.finditer(text)]
    if unknown := sorted(set(found) - set(BLOCKS)):
        raise DocError(f"unknown generated blocks: {', '.join(unknown)}")
    if missing := [b for b in BLOCKS if b not in found]:
        raise DocError(f"generated blocks missing from the doc: {', '.join(missing)}")
    notice = f"<!-- Generated by `{REGENERATE}`: edit the code, not this block. -->\n"
    return _BLOCK.sub(
        lambda m: f"{m.group(1)}{notice}\n{BLOCKS[m.group(2)]()}\n\n{m.group(4)}", text)
