"""checkpoint mirror against raw boto3 upload_file, and checkpoint written -> committed.

Starts moto's S3 server and a nats-server on free loopback ports. One synthetic
checkpoint (``--size-mb``, split like a real one: optimizer state half, model and EMA
weights a quarter each, plus small RNG/data-position files) is uploaded, alternating
rounds, by:

- raw: boto3 ``upload_file`` of each file in turn, with a ``TransferConfig`` of the same
  multipart threshold, part size and concurrency (boto3's own CRC checksums);
- tandem: the checkpointer's ``Mirror``: SHA-256 sent with every part and file, the
  whole file hashed and compared with the manifest, what S3 stored verified (composite
  checksum for multipart files, read-back for single-request ones, as moto does not
  check checksums), then the manifest put with ``If-None-Match: *``.

A first round warms both up and is not counted; then the sides alternate which goes
first, and the median round of each counts. Then the checkpointer service runs against
NATS: a ``CheckpointWritten`` event is published and the time until
``ckpt.<run>.mirrored`` arrives is measured (median of ``--commits``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

GOAL = 0.8
MiB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mb", type=int, default=256, help="checkpoint size in MiB")
    p.add_argument("--rounds", type=int, default=5, help="rounds per side (median counts)")
    p.add_argument("--commits", type=int, default=3, help="written -> committed samples")
    p.add_argument("--part-mb", type=int, default=16, help="part size and threshold, MiB")
    p.add_argument("--concurrency", type=int, default=8, help="parts uploaded at once")


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


def _clear(s3: Any, bucket: str) -> None:
    paginator = s3.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


def _raw(s3: Any, bucket: str, directory: Path, prefix: str, args: argparse.Namespace) -> float:
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_threshold=args.part_mb * MiB,
                         multipart_chunksize=args.part_mb * MiB,
                         max_concurrency=args.concurrency)
    t = time.perf_counter()
    for path in sorted(directory.iterdir()):
        s3.upload_file(str(path), bucket, f"{prefix}/{path.name}", Config=cfg)
    return time.perf_counter() - t


def _tandem(mirror: Any, directory: Path, run: str, step: int) -> float:
    from tandem.common import checkpoints as ck

    manifest = ck.scan(directory, run, step)  # the trainer's work, not the mirror's
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
            step_dir = directory / ck.step_name(step)
            step_dir.mkdir()
            for f in (directory / "source").iterdir():
                os.link(f, step_dir / f.name)
            manifest = ck.scan(step_dir, run, step)
            ev = CheckpointWritten(run_id=run, step=step, path=str(step_dir), manifest=manifest)
            await bus.publish(subjects.train(run, "checkpoint"), ev)
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
    from tandem.common.settings import Settings, load
    from tandem.common.storage import ensure_bucket, s3_client

    size = args.size_mb * MiB
    with tempfile.TemporaryDirectory(prefix="tandem-bench-ckpt-") as tmp:
        root = Path(tmp)
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        s3srv = S3Server(name="s3", log_path=root / "s3.log").start()
        nats = NatsServer(name="bench", log_path=root / "nats.log",
                          store_dir=root / "js").start()
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
            raw_s: list[float] = []
            tandem_s: list[float] = []
            try:
                # Round 0 warms both up (page cache, moto, connection pools) and is not
                # counted; after it the sides alternate which goes first.
                for r in range(args.rounds + 1):
                    sides = ["raw", "tandem"] if r % 2 == 0 else ["tandem", "raw"]
                    for side in sides:
                        if side == "raw":
                            dt = await asyncio.to_thread(_raw, s3, bucket, source,
                                                         f"raw/{r}", args)
                        else:
                            dt = await asyncio.to_thread(_tandem, mirror, source, "bench",
                                                         r + 1)
                        if r:
                            (raw_s if side == "raw" else tandem_s).append(dt)
                        _clear(s3, bucket)
            finally:
                mirror.close()
            commit_s = await _written_to_committed(s3srv.url, nats.url, bucket, root,
                                                   args)
        finally:
            nats.stop()
            s3srv.stop()
    raw_mb_s = size / MiB / statistics.median(raw_s)
    tandem_mb_s = size / MiB / statistics.median(tandem_s)
    ratio = tandem_mb_s / raw_mb_s
    return {
        "bench": "checkpoint",
        "size_mb": args.size_mb,
        "files": sizes,
        "part_mb": args.part_mb,
        "concurrency": args.concurrency,
        "rounds": args.rounds,
        "raw_s": [round(x, 3) for x in raw_s],
        "tandem_s": [round(x, 3) for x in tandem_s],
        "raw_mb_s": round(raw_mb_s, 1),
        "tandem_mb_s": round(tandem_mb_s, 1),
        "ratio": round(ratio, 3),
        "goal": GOAL,
        "written_to_committed_s": [round(x, 3) for x in commit_s],
        "written_to_committed_median_s": round(statistics.median(commit_s), 3),
        "ok": ratio >= GOAL,
    }


def render(r: dict[str, Any]) -> str:
    verdict = "meets" if r["ok"] else "MISSES"
    return "\n".join([
        f"checkpoint mirror, {r['size_mb']} MiB in {len(r['files'])} files, "
        f"{r['part_mb']} MiB parts x {r['concurrency']}, median of {r['rounds']} rounds",
        f"  raw boto3 upload_file : {r['raw_mb_s']:8.1f} MiB/s  {r['raw_s']}",
        f"  tandem mirror+verify  : {r['tandem_mb_s']:8.1f} MiB/s  {r['tandem_s']}",
        f"  ratio                 : {r['ratio']:.3f} ({verdict} the goal of {r['goal']})",
        f"  written -> committed  : {r['written_to_committed_median_s']:.3f} s median "
        f"{r['written_to_committed_s']}",
    ])
