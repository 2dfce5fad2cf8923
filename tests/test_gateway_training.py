"""POST /v1/training-runs: validated with the same code as `tandem train submit`,
recorded pending in KV `runs` and announced on `train.<run>.status`."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from tandem.common import subjects
from tandem.common.bus import Bus
from tandem.common.events import TrainStatus, decode
from tandem.common.jobs import JobLimits
from tandem.common.models import Registry
from tandem.common.streams import core_streams
from tandem.gateway.api import create_app
from tandem.gateway.generations import Gateway


@pytest.fixture
async def http(bus: Bus) -> AsyncIterator[httpx.AsyncClient]:
    await bus.provision(core_streams())
    gw = Gateway(bus, Registry.parse(""), ["local"], s3=None, bucket="b", url_ttl=60,
                 publish_retry_for=1.0,
                 limits=JobLimits(max_images=4, max_prompt_chars=100, max_size=512))
    asgi, _ = create_app(gw, max_body_bytes=65536, train_clusters=["control", "local"])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi),
                                 base_url="http://gw") as client:
        yield client


async def test_submitted_run_is_recorded_pending_and_announced(
        http: httpx.AsyncClient, bus: Bus, uid: str) -> None:
    run_id = f"r{uid}"
    r = await http.post("/v1/training-runs", json={"run_id": run_id, "steps": 30})
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["run_id"] == run_id and body["state"] == "pending"
    assert r.headers["location"] == body["status_url"] == f"/v1/training-runs/{run_id}"
    msg = await bus.js.get_last_msg("TRAIN", subjects.train(run_id, "status"))
    assert decode(msg.data, TrainStatus).state == "pending"
    view = (await http.get(body["status_url"])).json()
    assert view["config"]["steps"] == 30
    # The same config again is idempotent; a different one under the same id is refused.
    assert (await http.post("/v1/training-runs",
                            json={"run_id": run_id, "steps": 30})).status_code == 202
    clash = await http.post("/v1/training-runs", json={"run_id": run_id, "steps": 31})
    assert clash.status_code == 409 and run_id in clash.json()["detail"]


async def test_invalid_run_config_is_422_naming_the_field(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/training-runs", json={"steps": -1})
    assert r.status_code == 422
    assert any("steps" in d["loc"] for d in r.json()["detail"])
    r = await http.post("/v1/training-runs", json={"run_id": "bad.id"})
    assert r.status_code == 422 and "run_id" in r.text


async def test_a_run_for_a_cluster_this_gateway_does_not_send_to_is_422_naming_them(
        http: httpx.AsyncClient, uid: str) -> None:
    """It used to be accepted and stay pending for good (no coordinator there), holding
    one of its key's run slots."""
    r = await http.post("/v1/training-runs", json={"run_id": f"n{uid}", "cluster": "north"})
    assert r.status_code == 422, r.text
    [problem] = r.json()["detail"]
    assert problem["loc"] == ["body", "cluster"] and "control, local" in problem["msg"]
    assert problem["input"] == "north"
    assert (await http.get(f"/v1/training-runs/n{uid}")).status_code == 404
    r = await http.post("/v1/training-runs", json={"run_id": f"l{uid}", "cluster": "local"})
    assert r.status_code == 202, r.text


async def test_an_id_no_job_could_have_is_422_naming_it(http: httpx.AsyncClient) -> None:
    for path in ("/v1/generations/a.b", "/v1/training-runs/a.b"):
        r = await http.get(path)
        assert r.status_code == 422, (path, r.text)


async def test_unknown_run_is_404(http: httpx.AsyncClient) -> None:
    r = await http.get("/v1/training-runs/nope")
    assert r.status_code == 404 and "nope" in r.json()["detail"]


async def test_clusters_view_shows_each_node_with_health_and_gpus(
        http: httpx.AsyncClient, bus: Bus, uid: str) -> None:
    from tandem.common.events import GpuBrief, NodeHeartbeat
    from tandem.common.streams import KV_NODES

    nodes = await bus.typed(KV_NODES, NodeHeartbeat)
    cluster = f"c{uid}"
    await nodes.put(subjects.node_key(cluster, "n1"), NodeHeartbeat(
        cluster=cluster, node="n1", gpus_total=8, gpus_usable=8, gpus_free=6,
        models=["digits"], gpus=[GpuBrief(index=0, util=55.0, temp=61.0)]))
    r = await http.get("/v1/clusters")
    assert r.status_code == 200
    [view] = [c for c in r.json()["clusters"] if c["name"] == cluster]
    [node] = view["nodes"]
    assert node["node"] == "n1" and node["status"] == "healthy" and node["up"] is True
    assert node["gpus_total"] == 8 and node["gpus_free"] == 6
