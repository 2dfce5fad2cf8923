"""``tandem bench train --sharded``: FSDP2 over simulated nodes, Tandem against a plain loop.

The shape (one machine, as ``tests/test_train_nodes`` simulates nodes): ``--nodes`` nodes
(2) of ``--ranks-per-node`` ranks (2), one torchrun per node (``--nnodes N``, a c10d
rendezvous on loopback hosted by the first node's, the command line the coordinator's
``LocalLauncher`` gives a node; each rank takes its node from ``TANDEM_NODE``), each
node with a checkpoint folder of its own; gloo on CPU (``--device cuda``: NCCL, one GPU
per rank). This process plays what runs beside the ranks: the
coordinator's relay (every step report and checkpoint event published to NATS, as in
``tandem bench train``) and one checkpointer per node (a ``Mirror`` of its own, with its
own S3 client and thread, mirroring that node's checkpoints one after the other to S3, a
moto server here). Every process shares one machine's cores here, where a cluster's
nodes would each have their own: each figure's ``why`` says what was saturated.

Figures (``stats``: ``--repeat`` repeats, the sides of each in alternating order; goals
judged on the median of the per-repeat ratios):

(a) ``steps_ratio``: steps/s of the ranks' tandem segments (``after_step``: step
    reports, a DCP ``async_save`` of every rank's shards every ``--every`` steps, the
    first at the segment's first step; the segment ends when its saves are committed on
    the nodes' disks and each node's last checkpoint of it is in S3) over their plain
    segments (``train_step`` only, no checkpoint, no event) (``train_sharded_rank``);
    goal >= 0.95. Whether it can be met depends on ``--every``: a checkpoint's save and
    mirror must fit in the compute of the ``every - 1`` steps after it, as in a run,
    where an interval is hundreds of steps: a note gives each segment's tail (its last
    step's end to its end, the slowest rank) and the ratio over the steps alone. Where
    the ranks take every core (4 CPU ranks on 2 cores), the save's writes and the mirror
    cost the ranks a roughly fixed time per checkpoint (a note gives it, and the interval
    that leaves 0.95), so the ratio measures that cost against the interval: the default
    interval (32 steps of dit-b, about 10 minutes of training here) is the short end of
    what runs use; ``--every 4`` (74 s of training) measures a checkpoint's cost against
    almost nothing.
(b) ``block_ratio``: the time a checkpoint blocks training (the staging copy; the
    slowest rank per checkpoint) over a synchronous ``dcp.save`` of the same state with
    the same writer options; goal <= 0.2.
(c) ``mirror_ratio``: after training, each node's newest checkpoint folder uploaded by
    its ``Mirror`` (a CRC32 sent with every part, each file's CRC32, combined from its
    parts', checked against its manifest, what S3 stored verified, a manifest put last)
    against raw boto3
    (``upload_file``'s ``TransferManager``, every file at once, the same part size,
    threshold and concurrency), both nodes at once on each side: throughput per node,
    averaged over the nodes; goal >= 0.9.

What it leaves out: each node's folder is mirrored as a file set of its own (under
``<run>-<node>``); the one commit of a manifest over every node's shards is one small
conditional put after them (``checkpoints.merge_parts``), not timed here.

The JSON carries ``sharded.steps_ratio``, ``sharded.block_ratio`` and
``sharded.mirror_ratio`` (the medians) beside the usual ``figures``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from tandem.cli.bench import saturation, stats

GOAL_STEPS = 0.95
GOAL_BLOCKED = 0.2
GOAL_MIRROR = 0.9
MiB = 1 << 20
RUN = "bench"
BUCKET = "bench-sharded"
RANK_MODULE = "tandem.cli.bench.train_sharded_rank"
# A checkpoint every 32 steps: about 10 minutes of training for dit-b on 4 CPU ranks of
# a 2-core machine (~19 s a step), the short end of the 10-60 minutes runs checkpoint at.
DEFAULTS = {"steps": 32, "every": 32, "batch_size": 4, "threads": 0}
# --model: the preset by default, smaller DiTs to try the bench on a small machine.
MODELS: dict[str, Any] = {
    "dit-b": "dit-b",  # DiT-B/2 (runs.MODEL_PRESETS): 147.4M parameters, 2.36 GB of state
    # DiT-S/2 on the same latents: 12 blocks of width 384, 39.8M parameters
    "dit-s": {"kind": "dit", "sample_size": 32, "in_channels": 4, "num_classes": 1000,
              "num_layers": 12, "num_attention_heads": 6, "attention_head_dim": 64,
              "patch_size": 2},
    # two blocks of width 32 on 8x8: seconds, for a smoke run
    "dit-tiny": {"kind": "dit", "sample_size": 8, "in_channels": 4, "num_classes": 10,
                 "num_layers": 2, "num_attention_heads": 2, "attention_head_dim": 16,
                 "patch_size": 2},
}
SMOKE = ("--sharded", "--model", "dit-tiny", "--steps", "2", "--every", "2",
         "--batch-size", "2", "--part-mb", "5", "--concurrency", "2")


def add_options(p: argparse.ArgumentParser) -> None:
    """The options only ``--sharded`` reads (``train.add_arguments`` adds them)."""
    p.add_argument("--model", choices=list(MODELS), default="dit-b",
                   help="sharded: the DiT trained (default dit-b, 147.4M parameters)")
    p.add_argument("--nodes", type=stats.positive_int, default=2, help="sharded: simulated nodes")
    p.add_argument("--ranks-per-node", type=stats.positive_int, default=2,
                   help="sharded: ranks per node")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="sharded: cpu (gloo) or cuda (NCCL, a GPU per rank)")
    p.add_argument("--part-mb", type=stats.positive_int, default=16,
                   help="sharded: mirror part size and threshold, MiB (both sides)")
    p.add_argument("--concurrency", type=stats.positive_int, default=8,
                   help="sharded: parts uploaded at once per node (both sides)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``tandem bench train-sharded`` (``bench all``'s name for ``train --sharded``)."""
    from tandem.cli.bench import train

    train.add_arguments(p)
    p.set_defaults(sharded=True, repeat=3)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """The bench, its options left unset taking this mode's defaults."""
    args = argparse.Namespace(**{**vars(args), **{
        k: v for k, v in DEFAULTS.items() if getattr(args, k, None) is None}})
    for name in ("steps", "every", "batch_size", "nodes", "ranks_per_node", "repeat"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.steps % args.every:
        raise ValueError(f"--steps ({args.steps}) must be a multiple of --every "
                         f"({args.every}): every tandem segment starts with a checkpoint")
    return await _measure(args)


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    from concurrent.futures import ThreadPoolExecutor

    from tandem.checkpointer.mirror import Mirror, MirrorConfig
    from tandem.cli.bench.train import relay_pump
    from tandem.cli.devstack import S3Server, scratch_nats
    from tandem.common import log
    from tandem.common.bus import Bus
    from tandem.common.events import CheckpointWritten
    from tandem.common.runs import parse_run_config
    from tandem.common.settings import Settings, load
    from tandem.common.storage import ensure_bucket, s3_client
    from tandem.common.streams import core_streams
    from tandem.trainer.launcher import LocalLauncher
    from tandem.trainer.supervisor import RunSupervisor, SupervisorConfig

    log.configure("auto", "error", stream=sys.stderr)  # stdout: the result
    nodes = [f"node-{i}" for i in range(args.nodes)]
    world = args.nodes * args.ranks_per_node
    # Warm-up ends one step before a checkpoint step and segments are whole intervals, so
    # each tandem segment starts with a checkpoint and its last one overlaps every - 1
    # steps (as a run's checkpoint overlaps its interval).
    warmup = args.every - 1 or args.every
    cfg = parse_run_config({
        "run_id": RUN, "model": MODELS[args.model], "parallelism": "fsdp", "ranks": world,
        "nodes": nodes, "device": args.device, "batch_size": args.batch_size,
        "checkpoint_every": args.every, "step_event_every": 1,
        # one step more than are trained: no last-step checkpoint inside a segment
        "steps": warmup + 2 * args.repeat * args.steps + 1,
        "data": {"kind": "synthetic", "synthetic_size": 256}})
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    with scratch_nats("train-sharded") as (server, root):
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        s3srv = S3Server(name="s3", log_path=root / "s3.log").start()
        settings = load(Settings, nats_url=server.url, s3_endpoint=s3srv.url,
                        s3_access_key="bench", s3_secret_key="bench")
        pool = max(32, 2 * args.concurrency)
        # One checkpointer per node: its own client, mirror and thread (in order).
        clients = {n: s3_client(settings, max_pool=pool) for n in nodes}
        mirrors = {n: Mirror(clients[n], MirrorConfig(
            bucket=BUCKET, multipart_threshold=args.part_mb * MiB, part_size=args.part_mb * MiB,
            concurrency=args.concurrency)) for n in nodes}
        threads_of = {n: ThreadPoolExecutor(1, thread_name_prefix=f"mirror-{n}") for n in nodes}
        bus = await Bus.connect(settings, "bench")
        try:
            await bus.provision(core_streams())
            await asyncio.to_thread(ensure_bucket, clients[nodes[0]], BUCKET)
            sup = RunSupervisor(bus, SupervisorConfig(
                checkpoint_root=root / "ckpt", work_root=root / "work", cluster=RUN,
                node=nodes[0]), RUN, cfg, LocalLauncher(), log.get("tandem.bench"))
            relay = await sup.listen()  # the coordinator's relay, as it is started
            loop = asyncio.get_running_loop()
            mirrored: list[asyncio.Future[None]] = []

            def on_message(msg: Any) -> None:
                if isinstance(msg, CheckpointWritten):  # a node's part, on its disk
                    mirrored.append(loop.run_in_executor(
                        threads_of[msg.node], _mirror_node, mirrors[msg.node], msg))

            pump = asyncio.create_task(relay_pump(sup, world, on_message))
            procs = {"bench process (relay, mirrors)": saturation.this_process,
                     "moto (S3)": s3srv.cpu_seconds}
            meter = saturation.Meter(procs).start()
            out = await _train(args, cfg, root, nodes, threads, warmup, s3srv.url,
                               sup.relay_address)
            training = meter.stop()
            await asyncio.wait_for(pump, 60)  # every reported step is on the bus
            await asyncio.gather(*mirrored)
            published = (await bus.js.stream_info("TRAIN")).state.messages
            relay.close()
            uploads = await _mirror_vs_raw(args, root, nodes, clients, mirrors, procs)
        finally:
            await bus.drain()
            for n in nodes:
                mirrors[n].close()
                threads_of[n].shutdown(wait=True)
            s3srv.stop()
    return _result(args, cfg, out, uploads, training, published, threads)


async def _train(args: argparse.Namespace, cfg: Any, root: Path, nodes: list[str],
                 threads: int, warmup: int, s3_url: str, events: str) -> dict[str, Any]:
    """One torchrun per node, as the coordinator's local launcher starts them; the
    ranks' result (``train_sharded_rank``)."""
    import msgspec

    from tandem.cli.bench.train import bench_env
    from tandem.trainer.launcher import (
        LocalLauncher,
        Placement,
        rank_env,
        rendezvous_port,
        spawn,
    )
    from tandem.trainer.spec import LaunchSpec

    placement = Placement(nodes=nodes, per_node=args.ranks_per_node)
    port = rendezvous_port("127.0.0.1")
    agents = []
    for i, node in enumerate(nodes):
        folder = root / node
        (folder / "ckpt").mkdir(parents=True)
        spec_path = folder / "launch.json"
        spec_path.write_bytes(msgspec.json.encode(LaunchSpec(
            run_id=RUN, attempt=1, config=cfg.model_dump(mode="json"),
            checkpoint_root=str(folder / "ckpt"), attempt_dir=str(folder / "work"),
            events=events, rank_nodes=placement.rank_nodes, node=node, cluster=RUN,
            threads=threads)))
        spec_path.with_suffix(".bench.json").write_text(json.dumps({
            "steps": args.steps, "rounds": args.repeat, "warmup": warmup,
            "s3_endpoint": s3_url, "s3_key": "bench", "bucket": BUCKET,
            "out": str(root / "out.json")}))
        command = LocalLauncher().command(placement, i, port, spec_path, module=RANK_MODULE)
        agents.append((folder, await spawn(command, folder / "torchrun.log",
                                           rank_env(bench_env(), node))))
    codes = await asyncio.gather(*(proc.wait() for _, proc in agents))
    if any(codes):
        logs = "; ".join(f"{f / 'torchrun.log'}: "
                         f"{(f / 'torchrun.log').read_text(errors='replace')[-1500:]}"
                         for f, _ in agents)
        raise RuntimeError(f"a node's torchrun exited with {codes}: {logs}")
    return json.loads((root / "out.json").read_text())


def _standalone(manifest: Any, run: str) -> Any:
    """A node's share of a sharded checkpoint as a file set of its own, under ``run``."""
    import msgspec

    from tandem.common import checkpoints as ck

    return msgspec.structs.replace(manifest, run_id=run, kind=ck.FULL, world_size=0,
                                   part="")


def _mirror_node(mirror: Any, ev: Any) -> None:
    """A node's checkpointer: mirror the checkpoint the node wrote, then keep only the
    newest on disk and in S3 (the disk and moto's memory stay bounded, as retention
    keeps them in a run)."""
    from tandem.cli.bench.train_sharded_rank import node_run
    from tandem.common import checkpoints as ck

    run = node_run(RUN, ev.node)
    mirror.mirror(Path(ev.path), _standalone(ev.manifest, run))
    folder = Path(ev.path).parent
    for c, _ in ck.local_checkpoints(folder):
        if c.step < ev.step:
            ck.delete(mirror.s3, BUCKET, run, c.step, c.lineage)
            ck.remove_steps(folder, [c])


async def _mirror_vs_raw(args: argparse.Namespace, root: Path, nodes: list[str],
                         clients: dict[str, Any], mirrors: dict[str, Any],
                         procs: dict[str, Any]) -> dict[str, Any]:
    """(c): each node's newest checkpoint, every node at once, Tandem's mirror against
    raw boto3, interleaved; per node MiB/s averaged over the nodes, per repeat."""
    from tandem.cli.bench.checkpoint import clear_bucket, raw_upload, transfer_manager
    from tandem.common import checkpoints as ck

    sources, manifests, sizes = {}, {}, {}
    for n in nodes:
        path = ck.local_steps(root / n / "ckpt" / RUN)[0][1]  # the newest
        manifests[n] = ck.parse_manifest((path / ck.MANIFEST).read_bytes())
        sources[n], sizes[n] = path, sum(f.size for f in manifests[n].files)
    tms = {n: transfer_manager(clients[n], args.part_mb, args.concurrency) for n in nodes}

    async def side(name: str, r: int) -> dict[str, Any]:
        def one(node: str) -> float:
            if name == "raw":
                return raw_upload(tms[node], BUCKET, sources[node], f"raw{r + 1}/{node}")
            t0 = time.perf_counter()
            manifest = _standalone(manifests[node], f"mirror{r + 1}-{node}")
            result = mirrors[node].mirror(sources[node], manifest)
            assert result.committed and not result.skipped
            return time.perf_counter() - t0

        meter = saturation.Meter(procs).start()
        took = await asyncio.gather(*(asyncio.to_thread(one, n) for n in nodes))
        used = meter.stop()
        await asyncio.to_thread(clear_bucket, clients[nodes[0]], BUCKET)
        return {"mib_s": statistics.mean(sizes[n] / MiB / t for n, t in zip(nodes, took,
                                                                            strict=True)),
                "s": [round(t, 3) for t in took], "cpu": used.json()}

    try:
        await asyncio.to_thread(clear_bucket, clients[nodes[0]], BUCKET)  # training's copies
        # A first round of each warms both up (connections, moto, page cache): not counted.
        await side("raw", -1)
        await side("tandem", -1)
        runs = await stats.interleaved(args.repeat, {"raw": lambda r: side("raw", r),
                                                     "tandem": lambda r: side("tandem", r)})
    finally:
        for tm in tms.values():
            tm.shutdown()
    return {"runs": runs, "bytes_per_node": sizes,
            "crc32_mib_per_s_one_core": round(saturation.crc32_mib_per_s(), 1)}


def _result(args: argparse.Namespace, cfg: Any, out: dict[str, Any], uploads: dict[str, Any],
            training: Any, published: int, threads: int) -> dict[str, Any]:
    window = training.json()
    # The ranks are the bench's too: the cores they kept busy in the tandem segments.
    window["cores"]["ranks (tandem segments)"] = out.get("rank_cores", {}).get("tandem", 0.0)
    steps = stats.Figure("sharded_steps_per_s", "(a) FSDP2 steps/s with Tandem's additions",
                         "steps/s", out["tandem_steps_per_s"], out["plain_steps_per_s"],
                         "plain FSDP2 loop", goal=stats.Goal(">=", GOAL_STEPS))
    tails = out.get("tail_s", [])
    if tails:
        segs = [args.steps / r for r in out["tandem_steps_per_s"]]
        during = [args.steps / (s - t) for s, t in zip(segs, tails, strict=True)]
        steps.notes.append(
            "each tandem segment's last step ended " + ", ".join(f"{t:.1f}" for t in tails)
            + " s before the segment (" + ", ".join(f"{s:.1f}" for s in segs) + " s) did: "
            "the wait for its last checkpoint's save and mirror, which a run's next steps "
            "would overlap; over the steps alone, " + ", ".join(
                f"{d / p:.3f}" for d, p in zip(during, out["plain_steps_per_s"], strict=True))
            + " of the plain segments' steps/s")
    # A checkpoint's cost to training is a time, not a ratio: the ratio follows from the
    # interval (``--every``) the bench runs. What each checkpoint took from the ranks, and
    # the interval at which that would leave the goal's share of the plain loop's steps.
    lost = [(args.steps / t - args.steps / p) / (args.steps // args.every)
            for t, p in zip(out["tandem_steps_per_s"], out["plain_steps_per_s"], strict=True)]
    need = [GOAL_STEPS / (1 - GOAL_STEPS) * x for x in lost]
    steps.notes.append(
        "each checkpoint cost the ranks " + ", ".join(f"{x:.1f}" for x in lost) + " s of "
        f"training (the tandem segments' time over the plain ones', per checkpoint): "
        f"{GOAL_STEPS:g} of the plain steps/s needs checkpoints at least "
        + ", ".join(f"{x:.0f} s ({x * p:.0f} steps)" for x, p in
                    zip(need, out["plain_steps_per_s"], strict=True))
        + f" of training apart; this run checkpoints every {args.every} steps")
    n = len(out["blocked_s"])
    blocked = stats.Figure(
        "sharded_checkpoint_blocked", "(b) time a sharded checkpoint blocks training", "ms",
        [b * 1e3 for b in out["blocked_s"]], [s * 1e3 for s in out["sync_save_s"][:n]],
        "synchronous dcp.save", goal=stats.Goal("<=", GOAL_BLOCKED))
    runs = uploads["runs"]
    mirror = stats.Figure("sharded_mirror", "(c) mirror throughput per node", "MiB/s",
                          [x["mib_s"] for x in runs["tandem"]],
                          [x["mib_s"] for x in runs["raw"]],
                          "raw boto3 TransferManager (upload_file)",
                          goal=stats.Goal(">=", GOAL_MIRROR), digits=1)
    cores = out.get("rank_cores", {})
    note = (f"{threads} torch thread(s) per rank, {args.nodes * args.ranks_per_node} ranks "
            f"on {os.cpu_count()} CPUs (the ranks kept {cores.get('plain', 0):.2f} cores busy "
            f"in plain segments); the nodes' mirrors run in the bench process")
    for f in (steps, blocked):
        if f.met is False:
            f.why = saturation.why(window, extra=[note])
    if mirror.met is False:
        r = stats.median_run(range(args.repeat), lambda i: mirror.ratio[i])  # type: ignore[index]
        mirror.why = saturation.why(runs["tandem"][r]["cpu"], extra=[
            f"one core computes CRC32 at {uploads['crc32_mib_per_s_one_core']:,.0f} MiB/s; "
            "each side checksums each byte once (a CRC32 per part; the mirror combines "
            "them into the file's, against its manifest); the raw side's "
            "cores: " + ", ".join(f"{k} {v:.2f}" for k, v in
                                  runs["raw"][r]["cpu"]["cores"].items())])
    fj = stats.figures_json([steps, blocked, mirror])
    return {
        "bench": "train", "mode": "sharded", "model": args.model, "device": args.device,
        "nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
        "batch_size": cfg.batch_size, "checkpoint_every": args.every,
        "steps_per_segment": args.steps, "repeat": args.repeat,
        "threads_per_rank": threads, "checkpoints": out["checkpoints"],
        "state_bytes_per_node": out["node_bytes"],
        "mirror_bytes_per_node": uploads["bytes_per_node"],
        "events_published": published,
        "sharded": {"steps_ratio": fj[steps.name]["ratio"]["median"],
                    "block_ratio": fj[blocked.name]["ratio"]["median"],
                    "mirror_ratio": fj[mirror.name]["ratio"]["median"],
                    "goals": {"steps_ratio": GOAL_STEPS, "block_ratio": GOAL_BLOCKED,
                              "mirror_ratio": GOAL_MIRROR}},
        "machine_cpu": window,
        "figures": fj,
        "raw": {"ranks": out, "uploads": {k: [{"mib_s": round(x["mib_s"], 2), "s": x["s"]}
                                              for x in v] for k, v in runs.items()}},
        "ok": stats.all_met(fj),
    }


def render(r: dict[str, Any]) -> str:
    s, f = r["sharded"], r["figures"]

    def med(name: str, side: str) -> float:
        return float(f[name][side]["median"])

    per_node = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in r["state_bytes_per_node"].items())
    return "\n".join([
        f"tandem bench train --sharded: {r['model']} FSDP2 over {r['nodes']} nodes x "
        f"{r['ranks_per_node']} ranks ({r['device']}, {r['threads_per_rank']} thread(s) per "
        f"rank), batch {r['batch_size']} per rank, checkpoint every {r['checkpoint_every']} "
        f"steps, {r['repeat']} x {r['steps_per_segment']} steps",
        f"  checkpoint per node: {per_node}; {r['checkpoints']} checkpoints; "
        f"{r['events_published']} events published",
        f"  (a) steps/s   plain {med('sharded_steps_per_s', 'baseline'):.3f}  tandem "
        f"{med('sharded_steps_per_s', 'tandem'):.3f}  ratio {s['steps_ratio']} "
        f"(goal >= {GOAL_STEPS})",
        f"  (b) blocked   async {med('sharded_checkpoint_blocked', 'tandem'):.1f} ms  sync "
        f"dcp.save {med('sharded_checkpoint_blocked', 'baseline'):.1f} ms  ratio "
        f"{s['block_ratio']} (goal <= {GOAL_BLOCKED})",
        f"  (c) mirror    {med('sharded_mirror', 'tandem'):.1f} MiB/s per node  raw boto3 "
        f"{med('sharded_mirror', 'baseline'):.1f} MiB/s  ratio {s['mirror_ratio']} "
        f"(goal >= {GOAL_MIRROR})",
    ])
