"""tandem.cli.bench: ``tandem bench <what>``, Tandem against the raw baseline in the same run.

One module per benchmark (``bus``, ``serve``, ...), their shared ``children`` helpers, and
what only benches and scale tests run (``simfleet``, ``train_rank``). Bench code stays
here, never in a service: services do not import it.
"""

from __future__ import annotations

import argparse
import importlib
import json

# benchmark name -> module with `async def run(args) -> dict` and `add_arguments(p)`.
BENCHES = {
    "bus": "tandem.cli.bench.bus",
    "checkpoint": "tandem.cli.bench.checkpoint",
    "serve": "tandem.cli.bench.serve",
    "agent": "tandem.cli.bench.agent",
    "train": "tandem.cli.bench.train",
    "failover": "tandem.cli.bench.failover",
    "scale": "tandem.cli.bench.scale",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: Tandem against the raw baseline",
                       description="Each benchmark starts its own servers on free loopback "
                       "ports, measures Tandem and the raw baseline in the same run, and "
                       "prints both rates and their ratio.")
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


def _unavailable(name: str, exc: Exception):  # type: ignore[no-untyped-def]
    def run(args: argparse.Namespace) -> int:
        print(f"tandem bench {name}: unavailable: {exc!r}")
        return 2

    return run


def _runner(mod):  # type: ignore[no-untyped-def]
    def run(args: argparse.Namespace) -> int:
        from tandem.common.runner import loop_runner, tune_gc
        from tandem.common.settings import Settings

        # The same loop and collector settings as the services: a load generator or a
        # raw baseline in this process runs on them too, so both sides get the same.
        tune_gc(Settings.model_fields["gc_threshold"].default)
        result = loop_runner("auto")(mod.run(args))
        if args.json:
            print(json.dumps(result))
        else:
            print(mod.render(result))
        return 0 if result.get("ok", True) else 1

    return run
