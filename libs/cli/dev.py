"""``tandem dev``: the local stack in the foreground (``up``) and its clean-up (``down``).

``tandem dev up`` starts nats-server (JetStream, store under ``.tandem/nats``), an S3
endpoint (moto) with the bucket, provisions streams, then every built service for the
clusters of the stack file, each line prefixed with its process name. It prints
``[stack] ready: ...`` once every service answers /healthz (or the wait is over), and
runs until Ctrl-C, SIGTERM or SIGHUP (its terminal closed), which stop everything:
services first, then the servers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

from tandem.cli.stack import S3_KEY, Cancelled, Stack
from tandem.cli.stack_config import StackConfig
from tandem.common.errors import ServerStartError, SettingsError
from tandem.common.permissions import ADMIN, CLIENT

DEFAULT_ROOT = Path(".tandem")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dev", help="run the local stack (nats-server, S3, every service)",
                       description="The local development stack.")
    dev = p.add_subparsers(dest="dev_command", metavar="<dev command>", required=True)

    up = dev.add_parser(
        "up", help="start the local stack in the foreground; Ctrl-C stops it",
        description="Start nats-server (JetStream), an S3 endpoint (moto) with the bucket, "
        "and every built service for each cluster of the stack file (default: east and "
        "west), with log lines prefixed by process name. Ctrl-C, SIGTERM or SIGHUP stops "
        "them all.")
    add_stack_arguments(up)
    up.add_argument("--root", type=Path, default=DEFAULT_ROOT,
                    help="state folder: NATS store, logs, stack.json (default: .tandem)")
    up.add_argument("--nats-port", type=int, help="NATS client port (default 4222; 0: free)")
    up.add_argument("--nats-monitor-port", type=int,
                    help="NATS monitoring port (default 8222; 0: free)")
    up.add_argument("--s3-port", type=int, help="S3 endpoint port (default 9000; 0: free)")
    up.add_argument("--gateway-port", type=int, help="gateway HTTP port (default 8000; 0: free)")
    up.add_argument("--fresh", action="store_true",
                    help="start from an empty NATS store (deletes <root>/nats)")
    up.add_argument("--only", metavar="SERVICES",
                    help="comma-separated services to start (default: every built one)")
    up.add_argument("--auth", action="store_true",
                    help="NATS with one user per service (least-privilege permissions from "
                    "tandem.common.permissions, fresh passwords in <root>/nats.conf); with "
                    "--topology leaf, one NATS account per cluster, each leaf bound to its own")
    up.add_argument("--topology", choices=("single", "leaf"), default="single",
                    help="single: one nats-server (default); leaf: the production shape, a "
                    "3-server control-plane cluster holding the streams and one leaf-node "
                    "server per GPU cluster that its agents and workers connect through")
    up.add_argument("--health-timeout", type=float, default=90.0,
                    help="seconds to wait for services' /healthz before 'ready' (default 90)")
    up.set_defaults(func=_up)

    down = dev.add_parser(
        "down", help="stop a local stack started from another terminal or left behind",
        description="Stop the stack recorded in <root>/stack.json: SIGTERM its supervisor, "
        "or, if that is gone, its leftover processes.")
    down.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    down.add_argument("--timeout", type=float, default=30.0,
                      help="seconds to wait before SIGKILL (default 30)")
    down.set_defaults(func=_down)


def add_stack_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared by every command that starts a stack (dev up, demo)."""
    p.add_argument("--config", type=Path, default=None,
                   help="stack file (default: the bundled stack.toml)")
    p.add_argument("--clusters", metavar="NAMES",
                   help="comma-separated simulated clusters (default: the stack file's)")
    p.add_argument("--grace", type=float, default=15.0,
                   help="seconds a service gets to drain on stop before SIGKILL (default 15)")


def load_config(args: argparse.Namespace) -> StackConfig:
    config = StackConfig.load(args.config)
    if args.clusters:
        config = config.with_clusters([c.strip() for c in args.clusters.split(",") if c.strip()])
        if problems := config.problems():
            raise SettingsError("--clusters", problems)
    return config


def _up(args: argparse.Namespace) -> int:
    config = load_config(args).with_ports(
        nats=args.nats_port, nats_monitor=args.nats_monitor_port, s3=args.s3_port,
        gateway=args.gateway_port)
    refuse_if_running(args.root)
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    stop = threading.Event()

    def on_signal(sig: int, _frame: object) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # SIGHUP: terminal closed
        signal.signal(sig, on_signal)
    stack = Stack(config, args.root, fresh=args.fresh, grace=args.grace, auth=args.auth,
                  topology=args.topology)

    def say(msg: str) -> None:
        stack.out.line("stack", msg)

    say(f"starting in {args.root} (clusters: {', '.join(c.name for c in config.clusters)})")
    try:
        health = stack.start(cancel=stop, health_timeout=args.health_timeout, services=only)
    except Cancelled:
        say("interrupted while starting; everything started was stopped")
        return 130
    for line in summary(stack, health):
        say(line)
    if stack.auth:
        for line in credentials(stack.passwords):
            say(line)
    healthy = sum(state == "healthy" for state in health.values())
    if stack.children and all(state.startswith("exited") for state in health.values()):
        say(f"NOT READY: every service exited ({len(stack.children)}: see the lines above "
            f"and {stack.log_dir}); stopping")
        stack.stop()
        return 1
    say(f"ready: {healthy} of {len(stack.children)} service processes healthy; NATS "
        f"{stack.nats_url}, S3 {stack.s3_endpoint}; Ctrl-C stops everything")
    while not stop.wait(0.5):
        for name, code in stack.exits():
            say(f"{name} exited with code {code}; the others keep running")
    say("stopping: services first (SIGTERM, then SIGKILL after "
        f"{args.grace:.0f}s), then S3 and NATS")
    killed = stack.stop()
    say("stopped" + (f"; had to SIGKILL {', '.join(killed)}" if killed else " cleanly"))
    return 0


def credentials(passwords: dict[str, str]) -> list[str]:
    """The NATS users a person needs from ``dev up --auth`` (the rest are the services'),
    each with what it is for: ``admin`` for the CLI and trusted tools, ``client`` for a
    program outside Tandem (the job service, following jobs: docs/bus-api.md)."""
    lines = ["NATS auth on: each service is its own user; for the CLI and trusted tools, "
             "as admin (may do anything): export TANDEM_NATS_USER=admin "
             f"TANDEM_NATS_PASSWORD={passwords[ADMIN]}"]
    if CLIENT in passwords:
        lines.append("for a program outside Tandem (the job service tandem.jobs.*, "
                     "following jobs: docs/bus-api.md), as client: user client, "
                     f"password {passwords[CLIENT]}")
    return lines


def summary(stack: Stack, health: dict[str, str]) -> list[str]:
    """What runs where, what is unhealthy and what is not built: for the console."""
    lines = [f"NATS      {stack.nats_url}  (monitor http://127.0.0.1:"
             f"{stack.ports['nats_monitor']}, store {stack.root / 'nats'})",
             f"S3        {stack.s3_endpoint}  (bucket {stack.config.bucket}, in memory; for "
             f"the CLI: TANDEM_S3_ENDPOINT={stack.s3_endpoint} TANDEM_S3_ACCESS_KEY={S3_KEY} "
             f"TANDEM_S3_SECRET_KEY={S3_KEY})"]
    if stack.topology is not None:
        for cluster, leaf in stack.topology.leaves.items():
            how = (f"account cluster-{cluster} on the hub" if stack.topology.accounts
                   else f"JetStream domain {stack.topology.domain} in the hub")
            lines.append(f"leaf      {leaf.url}  ({cluster}'s services; {how})")
    for name, child in stack.children.items():
        where = f"  {child.spec.url}" if child.spec.url else ""
        lines.append(f"{name:<22} pid {child.pid:<7} {health.get(name, '?')}{where}")
    for svc, why in stack.missing.items():
        lines.append(f"{svc:<22} not started: {why}")
    lines.append(f"logs      {stack.log_dir}/<process>.log")
    return lines


# ------------------------------------------------------------------------------ stack.json


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):  # a zombie is dead for our purposes
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _ours(pid: int) -> bool:
    """Whether ``pid`` still runs one of our commands (PIDs get reused)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        return _alive(pid)
    return any(w in cmd for w in (b"tandem", b"nats-server", b"moto_server"))


def _read_state(root: Path) -> dict | None:
    try:
        return json.loads((root / "stack.json").read_text())
    except (OSError, ValueError):
        return None


def refuse_if_running(root: Path) -> None:
    """Fail clearly if a stack from ``root`` still runs; forget a stale record."""
    state = _read_state(root)
    if state is None:
        return
    sup = int(state.get("supervisor", 0))
    if sup and _alive(sup) and _ours(sup):
        raise ServerStartError("local stack", f"one is already running from {root} "
                               f"(supervisor pid {sup}); stop it with `tandem dev down`")
    left = [p for p in state.get("processes", {}).values() if _alive(p) and _ours(p)]
    if left:
        raise ServerStartError("local stack", f"processes of an earlier stack in {root} are "
                               f"still running (pids {left}); `tandem dev down` stops them")
    (root / "stack.json").unlink(missing_ok=True)


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)  # these are not our children: nothing to wait() on
    return left


def _down(args: argparse.Namespace) -> int:
    state = _read_state(args.root)
    if state is None:
        print(f"no local stack recorded in {args.root}/stack.json")
        return 0
    sup = int(state.get("supervisor", 0))
    if sup and _alive(sup) and _ours(sup):
        print(f"stopping the stack (supervisor pid {sup})")
        with contextlib.suppress(ProcessLookupError):
            os.kill(sup, signal.SIGTERM)
        if _wait_gone([sup], args.timeout):
            print(f"supervisor {sup} still running after {args.timeout:.0f}s; killing it")
            with contextlib.suppress(ProcessLookupError):  # it may end meanwhile
                os.kill(sup, signal.SIGKILL)
    pids = [p for p in state.get("processes", {}).values() if _alive(p) and _ours(p)]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    for pid in _wait_gone(pids, args.timeout):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    if pids:
        print(f"stopped {len(pids)} leftover processes")
    (args.root / "stack.json").unlink(missing_ok=True)
    print("local stack stopped")
    return 0
