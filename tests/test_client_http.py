"""``tandem generate`` over HTTP when the event stream breaks mid-task (the gateway
restarts, a proxy hangs up): the task runs on, so the client reads its status until it
has ended and saves its images, as over NATS."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.cli.devstack import S3Server
from tandem.common.storage import ensure_bucket, s3_client
from tests.conftest import ROOT, service_env
from tests.serving_stack import ServingStack, gateway, http_port, worker

CLUSTER = "sse"
pytestmark = pytest.mark.slow


class Proxy:
    """A TCP proxy to ``port``; ``cut()`` hangs up on every connection open now (later
    ones pass, as to a gateway that came back)."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.open: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream))
            with self.lock:
                self.open += [client, up]
            for a, b in ((client, up), (up, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self.lock:
            cut, self.open = self.open, []
        for s in cut:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.server.close()
        self.cut()


@pytest.fixture(scope="module")
def gateway_port(tmp_path_factory: pytest.TempPathFactory,
                s3_server: S3Server) -> Iterator[int]:
    """A gateway and a worker serving digits; yields the gateway's HTTP port."""
    st = ServingStack(tmp_path_factory.mktemp("sse"), s3_server, "sse")
    try:
        st.nats.start()
        ensure_bucket(s3_client(st.settings()), st.bucket)
        common = st.env(cluster=CLUSTER)
        gw = gateway(st.root, "gateway", **common, clusters=CLUSTER, routing="static")
        w = worker(st.root, "w-sse", **common, node="w-sse", serve="digits")
        st.children += [gw.start(), w.start()]
        port = http_port(gw)
        w.wait_healthy()
        yield port
    finally:
        st.stop()


def test_generate_over_http_outlives_a_broken_event_stream(gateway_port: int,
                                                           tmp_path: Path) -> None:
    proxy = Proxy(gateway_port)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli.main", "generate", "3", "--steps", "1000",
         "--url", f"http://127.0.0.1:{proxy.port}", "-o", str(tmp_path / "out")],
        cwd=ROOT, env=service_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        seen = b""
        deadline = time.monotonic() + 120
        while b"  step " not in seen:  # progress lines end in \r: read what comes
            assert time.monotonic() < deadline, seen.decode()
            chunk = os.read(proc.stdout.fileno(), 4096)
            assert chunk, "generate ended early: " + proc.stderr.read().decode()[-3000:]
            seen += chunk
        proxy.cut()  # the event stream breaks mid-task
        rest, err = proc.communicate(timeout=240)
    finally:
        proxy.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = (seen + rest).decode()
    assert proc.returncode == 0, out[-2000:] + err.decode()[-3000:]
    assert "Traceback" not in err.decode(), err.decode()[-3000:]
    pngs = list((tmp_path / "out").glob("*.png"))
    assert len(pngs) == 1 and str(pngs[0]) in out
    lines = out.replace("\r", "\n").splitlines()
    # A state line names where the task runs, or nothing: never a bare "on".
    assert not [ln for ln in lines if re.search(r" on\s*$", ln)], lines
