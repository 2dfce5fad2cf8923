"""Who may publish and subscribe to what on the bus: one declaration, one generator.

Every service connects as its own NATS user (``TANDEM_NATS_USER`` = its role) with
allow-lists built here from the subject templates in ``subjects`` and the stream, KV
and consumer names in ``streams``. Anything not listed is refused by the server, which
answers ``Permissions Violation`` (logged by ``Bus`` as ``nats.permission_denied``).

A grant is written in terms of what a service does, and expands into the subjects
nats-py sends for it:

=====================  =================================================================
``stream(S)``          provision S: ``$JS.API.STREAM.INFO.S``, ``$JS.API.STREAM.CREATE.S``
``publishes(subj, S)`` JetStream publish to ``subj`` (+ ``stream(S)``)
``consumes(spec)``     its durable: create/info, ``MSG.NEXT``, ``$JS.ACK.S.D.>`` and the
                       dead letters of S (``dlq.S`` on stream ``DLQ``)
``kv(b, write=)``      read (direct get, watch: ordered consumer + flow control) and,
                       with ``write``, ``$KV.b.>``
``reads_last(S)``      ``get_last_msg`` on S (``STREAM.MSG.GET``, ``DIRECT.GET``)
``updates(S)``         ``$JS.API.STREAM.UPDATE.S``: bring an older S up to its spec (no
                       service role may delete or purge a stream)
``emits`` / ``listens``  core NATS publish / subscribe
=====================  =================================================================

A service role takes its replies on its own inbox prefix, ``_SERVICE_INBOX.<role>.>``
(``subjects.service_inbox``; ``Bus.connect`` uses it for a service's user); ``client`` on
``_INBOX.>``, so no program outside Tandem hears a service's replies (records read from
KV, pulled tasks). For this release only, a service role may also subscribe to
``_INBOX.>`` (``LEGACY_REPLIES``): the services of the release before take their replies
there, and the hub's config is rolled out before them. The ``admin`` role (operators, the
CLI, the local stack's provisioning) may do anything.

The roles that run on a GPU cluster's training nodes (``CLUSTER_USER_ROLES``: the
trainer's coordinator and node agents, a checkpointer per node) have a user per cluster
as well, ``<role>-<cluster>`` (``cluster_users``), whose grants name that cluster alone
where a subject, durable or key names one; the ``trainer`` and ``checkpointer`` users
are the control plane's (every cluster). A user that is not a role's own name (those,
and a login added to rotate a password, ``with_logins``) takes its replies on
``_SERVICE_INBOX_<user>`` (``own_inbox``), set as its ``TANDEM_NATS_INBOX_PREFIX``.
``users`` is every user of a deployment.

``nats_config`` renders the nats-server ``authorization`` block of ``users``;
``deploy/nats/auth.conf`` is its output for compose (a test checks they agree),
``tandem dev up --auth`` writes its own with generated passwords.

One module past 600 lines: the grant vocabulary (``_Grants``), the declaration written
in it (the per-cluster users too) and the configs rendered from it change together;
split, a grant could be declared and never rendered.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from tandem.common import streams, subjects
from tandem.common.streams import ConsumerSpec, KVSpec, Spec, StreamSpec

API = "$JS.API"
INBOX = "_INBOX.>"
ADMIN = "admin"
CONTROL = "control"  # the cluster name of control-plane processes (gateway, trainer, ...)
GEN = "GEN_*"  # every cluster's work queue, as a provisioning pattern
CLIENT = "client"  # programs outside Tandem that submit jobs (the job service)
JOBS = subjects.JOBS.wildcard  # tandem.jobs.*: the job service's endpoints
SRV = "$SRV.>"  # the NATS service API's discovery: PING, INFO, STATS


@dataclass(frozen=True)
class Role:
    """One NATS user's allow-lists and the streams/consumers it may provision."""

    name: str
    description: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # What it may provision, as fnmatch patterns: ``<stream>`` (KV buckets as
    # ``KV_<bucket>``) and ``<stream>/<durable>``; per-cluster names as ``GEN_*``, so a
    # process can tell what is its own without knowing the deployment's clusters.
    provisions: frozenset[str] = frozenset()
    # It answers requests (the job service): it may publish to a requester's reply
    # subject, and only while that reply is due (nats-server's ``allow_responses``).
    responds: bool = False
    # The streams (KV buckets as ``KV_<bucket>``) whose config it may update.
    updates: frozenset[str] = frozenset()

    def may_provision(self, spec: Spec) -> bool:
        if self.name == ADMIN:
            return True
        return any(fnmatch.fnmatchcase(_name(spec), p) for p in self.provisions)

    def may_update(self, spec: StreamSpec | KVSpec) -> bool:
        return self.name == ADMIN or _name(spec) in self.updates


def _name(spec: Spec) -> str:
    if isinstance(spec, StreamSpec):
        return spec.name
    if isinstance(spec, KVSpec):
        return f"KV_{spec.bucket}"
    return f"{spec.stream}/{spec.durable}"


SERVICE_ROLES = ("gateway", "inference-worker", "cluster-agent", "trainer", "checkpointer")
# The roles that run on a GPU cluster's training nodes, each with a user per cluster
# (``cluster_user``): a node holds its own cluster's passwords, never the control plane's.
CLUSTER_USER_ROLES = ("trainer", "checkpointer")


def cluster_user(role: str, cluster: str) -> str:
    """``<role>-<cluster>``: the user ``role`` logs in as in GPU cluster ``cluster``."""
    if role not in CLUSTER_USER_ROLES:
        raise ValueError(f"{role!r} has no user per cluster; those that do: "
                         f"{', '.join(CLUSTER_USER_ROLES)}")
    return f"{role}-{subjects.token(cluster, 'cluster')}"


def own_inbox(user: str) -> str:
    """``_SERVICE_INBOX_<user>``: the inbox prefix of a user that is not a role's own name
    (a cluster's user, a login added for a rotation), its ``TANDEM_NATS_INBOX_PREFIX``.

    NOTE: one token, not ``_SERVICE_INBOX.<user>``: that setting takes one token, and
    ``Bus.connect`` derives ``subjects.service_inbox`` only for a role's own user. No
    other user's grant covers it (``_SERVICE_INBOX.>`` does not)."""
    return f"_SERVICE_INBOX_{subjects.token(user, 'user')}"


def replies(user: str) -> str:
    """What ``user`` subscribes to for the replies to its requests: ``_INBOX.>`` for
    ``client``, ``_SERVICE_INBOX.<role>.>`` for a service role's own user, else
    ``own_inbox(user)``."""
    if user == CLIENT:
        return INBOX
    if user in SERVICE_ROLES:
        return f"{subjects.service_inbox(user)}.>"
    return f"{own_inbox(user)}.>"


# TRANSITIONAL: for the rolling upgrade from the release before each service role had its
# own inbox prefix (commit 3ed533a), whose services take their replies on ``_INBOX``.
# With it the hub's config goes out first and the services after (docs/deploy.md,
# "Rolling out"); without it an old service's every request times out on the new config.
# Only an old service's replies flow there (a new one's come on its role's prefix), and
# clients, who subscribe to ``_INBOX.>`` too, hear those as they did before
# (docs/security.md). DROP IN THE NEXT RELEASE, with the tests that name it.
LEGACY_REPLIES = INBOX


def reply_grants(user: str) -> set[str]:
    """Every subject ``user`` may subscribe to for replies: ``replies(user)`` and, for a
    service role's own user this release only, ``LEGACY_REPLIES`` (a cluster's user is
    new: no service of the release before logs in as one)."""
    return {replies(user)} | ({LEGACY_REPLIES} if user in SERVICE_ROLES else set())


@dataclass
class _Grants:
    """Accumulates one role's subjects while the declaration below is read."""

    name: str
    description: str
    pub: set[str] = field(default_factory=set)
    sub: set[str] = field(default_factory=set)
    provisions: set[str] = field(default_factory=set)
    responds: bool = False
    update: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.sub |= reply_grants(self.name)

    def stream(self, name: str, pattern: str | None = None) -> _Grants:
        self.provisions.add(pattern or name)
        self.pub |= {f"{API}.STREAM.INFO.{name}", f"{API}.STREAM.CREATE.{name}"}
        return self

    def publishes(self, subject: str, stream: str, pattern: str | None = None) -> _Grants:
        self.pub.add(subject)
        return self.stream(stream, pattern)

    def consumes(self, spec: ConsumerSpec, pattern: str | None = None,
                 any_durable: bool = False) -> _Grants:
        """``pattern``: the ``<stream>/<durable>`` family this consumer belongs to.
        ``any_durable``: every durable of ``spec.stream`` (a family whose names the
        declaration cannot list, such as one per node: a NATS wildcard is a whole token)."""
        s, d = spec.stream, "*" if any_durable else spec.durable
        self.provisions.add(pattern or f"{s}/{d}")
        self.pub |= {
            f"{API}.CONSUMER.INFO.{s}.{d}",
            f"{API}.CONSUMER.CREATE.{s}.{d}",  # nats-py: by name ...
            f"{API}.CONSUMER.CREATE.{s}.{d}.>",  # ... with its filter subject
            f"{API}.CONSUMER.DURABLE.CREATE.{s}.{d}",  # older servers
            f"{API}.CONSUMER.MSG.NEXT.{s}.{d}",
            f"$JS.ACK.{s}.{d}.>",
        }
        self.stream(s, pattern and pattern.partition("/")[0])
        return self.publishes(subjects.dlq(s), streams.DLQ)

    def follows(self, stream: str) -> _Grants:
        """Ordered push consumers on ``stream`` (KV watches, replaying a stream).

        Only the unnamed (ephemeral) create form: a named one could redefine another
        role's durable. nats-py never deletes an ordered consumer (the server drops it
        when its subscription goes), so no delete either.
        """
        self.pub |= {
            f"{API}.CONSUMER.CREATE.{stream}", f"{API}.CONSUMER.INFO.{stream}.*",
            f"$JS.FC.{stream}.>",
            f"{API}.STREAM.NAMES",  # js.subscribe finds the stream by subject
        }
        return self

    def kv(self, bucket: str, write: bool = False, keys: str = ">",
           by_key: bool = False, reads: str = ">") -> _Grants:
        """Read ``bucket`` and, with ``write``, write the keys matching ``keys``.

        ``by_key``: reads of one key at a time only (direct get by subject), no watch,
        key listing or get by sequence, so the bucket cannot be walked; and of the keys
        matching ``reads`` only (a watch's filter travels in its request's body, where
        no grant can see it, so a narrower ``reads`` needs ``by_key``).
        """
        if reads != ">" and not by_key:
            raise ValueError(f"reads={reads!r} of KV {bucket} needs by_key: a watch's "
                             "keys cannot be narrowed by a grant")
        s = f"KV_{bucket}"
        self.stream(s)
        self.pub.add(f"{API}.DIRECT.GET.{s}." + (">" if reads == ">" else f"$KV.{bucket}.{reads}"))
        if not by_key:
            self.follows(s)  # watch, keys
            self.pub |= {f"{API}.DIRECT.GET.{s}", f"{API}.STREAM.MSG.GET.{s}"}
        if write:
            self.pub.add(f"$KV.{bucket}.{keys}")
        return self

    def updates(self, stream: str) -> _Grants:
        """Update ``stream``'s config (``provision`` brings an older one up to its spec)."""
        self.update.add(stream)
        self.pub.add(f"{API}.STREAM.UPDATE.{stream}")
        return self

    def reads_last(self, stream: str) -> _Grants:
        self.pub |= {f"{API}.STREAM.MSG.GET.{stream}", f"{API}.DIRECT.GET.{stream}",
                     f"{API}.DIRECT.GET.{stream}.>"}
        return self

    def emits(self, *subs: str) -> _Grants:
        self.pub.update(subs)
        return self

    def listens(self, *subs: str) -> _Grants:
        self.sub.update(subs)
        return self

    def serves(self, *subs: str) -> _Grants:
        """Answers requests on ``subs`` (a NATS service: its endpoints and ``$SRV``)."""
        self.sub.update(subs)
        self.responds = True
        return self

    def role(self) -> Role:
        return Role(self.name, self.description, tuple(sorted(self.pub)),
                    tuple(sorted(self.sub)), frozenset(self.provisions), self.responds,
                    frozenset(self.update))


# --------------------------------------------------------------------------- the declaration


def declaration(clusters: Sequence[str], control: str = CONTROL,
                home: str | None = None) -> dict[str, Role]:
    """Every role, for a deployment whose GPU clusters are ``clusters``.

    GEN streams are per cluster, so the lists name each cluster's stream (NATS wildcards
    match whole tokens only: ``GEN_*`` cannot be written). Trainers may run in the
    control plane (``control``) or in a GPU cluster; each cluster has its own durable.

    ``home``: the roles as they run in that GPU cluster, whose account they share (the
    leaf topology, ``accounts_config``): the subjects that name a cluster (telemetry,
    health, models, its nodes' heartbeats) name only ``home``. Without it, every
    cluster's: one server whose users serve every cluster.
    """
    clusters = [subjects.token(c, "cluster") for c in clusters]
    if not clusters:
        raise ValueError("a permissions declaration needs at least one cluster")
    records = subjects.TASK_RECORD.wildcard  # each write of a task's record
    home = None if home is None else subjects.token(home, "cluster")
    nodes = ">" if home is None else f"{home}.>"  # KV nodes keys are <cluster>.<node>
    telemetry, health, models = (s.filter(cluster=home) for s in (
        subjects.TELEMETRY, subjects.HEALTH, subjects.MODELS))

    gateway = (
        _Grants("gateway", "HTTP edge: enqueues generations, follows them, submits runs")
        # an event stream follows its task as clients do: progress, and each record write
        .listens(subjects.GEN_PROGRESS.wildcard, subjects.TASK_WRITTEN.wildcard)
        .kv(streams.KV_TASKS, write=True).kv(streams.KV_IDEMPOTENCY, write=True)
        # Its bucket's owner brings a KV tasks made before its writes were announced (by
        # the release before) up to date as it starts, so a rolling upgrade needs no admin
        # step. Only that bucket's config: the gateway writes and deletes every key of it
        # already.
        .updates(f"KV_{streams.KV_TASKS}")
        .kv(streams.KV_CANCELS, write=True)  # a cancel's notice to the workers
        .kv(streams.KV_NODES).kv(streams.KV_DRAINS)
        .kv(streams.KV_RUNS, write=True)
        .kv(streams.KV_RATES, write=True)  # each key's rate, one budget for every replica
        .kv(streams.KV_SSE, write=True)  # each key's open event streams, the fleet's
        .publishes(subjects.train_kind_filter("status"), streams.TRAIN)  # a run submitted
        # the dashboard (observe.py): live steps, checkpoints and results, a run's history
        .listens(subjects.train_kind_filter("step"), subjects.train_kind_filter("checkpoint"),
                 records)
        .follows(streams.TRAIN)
        .serves(JOBS, SRV)  # the job service, tandem-jobs (services/gateway/jobs.py)
    )
    for c in clusters:
        gateway.publishes(subjects.gen_cluster_filter(c), subjects.gen_stream_name(c), GEN)
        gateway.reads_last(subjects.gen_stream_name(c))  # the age of a queue's oldest task

    worker = (
        _Grants("inference-worker", "pulls generation tasks, writes their records, progress")
        .emits(subjects.GEN_PROGRESS.wildcard, models)
        # A task's record by its id only: the worker never walks the bucket.
        .kv(streams.KV_TASKS, write=True, by_key=True).kv(streams.KV_NODES)
        .kv(streams.KV_CANCELS)  # watched: the gateway's cancels
        .kv(streams.KV_DRAINS)
        .kv(streams.KV_RUNS)  # a run: model's newest committed checkpoint, on start
        # Failover discovers the clusters' queues by the names of the streams on gen.*.*
        # (STREAM.NAMES, granted by follows()), then STREAM.INFO of each queue it may pull.
        .listens(subjects.ckpt_kind_filter("mirrored"))  # hot-swap wake-ups
        .listens(subjects.kv_changes(streams.KV_RUNS))  # a run's rollback (its forks)
    )
    for c in clusters:  # every cluster's queue: healthy clusters drain a dead one's backlog
        worker.stream(subjects.gen_stream_name(c), GEN)
        for spec in (streams.gen_consumer(c), *streams.gen_consumers(c)):
            worker.consumes(spec, f"{GEN}/workers-*")

    agent = (
        _Grants("cluster-agent", "node telemetry, health transitions, heartbeats")
        .publishes(telemetry, streams.TELEMETRY)
        .publishes(health, streams.HEALTH).reads_last(streams.HEALTH)
        .listens(models)
        .kv(streams.KV_NODES, write=True, keys=nodes).kv(streams.KV_DRAINS)
    )

    # TRANSITIONAL: a control plane's trainer (compose's, the local stack's by default)
    # needs ``control``'s durable and subjects only; every GPU cluster's are here for the
    # release whose GPU clusters' coordinators and node agents log in as ``trainer``
    # (now each cluster's own user, ``cluster_users``; docs/security.md, "A user per
    # cluster"). DROP IN THE NEXT RELEASE, once every trainer in a GPU cluster logs in as
    # its cluster's user (the pods, and a local stack's trainer placed in a cluster):
    # ``_trainer("trainer", [control], control)``, with the tests that name it.
    trainer = _trainer("trainer", [control, *clusters], None)
    checkpointer = _checkpointer("checkpointer", None)

    # Programs outside Tandem: jobs through the job service, and what follows a job.
    client = (
        _Grants(CLIENT, "programs that submit jobs: the job service, job status, progress "
                "and results; no queue, stream or bucket of their own")
        .emits(JOBS, SRV)
        # A task's record only through the job service, which checks its owner: here,
        # that it was written (headers only), never what it holds (every tenant's).
        .listens(subjects.TASK_WRITTEN.wildcard, subjects.GEN_PROGRESS.wildcard,
                 subjects.train_kind_filter("status"))
    )

    admin = Role(ADMIN, "operators, the CLI and the local stack's provisioning: everything",
                 (">",), (">",))
    roles = [g.role() for g in (gateway, worker, agent, trainer, checkpointer, client)]
    roles.append(admin)
    return {r.name: r for r in roles}


def _trainer(user: str, durables: Sequence[str], cluster: str | None) -> _Grants:
    """The trainer's grants as ``user``: the coordinators' durables of ``durables``; the
    subjects and keys that name a cluster name ``cluster`` (None: every cluster's)."""
    where = "every cluster's" if cluster is None else f"cluster {cluster}'s"
    node, report = (s.filter(cluster=cluster)
                    for s in (subjects.TRAINER_NODE, subjects.TRAINER_REPORT))
    g = (
        _Grants(user, f"claims runs, relays steps and checkpoints, restarts: {where}")
        # A run's events and record are keyed by its id, which names no cluster.
        .publishes(subjects.TRAIN.wildcard, streams.TRAIN)
        .publishes(subjects.MIRROR.filter(cluster=cluster), streams.MIRROR)  # its nodes'
        .listens(subjects.HEALTH.filter(cluster=cluster))
        # KV runs: watched (a client's cancel), claimed and written; KV drains: watched
        # (its cluster's node keys, but a watch's filter is no grant's to see)
        .kv(streams.KV_RUNS, write=True).kv(streams.KV_DRAINS)
        # The coordinator and its node agents share the role: orders to the agents and
        # their reports, each a request the other side answers (nodes.py).
        .emits(node, report).serves(node, report)
    )
    if cluster is None:
        g.kv(streams.KV_NODES)
    else:  # a placed node's heartbeat, by its key (services/trainer/service.py)
        g.kv(streams.KV_NODES, by_key=True, reads=f"{cluster}.>")
    for c in dict.fromkeys(durables):
        g.consumes(streams.trainer_consumer(c),
                   f"{streams.TRAIN}/trainer-*" if cluster is None else None)
    return g


def _checkpointer(user: str, cluster: str | None) -> _Grants:
    """The checkpointer's grants as ``user``: the fleet-wide durable or every node's
    (``cluster`` None), or ``cluster``'s nodes' (``checkpointer-<cluster>-<node>``)."""
    # NOTE: MIRROR's durables are granted whole: a per-node durable's name holds its
    # cluster inside one token, and a NATS wildcard spans whole tokens, so no grant can
    # say "east's nodes' durables". ``cluster`` narrows what the process provisions only.
    where = "every cluster's" if cluster is None else f"cluster {cluster}'s nodes'"
    durables = (f"{streams.MIRROR}/checkpointer*" if cluster is None
                else f"{streams.MIRROR}/checkpointer-{cluster}-*")
    return (
        _Grants(user, f"mirrors checkpoints to S3, commits, prunes: {where}")
        # One fleet-wide durable, or one per node (checkpointer-<cluster>-<node>), on its
        # own stream: only checkpointers consume MIRROR.
        .consumes(streams.checkpointer_consumer(), durables, any_durable=True)
        .publishes(subjects.CKPT.wildcard, streams.CKPT)  # keyed by run id, as KV runs
        .kv(streams.KV_RUNS, write=True)
    )


def cluster_users(clusters: Sequence[str]) -> dict[str, Role]:
    """Each GPU cluster's users (``cluster_user``): its trainer coordinators' and node
    agents', and its nodes' checkpointers', their grants narrowed to that cluster where
    a subject, durable or key names one (docs/security.md says what stays shared)."""
    out: dict[str, Role] = {}
    for c in dict.fromkeys(subjects.token(c, "cluster") for c in clusters):
        for g in (_trainer(cluster_user("trainer", c), [c], c),
                  _checkpointer(cluster_user("checkpointer", c), c)):
            out[g.name] = g.role()
    return out


def users(clusters: Sequence[str], control: str = CONTROL) -> dict[str, Role]:
    """Every NATS user of a deployment whose GPU clusters are ``clusters``: one per role
    (``declaration``) and each cluster's (``cluster_users``), by user name."""
    return {**declaration(clusters, control), **cluster_users(clusters)}


def with_logins(existing: Mapping[str, Role], add: Mapping[str, str] | None = None,
                drop: Collection[str] = ()) -> dict[str, Role]:
    """The ``existing`` users with a login added for each ``new: old`` of ``add``, with
    the grants of ``old``, and without the users in ``drop``: a password rotated with no
    outage is "add user B, roll clients, remove user A" (docs/security.md), as
    nats-server holds one password per user. A login of a service's user takes its
    replies on its own ``own_inbox``; one of ``client`` or ``admin`` keeps theirs.

    Raises ValueError naming a new login that is already a user, and an ``old`` or a
    dropped user that is none (a typo must not leave out the user it meant).
    """
    add = dict(add or {})
    taken = sorted(set(add) & set(existing))
    unknown = sorted({*add.values(), *drop} - set(existing))
    if taken or unknown:
        raise ValueError("; ".join(
            [*(f"login {n!r} is already a user" for n in taken),
             *(f"no user {n!r} to {'copy' if n in add.values() else 'drop'}"
               for n in unknown)]))
    out = {n: r for n, r in existing.items() if n not in drop}
    for new, old in add.items():
        subjects.token(new, "user")
        role = existing[old]
        sub = (role.subscribe if old in (CLIENT, ADMIN) else
               tuple(sorted(set(role.subscribe) - reply_grants(old) | reply_grants(new))))
        out[new] = replace(role, name=new, subscribe=sub,
                           description=f"{role.description} (a login of {old})")
    return out


def provisionable(role: Role, specs: Iterable[Spec]) -> list[Spec]:
    """The part of ``specs`` that ``role`` may provision (the rest is another role's), a
    bucket it may not update marked so (``KVSpec.update``): a request the server refuses
    would cost each start a timeout."""
    return [replace(s, update=False) if isinstance(s, KVSpec) and not role.may_update(s)
            else s for s in specs if role.may_provision(s)]


def role_for(user: str | None, service: str) -> Role | None:
    """The role a process runs as: its NATS user's, else its service's; None if neither.

    Only what it may provision matters here, which does not depend on the clusters. A
    cluster's user (or a login) is taken as its service's role, which provisions the
    same streams and buckets; of the per-cluster durables, a service asks only for its
    own cluster's, which its user's grants hold.
    """
    roles = declaration([CONTROL])
    return roles.get(user or "") or roles.get(service)


# ------------------------------------------------------------------------------ the config


def password_env(user: str) -> str:
    """``TANDEM_NATS_PASSWORD_<USER>``: where nats-server finds a user's password
    (``trainer-east``: ``TANDEM_NATS_PASSWORD_TRAINER_EAST``)."""
    return "TANDEM_NATS_PASSWORD_" + user.upper().replace("-", "_")


def quoted(value: str) -> str:
    """``value`` as a quoted string of the NATS config format."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _list(items: Sequence[str], indent: str) -> str:
    return "[\n" + "".join(f"{indent}  {quoted(i)}\n" for i in items) + f"{indent}]"


def nats_config(roles: Mapping[str, Role], passwords: Mapping[str, str] | None = None,
                header: str = "") -> str:
    """The nats-server ``authorization`` block for ``roles``.

    ``passwords`` maps a user to its password, written quoted; a user without one gets
    ``$TANDEM_NATS_PASSWORD_<USER>`` (``password_env``), which nats-server reads from its
    environment: a variable missing there stops nats-server at start.
    """
    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines += ["authorization {", "  users: [", *users_config(roles, passwords, "    "),
              "  ]", "}", ""]
    return "\n".join(lines)


def users_config(roles: Mapping[str, Role], passwords: Mapping[str, str] | None = None,
                 indent: str = "") -> list[str]:
    """One user per role with its allow-lists, as the lines of a ``users`` list;
    passwords as for ``nats_config``. Raises ValueError if two users would read their
    passwords from one variable (``a-b`` and ``a_b``)."""
    passwords = passwords or {}
    by_env: dict[str, str] = {}
    for name in sorted(set(roles) - set(passwords)):
        if (other := by_env.setdefault(password_env(name), name)) != name:
            raise ValueError(f"users {other!r} and {name!r} would both read their password "
                             f"from ${password_env(name)}: rename one")
    lines: list[str] = []
    for name in sorted(roles):
        role = roles[name]
        pw = quoted(passwords[name]) if name in passwords else "$" + password_env(name)
        ind = indent + "    "
        lines += [f"{indent}# {role.description}", f"{indent}{{",
                  f"{indent}  user: {quoted(name)}", f"{indent}  password: {pw}"]
        lines += [
            f"{indent}  permissions: {{",
            f"{ind}publish: {{ allow: {_list(role.publish, ind)} }}",
            f"{ind}subscribe: {{ allow: {_list(role.subscribe, ind)} }}",
            *([f"{ind}allow_responses: true"] if role.responds else []),
            f"{indent}  }}",
            f"{indent}}}",
        ]
    return lines


COMPOSE_CLUSTERS = ("east", "west")
COMPOSE_HEADER = (
    "Generated from tandem.common.permissions (one declaration of every service's NATS\n"
    "permissions): do not edit. Regenerate with\n"
    "  tandem security nats-config --clusters east,west > deploy/nats/auth.conf\n"
    "Passwords come from nats-server's environment: TANDEM_NATS_PASSWORD_<USER>.")


def compose_config() -> str:
    """What ``deploy/nats/auth.conf`` must hold (checked by a test)."""
    return nats_config(users(COMPOSE_CLUSTERS), header=COMPOSE_HEADER)


# --------------------------------------------------------------------------------- refusals


@dataclass(frozen=True)
class Violation:
    """A permission the server refused: ``operation`` is ``publish`` or ``subscribe``.

    ``subject`` is as nats-py reports it, lowercased (its protocol parser lowercases
    ``-ERR`` text); the server's own log line keeps the exact subject.
    """

    operation: str
    subject: str


_VIOLATION = re.compile(r"permissions violation for (publish|subscription) to \"?([^\"\s']+)",
                        re.IGNORECASE)


def violation(error: BaseException | str) -> Violation | None:
    """The refusal an error from nats-py reports, or None if it is not one."""
    m = _VIOLATION.search(str(error))
    if m is None:
        return None
    op = "publish" if m.group(1).lower() == "publish" else "subscribe"
    return Violation(op, m.group(2))


def server_config(store_dir: str, roles: Mapping[str, Role] | None = None,
                  passwords: Mapping[str, str] | None = None, *, tls_cert: str | None = None,
                  tls_key: str | None = None, tls_ca: str | None = None,
                  verify_clients: bool = False, server_name: str | None = None) -> str:
    """A single local nats-server's config: JetStream, and authorization and TLS when
    given (``tandem dev up --auth``, the tests). Ports come from the command line.

    ``server_name``: the name it is started with (``-n``); a reload (SIGHUP) of a config
    that names none is refused ("config reload not supported for ServerName")."""
    out = [f"server_name: {quoted(server_name)}"] if server_name else []
    out.append(f"jetstream {{ store_dir: {quoted(store_dir)} }}")
    if tls_cert and tls_key:
        out += ["tls {", f"  cert_file: {quoted(tls_cert)}", f"  key_file: {quoted(tls_key)}"]
        if tls_ca:
            out.append(f"  ca_file: {quoted(tls_ca)}")
        if verify_clients:
            out.append("  verify: true")
        out += ["  timeout: 3", "}"]
    if roles is not None:
        out.append(nats_config(roles, passwords))
    return "\n".join(out) + "\n"
