"""The one service runner: every Tandem service lives the same life.

connect (retrying) → provision → serve /healthz and /metrics → run the service's loops
→ on SIGTERM/SIGINT: set ``ctx.stopping`` (loops stop pulling and finish or hand back
in-flight work) → wait up to ``drain_timeout`` → cancel what is left → drain the
connection → exit 0. Stopping is idempotent: a second signal only logs. Whatever still
holds the process ``EXIT_GRACE_S`` after that (a thread stuck in a pipeline call or a
driver, which Python cannot stop and joins at exit) is cut off: the process exits anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tandem.common import log, metrics, tracing
from tandem.common.backoff import Backoff
from tandem.common.bus import Bus
from tandem.common.errors import SettingsError, StreamConflict
from tandem.common.settings import Settings, load
from tandem.common.streams import Spec, core_streams


@dataclass
class Context:
    """What a running service gets from the runner."""

    bus: Bus
    settings: Settings
    stopping: asyncio.Event
    log: Any
    started_at: float = field(default_factory=time.time)

    async def wait_stopping(self, timeout: float) -> bool:
        """Wait until stopping or ``timeout``; True if stopping. For periodic loops."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), timeout)
        return self.stopping.is_set()


class Service(ABC):
    """A Tandem service: a name, a settings class, the specs it needs, and its loops."""

    name: ClassVar[str]
    settings_class: ClassVar[type[Settings]] = Settings

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def streams(self) -> Sequence[Spec]:
        """What this service provisions at start (idempotently)."""
        return core_streams(self.settings.stream_replicas)

    def health(self) -> dict[str, Any]:
        """Extra fields for /healthz."""
        return {}

    def ready(self) -> bool:
        """False while the service is still starting (``/healthz`` answers 503 then)."""
        return True

    def live(self) -> str | None:
        """Why only a restart helps this process now (``/livez`` answers 503 naming it),
        or None. Not readiness: a service loading models is not ready and still alive."""
        return None

    def preflight(self) -> None:
        """Check what the settings ask of this host before connecting (a device, a
        driver); raise ``SettingsError`` naming the setting: the process exits 2, as for
        a bad value. Not part of loading settings, which reads values only (a tool may
        load a pod's settings anywhere)."""
        return None

    @abstractmethod
    async def run(self, ctx: Context) -> None:
        """Run until ``ctx.stopping`` is set, then finish or hand back in-flight work."""


# --------------------------------------------------------------------------- /healthz, /metrics


class HttpEndpoint:
    """A tiny HTTP/1.1 server for /healthz, /livez and /metrics (no web framework).

    ``/healthz`` is readiness (in the Service's endpoints or not); ``/livez`` liveness,
    for an orchestrator's restart: 200 unless ``Service.live`` names why not."""

    def __init__(self, service: Service, bus: Bus, stopping: asyncio.Event) -> None:
        self.service = service
        self.bus = bus
        self.stopping = stopping
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        self.server = await asyncio.start_server(self._handle, host, port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass
            parts = line.decode("latin-1").split()
            path = parts[1] if len(parts) > 1 else "/"
            if path.startswith("/metrics"):
                body, ctype = metrics.exposition()
                status = "200 OK"
            elif path.startswith("/livez"):
                why = self.service.live()
                body = json.dumps({"status": "ok" if why is None else "dead",
                                   "service": self.service.name, "why": why}).encode()
                ctype = "application/json"
                status = "200 OK" if why is None else "503 Service Unavailable"
            elif path.startswith("/healthz"):
                ready = self.service.ready()
                ok = self.bus.nc.is_connected and not self.stopping.is_set() and ready
                payload = {"status": "ok" if ok else "unavailable", "ready": ready,
                           "service": self.service.name,
                           "nats": "connected" if self.bus.nc.is_connected else "disconnected",
                           "stopping": self.stopping.is_set(),
                           "loop": "uvloop" if type(asyncio.get_running_loop()).__module__
                           .startswith("uvloop") else "asyncio",
                           "gc_threshold": gc.get_threshold()[0], **self.service.health()}
                body, ctype = json.dumps(payload).encode(), "application/json"
                status = "200 OK" if ok else "503 Service Unavailable"
            else:
                body, ctype, status = b"not found\n", "text/plain", "404 Not Found"
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2)


# --------------------------------------------------------------------------------- the life


CONNECT_BACKOFF = Backoff(0.2, max_delay=5.0)  # between connects while NATS is unreachable


async def _connect(settings: Settings, name: str, stopping: asyncio.Event, lg: Any) -> Bus | None:
    retries = CONNECT_BACKOFF.retries(stop=stopping)
    async for _ in retries:  # ends when stopping is set
        # Race each attempt against stopping: a SIGTERM while NATS is unreachable must
        # still end the process promptly.
        attempt = asyncio.create_task(Bus.connect(settings, name))
        stop_wait = asyncio.create_task(stopping.wait())
        await asyncio.wait({attempt, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        stop_wait.cancel()
        if not attempt.done():
            attempt.cancel()
            with contextlib.suppress(BaseException):
                await attempt
            return None
        try:
            return attempt.result()
        except Exception as exc:
            lg.warning("runner.connect_failed", servers=settings.nats_servers, error=repr(exc),
                       retry_in=retries.delay)
    return None


def provisionable(service: Service, s: Settings) -> Sequence[Spec]:
    """What ``service`` provisions at start. Connected as a restricted NATS user, or in
    a cluster's account that imports the control plane's JetStream under a prefix (the
    leaf topology with accounts), it may touch only its own role's streams
    (``permissions``), so it leaves the others to the services that own them rather than
    wait on requests the server refuses or nobody answers."""
    specs = service.streams()
    if not (s.nats_user or s.nats_creds or s.nats_js_api_prefix):
        return specs
    from tandem.common import permissions

    role = permissions.role_for(s.nats_user, service.name)
    return specs if role is None else permissions.provisionable(role, specs)


async def serve(service: Service) -> int:
    """Run ``service`` to completion; return the process exit code."""
    s = service.settings
    log.configure(s.log_format, s.log_level, service=service.name, cluster=s.cluster, node=s.node)
    tracing.configure(service.name, s.otlp_endpoint)
    lg = log.get("tandem.runner")
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if stopping.is_set():
            lg.info("runner.signal_again", signal=sig.name)
            return
        lg.info("runner.stopping", signal=sig.name)
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    bus = await _connect(s, service.name, stopping, lg)
    if bus is None:
        return 0
    try:
        await bus.provision(provisionable(service, s))
    except StreamConflict as exc:
        lg.error("runner.stream_conflict", error=str(exc))
        await bus.drain()
        return 2
    http = HttpEndpoint(service, bus, stopping)
    await http.start(s.metrics_host, s.metrics_port)
    metrics.UP.labels(service.name).set(1)
    lg.info("runner.started", metrics=f"http://{s.metrics_host}:{http.port}/metrics")

    ctx = Context(bus=bus, settings=s, stopping=stopping, log=log.get(f"tandem.{service.name}"))
    task = asyncio.create_task(service.run(ctx), name=f"{service.name}.run")
    stop_wait = asyncio.create_task(stopping.wait())
    code = 0
    try:
        await asyncio.wait({task, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            exc = task.exception()
            if exc is not None:
                code = _ended(lg, exc)
        else:
            try:
                await asyncio.wait_for(asyncio.shield(task), s.drain_timeout)
                lg.info("runner.drained")
            except TimeoutError:
                lg.warning("runner.drain_timeout", seconds=s.drain_timeout)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            except Exception as exc:
                code = _ended(lg, exc)
    finally:
        stop_wait.cancel()
        metrics.UP.labels(service.name).set(0)
        await http.close()
        await bus.drain()
        tracing.shutdown()
    lg.info("runner.exit", code=code)
    return code


def _ended(lg: Any, exc: BaseException) -> int:
    """The exit status for a service whose ``run`` raised ``exc``, logged: the error's
    own ``exit_code`` where it has one (a known refusal, not a crash, such as the
    cluster-agent's ``NodeTaken``: 3), else 1, a crash, with its traceback."""
    code = getattr(exc, "exit_code", None)
    if isinstance(code, int) and code > 1:
        lg.error("runner.refused", error=str(exc), code=code)
        return code
    lg.error("runner.crashed", error=repr(exc), exc_info=exc)
    return 1


EXIT_GRACE_S = 5.0  # from the runner's end to the process's, at most


def main(service_cls: type[Service], argv: list[str] | None = None) -> None:
    """Entry point of ``python -m tandem.<service>``: validate settings, run, exit."""
    try:
        settings = load(service_cls.settings_class, service_cls.name)
        run = loop_runner(settings.event_loop)
        service = service_cls(settings)
        service.preflight()
    except SettingsError as exc:
        print(f"tandem {service_cls.name}: {exc}", file=sys.stderr)
        sys.exit(2)
    tune_gc(settings.gc_threshold)

    async def served() -> int:
        code = await serve(service)
        exit_anyway(code, EXIT_GRACE_S)
        return code

    sys.exit(run(served()))


def exit_anyway(code: int, after: float) -> None:
    """End this process with ``code`` in ``after`` seconds if it has not ended by then.

    The runner is done; what may still hold the process is a thread that never ends (a
    pipeline call stuck in a hung driver, which Python cannot stop): the event loop's
    close and the interpreter's exit join such threads, for good. Its name is logged."""
    def cut_off() -> None:
        main = threading.main_thread()
        stuck = [t.name for t in threading.enumerate()
                 if t.is_alive() and not t.daemon and t is not main]
        log.get("tandem.runner").warning("runner.exit_forced", code=code, after_s=after,
                                         threads=stuck)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

    timer = threading.Timer(after, cut_off)
    timer.daemon = True
    timer.start()


def tune_gc(threshold: int) -> None:
    """Collect the youngest generation every ``threshold`` allocations, not every 700.

    A busy service allocates a few objects per message; at Python's default the cyclic
    collector ran so often that it took about a third of a worker's CPU on no-op tasks
    (py-spy; 0.46-0.61 s of CPU per 3,000 tasks, 0.31-0.43 s at 20,000). What was
    allocated while starting (modules, models) is frozen out of the collector's scans.
    0 keeps Python's defaults.
    """
    if threshold:
        gc.freeze()
        gc.set_threshold(threshold)


def loop_runner(loop: str = "auto") -> Callable[[Coroutine[Any, Any, Any]], Any]:
    """``asyncio.run``, on uvloop when it is installed (``auto``) or asked for.

    uvloop runs the same asyncio code on libuv: the bus's many small messages and the
    gateway's requests cost far less CPU. ``asyncio`` keeps the standard loop.
    """
    if loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if loop == "uvloop":
                raise SettingsError("TANDEM_EVENT_LOOP=uvloop, but uvloop is not installed "
                                    "(pip install uvloop)") from None
        else:
            return uvloop.run
    return asyncio.run
