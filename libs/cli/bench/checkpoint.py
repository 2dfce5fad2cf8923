"""checkpoint mirror against raw boto3's parallel transfer, and written -> committed.

Starts moto's S3 server and a nats-server on free loopback ports. One synthetic
checkpoint (``--size-mb``, split like a real one: optimizer state half, model and EMA
weights a quarter each, plus small RNG/data-position files) is uploaded, alternating
rounds, by:

- raw: every file handed at once to one boto3 ``TransferManager`` (``TransferConfig`` of
  the same multipart threshold, part size and concurrency: its parts and small files
  share ``max_concurrency`` threads, as the mirror's share its pool; boto3's own CRC
  checksums): as parallel as boto3 goes, so the mirror's overlap of files is no edge;
- tandem: the checkpointer's ``Mirror``: a CRC32 sent with every part (as boto3 sends
  its own) and the manifest's CRC32 with every small file, each whole file's CRC32
  (combined from its parts') compared with the manifest, what S3 stored verified
  (composite checksum for multipart files, read-back for single-request ones, as moto
  does not check checksums), then the manifest put with ``If-None-Match: *``;
- verified: raw, plus what a boto3 user adds for the mirror's guarantee: every file
  checked against the manifest (its CRC32, one pass in one thread beside the transfer:
  boto3 does not hand back the CRC32s it sends). The goal is judged against raw (as the
  issue sets it); the mirror against this side is the figure with the same guarantee on
  both sides (no goal).

Both sides use the same client (``storage.s3_client``: no SHA-256 of the bodies for the
signature, which botocore would add on moto's plain http for the mirror's explicit
checksum headers and never for boto3's streamed trailers).

A first round warms both up and is not counted; then ``--repeat`` repeats interleave the
sides (``stats.schedule``: which goes first alternates), and the goal is judged on the
median repeat's ratio. Each side's CPU (this process: the uploading threads; moto) and the
machine's are read over each upload, and one core's CRC32 rate is measured, so a missed
goal says what bound it. ``--pin-s3`` puts moto on one CPU and this process on the others:
S3 then does not take the uploaders' cores, as in a deployment. Then the checkpointer
service runs against NATS: a ``CheckpointWritten`` event is published and the time until
``ckpt.<run>.mirrored`` arrives is measured (median of ``--commits``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tandem.cli.bench import saturation, stats

GOAL = 0.9  # of boto3's parallel transfer (issue 21: the baseline as parallel as Tandem)
MiB = 1 << 20
SMOKE = ("--size-mb", "12", "--part-mb", "5", "--commits", "1", "--concurrency", "4")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mb", type=stats.positive_int, default=256, help="checkpoint size in MiB")
    stats.add_repeat(p, 5, "--rounds")
    p.add_argument("--commits", type=stats.positive_int, default=3,
                   help="written -> committed samples")
    p.add_argument("--part-mb", type=stats.positive_int, default=16,
                   help="part size and threshold, MiB")
    p.add_argument("--concurrency", type=stats.positive_int, default=8,
                   help="parts uploaded at once")
    p.add_argument("--pin-s3", action="store_true",
                   help="moto on one CPU and this process on the others, so S3 does not "
                   "share the uploaders' cores (as in a deployment); needs 2 CPUs")


def _write_checkpoint(directory: Path, size: int) -> dict[str, int]:
    sizes = {"optimizer.bin": size // 2, "model.safetensors": size // 4,
             "ema.safetensors": size - size // 2 - size // 4 - 4096 - 200,
             "rng.bin": 4096, "data_position.json": 200}
    directory.mkdir(parents=True)
    block = os.urandom(4 * MiB)
    for name, n in sizes.items():
        with open(directory / name, "wb") as f:
            left = n
            while left > 0:
                chunk = block[: min(left, len(block))]
                f.write(chunk)
                left -= len(chunk)
            # Make files differ from each other (no dedupe anywhere to flatter anyone).
            f.seek(0)
            f.write(os.urandom(min(n, 64)))
    return sizes


def clear_bucket(s3: Any, bucket: str) -> None:
    """Delete every object of ``bucket`` (between a bench's sides: each starts empty)."""
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


def raw_upload(tm: Any, bucket: str, directory: Path, prefix: str,
               extra_args: dict[str, str] | None = None) -> float:
    """Every file under ``directory`` through one boto3 ``TransferManager`` at once (what
    ``upload_file`` runs on): its parts and small files share ``max_concurrency``
    threads, as the mirror's share its pool. Returns the seconds it took."""
    t = time.perf_counter()
    futures = [tm.upload(str(path), bucket, f"{prefix}/{path.relative_to(directory).as_posix()}",
                         extra_args=extra_args)
               for path in sorted(directory.rglob("*")) if path.is_file()]
    for fut in futures:
        fut.result()
    return time.perf_counter() - t


def verified_upload(tm: Any, bucket: str, directory: Path, prefix: str, manifest: Any
                    ) -> float:
    """``raw_upload`` with the mirror's guarantee added: every file checked against
    ``manifest`` (its checksum), in one thread beside the transfer. What a user who needs
    that check would run with boto3; returns the seconds it took, the check included."""
    from tandem.common import checkpoints as ck

    t = time.perf_counter()
    with ThreadPoolExecutor(1, thread_name_prefix="bench-hash") as hasher:
        checked = {e.name: hasher.submit(ck.checksum.check_file, directory / e.name, e)
                   for e in sorted(manifest.files, key=lambda e: -e.size)}
        raw_upload(tm, bucket, directory, prefix)
        bad = [e.name for e in manifest.files if not checked[e.name].result().ok()]
    if bad:
        raise RuntimeError(f"bench: files differ from their manifest: {bad}")
    return time.perf_counter() - t


def transfer_manager(s3: Any, part_mb: int, concurrency: int) -> Any:
    """boto3's ``TransferManager`` with the mirror's part size, threshold and concurrency."""
    from boto3.s3.transfer import TransferConfig, create_transfer_manager

    return create_transfer_manager(s3, TransferConfig(
        multipart_threshold=part_mb * MiB, multipart_chunksize=part_mb * MiB,
        max_concurrency=concurrency))


def _tandem(mirror: Any, directory: Path, manifest: Any) -> float:
    t = time.perf_counter()
    result = mirror.mirror(directory, manifest)
    dt = time.perf_counter() - t
    assert result.committed and not result.skipped
    return dt


async def _written_to_committed(s3_url: str, nats_url: str, bucket: str, directory: Path,
                                args: argparse.Namespace) -> list[float]:
    from tandem.checkpointer.service import Checkpointer, CheckpointerSettings
    from tandem.common import checkpoints as ck
    from tandem.common import log, subjects
    from tandem.common.bus import Bus
    from tandem.common.events import CheckpointMirrored, CheckpointWritten, decode
    from tandem.common.runner import Context
    from tandem.common.settings import load

    settings = load(CheckpointerSettings, "checkpointer", nats_url=nats_url,
                    s3_endpoint=s3_url, s3_bucket=bucket, s3_access_key="bench",
                    s3_secret_key="bench", multipart_threshold=args.part_mb * MiB,
                    part_size=args.part_mb * MiB, upload_concurrency=args.concurrency,
                    keep_last=1, local_keep=args.commits + 1, checkpoint_root=str(directory))
    bus = await Bus.connect(settings, "bench")
    svc = Checkpointer(settings)
    await bus.provision(svc.streams())
    ctx = Context(bus=bus, settings=settings, stopping=asyncio.Event(),
                  log=log.get("tandem.checkpointer"))
    task = asyncio.create_task(svc.run(ctx))
    got: asyncio.Queue[tuple[float, CheckpointMirrored]] = asyncio.Queue()

    async def on(msg: Any) -> None:
        got.put_nowait((time.time(), decode(msg.data, CheckpointMirrored)))

    run = "bench"
    await bus.nc.subscribe(subjects.ckpt(run, "mirrored"), cb=on)
    out = []
    try:
        for i in range(args.commits):
            step = (i + 1) * 100
            step_dir = ck.step_dir(directory, run, step)  # the layout the checkpointer checks
            step_dir.mkdir(parents=True)
            for f in (directory / "source").iterdir():
                os.link(f, step_dir / f.name)
            manifest = ck.scan(step_dir, run, step)
            ev = CheckpointWritten(run_id=run, step=step, path=str(step_dir), manifest=manifest,
                                   cluster="bench", node="node-0")
            await bus.publish(subjects.mirror(ev.cluster, ev.node), ev)
            at, mirrored = await asyncio.wait_for(got.get(), 600)
            assert mirrored.step == step, mirrored
            out.append(at - ev.at)
    finally:
        ctx.stopping.set()
        await asyncio.wait_for(task, 60)
        await bus.drain()
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from tandem.checkpointer.mirror import Mirror, MirrorConfig
    from tandem.cli.devstack import NatsServer, S3Server
    from tandem.common import checkpoints as ck
    from tandem.common import log
    from tandem.common.settings import Settings, load
    from tandem.common.storage import ensure_bucket, s3_client

    log.configure("auto", "warning", stream=sys.stderr)  # stdout: the result
    size = args.size_mb * MiB
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin_s3 and len(cpus) < 2:
        raise ValueError(f"--pin-s3 needs 2 CPUs; this process may use {len(cpus)}")
    pinned: dict[str, list[int]] | None = None
    with tempfile.TemporaryDirectory(prefix="tandem-bench-ckpt-") as tmp:
        root = Path(tmp)
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        # The server holds every object in memory (above the largest file, and its
        # completed copy): it does the same work each round (devstack.S3Server).
        s3srv = S3Server(name="s3", log_path=root / "s3.log",
                         hold_mib=args.size_mb).start()
        nats = NatsServer(name="bench", log_path=root / "nats.log",
                          store_dir=root / "js").start()
        if args.pin_s3:  # before any thread starts: the uploaders' threads inherit it
            pinned = {"moto (S3)": cpus[:1], "bench process": cpus[1:]}
            assert s3srv.pid is not None
            os.sched_setaffinity(s3srv.pid, set(cpus[:1]))
            os.sched_setaffinity(0, set(cpus[1:]))
        try:
            settings = load(Settings, s3_endpoint=s3srv.url, s3_access_key="bench",
                            s3_secret_key="bench")
            s3 = s3_client(settings, max_pool=max(32, args.concurrency * 2))
            bucket = "bench-checkpoint"
            ensure_bucket(s3, bucket)
            source = root / "source"
            sizes = _write_checkpoint(source, size)
            mirror = Mirror(s3, MirrorConfig(bucket=bucket,
                                             multipart_threshold=args.part_mb * MiB,
                                             part_size=args.part_mb * MiB,
                                             concurrency=args.concurrency))
            tm = transfer_manager(s3, args.part_mb, args.concurrency)
            procs = {"bench process": saturation.this_process, "moto (S3)": s3srv.cpu_seconds}

            async def side(name: str, r: int) -> dict[str, Any]:
                if name != "raw":  # the trainer's work, not the mirror's: not metered
                    manifest = await asyncio.to_thread(ck.scan, source, "bench", r + 1)
                meter = saturation.Meter(procs).start()
                if name == "raw":
                    dt = await asyncio.to_thread(raw_upload, tm, bucket, source, f"raw/{r}")
                elif name == "verified":
                    dt = await asyncio.to_thread(verified_upload, tm, bucket, source,
                                                 f"verified/{r}", manifest)
                else:
                    dt = await asyncio.to_thread(_tandem, mirror, source, manifest)
                used = meter.stop()
                clear_bucket(s3, bucket)
                return {"s": dt, "cpu": used.json()}

            try:
                # Round 0 warms both up (page cache, moto, connection pools), not counted.
                await side("raw", -1)
                await side("verified", -1)
                await side("tandem", 0)
                runs = await stats.interleaved(args.repeat, {
                    "raw": lambda r: side("raw", r), "verified": lambda r: side("verified", r),
                    "tandem": lambda r: side("tandem", r + 1)})
            finally:
                mirror.close()
                tm.shutdown()
            hash_rate = saturation.crc32_mib_per_s()
            commit_s = await _written_to_committed(s3srv.url, nats.url, bucket, root,
                                                   args)
        finally:
            nats.stop()
            s3srv.stop()
            os.sched_setaffinity(0, set(cpus))
    raw_s = [x["s"] for x in runs["raw"]]
    tandem_s = [x["s"] for x in runs["tandem"]]
    mirror_fig = stats.Figure("mirror", "mirror throughput", "MiB/s",
                              [args.size_mb / t for t in tandem_s],
                              [args.size_mb / t for t in raw_s], "raw boto3 TransferManager",
                              goal=stats.Goal(">=", GOAL), digits=1,
                              notes=[f"S3 pinned: {pinned}"] if pinned else [])
    if mirror_fig.met is False:
        r = stats.median_run(range(args.repeat), lambda i: mirror_fig.ratio[i])  # type: ignore[index]
        mirror_fig.why = saturation.why(runs["tandem"][r]["cpu"], extra=[_hashing(
            args, hash_rate, tandem_s[r], runs["raw"][r]["cpu"])])
    verified_s = [x["s"] for x in runs["verified"]]
    same_work = stats.Figure(
        "mirror_same_check", "mirror throughput, against boto3 doing the same check",
        "MiB/s", [args.size_mb / t for t in tandem_s], [args.size_mb / t for t in verified_s],
        "boto3 TransferManager + each file's CRC32 against the manifest, beside it",
        digits=1, notes=["no goal of its own: the mirror's guarantee (every file as its "
                         "manifest says) on both sides"])
    committed = stats.Figure("written_to_committed", "checkpoint written -> committed", "s",
                             commit_s, notes=["no baseline and no goal: how long until a "
                                    "checkpoint may be loaded"])
    fj = stats.figures_json([mirror_fig, same_work, committed])
    m = fj["mirror"]
    return {
        "bench": "checkpoint",
        "size_mb": args.size_mb,
        "files": sizes,
        "part_mb": args.part_mb,
        "concurrency": args.concurrency,
        "repeat": args.repeat,
        "pinned": pinned,
        "raw_s": [round(x, 3) for x in raw_s],
        "tandem_s": [round(x, 3) for x in tandem_s],
        "verified_s": [round(x, 3) for x in verified_s],
        "verified_mb_s": fj["mirror_same_check"]["baseline"]["median"],
        "same_check_ratio": fj["mirror_same_check"]["ratio"]["median"],
        "raw_mb_s": m["baseline"]["median"],
        "tandem_mb_s": m["tandem"]["median"],
        "ratio": m["ratio"]["median"],
        "goal": GOAL,
        "written_to_committed_s": [round(x, 3) for x in commit_s],
        "written_to_committed_median_s": fj["written_to_committed"]["tandem"]["median"],
        "crc32_mib_per_s_one_core": round(hash_rate, 1),
        "cpu": {k: [x["cpu"] for x in v] for k, v in runs.items()},
        "figures": fj,
        "ok": stats.all_met(fj),
    }


def _hashing(args: argparse.Namespace, rate: float, took: float, raw_cpu: dict[str, Any]
             ) -> str:
    """The checksum's share, measured: each byte is checksummed once (CRC32, a part's for
    S3; the manifest's is combined from them), as boto3 does; beside it what the raw side
    cost the same processes."""
    pass_s = args.size_mb / rate
    raw = ", ".join(f"{n} {c:.2f}" for n, c in raw_cpu["cores"].items())
    return (f"checksums: one core computes CRC32 at {rate:,.0f} MiB/s, so the one pass "
            f"both sides make costs {pass_s:.2f} CPU-s of the {took:.2f} s the mirror took; "
            f"the raw side's cores: {raw}")


def render(r: dict[str, Any]) -> str:
    return "\n".join([
        f"checkpoint mirror, {r['size_mb']} MiB in {len(r['files'])} files, "
        f"{r['part_mb']} MiB parts x {r['concurrency']}, {r['repeat']} repeats interleaved",
        f"  raw boto3 transfer    : {r['raw_mb_s']:8.1f} MiB/s median  {r['raw_s']} s",
        f"  boto3 + CRC32 check   : {r['verified_mb_s']:8.1f} MiB/s median  {r['verified_s']} s",
        f"  tandem mirror+verify  : {r['tandem_mb_s']:8.1f} MiB/s median  {r['tandem_s']} s",
        f"  ratio                 : {r['ratio']:.3f} median of the repeats' ratios "
        f"(goal >= {r['goal']})",
        f"  ratio, same check     : {r['same_check_ratio']:.3f} median (no goal)",
        f"  written -> committed  : {r['written_to_committed_median_s']:.3f} s median "
        f"{r['written_to_committed_s']}",
        f"  one core computes CRC32 at {r['crc32_mib_per_s_one_core']:,.0f} MiB/s",
        *([f"  CPUs pinned            : {r['pinned']}"] if r.get("pinned") else []),
    ])
