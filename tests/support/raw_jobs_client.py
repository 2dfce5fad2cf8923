"""A client of Tandem's bus API that is not Tandem's: nats-py and the standard library.

Run by tests/test_job_service.py against a real stack (``NATS_URL``, ``API_KEY``,
``OTHER_KEY``, ``CLUSTER``, ``RUN_CONFIG``): it discovers the job service, submits,
follows and cancels jobs the way any NATS program would, and prints what it saw as
JSON for the test to judge. It never imports ``tandem`` (it checks at the end).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
import urllib.request
import uuid
from typing import Any

import nats

DEADLINE = 240.0


class Jobs:
    def __init__(self, nc: Any, key: str) -> None:
        self.nc, self.key = nc, key

    async def call(self, endpoint: str, body: Any, key: str | None = None,
                   **headers: str) -> tuple[int, Any]:
        """(0, reply) or (error code, error body) of one job-service request."""
        hdrs = {"Authorization": f"Bearer {key or self.key}", **headers}
        msg = await self.nc.request(f"tandem.jobs.{endpoint}", json.dumps(body).encode(),
                                    timeout=15, headers=hdrs)
        code = int((msg.headers or {}).get("Nats-Service-Error-Code", 0))
        return code, json.loads(msg.data) if msg.data else None


class Inbox:
    """Every message on a wildcard subject, by its last token (subscribed up front, so
    nothing published for a task id learned later is missed)."""

    def __init__(self) -> None:
        self.by_id: dict[str, list[Any]] = {}
        self.changed = asyncio.Event()

    async def on(self, msg: Any) -> None:
        key = msg.subject.rsplit(".", 1)[-1]
        self.by_id.setdefault(key, []).append(json.loads(msg.data))
        self.changed.set()

    async def until(self, key: str, pred: Any = lambda items: bool(items)) -> list[Any]:
        async with asyncio.timeout(DEADLINE):
            while not pred(self.by_id.get(key, [])):
                self.changed.clear()
                await self.changed.wait()
        return self.by_id[key]


async def main() -> dict[str, Any]:
    out: dict[str, Any] = {}
    cluster, key, other = os.environ["CLUSTER"], os.environ["API_KEY"], os.environ["OTHER_KEY"]
    nc = await nats.connect(os.environ["NATS_URL"])
    js = nc.jetstream()
    jobs = Jobs(nc, key)
    # Each write of a task's record (its one source of truth) travels on $KV.tasks.<task>.
    records, progress, dead = Inbox(), Inbox(), Inbox()
    await nc.subscribe("$KV.tasks.*", cb=records.on)
    await nc.subscribe("gen.progress.*", cb=progress.on)
    await nc.subscribe(f"dlq.GEN_{cluster.upper()}", cb=dead.on)

    # Discovery, as `nats micro info tandem-jobs` does it.
    info = json.loads((await nc.request("$SRV.INFO.tandem-jobs", b"", timeout=5)).data)
    out["info"] = {"name": info["name"], "endpoints": {
        e["name"]: {"subject": e["subject"],
                    "schema": json.loads(e["metadata"]["request_schema"])}
        for e in info["endpoints"]}}
    ping = json.loads((await nc.request("$SRV.PING.tandem-jobs", b"", timeout=5)).data)
    out["ping"] = ping["type"]

    # A generation through the job service: accepted, progress, result, status, image.
    code, task = await jobs.call("generate", {"model": "digits", "class_label": 3, "steps": 4})
    out["accepted"] = {"code": code, **task}
    writes = await records.until(task["id"], ended)
    out["result"] = writes[-1]
    out["writes"] = [w["state"] for w in writes]
    out["progress_steps"] = sorted(p["step"] for p in progress.by_id.get(task["id"], []))
    code, record = await jobs.call("status", {"id": task["id"]})
    out["status"] = {"code": code, "state": record["state"], "owner": record["owner"],
                     "images": len(record["images"])}
    out["png_signature"] = (await asyncio.to_thread(_fetch, record["images"][0]["url"]))[
        :8].hex()
    code, hidden = await jobs.call("status", {"id": task["id"]}, key=other)
    out["other_key_status"] = {"code": code, "body": hidden}

    # Idempotency, and field errors with the HTTP API's messages.
    first = await jobs.call("generate", {"model": "digits", "class_label": 1, "steps": 2},
                            **{"Idempotency-Key": "raw-client-key"})
    again = await jobs.call("generate", {"model": "digits", "class_label": 1, "steps": 2},
                            **{"Idempotency-Key": "raw-client-key"})
    out["idempotent"] = [first[1]["id"], again[1]["id"], again[1]["replayed"]]
    code, body = await jobs.call("generate", {"model": "digits", "class_label": 99,
                                              "steps": 5000})
    out["invalid"] = {"code": code, "locs": sorted(d["loc"][-1] for d in body["detail"]),
                      "msgs": [d["msg"] for d in body["detail"]]}
    out["not_json"] = (await nc.request("tandem.jobs.generate", b"{not json", timeout=5,
                                        headers={"Authorization": f"Bearer {key}"})).headers

    # Cancel a generation that would run for long.
    code, slow = await jobs.call("generate", {"model": "digits", "class_label": 2,
                                              "steps": 1000})
    code, cancelled = await jobs.call("cancel", {"id": slow["id"]})
    out["cancel"] = {"code": code, "state": cancelled["state"]}
    out["cancel_status"] = (await records.until(slow["id"], ended))[-1]["state"]
    code, again = await jobs.call("cancel", {"id": slow["id"]})  # idempotent, as DELETE
    out["cancel_again"] = [code, again["state"]]
    code, done = await jobs.call("cancel", {"id": task["id"]})  # it already succeeded
    out["cancel_done"] = [code, done["detail"]]

    # A bare publish on the cluster's queue: a good task runs, a bad one is dead-lettered.
    # A bare task names its owner itself (no door checks a key on gen.*: deployments
    # with keys let only services publish there, docs/security.md); here, alice's key.
    good, bad = uuid.uuid4().hex, uuid.uuid4().hex
    base = {"model": "digits", "class_label": 5, "width": 16, "height": 16, "steps": 2,
            "cluster": cluster, "lane": "interactive", "owner": "alice"}
    for tid, body in ((good, base), (bad, {**base, "steps": 5000})):
        ack = await js.publish(f"gen.{cluster}.interactive",
                               json.dumps({"task_id": tid, **body}).encode(),
                               headers={"Nats-Msg-Id": tid})
        out.setdefault("bare_stream", ack.stream)
    out["bare_result"] = len((await records.until(good, ended))[-1]["images"])
    def about_bad(items: list[Any]) -> list[Any]:
        return [d for d in items if bad.encode() in base64.b64decode(d["data"])]

    letters = await dead.until("GEN_" + cluster.upper(), about_bad)
    [letter] = about_bad(letters)
    out["dlq_reason"] = letter["reason"]
    code, failed = await jobs.call("status", {"id": bad})
    out["bare_bad_status"] = {"code": code, "state": failed["state"], "reason": failed["reason"]}

    # Training: submit, watch its status events, and cancel a long one.
    config = json.loads(os.environ["RUN_CONFIG"])
    run_id = f"raw-{uuid.uuid4().hex[:8]}"
    long_id = f"rawlong-{uuid.uuid4().hex[:8]}"
    runs = Inbox()

    async def on_run(msg: Any) -> None:  # keyed by the run id, the subject's middle token
        runs.by_id.setdefault(msg.subject.split(".")[1], []).append(json.loads(msg.data))
        runs.changed.set()

    await nc.subscribe("train.*.status", cb=on_run)
    code, run = await jobs.call("train", {**config, "run_id": run_id})
    out["train"] = {"code": code, "state": run["state"],
                    "status_subject": run["status_subject"]}
    code, _ = await jobs.call("train", {**config, "run_id": long_id, "steps": 100000})
    await runs.until(long_id, lambda items: any(s["state"] == "running" for s in items))
    code, _ = await jobs.call("cancel", {"run_id": long_id})
    out["train_cancel"] = code
    await runs.until(long_id, lambda items: any(s["state"] == "cancelled" for s in items))
    await runs.until(run_id, lambda items: any(s["state"] in ("succeeded", "failed")
                                              for s in items))
    out["train_states"] = {r: [s["state"] for s in runs.by_id[r]] for r in (run_id, long_id)}
    code, final = await jobs.call("status", {"run_id": long_id})
    out["train_cancel_status"] = final["state"]
    code, body = await jobs.call("train", {"steps": -1, "lr": "fast"})
    out["train_invalid"] = {"code": code, "locs": sorted(
        ".".join(str(p) for p in d["loc"][1:]) for d in body["detail"])}

    stats = json.loads((await nc.request("$SRV.STATS.tandem-jobs", b"", timeout=5)).data)
    out["stats"] = {e["name"]: {"requests": e["num_requests"], "errors": e["num_errors"]}
                    for e in stats["endpoints"]}
    await nc.drain()
    out["imports_tandem"] = sorted(m for m in sys.modules if m.split(".")[0] == "tandem")
    return out


def ended(writes: list[Any]) -> bool:
    return any(w["state"] in ("succeeded", "failed", "cancelled") for w in writes)


def _fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
