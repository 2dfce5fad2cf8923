"""The gateway's observer keeps series only for what it still shows.

A gateway runs for months while nodes come and go and runs finish: a node whose heartbeat
key expired, and a run that left the view, must lose their series on its ``/metrics``,
and a node that is down must not keep showing its GPUs' last figures.
"""

from __future__ import annotations

import time

import pytest

from tandem.common import metrics, streams, subjects
from tandem.common.bus import Bus
from tandem.common.events import GpuBrief, NodeHeartbeat, encode
from tandem.common.runs import submit_run
from tandem.gateway import observe
from tandem.gateway.observe import Observer


def exposed() -> str:
    return metrics.exposition()[0].decode()


async def test_nodes_gone_or_down_lose_their_series(bus: Bus, uid: str) -> None:
    await bus.provision(streams.core_streams())
    cluster = f"obs{uid}"
    nodes = await bus.kv(streams.KV_NODES)
    gpus = [GpuBrief(index=0, util=50.0, temp=60.0, power=300.0, mem_used=1)]

    async def beat(node: str, at: float) -> None:
        await nodes.put(subjects.node_key(cluster, node), encode(NodeHeartbeat(
            cluster=cluster, node=node, gpus_total=1, gpus_usable=1, gpus=gpus, at=at)))

    for node in ("n1", "n2"):
        await beat(node, time.time())
    obs = Observer(bus, [cluster])
    await obs.refresh()
    text = exposed()
    for node in ("n1", "n2"):
        assert f'tandem_node_up{{cluster="{cluster}",node="{node}"}} 1.0' in text
        assert (f'tandem_gpu_utilization_percent{{cluster="{cluster}",gpu="0",node="{node}"}}'
                ' 50.0') in text

    await nodes.delete(subjects.node_key(cluster, "n2"))  # its key expired
    await beat("n1", time.time() - 3600)  # its heartbeat is an hour old: down
    await obs.refresh()
    text = exposed()
    assert not [ln for ln in text.splitlines() if f'cluster="{cluster}"' in ln
                and 'node="n2"' in ln]
    assert f'tandem_node_up{{cluster="{cluster}",node="n1"}} 0.0' in text
    assert f'tandem_gpu_utilization_percent{{cluster="{cluster}",gpu="0",node="n1"}}' not in text


async def test_a_run_that_leaves_the_view_loses_its_series(
        bus: Bus, uid: str, monkeypatch: pytest.MonkeyPatch) -> None:
    await bus.provision(streams.core_streams())
    monkeypatch.setattr(observe, "MAX_RUNS", 1)  # the view keeps the newest run only
    old, new = f"old{uid}", f"new{uid}"
    await submit_run(bus, {"run_id": old, "steps": 5, "ranks": 1, "cluster": "nowhere"})
    metrics.train_step(old, 3, 0.5, 10.0, 0.1)
    obs = Observer(bus, [])
    await obs.refresh()
    assert f'tandem_train_loss{{run="{old}"}} 0.5' in exposed()
    await submit_run(bus, {"run_id": new, "steps": 5, "ranks": 1, "cluster": "nowhere"})
    await obs.refresh()
    assert set(obs.runs) == {new}
    assert f'run="{old}"' not in exposed()
