"""What a newcomer's first calls get from a real gateway (the new-user red team's
findings 6 and 7): a JSON body ``curl -d`` sends as a form is refused naming the header to
send, and a run pinned to a cluster where no trainer coordinator has ever started says
so instead of staying ``pending`` without a word."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from tandem.cli.devstack import S3Server
from tandem.client import connect
from tandem.common.streams import trainer_consumer
from tests.serving_stack import ServingStack, gateway, http_port

pytestmark = pytest.mark.slow
SERVES = "east"  # the gateway's task cluster, as dev up's: no trainer there
TRAINS = "control"  # the one cluster whose coordinator has started, as dev up's trainer


@dataclass
class Stack:
    serving: ServingStack
    url: str  # the gateway's HTTP API


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[Stack]:
    st = ServingStack(tmp_path_factory.mktemp("newcomer"), s3_server, "newcomer")
    try:
        st.nats.start()
        gw = gateway(st.root, "gateway", **st.env(cluster=TRAINS), clusters=SERVES,
                     routing="static")
        st.children.append(gw.start())
        yield Stack(st, f"http://127.0.0.1:{http_port(gw)}")
    finally:
        st.stop()


def test_a_json_body_sent_as_a_form_is_415_saying_to_send_application_json(
        stack: Stack) -> None:
    body = json.dumps({"model": "noop"})
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        # What `curl -d '{...}' URL` sends.
        r = http.post("/v1/generations", content=body,
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 415, r.text
        detail = r.json()["detail"]
        assert "Content-Type: application/json" in detail and "curl" in detail
        r = http.post("/v1/training-runs", content="{}", headers={"Content-Type": "text/plain"})
        assert r.status_code == 415 and "'text/plain'" in r.json()["detail"], r.text
        r = http.post("/v1/generations", content=body.encode())  # no Content-Type at all
        assert r.status_code == 415 and "no Content-Type" in r.json()["detail"], r.text
        # What was taken before still is: JSON, with parameters or a +json type.
        for ctype in ("application/json", "application/json; charset=utf-8",
                      "application/vnd.api+json"):
            r = http.post("/v1/generations", content=body, headers={"Content-Type": ctype})
            assert r.status_code == 202, (ctype, r.text)


async def test_a_run_pinned_to_a_cluster_no_coordinator_ever_started_says_so_at_both_doors(
        stack: Stack, uid: str) -> None:
    # What a coordinator's start leaves on the bus: its cluster's durable.
    async with stack.serving.bus() as bus:
        await bus.provision([trainer_consumer(TRAINS)])
    for url in (stack.url, stack.serving.nats.url):
        async with await connect(url) as tandem:
            run = await tandem.train(run_id=f"e{uid}{url[:4]}", steps=5, cluster=SERVES)
            assert run["state"] == "pending"
            for view in (run, await tandem.run(run["run_id"])):
                waiting = view["waiting"]
                assert f"cluster {SERVES!r}" in waiting, (url, waiting)
                assert "none has ever started there" in waiting, (url, waiting)
                assert f"clusters with one: {TRAINS}" in waiting, (url, waiting)
            ok = await tandem.train(run_id=f"c{uid}{url[:4]}", steps=5, cluster=TRAINS)
            assert f"cluster {TRAINS!r}" in ok["waiting"] and "ever" not in ok["waiting"]
            anywhere = await tandem.train(run_id=f"a{uid}{url[:4]}", steps=5)
            assert "any cluster" in anywhere["waiting"]
            cancelled = await tandem.cancel_run(run["run_id"])
            assert cancelled["state"] == "cancelled" and cancelled["waiting"] == ""
