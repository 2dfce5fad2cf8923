"""tandem.cli.bench: ``tandem bench <what>``, Tandem against its raw baseline in the same run.

One module per benchmark (``bus``, ``serve``, ...); what they all share: ``stats``
(``--repeat``, interleaving, min/median/max, goals judged on the median, the JSON shape and
the Markdown table), ``saturation`` (what was saturated when a goal is missed) and
``children`` (services as child processes); ``suite`` (``tandem bench all``); and what only
benches and scale tests run (``simfleet``, ``train_rank``). Bench code stays here, never in
a service: services do not import it.

``failover`` and ``scale`` have no raw baseline (there is no raw equivalent of a cluster
dying or of a fleet): they report against their goals only, and say so.
"""

from __future__ import annotations

import argparse
import importlib
import json

# benchmark name -> module with `async def run(args) -> dict` (its JSON, with `figures`),
# `render(result) -> str`, `add_arguments(p)` (including `--repeat`) and `SMOKE` (the argv
# of its smallest run, for `tandem bench all --smoke`).
BENCHES = {
    "bus": "tandem.cli.bench.bus",
    "checkpoint": "tandem.cli.bench.checkpoint",
    "serve": "tandem.cli.bench.serve",
    "agent": "tandem.cli.bench.agent",
    "train": "tandem.cli.bench.train",
    "train-sharded": "tandem.cli.bench.train_sharded",  # = train --sharded, for `bench all`
    "failover": "tandem.cli.bench.failover",
    "scale": "tandem.cli.bench.scale",
}


def register(sub: argparse._SubParsersAction) -> None:
    from tandem.cli.bench import suite

    p = sub.add_parser("bench", help="benchmarks: Tandem against the raw baseline",
                       description="Each benchmark starts its own servers on free loopback "
                       "ports, measures Tandem and its raw baseline interleaved in each of "
                       "--repeat repeats, and prints min/median/max of each figure and ratio, "
                       "with its goal judged on the median (failover and scale have no "
                       "baseline: they report against their goals).")
    bsub = p.add_subparsers(dest="bench", metavar="<benchmark>", required=True)
    for name, module in BENCHES.items():
        try:
            mod = importlib.import_module(module)
        except Exception as exc:
            # One broken benchmark must not take the whole CLI down with it.
            bp = bsub.add_parser(name, help=f"(unavailable: {exc})")
            bp.set_defaults(func=_unavailable(name, exc))
            continue
        bp = bsub.add_parser(name, help=mod.__doc__.splitlines()[0] if mod.__doc__ else name)
        bp.add_argument("--json", action="store_true", help="print one JSON object")
        mod.add_arguments(bp)
        bp.set_defaults(func=_runner(mod))
    suite.register(bsub)


def _unavailable(name: str, exc: Exception):  # type: ignore[no-untyped-def]
    def run(args: argparse.Namespace) -> int:
        print(f"tandem bench {name}: unavailable: {exc!r}")
        return 2

    return run


def _runner(mod):  # type: ignore[no-untyped-def]
    def run(args: argparse.Namespace) -> int:
        result = run_bench(mod, args)
        print(json.dumps(result) if args.json else render(mod, result))
        return 0 if result.get("ok", True) else 1

    return run


def run_bench(mod, args: argparse.Namespace) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """One benchmark's ``run(args)`` on the services' loop and collector settings."""
    from tandem.common.runner import loop_runner, tune_gc
    from tandem.common.settings import Settings

    # The same loop and collector settings as the services: a load generator or a
    # raw baseline in this process runs on them too, so both sides get the same.
    tune_gc(Settings.model_fields["gc_threshold"].default)
    result: dict = loop_runner("auto")(mod.run(args))  # type: ignore[type-arg]
    return result


def render(mod, result: dict) -> str:  # type: ignore[no-untyped-def,type-arg]
    """The bench's own lines, then its figures with their spread, goals and why not met."""
    from tandem.cli.bench import stats

    text = mod.render(result)
    if result.get("figures"):
        text += "\n" + stats.render(result["figures"], result.get("repeat"))
    return str(text)
