"""The local stack: real servers plus every built service, as supervised child processes.

``Stack`` starts a nats-server (JetStream, file store under the stack's root), moto's S3
server with the bucket created, provisions the shared streams and KV buckets, then one
child process per entry of the process list (``stack.toml``: clusters and process kinds
are data). Each child's output lines are copied to one sink prefixed with its name
(``[east/worker-0] ...``) and to ``<root>/logs/<name>.log``.

It is the one supervisor behind ``tandem dev up``, ``tandem demo``, the benchmarks and
the failover tests: ``kill("east")`` SIGKILLs every process of cluster east as a crash
would, ``restart("east")`` brings them back, ``stop()`` leaves nothing behind.

Stopping order: services first (SIGTERM so they drain, SIGKILL to the process group of
any straggler after ``grace``), then S3 and NATS. A service's own children (trainer
ranks) share its process group, so a kill never orphans them.

A little past ~450 lines: ``Stack`` is one supervisor whose start order, per-cluster
kill and restart, and stop order share its state; the process list is
``tandem.cli.stack_config``, one supervised child ``tandem.cli.supervise``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Literal

from tandem.cli import http
from tandem.cli.devstack import NatsServer, S3Server, free_port, port_in_use
from tandem.cli.stack_config import ProcessKind, StackConfig
from tandem.cli.supervise import Child, Output, ProcessSpec, stop_children
from tandem.cli.topology import Topology
from tandem.common.errors import ServerStartError, SettingsError, StreamConflict
from tandem.common.permissions import ADMIN
from tandem.common.settings import Settings, load
from tandem.common.streams import ConsumerSpec, cluster_streams, core_streams

HOST = "127.0.0.1"
S3_KEY = "tandem"  # moto accepts any credentials; services still need some

# What the port-in-use message suggests, per configured port.
_PORT_FLAGS = {"nats": "--nats-port", "nats_monitor": "--nats-monitor-port",
               "s3": "--s3-port", "gateway": "--gateway-port"}


class Cancelled(Exception):
    """``Stack.start`` was interrupted (Ctrl-C / SIGTERM) before the stack was up."""


# ------------------------------------------------------------------------------------ the stack


def module_of(service: str) -> str:
    return "tandem." + service.replace("-", "_")


def built_services(services: list[str]) -> tuple[list[str], dict[str, str]]:
    """Split ``services`` into those whose ``tandem.<svc>.service`` imports and the rest.

    The rest map to why: "not built yet" when the module does not exist, else the error.
    """
    from tandem.cli.run import service_class

    built: list[str] = []
    missing: dict[str, str] = {}
    for svc in dict.fromkeys(services):
        target = f"{module_of(svc)}.service"
        try:
            service_class(svc)
        except ModuleNotFoundError as exc:
            missing[svc] = ("not built yet" if exc.name and target.startswith(exc.name)
                            else f"cannot import: {exc}")
        except Exception as exc:
            missing[svc] = f"cannot import: {exc!r}"
        else:
            built.append(svc)
    return built, missing


class Stack:
    """The local stack. ``start()`` → use it → ``stop()`` (or use it as a context manager).

    The methods block (starting waits for health, stopping for drains); from async code
    they work as they are, or without stalling the loop via ``asyncio.to_thread``.
    """

    def __init__(self, config: StackConfig, root: Path, sink: IO[str] | None = None, *,
                 fresh: bool = False, log_format: str | None = None, grace: float = 15.0,
                 tail_servers: tuple[str, ...] = ("nats",), auth: bool = False,
                 topology: Literal["single", "leaf"] = "single") -> None:
        self.config = config
        # topology "leaf": a 3-server control-plane cluster holds the streams; each GPU
        # cluster's processes connect through its own leaf-node server (servers.Topology).
        self.topology_kind = topology
        self.topology: Topology | None = None
        # auth: nats-server runs with tandem.common.permissions' users, each service
        # connects as its own role, provisioning and settings() as admin.
        self.auth = auth
        self.passwords: dict[str, str] = {}
        # The gateway seals what it enqueues and the workers check (tasks.seal): one
        # fresh key per stack, so a task sealed by another stack's gateway is read first.
        self.seal_key = secrets.token_hex(16)
        self.root = Path(root)
        self.out = Output(sink or sys.stdout)
        self.fresh = fresh
        self.grace = grace
        self.tail_servers = tail_servers
        self.log_format = log_format or ("console" if (sink or sys.stdout).isatty() else "json")
        self.ports: dict[str, int] = dict(config.ports)  # the live ones once started
        self.nats: NatsServer | None = None
        self.s3: S3Server | None = None
        self.children: dict[str, Child] = {}
        self.missing: dict[str, str] = {}
        self._tail_stop = threading.Event()
        self._stopped = False

    # -------------------------------------------------------------------------------- views

    @property
    def log_dir(self) -> Path:
        return self.root / "logs"

    @property
    def state_path(self) -> Path:
        return self.root / "stack.json"

    @property
    def nats_url(self) -> str:
        if self.topology is not None and self.topology.hub is not None:
            return self.topology.hub_url
        return f"nats://{HOST}:{self.ports['nats']}"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{HOST}:{self.ports['s3']}"

    def settings(self, **overrides: Any) -> Settings:
        """Settings that reach this stack's NATS and S3 (for in-process clients)."""
        values: dict[str, Any] = dict(
            nats_url=self.nats_url, s3_endpoint=self.s3_endpoint, s3_bucket=self.config.bucket,
            s3_access_key=S3_KEY, s3_secret_key=S3_KEY)
        if self.auth:
            values.update(nats_user=ADMIN, nats_password=self.passwords.get(ADMIN))
        values.update(overrides)
        return load(Settings, "stack", **values)

    def url(self, name: str) -> str | None:
        child = self.children.get(name)
        return child.spec.url if child else None

    def pids(self) -> dict[str, int]:
        out = {n: c.pid for n, c in self.children.items() if c.running and c.pid}
        for srv in (*self._nats_servers(), self.s3):
            if srv is not None and srv.running and srv.pid:
                out[srv.name] = srv.pid
        return out

    def _nats_servers(self) -> list[NatsServer | None]:
        """Every nats-server, in stopping order (leaves before the hub they relay to)."""
        if self.topology is not None:
            return list(reversed(self.topology.servers))
        return [self.nats]

    def select(self, target: str) -> list[Child]:
        """Children named ``target``: a process name, a cluster, a service, or ``all``."""
        if target in self.children:
            return [self.children[target]]
        found = [c for c in self.children.values()
                 if target in ("all", c.spec.cluster, c.spec.service)]
        if not found:
            raise KeyError(f"no process, cluster or service {target!r} in the stack; "
                           f"processes: {', '.join(self.children) or 'none'}")
        return found

    # -------------------------------------------------------------------------------- specs

    def specs(self, services: list[str] | None = None) -> list[ProcessSpec]:
        """Resolve the process list (only ``services`` when given) against the live ports."""
        names = [c.name for c in self.config.clusters]
        values = {f"{k}_port": str(v) for k, v in self.ports.items()}
        values.update(clusters=",".join(names), nats_url=self.nats_url,
                      s3_endpoint=self.s3_endpoint, bucket=self.config.bucket,
                      root=str(self.root.resolve()))
        out: list[ProcessSpec] = []
        for kind in self.config.processes:
            if services is not None and kind.service not in services:
                continue
            if kind.scope == "global":
                places = [(kind.name, kind.cluster, kind.name, 0)]
            else:
                places = [(f"{c.name}/{kind.name}-{i}", c.name, f"node-{i}", i)
                          for c in self.config.clusters for i in range(c.nodes)]
            for name, cluster, node, index in places:
                local = {**values, "cluster": cluster, "node": node, "index": str(index)}
                out.append(self._spec(kind, name, cluster, node, local))
        return out

    def _spec(self, kind: ProcessKind, name: str, cluster: str, node: str,
              values: dict[str, str]) -> ProcessSpec:
        def fmt(text: str, key: str) -> str:
            try:
                return text.format(**values)
            except (KeyError, IndexError, ValueError) as exc:
                raise SettingsError("stack config", {
                    f"processes.{kind.name}.{key}": f"{text!r}: unknown placeholder {exc}; "
                    f"known: {', '.join(sorted(values))}"}) from None

        metrics_port = free_port(HOST)
        env = dict(os.environ)  # a user's TANDEM_* (log level, ...) reach every service
        env.setdefault("TANDEM_LOG_FORMAT", self.log_format)
        env.setdefault("TANDEM_DRAIN_TIMEOUT", str(max(1.0, self.grace - 5)))
        # The workers' call ledger is this stack's: another stack's dead calls are not its.
        env.setdefault("TANDEM_CALLS_DIR", str(self.root / "calls"))
        env.update({
            "PYTHONUNBUFFERED": "1",
            "TANDEM_NATS_URL": self.nats_url,
            "TANDEM_STREAM_REPLICAS": "1",
            "TANDEM_S3_ENDPOINT": self.s3_endpoint,
            "TANDEM_S3_BUCKET": self.config.bucket,
            "TANDEM_S3_ACCESS_KEY": S3_KEY,
            "TANDEM_S3_SECRET_KEY": S3_KEY,
            "TANDEM_CLUSTER": cluster,
            "TANDEM_NODE": node,
            "TANDEM_METRICS_HOST": HOST,
            "TANDEM_METRICS_PORT": str(metrics_port),
            "TANDEM_TASK_SEAL_KEY": self.seal_key,
        })
        if self.topology is not None and cluster in self.topology.leaves:
            # Its leaf's URL and how it reaches the hub's JetStream. The leaf asks for no
            # user: under auth the leaf's own login puts it in its cluster's account.
            leaf = self.topology.env_for(cluster)
            env.update({f"TANDEM_{k.upper()}": v for k, v in leaf.items()})
        elif self.auth:
            env.update(TANDEM_NATS_USER=kind.service,
                       TANDEM_NATS_PASSWORD=self.passwords.get(kind.service, ""))
        env.update({f"TANDEM_{k.upper()}": fmt(str(v), f"env.{k}") for k, v in kind.env.items()})
        return ProcessSpec(
            name=name, argv=(sys.executable, "-m", module_of(kind.service)), env=env,
            service=kind.service, cluster=cluster,
            health_url=f"http://{HOST}:{metrics_port}/healthz",
            url=fmt(kind.url, "url") if kind.url else None)

    # ---------------------------------------------------------------------------- lifecycle

    def start(self, *, cancel: threading.Event | None = None, health_timeout: float = 90.0,
              services: list[str] | None = None) -> dict[str, str]:
        """Start servers, provision, start every built service; return health by process.

        Raises ``ServerStartError`` (a port in use names the port and the flag to change
        it) before starting anything, ``StreamConflict`` if the store holds streams of
        another shape (``fresh=True`` starts from an empty store), ``Cancelled`` when
        ``cancel`` is set meanwhile. On any error what was started is stopped again.
        """
        cancel = cancel or threading.Event()
        try:
            return self._start(cancel, health_timeout, services)
        except BaseException:
            self.stop()
            raise

    def _check(self, cancel: threading.Event) -> None:
        if cancel.is_set():
            raise Cancelled("interrupted while starting")

    def _start(self, cancel: threading.Event, health_timeout: float,
               services: list[str] | None) -> dict[str, str]:
        known = sorted({k.service for k in self.config.processes})
        if unknown := [s for s in services or () if s not in known]:
            raise SettingsError("--only", {", ".join(unknown): (
                f"not a service of the stack file; its services: {', '.join(known)}")})
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.ports = self._claim_ports()
        if self.fresh:
            import shutil

            shutil.rmtree(self.root / "nats", ignore_errors=True)
        if self.topology_kind == "leaf":
            # With auth: one NATS account per cluster and one for the control plane
            # (tandem.common.accounts), each leaf bound to its cluster's account.
            self.topology = Topology(self.root / "nats", [c.name for c in self.config.clusters],
                                     hub_ports=[(self.ports["nats"], self.ports["nats_monitor"])],
                                     accounts=self.auth, control=self._control())
            self._tail(self.root / "nats" / "hub" / "n0.log", "nats")
            self.topology.start()
            self.passwords = dict(self.topology.passwords)
            assert self.topology.hub is not None
            self.nats = self.topology.hub.servers[0]
            self._write_state()
        else:
            # Each server is recorded in stack.json as soon as it exists: a supervisor
            # killed while starting leaves nothing `tandem dev down` cannot find.
            self.nats = NatsServer(name="nats", log_path=self.log_dir / "nats.log",
                                   port=self.ports["nats"], monitor_port=self.ports["nats_monitor"],
                                   store_dir=self.root / "nats", host=HOST,
                                   config_path=self._auth_config("nats") if self.auth else None,
                                   spawned=self._write_state)
            self._tail(self.nats.log_path, "nats")
            self.nats.start()
        self._check(cancel)
        self.s3 = S3Server(name="s3", log_path=self.log_dir / "s3.log", port=self.ports["s3"],
                           host=HOST, spawned=self._write_state)
        self._tail(self.s3.log_path, "s3")
        self.s3.start()
        from tandem.common.storage import ensure_bucket, s3_client

        ensure_bucket(s3_client(self.settings()), self.config.bucket)
        self._check(cancel)
        created = _run_async(self._provision())
        self.out.line("stack", f"provisioned {', '.join(created) or 'nothing new'}")
        kinds = [k.service for k in self.config.processes
                 if services is None or k.service in services]
        built, self.missing = built_services(kinds)
        for spec in self.specs(built):
            self.children[spec.name] = Child(spec, self.out, self.log_dir)
        for child in self.children.values():
            child.start()
        self._write_state()
        return self.wait_healthy("all", health_timeout, cancel) if self.children else {}

    def _claim_ports(self) -> dict[str, int]:
        taken = {p for p in self.config.ports.values() if p}
        ports: dict[str, int] = {}
        for name, port in self.config.ports.items():
            if port == 0:
                port = free_port(HOST)
                while port in taken:
                    port = free_port(HOST)
                taken.add(port)
            elif port_in_use(port, HOST):
                flag = _PORT_FLAGS.get(name, f"ports.{name} in the stack file")
                raise ServerStartError(
                    name, f"{name} port {HOST}:{port} is already in use. Another "
                    f"`tandem dev up`? Stop it (`tandem dev down`), or pick another port "
                    f"with {flag} (0 picks a free one).")
            ports[name] = port
        return ports

    async def _provision(self) -> list[str]:
        """Streams and KV buckets only: consumers are each service's own to declare."""
        import nats

        from tandem.common.streams import provision

        specs = [s for s in core_streams(1) + cluster_streams(
            [c.name for c in self.config.clusters], 1) if not isinstance(s, ConsumerSpec)]
        auth = {"user": ADMIN, "password": self.passwords[ADMIN]} if self.auth else {}
        nc = await nats.connect(self.nats_url.split(","), connect_timeout=5,
                                max_reconnect_attempts=3,
                                **auth)
        try:
            return await provision(nc.jetstream(), specs)
        except StreamConflict as exc:
            raise StreamConflict(exc.kind, f"{exc.name} (in {self.root / 'nats'}; "
                                 "`--fresh` starts from an empty store)",
                                 exc.differences) from None
        finally:
            await nc.close()

    def _control(self) -> str:
        """The cluster name of the control plane's trainer (its durable's name)."""
        from tandem.common import permissions

        return next((k.cluster for k in self.config.processes if k.service == "trainer"),
                    permissions.CONTROL)

    def _auth_config(self, server_name: str) -> Path:
        """Write ``<root>/nats.conf`` (mode 0600): the server's name (so a SIGHUP reload of
        a regenerated one is accepted), JetStream plus every user of a deployment with
        its clusters (``permissions.users``: each role's, each cluster's trainer and
        checkpointer) with a fresh random password, from the one permissions declaration."""
        import secrets

        from tandem.common import permissions

        roles = permissions.users([c.name for c in self.config.clusters], self._control())
        self.passwords = {r: secrets.token_urlsafe(18) for r in roles}
        path = self.root / "nats.conf"
        path.touch(mode=0o600)
        path.chmod(0o600)
        path.write_text(permissions.server_config(str((self.root / "nats").resolve()), roles,
                                                  self.passwords, server_name=server_name))
        return path

    def _tail(self, path: Path, name: str) -> None:
        if name not in self.tail_servers:
            return
        offset = path.stat().st_size if path.exists() else 0

        def run() -> None:
            while not path.exists():
                if self._tail_stop.wait(0.2):
                    return
            with open(path, "rb") as f:
                f.seek(offset)
                while True:
                    raw = f.readline()
                    if raw.endswith(b"\n"):
                        self.out.line(name, raw.decode("utf-8", "replace").rstrip("\r\n"))
                        continue
                    f.seek(-len(raw), os.SEEK_CUR)  # a partial line: read it whole later
                    if self._tail_stop.wait(0.2):
                        return

        threading.Thread(target=run, daemon=True, name=f"tail-{name}").start()

    def wait_healthy(self, target: str = "all", timeout: float = 90.0,
                     cancel: threading.Event | None = None) -> dict[str, str]:
        """Poll each selected child's /healthz until it answers 200, exits, or time is up.

        Returns ``{name: "healthy" | "exited with code N" | "not healthy after Ts"}``.
        """
        pending = {c.name: c for c in self.select(target)}
        result: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        while pending:
            for name, child in list(pending.items()):
                if not child.running:
                    code = child.proc.returncode if child.proc else None
                    result[name] = f"exited with code {code}"
                elif child.spec.health_url is None or http.is_ok(child.spec.health_url):
                    result[name] = "healthy"
                else:
                    continue
                del pending[name]
            if not pending:
                break
            if time.monotonic() > deadline:
                result.update(dict.fromkeys(pending, f"not healthy after {timeout:g}s"))
                break
            if cancel is not None and cancel.wait(0.2):
                raise Cancelled("interrupted while waiting for services")
            if cancel is None:
                time.sleep(0.2)  # polling the services' own readiness endpoints
        return {c.name: result[c.name] for c in self.select(target)}

    def exits(self) -> list[tuple[str, int]]:
        """Children that exited since last asked (name, code): for the supervisor's log."""
        return [(c.name, code) for c in self.children.values()
                if (code := c.exit_news()) is not None]

    def kill(self, target: str) -> list[str]:
        """SIGKILL the selected processes (and their process groups); return their names."""
        chosen = self.select(target)
        for c in chosen:
            c.kill()
        self._write_state()
        return [c.name for c in chosen]

    def restart(self, target: str) -> dict[str, int]:
        """Stop (SIGTERM, then SIGKILL after grace) if running, start again; return new PIDs."""
        chosen = self.select(target)
        stop_children([c for c in chosen if c.running], self.grace)
        for c in chosen:
            c.start()
        self._write_state()
        return {c.name: c.pid or 0 for c in chosen}

    def stop(self) -> list[str]:
        """Stop everything; idempotent. Returns the names that needed SIGKILL."""
        if self._stopped:
            return []
        self._stopped = True
        killed = stop_children(list(self.children.values()), self.grace)
        for srv in (self.s3, *self._nats_servers()):
            if srv is not None:
                srv.stop()
                if srv.proc is not None:  # and anything it left in its group
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(srv.proc.pid, signal.SIGKILL)
        self._tail_stop.set()
        with contextlib.suppress(FileNotFoundError):
            self.state_path.unlink()
        return killed

    def _write_state(self) -> None:
        state = {"supervisor": os.getpid(), "root": str(self.root.resolve()),
                 "nats_url": self.nats_url, "s3_endpoint": self.s3_endpoint,
                 "processes": self.pids()}
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_path)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __iter__(self) -> Iterator[Child]:
        return iter(self.children.values())


def _run_async(coro: Any) -> Any:
    """Run ``coro`` to completion, also when called from inside a running event loop
    (an async benchmark or test that starts a stack): then on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
