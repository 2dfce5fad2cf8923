"""The simulated fleet, the per-cluster summaries routing reads, and the scale bench's
arithmetic: a tiny fleet on real nats-servers (the 1,000-node run is `tandem bench scale`)."""

from __future__ import annotations

import argparse
import asyncio
import math
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from tandem.cli.bench import scale as bench_scale
from tandem.cli.topology import Topology
from tandem.common import fleet, streams, subjects
from tandem.common.bus import Bus
from tandem.common.clusters import ClusterBoard
from tandem.common.events import Health, NodeHeartbeat
from tandem.common.settings import Settings, load
from tandem.common.streams import KV_NODES, TELEMETRY
from tests.serving_stack import Child

DEADLINE = 60.0


async def until(pred: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    """Re-check ``pred`` (a live in-memory view, which has no change event) until it holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout:g}s: {what}")
        await asyncio.sleep(0.05)  # polling a condition with a deadline


COUNTS = ("healthy", "nodes_total", "nodes_up", "nodes_serving", "nodes_drained",
          "gpus_total", "gpus_free")


def summaries_match_view(board: ClusterBoard) -> bool:
    """The incremental summaries say what summarising every node says."""
    view = {c.name: c for c in board.view().clusters}
    got = {s.name: s for s in board.summaries() if s.nodes_total}
    return set(view) == set(got) and all(
        getattr(got[name], f) == getattr(c, f) for name, c in view.items() for f in COUNTS
    ) and all(sorted(got[name].models) == c.models for name, c in view.items())


async def test_cluster_summaries_follow_heartbeats_drains_and_expiry(bus: Bus, uid: str) -> None:
    await bus.provision(streams.core_streams())
    kv = await bus.kv(KV_NODES)
    a, b = f"a{uid}", f"b{uid}"

    async def beat(cluster: str, node: str, free: int, models: list[str],
                   health: Health = Health.healthy) -> None:
        hb = NodeHeartbeat(cluster=cluster, node=node, health=health, gpus_total=8,
                           gpus_usable=8, gpus_free=free, models=models)
        await kv.put(subjects.node_key(cluster, node), msgspec.json.encode(hb))

    board = await ClusterBoard(bus, ttl=1.5).start()
    try:
        await beat(a, "n0", 8, ["digits"])
        await beat(a, "n1", 2, ["noop"])
        await beat(b, "n0", 4, ["digits"], Health.unhealthy)
        await until(lambda: {a, b} <= set(board.clusters())
                    and board.summary(a).nodes_up == 2, "both clusters seen")
        sa, sb = board.summary(a), board.summary(b)
        assert (sa.healthy, sa.gpus_free, sa.gpus_total, sa.models) == (
            True, 10, 16, {"digits", "noop"})
        assert (sb.healthy, sb.nodes_serving, sb.gpus_free) == (False, 0, 0)
        assert summaries_match_view(board)

        await fleet.drain(bus, a, "n1", reason="test")
        await until(lambda: board.summary(a).nodes_drained == 1, "drain counted")
        assert board.summary(a).models == {"digits"} and board.summary(a).gpus_free == 8
        assert summaries_match_view(board)
        await fleet.undrain(bus, a, "n1")
        await until(lambda: board.summary(a).nodes_drained == 0, "undrain counted")

        # Heartbeats stop: after the TTL every node counts as down, though nothing arrived.
        await until(lambda: board.summary(a).nodes_up == 0, "expired without an event")
        assert not board.summary(a).healthy and summaries_match_view(board)
        await beat(a, "n0", 8, ["digits"])  # one comes back
        await until(lambda: board.summary(a).nodes_up == 1, "back up")
        await kv.delete(subjects.node_key(a, "n0"))  # a graceful stop removes the key
        await until(lambda: board.summary(a).nodes_total == 1, "deleted key forgotten")
        assert summaries_match_view(board)
    finally:
        await board.stop()


async def test_a_node_silent_for_ten_ttls_is_forgotten(bus: Bus, uid: str) -> None:
    # KV expiry is silent: without forgetting, a board would keep every node it ever saw.
    await bus.provision(streams.core_streams())
    kv = await bus.kv(KV_NODES)
    cluster = f"f{uid}"
    async with ClusterBoard(bus, ttl=0.2) as board:
        hb = NodeHeartbeat(cluster=cluster, node="n0", gpus_total=1, gpus_usable=1)
        await kv.put(subjects.node_key(cluster, "n0"), msgspec.json.encode(hb))
        await until(lambda: board.summary(cluster).nodes_up == 1, "the node up")
        await until(lambda: board.summary(cluster).nodes_up == 0
                    and board.summary(cluster).nodes_total == 1, "down, still known")
        await until(lambda: board.summary(cluster).nodes_total == 0, "forgotten")
        assert not board.view().clusters and cluster in board.clusters()


# ------------------------------------------------------------------------ a tiny fleet


@pytest.fixture(scope="module")
def leaf_topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Topology]:
    topo = Topology(tmp_path_factory.mktemp("scale"), ["east", "west"], hub_size=1).start()
    yield topo
    topo.stop()


async def test_multiplexed_agents_behind_leaves_report_every_node_and_leave_cleanly(
        leaf_topology: Topology, tmp_path: Path) -> None:
    topo = leaf_topology
    hub = await Bus.connect(load(Settings, nats_url=topo.hub_url), "test")
    await hub.provision(streams.core_streams())
    fleets = [Child(name=f"fleet-{c}", log_path=tmp_path / f"fleet-{c}.log",
                    module="tandem.cli.bench.simfleet",
                    env={"cluster": c, "fleet_nodes": "3", "fleet_first": "10",
                         "fleet_prefix": "sim", "sim_gpus": "2", "agent_interval": "0.2",
                         **topo.env_for(c)}).start() for c in ("east", "west")]
    board = await ClusterBoard(hub).start()
    try:
        for f in fleets:
            h = f.wait_healthy(lambda h: bool(h.get("started")))
            assert h["nodes"] == 3
        await until(lambda: all(board.summary(c).nodes_serving == 3 for c in ("east", "west")),
                    "six serving nodes")
        assert board.summary("east").gpus_total == 6 and board.summary("west").gpus_total == 6
        nodes = {(c.name, n.node) for c in board.view().clusters for n in c.nodes}
        assert nodes == {(c, f"sim{i}") for c in ("east", "west") for i in (10, 11, 12)}
        # Every node's telemetry is stored in the hub's stream.
        for c, node in nodes:
            msg = await hub.js.get_last_msg(TELEMETRY, subjects.telemetry(c, node))
            assert msg.data
        for f in fleets:
            assert f.proc is not None
            f.proc.send_signal(signal.SIGTERM)
            assert f.proc.wait(30) == 0
        # A graceful stop removes each node's heartbeat: the clusters empty at once.
        await until(lambda: not any(s.nodes_total for s in board.summaries())
                    and not board.view().clusters, "heartbeats removed on stop")
    finally:
        await board.stop()
        for f in fleets:
            f.kill()
        await hub.drain()


def test_fleet_runner_rejects_a_node_prefix_that_is_not_a_token(tmp_path: Path) -> None:
    child = Child(name="bad", log_path=tmp_path / "bad.log", module="tandem.cli.bench.simfleet",
                  env={"fleet_prefix": "bad prefix", "nats_url": "nats://127.0.0.1:9"}).start()
    assert child.proc is not None
    assert child.proc.wait(60) != 0
    assert "node" in child.tail()


# ------------------------------------------------------------------------- bench arithmetic


def test_bucket_quantile_interpolates_within_the_bucket_of_the_rank() -> None:
    before = [(1e-5, 0.0), (2e-5, 0.0), (math.inf, 0.0)]
    after = [(1e-5, 50.0), (2e-5, 100.0), (math.inf, 100.0)]
    assert bench_scale.bucket_quantile(before, after, 0.5) == pytest.approx(1e-5)
    assert bench_scale.bucket_quantile(before, after, 0.75) == pytest.approx(1.5e-5)
    assert bench_scale.bucket_quantile(after, after, 0.5) is None  # nothing observed between
    text = ('x_bucket{le="1e-05"} 3.0\nx_bucket{le="+Inf"} 4.0\nx_count 4.0\n')
    assert bench_scale.histogram(text, "x") == [(1e-5, 3.0), (math.inf, 4.0)]


@pytest.mark.slow
async def test_scale_bench_runs_a_tiny_fleet_and_reports_every_figure() -> None:
    p = argparse.ArgumentParser()
    bench_scale.add_arguments(p)
    args = p.parse_args(["--sizes", "4", "--clusters", "2", "--hub-size", "1", "--seconds", "2",
                         "--burst-seconds", "1", "--burst-conns", "4", "--task-rate", "20"])
    r = await bench_scale.run(args)
    [row] = r["sizes"]
    steady = row["steady"]
    assert row["nodes"] == 4 and row["gpus"] == 32
    tele = steady["telemetry"]
    assert tele["nominal_per_s"] == 4.0
    # The ratio is over the samples whose publish ended in the window (stored or raised),
    # so it is at most 1 whatever was in flight at the window's edges.
    assert tele["offered"] > 0 and tele["delivered"] > 0 and tele["delivered_per_s"] > 0
    assert tele["ended"] == tele["delivered"] + tele["publish_failed"]
    assert tele["ratio"] == round(tele["delivered"] / tele["ended"], 4) <= 1.0
    assert steady["tasks"]["accepted"] > 0 and steady["tasks"]["not_done_30s_after"] == 0
    assert row["burst"]["accepted"] > 0 and row["burst"]["not_done_60s_after"] == 0
    # The burst's own readings: what a missed goal's "why" names (not "machine unknown").
    burst = row["burst"]
    assert 0 < burst["machine_busy"] <= 1 and burst["cpu_cores"]["gateway"] > 0
    assert burst["nats_cpu_cores"] > 0 and burst["agents_cpu_cores"] >= 0  # 4 nodes: ticks
    from tandem.cli.bench import scale_report

    (fig,) = [f for f in scale_report.figures([r], args) if f.name == "burst_4"]
    why = fig.why or ""
    assert fig.met is not False or ("machine unknown" not in why
                                    and "CPU cores over the window: " in why)
    assert steady["routing"]["p50_us"] is not None
    assert row["memory_bytes"]["hub_rss"] > 0 and steady["nats_cpu_cores"] > 0
    assert set(row["per_node"]) >= {"nats_cpu_ms_per_s", "leaf_in_bytes_per_s", "js_api_per_s"}
    assert "4 nodes" in bench_scale.render(r)
