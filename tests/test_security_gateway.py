"""Keys at the edge: a real gateway process over HTTPS with hashed API keys.

401 without a known key, 403 without the scope, 429 with Retry-After over a key's rate,
open event streams or unfinished training runs; the request-shape limits are settings
and each answers a 4xx naming the limit. No worker runs: tasks stay queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from tandem.cli.devstack import NatsServer, S3Server
from tandem.client import JobError, SyncClient
from tandem.common.bus import Bus, TypedKV
from tandem.common.events import RateMark, RunRecord, RunState, struct_replace
from tandem.common.jobs import Caller
from tandem.common.settings import Settings, load
from tandem.common.streams import KV_RATES, KV_RUNS, core_streams
from tandem.gateway.api import caller
from tandem.gateway.auth import (
    AuthSettings,
    Denied,
    Guard,
    Keyring,
    Limits,
    hash_key,
    new_key,
    parse_keys,
)
from tandem.gateway.training import add_training_routes
from tests.conftest import PYTHON, service_env
from tests.nats_proxy import NatsProxy
from tests.security_support import TIMEOUT, Gateway, gateway_replicas, https_gateway

KEYS = {  # name -> (scopes, extra limits)
    "gen": (["generate"], {}),
    "gen2": (["generate"], {}),
    "trainer": (["train"], {}),
    "trainer2": (["train"], {}),
    "ops": (["admin"], {}),
    "slow": (["generate"], {"rate": 0.001, "burst": 2}),
    "viewer": (["generate"], {"max_streams": 1}),
    "twodoors": (["generate", "train"], {"rate": 0.001, "burst": 3, "max_runs": 1}),
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server
            ) -> Iterator[Gateway]:
    with https_gateway(tmp_path_factory.mktemp("gw"), s3_server, KEYS, sse_ping="0.2",
                       max_body_bytes="2048", max_prompt_chars="50", max_images="2") as gw:
        yield gw


def test_no_key_or_an_unknown_one_is_401_and_public_paths_stay_open(gateway: Gateway) -> None:
    with gateway.client() as http:
        r = http.get("/v1/models")
        assert r.status_code == 401 and "no API key" in r.json()["detail"]
        assert r.headers["www-authenticate"].startswith("Bearer")
        r = http.post("/v1/generations", json={"model": "noop"},
                      headers={"Authorization": "Bearer tdm_not-a-key"})
        assert r.status_code == 401 and "unknown API key" in r.json()["detail"]
        assert http.get("/healthz").status_code == 200
        schema = http.get("/openapi.json").json()
        assert schema["components"]["securitySchemes"]["ApiKey"]["scheme"] == "bearer"
        assert "401" in schema["paths"]["/v1/generations"]["post"]["responses"]


def test_a_key_without_the_scope_is_403_naming_the_scope(gateway: Gateway) -> None:
    with gateway.client("trainer") as http:
        r = http.post("/v1/generations", json={"model": "noop"})
        assert r.status_code == 403
        assert "lacks scope 'generate'" in r.json()["detail"] and "'trainer'" in r.json()["detail"]
        assert http.get("/v1/models").status_code == 200  # any key may list models
    with gateway.client("gen") as http:
        assert http.post("/v1/generations", json={"model": "noop"}).status_code == 202
        r = http.get("/metrics")  # unlisted routes need admin
        assert r.status_code == 403 and "'admin'" in r.json()["detail"]
    with gateway.client("ops") as http:  # admin holds every scope
        assert http.get("/metrics").status_code == 200
        assert http.post("/v1/generations", json={"model": "noop"}).status_code == 202
    with gateway.client() as http:  # the other header form
        r = http.get("/v1/models", headers={"X-API-Key": gateway.keys["gen"]})
        assert r.status_code == 200


def test_a_key_over_its_rate_gets_429_with_retry_after_and_others_are_unaffected(
        gateway: Gateway) -> None:
    with gateway.client("slow") as http:
        assert [http.get("/v1/models").status_code for _ in range(2)] == [200, 200]
        r = http.get("/v1/models")
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        assert "rate limit of 0.001 requests/s (burst 2)" in r.json()["detail"]
    with gateway.client("gen") as http:
        assert http.get("/v1/models").status_code == 200


def test_open_event_streams_per_key_are_bounded_and_a_closed_one_frees_its_slot(
        gateway: Gateway) -> None:
    with gateway.client("viewer", timeout=TIMEOUT) as http:
        tid = http.post("/v1/generations", json={"model": "noop"}).json()["id"]
        path = f"/v1/generations/{tid}/events"
        with http.stream("GET", path) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # kept: a collected iterator closes the stream
            assert next(lines) == "event: state"
            second = http.get(path)
            assert second.status_code == 429 and second.headers["retry-after"] == "1"
            assert ("has 1 event streams open (1 through this gateway); the limit is 1"
                    in second.json()["detail"])
        deadline = time.monotonic() + TIMEOUT  # the server notices at its next ping
        while True:
            with http.stream("GET", path) as again:
                if again.status_code == 200:
                    break
            assert time.monotonic() < deadline, "the closed stream's slot was never freed"
            time.sleep(0.1)  # retrying as a client told Retry-After would


@contextlib.contextmanager
def held_stream(http: httpx.Client, path: str) -> Iterator[None]:
    """An event stream of ``path``, open while the block runs, once the key may open one
    (retrying as a client told Retry-After would)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        with http.stream("GET", path) as r:
            if r.status_code == 200:
                lines = r.iter_lines()  # kept: a collected iterator closes the stream
                assert next(lines) == "event: state"
                yield
                return
            assert r.status_code == 429, r.read()
            assert time.monotonic() < deadline, f"no slot freed: {r.read()!r}"
        time.sleep(0.1)


def test_a_keys_open_event_streams_are_bounded_across_gateways_and_a_killed_ones_lapse(
        tmp_path: Path, s3_server: S3Server) -> None:
    """Two replicas of one deployment and a key that may hold two event streams: with one
    open through each, a third is refused by either, naming the count; one closed frees
    its slot for the other replica; a replica killed (-9) with a stream open stops
    counting it once its lease (2 s here) has run out."""
    nats = NatsServer(name="two", log_path=tmp_path / "nats.log",
                      store_dir=tmp_path / "js").start()
    keys = {"two": (["generate"], {"max_streams": 2})}
    try:
        with gateway_replicas(tmp_path, nats.url, s3_server, keys, 2, sse_ping="0.2",
                              stream_lease="2") as (a, b), \
                a.client("two", timeout=TIMEOUT) as ha, b.client("two", timeout=TIMEOUT) as hb:
            tid = ha.post("/v1/generations", json={"model": "noop"}).json()["id"]
            path = f"/v1/generations/{tid}/events"
            with held_stream(ha, path), held_stream(hb, path):
                for http in (ha, hb):
                    third = http.get(path)
                    assert third.status_code == 429, third.text
                    assert ("has 2 event streams open (1 through this gateway); the limit "
                            "is 2") in third.json()["detail"]
            with held_stream(ha, path):  # both closed: B's slot is free for A's
                pass
            kept = contextlib.ExitStack()
            kept.enter_context(held_stream(ha, path))
            a.proc.kill()  # its stream's count stays in KV sse until its lease runs out
            a.proc.wait()
            with held_stream(hb, path), held_stream(hb, path):  # both slots B's
                pass
            kept.close()
    finally:
        nats.stop()


def test_limits_are_settings_and_exceeding_one_is_a_clear_4xx(gateway: Gateway) -> None:
    with gateway.client("gen") as http:
        r = http.post("/v1/generations", content=b"{" + b" " * 4000 + b"}",
                      headers={"content-type": "application/json"})
        assert r.status_code == 413 and "the limit is 2048 bytes" in r.json()["detail"]
        r = http.post("/v1/generations", json={"model": "tiny-text", "prompt": "x" * 51})
        assert r.status_code == 422 and "at most 50" in r.json()["detail"][0]["msg"]
        r = http.post("/v1/generations", json={"model": "noop", "num_images": 3})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "num_images"]


def test_a_task_is_its_keys_own_another_key_gets_404_and_admin_sees_it(
        gateway: Gateway) -> None:
    with gateway.client("gen") as http:
        r = http.post("/v1/generations", json={"model": "noop"})
        assert r.status_code == 202
        tid = r.json()["id"]
        mine = http.get(f"/v1/generations/{tid}")
        assert mine.status_code == 200 and mine.json()["owner"] == "gen"
    with gateway.client("gen2") as http:
        for method, path in (("GET", f"/v1/generations/{tid}"),
                             ("GET", f"/v1/generations/{tid}/events"),
                             ("DELETE", f"/v1/generations/{tid}")):
            r = http.request(method, path)
            assert r.status_code == 404, (method, path, r.status_code, r.text)
            assert r.json()["detail"] == f"no task {tid!r}"  # as for an id that never was
    with gateway.client("ops") as http:  # admin sees every key's tasks
        view = http.get(f"/v1/generations/{tid}").json()
        assert view["owner"] == "gen" and view["state"] == "queued"  # gen2's DELETE did nothing


def test_idempotency_keys_are_scoped_per_api_key(gateway: Gateway) -> None:
    body, headers = {"model": "noop"}, {"Idempotency-Key": "same-key-for-both"}
    with gateway.client("gen") as http:
        first = http.post("/v1/generations", json=body, headers=headers)
        again = http.post("/v1/generations", json=body, headers=headers)
    with gateway.client("gen2") as http:
        other = http.post("/v1/generations", json=body, headers=headers)
        assert other.status_code == 202 and "idempotent-replayed" not in other.headers
        assert http.get(f"/v1/generations/{other.json()['id']}").status_code == 200
    assert first.status_code == again.status_code == 202
    assert again.headers["idempotent-replayed"] == "true"
    assert first.json()["id"] == again.json()["id"] != other.json()["id"]


def test_a_training_run_is_its_keys_own_and_its_id_is_not_anothers_to_take(
        gateway: Gateway) -> None:
    config = {"run_id": f"owned-{uuid.uuid4().hex[:8]}", "steps": 10, "cluster": "east"}
    with gateway.client("trainer") as http:
        r = http.post("/v1/training-runs", json=config)
        assert r.status_code == 202, r.text
        assert http.post("/v1/training-runs", json=config).status_code == 202  # idempotent
        assert http.get(f"/v1/training-runs/{config['run_id']}").status_code == 200
    with gateway.client("trainer2") as http:
        r = http.get(f"/v1/training-runs/{config['run_id']}")
        assert r.status_code == 404 and config["run_id"] in r.json()["detail"]
        r = http.post("/v1/training-runs", json=config)
        assert r.status_code == 409 and "owner" in r.json()["detail"]
    with gateway.client("ops") as http:
        r = http.get(f"/v1/training-runs/{config['run_id']}")
        assert r.status_code == 200 and r.json()["owner"] == "trainer"


def test_ids_that_are_not_safe_tokens_never_reach_a_subject_or_key(gateway: Gateway) -> None:
    with gateway.client("gen") as http:
        for raw in ("a.b", "%2A", "%3E", "a%20b", "..%2Fx", "x" * 65):
            for method, path in (("GET", f"/v1/generations/{raw}"),
                                 ("GET", f"/v1/generations/{raw}/events"),
                                 ("DELETE", f"/v1/generations/{raw}")):
                r = http.request(method, path)
                assert r.status_code in (404, 422), (method, path, r.status_code, r.text)


def test_keys_are_kept_hashed_never_logged_and_https_is_required(gateway: Gateway) -> None:
    log = gateway.log.read_text()
    assert '"auth.enabled"' in log
    for key in gateway.keys.values():
        assert key not in log
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port gets no answer
        httpx.get(gateway.url.replace("https://", "http://") + "/healthz", timeout=5)


def test_a_keys_rate_and_runs_are_one_budget_across_http_and_the_job_service(
        gateway: Gateway) -> None:
    """Neither door is a way around the other's limits: one bucket and one count of
    unfinished runs per key, whichever door each request came in by."""
    key = gateway.keys["twodoors"]
    run = {"steps": 10, "cluster": "east"}  # no trainer here: it stays pending
    with SyncClient(gateway.nats_url, api_key=key) as bus, \
            gateway.client("twodoors") as http:
        submitted = bus.train(**run)  # the job service: request 1 of 3, run 1 of 1
        assert submitted["state"] == "pending" and submitted["owner"] == "twodoors"
        second = http.post("/v1/training-runs", json=run)  # HTTP: request 2 of 3
        assert second.status_code == 429, second.text
        assert "1 training runs not finished" in second.json()["detail"]
        assert submitted["run_id"] in second.json()["detail"]
        assert http.get("/v1/models").status_code == 200  # request 3 of 3
        with pytest.raises(JobError) as err:
            bus.models()  # the bucket HTTP emptied
        assert err.value.status == 429 and "over its rate limit" in str(err.value)
        assert err.value.retry_after is not None and err.value.retry_after >= 1
        again = http.get("/v1/models")
        assert again.status_code == 429 and int(again.headers["retry-after"]) >= 1


def test_a_bad_key_list_stops_the_gateway_at_start_naming_the_setting(tmp_path: Path) -> None:
    env = service_env(api_keys='[{"name": "x", "sha256": "not-hex", "scopes": ["generate"]}]')
    res = subprocess.run([PYTHON, "-m", "tandem.gateway"], env=env, capture_output=True,
                         text=True, timeout=60, cwd=tmp_path)
    assert res.returncode == 2
    assert "TANDEM_API_KEYS" in res.stderr and "sha256" in res.stderr


# ------------------------------------------------------------------- training runs per key


@contextlib.asynccontextmanager
async def runs_gateway(bus: Bus, max_runs: int, keys: dict[str, str], rate: float = 1000.0,
                       burst: int = 1000) -> AsyncIterator[httpx.AsyncClient]:
    """One gateway's Guard in front of its training-run routes, on a real bus: its own
    ``Limits``, as each replica (or a restarted one) has; ``keys``: name -> key."""
    entries = [{"name": n, "sha256": hash_key(k), "scopes": ["train"]}
               for n, k in keys.items()]
    settings = load(AuthSettings, api_keys=json.dumps(entries), max_runs_per_key=max_runs,
                    rate_limit=rate, rate_burst=burst)
    keyring = Keyring(parse_keys(settings.api_keys))
    limits = await Limits.on(bus, keyring, settings)
    app = FastAPI()
    add_training_routes(app, bus, caller, limits)  # the gateway's own route, submitting for real
    guard = Guard.wrap(app, keyring, limits)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=guard),
                                 base_url="http://gw") as client:
        yield client


@pytest.fixture
async def runs_app(bus: Bus) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, str]]]:
    await bus.provision(core_streams())
    keys = {"a": new_key(), "b": new_key()}
    async with runs_gateway(bus, 2, keys) as client:
        yield client, keys


async def test_unfinished_training_runs_per_key_are_bounded_until_one_finishes(
        runs_app: tuple[httpx.AsyncClient, dict[str, str]], bus: Bus,
        settings: Settings) -> None:
    http, keys = runs_app
    a = {"Authorization": f"Bearer {keys['a']}"}
    config = {"steps": 10, "cluster": settings.cluster}
    first, second = [await http.post("/v1/training-runs", json=config, headers=a)
                     for _ in range(2)]
    assert first.status_code == second.status_code == 202
    third = await http.post("/v1/training-runs", json=config, headers=a)
    assert third.status_code == 429 and "the limit is 2" in third.json()["detail"]
    assert first.json()["run_id"] in third.json()["detail"]
    other = await http.post("/v1/training-runs", json=config,
                            headers={"Authorization": f"Bearer {keys['b']}"})
    assert other.status_code == 202  # the limit is per key
    runs = await bus.typed(KV_RUNS, RunRecord)
    await runs.update(first.json()["run_id"],  # as its trainer would record it
                      lambda r: None if r is None else struct_replace(r, state=RunState.failed))
    fourth = await http.post("/v1/training-runs", json=config, headers=a)
    assert fourth.status_code == 202, fourth.text


async def test_a_keys_unfinished_runs_are_bounded_across_gateways_and_restarts(
        bus: Bus, settings: Settings, uid: str) -> None:
    """Two replicas, then a third started later (a restarted one): the key's limit of
    unfinished runs is the fleet's. Of submissions racing through both replicas for one
    slot, exactly one gets it, and a refused run leaves no record behind."""
    await bus.provision(core_streams())
    name = f"fleet-{uid}"
    keys = {name: new_key()}
    a = {"Authorization": f"Bearer {keys[name]}"}
    config = {"steps": 10, "cluster": settings.cluster}
    runs = await bus.typed(KV_RUNS, RunRecord)

    async def unfinished() -> list[str]:
        return sorted(k for k, v in (await runs.items()).items()
                      if v.owner == name and not v.state.terminal)

    async with runs_gateway(bus, 2, keys) as one, runs_gateway(bus, 2, keys) as two:
        first = await one.post("/v1/training-runs", json=config, headers=a)
        second = await two.post("/v1/training-runs", json=config, headers=a)
        assert first.status_code == second.status_code == 202
        third = await two.post("/v1/training-runs", json=config, headers=a)
        assert third.status_code == 429 and "the limit is 2" in third.json()["detail"]
        assert first.json()["run_id"] in third.json()["detail"]
        # One finishes; eight submissions race through both replicas for its slot.
        await runs.update(first.json()["run_id"],
                          lambda r: None if r is None else struct_replace(r, state=RunState.failed))
        raced = await asyncio.gather(*(
            gw.post("/v1/training-runs", json=config, headers=a)
            for gw in (one, two) * 4))
        codes = sorted(r.status_code for r in raced)
        assert codes.count(202) == 1 and codes.count(429) == 7, codes
        assert len(await unfinished()) == 1 + codes.count(202)
        refused = [r for r in raced if r.status_code == 429]
        assert all(int(r.headers["retry-after"]) >= 1 for r in refused)

    # A gateway started now knows nothing in memory: the limit still holds.
    async with runs_gateway(bus, 2, keys) as restarted:
        if len(await unfinished()) < 2:
            took = await restarted.post("/v1/training-runs", json=config, headers=a)
            assert took.status_code == 202
        late = await restarted.post("/v1/training-runs", json=config, headers=a)
        assert late.status_code == 429, late.text
        assert len(await unfinished()) == 2


async def test_a_keys_rate_is_one_budget_across_gateways_and_restarts(
        bus: Bus, uid: str) -> None:
    """Requests raced through two replicas take from one budget (KV ``rates``): exactly
    the burst gets through, as through one gateway; one started later (a restarted one)
    knows nothing in memory and still refuses; another key is unaffected."""
    await bus.provision(core_streams())
    keys = {f"rate-{uid}": new_key(), f"other-{uid}": new_key()}
    a, b = ({"Authorization": f"Bearer {k}"} for k in keys.values())
    async with runs_gateway(bus, 2, keys, rate=0.001, burst=3) as one, \
            runs_gateway(bus, 2, keys, rate=0.001, burst=3) as two:
        raced = await asyncio.gather(*(gw.get(f"/v1/training-runs/none-{uid}", headers=a)
                                       for gw in (one, two) * 4))
        codes = sorted(r.status_code for r in raced)
        assert codes == [404] * 3 + [429] * 5, codes  # admitted ones find no such run
        refused = [r for r in raced if r.status_code == 429]
        assert all("rate limit of 0.001 requests/s (burst 3)" in r.json()["detail"]
                   and int(r.headers["retry-after"]) >= 1 for r in refused)
        assert (await two.get(f"/v1/training-runs/none-{uid}", headers=b)).status_code == 404
    async with runs_gateway(bus, 2, keys, rate=0.001, burst=3) as restarted:
        late = await restarted.get(f"/v1/training-runs/none-{uid}", headers=a)
        assert late.status_code == 429, late.text


async def test_a_rate_that_cannot_be_read_refuses_the_request_with_503(
        nats_server: NatsServer, bus: Bus, uid: str) -> None:
    """No request goes through unaccounted: with its connection to NATS away, the
    gateway answers 503 naming KV ``rates``, and serves again once it is back."""
    await bus.provision(core_streams())
    proxy = await NatsProxy(nats_server.url).start()
    away = await Bus.connect(load(Settings, nats_url=proxy.url), "gateway")
    key = new_key()
    settings = load(AuthSettings, api_keys=json.dumps(
        [{"name": f"k-{uid}", "sha256": hash_key(key), "scopes": ["train"]}]))
    limits = await Limits.on(away, Keyring(parse_keys(settings.api_keys)), settings)
    caller = Caller(key=f"k-{uid}")
    try:
        await limits.admit(caller)
        await proxy.cut()
        with pytest.raises(Denied) as refused:
            await limits.admit(caller)
        assert refused.value.status == 503 and "KV rates" in refused.value.message
        proxy.mend()
        await asyncio.wait_for(away.nc.flush(), TIMEOUT)  # reconnected
        await limits.admit(caller)
        mark = await (await bus.typed(KV_RATES, RateMark)).get(f"k-{uid}")
        assert mark is not None and mark[1] >= 2  # both requests let through are written
    finally:
        await away.drain()
        await proxy.stop()


async def one_key_limits(bus: Bus, name: str, burst: int) -> tuple[Limits, TypedKV[RateMark]]:
    """One gateway's ``Limits`` for a key named ``name``: ``burst`` requests, then almost
    none (0.001/s)."""
    await bus.provision(core_streams())
    settings = load(AuthSettings, api_keys=json.dumps([{
        "name": name, "sha256": hash_key(new_key()), "scopes": ["generate"],
        "rate": 0.001, "burst": burst}]))
    limits = await Limits.on(bus, Keyring(parse_keys(settings.api_keys)), settings)
    return limits, limits.rates


async def test_one_keys_requests_at_once_take_its_budget_in_one_write(
        bus: Bus, uid: str) -> None:
    """Fifty requests of one key at once through one gateway: exactly its burst of 10
    are let through and the rest refused, as one at a time would be, in two writes of
    its mark (the first request's, then one for all that waited behind it), not one a
    request let through, so a key's rate through one replica is not bounded by the KV
    round trip."""
    limits, _ = await one_key_limits(bus, f"burst-{uid}", 10)
    before = (await bus.js.stream_info(f"KV_{KV_RATES}")).state.last_seq
    got = await asyncio.gather(*(limits.admit(Caller(key=f"burst-{uid}"))
                                 for _ in range(50)), return_exceptions=True)
    assert got.count(None) == 10
    refused = [g for g in got if g is not None]
    assert len(refused) == 40 and all(isinstance(g, Denied) and g.status == 429
                                      for g in refused), refused
    assert got[:10] == [None] * 10  # in arrival order
    assert (await bus.js.stream_info(f"KV_{KV_RATES}")).state.last_seq - before == 2


async def test_a_request_that_leaves_before_its_turn_takes_nothing_from_the_budget(
        bus: Bus, uid: str) -> None:
    name = f"gone-{uid}"
    limits, _ = await one_key_limits(bus, name, 2)
    turn = limits._state(limits.keys.by_name[name]).rate_lock
    async with turn:  # another group is being decided: these three wait for the turn
        first, gone, third = (asyncio.ensure_future(limits.admit(Caller(key=name)))
                              for _ in range(3))
        await asyncio.sleep(0)  # one pass of the loop: each waits on the turn now
        assert len(limits.state[name].asking) == 3
        gone.cancel()  # its client left while it waited
    assert await first is None and await third is None
    assert gone.cancelled()
    with pytest.raises(Denied) as over:  # the burst of 2 is spent by the two that stayed
        await limits.admit(Caller(key=name))
    assert over.value.status == 429


async def test_a_request_that_leaves_while_its_group_is_decided_counts_the_group_once(
        nats_server: NatsServer, bus: Bus, uid: str) -> None:
    """The request deciding a group leaves while its write is on the server but its
    answer is not back: the group is still decided by that one write, so the requests
    that stayed are let through (before, the next turn took them from the budget again
    and refused them)."""
    await bus.provision(core_streams())
    proxy = await NatsProxy(nats_server.url).start()
    away = await Bus.connect(load(Settings, nats_url=proxy.url), "gateway")
    name = f"once-{uid}"
    settings = load(AuthSettings, api_keys=json.dumps([{
        "name": name, "sha256": hash_key(new_key()), "scopes": ["generate"],
        "rate": 0.001, "burst": 4}]))
    limits = await Limits.on(away, Keyring(parse_keys(settings.api_keys)), settings)
    try:
        await limits.admit(Caller(key=name))  # 1 of 4: the mark is known, no read next
        turn = limits._state(limits.keys.by_name[name]).rate_lock
        async with turn:  # the three queue behind one turn: one group
            leader, second, third = (asyncio.ensure_future(limits.admit(Caller(key=name)))
                                     for _ in range(3))
            await asyncio.sleep(0)  # one pass of the loop: each waits on the turn now
            proxy.hold_reply()
        await asyncio.wait_for(proxy.reply_held.wait(), TIMEOUT)  # the write is done
        leader.cancel()  # its client left while the answer was on its way
        await asyncio.sleep(0)  # one pass: the cancel is delivered to the waiting leader
        proxy.release_reply()
        assert await second is None and await third is None
        with pytest.raises(asyncio.CancelledError):
            await leader
        with pytest.raises(Denied) as over:  # 1 + the group of 3: the burst is spent
            await limits.admit(Caller(key=name))
        assert over.value.status == 429
    finally:
        await away.drain()
        await proxy.stop()


def test_result_urls_are_presigned_for_the_configured_ttl_only(s3_server: S3Server,
                                                               uid: str) -> None:
    from urllib.parse import parse_qs, urlparse

    from tandem.common.events import GenerationTask, TaskRecord, TaskState
    from tandem.common.models import Registry
    from tandem.common.storage import ensure_bucket, s3_client
    from tandem.gateway.generations import Gateway as Edge

    s3 = s3_client(load(Settings, s3_endpoint=s3_server.url, s3_access_key="tandem",
                        s3_secret_key="tandem"))
    bucket = f"b{uid}"
    ensure_bucket(s3, bucket)
    s3.put_object(Bucket=bucket, Key=f"images/{uid}/0.png", Body=b"png")
    edge = Edge(None, Registry.parse(""), ["east"], s3=s3, bucket=bucket, url_ttl=90,  # type: ignore[arg-type]
                publish_retry_for=1.0)
    rec = TaskRecord(task=GenerationTask(task_id=uid, model="noop"), state=TaskState.succeeded,
                     images=[f"images/{uid}/0.png"])
    from datetime import UTC, datetime

    before = int(time.time())  # X-Amz-Date has whole seconds
    image = edge.view(rec)["images"][0]
    after = time.time()
    query = parse_qs(urlparse(image["url"]).query)
    # SigV4 states the lifetime in the URL: exactly the TTL, from the moment of signing.
    assert query["X-Amz-Expires"] == ["90"]
    signed = datetime.strptime(query["X-Amz-Date"][0], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    assert before <= signed.timestamp() <= after
    assert "X-Amz-Signature" in query
    assert httpx.get(image["url"]).content == b"png"


@pytest.mark.parametrize(("text", "named"), [
    # One entry as `tandem security api-key` prints it, not wrapped in a list.
    ('{"name": "a", "sha256": "00", "scopes": ["generate"]}',
     "the whole value: Input should be a valid array (a JSON list of keys"),
    ('[{"name": 1}]', "0.name: Input should be a valid string"),
])
def test_a_keys_value_that_is_not_a_list_of_keys_names_what_is_wrong(
        text: str, named: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_keys(text)
    assert named in str(err.value), err.value
