"""Real local servers as child processes: nats-server and S3 (moto); clusters of
nats-servers and the leaf-node topology are in ``tandem.cli.topology``.

Dev infrastructure, not product: it lives with the CLI and no service imports it. Used
by ``tandem dev up``, the benchmarks and the test fixtures alike, so the way a server is
started, checked for readiness, killed with SIGKILL and restarted is written once.
Readiness always comes from the server itself (its ``/healthz``), never a sleep. Servers
bind port 0 themselves and the ports they chose are read back (no probe-then-bind race).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.cli import http
from tandem.common import ports
from tandem.common.errors import ServerStartError

# How long a port free_port hands out stays leased (ports.lease): the window between the
# probe and the child's bind, with room to spare.
PORT_LEASE_S = 600.0


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to now, for a child to bind, and not one that any process
    of this user handed out in the last ``PORT_LEASE_S`` seconds.

    Drawn below the kernel's ephemeral range (``ports.LISTEN``): ``bind(0)``'s pick is a
    port the local end of any outgoing connection can take before the child binds it
    (the rendezvous port of a suite's training run was taken so). The probe's socket is
    closed before the child binds, so two probes could return the same port: a dev stack
    of a dozen processes got one metrics port twice (suite run at 6c44973), and two test
    workers starting stacks at once could as well; leased ports are skipped
    (``ports.lease``). A program that is not Tandem's can still bind a port before the
    child does; servers the tests start themselves bind port 0 instead."""
    try:
        return ports.lease(host, ports.band_range(ports.LISTEN), PORT_LEASE_S)
    except OSError as exc:
        raise ServerStartError("free_port", str(exc)) from None


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


def _port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _fail_if_exited(proc: subprocess.Popen[bytes] | asyncio.subprocess.Process, what: str,
                    log_path: Path | None) -> None:
    # An asyncio child's returncode is kept current by its event loop; a Popen's by poll().
    code = proc.poll() if isinstance(proc, subprocess.Popen) else proc.returncode
    if code is not None:
        tail = ""
        if log_path and log_path.exists():
            tail = log_path.read_text(errors="replace")[-2000:]
        raise ServerStartError(what, f"exited with code {code}: {tail}")


def _read_ports(path: Path, deadline: float, proc: subprocess.Popen[bytes],
                log_path: Path) -> dict[str, list[str]]:
    """The ports a nats-server bound, from the ports file it writes once listening."""
    while time.monotonic() < deadline:
        _fail_if_exited(proc, "nats-server", log_path)
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):  # not written yet, or half written
            time.sleep(0.02)  # polling the server's own ports file
    raise ServerStartError("nats-server", f"no ports file {path} in time: see {log_path}")


def _read_logged_port(pattern: re.Pattern[bytes], deadline: float,
                      proc: subprocess.Popen[bytes] | asyncio.subprocess.Process, what: str,
                      log_path: Path,
                      offset: int) -> int:
    """The port a child server says it listens on in its log (it bound port 0 itself),
    read from ``offset`` on: what this start wrote, not an earlier run's lines."""
    while time.monotonic() < deadline:
        _fail_if_exited(proc, what, log_path)
        with open(log_path, "rb") as f:
            f.seek(offset)
            m = pattern.search(f.read())
        if m:
            return int(m.group(1))
        time.sleep(0.02)  # polling the server's own log
    raise ServerStartError(what, f"no listening port in {log_path} in time")


# What a Tandem service's runner logs once /healthz and /metrics listen (metrics_port=0
# lets it pick the port itself).
_RUNNER_METRICS = re.compile(rb'"metrics": "http://[^"]+:(\d+)/metrics"')


def log_offset(log_path: Path) -> int:
    """Where the next start's lines begin in ``log_path`` (0 for a new log)."""
    return log_path.stat().st_size if log_path.exists() else 0


def logged_metrics_port(proc: subprocess.Popen[bytes] | asyncio.subprocess.Process,
                        log_path: Path, offset: int = 0, timeout: float = 90.0) -> int:
    """The /metrics port a Tandem service started with ``metrics_port=0`` bound, from its
    ``runner.started`` line (JSON logs, level info or lower) written after ``offset``.
    Blocks: from a coroutine, call it in a thread (an asyncio child's exit is then still
    noticed)."""
    return _read_logged_port(_RUNNER_METRICS, time.monotonic() + timeout, proc,
                             f"{log_path.stem} (a Tandem service)", log_path, offset)


def _wait_http(url: str, deadline: float, proc: subprocess.Popen[bytes], what: str,
               log_path: Path | None = None) -> None:
    while time.monotonic() < deadline:
        _fail_if_exited(proc, what, log_path)
        resp = http.get(url, timeout=1)
        if resp is not None and resp.status_code < 500:
            return
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
    # Called once the process exists, before it is waited on (a supervisor records it).
    spawned: Callable[[], None] | None = None

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
        if self.spawned is not None:
            self.spawned()

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
    bound: dict[str, list[str]] = field(default_factory=dict)  # from its ports file

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 20) -> NatsServer:
        """Start and wait for JetStream; ports left at 0 are picked by the server itself.

        A port of 0 is passed as ``-1`` (nats-server's "any free port"); the ports it
        bound are read back from its ports file, so nothing else can take a port between
        choosing it and binding it. The chosen ports are kept: a restart reuses them, so
        clients reconnect to the same URL.
        """
        for p, what in ((self.port, "client"), (self.monitor_port, "monitoring")):
            if p and port_in_use(p, self.host):
                raise ServerStartError(
                    "nats-server", f"{what} port {self.host}:{p} is already in use "
                    "(another nats-server or `tandem dev up` running? "
                    "stop it or pick another port)")
        ports_dir = self.log_path.with_name(f"{self.log_path.stem}.ports.d")
        ports_dir.mkdir(parents=True, exist_ok=True)
        argv = [_binary("nats-server"), "-a", self.host, "-p", str(self.port or -1),
                "-m", str(self.monitor_port or -1), "-n", self.name,
                "--ports_file_dir", str(ports_dir)]
        if self.config_path is not None:
            argv += ["-c", str(self.config_path)]
        else:
            argv += ["-js", "-sd", str(self.store_dir)]
        self._spawn(argv + self.extra_args)
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        self.bound = _read_ports(ports_dir / f"nats-server_{self.proc.pid}.ports", deadline,
                                 self.proc, self.log_path)
        self.port = _port_of(self.bound["nats"][0])
        self.monitor_port = _port_of(self.bound["monitoring"][0])
        _wait_http(f"http://{self.host}:{self.monitor_port}/healthz?js-enabled-only=true",
                   deadline, self.proc, "nats-server", self.log_path)
        return self

    @property
    def cluster_port(self) -> int:
        """The route port this server listens on (0 outside a cluster)."""
        return _port_of(self.bound["cluster"][0]) if self.bound.get("cluster") else 0

    def varz(self) -> dict[str, Any]:
        """The server's own /varz (configuration as it runs, with the ports it bound)."""
        varz = http.get_json(f"http://{self.host}:{self.monitor_port}/varz", timeout=5)
        if not isinstance(varz, dict):
            raise ServerStartError(self.name, f"no /varz on port {self.monitor_port}")
        return varz

    def restart(self, timeout: float = 20) -> NatsServer:
        self.stop()
        return self.start(timeout)

    def reload(self) -> None:
        """Re-read the config file (SIGHUP), as ``nats-server --signal reload`` does."""
        if self.running:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGHUP)

    def wait_jetstream(self, timeout: float = 30) -> None:
        """Wait until this server reports JetStream healthy (meta leader known in a cluster)."""
        assert self.proc is not None
        _wait_http(f"http://{self.host}:{self.monitor_port}/healthz",
                   time.monotonic() + timeout, self.proc, "nats-server", self.log_path)


_WERKZEUG_LISTENING = re.compile(rb"Running on http://[^\s:]+:(\d+)")


@dataclass
class S3Server(Process):
    """moto's standalone S3 server. A restart starts empty.

    moto keeps an object in memory up to 5 MiB and spills larger ones to temporary files.
    ``hold_mib`` raises that bound (``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE``) and has glibc
    reuse freed blocks of up to 32 MiB (a part) instead of returning them to the kernel:
    a benchmark's server then does about the same work for the same upload each round.
    Without it, its system time for the same 256 MiB went 0.3-4 CPU-s between rounds
    (spills, and fresh pages the VM faults in at 3-13 us each), which both sides of a
    comparison took as noise. (``MALLOC_MMAP_MAX_=0`` was tried: growing a 128 MiB object
    in the heap then copies it on every realloc, 2-8 s an upload.)"""

    port: int = 0
    host: str = "127.0.0.1"
    hold_mib: int = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30) -> S3Server:
        """Start and wait for readiness. Port 0: moto binds a free port itself and logs
        it; that port is kept, so a restart serves the same URL."""
        if self.port and port_in_use(self.port, self.host):
            raise ServerStartError("s3", f"port {self.host}:{self.port} is already in use")
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        env = {"AWS_ACCESS_KEY_ID": "tandem", "AWS_SECRET_ACCESS_KEY": "tandem"}
        if self.hold_mib:
            env |= {"MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(self.hold_mib << 20),
                    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),  # the most glibc allows
                    "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
        self._spawn([_binary("moto_server"), "-H", self.host, "-p", str(self.port)], env=env)
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        if not self.port:
            self.port = _read_logged_port(_WERKZEUG_LISTENING, deadline, self.proc, "s3",
                                          self.log_path, offset)
        _wait_http(f"{self.url}/moto-api/", deadline, self.proc, "s3", self.log_path)
        return self

    def restart(self, timeout: float = 30) -> S3Server:
        self.stop()
        return self.start(timeout)


def stop_all(procs: list[Process]) -> None:
    for p in procs:
        with contextlib.suppress(Exception):
            p.stop()


@contextlib.contextmanager
def scratch_nats(what: str) -> Iterator[tuple[NatsServer, Path]]:
    """A JetStream nats-server of its own in a temporary folder (a bench's): yields the
    server and the folder, and on exit stops the server and removes the folder."""
    with tempfile.TemporaryDirectory(prefix=f"tandem-bench-{what}-") as tmp:
        root = Path(tmp)
        server = NatsServer(name=f"bench-{what}", log_path=root / "nats.log",
                            store_dir=root / "js").start()
        try:
            yield server, root
        finally:
            server.stop()
