"""What the gateway's HTTP door counts: every answer by route template and status, and
the admission time of accepted generations only (a refusal admitted nothing)."""

from __future__ import annotations

import httpx

from tandem.common import metrics
from tandem.gateway.api import create_app
from tandem.gateway.generations import Gateway
from tandem.gateway.traces import AdmissionTracing
from tests.test_gateway import MAX_BODY, gw  # noqa: F401  (the gateway fixture)

ROUTE = "/v1/generations"


def answers(route: str, status: int) -> float:
    return metrics.REGISTRY.get_sample_value(
        "tandem_gateway_requests_total", {"route": route, "status": str(status)}) or 0.0


def admissions() -> float:
    return metrics.REGISTRY.get_sample_value(
        "tandem_generation_phase_seconds_count", {"phase": "admission"}) or 0.0


async def test_refusals_are_counted_by_route_and_status_and_never_timed_as_admissions(
        gw: Gateway) -> None:  # noqa: F811  (the fixture imported above)
    asgi, app = create_app(gw, max_body_bytes=MAX_BODY)
    app.add_middleware(AdmissionTracing)  # as the gateway service installs it
    wanted = {(ROUTE, 202): 1, (ROUTE, 422): 2, (f"{ROUTE}/{{task_id}}", 200): 1,
              (f"{ROUTE}/{{task_id}}", 404): 1, ("other", 413): 1, ("other", 404): 1}
    before = {key: answers(*key) for key in wanted}
    admitted = admissions()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi),
                                 base_url="http://gw") as http:
        refused = [await http.post(ROUTE, json={"model": "no-such-model", "prompt": "a"}),
                   await http.post(ROUTE, json={"model": "tiny-text", "prompt": "a",
                                                "cluster": "mars"})]
        assert [r.status_code for r in refused] == [422, 422], [r.text for r in refused]
        accepted = await http.post(ROUTE, json={"model": "tiny-text", "prompt": "a cat"})
        assert accepted.status_code == 202, accepted.text
        assert (await http.get(accepted.json()["status_url"])).status_code == 200
        assert (await http.get(f"{ROUTE}/never-made")).status_code == 404
        too_big = await http.post(ROUTE, content=b"{" + b" " * MAX_BODY + b"}",
                                  headers={"Content-Type": "application/json"})
        assert too_big.status_code == 413
        assert (await http.get("/no/such/path")).status_code == 404
    assert {key: answers(*key) - before[key] for key in wanted} == wanted
    assert admissions() - admitted == 1  # the 202 alone
    # The label is the route's template: no task id ever becomes a series.
    families = [f for f in metrics.REGISTRY.collect() if f.name == "tandem_gateway_requests"]
    assert not [s for f in families for s in f.samples if "never-made" in s.labels["route"]]
