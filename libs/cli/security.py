"""``tandem security``: NATS permissions config, gateway API keys, local TLS certificates."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tandem.common import accounts, permissions
from tandem.common.subjects import token_list


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("security", help="NATS permissions, API keys, TLS certificates",
                       description="Least-privilege NATS users, gateway API keys and "
                       "local TLS certificates (see docs/security.md).")
    cmd = p.add_subparsers(dest="security_command", metavar="<command>", required=True)

    nc = cmd.add_parser(
        "nats-config", help="print the nats-server authorization block",
        description="Print the nats-server `authorization` block generated from "
        "tandem.common.permissions: one user per service role, plus admin, and each GPU "
        "cluster's trainer-<cluster> and checkpointer-<cluster>. Passwords are read by "
        "nats-server from TANDEM_NATS_PASSWORD_<USER> in its environment. --add-login and "
        "--drop rotate a password: add user B, roll clients, remove user A "
        "(docs/security.md).")
    nc.add_argument("--clusters", default=",".join(permissions.COMPOSE_CLUSTERS),
                    help="comma-separated GPU clusters (default: east,west)")
    nc.add_argument("--control", default=permissions.CONTROL,
                    help="cluster name of the control plane's trainer (default: control)")
    nc.add_argument("--roles", action="store_true",
                    help="print each role's allow-lists as JSON instead")
    nc.add_argument("--accounts", action="store_true",
                    help="print the leaf topology's accounts block instead: one account per "
                    "cluster (its leaf's login) and one for the control plane "
                    "(tandem.common.accounts; deploy/nats/accounts.conf)")
    nc.add_argument("--add-login", action="append", default=[], metavar="NEW=OLD",
                    help="add user NEW with OLD's grants, in OLD's account (repeatable)")
    nc.add_argument("--drop", action="append", default=[], metavar="USER",
                    help="leave user USER out (repeatable)")
    nc.set_defaults(func=_nats_config)

    key = cmd.add_parser(
        "api-key", help="make a gateway API key (printed once) and its config entry",
        description="Print a new random API key and the JSON entry for TANDEM_API_KEYS "
        "(or the keys file), which holds only the key's SHA-256.")
    key.add_argument("--name", required=True, help="who holds the key (a token)")
    key.add_argument("--scopes", default="generate",
                     help="comma-separated: generate, train, admin (default: generate)")
    key.add_argument("--rate", type=float, help="requests/s (default: TANDEM_RATE_LIMIT)")
    key.add_argument("--burst", type=int, help="burst (default: TANDEM_RATE_BURST)")
    key.add_argument("--max-streams", type=int, help="open SSE streams")
    key.add_argument("--max-runs", type=int, help="unfinished training runs")
    key.set_defaults(func=_api_key)

    certs = cmd.add_parser(
        "certs", help="write a throwaway local CA, a server and a client certificate "
        "(local use only; they expire after 30 days)",
        description="Write ca.pem, server.pem/.key (localhost, 127.0.0.1) and "
        "client.pem/.key: for TLS to a local nats-server and HTTPS on the gateway. "
        "For local use only: a fresh CA each time, and every certificate expires after "
        "30 days. Not for a deployment: its hub certificate comes from cert-manager or "
        "your own CA (docs/deploy.md).")
    certs.add_argument("folder", type=Path)
    certs.add_argument("--hosts", default="localhost,127.0.0.1",
                       help="names and addresses of the server certificate")
    certs.set_defaults(func=_certs)


def _nats_config(args: argparse.Namespace) -> int:
    try:
        print(_nats_config_text(args), end="")
    except ValueError as exc:  # a bad cluster, login or user name: InvalidToken too
        print(f"tandem security nats-config: {exc}", file=sys.stderr)
        return 2
    return 0


def _nats_config_text(args: argparse.Namespace) -> str:
    """What ``nats-config`` prints. Raises ValueError naming what was wrong."""
    clusters = token_list(args.clusters, "cluster")
    if not clusters:
        raise ValueError("--clusters names no cluster; give at least one (e.g. east,west)")
    add = _logins(args.add_login)
    # The committed files (deploy/nats) are these with their header; a rotation's not.
    compose = (tuple(clusters) == permissions.COMPOSE_CLUSTERS
               and args.control == permissions.CONTROL and not add and not args.drop)
    if args.accounts:
        return (accounts.compose_config() if compose else accounts.accounts_config(
            clusters, control=args.control, add=add, drop=args.drop))
    users = permissions.users(clusters, args.control)
    if layout := sorted(({*add.values(), *args.drop} - set(users))
                        & set(accounts.users(clusters))):
        raise ValueError(f"{', '.join(map(repr, layout))}: a user of the accounts layout "
                         "only: add --accounts")
    users = permissions.with_logins(users, add, args.drop)
    if args.roles:
        return json.dumps({n: {"publish": r.publish, "subscribe": r.subscribe}
                           for n, r in users.items()}, indent=2) + "\n"
    return permissions.compose_config() if compose else permissions.nats_config(users)


def _logins(pairs: list[str]) -> dict[str, str]:
    """``--add-login NEW=OLD`` values as ``{NEW: OLD}``. Raises ValueError on a value that
    is not one such pair, or a NEW given twice."""
    out: dict[str, str] = {}
    for pair in pairs:
        new, sep, old = (p.strip() for p in pair.partition("="))
        if not (sep and new and old) or "=" in old:
            raise ValueError(f"--add-login {pair!r}: give NEW=OLD, e.g. "
                             "trainer-east-2=trainer-east")
        if out.setdefault(new, old) != old:
            raise ValueError(f"--add-login: login {new!r} given twice "
                             f"({out[new]!r} and {old!r})")
    return out


def _api_key(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from tandem.gateway.auth import ApiKey, hash_key, new_key

    key = new_key()
    try:
        entry = ApiKey(name=args.name, sha256=hash_key(key),
                       scopes=tuple(s.strip() for s in args.scopes.split(",") if s.strip()),
                       rate=args.rate, burst=args.burst, max_streams=args.max_streams,
                       max_runs=args.max_runs)
    except ValidationError as exc:
        for e in exc.errors():
            print(f"tandem security api-key: {'.'.join(map(str, e['loc']))}: {e['msg']}",
                  file=sys.stderr)
        return 2
    print(f"key (shown once; give it to {args.name}): {key}")
    print("entry for TANDEM_API_KEYS / the keys file:")
    print(entry.model_dump_json(exclude_none=True))
    return 0


def _certs(args: argparse.Namespace) -> int:
    from tandem.cli.certs import dev_certs

    try:
        files = dev_certs(args.folder, tuple(h.strip() for h in args.hosts.split(",")))
    except OSError as exc:
        print(f"tandem security certs: cannot write {exc.filename or args.folder}: "
              f"{exc.strerror}", file=sys.stderr)
        return 2
    for what, path in vars(files).items():
        print(f"{what:<12} {path}")
    return 0
