"""Multi-server NATS on loopback: a JetStream cluster, leaf-node servers, and the
production topology (a control-plane cluster with one leaf per GPU cluster).

Dev infrastructure like ``tandem.cli.devstack``, whose single ``NatsServer`` each of
these is built from; used by the topology and failover tests, ``tandem bench scale``
and the 3-node fixtures.
"""

from __future__ import annotations

import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from tandem.cli import http
from tandem.cli.devstack import NatsServer
from tandem.common import accounts as nats_accounts
from tandem.common.errors import ServerStartError
from tandem.common.permissions import CONTROL


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
    extra: str = ""  # appended to every server's config (the accounts of the leaf topology)

    def start(self, timeout: float = 30) -> NatsCluster:
        """Start every server; each binds its own free ports (none is chosen for it).

        Routes need a peer's port before that peer runs, so the first server starts as
        the seed with a placeholder route (a socket bound but not listening: refused at
        once, and nobody else can take it), the others route to the seed and learn each
        other by gossip; then every config is rewritten with the ports actually bound and
        the seed reloads its routes. A server restarted later reuses its ports.
        """
        host = "127.0.0.1"
        placeholder = socket.socket()
        placeholder.bind((host, 0))
        try:
            seed_route = [f"nats-route://{host}:{placeholder.getsockname()[1]}"]
            for i in range(self.size):
                port, monitor = self.ports[i] if i < len(self.ports) else (0, 0)
                name = f"n{i}"
                srv = NatsServer(name=name, log_path=self.root / f"{name}.log",
                                 store_dir=self.root / name / "js",
                                 config_path=self.root / f"{name}.conf",
                                 port=port, monitor_port=monitor)
                self.servers.append(srv)
                routes = seed_route if i == 0 else [self._route(self.servers[0])]
                self._write_conf(i, routes)
                srv.start(timeout)
        finally:
            placeholder.close()
        if self.leafnodes:
            self.leaf_ports = [srv.varz()["leaf"]["port"] for srv in self.servers]
        for i, srv in enumerate(self.servers):
            self._write_conf(i, [self._route(o) for o in self.servers if o is not srv])
        self.servers[0].reload()
        for srv in self.servers:
            srv.wait_jetstream(timeout)
        return self

    @staticmethod
    def _route(srv: NatsServer) -> str:
        return f"nats-route://{srv.host}:{srv.cluster_port}"

    def _write_conf(self, i: int, routes: list[str]) -> None:
        """Server ``i``'s config: its own bound ports once known, ``-1`` (any) before."""
        srv = self.servers[i]
        host = srv.host
        domain = f", domain: {self.domain}" if self.domain else ""
        if self.max_consumers:
            domain += f", limits: {{ default_max_consumers: {self.max_consumers} }}"
        text = (f"server_name: {srv.name}\n"
                f"jetstream {{ store_dir: \"{srv.store_dir}\"{domain} }}\n")
        if self.size > 1:
            listen = srv.cluster_port if srv.bound else -1
            text += (f"cluster {{ name: {self.name}, listen: \"{host}:{listen}\", "
                     f"routes: [{', '.join(routes)}] }}\n")
        if self.leafnodes:
            leaf = self.leaf_ports[i] if i < len(self.leaf_ports) else -1
            text += f"leafnodes {{ listen: \"{host}:{leaf}\" }}\n"
        text += self.extra
        assert srv.config_path is not None
        srv.config_path.parent.mkdir(parents=True, exist_ok=True)
        srv.config_path.write_text(text)

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
        leafz = http.get_json(f"http://{self.host}:{self.monitor_port}/leafz", timeout=1)
        return isinstance(leafz, dict) and int(leafz.get("leafnodes", 0)) > 0

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

    With ``accounts`` the hub runs ``tandem.common.accounts``' layout with fresh random
    ``passwords`` (by user): the control-plane roles' users in the control plane's
    account, and each leaf logged in as its cluster's ``leaf-<cluster>``, so
    everything behind a leaf is in that cluster's account and may do only what it
    imports. The leaves themselves authenticate nobody: the leaf is the cluster's door.
    """

    root: Path
    clusters: list[str]
    hub_size: int = 3
    domain: str = "hub"
    hub_ports: list[tuple[int, int]] = field(default_factory=list)
    # NOTE: every node's agent watches its drain key (one ordered consumer on KV_drains
    # each), so a fleet over 1,000 nodes needs more than nats-server's per-stream default.
    max_consumers: int = 10_000
    accounts: bool = False
    control: str = CONTROL  # the cluster name of the control plane's trainer
    passwords: dict[str, str] = field(default_factory=dict)
    hub: NatsCluster | None = None
    leaves: dict[str, LeafNode] = field(default_factory=dict)

    def start(self, timeout: float = 30) -> Topology:
        extra = ""
        if self.accounts:
            self.passwords = {u: secrets.token_urlsafe(18)
                              for u in nats_accounts.users(self.clusters)}
            extra = nats_accounts.accounts_config(self.clusters, self.passwords, self.control)
        try:
            self.hub = NatsCluster(root=self.root / "hub", size=self.hub_size,
                                   domain=self.domain, leafnodes=True,
                                   ports=self.hub_ports, max_consumers=self.max_consumers,
                                   extra=extra).start(timeout)
            for c in self.clusters:
                leaf = LeafNode(name=f"leaf-{c}", log_path=self.root / f"leaf-{c}.log",
                                remotes=self._remotes(c))
                self.leaves[c] = leaf
                leaf.start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _remotes(self, cluster: str) -> list[str]:
        """The hub's leaf-node URLs, with the cluster's login under ``accounts``."""
        assert self.hub is not None
        if not self.accounts:
            return self.hub.leaf_urls
        user = nats_accounts.leaf_user(cluster)
        return [u.replace("://", f"://{user}:{self.passwords[user]}@", 1)
                for u in self.hub.leaf_urls]

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
        if self.accounts:  # JetStream by its account's imports; its push deliveries
            # come in under its own inbox prefix
            return {"nats_url": self.url_for(cluster),
                    "nats_js_api_prefix": nats_accounts.JS_API,
                    "nats_inbox_prefix": nats_accounts.inbox_prefix(cluster)}
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
