"""The gateway's HTTP API fuzzed from its own OpenAPI schema (schemathesis): a real
gateway process over HTTPS with API keys; no input may get a 5xx or hang a request."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tandem.cli.devstack import S3Server
from tests.security_support import Gateway, https_gateway

ST = str(Path(sys.executable).parent / "st")
EXAMPLES = "10"  # per operation and phase: bounded, the run fits in about a minute


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server
            ) -> Iterator[Gateway]:
    keys = {"fuzz": (["admin"], {"rate": 100000, "burst": 100000})}
    with https_gateway(tmp_path_factory.mktemp("gw"), s3_server, keys) as gw:
        yield gw


def test_fuzzing_the_openapi_schema_finds_no_5xx_and_no_hang(gateway: Gateway,
                                                             tmp_path: Path) -> None:
    cmd = [ST, "run", f"{gateway.url}/openapi.json", "--checks", "not_a_server_error",
           "--phases", "examples,coverage,fuzzing", "-n", EXAMPLES, "--seed", "7",
           "--request-timeout", "10", "--tls-verify", str(gateway.certs.ca),
           "-H", f"Authorization: Bearer {gateway.keys['fuzz']}",
           "--generation-database", "none", "-w", "2", "--no-color"]
    # A hang would blow the 150 s bound (each request is bounded to 10 s by itself).
    res = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=150)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    assert "generated" in out and " passed" in out, out[-3000:]
    with gateway.client("fuzz") as http:  # and the gateway is still serving
        assert http.get("/healthz").status_code == 200
        assert http.post("/v1/generations", json={"model": "noop"}).status_code == 202
    assert "Traceback" not in gateway.log.read_text()


def test_an_oversized_body_gets_413_even_from_a_client_that_writes_it_all_first(
        gateway: Gateway) -> None:
    """python-requests-like clients send the whole body before reading: they must still
    read the 413 rather than a connection closed under them (found by the fuzzer)."""
    import requests

    body = b'{"model": "tiny-text", "prompt": "' + b"x" * 5_000_000 + b'"}'
    auth = {"Authorization": f"Bearer {gateway.keys['fuzz']}"}
    r = requests.post(f"{gateway.url}/v1/generations", data=body, timeout=10,
                      headers={"content-type": "application/json", **auth},
                      verify=str(gateway.certs.ca))
    assert r.status_code == 413 and "the limit is 65536 bytes" in r.json()["detail"]
    with httpx.Client(verify=gateway.ca, timeout=10) as http:  # chunked: no length
        r = http.post(f"{gateway.url}/v1/generations", content=iter([body[:40_000]] * 8),
                      headers={"content-type": "application/json", **auth})
        assert r.status_code == 413 and "the limit is 65536 bytes" in r.json()["detail"]
