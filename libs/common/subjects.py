"""Every NATS subject Tandem uses, built by functions from validated tokens.

A call site never formats a subject string: a typo becomes an AttributeError at import,
not a message published into the void. Templates (``Subject.template``) stay apart from
wire forms so permissions and stream declarations are derived from the same source.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from tandem.common.errors import InvalidToken

MAX_TOKEN = 64
_TOKEN = re.compile(r"[A-Za-z0-9_-]+")

Lane = Literal["interactive", "batch"]
LANES: tuple[Lane, ...] = ("interactive", "batch")
CKPT_KINDS = ("mirrored", "failed", "pruned", "part")
TRAIN_KINDS = ("status", "step", "checkpoint")


def token(value: object, kind: str = "token", max_len: int = MAX_TOKEN) -> str:
    """Return ``value`` if it is a safe subject token, else raise ``InvalidToken``.

    Safe means ``[A-Za-z0-9_-]``, 1..``max_len`` characters: no dots, wildcards or
    spaces, so a token can never widen a subject or escape an S3 prefix.
    """
    if not isinstance(value, str):
        raise InvalidToken(kind, value, f"must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidToken(kind, value, "must not be empty")
    if len(value) > max_len:
        raise InvalidToken(kind, value, f"longer than {max_len} characters")
    if not _TOKEN.fullmatch(value):
        raise InvalidToken(kind, value, "only letters, digits, '_' and '-' are allowed")
    return value


# A Kubernetes node name: lowercase DNS labels joined by dots (RFC 1123 subdomain).
_DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_K8S_NODE = re.compile(rf"{_DNS_LABEL}(?:\.{_DNS_LABEL})+")


def node(value: object) -> str:
    """A node's name as a subject token.

    A Kubernetes node name may hold dots (EKS names its nodes ``ip-10-0-0-1.ec2.internal``),
    and a dot would split a subject token, so each dot becomes ``_``: a character no
    Kubernetes name holds, so two nodes of one cluster never map to one token. Whoever
    names a node (``TANDEM_NODE`` from ``spec.nodeName``, a run's ``nodes``, ``tandem
    fleet drain``) passes it through here, so every side sees the same token. Anything
    else must be a token as it is.
    """
    if isinstance(value, str) and "." in value:
        if not _K8S_NODE.fullmatch(value):
            raise InvalidToken("node", value, "dots are allowed only in a Kubernetes node "
                               "name: lowercase DNS labels joined by '.', such as "
                               "ip-10-0-0-1.ec2.internal")
        value = value.replace(".", "_")
    return token(value, "node")


def token_list(value: str, kind: str = "token") -> list[str]:
    """A comma-separated list of tokens (settings such as ``a,b``), each validated."""
    return [token(v.strip(), kind) for v in value.split(",") if v.strip()]


def lane(value: str) -> Lane:
    if value not in LANES:
        raise InvalidToken("lane", value, f"must be one of {', '.join(LANES)}")
    return value  # type: ignore[return-value]


@dataclass(frozen=True, slots=True)
class Subject:
    """A subject template such as ``gen.{cluster}.{lane}``; ``wildcard`` is its filter."""

    template: str

    @property
    def wildcard(self) -> str:
        return ".".join("*" if p.startswith("{") else p for p in self.template.split("."))

    def filter(self, **tokens: str | None) -> str:
        """The filter with the named placeholders filled (each validated) and the rest
        ``*``: ``TELEMETRY.filter(cluster="east")`` is ``telemetry.east.*``; a value of
        None leaves its placeholder a wildcard."""
        out = []
        for part in self.template.split("."):
            name = part[1:-1] if part.startswith("{") else None
            if name is None:
                out.append(part)
            elif tokens.get(name) is not None:
                out.append(token(tokens[name], name))
            else:
                out.append("*")
        unknown = set(tokens) - {p[1:-1] for p in self.template.split(".") if p.startswith("{")}
        if unknown:
            raise ValueError(f"{self.template} has no placeholder {', '.join(sorted(unknown))}")
        return ".".join(out)


GEN = Subject("gen.{cluster}.{lane}")
GEN_PROGRESS = Subject("gen.progress.{task}")
# A task's record is KV ``tasks`` (streams.KV_TASKS): each write of it is a message on
# this subject, the task's whole record as JSON, so a core subscription follows a task's
# state changes and ``$KV.tasks.*`` every task's.
TASK_RECORD = Subject("$KV.tasks.{task}")
# Each stored write of a task's record, republished by the server with its headers only
# (``Nats-Sequence``, ``Nats-Msg-Size``; ``KV-Operation`` on a delete), never the record:
# what programs outside Tandem (the ``client`` role) follow, a wake-up to read their own
# task's record through the job service, which checks its owner. ``$KV.tasks.*`` carries
# every tenant's whole record (prompt, owner, image keys), so only services hear it.
TASK_WRITTEN = Subject("tasks.written.{task}")
TASKS_WRITTEN = "tasks.written.>"  # KV tasks' republish target (streams.KVSpec.announce)
TELEMETRY = Subject("telemetry.{cluster}.{node}")
HEALTH = Subject("health.{cluster}.{node}")
MODELS = Subject("models.{cluster}.{node}")
TRAIN = Subject("train.{run}.{kind}")
CKPT = Subject("ckpt.{run}.{kind}")
# A checkpoint written on a node, for the checkpointer of that node (stream MIRROR): its
# files are on that node's disk only, so no other node's checkpointer can mirror them.
MIRROR = Subject("mirror.{cluster}.{node}")
DLQ = Subject("dlq.{stream}")
# The trainer coordinator and its node agents (core NATS request/reply, no stream: an
# order to an absent agent must fail now, not be replayed to a later one).
TRAINER_NODE = Subject("trainer.node.{cluster}.{node}")  # launch and stop orders to a node
TRAINER_REPORT = Subject("trainer.report.{cluster}.{run}")  # node agents' reports of a run
# The job service (nats.micro ``tandem-jobs``): request/reply, one subject per endpoint.
JOBS = Subject("tandem.jobs.{kind}")  # kind: one of JOB_ENDPOINTS
JOB_ENDPOINTS = ("generate", "train", "cancel", "status", "models")


def gen(cluster: str, lane_: str) -> str:
    return f"gen.{token(cluster, 'cluster')}.{lane(lane_)}"


def gen_cluster_filter(cluster: str) -> str:
    return f"gen.{token(cluster, 'cluster')}.*"


def task_record(task: str) -> str:
    """Where each write of a task's record travels (KV ``tasks``, key ``task``)."""
    return f"$KV.tasks.{token(task, 'task id')}"


def task_written(task: str) -> str:
    """Where each stored write of a task's record is announced, headers only."""
    return f"tasks.written.{token(task, 'task id')}"


def gen_progress(task: str) -> str:
    return f"gen.progress.{token(task, 'task id')}"


def jobs(endpoint: str) -> str:
    """The job service's subject for ``endpoint`` (one of ``JOB_ENDPOINTS``)."""
    if endpoint not in JOB_ENDPOINTS:
        raise InvalidToken("job endpoint", endpoint, f"not one of {', '.join(JOB_ENDPOINTS)}")
    return f"tandem.jobs.{endpoint}"


def service_inbox(role: str) -> str:
    """``_SERVICE_INBOX.<role>``: the inbox prefix of a service role's connections (the
    replies to its requests: KV reads, pulled tasks, publish acks). Programs outside
    Tandem share ``_INBOX.>`` (the ``client`` role), so a service's replies must not land
    there. Not ``_INBOX_<x>``: that is a cluster's (``accounts.inbox_prefix``), imported
    into the cluster's account by its prefix."""
    return f"_SERVICE_INBOX.{token(role, 'role')}"


def is_inbox(reply: str | None) -> bool:
    """Whether ``reply`` is a requester's inbox, the only subject a service answers on:
    ``_INBOX.<...>``, a cluster's ``_INBOX_<cluster>.<...>`` (accounts.inbox_prefix), or
    ``_R_.<...>``, a reply nats-server mapped across accounts. A request whose reply names
    anything else (a KV key, a queue) would have its answer published there with the
    service's own permissions."""
    head, dot, rest = (reply or "").partition(".")
    return (bool(dot and rest) and (head in ("_INBOX", "_R_") or head.startswith("_INBOX_"))
            and not {"*", ">", " "} & set(rest))


def telemetry(cluster: str, node: str) -> str:
    return f"telemetry.{token(cluster, 'cluster')}.{token(node, 'node')}"


def health(cluster: str, node: str) -> str:
    return f"health.{token(cluster, 'cluster')}.{token(node, 'node')}"


def models(cluster: str, node: str) -> str:
    """Core NATS: workers announce the models they have loaded on a node."""
    return f"models.{token(cluster, 'cluster')}.{token(node, 'node')}"


def train(run: str, kind: str) -> str:
    if kind not in TRAIN_KINDS:
        raise InvalidToken("train event kind", kind, f"must be one of {', '.join(TRAIN_KINDS)}")
    return f"train.{token(run, 'run id')}.{kind}"


def train_kind_filter(kind: str) -> str:
    """``train.*.<kind>``: one kind of training event, every run (e.g. checkpoints)."""
    if kind not in TRAIN_KINDS:
        raise InvalidToken("train event kind", kind, f"must be one of {', '.join(TRAIN_KINDS)}")
    return f"train.*.{kind}"


def ckpt(run: str, kind: str) -> str:
    if kind not in CKPT_KINDS:
        raise InvalidToken("checkpoint event kind", kind, f"must be one of {', '.join(CKPT_KINDS)}")
    return f"ckpt.{token(run, 'run id')}.{kind}"


def ckpt_kind_filter(kind: str) -> str:
    """``ckpt.*.<kind>``: one kind of checkpoint event, every run (e.g. mirrored)."""
    if kind not in CKPT_KINDS:
        raise InvalidToken("checkpoint event kind", kind, f"must be one of {', '.join(CKPT_KINDS)}")
    return f"ckpt.*.{kind}"


def mirror(cluster: str, node: str) -> str:
    """``CheckpointWritten`` of a checkpoint (or a node's part of one) on ``node``'s disk:
    what that node's checkpointer mirrors (``streams.checkpointer_consumer``)."""
    return f"mirror.{token(cluster, 'cluster')}.{token(node, 'node')}"


def trainer_node(cluster: str, node: str) -> str:
    """Orders (``NodeOrder``) to the trainer agent of one node; it replies ``NodeReply``."""
    return f"trainer.node.{token(cluster, 'cluster')}.{token(node, 'node')}"


def trainer_report(cluster: str, run: str) -> str:
    """Node agents' ``NodeReport`` of a run's attempt; its coordinator replies
    ``NodeReportReply`` (whether the attempt is still wanted)."""
    return f"trainer.report.{token(cluster, 'cluster')}.{token(run, 'run id')}"


def dlq(stream: str) -> str:
    return f"dlq.{token(stream, 'stream')}"


def kv_changes(bucket: str, key: str | None = None) -> str:
    """``$KV.<bucket>.<key>``: where a KV bucket publishes each put of ``key`` (None:
    every single-token key, ``*``), so a core subscription hears every change without a
    watch's consumer."""
    return f"$KV.{token(bucket, 'bucket')}.{'*' if key is None else token(key, 'key')}"


def cluster_keys(cluster: str) -> str:
    """``<cluster>.*``: the KV key pattern of every node of ``cluster`` (``node_key``) in a
    bucket keyed by node (``nodes``, ``drains``), for a watch."""
    return f"{token(cluster, 'cluster')}.*"


def node_key(cluster: str, node: str) -> str:
    """Key of a node in KV ``nodes``: ``<cluster>.<node>``."""
    return f"{token(cluster, 'cluster')}.{token(node, 'node')}"


def gen_stream_name(cluster: str) -> str:
    """``GEN_<CLUSTER>``: the work-queue stream of one cluster."""
    return f"GEN_{token(cluster, 'cluster').upper()}"
