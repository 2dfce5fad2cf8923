"""What ``tandem bench scale`` reports: its goals, its figures over the runs (with the
saturation note of a goal not met) and the text it prints.

Apart from ``scale.py`` (the fleet and the windows it measures) so each reads alone.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from tandem.cli.bench import saturation, stats

GOAL_TASKS_PER_S = 1000.0
GOAL_DELIVERED = 0.99  # telemetry delivered / offered that counts as "no backlog"


def largest_ratio(run: dict[str, Any]) -> float:
    return run["sizes"][-1]["steady"]["telemetry"]["ratio"] if run["sizes"] else 0.0


def figures(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[stats.Figure]:
    """Per size: telemetry delivered/offered and burst tasks/s; the gateway alone."""
    out = []
    alone = [x["gateway_alone"] for x in runs]
    out.append(stats.Figure("gateway_alone", "gateway alone, tasks accepted", "tasks/s",
                            [g["accepted_per_s"] for g in alone],
                            goal=stats.Goal(">=", GOAL_TASKS_PER_S, on="tandem"), digits=1,
                            notes=[stats.NO_BASELINE]))
    if out[-1].met is False:
        g = stats.median_run(alone, lambda x: x["accepted_per_s"])
        out[-1].why = saturation.why({"cores": {"gateway": g["gateway_cpu_cores"]},
                                      "cpus": os.cpu_count() or 1, "machine_busy_cores": None},
                                     extra=[f"{g['gateway_cpu_ms_per_task']} ms of gateway "
                                            "CPU per task"])
    nodes = [row["nodes"] for row in runs[0]["sizes"]]
    for n in nodes:
        rows = [row for x in runs for row in x["sizes"] if row["nodes"] == n]
        if len(rows) != len(runs):  # a size failed in some run: no spread to report
            continue
        tele = stats.Figure(f"telemetry_{n}", f"{n} nodes: telemetry stored / offered",
                            "ratio", [r["steady"]["telemetry"]["ratio"] for r in rows],
                            goal=stats.Goal(">=", GOAL_DELIVERED, on="tandem"), digits=4,
                            notes=["offered: the samples whose publish ended in the window "
                                   "(acknowledged or raised; each node publishes one at a "
                                   "time); stored: those the stream acknowledged (PubAck), "
                                   "counted in the same agent process's reply"])
        schedule = stats.Figure(
            f"schedule_{n}", f"{n} nodes: agents' samples / nodes x rate", "ratio",
            [r["steady"]["telemetry"]["on_schedule"] for r in rows], digits=4,
            notes=["no goal: the simulated agents keeping their own schedule (many nodes "
                   "per process on a shared box), not the bus; a node's one agent on its "
                   "own host ticks on time"])
        burst = stats.Figure(f"burst_{n}", f"{n} nodes: burst tasks accepted", "tasks/s",
                             [r["burst"]["accepted_per_s"] for r in rows],
                             goal=stats.Goal(">=", GOAL_TASKS_PER_S, on="tandem"), digits=1)
        if tele.met is False:
            row = stats.median_run(rows, lambda r: r["steady"]["telemetry"]["ratio"])
            tele.why = _why_window(row["steady"], args)
        if burst.met is False:
            row = stats.median_run(rows, lambda r: r["burst"]["accepted_per_s"])
            burst.why = _why_cores(row["burst"]) if "cpu_cores" in row["burst"] else (
                saturation.why({"cores": {"gateway": row["burst"]["gateway_cpu_cores"]},
                                "cpus": os.cpu_count() or 1, "machine_busy_cores": None}))
        out += [tele, schedule, burst]
    return out


def _why_cores(window: dict[str, Any], extra: list[str] | None = None) -> str:
    """A window's readings (the steady window's or the burst's) as a saturation note:
    every process's cores, the NATS servers and the agent processes summed (each counted
    once), the machine's busy cores."""
    cpus = os.cpu_count() or 1
    summed = set(window.get("nats_servers", ()))
    cores = {n: c for n, c in window["cpu_cores"].items()
             if n not in summed and not n.startswith("agents-")}
    cores["all NATS servers"] = window["nats_cpu_cores"]
    cores["all agent processes"] = window["agents_cpu_cores"]
    return saturation.why({"cores": cores, "cpus": cpus,
                           "machine_busy_cores": window["machine_busy"] * cpus}, extra=extra)


def _why_window(steady: dict[str, Any], args: argparse.Namespace) -> str:
    lag = steady["heartbeat_lag"]["second_half"]["p99_ms"]
    return _why_cores(steady, [f"heartbeat lag p99 {lag} ms at the end of the window "
                               f"(interval {args.interval * 1e3:g} ms)"])


def render(r: dict[str, Any]) -> str:
    yes = {True: "yes", False: "NO"}
    lines = [f"tandem bench scale ({r['cpus']} CPUs): {r['clusters']} clusters behind leaf "
             f"nodes, hub of {r['hub_size']}, {r['gpus_per_node']} GPUs/node at "
             f"{1 / r['interval_s']:g} Hz; no raw baseline: judged against its goals only"
             + (f"; the median of {r['repeat']} runs shown" if r.get("repeat", 1) > 1 else "")]
    g = r.get("gateway_alone")
    if g:
        lines.append(f"gateway alone (1 nats-server, no fleet, {g['connections']} conns): "
                     f"{g['accepted_per_s']}/s accepted, {g['rejected']} refused, "
                     f"{g['gateway_cpu_cores']} cores, "
                     f"{g['gateway_cpu_ms_per_task']} ms CPU/task; >= {GOAL_TASKS_PER_S:g}/s: "
                     f"{yes[g['meets_goal']]}")
    for row in r["sizes"]:
        s, b, pn = row["steady"], row["burst"], row["per_node"]
        t = s["telemetry"]
        lines += [
            f"{row['nodes']:>5} nodes ({row['gpus']} GPUs), up in {row['startup_s']} s; box "
            f"{s['machine_busy']:.0%} busy, load average {s['load_avg_1m']}",
            f"   telemetry  {t['delivered_per_s']:>8.1f}/s stored of {t['offered_per_s']:.1f}/s "
            f"offered ({t['ratio']:.4f}), {t['publish_failed']} publishes failed; stream "
            f"sequence {t['stream_stored_per_s']:.1f}/s; agents sampled "
            f"{t['on_schedule']:.4f} of {t['nominal_per_s']:g}/s",
            f"              heartbeats {s['heartbeats_per_s']}/s; JS API "
            f"{s['js_api_per_s']}/s; leaf in {s['leaf_in_bytes_per_s'] / 1e6:.2f} MB/s",
            f"   NATS CPU   {s['nats_cpu_cores']:.3f} cores (hub {s['hub_cpu_cores']:.3f}); RSS "
            f"hub {row['memory_bytes']['hub_rss'] / 2**20:.0f} MiB, leaves "
            f"{row['memory_bytes']['leaves_rss'] / 2**20:.0f} MiB; agents "
            f"{s['agents_cpu_cores']:.3f} cores",
            f"   backlog    queued {s['backlog_start']['gen_queued']} -> "
            f"{s['backlog_end']['gen_queued']}; heartbeat lag p50/p99 "
            f"{s['heartbeat_lag']['first_half']['p50_ms']}/"
            f"{s['heartbeat_lag']['first_half']['p99_ms']} ms -> "
            f"{s['heartbeat_lag']['second_half']['p50_ms']}/"
            f"{s['heartbeat_lag']['second_half']['p99_ms']} ms; "
            f"no growth: {yes[row['no_backlog_growth']]}",
            f"   routing    p50 {s['routing']['p50_us']} us  p99 {s['routing']['p99_us']} us "
            f"(gateway); summaries {s['routing_input']['summaries_us']} us vs full view "
            f"{s['routing_input']['full_view_us']} us",
            f"   steady     {s['tasks']['throughput_per_s']}/s of {s['tasks']['offered_per_s']:g} "
            f"offered, latency p50 {s['tasks']['latency']['p50_ms']} ms p99 "
            f"{s['tasks']['latency']['p99_ms']} ms, not done {s['tasks']['not_done_30s_after']}",
            f"   burst      {b['accepted_per_s']}/s accepted, {b['completed_per_s']}/s completed "
            f"({b['connections']} conns; gateway {b['gateway_cpu_cores']} cores), latency p50 "
            f"{b['latency']['p50_ms']} ms p99 {b['latency']['p99_ms']} ms; >= "
            f"{GOAL_TASKS_PER_S:g}/s: {yes[b['meets_goal']]}",
            f"   per node   NATS {pn['nats_cpu_ms_per_s']} ms CPU/s, agent "
            f"{pn['agent_cpu_ms_per_s']} ms CPU/s, {pn['leaf_in_bytes_per_s']} B/s in, "
            f"{pn['js_api_per_s']} JS API req/s, agent RSS {pn['agent_rss_kib']} KiB",
        ]
    for fail in r.get("failed", []):
        lines.append(f"{fail['nodes']:>5} nodes FAILED: {fail['error']}")
        for name, tail in fail["logs"].items():
            lines.append(f"   {name}: ...{tail[-600:]}")
    if r.get("marginal_per_node"):
        m = r["marginal_per_node"]
        lines.append(f"marginal per node (largest - smallest): NATS {m['nats_cpu_ms_per_node_s']} "
                     f"ms CPU/s, NATS RSS {m['nats_rss_kib_per_node']} KiB")
    return "\n".join(lines)
