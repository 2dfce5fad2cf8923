"""``tandem bench all``: every benchmark once, in sequence, into one JSON and one table.

Each benchmark runs with its own defaults (``--smoke``: with its smallest settings, to see
that all of them run, not to measure), ``--repeat`` applying to all. One failing
benchmark is recorded (``error``) and the rest still run. The JSON holds, beside each
benchmark's own result, when it was measured, on what (CPUs, memory, the commit) and how
long each took; the Markdown table (``stats.markdown``) is the one a README quotes.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def register(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("all", help="every benchmark once, in sequence: one JSON, one table",
                        description="Runs every benchmark in sequence (each with its own "
                        "defaults) and writes one JSON and a Markdown table: figure, "
                        "baseline, ratio, spread, goal, met.")
    p.add_argument("--repeat", type=int, default=None, metavar="N",
                   help="repeats for every benchmark (default: each one's own default)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the JSON to FILE (no FILE: print it instead of the text)")
    p.add_argument("--markdown", default=None, metavar="FILE",
                   help="write the Markdown table to FILE")
    p.add_argument("--only", default="", help="comma-separated benchmarks to run")
    p.add_argument("--skip", default="", help="comma-separated benchmarks not to run")
    p.add_argument("--smoke", action="store_true",
                   help="each benchmark at its smallest settings: shows they run, measures "
                   "nothing worth quoting")
    p.set_defaults(func=run)


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    commit = ""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=False).stdout.strip()
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "memory_gib": round(mem / 2**30, 1),
            "machine": platform.machine(), "system": platform.platform(),
            "python": platform.python_version(), "commit": commit,
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def selected(only: str, skip: str) -> list[str]:
    from tandem.cli.bench import BENCHES

    names = [n.strip() for n in only.split(",") if n.strip()] or list(BENCHES)
    unknown = [n for n in names + [s.strip() for s in skip.split(",") if s.strip()]
               if n not in BENCHES]
    if unknown:
        raise SystemExit(f"tandem bench all: unknown benchmarks {unknown}; "
                         f"known: {', '.join(BENCHES)}")
    return [n for n in names if n not in {s.strip() for s in skip.split(",")}]


def bench_args(mod: Any, name: str, repeat: int | None, smoke: bool) -> argparse.Namespace:
    """The namespace ``tandem bench <name>`` would parse: its defaults, its ``SMOKE``
    settings when asked, ``--repeat`` when given."""
    p = argparse.ArgumentParser(prog=f"tandem bench {name}")
    p.add_argument("--json", action="store_true")
    mod.add_arguments(p)
    argv = list(getattr(mod, "SMOKE", ())) if smoke else []
    if repeat is not None:
        argv += ["--repeat", str(repeat)]
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    from tandem.cli.bench import BENCHES, render, run_bench, stats

    names = selected(args.only, args.skip)
    # With --json and no file, stdout is the JSON; everything else goes to stderr.
    out = sys.stderr if args.json == "-" else sys.stdout
    started = datetime.datetime.now(datetime.UTC)
    results: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    for name in names:
        print(f"== tandem bench {name} ==", file=out, flush=True)
        t0 = time.perf_counter()
        try:
            mod = importlib.import_module(BENCHES[name])
            result = run_bench(mod, bench_args(mod, name, args.repeat, args.smoke))
            print(render(mod, result), file=out, flush=True)
        except Exception as exc:  # report it and go on with the next benchmark
            result = {"error": repr(exc), "ok": False}
            print(f"tandem bench {name}: failed: {exc!r}", file=out, flush=True)
        seconds[name] = round(time.perf_counter() - t0, 1)
        results[name] = result
    report = {
        "date": started.isoformat(timespec="seconds"), "machine": machine(),
        "repeat": args.repeat, "smoke": args.smoke, "seconds": seconds,
        "benches": results,
        "met": {name: stats.all_met(r.get("figures", {})) if "error" not in r else None
                for name, r in results.items()},
    }
    table = table_markdown(report)
    if args.json == "-":
        print(json.dumps(report))
    elif args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(table)
    print(table, file=out)
    return 0 if all(r.get("ok", True) for r in results.values()) else 1


def table_markdown(report: dict[str, Any]) -> str:
    """The table with a line above it saying when, on what and how it was measured."""
    from tandem.cli.bench import stats

    m = report["machine"]
    head = (f"Measured {report['date'][:10]} on {m['cpus']} CPUs, {m['memory_gib']} GiB "
            f"({m['machine']}, Python {m['python']}, commit {m['commit'] or 'unknown'}, load "
            f"average {m['load_avg_1m']} at the start); "
            + (f"{report['repeat']} repeat{'s' * (report['repeat'] != 1)} each" if report["repeat"]
               else "each bench's default repeats")
            + (" (smoke settings: not figures to quote)" if report["smoke"] else "")
            + "; median [min-max], goals judged on the median.\n\n")
    return head + stats.markdown(report["benches"])
