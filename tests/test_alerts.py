"""The alerting rules and the Grafana dashboards: what they read is what Tandem exports,
and read as it is exported.

The rules are one file for Prometheus (deploy/prometheus/rules/, loaded through
prometheus.yml's ``rule_files``) and the same groups as a PrometheusRule in every k8s
overlay (deploy/k8s/base/common/; test_deploy validates it against the CRD's schema).
Every gateway exports the whole system view, so a panel or rule that reads it must
aggregate the gateways' copies by min or max: N gateways never draw N lines or count N
times.
"""

from __future__ import annotations

import json
import re
from pathlib import PurePosixPath
from typing import Any

import yaml
from prometheus_client.metrics import MetricWrapperBase

from tandem.common import metrics
from tandem.gateway import observe

from .conftest import ROOT
from .observability_support import metric_names, tandem_metrics
from .test_deploy import OVERLAYS, objects

PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "rules" / "tandem.rules.yml"
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
# What the rules must watch (docs/observability.md, "Alerts").
ALERTS = {"TandemClusterDown", "TandemNodeDown", "TandemNodeOutOfService",
          "TandemDeadLetters", "TandemQueueStalled", "TandemTrainingRestarted",
          "TandemTrainingRunFailed", "TandemObserverStale"}


def rules() -> list[dict[str, Any]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def expressions() -> list[tuple[str, str]]:
    """(where, PromQL) for every rule and every dashboard panel's query."""
    out = [(f"rule {r['alert']}", r["expr"]) for r in rules()]
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            out += [(f"{path.name}: {panel['title']}", t["expr"]) for t in panel["targets"]]
    return out


def view_series() -> set[str]:
    """The series every gateway exports for the whole system: the observer's own (but its
    refresh time, which is the gateway's) and the GPU and run series it sets."""
    def names(objs: Any) -> set[str]:
        return {o.describe()[0].name for o in objs if isinstance(o, MetricWrapperBase)}

    return (names(vars(observe).values()) - names([observe.REFRESHED])
            | names(metrics.GPU_SERIES) | names(metrics.RUN_SERIES))


def unaggregated(expr: str, view: set[str]) -> list[str]:
    """The selectors of ``expr`` that read a system-view series from every gateway without
    a ``min by``/``max by`` around them (a function such as ``changes(`` may sit between).
    A selector matching one source (``service="trainer"``) reads no gateway's copy."""
    bad = []
    for m in re.finditer(r"(tandem_[a-z_]+)(\{[^}]*\})?", expr):
        if not metric_names(m[1]) & view:
            continue
        if re.search(r'\bservice="(?!gateway")[^"]+"', m[2] or ""):
            continue
        if not re.search(r"\b(max|min) by \([^)]*\) \((\w+\()?$", expr[:m.start()]):
            bad.append(m[0])
    return bad


def test_prometheus_loads_the_rules_and_every_overlay_ships_the_same_prometheusrule() -> None:
    prom = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    # rule_files are relative to the config's folder, as Prometheus reads them.
    loaded = {p for pattern in prom["rule_files"] for p in PROMETHEUS.glob(pattern)}
    assert loaded == {RULES}
    # compose mounts the rules beside the config, or its Prometheus would load none.
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    volumes = compose["services"]["prometheus"]["volumes"]
    config = next(v.split(":")[1] for v in volumes if v.endswith("prometheus.yml:ro"))
    mounted = {v.split(":")[1]: v.split(":")[0] for v in volumes}
    folder = str(PurePosixPath(config).parent)
    for pattern in prom["rule_files"]:
        where = str(PurePosixPath(folder, pattern).parent)
        assert mounted.get(where) == "./deploy/prometheus/" + str(
            PurePosixPath(pattern).parent), (where, volumes)
    groups = yaml.safe_load(RULES.read_text())["groups"]
    for overlay in OVERLAYS:  # beside it, tandem-infrastructure: NATS and the targets
        rule = objects(overlay, "PrometheusRule")["tandem"]
        assert rule["spec"]["groups"] == groups, overlay


def test_every_alert_is_named_graded_described_and_reads_only_tandem_metrics() -> None:
    defined = tandem_metrics()
    assert {r["alert"] for r in rules()} >= ALERTS
    for r in rules():
        assert r["labels"]["severity"] in {"warning", "critical"}, r["alert"]
        assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]
        used = metric_names(r["expr"])
        assert used and used <= defined, (r["alert"], used - defined)


def test_panels_and_rules_aggregate_the_gateways_copies_of_the_system_view() -> None:
    view = view_series()
    assert {"tandem_queue_depth", "tandem_cluster_healthy", "tandem_train_restarts",
            "tandem_gpu_utilization_percent"} <= view
    assert "tandem_observer_last_refresh_timestamp_seconds" not in view
    # The check itself: what a second gateway doubles, and what it does not.
    assert unaggregated("sum by (cluster) (tandem_queue_depth)", view) == [
        "tandem_queue_depth"]
    assert unaggregated("tandem_cluster_healthy", view) == ["tandem_cluster_healthy"]
    assert not unaggregated("max by (run) (changes(tandem_train_restarts[10m]))", view)
    assert not unaggregated('tandem_train_loss{service="trainer"}', view)
    assert not unaggregated("sum(rate(tandem_bus_dead_letters_total[5m]))", view)
    bad = [(where, unaggregated(expr, view)) for where, expr in expressions()]
    assert [b for b in bad if b[1]] == []


def test_a_dead_nodes_alert_outlives_the_gateways_grace_on_its_series() -> None:
    """A gateway drops a gone node's series after ``GONE_GRACE`` (and one started since
    never had them): ``TandemNodeDown`` must then read what Prometheus kept of the node,
    for longer than the grace, rather than resolve as the series go."""
    (rule,) = [r for r in rules() if r["alert"] == "TandemNodeDown"]
    expr = " ".join(rule["expr"].split())
    back = re.search(r"\bor \(max by \(cluster, node\) \(last_over_time\(tandem_node_up"
                     r"\[(\d+)([mhd])\]\)\) unless on \(cluster, node\) max by "
                     r"\(cluster, node\) \(tandem_node_up\)\)", expr)
    assert back is not None, expr
    lookback = int(back[1]) * {"m": 60, "h": 3600, "d": 86400}[back[2]]
    assert lookback > observe.GONE_GRACE
    # Only while some gateway exports the view: a scrape outage is not every node dead.
    assert expr.endswith("and on () count(tandem_observer_last_refresh_timestamp_seconds) > 0")
