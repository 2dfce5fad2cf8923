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
        "tandem.common.permissions: one user per service role, plus admin. Passwords are "
        "read by nats-server from TANDEM_NATS_PASSWORD_<ROLE> in its environment.")
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
    clusters = token_list(args.clusters, "cluster")
    if not clusters:
        print("tandem security nats-config: --clusters names no cluster; give at least one "
              "(e.g. east,west)", file=sys.stderr)
        return 2
    roles = permissions.declaration(clusters, args.control)
    compose = (tuple(clusters) == permissions.COMPOSE_CLUSTERS
               and args.control == permissions.CONTROL)
    if args.accounts:
        print(accounts.compose_config() if compose
              else accounts.accounts_config(clusters, control=args.control), end="")
    elif args.roles:
        print(json.dumps({n: {"publish": r.publish, "subscribe": r.subscribe}
                          for n, r in roles.items()}, indent=2))
    elif compose:
        print(permissions.compose_config(), end="")
    else:
        print(permissions.nats_config(roles), end="")
    return 0


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
