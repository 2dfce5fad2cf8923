"""``tandem checkpoints``: list a run's committed checkpoints in S3, restore one verified.

S3 settings come from the environment (``TANDEM_S3_ENDPOINT``, ``TANDEM_S3_BUCKET``,
credentials), as for the services; ``--bucket`` overrides the bucket. A run that rolled
back has checkpoints of several lineages (``step-<N>-l<L>``): ``list`` shows every one
with its lineage, ``restore`` takes the history ``--forks`` names (the run record's
``forks``; ``tandem train status`` shows them), lineage 0's without it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoints", help="list and restore a run's checkpoints in S3",
                       description="Only committed checkpoints (manifest.json stored) are "
                       "listed or restored; every restored file is checked against the "
                       "manifest's checksum.")
    csub = p.add_subparsers(dest="action", metavar="<action>", required=True)

    ls = csub.add_parser("list", help="committed checkpoints of a run, oldest first")
    ls.add_argument("run", help="run id")
    ls.add_argument("--bucket", help="S3 bucket (default: TANDEM_S3_BUCKET)")
    ls.add_argument("--all", action="store_true",
                    help="also show steps with files but no manifest (not committed)")
    ls.add_argument("--json", action="store_true", help="print one JSON object")
    ls.set_defaults(func=_list)

    rs = csub.add_parser("restore", help="download and verify a checkpoint",
                         description="Download the newest committed checkpoint (or --step) "
                         "into OUTPUT/step-<N>/, verifying every file; a corrupt one is "
                         "skipped for the previous committed checkpoint.")
    rs.add_argument("run", help="run id")
    rs.add_argument("--step", type=int, help="step to restore (default: the newest)")
    rs.add_argument("-o", "--output", default=".", help="directory to restore into")
    rs.add_argument("--bucket", help="S3 bucket (default: TANDEM_S3_BUCKET)")
    rs.add_argument("--no-fallback", action="store_true",
                    help="fail instead of falling back to an older checkpoint")
    rs.add_argument("--forks", type=_forks, default=(), metavar="STEPS",
                    help="the run's forks (its record's, comma-separated): restore from "
                    "the current lineage's history (default: lineage 0's)")
    rs.set_defaults(func=_restore)


def _forks(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--forks takes comma-separated steps, not "
                                         f"{text!r}") from None


def _client(args: argparse.Namespace) -> tuple[object, str]:
    """The S3 client and the bucket, which must exist (else the command ends, saying so:
    an empty listing would read as a run without checkpoints)."""
    from botocore.exceptions import ClientError

    from tandem.common.settings import Settings, load
    from tandem.common.storage import s3_client

    settings = load(Settings, "tandem checkpoints")
    s3, bucket = s3_client(settings), args.bucket or settings.s3_bucket
    try:
        s3.head_bucket(Bucket=bucket)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") not in ("404", "NoSuchBucket", "NotFound"):
            raise
        raise SystemExit(f"tandem checkpoints: bucket {bucket!r} does not exist at "
                         f"{settings.s3_endpoint or 'S3'} (--bucket or TANDEM_S3_BUCKET)") from None
    return s3, bucket


def _list(args: argparse.Namespace) -> int:
    from tandem.common import checkpoints as ck
    from tandem.common.errors import CheckpointError

    s3, bucket = _client(args)
    rows = []
    for (step, lineage), committed in ck.list_checkpoints(s3, bucket, args.run).items():
        uri = ck.checkpoint_uri(bucket, args.run, step, lineage)
        if not committed:
            if args.all:
                rows.append({"step": step, "lineage": lineage, "committed": False,
                             "uri": uri})
            continue
        row: dict[str, object] = {"step": step, "lineage": lineage, "committed": True,
                                  "uri": uri}
        try:
            m = ck.read_manifest(s3, bucket, args.run, step, lineage)
            row.update(files=len(m.files), bytes=sum(f.size for f in m.files),
                       created_at=m.created_at)
        except CheckpointError as exc:
            row["error"] = exc.reason
        rows.append(row)
    if args.json:
        print(json.dumps({"run_id": args.run, "bucket": bucket, "checkpoints": rows}))
        return 0
    if not rows:
        print(f"{args.run}: no committed checkpoints in s3://{bucket}/")
        return 0
    print(f"{'STEP':>10}  {'LINEAGE':>7}  {'FILES':>5}  {'SIZE':>10}  {'CREATED (UTC)':<19}  URI")
    for r in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(float(r["created_at"]))) \
            if "created_at" in r else ("not committed" if not r["committed"] else "?")
        size = f"{int(r['bytes']) / 2**20:.1f} MiB" if "bytes" in r else "-"
        note = f"  ({r['error']})" if "error" in r else ""
        print(f"{r['step']:>10}  {r['lineage']:>7}  {r.get('files', '-'):>5}  {size:>10}  "
              f"{created:<19}  {r['uri']}{note}")
    return 0


def _restore(args: argparse.Namespace) -> int:
    from tandem.common import checkpoints as ck
    from tandem.common.errors import CheckpointNotFound

    s3, bucket = _client(args)

    def skipped(step: int, reason: str) -> None:
        print(f"skipped step {step}: {reason}", file=sys.stderr)

    t = time.perf_counter()
    try:
        r = ck.restore(s3, bucket, args.run, Path(args.output), step=args.step,
                       fallback=not args.no_fallback, on_skip=skipped,
                       line=ck.Lineage.of(args.forks))
    except CheckpointNotFound as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 1
    dt = time.perf_counter() - t
    print(f"restored {ck.step_name(r.step, r.lineage)} of {args.run}: "
          f"{len(r.manifest.files)} files, "
          f"{r.bytes / 2**20:.1f} MiB verified in {dt:.2f}s -> {r.path}")
    return 0
