"""The gateway service: the HTTP edge, run by the common service runner.

uvicorn serves the API as one task of ``run``; ``ctx.stopping`` tells it to stop taking
connections and finish open requests. The runner owns signals (uvicorn's own handlers
are not installed), the bus connection and the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
from collections.abc import Iterator, Sequence
from typing import Any

from pydantic import Field, field_validator

from tandem.common import subjects
from tandem.common.bus import Bus
from tandem.common.errors import ServerStartError
from tandem.common.jobs import JobLimitSettings
from tandem.common.models import RegistrySettings
from tandem.common.runner import Context, Service
from tandem.common.storage import s3_client
from tandem.common.streams import Spec, core_streams, gen_stream
from tandem.common.tasks import SealSettings
from tandem.gateway import dashboard
from tandem.gateway.api import create_app
from tandem.gateway.auth import AuthSettings, Guard, Keyring, Limits, document, parse_keys
from tandem.gateway.connections import BoundedHttpTools, HttpBounds
from tandem.gateway.generations import Gateway
from tandem.gateway.jobs import JobService
from tandem.gateway.observe import Observer
from tandem.gateway.routing import Router, RoutingSettings
from tandem.gateway.traces import AdmissionTracing


class GatewaySettings(RoutingSettings, AuthSettings, JobLimitSettings, SealSettings,
                      RegistrySettings):
    """``TANDEM_*`` settings of the gateway (see README.md)."""

    http_host: str = Field("127.0.0.1", description="Address the HTTP API listens on.")
    http_port: int = Field(8000, ge=0, le=65535, description="Port of the HTTP API.")
    clusters: str = Field("", description="Comma-separated clusters tasks may go to; "
                          "empty: this process's cluster.")
    max_body_bytes: int = Field(64 * 1024, ge=1024, description="Largest request body; "
                                "larger gets 413.")
    publish_retry_for: float = Field(10.0, ge=0, description="Seconds to retry enqueueing "
                                     "(same Nats-Msg-Id) before answering 503.")
    result_url_ttl: float = Field(3600.0, ge=1, le=7 * 24 * 3600,
                                  description="Seconds a presigned image URL stays valid.")
    s3_public_endpoint: str | None = Field(
        None, description="S3 endpoint clients reach (presigned URLs); default s3_endpoint.")
    sse_ping: float = Field(15.0, gt=0, description="Seconds between SSE keep-alive comments.")
    http_keep_alive: float = Field(
        75.0, gt=0, le=3600, description="Seconds an idle HTTP connection is kept open. "
        "Longer than any client's or load balancer's idle timeout (httpx 5, AWS ALB 60): "
        "a server that closes first races the client's next request on that connection, "
        "which then fails without a response.")
    http_max_header_bytes: int = Field(
        HttpBounds.max_header_bytes, ge=1024, le=16 * 1024 * 1024,
        description="Largest request line plus headers; larger gets 431 and the "
        "connection closed.")
    http_head_timeout: float = Field(
        HttpBounds.head_timeout, gt=0, le=3600, description="Seconds a request head may "
        "take from the connection's opening (or the first byte of a later request) to its "
        "end; then 408 and the connection closed. Bodies and responses (SSE) are not timed.")
    http_max_connections: int = Field(
        HttpBounds.max_connections, ge=1, description="Open HTTP connections; one more "
        "gets 503 at once, while those open go on.")

    train_clusters: str = Field("", description="Comma-separated clusters a training run "
                                "may name; empty: this process's cluster and CLUSTERS. "
                                "Another is refused (422): no coordinator would claim it.")

    @field_validator("clusters", "train_clusters")
    @classmethod
    def _clusters(cls, v: str) -> str:
        subjects.token_list(v, "cluster")
        return v

    @property
    def cluster_list(self) -> list[str]:
        return subjects.token_list(self.clusters, "cluster") or [self.cluster]

    @property
    def train_cluster_list(self) -> list[str]:
        return (subjects.token_list(self.train_clusters, "cluster")
                or list(dict.fromkeys([self.cluster, *self.cluster_list])))


class _Server:
    """uvicorn without its signal handlers: the runner owns SIGTERM."""

    def __init__(self, app: Any, sock: socket.socket, ssl_certfile: str | None = None,
                 ssl_keyfile: str | None = None, keep_alive: float = 75.0,
                 bounds: HttpBounds = HttpBounds()) -> None:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5, ssl_certfile=ssl_certfile,
                                ssl_keyfile=ssl_keyfile, timeout_keep_alive=keep_alive,
                                http=BoundedHttpTools.with_bounds(bounds))
        self.config = config
        self.server = Server(config)
        self.sock = sock

    async def serve(self) -> None:
        await self.server.serve(sockets=[self.sock])

    def stop(self) -> None:
        self.server.should_exit = True


def bind(host: str, port: int) -> socket.socket:
    # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY only on sockets that say so, and
    # without it every response waits ~40 ms on Nagle + delayed ACK.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                         socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServerStartError("gateway", f"cannot listen on {host}:{port}: {exc.strerror} "
                               "(set TANDEM_HTTP_PORT, 0 picks a free one)") from None
    sock.set_inheritable(True)
    return sock


# Files the gateway holds besides its HTTP connections: NATS, S3's pool, the metrics
# port, logs, the event loop's own.
OWN_FILES = 100


def open_files_for(connections: int) -> bool:
    """Raise this process's soft limit on open files, up to the hard one, so that
    ``connections`` HTTP connections fit beside the gateway's own files; whether they do.
    Shells and systemd start processes at 1024: without this the connection cap would
    come after accept() fails (EMFILE), and with it every socket the gateway opens."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = connections + OWN_FILES
    if soft == resource.RLIM_INFINITY or soft >= want:
        return True
    if hard != resource.RLIM_INFINITY and hard < want:
        want = hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return want >= connections + OWN_FILES


class GatewayService(Service):
    name = "gateway"
    settings_class = GatewaySettings

    def __init__(self, settings: GatewaySettings) -> None:  # type: ignore[override]
        super().__init__(settings)
        self.s: GatewaySettings = settings
        self.port = 0
        self.router: Router | None = None
        self._server: _Server | None = None

    def streams(self) -> Sequence[Spec]:
        # The queues it publishes to, not their consumers: those are the workers' own.
        return [*core_streams(self.s.stream_replicas),
                *(gen_stream(c, self.s.stream_replicas) for c in self.s.cluster_list)]

    def health(self) -> dict[str, Any]:
        out: dict[str, Any] = {"http_port": self.port, "clusters": self.s.cluster_list}
        if self.router is not None:
            out["routing"] = self.router.describe()
        return out

    def ready(self) -> bool:
        # Ready once uvicorn listens: before that a client would get "connection refused".
        return self._server is not None and bool(self._server.server.started)

    async def run(self, ctx: Context) -> None:
        s = self.s
        presign = s.model_copy(update={"s3_endpoint": s.s3_public_endpoint or s.s3_endpoint})
        if s.routing == "fleet":
            self.router = await Router.from_settings(ctx.bus, s, s.cluster_list).start()
        gw = Gateway(ctx.bus, s.registry, s.cluster_list,
                     s3=s3_client(presign), bucket=s.s3_bucket, url_ttl=s.result_url_ttl,
                     publish_retry_for=s.publish_retry_for, sse_ping=s.sse_ping,
                     router=self.router, limits=s.job_limits, seal_key=s.seal_key,
                     heartbeat_ttl=s.heartbeat_ttl)
        await gw.start()
        keys = Keyring(parse_keys(s.api_keys))
        # Both doors share them; they are every replica's (KV rates, sse, runs).
        limits = await Limits.on(ctx.bus, keys, s)
        jobs = JobService(gw, keys, limits, max_body=s.max_body_bytes,
                          train_clusters=s.train_cluster_list)
        # The job service on a connection of its own: a flood of requests that the server
        # drops as a slow consumer takes this one down (it reconnects), not the bus the
        # gateway's records, progress and dashboard use.
        door = await Bus.connect(s, "gateway-jobs")
        await jobs.start(door.nc)
        asgi, app = create_app(gw, max_body_bytes=s.max_body_bytes, limits=limits,
                               train_clusters=s.train_cluster_list)
        document(app)
        observer = Observer(ctx.bus, s.cluster_list, s3=gw.s3, bucket=s.s3_bucket,
                            url_ttl=s.result_url_ttl, heartbeat_ttl=s.heartbeat_ttl)
        dashboard.install(app, observer)  # the live dashboard at /
        app.add_middleware(AdmissionTracing)  # a generation's trace starts here
        asgi = Guard.wrap(asgi, keys, limits)
        sock = bind(s.http_host, s.http_port)
        self.port = sock.getsockname()[1]
        tls = (s.http_tls_cert, s.http_tls_key) if s.tls else (None, None)
        bounds = HttpBounds(s.http_max_header_bytes, s.http_head_timeout,
                            s.http_max_connections)
        if not open_files_for(bounds.max_connections):
            ctx.log.warning("gateway.open_files_short",
                            open_files=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                            http_max_connections=bounds.max_connections,
                            hint="raise the hard limit (ulimit -Hn) or lower "
                            "TANDEM_HTTP_MAX_CONNECTIONS: past it accept() and the gateway's "
                            "own NATS and S3 sockets fail instead")
        server = self._server = _Server(asgi, sock, *tls, keep_alive=s.http_keep_alive,
                                        bounds=bounds)
        scheme = "https" if s.tls else "http"
        ctx.log.info("gateway.listening", url=f"{scheme}://{s.http_host}:{self.port}",
                     docs=f"{scheme}://{s.http_host}:{self.port}/docs", clusters=s.cluster_list)
        async with asyncio.TaskGroup() as tg:
            serving = tg.create_task(server.serve())
            tg.create_task(observer.run(ctx.stopping))
            stopping = tg.create_task(ctx.stopping.wait())
            await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
            await jobs.stop()  # first: a request now goes to another gateway of the group
            with contextlib.suppress(Exception):
                await door.drain()
            server.stop()
            stopping.cancel()
        sock.close()
        limits.close()
        await gw.stop()
        if self.router is not None:
            await self.router.stop()
