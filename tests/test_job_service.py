"""The job service (``tandem-jobs``, nats.micro) against a real stack: a gateway with API
keys, a worker and a trainer coordinator on one NATS server.

The main test runs a client that is not Tandem's (``tests/support/raw_jobs_client.py``:
nats-py and the standard library only) through discovery, generation, progress, results,
idempotency, field errors, cancel, the bare-publish door and its DLQ, and training with
a cancel. The others check ``tandem.client`` gives the same answers over NATS and HTTP,
and that the README's bare nats-py example runs as printed.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.cli.devstack import S3Server
from tandem.client import JobError, SyncClient
from tandem.common.storage import ensure_bucket, s3_client
from tandem.gateway.auth import hash_key, new_key
from tests.conftest import PYTHON, ROOT
from tests.serving_stack import Child, ServingStack, gateway, http_port, worker

CLUSTER = "jobs"
TINY_MODEL = {"sample_size": 8, "block_out_channels": [16, 32],
              "down_block_types": ["DownBlock2D", "DownBlock2D"],
              "up_block_types": ["UpBlock2D", "UpBlock2D"]}
RUN = {"steps": 2, "batch_size": 8, "ranks": 1, "device": "cpu", "checkpoint_every": 2,
       "warmup_steps": 1, "model": TINY_MODEL, "seed": 7, "cluster": CLUSTER,
       "watchdog": {"hang_floor_s": 120, "backoff_s": 0.2, "startup_timeout_s": 200}}

pytestmark = pytest.mark.slow


class Jobs(ServingStack):
    """NATS, the session's S3, a gateway with two keys, a worker and a trainer."""

    def __init__(self, root: Path, s3: S3Server) -> None:
        super().__init__(root, s3, "jobs")
        self.keys = {"alice": new_key(), "bob": new_key()}
        self.port = 0

    def start(self) -> None:
        self.nats.start()
        ensure_bucket(s3_client(self.settings()), self.bucket)
        scopes = {"alice": ["generate", "train"], "bob": ["generate"]}
        (self.root / "keys.json").write_text(json.dumps([
            {"name": n, "sha256": hash_key(k), "scopes": scopes[n]}
            for n, k in self.keys.items()]))
        common = self.env(cluster=CLUSTER)
        gw = gateway(self.root, "gateway", **common, clusters=CLUSTER, routing="static",
                     api_keys=f"@{self.root / 'keys.json'}",
                     train_clusters=f"{CLUSTER},nowhere")  # nowhere: no coordinator
        self.children.append(gw.start())
        w = worker(self.root, "w-jobs", **common, node="w-jobs", serve="digits")
        trainer = Child(name="trainer", log_path=self.root / "trainer.log",
                        module="tandem.trainer", env={
                            **common, "node": "n0", "status_every_s": "0.5",
                            "checkpoint_root": str(self.root / "ckpt"),
                            "work_root": str(self.root / "work")})
        self.children += [w.start(), trainer.start()]
        self.port = http_port(gw)
        w.wait_healthy()
        trainer.wait_healthy()

    def client(self, transport: str, key: str = "alice") -> SyncClient:
        url = self.nats.url if transport == "nats" else f"http://127.0.0.1:{self.port}"
        return SyncClient(url, api_key=self.keys[key])


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server) -> Iterator[Jobs]:
    st = Jobs(tmp_path_factory.mktemp("jobs"), s3_server)
    try:
        st.start()
        yield st
    finally:
        st.stop()


def test_a_client_with_only_nats_py_submits_follows_and_cancels_jobs(jobs: Jobs) -> None:
    env = {"NATS_URL": jobs.nats.url, "API_KEY": jobs.keys["alice"],
           "OTHER_KEY": jobs.keys["bob"], "CLUSTER": CLUSTER, "RUN_CONFIG": json.dumps(RUN)}
    res = subprocess.run([PYTHON, "-I", str(ROOT / "tests/support/raw_jobs_client.py")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    out: dict[str, Any] = json.loads(res.stdout)
    assert out["imports_tandem"] == []  # nothing of Tandem's was loaded by the client

    # Discovery: $SRV.PING and $SRV.INFO name every endpoint, its subject and schema.
    assert out["ping"] == "io.nats.micro.v1.ping_response"
    endpoints = out["info"]["endpoints"]
    assert {n: e["subject"] for n, e in endpoints.items()} == {
        n: f"tandem.jobs.{n}" for n in ("generate", "train", "cancel", "status", "models")}
    assert "class_label" in endpoints["generate"]["schema"]["properties"]
    assert "steps" in endpoints["train"]["schema"]["properties"]

    # A generation: accepted, every step's progress, one result, the images in S3.
    accepted = out["accepted"]
    assert accepted["code"] == 0 and accepted["state"] == "queued"
    assert accepted["cluster"] == CLUSTER
    assert accepted["record_subject"] == f"tasks.written.{accepted['id']}"
    # The record's writes, followed by a core subscription: queued, then succeeded once
    # with the images (running between only for a run longer than the progress interval).
    writes = out["writes"]
    assert writes[0] == "queued" and writes[-1] == "succeeded", writes
    assert out["result"]["state"] == "succeeded" and len(out["result"]["images"]) == 1
    assert out["progress_steps"] == [1, 2, 3, 4]
    assert out["status"] == {"code": 0, "state": "succeeded", "owner": "alice", "images": 1}
    assert out["png_signature"] == b"\x89PNG\r\n\x1a\n".hex()
    assert out["other_key_status"]["code"] == 404  # bob cannot see alice's task

    # Idempotency and errors, as over HTTP.
    first, again, replayed = out["idempotent"]
    assert first == again and replayed is True
    assert out["invalid"]["code"] == 422
    assert out["invalid"]["locs"] == ["class_label", "steps"]
    assert any("at most 1000 steps" in m for m in out["invalid"]["msgs"])
    assert out["not_json"]["Nats-Service-Error-Code"] == "400"
    assert "not JSON" in out["not_json"]["Nats-Service-Error"]

    # Cancel: the reply says so, its record's last write says so; again is the same
    # answer; a finished task cannot be cancelled.
    assert out["cancel"] == {"code": 0, "state": "cancelled"}
    assert out["cancel_status"] == "cancelled"
    assert out["cancel_again"] == [0, "cancelled"]
    assert out["cancel_done"] == [409, f"task {accepted['id']} already succeeded"]

    # The bare door: same validation; the bad one dead-lettered and failed, never run.
    assert out["bare_stream"] == f"GEN_{CLUSTER.upper()}" and out["bare_result"] == 1
    assert out["dlq_reason"].startswith("rejected: invalid task: steps: ")
    assert out["bare_bad_status"] == {"code": 0, "state": "failed",
                                      "reason": out["dlq_reason"]}

    # Training through the job service: it runs to the end; the long one is cancelled.
    assert out["train"]["code"] == 0 and out["train"]["state"] == "pending"
    states = out["train_states"]
    short, long_ = states.values()
    assert short[0] == "pending" and short[-1] == "succeeded", short
    assert "running" in long_ and long_[-1] == "cancelled", long_
    assert out["train_cancel"] == 0 and out["train_cancel_status"] == "cancelled"
    assert out["train_invalid"]["code"] == 422
    assert {"steps", "lr"} <= set(out["train_invalid"]["locs"])

    # $SRV.STATS counted the requests and the refusals.
    stats = out["stats"]
    assert stats["generate"]["requests"] >= 5 and stats["generate"]["errors"] == 2
    assert stats["cancel"]["errors"] == 1 and stats["train"]["errors"] == 1
    assert stats["status"]["errors"] == 1  # bob's look at alice's task


@pytest.mark.parametrize("transport", ["nats", "http"])
def test_the_python_client_answers_the_same_over_nats_and_http(jobs: Jobs,
                                                                transport: str) -> None:
    with jobs.client(transport) as tandem:
        assert {m["name"] for m in tandem.models()} >= {"digits", "tiny-text"}
        # Progress goes to whoever follows while the steps run (core NATS): the task waits
        # behind a long one until the test follows it, so every step is seen.
        long = tandem.generate(model="digits", class_label=1, steps=1000, seed=1)
        following_long = tandem.events(long["id"])
        assert next(e for e in following_long if e["event"] == "progress")
        following_long.close()
        task = tandem.generate(model="digits", class_label=4, steps=3, seed=11)
        following = tandem.events(task["id"])
        first = next(following)  # the task's state: the follow is subscribed
        assert first["event"] == "state" and first["state"] in ("queued", "running")
        tandem.cancel(long["id"])
        assert tandem.wait(long["id"], timeout=60)["state"] == "cancelled"
        events = [first, *following]
        assert events[-1]["event"] == "final"
        record = events[-1]["record"]
        assert record["state"] == "succeeded" and record["params"]["seed"] == 11
        assert [e["step"] for e in events if e["event"] == "progress"] == [1, 2, 3]
        assert tandem.wait(task["id"], timeout=60)["state"] == "succeeded"
        [png] = tandem.images(record)
        assert png.startswith(b"\x89PNG")
        with pytest.raises(JobError) as err:
            tandem.generate(model="digits", class_label=12)
        assert err.value.status == 422 and err.value.detail[0]["loc"] == ["body",
                                                                          "class_label"]
    with jobs.client(transport, key="bob") as bob:
        with pytest.raises(JobError) as err:
            bob.status(task["id"])
        assert err.value.status == 404
        with pytest.raises(JobError) as err:
            bob.train(**RUN)
        assert err.value.status == 403 and "lacks scope 'train'" in str(err.value)


def test_the_readme_example_runs_as_printed(jobs: Jobs, tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    [code] = re.findall(r"<!-- bus-example -->\n```python\n(.*?)```", readme, re.S)
    assert len([line for line in code.splitlines() if line.strip()]) <= 16
    script = tmp_path / "example.py"
    script.write_text(code)
    res = subprocess.run([PYTHON, "-I", str(script)], capture_output=True, text=True,
                         timeout=180, env={"NATS_URL": jobs.nats.url,
                                           "TANDEM_API_KEY": jobs.keys["alice"]})
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r"^queued [0-9a-f]{32} on jobs$", res.stdout, re.M), res.stdout
    assert re.search(r"^succeeded images: \['images/[0-9a-f]{32}/0\.png'\]$", res.stdout,
                     re.M), \
        res.stdout


async def test_a_nats_follower_that_missed_the_final_write_reads_the_record_again(
        jobs: Jobs) -> None:
    """``tandem.client`` over NATS follows a task's record by a core subscription, which
    hears nothing while its connection is away: a task cancelled then (its last write)
    still ends the follow, by the record read again once nothing was heard for a while."""
    from tandem.client import connect
    from tandem.common import fleet
    from tandem.common.bus import Bus
    from tandem.common.settings import Settings, load
    from tests.nats_proxy import NatsProxy

    bus = await Bus.connect(load(Settings, nats_url=jobs.nats.url), "test")
    worker = next(c for c in jobs.children if c.name == "w-jobs")
    await fleet.drain(bus, CLUSTER, "w-jobs", "keep the task queued")
    proxy = await NatsProxy(jobs.nats.url).start()
    try:
        await asyncio.to_thread(worker.wait_healthy, lambda h: h.get("drained"))
        async with await connect(proxy.url, jobs.keys["alice"], recheck=0.5) as follower, \
                await connect(jobs.nats.url, jobs.keys["alice"]) as other:
            task = await follower.generate(model="digits", class_label=2)
            events = follower.events(task["id"])
            assert (await anext(events))["state"] == "queued"  # subscribed, record read
            await proxy.cut()
            assert (await other.cancel(task["id"]))["state"] == "cancelled"
            proxy.mend()
            final = await asyncio.wait_for(anext(e async for e in events
                                                 if e["event"] == "final"), 60)
            assert final["record"]["state"] == "cancelled"
    finally:
        await fleet.undrain(bus, CLUSTER, "w-jobs")
        await proxy.stop()
        await bus.drain()


def test_train_submit_goes_through_the_job_service_and_names_each_bad_field(
        jobs: Jobs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.cli.main import main

    monkeypatch.setenv("TANDEM_NATS_URL", jobs.nats.url)
    monkeypatch.setenv("TANDEM_API_KEY", jobs.keys["alice"])
    bad = tmp_path / "bad.toml"
    bad.write_text('steps = 0\nmodel = { kind = "gan" }\n')
    with pytest.raises(SystemExit) as exc:
        main(["train", "submit", str(bad)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "422" in err and "steps" in err and "model.kind" in err
    good = tmp_path / "run.toml"
    good.write_text('steps = 5\ncluster = "north"\n')
    with pytest.raises(SystemExit) as exc:  # not one of the gateway's TRAIN_CLUSTERS
        main(["train", "submit", str(good)])
    assert exc.value.code == 2
    assert "cluster" in capsys.readouterr().err
    good.write_text('steps = 5\ncluster = "nowhere"\n')  # no coordinator takes it
    run = f"cli-{uuid.uuid4().hex[:8]}"
    with pytest.raises(SystemExit) as exc:
        main(["train", "submit", str(good), "--run-id", run, "--set", "ranks=1",
              "--set", "model.kind=dit"])
    assert exc.value.code == 0
    assert run in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["train", "status", run])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert f"run {run}: pending" in out and "0/5" in out
    with jobs.client("http") as tandem:  # the same run, by the other door, owned by alice
        assert tandem.run(run)["owner"] == "alice"


async def test_a_cancel_the_runs_bucket_refused_leaves_the_run_to_finish(jobs: Jobs) -> None:
    """A compare-and-set the bucket refuses is still published on the key's subject, so
    every core subscriber of ``$KV.runs.<run>`` hears it. The coordinator must act on
    stored records only: a refused write asking for a cancel stops nothing."""
    import asyncio

    import nats
    from nats.js.errors import APIError

    from tandem.client import connect
    from tandem.common import events, subjects
    from tandem.common.events import RunRecord, RunState, TrainStatus

    run_id = f"refused-{uuid.uuid4().hex[:8]}"
    nc = await nats.connect(jobs.nats.url)
    try:
        steps: asyncio.Queue[Any] = asyncio.Queue()
        ended: asyncio.Future[TrainStatus] = asyncio.get_running_loop().create_future()

        async def on_status(msg: Any) -> None:
            ev = events.decode(msg.data, TrainStatus)
            if ev.state.terminal and not ended.done():
                ended.set_result(ev)

        await nc.subscribe(subjects.train(run_id, "step"), cb=steps.put)
        await nc.subscribe(subjects.train(run_id, "status"), cb=on_status)
        client = await connect(jobs.nats.url, api_key=jobs.keys["alice"])
        try:
            await client.train(**{**RUN, "steps": 8, "run_id": run_id})
        finally:
            await client.close()
        async with asyncio.timeout(300):
            await steps.get()  # the run is claimed and its ranks are stepping
        kv = await nc.jetstream().key_value("runs")
        entry = await kv.get(run_id)
        rec = events.decode(entry.value, RunRecord)
        assert rec.state == RunState.running and not rec.cancel
        refused = events.struct_replace(rec, cancel="a write the bucket refused")
        with pytest.raises(APIError) as err:  # the stored revision is not the one named
            await nc.jetstream().publish(
                f"$KV.runs.{run_id}", events.encode(refused),
                headers={"Nats-Expected-Last-Subject-Sequence": str(entry.revision + 10**6)})
        assert err.value.err_code == 10071  # wrong last sequence: nothing was stored
        async with asyncio.timeout(300):
            end = await ended
        assert end.state == RunState.succeeded, end
        assert not events.decode((await kv.get(run_id)).value, RunRecord).cancel
    finally:
        await nc.close()
