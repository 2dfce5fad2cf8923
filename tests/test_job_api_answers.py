"""What the two doors (HTTP and the job service on NATS) answer, as a client written from
docs/bus-api.md alone reads it (the bus API red team's smaller findings): a cancel of a
running run is shown at once, integers are integers, an id no job could have is a 422
naming it, a refused run config names each field with what was sent, and the
credentials ``dev up --auth`` prints are the ones a program outside Tandem needs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from nats.aio.msg import Msg

from tandem.cli.dev import credentials
from tandem.cli.devstack import NatsServer
from tandem.common import permissions, subjects
from tandem.common.bus import Bus
from tandem.common.events import RunRecord, RunState, struct_replace
from tandem.common.streams import KV_RUNS
from tandem.gateway.jobs import JobService
from tests import test_gateway, test_gateway_faults

gw, http = test_gateway.gw, test_gateway.http  # one gateway on real servers, both doors
jobs = test_gateway_faults.jobs
ASK = {"model": "tiny-text", "prompt": "a cat"}


async def answer(bus: Bus, endpoint: str, body: Any) -> tuple[str | None, Any, Msg]:
    """The job service's error code (None: none), its JSON body and the message."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    msg = await bus.nc.request(subjects.jobs(endpoint), data, timeout=30)
    return (msg.headers or {}).get("Nats-Service-Error-Code"), json.loads(msg.data), msg


async def test_a_cancelled_running_run_shows_the_cancel_at_both_doors(
        http: httpx.AsyncClient, jobs: JobService, bus: Bus, uid: str) -> None:
    """A running run stays ``running`` until its coordinator stops the ranks; the answer
    used to be the same as before the cancel, so nothing showed it was taken."""
    runs = await bus.typed(KV_RUNS, RunRecord)
    ids = {}
    for door in ("http", "nats"):
        run_id = ids[door] = f"r{door}{uid}"
        r = await http.post("/v1/training-runs", json={"run_id": run_id, "steps": 30})
        assert r.status_code == 202, r.text
        assert r.json()["cancel_requested"] is False and r.json()["cancel_reason"] == ""
        await runs.update(run_id, lambda cur: struct_replace(  # a coordinator claimed it
            cur, state=RunState.running, coordinator="c1.n0"))
    r = await http.delete(f"/v1/training-runs/{ids['http']}")
    assert r.status_code == 200, r.text
    code, body, _ = await answer(bus, "cancel", {"run_id": ids["nats"]})
    assert code is None, body
    for door, view in (("http", r.json()), ("nats", body)):
        assert view["run_id"] == ids[door] and view["state"] == "running"
        assert view["cancel_requested"] is True and view["cancel_reason"]
    again = (await http.delete(f"/v1/training-runs/{ids['http']}")).json()
    code, status, _ = await answer(bus, "status", {"run_id": ids["http"]})
    assert code is None and again["cancel_requested"] and status["cancel_requested"]
    # A pending run is cancelled at once, and says so the same way.
    pending = f"rp{uid}"
    assert (await http.post("/v1/training-runs", json={"run_id": pending})).status_code == 202
    view = (await http.delete(f"/v1/training-runs/{pending}")).json()
    assert view["state"] == "cancelled" and view["cancel_requested"] is True
    schema = (await http.get("/openapi.json")).json()["components"]["schemas"]["RunView"]
    assert {"cancel_requested", "cancel_reason", "status_subject"} <= set(schema["required"])


@pytest.mark.parametrize(("field", "value"), [
    ("steps", True), ("steps", "5"), ("steps", 5.0), ("num_images", True),
    ("num_images", "2"), ("seed", 7.0), ("width", 16.0), ("height", "16"),
    ("class_label", False),
])
async def test_an_integer_field_given_another_type_is_refused_at_both_doors(
        http: httpx.AsyncClient, jobs: JobService, bus: Bus, field: str, value: Any) -> None:
    """``"steps": true`` ran as 1 step, ``"5"`` and ``5.0`` as 5, against a schema that
    says ``integer``."""
    r = await http.post("/v1/generations", json={**ASK, field: value})
    assert r.status_code == 422, r.text
    code, body, _ = await answer(bus, "generate", {**ASK, field: value})
    assert code == "422", body
    for detail in (r.json()["detail"], body["detail"]):
        [problem] = detail
        assert problem["loc"] == ["body", field] and problem["input"] == value
        assert "integer" in problem["msg"]


async def test_a_number_field_still_takes_an_integer(
        http: httpx.AsyncClient, jobs: JobService, bus: Bus) -> None:
    r = await http.post("/v1/generations", json={**ASK, "guidance": 5, "steps": 3})
    assert r.status_code == 202, r.text
    code, body, _ = await answer(bus, "generate", {**ASK, "guidance": 5})
    assert code is None, body


@pytest.mark.parametrize("body", [{"id": "a.b"}, {"run_id": "a.b"}, {"id": "x" * 65},
                                  {"run_id": ""}])
async def test_an_id_no_job_could_have_is_a_422_naming_it(
        jobs: JobService, bus: Bus, body: dict[str, str]) -> None:
    """``status {"id": "a.b"}`` answered 404, as for a job that might exist."""
    [(field, value)] = body.items()
    for endpoint in ("status", "cancel"):
        code, answered, _ = await answer(bus, endpoint, body)
        assert code == "422", answered
        [problem] = answered["detail"]
        assert problem["loc"] == ["body", field] and problem["input"] == value


async def test_a_run_id_no_run_could_have_is_a_422_naming_it_over_http(
        http: httpx.AsyncClient) -> None:
    for method in ("GET", "DELETE"):
        r = await http.request(method, "/v1/training-runs/a.b")
        assert r.status_code == 422, r.text
        [problem] = r.json()["detail"]
        assert problem["loc"] == ["path", "run_id"] and problem["input"] == "a.b"


async def test_the_published_schema_of_status_and_cancel_refuses_extra_keys(
        jobs: JobService, bus: Bus) -> None:
    """INFO allowed extra keys that the service refuses: it now says what it does."""
    info = json.loads((await bus.nc.request("$SRV.INFO.tandem-jobs", b"", timeout=30)).data)
    schemas = {e["name"]: json.loads(e["metadata"]["request_schema"])
               for e in info["endpoints"]}
    for endpoint in ("status", "cancel"):
        assert schemas[endpoint]["additionalProperties"] is False
        code, body, _ = await answer(bus, endpoint, {"id": "x", "extra": 1})
        assert code == "422" and body["detail"][0]["loc"] == ["body", "extra"]


@pytest.mark.parametrize(("config", "loc", "given"), [
    ([], ["body"], []),  # not a mapping: the body itself, not loc ["body", ""]
    ({"steps": -1}, ["body", "steps"], -1),
    ({"model": {"layers_per_block": 99}}, ["body", "model", "layers_per_block"], 99),
    ({"batch_size": 1000, "ranks": 2}, ["body", "batch_size"], 1000),  # across fields
    ({"nope": 1}, ["body", "nope"], 1),
])
async def test_a_refused_run_config_names_each_field_with_what_was_sent(
        jobs: JobService, bus: Bus, config: Any, loc: list[str], given: Any) -> None:
    """Training 422s had no ``input``; an array body was ``loc ["body", ""]`` and its
    message began ``": "``. They now read as a generation's."""
    code, body, msg = await answer(bus, "train", config)
    assert code == "422", body
    [problem] = body["detail"]
    assert problem["loc"] == loc and problem["input"] == given and problem["msg"]
    error = msg.headers["Nats-Service-Error"]
    assert not error.startswith(":") and problem["msg"] in error


async def test_a_refused_run_config_reads_the_same_over_http(http: httpx.AsyncClient) -> None:
    for config, loc, given in (([], ["body"], []), ({"steps": -1}, ["body", "steps"], -1)):
        r = await http.post("/v1/training-runs", json=config)
        assert r.status_code == 422, r.text
        [problem] = r.json()["detail"]
        assert problem["loc"] == loc and problem["input"] == given


async def test_dev_up_auth_prints_the_client_users_password_that_logs_in(
        tmp_path: Path) -> None:
    """Only the admin password was printed; a program outside Tandem needs ``client``'s,
    which was only in ``<root>/nats.conf``."""
    roles = permissions.declaration(["east"])
    passwords = {r: f"pw-{r}-{i}" for i, r in enumerate(roles)}
    conf = tmp_path / "auth.conf"
    conf.write_text(permissions.server_config(str(tmp_path / "js"), roles, passwords))
    srv = NatsServer(name="auth", log_path=tmp_path / "nats.log", config_path=conf).start()
    try:
        lines = credentials(passwords)
        [admin] = [ln for ln in lines if "TANDEM_NATS_USER=admin" in ln]
        [client] = [ln for ln in lines if "as client" in ln]
        assert "CLI" in admin and "outside Tandem" in client
        for line, pattern in ((admin, r"NATS_USER=(\w+) TANDEM_NATS_PASSWORD=(\S+)"),
                              (client, r"user (\w+), password (\S+)")):
            m = re.search(pattern, line)
            assert m is not None, line
            nc = await nats.connect(srv.url, user=m[1], password=m[2],
                                    allow_reconnect=False, connect_timeout=5)
            await nc.close()
        assert re.search(r"user (\w+)", client)[1] == permissions.CLIENT  # type: ignore[index]
    finally:
        srv.stop()
