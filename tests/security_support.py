"""Security tests' helpers: a real gateway process over HTTPS with hashed API keys."""

from __future__ import annotations

import contextlib
import json
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tandem.cli.certs import CertFiles, dev_certs
from tandem.cli.devstack import NatsServer, S3Server, logged_metrics_port
from tandem.gateway.auth import hash_key, new_key
from tests.conftest import PYTHON, service_env

TIMEOUT = 30


@dataclass
class Gateway:
    url: str
    keys: dict[str, str]  # name -> the key itself
    certs: CertFiles
    log: Path
    nats_url: str  # the job service's door, the same gateway process
    proc: subprocess.Popen[bytes]

    @property
    def ca(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.certs.ca))

    def client(self, key: str | None = None, **kw: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.keys[key]}"} if key else {}
        return httpx.Client(base_url=self.url, verify=self.ca, headers=headers,
                            timeout=kw.pop("timeout", 10), **kw)


def _wait_port(proc: subprocess.Popen[bytes], log: Path) -> int:
    """The gateway's API port, from its /healthz once ready (both ports it picked)."""
    metrics = logged_metrics_port(proc, log, timeout=TIMEOUT)
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/healthz", timeout=1) as r:
                port = json.load(r).get("http_port")
                if port:
                    return int(port)
        time.sleep(0.1)  # polling the service's own readiness endpoint
    raise AssertionError("gateway not ready: " + log.read_text()[-3000:])


@contextlib.contextmanager
def https_gateway(root: Path, s3: S3Server, keys: dict[str, tuple[list[str], dict[str, Any]]],
                  **settings: str) -> Iterator[Gateway]:
    """A NATS server and a gateway process (HTTPS, ``keys`` as a hashed keys file, static
    routing, no workers) until the block ends. ``keys``: name -> (scopes, limits)."""
    nats = NatsServer(name="gw", log_path=root / "nats.log", store_dir=root / "js").start()
    try:
        with gateway_replicas(root, nats.url, s3, keys, 1, **settings) as (gateway,):
            yield gateway
    finally:
        nats.stop()


@contextlib.contextmanager
def gateway_replicas(root: Path, nats_url: str, s3: S3Server,
                     keys: dict[str, tuple[list[str], dict[str, Any]]], n: int,
                     **settings: str) -> Iterator[list[Gateway]]:
    """``n`` gateway processes on ``nats_url`` with the same keys and certificates (the
    replicas of one deployment) until the block ends."""
    certs = dev_certs(root / "certs")
    secret = {name: new_key() for name in keys}
    entries = [{"name": n, "sha256": hash_key(secret[n]), "scopes": s, **extra}
               for n, (s, extra) in keys.items()]
    (root / "keys.json").write_text(json.dumps(entries))
    env = service_env(**{
        "nats_url": nats_url, "s3_endpoint": s3.url, "s3_access_key": "tandem",
        "s3_secret_key": "tandem", "s3_bucket": "secgw", "cluster": "east",
        "clusters": "east", "node": "gw", "http_port": "0", "metrics_port": "0",
        "api_keys": f"@{root / 'keys.json'}", "http_tls_cert": str(certs.server_cert),
        "http_tls_key": str(certs.server_key), "routing": "static", **settings})
    procs: list[subprocess.Popen[bytes]] = []
    try:
        gateways = []
        for i in range(n):
            log = root / ("gateway.log" if n == 1 else f"gateway-{i}.log")
            with log.open("wb") as out:
                procs.append(subprocess.Popen([PYTHON, "-m", "tandem.gateway"], env=env,
                                              stdout=out, stderr=subprocess.STDOUT))
            port = _wait_port(procs[-1], log)
            gateways.append(Gateway(f"https://127.0.0.1:{port}", secret, certs, log,
                                    nats_url, procs[-1]))
        yield gateways
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
