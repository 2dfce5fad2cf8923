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

from tandem.cli.bench.stats import positive_int

# Where `--readmes` writes: the whole table in README.md, each service's rows in its own.
BEGIN, END = "<!-- tandem bench all: begin -->", "<!-- tandem bench all: end -->"
SERVICE_BENCHES = {
    "gateway": ("serve", "failover", "scale"),
    "inference-worker": ("serve",),
    "checkpointer": ("checkpoint",),
    "trainer": ("train", "train-sharded"),
    "cluster-agent": ("agent", "scale"),
}


def register(bsub: argparse._SubParsersAction) -> None:
    p = bsub.add_parser("all", help="every benchmark once, in sequence: one JSON, one table",
                        description="Runs every benchmark in sequence (each with its own "
                        "defaults) and writes one JSON and a Markdown table: figure, "
                        "baseline, ratio, spread, goal, met.")
    p.add_argument("--repeat", type=positive_int, default=None, metavar="N",
                   help="repeats for every benchmark (default: each one's own default)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                   help="write the JSON to FILE (no FILE: print it instead of the text)")
    p.add_argument("--markdown", default=None, metavar="FILE",
                   help="write the Markdown table to FILE")
    p.add_argument("--only", default="", help="comma-separated benchmarks to run")
    p.add_argument("--skip", default="", help="comma-separated benchmarks not to run")
    p.add_argument("--from", dest="from_json", nargs="+", default=None, metavar="FILE",
                   help="run nothing: take the figures from the JSON an earlier run wrote "
                   "(several: one table of them all, e.g. of benches run one at a time; a "
                   "bench in more than one is an error)")
    p.add_argument("--readmes", nargs="?", const=".", default=None, metavar="ROOT",
                   help="write the table into ROOT's README.md and each service's README "
                   f"(its own benches' rows) between the lines {BEGIN!r} and {END!r}")
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
    if args.from_json:
        return _publish(merged([Path(f) for f in args.from_json]), args, sys.stdout)
    return _measure(args)


def merged(paths: list[Path]) -> dict[str, Any]:
    """One report of the reports at ``paths`` (``bench all`` runs of different benches on
    one machine): its date the earliest, the load averages of every start, each run's
    date and commit kept per bench. Two runs of one bench, or runs of different commits,
    settings or machines, are refused: a table must not mix what it cannot compare."""
    reports = [json.loads(p.read_text()) for p in paths]
    if len(reports) == 1:
        return reports[0]
    out = dict(min(reports, key=lambda r: r["date"]))
    out["benches"], out["seconds"], out["met"], out["dates"] = {}, {}, {}, {}
    same = ("cpus", "memory_gib", "machine", "python", "commit")
    for path, r in zip(paths, reports, strict=True):
        for key in same:
            if r["machine"].get(key) != out["machine"].get(key):
                raise SystemExit(f"tandem bench all --from: {path} was measured with "
                                 f"{key} {r['machine'].get(key)!r}, another file with "
                                 f"{out['machine'].get(key)!r}: not one table")
        if (r["repeat"], r["smoke"]) != (out["repeat"], out["smoke"]):
            raise SystemExit(f"tandem bench all --from: {path} has other settings (repeat "
                             f"{r['repeat']}, smoke {r['smoke']}) than {paths[0]}")
        twice = set(r["benches"]) & set(out["benches"])
        if twice:
            raise SystemExit(f"tandem bench all --from: {sorted(twice)} in more than one file")
        out["benches"].update(r["benches"])
        out["seconds"].update(r["seconds"])
        out["met"].update(r["met"])
        out["dates"].update(dict.fromkeys(r["benches"], r["date"]))
    loads = [r["machine"]["load_avg_1m"] for r in reports]
    out["machine"] = {**out["machine"], "load_avg_1m": min(loads),
                      "load_avg_1m_max": max(loads)}
    return out


def _measure(args: argparse.Namespace) -> int:
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
    if args.json == "-":
        print(json.dumps(report))
    elif args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return _publish(report, args, out)


def _publish(report: dict[str, Any], args: argparse.Namespace, out: Any) -> int:
    table = table_markdown(report)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.readmes:
        for path in write_readmes(report, Path(args.readmes)):
            print(f"figures written into {path}", file=out)
    print(table, file=out)
    return 0 if all(r.get("ok", True) for r in report["benches"].values()) else 1


def write_readmes(report: dict[str, Any], root: Path) -> list[Path]:
    """Put the table between the bench markers of ``root``'s README.md and each service's
    README (only the rows of its benches). A README without the markers is an error
    naming it: nothing is written until every one has them."""
    from tandem.common.errors import TandemError

    targets = {root / "README.md": None}
    targets.update({root / "services" / svc / "README.md": names
                    for svc, names in SERVICE_BENCHES.items()})
    texts: dict[Path, str] = {}
    for path, names in targets.items():
        text = path.read_text() if path.is_file() else ""
        if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
            raise TandemError(f"{path}: needs one line {BEGIN!r} and, below it, one {END!r}")
        head, rest = text.split(BEGIN)
        tail = rest.split(END)[1]
        texts[path] = f"{head}{BEGIN}\n{table_markdown(report, names)}{END}{tail}"
    for path, text in texts.items():
        path.write_text(text)
    return list(texts)


def table_markdown(report: dict[str, Any], only: tuple[str, ...] | None = None) -> str:
    """The table (of the benches ``only`` names, or all) with a line above it saying
    when, on what and how it was measured."""
    from tandem.cli.bench import stats

    m = report["machine"]
    head = (f"Measured {report['date'][:10]} on {m['cpus']} CPUs, {m['memory_gib']} GiB "
            f"({m['machine']}, Python {m['python']}, commit {m['commit'] or 'unknown'}, load "
            f"average {m['load_avg_1m']}"
            + (f"-{m['load_avg_1m_max']} at the starts of the benches, each run on its "
               f"own, started {report['date'][11:16]}-{max(report['dates'].values())[11:16]}"
               " UTC); "
               if "load_avg_1m_max" in m else " at the start); ")
            + (f"{report['repeat']} repeat{'s' * (report['repeat'] != 1)} each" if report["repeat"]
               else "each bench's default repeats")
            + (" (smoke settings: not figures to quote)" if report["smoke"] else "")
            + "; median [min-max], goals judged on the median.\n\n")
    benches = {n: r for n, r in report["benches"].items() if only is None or n in only}
    return head + stats.markdown(benches)
