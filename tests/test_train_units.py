"""The trainer's parts on their own: run configs and submission, loss health, stragglers,
goodput, the checkpoint store, data positions, the async checkpointer, other models."""

from __future__ import annotations

import asyncio
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from tandem.cli.devstack import NatsServer
from tandem.common import checkpoints as ck
from tandem.common import subjects
from tandem.common.bus import Bus
from tandem.common.errors import InvalidRunConfig, RunExists
from tandem.common.events import RunState, TrainStatus, decode, encode
from tandem.common.runs import DataSpec, RunConfig, get_run, parse_run_config, submit_run
from tandem.common.streams import core_streams
from tandem.trainer.health import Goodput, LossHealth, StragglerDetector
from tandem.trainer.launcher import place

TINY_MODEL = {"sample_size": 8, "block_out_channels": [16, 32],
              "down_block_types": ["DownBlock2D", "DownBlock2D"],
              "up_block_types": ["UpBlock2D", "UpBlock2D"]}


# ------------------------------------------------------------------------ configs and submit


def test_run_config_errors_name_every_bad_field() -> None:
    with pytest.raises(InvalidRunConfig) as exc:
        parse_run_config({"steps": 0, "lr": -1, "bogus": 1, "model": {"kind": "gan"},
                          "run_id": "has space", "data": {"kind": "image_folder"}})
    problems = exc.value.problems
    assert {"steps", "lr", "bogus", "model.kind", "run_id", "data"} <= set(problems)
    assert "path is required" in problems["data"]
    with pytest.raises(InvalidRunConfig, match="divisible"):
        parse_run_config({"model": {"sample_size": 10}})
    cfg = parse_run_config({"model": {"kind": "dit"}, "data": {"kind": "synthetic"}})
    assert cfg.model.kind == "dit" and cfg.ranks == 2 and cfg.device == "auto"


def test_a_data_root_confines_image_folders_and_names_what_leaves_it(tmp_path: Path) -> None:
    root = tmp_path / "data"
    (root / "pets" / "cat").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    (root / "escape").symlink_to(tmp_path / "secret")

    def data(path: str) -> DataSpec:
        return DataSpec(kind="image_folder", path=path)

    assert data("/anywhere").confined("").path == "/anywhere"  # no root: as given
    assert DataSpec(kind="digits").confined(str(root)).path is None
    assert data("pets").confined(str(root)).path == str(root.resolve() / "pets")
    assert data(str(root / "pets")).confined(str(root)).path == str(root.resolve() / "pets")
    for outside in ("../secret", str(tmp_path / "secret"), "escape", "/etc"):
        with pytest.raises(ValueError, match="outside this trainer's data root") as err:
            data(outside).confined(str(root))
        assert repr(outside) in str(err.value) and "TANDEM_DATA_ROOT" in str(err.value)


async def test_submit_is_idempotent_and_refuses_another_config_under_the_same_id(
        bus: Bus, uid: str) -> None:
    await bus.provision(core_streams())
    seen: list[TrainStatus] = []
    got = asyncio.Event()

    async def on(msg) -> None:  # type: ignore[no-untyped-def]
        seen.append(decode(msg.data, TrainStatus))
        got.set()

    await bus.nc.subscribe(subjects.train(f"r{uid}", "status"), cb=on)
    first = await submit_run(bus, {"run_id": f"r{uid}", "steps": 5})
    again = await submit_run(bus, {"run_id": f"r{uid}", "steps": 5})
    assert first.run_id == again.run_id == f"r{uid}" and again.state == RunState.pending
    with pytest.raises(RunExists):
        await submit_run(bus, {"run_id": f"r{uid}", "steps": 6})
    await asyncio.wait_for(got.wait(), 5)
    assert seen[0].state == RunState.pending
    rec = await get_run(bus, f"r{uid}")
    assert rec.config["steps"] == 5
    generated = await submit_run(bus, RunConfig(steps=3))
    assert generated.run_id.startswith("run-")


# ---------------------------------------------------------------------------- judgements


def test_loss_health_flags_nonfinite_and_spikes_but_not_noise() -> None:
    h = LossHealth(window=30, min_history=10, z_threshold=8)
    for i in range(60):  # a noisy, decreasing loss
        assert h.check(1.0 / (1 + 0.05 * i) + 0.02 * math.sin(i * 1.7), 1.0) is None
    spike = h.check(5.0, 1.0)
    assert spike is not None and spike.kind == "spike" and spike.evidence["z"] > 8
    assert h.check(float("nan"), 1.0).kind == "nonfinite"  # type: ignore[union-attr]
    assert h.check(0.5, float("inf")).kind == "nonfinite"  # type: ignore[union-attr]
    restored = LossHealth(window=30, min_history=10, z_threshold=8)
    restored.load_state_dict(h.state_dict())
    assert restored.check(5.0, 1.0) is not None  # the window survives a checkpoint


def test_straggler_is_flagged_only_when_slowness_persists() -> None:
    d = StragglerDetector(ratio=1.5, window=4)
    nodes = ["a", "b", "c"]
    assert d.observe([1.0, 3.0, 1.0], nodes) == []  # once is noise
    for _ in range(2):
        assert d.observe([1.0, 1.0, 1.0], nodes) == []
    flagged = []
    for _ in range(4):
        flagged += d.observe([1.0, 1.0, 2.0], nodes)
    assert [(s.rank, s.node) for s in flagged] == [(2, "c")]
    assert flagged[0].score >= 1.5 and flagged[0].median_time == 1.0
    assert d.observe([1.0, 1.0, 2.0], nodes) == []  # reported once


def test_goodput_moves_redone_steps_to_lost_and_adds_up() -> None:
    g = Goodput(started_at=0.0)
    g.launched(at=0.0)
    g.step(1, at=10.0)  # startup: launch to first step
    for s in range(2, 7):
        g.step(s, at=10.0 + s)  # steps 2..6, 1 s each (s=2 lands at 12: 2 s)
    g.checkpoint_blocked(0.5)
    g.failed(resume_step=3, at=20.0)  # steps 4..6 are redone; 16 -> 20 lost
    g.launched(at=22.0)
    g.step(4, at=30.0)
    g.finished(at=31.0)
    out = g.summary(at=31.0)
    assert out["badput_startup_s"] == 18.0
    assert out["badput_restart_s"] == 2.0
    assert out["badput_lost_s"] == 3.0 + 4.0
    assert out["badput_checkpoint_s"] == 0.5
    accounted = out["productive_s"] + sum(v for k, v in out.items() if k.startswith("badput_"))
    assert accounted == pytest.approx(out["elapsed_s"])
    # A new coordinator adopting the run at t=40 carries on from the record of t=31.
    adopted = Goodput.resumed(out, last_seen=31.0)
    adopted.launched(at=40.0)
    later = adopted.summary(at=40.0)
    assert later["elapsed_s"] == 40.0 and later["badput_restart_s"] == 2.0 + 9.0
    assert later["productive_s"] == out["productive_s"]


def test_placement_keeps_the_world_size() -> None:
    assert place(4, ["a", "b", "c"]).rank_nodes == ["a", "a", "b", "b"]  # type: ignore[union-attr]
    assert place(2, ["a"]).rank_nodes == ["a", "a"]  # type: ignore[union-attr]
    assert place(2, []) is None


# ----------------------------------------------------------------------- checkpoint store


def _fake_checkpoint(root: Path, run: str, step: int) -> Path:
    tmp = ck.incomplete_dir(root, run, step)
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    (tmp / "trainer.pt").write_bytes(b"state %d" % step)
    path, manifest = ck.commit(run, step, tmp)
    assert [f.name for f in manifest.files] == ["model.safetensors", "trainer.pt"]
    return path


def test_newest_valid_skips_incomplete_and_quarantines_corrupt(tmp_path: Path) -> None:
    for step in (3, 6, 9):
        _fake_checkpoint(tmp_path, "r", step)
    ck.incomplete_dir(tmp_path, "r", 12).mkdir()  # a write a crash interrupted
    data = bytearray((tmp_path / "r/step-9/model.safetensors").read_bytes())
    data[10] ^= 1
    (tmp_path / "r/step-9/model.safetensors").write_bytes(bytes(data))
    (tmp_path / "r/step-6/trainer.pt").unlink()
    resume, rejected = ck.newest_valid(tmp_path, "r")
    assert resume is not None and resume.step == 3
    assert [(r.step, r.reason.split(" ")[0]) for r in rejected] == [
        (9, "model.safetensors"), (6, "trainer.pt")]
    assert (tmp_path / "r/step-9.corrupt").is_dir() and not (tmp_path / "r/step-9").exists()
    assert ck.remove_incomplete(tmp_path, "r") == ["step-12.incomplete"]
    shutil.rmtree(tmp_path / "r/step-3")
    assert ck.newest_valid(tmp_path, "r") == (None, [])


# ------------------------------------------------------------------------ data and training


def test_data_positions_shard_disjointly_and_skip_windows() -> None:
    from tandem.trainer.data import BatchPlan, next_position

    plans = [BatchPlan(100, 8, 2, r, seed=1) for r in range(2)]
    a, b = (p.indices(13).tolist() for p in plans)
    assert len(a) == len(b) == 8 and not set(a) & set(b)
    assert plans[0].indices(13).tolist() == BatchPlan(100, 8, 2, 0, seed=1).indices(13).tolist()
    assert next_position(4, [[4, 5]]) == 6
    assert next_position(3, [[4, 5], [6, 6]]) == 3
    assert next_position(5, [[6, 7], [4, 5]]) == 8


def test_async_checkpoint_blocks_only_for_the_copy_and_loads_back_weights_only(
        tmp_path: Path) -> None:
    import torch

    from tandem.trainer.async_ckpt import AsyncCheckpointer
    from tandem.trainer.loop import TrainLoop

    cfg = parse_run_config({"model": TINY_MODEL, "ranks": 1, "batch_size": 4, "steps": 4,
                            "device": "cpu", "data": {"kind": "synthetic",
                                                      "synthetic_size": 64}})
    writer = AsyncCheckpointer(tmp_path, "r")
    loop = TrainLoop(cfg)
    loop.train_step()
    snap = loop.checkpoint(writer)
    assert snap is not None and snap.blocked_s > 0
    before = {k: v.clone() for k, v in loop.model.state_dict().items()}
    loop.train_step()  # training goes on while the write runs; the snapshot is a copy
    writer.close()
    (written,) = writer.written
    assert written.path == tmp_path / "r" / "step-1"
    assert ck.verify(written.path).step == 1
    assert {f.name for f in written.manifest.files} == {
        "model.safetensors", "ema.safetensors", "optimizer.pt", "scheduler.pt", "rng.pt",
        "trainer.pt", "model_config.json"}
    resumed = TrainLoop(cfg)
    resumed.load(written.path)  # torch.load(weights_only=True) inside
    for k, v in resumed.model.state_dict().items():
        assert torch.equal(v, before[k])
    assert resumed.step == 1 and resumed.data_pos == 1
    again = TrainLoop(cfg)
    again.load(written.path)
    # Every RNG state came back: the step after a resume is the same step, bit for bit.
    assert again.train_step().loss == resumed.train_step().loss


def test_a_checkpoint_write_that_fails_leaves_no_folder_and_the_next_one_commits(
        tmp_path: Path) -> None:
    import errno

    import torch

    from tandem.trainer.async_ckpt import AsyncCheckpointer

    def full_disk(step: int) -> None:  # the drill's hook: its files are written by now
        assert (tmp_path / "r" / f"step-{step}.incomplete" / "model.safetensors").is_file()
        if step == 2:
            raise OSError(errno.ENOSPC, "No space left on device")

    failed: list[tuple[int, BaseException]] = []
    writer = AsyncCheckpointer(tmp_path, "r", before_commit=full_disk,
                               on_error=lambda step, exc: failed.append((step, exc)))
    for step in (1, 2, 3):
        writer.snapshot(step, {"model": {"w": torch.full((4,), float(step))}},
                        {"trainer": {"step": step}})
        writer.wait()
    writer.close()
    assert [(step, getattr(exc, "errno", None)) for step, exc in failed] == [(2, errno.ENOSPC)]
    assert [w.step for w in writer.written] == [1, 3]
    # Nothing of step 2 is left (its files would hold the room the next one needs), and
    # the checkpoints around it are whole.
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["step-1", "step-3"]
    assert [ck.verify(tmp_path / "r" / f"step-{s}").step for s in (1, 3)] == [1, 3]


def test_dit_and_image_folder_are_config_changes(tmp_path: Path) -> None:
    from PIL import Image

    from tandem.trainer.loop import TrainLoop

    for label in ("cats", "dogs"):
        (tmp_path / label).mkdir()
        for i in range(4):
            Image.new("L", (12, 12), color=40 * i + (100 if label == "dogs" else 0)).save(
                tmp_path / label / f"{i}.png")
    cfg = parse_run_config({
        "ranks": 1, "batch_size": 4, "steps": 2, "device": "cpu",
        "model": {"kind": "dit", "sample_size": 8, "num_classes": 2, "num_layers": 1,
                  "num_attention_heads": 2, "attention_head_dim": 8, "patch_size": 2},
        "data": {"kind": "image_folder", "path": str(tmp_path)}})
    loop = TrainLoop(cfg)
    assert type(loop.model).__name__ == "DiTTransformer2DModel"
    assert loop.x.shape == (8, 1, 8, 8) and sorted(set(loop.y.tolist())) == [0, 1]
    r = loop.train_step()
    assert r.anomaly is None and math.isfinite(r.loss) and loop.step == 1


async def test_drained_or_unhealthy_nodes_are_left_out_of_the_next_placement(
        bus: Bus, uid: str, tmp_path: Path) -> None:
    from tandem.common import log
    from tandem.common.events import DrainRecord, Health, NodeHeartbeat
    from tandem.common.streams import KV_DRAINS, KV_NODES
    from tandem.trainer.launcher import LocalLauncher
    from tandem.trainer.supervisor import RunSupervisor, SupervisorConfig

    await bus.provision(core_streams())
    cluster = f"c{uid}"
    cfg = parse_run_config({"run_id": f"r{uid}", "ranks": 2, "cluster": cluster,
                            "nodes": ["na", "nb", "nc"]})
    sup = RunSupervisor(bus, SupervisorConfig(checkpoint_root=tmp_path, work_root=tmp_path,
                                              cluster=cluster, node="n0"),
                        f"r{uid}", cfg, LocalLauncher(), log.get("test"))
    assert (await sup.healthy_nodes())[0] == ["na", "nb", "nc"]
    await (await bus.typed(KV_DRAINS, DrainRecord)).put(
        subjects.node_key(cluster, "nb"), DrainRecord(cluster=cluster, node="nb", reason="t"))
    await (await bus.typed(KV_NODES, NodeHeartbeat)).put(
        subjects.node_key(cluster, "nc"),
        NodeHeartbeat(cluster=cluster, node="nc", health=Health.unhealthy))
    # A body that names another node under na's key is not na's heartbeat (fleet.keyed).
    await (await bus.kv(KV_NODES)).put(subjects.node_key(cluster, "na"), encode(
        NodeHeartbeat(cluster=cluster, node="elsewhere", health=Health.unhealthy)))
    healthy, why = await sup.healthy_nodes()
    assert healthy == ["na"] and set(why) == {"nb", "nc"}
    assert place(2, healthy).rank_nodes == ["na", "na"]  # type: ignore[union-attr]
    sup.on_health("na", "drained", "operator")  # a drain event while the run is placed
    assert (await sup.healthy_nodes())[0] == []
    sup.on_health("na", "healthy", "undrained")
    assert (await sup.healthy_nodes())[0] == ["na"]


async def test_what_is_written_while_the_coordinators_connection_is_away_reaches_its_runs(
        nats_server: NatsServer, bus: Bus, uid: str) -> None:
    """Drains: the coordinator follows its cluster's by a KV watch, so one written while
    its connection was away is in the watch's values once it is back (a core
    subscription to the keys' subject never hears it), and another cluster's are not its
    business. Health: transitions come by a core subscription, so after a reconnect the
    heartbeats of the nodes its runs are placed on are read again."""
    from tandem.common import fleet
    from tandem.common.events import Health, NodeHeartbeat
    from tandem.common.settings import load
    from tandem.common.streams import KV_NODES
    from tandem.trainer.launcher import Placement
    from tandem.trainer.service import Trainer, TrainerSettings
    from tests.nats_proxy import NatsProxy

    await bus.provision(core_streams())
    cluster = f"c{uid}"
    heard: asyncio.Queue[tuple[str, str]] = asyncio.Queue()

    class Supervisor:  # what the service hands a node's change to: each run's supervisor
        def __init__(self) -> None:
            self.cluster, self.placement = cluster, Placement(["na", "nb", "nc"], 1)

        def on_health(self, node: str, current: str, reason: str) -> None:
            heard.put_nowait((node, current))

    async def next_heard() -> tuple[str, str]:
        return await asyncio.wait_for(heard.get(), 30)

    proxy = await NatsProxy(nats_server.url).start()
    s = load(TrainerSettings, nats_url=proxy.url, cluster=cluster, node="n0")
    coordinator = await Bus.connect(s, "trainer")
    trainer = Trainer(s)
    trainer.supervisors["r"] = Supervisor()  # type: ignore[assignment]
    watch = trainer.drain_watch(coordinator)
    await watch.start()
    recheck = trainer.recheck_health_on_reconnect(coordinator)
    try:
        await fleet.drain(bus, f"other{uid}", "na", "another cluster's node")
        await fleet.drain(bus, cluster, "na", "live")
        assert await next_heard() == ("na", "drained")
        await proxy.cut()
        await fleet.drain(bus, cluster, "nb", "while the coordinator was away")
        await fleet.undrain(bus, cluster, "na")
        await (await bus.typed(KV_NODES, NodeHeartbeat)).put(  # as nc's agent writes it
            subjects.node_key(cluster, "nc"),
            NodeHeartbeat(cluster=cluster, node="nc", health=Health.unhealthy))
        proxy.mend()
        got = {await next_heard() for _ in range(3)}
        assert got == {("nb", "drained"), ("na", "healthy"), ("nc", "unhealthy")}
        assert heard.empty()  # nothing of the other cluster's
    finally:
        coordinator.reconnected.remove(recheck)
        await watch.stop()
        await coordinator.drain()
        await proxy.stop()


def test_device_picks_the_backend() -> None:
    import torch

    from tandem.trainer.rank import pick_device

    cpu = parse_run_config({"device": "cpu"})
    assert pick_device(cpu, 0) == (torch.device("cpu"), "gloo")
    cuda = parse_run_config({"device": "cuda"})
    if torch.cuda.is_available():
        assert pick_device(cuda, 0)[1] == "nccl"
    else:
        with pytest.raises(RuntimeError, match="no CUDA device"):
            pick_device(cuda, 0)
    auto = pick_device(parse_run_config({"device": "auto"}), 0)[1]
    assert auto == ("nccl" if torch.cuda.is_available() else "gloo")


def test_parallelism_is_config_and_bf16_is_refused_where_it_cannot_run() -> None:
    import torch

    from tandem.trainer.sharding import MixedPrecisionUnsupported, mixed_precision

    assert parse_run_config({}).parallelism == "ddp"
    fsdp = parse_run_config({"parallelism": "fsdp", "fsdp": {"reshard_after_forward": False}})
    assert fsdp.fsdp.reshard_after_forward is False and fsdp.fsdp.mixed_precision == "none"
    with pytest.raises(InvalidRunConfig) as exc:
        parse_run_config({"parallelism": "fsdp", "device": "cpu",
                          "fsdp": {"mixed_precision": "bf16"}})
    assert "needs a CUDA device with bf16" in str(exc.value.problems)
    with pytest.raises(InvalidRunConfig):
        parse_run_config({"parallelism": "fsdp", "mixed_precision": "fp16"})
    auto = parse_run_config({"parallelism": "fsdp", "fsdp": {"mixed_precision": "bf16"}})
    with pytest.raises(MixedPrecisionUnsupported, match="cannot run on cpu"):
        mixed_precision(auto, torch.device("cpu"))
    assert mixed_precision(fsdp, torch.device("cpu")).param_dtype is None


def test_the_dit_b_preset_is_a_model_worth_sharding() -> None:
    import torch

    from tandem.trainer.loop import build_model

    cfg = parse_run_config({"model": "dit-b", "parallelism": "fsdp"})
    with torch.device("meta"):  # shapes only: nothing is allocated
        model = build_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    assert params >= 100_000_000
    assert params * 4 * 3 >= 1.2e9  # fp32 weights and AdamW's two moments
    with pytest.raises(InvalidRunConfig, match="dit-b"):
        parse_run_config({"model": "dit-z"})


def test_a_node_fetches_a_committed_checkpoint_verified_and_tells_corrupt_from_unreachable(
        s3_server: Any, uid: str, tmp_path: Path) -> None:
    """``fetch.fetch_step``, what each node's first rank does for a resume on its own disk:
    a verified copy (kept when one is there), "corrupt" (the ranks fall back to an older
    step) or "error" (the attempt fails: an outage is no reason to fall back)."""
    from tandem.common.settings import Settings, load
    from tandem.common.storage import ensure_bucket, s3_client
    from tandem.trainer.fetch import fetch_step
    from tests.test_checkpoints import commit, flip_byte

    s3 = s3_client(load(Settings, s3_endpoint=s3_server.url, s3_access_key="tandem",
                        s3_secret_key="tandem"))
    bucket, run = f"fetch-{uid}", f"r{uid}"
    ensure_bucket(s3, bucket)
    commit(s3, bucket, tmp_path / "writer", run, 5, {"rng.bin": 3000})
    root = tmp_path / "node"
    assert fetch_step(s3, bucket, root, run, 5) == ("ok", "downloaded")
    assert ck.same_files(ck.verify(ck.step_dir(root, run, 5)),
                         ck.scan(tmp_path / "writer" / "step-5", run, 5))
    assert fetch_step(s3, bucket, root, run, 5) == ("ok", "kept the copy on this node")

    flip_byte(s3, bucket, ck.object_key(run, 5, "rng.bin"))
    shutil.rmtree(ck.step_dir(root, run, 5))
    kind, why = fetch_step(s3, bucket, root, run, 5)
    assert kind == "corrupt" and why.startswith("rng.bin: crc32 "), why
    assert not ck.step_dir(root, run, 5).exists()  # nothing half-fetched is left as a step
    kind, why = fetch_step(s3, bucket, root, run, 6)
    assert kind == "corrupt" and "not committed" in why

    dead = s3_client(load(Settings, s3_endpoint="http://127.0.0.1:9", s3_access_key="tandem",
                          s3_secret_key="tandem", s3_max_attempts=1))
    kind, why = fetch_step(dead, bucket, root, run, 5)
    assert kind == "error" and "EndpointConnectionError" in why, why


def test_a_resume_from_s3_fetches_only_checkpoints_of_the_runs_current_lineage(
        s3_server: Any, uid: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``fetch.fetch`` (one rank, no process group): with the run forked at step 4 (its
    lineage 1 owns steps after 4), step 5 is ``step-5-l1``, never lineage 0's abandoned
    ``step-5``, even when the new one is corrupt: then the fetch falls back to step 3."""
    from tandem.common.settings import Settings, load
    from tandem.common.storage import ensure_bucket, s3_client
    from tandem.trainer.fetch import fetch
    from tandem.trainer.spec import LaunchSpec
    from tests.test_checkpoints import commit, flip_byte

    for name, value in (("S3_ENDPOINT", s3_server.url), ("S3_ACCESS_KEY", "tandem"),
                        ("S3_SECRET_KEY", "tandem"), ("S3_BUCKET", f"lineage-{uid}")):
        monkeypatch.setenv(f"TANDEM_{name}", value)
    s3 = s3_client(load(Settings))
    bucket, run = f"lineage-{uid}", f"r{uid}"
    ensure_bucket(s3, bucket)
    for step, lineage in ((3, 0), (5, 0), (5, 1)):
        commit(s3, bucket, tmp_path / "writer", run, step, {"rng.bin": 3000}, lineage)
    root = tmp_path / "node"
    spec = LaunchSpec(run_id=run, attempt=2, config={}, checkpoint_root=str(root),
                      attempt_dir=str(tmp_path / "work"), resume_steps=[5, 3], forks=[4])

    path, step, skipped = fetch(spec, local_rank=0, world=1, node="n0")
    assert (path, step, skipped) == (ck.step_dir(root, run, 5, 1), 5, {})
    assert ck.verify(path).lineage == 1
    assert not ck.step_dir(root, run, 5).exists()

    shutil.rmtree(path)
    flip_byte(s3, bucket, ck.object_key(run, 5, "rng.bin", 1))
    path, step, skipped = fetch(spec, local_rank=0, world=1, node="n0")
    assert (path, step) == (ck.step_dir(root, run, 3), 3)
    assert list(skipped) == [5] and "rng.bin: crc32 " in skipped[5]
    assert not ck.step_dir(root, run, 5).exists()
