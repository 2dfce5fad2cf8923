"""NATS node loss: a 3-node JetStream cluster with R3 streams loses the leader of the
work queue while the gateway (a child process, given all three URLs) takes submissions."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import httpx

from tandem.cli.devstack import S3Server
from tandem.cli.topology import NatsCluster
from tandem.common import subjects
from tandem.common.bus import MSG_ID, Bus
from tandem.common.settings import Settings, load
from tandem.common.streams import KV_TASKS
from tests.serving_stack import gateway, http_port

CLUSTER = "rthree"
TASKS = 120
KILL_AFTER = 30
DEADLINE = 90.0


async def msg_ids(bus: Bus, stream: str) -> list[str]:
    """The Nats-Msg-Id of every message in ``stream``, read by sequence (a work queue of
    R3 admits no R1 ordered consumer to read it with)."""
    state = (await bus.js.stream_info(stream)).state
    out = []
    for seq in range(state.first_seq, state.last_seq + 1):
        msg = await bus.js.get_msg(stream, seq)
        out.append((msg.headers or {}).get(MSG_ID, ""))
    return out


async def test_killing_the_stream_leader_during_submission_loses_no_task_and_enqueues_none_twice(
        nats_cluster: NatsCluster, s3_server: S3Server, tmp_path: Path) -> None:
    gw = gateway(tmp_path, "gateway-r3", nats_url=nats_cluster.url, stream_replicas="3",
                 routing="static", clusters=CLUSTER, cluster=CLUSTER, s3_endpoint=s3_server.url,
                 s3_access_key="tandem", s3_secret_key="tandem", publish_retry_for="30")
    gw.start()
    bus = await Bus.connect(load(Settings, nats_url=nats_cluster.url), "test")
    try:
        port = http_port(gw)
        stream = subjects.gen_stream_name(CLUSTER)
        info = await bus.js.stream_info(stream)
        assert info.config.num_replicas == 3 and info.cluster is not None
        leader = info.cluster.leader
        accepted: list[str] = []
        answers: Counter[int] = Counter()
        killed_at: list[float] = []

        async def client(http: httpx.AsyncClient) -> None:
            while len(accepted) < TASKS:
                try:
                    r = await http.post("/v1/generations", json={"model": "noop"})
                except httpx.TransportError:
                    answers[0] += 1
                    continue
                answers[r.status_code] += 1
                if r.status_code == 202:
                    accepted.append(r.json()["id"])
                if len(accepted) >= KILL_AFTER and not killed_at:
                    killed_at.append(time.monotonic())
                    nats_cluster.by_name(leader).kill()

        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
            await asyncio.wait_for(asyncio.gather(*(client(http) for _ in range(4))), DEADLINE)

        new_leader = (await bus.js.stream_info(stream)).cluster.leader  # type: ignore[union-attr]
        stored = await msg_ids(bus, stream)
        log_lines = gw.tail(10**7).splitlines()
        retried = [json.loads(line).get("msg_id") for line in log_lines
                   if '"bus.publish_retry"' in line]
        recorded = sum('"bus.retry"' in line for line in log_lines)
        print(f"\nleader {leader} killed after {KILL_AFTER} accepted, new leader {new_leader}; "
              f"answers {dict(answers)}; {len(stored)} stored for {len(accepted)} accepted; "
              f"{len(retried)} publish retries of {len(set(retried))} tasks, {recorded} retries "
              "of task records")
        assert new_leader != leader
        # Each request was accepted or refused with 503 (Retry-After): never a 500.
        assert set(answers) <= {202, 503}, answers
        # Publishes caught by the election were retried with their task id as Nats-Msg-Id.
        assert set(retried) <= set(accepted), retried
        assert len(stored) == len(set(stored))  # nothing enqueued twice
        assert set(accepted) <= set(stored)  # no accepted task lost
        # A task not accepted is one the gateway answered with an error, and recorded so.
        kv = await bus.kv(KV_TASKS)
        for task_id in set(stored) - set(accepted):
            assert b'"state":"failed"' in ((await kv.get(task_id)).value or b"")
    finally:
        gw.kill()
        await bus.drain()
