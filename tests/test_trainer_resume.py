"""Where a restarted run resumes from, against real servers (nats-server, moto's S3, and
an S3 endpoint that answers every request ``503 SlowDown``):

- the local launcher: a run starts afresh only when S3 says nothing is committed; S3
  failing to answer fails the attempt (retried with backoff), never "from scratch";
- the nodes launcher: the resume point is S3's committed list alone, never what the
  coordinator's own disk (one node's at most) holds: a node's part of a sharded
  checkpoint, or a full one older than what S3 committed since;
- ``newest_valid`` never returns a node's part, nor a folder whose manifest is of
  another run, step or lineage.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tandem.cli.devstack import S3Server
from tandem.common import checkpoints as ck
from tandem.common import log
from tandem.common.bus import Bus
from tandem.common.runner import Context
from tandem.common.runs import parse_run_config
from tandem.common.settings import Settings, load
from tandem.common.storage import ensure_bucket, s3_client
from tandem.common.streams import core_streams
from tandem.trainer.launcher import LaunchFailed, Placement
from tandem.trainer.service import Trainer, TrainerSettings
from tandem.trainer.spec import LaunchSpec
from tandem.trainer.supervisor import RunSupervisor
from tandem.trainer.watch import Outcome
from tests.checkpoint_support import write_checkpoint

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")


class SlowDownS3:
    """An S3 endpoint that answers every request 503 SlowDown (as S3 does when
    throttled), counting them."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                outer.requests.append(f"{self.command} {self.path}")
                self.send_response(503, "Slow Down")
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(SLOW_DOWN)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(SLOW_DOWN)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def slow_s3() -> Iterator[SlowDownS3]:
    srv = SlowDownS3()
    srv.thread.start()
    yield srv
    srv.server.shutdown()
    srv.server.server_close()


class NoLaunch:
    """A launcher that records each attempt's launch spec and starts nothing (so an
    attempt that got as far as launching ends ``launch_failed``)."""

    def __init__(self) -> None:
        self.specs: list[LaunchSpec] = []

    async def start(self, placement: Placement, spec: LaunchSpec, spec_path: Path,
                    attempt_dir: Path) -> Any:
        self.specs.append(spec)
        raise LaunchFailed(placement.nodes[0], "this test launches nothing")

    async def poll(self, attempt: Any) -> Any:
        raise AssertionError("nothing was launched")

    async def stop(self, attempt: Any, rank_pids: Any = (), timeout: float = 10.0) -> Any:
        raise AssertionError("nothing was launched")


async def attempt_once(bus: Bus, settings: Settings, tmp_path: Path, run: str,
                       endpoint: str, bucket: str, **trainer: Any
                       ) -> tuple[Outcome, NoLaunch]:
    """One attempt of ``run`` by a coordinator with these settings, as it makes them."""
    s = load(TrainerSettings, nats_url=settings.nats_url, cluster=settings.cluster,
             node=settings.node, s3_endpoint=endpoint, s3_bucket=bucket,
             s3_access_key="tandem", s3_secret_key="tandem", s3_max_attempts=1,
             checkpoint_root=str(tmp_path / "checkpoints"), work_root=str(tmp_path / "work"),
             **trainer)
    coordinator = Trainer(s)
    coordinator.ctx = Context(bus=bus, settings=s, stopping=asyncio.Event(),
                              log=log.get("test"))
    await bus.provision(core_streams())
    launcher = NoLaunch()
    sup = RunSupervisor(bus, coordinator.supervisor_config(), run,
                        parse_run_config({"run_id": run, "ranks": 1}), launcher,
                        log.get("test"))
    return await sup._attempt(asyncio.Event()), launcher


def commit_in_s3(s3: Any, bucket: str, run: str, step: int) -> None:
    """What a committed checkpoint looks like to a listing: its files, then its manifest."""
    ensure_bucket(s3, bucket)
    s3.put_object(Bucket=bucket, Key=ck.object_key(run, step, "rng.bin"), Body=b"x")
    s3.put_object(Bucket=bucket, Key=ck.manifest_key(run, step), Body=b"{}")


@pytest.fixture
def s3(s3_server: S3Server) -> Any:
    return s3_client(load(Settings, s3_endpoint=s3_server.url, s3_access_key="tandem",
                          s3_secret_key="tandem"))


def node_part(root: Path, run: str, step: int) -> Path:
    """Node n0's part of a 4-rank sharded checkpoint (ranks 0 and 1), committed locally
    as that node's first rank commits it."""
    tmp = ck.prepare_incomplete(root, run, step)
    (tmp / ck.SHARD_DIR).mkdir()
    for rank in (0, 1):
        (tmp / f"{ck.SHARD_DIR}/__{rank}_0.distcp").write_bytes(os.urandom(1000))
    for name in (ck.DCP_METADATA, *ck.SHARDED_STATE):
        (tmp / name).write_bytes(b"x")
    path, manifest = ck.commit(run, step, tmp, world_size=4, node="n0")
    assert manifest.part == "n0"
    return path


def full_checkpoint(root: Path, run: str, step: int) -> Path:
    directory, manifest = write_checkpoint(ck.run_dir(root, run), run, step, {"rng.bin": 10})
    (directory / ck.MANIFEST).write_bytes(ck.encode_manifest(manifest))
    return directory


# ------------------------------------------------------------------ the local launcher


async def test_s3_throttling_at_restart_fails_the_attempt_instead_of_starting_afresh(
        bus: Bus, settings: Settings, uid: str, tmp_path: Path, slow_s3: SlowDownS3) -> None:
    outcome, launcher = await attempt_once(bus, settings, tmp_path, f"r{uid}", slow_s3.url,
                                           f"b{uid}")
    assert launcher.specs == [], "launched (from scratch) although S3 could not say"
    assert outcome.kind == "restore_failed", outcome
    assert "SlowDown" in outcome.detail["reason"], outcome.detail
    assert any(r.startswith("GET ") and "list-type=2" in r for r in slow_s3.requests), \
        slow_s3.requests


async def test_nothing_committed_in_s3_starts_the_run_afresh(
        bus: Bus, settings: Settings, uid: str, tmp_path: Path, s3_server: S3Server) -> None:
    outcome, launcher = await attempt_once(bus, settings, tmp_path, f"r{uid}", s3_server.url,
                                           f"b{uid}")
    assert outcome.kind == "launch_failed"  # got as far as launching: NoLaunch
    [spec] = launcher.specs
    assert (spec.resume_path, spec.resume_steps) == ("", [])


# ------------------------------------------------------------------ the nodes launcher


@pytest.mark.parametrize("on_disk", ["a node's part of step 40", "a stale full step 10"])
async def test_the_nodes_launcher_resumes_from_s3s_committed_list_never_its_own_disk(
        bus: Bus, settings: Settings, uid: str, tmp_path: Path, s3_server: S3Server,
        s3: Any, on_disk: str) -> None:
    run, bucket = f"r{uid}", f"b{uid}"
    root = tmp_path / "checkpoints"
    full_checkpoint(root, run, 10)
    if on_disk.startswith("a node's part"):
        node_part(root, run, 40)
    for step in (10, 40):
        commit_in_s3(s3, bucket, run, step)
    outcome, launcher = await attempt_once(bus, settings, tmp_path, run, s3_server.url,
                                           bucket, launcher="nodes")
    assert outcome.kind == "launch_failed", outcome
    [spec] = launcher.specs
    assert spec.resume_path == "", f"resumed from {spec.resume_path}, {on_disk} here"
    assert spec.resume_steps == [40, 10]  # every node fetches the newest all verify


# ------------------------------------------------------------------------ newest_valid


def test_newest_valid_never_returns_a_nodes_part_and_leaves_it_for_its_checkpointer(
        tmp_path: Path) -> None:
    full_checkpoint(tmp_path, "r", 10)
    part = node_part(tmp_path, "r", 40)
    resume, rejected = ck.newest_valid(tmp_path, "r")
    assert resume is not None and resume.step == 10
    assert [(r.step, r.path) for r in rejected] == [(40, str(part))]
    assert "part of a sharded checkpoint" in rejected[0].reason
    assert ck.verify(part).part == "n0"  # still there, whole, for its mirror


@pytest.mark.parametrize(("source", "copied_to"), [
    ("r/20", "r/step-30"),         # step 20's files named step 30
    ("r/20", "other/step-20"),     # r's step 20 in another run's folder
    ("other/20", "r/step-20-l1"),  # another run's step 20 as r's lineage 1
])
def test_newest_valid_refuses_a_folder_whose_manifest_names_another_checkpoint(
        tmp_path: Path, source: str, copied_to: str) -> None:
    full_checkpoint(tmp_path, "r", 10)
    src_run, src_step = source.split("/")
    shutil.move(full_checkpoint(tmp_path / "src", src_run, int(src_step)),
                tmp_path / copied_to)
    run, name = copied_to.split("/")
    line = ck.Lineage((10,)) if name.endswith("-l1") else None
    resume, rejected = ck.newest_valid(tmp_path, run, line=line)
    assert [r.step for r in rejected] == [ck.parse_step(name.split("-l")[0])], rejected
    assert "manifest is of run" in rejected[0].reason
    assert rejected[0].path.endswith(".corrupt")
    assert (resume.step if resume else None) == (10 if run == "r" else None)
