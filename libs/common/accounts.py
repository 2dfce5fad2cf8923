"""NATS accounts for the leaf topology: one per GPU cluster, one for the control plane.

nats-server refuses permissions on leaf-node users, so a GPU cluster's leaf connection
is bound to an account of its own instead, and an account sees only what it imports.
The layout, generated from ``permissions.declaration`` (nothing here names a subject):

- ``control-plane`` holds JetStream (every stream and bucket, domain ``hub``), the
  control-plane roles' users (gateway, trainer, checkpointer, client, admin) and each
  GPU cluster's trainer and checkpointer users (``permissions.cluster_users``: their
  processes run on the cluster's training nodes but dial the hub) with their
  allow-lists, and exports exactly what the clusters import, each to those clusters.
- ``cluster-<name>`` has no JetStream and one user, ``leaf-<name>``, that its leaf
  server logs in as. It imports, from the control plane, what the roles running in a
  GPU cluster (``CLUSTER_ROLES``) may do there (``declaration(..., home=<name>)``):
  each publish grant as a **service** (a JetStream publish, API call or ack is a
  request whose reply comes back through the import; a core publish simply arrives;
  the JetStream API under the prefix ``JS_API``),
  each subscribe grant that the cluster does not publish itself as a **stream**
  (cancels, mirrored checkpoints), and ``<inbox prefix>.>`` as a stream: where the
  control plane's JetStream delivers the cluster's push consumers (KV watches), which
  is why a cluster's processes use their own inbox prefix (``inbox_prefix``).
  Provisioning grants (``STREAM.CREATE``) are left out: the control plane creates the
  streams, and a stream created from a cluster could capture another's subjects.
- ``CONSUMER.MSG.NEXT`` services answer with a stream of messages (``response_type:
  stream``); every other reply is one message.
- ``SYS`` is the system account (``system_account``, written after the block): the
  servers' own monitoring and control subjects (``$SYS.>``: ``nats server report
  jetstream``, ``nats server ls``), one user, ``sys``, the operators'; no service uses
  it. It is generated with the rest, the line naming it too, so every server that runs
  these accounts (the Kubernetes hub, compose's leaf override, ``tandem dev up
  --topology leaf --auth``) has it, and no config can name a system account the block
  lacks (nats-server accepts that without a word, and nobody logs in to it) or hold a
  ``SYS`` that is not the system account (a user that sees nothing of ``$SYS``).

What an import cannot express is not granted, and ``docs/security.md`` says what holds.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from tandem.common import permissions, subjects
from tandem.common.permissions import ADMIN, API, CLIENT, CONTROL

CONTROL_ACCOUNT = "control-plane"
SYS_ACCOUNT = "SYS"  # the system account (``system_account``)
SYS_USER = "sys"  # its one user: operators' `nats server` commands
# The prefix a cluster's processes reach the control plane's JetStream API by
# (``TANDEM_NATS_JS_API_PREFIX``). Not ``$JS.API``: nats-server answers that in every
# account itself ("JetStream not enabled for account", racing the import's answer), and
# not the ``$JS.<domain>.API`` form, which the hub maps back to ``$JS.API``.
JS_API = "JS.control-plane.API"
# The roles whose processes run in a GPU cluster, behind its leaf (stack.toml's per-node
# processes); the others run in the control plane.
CLUSTER_ROLES = ("inference-worker", "cluster-agent")
CONTROL_ROLES = ("gateway", "trainer", "checkpointer", CLIENT, ADMIN)


@dataclass(frozen=True)
class Import:
    """What a cluster account takes from the control plane's account."""

    kind: str  # "service" (request/reply, or a publish that goes there) or "stream"
    subject: str
    response: str | None = None  # "stream": the reply is several messages (a pull)
    to: str | None = None  # the subject the cluster uses for it, if not ``subject``


def account(cluster: str) -> str:
    return f"cluster-{subjects.token(cluster, 'cluster')}"


def leaf_user(cluster: str) -> str:
    """The user a cluster's leaf server logs in to the hub as (bound to its account)."""
    return f"leaf-{subjects.token(cluster, 'cluster')}"


def inbox_prefix(cluster: str) -> str:
    """``_INBOX_<cluster>``: the inbox prefix of a cluster's processes (their push
    deliveries are imported by this prefix, so no cluster receives another's)."""
    return f"_INBOX_{subjects.token(cluster, 'cluster')}"


def users(clusters: Sequence[str]) -> list[str]:
    """Every user of the layout: the control-plane roles', each cluster's trainer and
    checkpointer users (in the control plane's account), each cluster's leaf and the
    system account's ``sys``."""
    return [*CONTROL_ROLES, *permissions.cluster_users(clusters),
            *(leaf_user(c) for c in clusters), SYS_USER]


def covers(pattern: str, subject: str) -> bool:
    """Whether every subject ``subject`` matches is matched by ``pattern`` too (both may
    hold wildcards: ``*`` one token, ``>`` one or more trailing tokens)."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or s[i] == ">" or (tok != "*" and (s[i] == "*" or tok != s[i])):
            return False
    return len(p) == len(s)


def _prune(patterns: set[str]) -> list[str]:
    """Drop each pattern another one covers: overlapping service imports would deliver a
    request twice (and answer it twice)."""
    return sorted(p for p in patterns
                  if not any(o != p and covers(o, p) for o in patterns))


def _provisioning(subject: str) -> bool:
    return subject.startswith(f"{API}.STREAM.CREATE.")


def _to(subject: str) -> str | None:
    """Where a cluster sends what the control plane serves on ``subject``: the JetStream
    API under ``JS_API``, KV writes as ``<JS_API>.$KV...`` (how nats clients write KV
    under an API prefix); everything else, acks included, as it is."""
    if subject.startswith(f"{API}."):
        return JS_API + subject[len(API):]
    if subject.startswith("$KV."):
        return f"{JS_API}.{subject}"
    return None


def imports(clusters: Sequence[str], home: str, control: str = CONTROL) -> list[Import]:
    """What cluster ``home``'s account imports, from its roles' declaration."""
    roles = permissions.declaration(clusters, control, home=home)
    pub = {p for r in CLUSTER_ROLES for p in roles[r].publish if not _provisioning(p)}
    # Their replies come on the cluster's own inbox prefix (below), not the role's.
    sub = {s for r in CLUSTER_ROLES for s in roles[r].subscribe
           if s not in permissions.reply_grants(r)}
    services = _prune(pub)
    out = [Import("service", s, "stream" if ".CONSUMER.MSG.NEXT." in s else None, _to(s))
           for s in services]
    # What the cluster publishes itself (models.<home>.*) it hears locally already.
    out += [Import("stream", s) for s in _prune(sub)
            if not any(covers(p, s) for p in services)]
    out.append(Import("stream", f"{inbox_prefix(home)}.>"))
    return out


def accounts_config(clusters: Sequence[str], passwords: Mapping[str, str] | None = None,
                    control: str = CONTROL, header: str = "", *,
                    add: Mapping[str, str] | None = None, drop: Collection[str] = ()) -> str:
    """The hub's ``accounts`` block: the control plane's, one per cluster and the
    system account ``SYS``, then the ``system_account`` line that makes it so.

    ``passwords`` maps each of ``users(clusters)`` to its password; one missing is
    read from nats-server's environment (``$TANDEM_NATS_PASSWORD_<USER>``). ``add`` and
    ``drop``: logins to add (``new: old``, in ``old``'s account with its grants) and
    users to leave out, a password's rotation (``permissions.with_logins``).

    Raises ValueError naming a login that is already a user or is no valid token, and
    an ``old`` or a dropped user that is none.
    """
    clusters = [subjects.token(c, "cluster") for c in clusters]
    passwords = passwords or {}
    add = dict(add or {})
    # The users with no permissions but their account's (each leaf's, sys): a login of
    # one is in the same account.
    bound = {**{leaf_user(c): account(c) for c in clusters}, SYS_USER: SYS_ACCOUNT}
    for name in add:  # a leaf's login, too: its name is in its password's variable
        subjects.token(name, "user")
    if taken := sorted(set(add) & set(users(clusters))):
        raise ValueError(f"login {', '.join(map(repr, taken))} is already a user")
    roles = permissions.declaration(clusters, control)
    # The control plane's users and their logins (with_logins checks the names).
    control_users = permissions.with_logins(
        {**{r: roles[r] for r in CONTROL_ROLES}, **permissions.cluster_users(clusters)},
        {n: o for n, o in add.items() if o not in bound}, set(drop) - set(bound))
    logins = {acc: [u for u in (user, *(n for n, o in add.items() if o == user))
                    if u not in drop] for user, acc in bound.items()}
    by_cluster = {c: imports(clusters, c, control) for c in clusters}
    exports: dict[Import, list[str]] = {}
    for c, imps in by_cluster.items():
        for imp in imps:
            exports.setdefault(replace(imp, to=None), []).append(account(c))

    def q(v: str) -> str:
        return permissions.quoted(v)

    def entries(acc: str) -> str:
        return ", ".join(
            f"{{ user: {q(u)}, password: "
            f"{q(passwords[u]) if u in passwords else '$' + permissions.password_env(u)} }}"
            for u in logins[acc])

    lines = [f"# {line}".rstrip() for line in header.splitlines()]
    lines += ["accounts {", f"  {q(CONTROL_ACCOUNT)}: {{", "    jetstream: enabled",
              "    users: [", *permissions.users_config(control_users, passwords, "      "),
              "    ]", "    exports: ["]
    for imp, accounts in sorted(exports.items(), key=lambda e: (e[0].kind, e[0].subject)):
        rt = f", response_type: {imp.response}" if imp.response else ""
        lines.append(f"      {{ {imp.kind}: {q(imp.subject)}, accounts: "
                     f"[{', '.join(q(a) for a in accounts)}]{rt} }}")
    lines += ["    ]", "  }"]
    for c in clusters:
        lines += [f"  {q(account(c))}: {{", f"    users: [ {entries(account(c))} ]",
                  "    imports: ["]
        lines += [f"      {{ {imp.kind}: {{ account: {q(CONTROL_ACCOUNT)}, "
                  f"subject: {q(imp.subject)} }}{f', to: {q(imp.to)}' if imp.to else ''} }}"
                  for imp in by_cluster[c]]
        lines += ["    ]", "  }"]
    # The servers' own subjects ($SYS.>), for operators' `nats server` commands; it
    # exports nothing to Tandem's accounts and imports nothing from them.
    lines += [f"  {q(SYS_ACCOUNT)}: {{", f"    users: [ {entries(SYS_ACCOUNT)} ]", "  }",
              "}", f"system_account: {q(SYS_ACCOUNT)}", ""]
    return "\n".join(lines)


COMPOSE_HEADER = (
    "Generated from tandem.common.accounts (the leaf topology's NATS accounts, from the\n"
    "permissions declaration): do not edit. Regenerate with\n"
    "  tandem security nats-config --accounts --clusters east,west > deploy/nats/accounts.conf\n"
    "compose.leaf.yaml mounts it in place of auth.conf. Passwords come from nats-server's\n"
    "environment: TANDEM_NATS_PASSWORD_<USER>.")


def compose_config() -> str:
    """What ``deploy/nats/accounts.conf`` must hold (checked by a test)."""
    return accounts_config(permissions.COMPOSE_CLUSTERS, header=COMPOSE_HEADER)
