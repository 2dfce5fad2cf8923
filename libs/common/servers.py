"""Real local servers as child processes: nats-server (single or clustered) and S3 (moto).

Used by ``tandem dev up``, the benchmarks and the test fixtures alike, so the way a
server is started, checked for readiness, killed with SIGKILL and restarted is written
once. Readiness always comes from the server itself (its ``/healthz``), never a sleep.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tandem.common.errors import ServerStartError


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when something listens on ``port`` (TIME_WAIT leftovers do not count,
    as servers bind with SO_REUSEADDR)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _binary(name: str) -> str:
    """A console script installed beside this interpreter, else one on PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if not found:
        raise ServerStartError(name, f"{name} not found: install tandem[local]")
    return found


def _wait_http(url: str, deadline: float, proc: subprocess.Popen[bytes], what: str,
               log_path: Path | None = None) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = ""
            if log_path and log_path.exists():
                tail = log_path.read_text(errors="replace")[-2000:]
            raise ServerStartError(what, f"exited with code {proc.returncode}: {tail}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status < 500:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code < 500:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.05)  # polling the server's own readiness endpoint
    raise ServerStartError(what, f"not ready at {url} in time")


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used, from /proc/<pid>/stat."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


@dataclass
class Process:
    """A child server process that can be stopped, killed (-9) and restarted."""

    name: str
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cpu_seconds(self) -> float:
        """CPU seconds (user + system) the process has used so far; 0 if it is gone."""
        return proc_cpu(self.pid or 0)

    def _spawn(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log_path, "ab")  # the child owns it
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})},
                                     start_new_session=True)
        out.close()

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown, no flush."""
        if self.running:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 10) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class NatsServer(Process):
    """One nats-server with JetStream and a file store."""

    port: int = 0
    monitor_port: int = 0
    store_dir: Path = Path(".tandem/nats")
    host: str = "127.0.0.1"
    config_path: Path | None = None
    extra_args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 20) -> NatsServer:
        if not self.port:
            self.port = free_port(self.host)
        if not self.monitor_port:
            self.monitor_port = free_port(self.host)
        for p, what in ((self.port, "client"), (self.monitor_port, "monitoring")):
            if port_in_use(p, self.host):
                raise ServerStartError(
                    "nats-server", f"{what} port {self.host}:{p} is already in use "
                    "(another nats-server or `tandem dev up` running? "
                    "stop it or pick another port)")
        argv = [_binary("nats-server"), "-a", self.host, "-p", str(self.port),
                "-m", str(self.monitor_port), "-n", self.name]
        if self.config_path is not None:
            argv += ["-c", str(self.config_path)]
        else:
            argv += ["-js", "-sd", str(self.store_dir)]
        self._spawn(argv + self.extra_args)
        assert self.proc is not None
        _wait_http(f"http://{self.host}:{self.monitor_port}/healthz?js-enabled-only=true",
                   time.monotonic() + timeout, self.proc, "nats-server", self.log_path)
        return self

    def restart(self, timeout: float = 20) -> NatsServer:
        self.stop()
        return self.start(timeout)

    def wait_jetstream(self, timeout: float = 30) -> None:
        """Wait until this server reports JetStream healthy (meta leader known in a cluster)."""
        assert self.proc is not None
        _wait_http(f"http://{self.host}:{self.monitor_port}/healthz",
                   time.monotonic() + timeout, self.proc, "nats-server", self.log_path)


@dataclass
class NatsCluster:
    """A JetStream cluster of ``size`` nats-servers on loopback, routes between them.

    With ``domain`` its JetStream answers as that domain too (``$JS.<domain>.API``);
    with ``leafnodes`` every server accepts leaf-node connections (``leaf_urls``), which
    is how ``Topology`` puts GPU clusters' leaf servers in front of it. ``ports`` fixes
    the (client, monitoring) ports of the first servers; 0 or missing picks free ones.
    A cluster of one is a single server (no cluster block).
    """

    root: Path
    size: int = 3
    name: str = "tandem"
    servers: list[NatsServer] = field(default_factory=list)
    domain: str = ""
    leafnodes: bool = False
    ports: list[tuple[int, int]] = field(default_factory=list)
    leaf_ports: list[int] = field(default_factory=list)
    max_consumers: int = 0  # per stream; 0 keeps nats-server's default (1,000 since 2.15)

    def start(self, timeout: float = 30) -> NatsCluster:
        host = "127.0.0.1"
        cports = [free_port(host) for _ in range(self.size)]
        routes = ", ".join(f"nats-route://{host}:{p}" for p in cports)
        if self.leafnodes:
            self.leaf_ports = [free_port(host) for _ in range(self.size)]
        for i in range(self.size):
            name = f"n{i}"
            conf = self.root / f"{name}.conf"
            store = self.root / name / "js"
            conf.parent.mkdir(parents=True, exist_ok=True)
            domain = f", domain: {self.domain}" if self.domain else ""
            if self.max_consumers:
                domain += f", limits: {{ default_max_consumers: {self.max_consumers} }}"
            text = (f"server_name: {name}\n"
                    f"jetstream {{ store_dir: \"{store}\"{domain} }}\n")
            if self.size > 1:
                text += (f"cluster {{ name: {self.name}, listen: \"{host}:{cports[i]}\", "
                         f"routes: [{routes}] }}\n")
            if self.leafnodes:
                text += f"leafnodes {{ listen: \"{host}:{self.leaf_ports[i]}\" }}\n"
            conf.write_text(text)
            port, monitor = self.ports[i] if i < len(self.ports) else (0, 0)
            srv = NatsServer(name=name, log_path=self.root / f"{name}.log", store_dir=store,
                             config_path=conf, port=port, monitor_port=monitor)
            self.servers.append(srv)
        for srv in self.servers:
            srv.start(timeout)
        for srv in self.servers:
            srv.wait_jetstream(timeout)
        return self

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def url(self) -> str:
        return ",".join(self.urls)

    @property
    def leaf_urls(self) -> list[str]:
        """Where leaf-node servers connect (``leafnodes=True``)."""
        return [f"nats-leaf://127.0.0.1:{p}" for p in self.leaf_ports]

    def by_name(self, name: str) -> NatsServer:
        return next(s for s in self.servers if s.name == name)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()


@dataclass
class LeafNode(NatsServer):
    """A GPU cluster's leaf-node server in front of the control-plane cluster.

    That cluster's services connect here; the leaf relays their traffic to the hub
    (``remotes``: every hub server's leaf-node URL, so it fails over between them). It
    has no JetStream of its own, so nothing is stored in the GPU cluster and a dead
    leaf takes no queue with it. Its clients reach the hub's JetStream by its domain
    (``TANDEM_NATS_JS_DOMAIN``), as the NATS docs prescribe across a leaf connection.
    ``start`` returns once the leaf connection to the hub is up, not just the server.
    """

    remotes: list[str] = field(default_factory=list)

    def start(self, timeout: float = 20) -> LeafNode:
        if not self.remotes:
            raise ServerStartError(self.name, "a leaf node needs the hub's leaf-node URLs")
        conf = self.log_path.with_name(f"{self.name}.conf")
        conf.parent.mkdir(parents=True, exist_ok=True)
        urls = ", ".join(f'"{u}"' for u in self.remotes)
        conf.write_text(f"server_name: {self.name}\n"
                        f"leafnodes {{ remotes: [ {{ urls: [{urls}] }} ] }}\n")
        self.config_path = conf
        super().start(timeout)
        self.wait_connected(timeout)
        return self

    def restart(self, timeout: float = 20) -> LeafNode:
        self.stop()
        return self.start(timeout)

    def connected(self) -> bool:
        """Whether this server's leaf connection to the hub is up (from its /leafz)."""
        import json

        try:
            with urllib.request.urlopen(
                    f"http://{self.host}:{self.monitor_port}/leafz", timeout=1) as resp:
                return int(json.loads(resp.read()).get("leafnodes", 0)) > 0
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
            return False

    def wait_connected(self, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while not self.connected():
            if not self.running:
                raise ServerStartError(self.name, f"exited: see {self.log_path}")
            if time.monotonic() > deadline:
                raise ServerStartError(self.name, f"no leaf connection to {self.remotes} "
                                       f"within {timeout:g}s: see {self.log_path}")
            time.sleep(0.05)  # polling the server's own /leafz


@dataclass
class Topology:
    """The production shape on loopback: a control-plane JetStream cluster that holds
    every stream and KV bucket (JetStream domain ``domain``), and one ``LeafNode`` per
    GPU cluster through which that cluster's services reach it.

    Control-plane services (gateway, trainer, checkpointer) connect to ``hub_url``;
    a GPU cluster's agents and workers to ``url_for(cluster)`` with
    ``TANDEM_NATS_JS_DOMAIN=<domain>`` (``env_for`` gives both).
    """

    root: Path
    clusters: list[str]
    hub_size: int = 3
    domain: str = "hub"
    hub_ports: list[tuple[int, int]] = field(default_factory=list)
    # NOTE: every node's agent watches its drain key (one ordered consumer on KV_drains
    # each), so a fleet over 1,000 nodes needs more than nats-server's per-stream default.
    max_consumers: int = 10_000
    hub: NatsCluster | None = None
    leaves: dict[str, LeafNode] = field(default_factory=dict)

    def start(self, timeout: float = 30) -> Topology:
        try:
            self.hub = NatsCluster(root=self.root / "hub", size=self.hub_size,
                                   domain=self.domain, leafnodes=True,
                                   ports=self.hub_ports,
                                   max_consumers=self.max_consumers).start(timeout)
            for c in self.clusters:
                leaf = LeafNode(name=f"leaf-{c}", log_path=self.root / f"leaf-{c}.log",
                                remotes=self.hub.leaf_urls)
                self.leaves[c] = leaf
                leaf.start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def hub_url(self) -> str:
        assert self.hub is not None, "start() first"
        return self.hub.url

    def leaf(self, cluster: str) -> LeafNode:
        try:
            return self.leaves[cluster]
        except KeyError:
            raise KeyError(f"no leaf node for cluster {cluster!r}; clusters: "
                           f"{', '.join(self.leaves)}") from None

    def url_for(self, cluster: str | None) -> str:
        """The NATS URL of ``cluster``'s services (its leaf), or the hub's for None."""
        return self.hub_url if cluster is None else self.leaf(cluster).url

    def env_for(self, cluster: str | None) -> dict[str, str]:
        """``TANDEM_*`` values that connect a process of ``cluster`` (None: control plane)."""
        if cluster is None:
            return {"nats_url": self.hub_url}
        return {"nats_url": self.url_for(cluster), "nats_js_domain": self.domain}

    @property
    def servers(self) -> list[NatsServer]:
        """Every nats-server of the topology: the hub's, then the leaves."""
        return [*(self.hub.servers if self.hub else []), *self.leaves.values()]

    def stop(self) -> None:
        for leaf in self.leaves.values():
            leaf.stop()
        if self.hub is not None:
            self.hub.stop()


@dataclass
class S3Server(Process):
    """moto's standalone S3 server. In-memory: a restart starts empty."""

    port: int = 0
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30) -> S3Server:
        if not self.port:
            self.port = free_port(self.host)
        if port_in_use(self.port, self.host):
            raise ServerStartError("s3", f"port {self.host}:{self.port} is already in use")
        self._spawn([_binary("moto_server"), "-H", self.host, "-p", str(self.port)],
                    env={"AWS_ACCESS_KEY_ID": "tandem", "AWS_SECRET_ACCESS_KEY": "tandem"})
        assert self.proc is not None
        _wait_http(f"{self.url}/moto-api/", time.monotonic() + timeout, self.proc, "s3",
                   self.log_path)
        return self

    def restart(self, timeout: float = 30) -> S3Server:
        self.stop()
        return self.start(timeout)


def stop_all(procs: list[Process]) -> None:
    for p in procs:
        with contextlib.suppress(Exception):
            p.stop()
