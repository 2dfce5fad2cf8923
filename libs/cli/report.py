"""The demo's report: one HTML page and its PNGs, drawn from ``demo.json``.

``write_report(out)`` reads ``<out>/demo.json`` (written by ``tandem demo``) and the grid
images under ``<out>/images/``, and writes ``<out>/report.html`` with ``loss.png``,
``grid.png``, ``gpus.png``, ``failover.png`` and ``goodput.png``. Every axis names its
unit; times are seconds since the demo started. ``tandem report <out>`` redraws it.
matplotlib is imported here only (the ``demo`` extra), never by a service.
"""

from __future__ import annotations

import argparse
import html
import itertools
import json
import sys
from pathlib import Path
from typing import Any

CLUSTER_COLORS = {"east": "#1f77b4", "west": "#ff7f0e"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="redraw a demo's HTML report from its demo.json",
                       description="Read <out>/demo.json (written by `tandem demo`) and "
                       "write <out>/report.html with its PNGs: loss curve, grid, GPU "
                       "telemetry, failover timeline, goodput.")
    p.add_argument("out", type=Path, nargs="?", default=Path("out/demo"),
                   help="the demo's output folder (default out/demo)")
    p.set_defaults(func=_report)


def _report(args: argparse.Namespace) -> int:
    if not (args.out / "demo.json").exists():
        print(f"tandem report: no demo.json in {args.out}; run `tandem demo --out {args.out}` "
              "first")
        return 2
    try:
        print(write_report(args.out).resolve())
    except (ValueError, KeyError, TypeError) as exc:
        # ValueError: not JSON; the rest: JSON, but not what `tandem demo` writes
        why = f"no {exc}" if isinstance(exc, KeyError) else str(exc)
        print(f"tandem report: {args.out / 'demo.json'} is not a demo record ({why}); run "
              f"`tandem demo --out {args.out}` again", file=sys.stderr)
        return 2
    return 0


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _color(cluster: str) -> str:
    return CLUSTER_COLORS.get(cluster, "#2ca02c")


# ----------------------------------------------------------------------------- figures


def loss_figure(rec: dict[str, Any], path: Path) -> bool:
    steps = rec.get("steps") or []
    if not steps:
        return False
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 1.3]})
    attempts = sorted({int(s[5]) for s in steps})
    for att in attempts:
        rows = [s for s in steps if int(s[5]) == att]
        ax.plot([r[0] for r in rows], [r[1] for r in rows], lw=0.8,
                label=f"attempt {att}" if len(attempts) > 1 else "loss")
        ax2.plot([r[0] for r in rows], [r[2] * 1000 for r in rows], lw=0.6)
    ax.set_yscale("log")
    ax.set_ylabel("loss (MSE of predicted noise, log scale)")
    ax2.set_ylabel("step time (ms)")
    ax2.set_xlabel("training step (optimizer steps)")
    mirrored = {m["step"] for m in rec.get("mirrored") or []}
    for i, c in enumerate(rec.get("checkpoints") or []):
        committed = c["step"] in mirrored
        ax.axvline(c["step"], color="green" if committed else "gray", ls="--", lw=0.8,
                   label=("checkpoint (committed in S3)" if committed
                          else "checkpoint (written)") if i == 0 else None)
    for i, inc in enumerate(rec.get("incidents") or []):
        x = inc.get("step") or 0
        ax.axvline(x, color="red", lw=1.5, label="incident" if i == 0 else None)
        ax.annotate(str(inc.get("kind", "incident")), (x, ax.get_ylim()[1]), color="red",
                    fontsize=8, rotation=90, va="top", ha="right")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(f"Training run {rec['run_id']}: loss per step")
    ax.grid(alpha=0.3)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def grid_figure(rec: dict[str, Any], images: Path, path: Path) -> bool:
    files = sorted(images.glob("digit*-*.png")) if images.exists() else []
    if not files:
        return False
    import numpy as np
    from PIL import Image

    plt = _plt()
    cells: dict[int, dict[int, Any]] = {}
    for f in files:
        digit, index = f.stem[len("digit"):].split("-")
        cells.setdefault(int(digit), {})[int(index)] = np.asarray(Image.open(f).convert("L"))
    cols = max(len(v) for v in cells.values())
    fig, axes = plt.subplots(10, cols, figsize=(max(cols * 0.8 + 0.8, 5.5), 8.6),
                             squeeze=False)
    for d in range(10):
        for i in range(cols):
            ax = axes[d][i]
            ax.set_xticks([])
            ax.set_yticks([])
            img = cells.get(d, {}).get(i)
            if img is not None:
                ax.imshow(img, cmap="gray", vmin=0, vmax=255, interpolation="nearest")
            if i == 0:
                ax.set_ylabel(str(d), rotation=0, labelpad=12, fontsize=12, va="center")
    steps = (rec.get("serving", {}).get("grid") or {}).get("checkpoint_steps") or []
    where = ", ".join(f"step {s}" for s in steps) or "unknown step"
    fig.suptitle(f"Generated over HTTP by run {rec['run_id']}, checkpoint {where}\n"
                 f"(rows: class label 0-9; {rec['plan'].get('sample_steps')} DDPM steps, "
                 "16x16 px)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def gpu_figure(rec: dict[str, Any], path: Path) -> bool:
    tel = rec.get("telemetry") or {}
    if not tel:
        return False
    plt = _plt()
    t0 = rec["started_at"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    for name, rows in sorted(tel.items()):
        cluster = name.split("/")[0]
        ls = "-" if name.endswith("gpu0") else ":"
        for ax, col in zip(axes, (1, 2, 3), strict=True):
            xs, ys = _with_gaps(rows, col, t0)
            ax.plot(xs, ys, ls, color=_color(cluster), lw=0.9, label=name)
    for ax, label in zip(axes, ("utilization (%)", "temperature (°C)", "power (W)"),
                         strict=True):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        _mark_failover(ax, rec)
    axes[0].legend(fontsize=7, ncol=2, loc="upper left")
    axes[-1].set_xlabel("time since the demo started (s)")
    axes[0].set_title("Simulated GPU telemetry per node (from the cluster agents)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _with_gaps(rows: list[list[float]], col: int, t0: float) -> tuple[list[float], list[float]]:
    """x, y with a break wherever samples stop (a killed agent), not a line across it."""
    xs: list[float] = []
    ys: list[float] = []
    gaps = sorted(b[0] - a[0] for a, b in itertools.pairwise(rows))
    usual = gaps[len(gaps) // 2] if gaps else 1.0
    for i, r in enumerate(rows):
        if i and r[0] - rows[i - 1][0] > 3 * usual:
            xs.append(float("nan"))
            ys.append(float("nan"))
        xs.append(r[0] - t0)
        ys.append(r[col] if r[col] >= 0 else float("nan"))
    return xs, ys


def _mark_failover(ax: Any, rec: dict[str, Any]) -> None:
    f = rec.get("failover") or {}
    if f.get("killed_at"):
        ax.axvline(f["killed_at"] - rec["started_at"], color="red", lw=1.2,
                   label=f"{f.get('cluster')} killed")
    if f.get("restarted_at"):
        ax.axvline(f["restarted_at"] - rec["started_at"], color="purple", lw=1, ls="--",
                   label=f"{f.get('cluster')} restarted")


def failover_figure(rec: dict[str, Any], path: Path) -> bool:
    gens = [g for g in rec.get("generations") or [] if g.get("started_at")]
    if not gens:
        return False
    plt = _plt()
    t0 = rec["started_at"]
    gens.sort(key=lambda g: (g["created_at"] or 0, g["id"]))
    fig, ax = plt.subplots(figsize=(9, max(3.0, 0.16 * len(gens) + 1.5)))
    stranded = set((rec.get("failover") or {}).get("stranded_ids") or [])
    for y, g in enumerate(gens):
        # The last start is the one that finished it (a stranded task started again
        # elsewhere); earlier starts show as dots.
        starts = [x["at"] for x in g.get("starts") or []] or [g["started_at"]]
        start = max(starts) - t0
        end = (g["finished_at"] or max(starts)) - t0
        queued = (g["created_at"] or g["started_at"]) - t0
        ax.plot([queued, start], [y, y], color="lightgray", lw=2)
        ax.barh(y, max(end - start, 0.05), left=start,
                color=_color(g.get("ran_on") or g["cluster"]),
                edgecolor="black" if g["id"] in stranded else "none", height=0.8)
        for x in starts[:-1]:
            ax.plot([x - t0], [y], "k.", ms=3)
    _mark_failover(ax, rec)
    from matplotlib.patches import Patch

    handles, _ = ax.get_legend_handles_labels()
    handles += [Patch(color=_color(c), label=f"ran on {c}")
                for c in sorted({g.get("ran_on") or g["cluster"] for g in gens})]
    handles += [Patch(color="lightgray", label="queued")]
    ax.set_yticks([])
    ax.set_ylabel(f"generation tasks ({len(gens)}); outlined: stranded by the kill")
    ax.set_xlabel("time since the demo started (s)")
    f = rec.get("failover") or {}
    title = "Generation tasks: queue wait and run time per cluster"
    if f.get("failover_s") is not None:
        title += f"\nfailover {f['failover_s']:.1f}s: cluster death -> first stranded task " \
                 "started elsewhere"
    ax.set_title(title, fontsize=10)
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def goodput_figure(rec: dict[str, Any], path: Path) -> bool:
    g = (rec.get("run") or {}).get("goodput") or {}
    parts = {"productive": g.get("productive_s", 0.0)}
    parts.update({k[len("badput_"):-2].replace("_", " "): v for k, v in g.items()
                  if k.startswith("badput_") and k.endswith("_s") and v > 0})
    if not g or sum(parts.values()) <= 0:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 2.4))
    left = 0.0
    colors = ["#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"]
    for (name, secs), color in zip(parts.items(), colors * 3, strict=False):
        ax.barh(0, secs, left=left, color=color, label=f"{name} {secs:.1f}s")
        left += secs
    ax.set_yticks([])
    ax.set_xlabel("seconds of the run's wall-clock time")
    ax.set_title(f"Goodput {g.get('goodput', 0.0):.1%}: productive training time out of "
                 f"{g.get('elapsed_s', left):.1f}s elapsed", fontsize=10)
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.45))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -------------------------------------------------------------------------------- page


def figures(rec: dict[str, Any]) -> list[tuple[str, str]]:
    """The run's figures as (label, value) rows, all with units."""
    run = rec.get("run") or {}
    steps = rec.get("steps") or []
    rows: list[tuple[str, str]] = [("run", rec["run_id"]),
                                   ("state", str(run.get("state", "-")))]
    if steps:
        times = sorted(s[2] for s in steps)
        sps = sorted(s[3] for s in steps)
        rows += [("steps trained", f"{run.get('latest_step', steps[-1][0])}"),
                 ("final loss (mean of last 20 steps)",
                  f"{sum(s[1] for s in steps[-20:]) / len(steps[-20:]):.4f}"),
                 ("step time, median / p95", f"{times[len(times) // 2] * 1000:.0f} ms / "
                  f"{times[int(len(times) * 0.95)] * 1000:.0f} ms"),
                 ("throughput, median", f"{sps[len(sps) // 2]:.0f} samples/s")]
    rows.append(("restarts", str(run.get("restarts", 0))))
    ck = rec.get("checkpoints") or []
    if ck:
        blocked = sorted(c["blocked_s"] for c in ck)
        rows += [("checkpoints written / committed in S3",
                  f"{len(ck)} / {len(rec.get('mirrored') or [])}"),
                 ("training blocked per checkpoint, median / max",
                  f"{blocked[len(blocked) // 2] * 1000:.1f} ms / {blocked[-1] * 1000:.1f} ms"),
                 ("checkpoint size", f"{ck[-1]['bytes'] / 1e6:.2f} MB")]
    mir = rec.get("mirrored") or []
    if mir:
        secs = sorted(m["seconds"] for m in mir)
        rows.append(("written -> committed in S3, median", f"{secs[len(secs) // 2]:.2f} s"))
    g = run.get("goodput") or {}
    if g:
        rows.append(("goodput", f"{g.get('goodput', 0.0):.1%} ({g.get('productive_s', 0):.1f} s "
                     f"productive of {g.get('elapsed_s', 0):.1f} s)"))
    gens = [x for x in rec.get("generations") or [] if x["state"] == "succeeded"]
    if gens:
        lat = sorted((x["finished_at"] - x["created_at"]) for x in gens
                     if x["finished_at"] and x["created_at"])
        images = sum(x["num_images"] for x in gens)
        rows += [("generations succeeded", f"{len(gens)} tasks, {images} images"),
                 ("generation latency (queued -> done), median / max",
                  f"{lat[len(lat) // 2]:.2f} s / {lat[-1]:.2f} s" if lat else "-")]
    for cluster, s in sorted((rec.get("serving") or {}).items()):
        if cluster != "grid":
            rows.append((f"{cluster} serves", f"{s.get('checkpoint') or '-'} "
                         f"(worker {s.get('worker') or '-'})"))
    f = rec.get("failover") or {}
    if f:
        rows += [("cluster killed", f"{f['cluster']} ({', '.join(f.get('processes', []))})"),
                 ("its tasks unfinished at the kill", str(f.get("stranded", 0))),
                 ("failover time (death -> first stranded task started elsewhere)",
                  f"{f['failover_s']:.2f} s" if f.get("failover_s") is not None
                  else "no failover: finished after a restart"),
                 ("stranded backlog finished elsewhere / after restart",
                  f"{f.get('finished_elsewhere', 0)} / {f.get('finished_after_restart', 0)}"),
                 ("stranded backlog done after", f"{f.get('backlog_done_s', 0):.1f} s")]
    if rec.get("finished_at"):
        rows.append(("demo wall time", f"{rec['finished_at'] - rec['started_at']:.0f} s"))
    return rows


def write_report(out: Path) -> Path:
    """Draw every figure the record allows and write ``<out>/report.html``; return it."""
    rec = json.loads((out / "demo.json").read_text())
    drawn = {
        "loss.png": loss_figure(rec, out / "loss.png"),
        "grid.png": grid_figure(rec, out / "images", out / "grid.png"),
        "gpus.png": gpu_figure(rec, out / "gpus.png"),
        "failover.png": failover_figure(rec, out / "failover.png"),
        "goodput.png": goodput_figure(rec, out / "goodput.png"),
    }
    e = html.escape

    def img(name: str, alt: str) -> str:
        if drawn[name]:
            return f'<img src="{name}" alt="{e(alt)}">'
        return f"<p class=none>No data for this figure ({e(alt)}).</p>"

    results = "".join(
        f"<tr class={e(r['status'])}><td>{e(r['phase'])}</td><td>{e(r['status'])}</td>"
        f"<td>{r['seconds']:g} s</td><td>{e(r['detail'])}</td></tr>"
        for r in rec.get("results") or [])
    figs = "".join(f"<tr><td>{e(k)}</td><td>{e(v)}</td></tr>" for k, v in figures(rec))
    t0 = rec["started_at"]
    timeline = "".join(f"<tr><td>{at - t0:7.1f} s</td><td>{e(text)}</td></tr>"
                       for at, text in rec.get("timeline") or [])
    incidents = "".join(
        f"<tr><td>{inc['at'] - t0:7.1f} s</td><td>step {inc.get('step', '-')}</td>"
        f"<td>{e(str(inc.get('kind', '')))}</td><td>{e(json.dumps(inc)[:300])}</td></tr>"
        for inc in rec.get("incidents") or [])
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Tandem demo report: {e(rec['run_id'])}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1000px; margin: 2em auto; color: #222; }}
img {{ max-width: 100%; border: 1px solid #ddd; margin: .5em 0; }}
table {{ border-collapse: collapse; margin: .5em 0 1.5em; }}
td, th {{ border: 1px solid #ddd; padding: .25em .6em; text-align: left; vertical-align: top; }}
tr.passed td:nth-child(2) {{ color: #2a7d2a; font-weight: bold; }}
tr.failed td:nth-child(2) {{ color: #c0392b; font-weight: bold; }}
.none {{ color: #888; }}
</style></head><body>
<h1>Tandem demo report</h1>
<p>Training run <b>{e(rec['run_id'])}</b> on the local stack (two simulated clusters), its
checkpoints mirrored to S3 and served by workers in both clusters, a grid of every digit
generated through the gateway's HTTP API while one cluster was killed.</p>
<h2>What ran</h2><table><tr><th>phase</th><th>result</th><th>took</th><th>detail</th></tr>
{results}</table>
<h2>Figures</h2><table>{figs}</table>
<h2>Loss, checkpoints and incidents</h2>{img('loss.png', 'loss curve')}
<table><tr><th>when</th><th>at</th><th>incident</th><th>evidence</th></tr>{incidents}</table>
<h2>Generated grid</h2>{img('grid.png', 'grid of generated digits')}
<h2>Goodput</h2>{img('goodput.png', 'goodput breakdown')}
<h2>Failover timeline</h2>{img('failover.png', 'failover timeline')}
<h2>GPU telemetry of the simulated nodes</h2>{img('gpus.png', 'GPU telemetry')}
<h2>Timeline</h2><table>{timeline}</table>
<p>Raw data: <a href="demo.json">demo.json</a>; the stack's logs: <code>stack/logs/</code>.</p>
</body></html>
"""
    path = out / "report.html"
    path.write_text(page)
    return path
