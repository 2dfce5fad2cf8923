"""``tandem run <service>``: run one service in the foreground (as ``python -m``)."""

from __future__ import annotations

import argparse
import importlib

# service name -> "module:class"; the module is imported only when the service runs.
SERVICES = {
    "gateway": "tandem.gateway.service:GatewayService",
    "inference-worker": "tandem.inference_worker.service:InferenceWorker",
    "cluster-agent": "tandem.cluster_agent.service:ClusterAgent",
    "trainer": "tandem.trainer.service:Trainer",
    "checkpointer": "tandem.checkpointer.service:Checkpointer",
}


def service_class(name: str) -> type:
    module, _, cls = SERVICES[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="run one service in the foreground",
                       description="Run one Tandem service. Settings come from TANDEM_* "
                       "environment variables (see the service's README).")
    p.add_argument("service", choices=sorted(SERVICES))
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    # Exactly what ``python -m tandem.<service>`` runs: a service's entry may choose by
    # its settings what it starts (the trainer: coordinator or node agent).
    import runpy

    runpy.run_module("tandem." + args.service.replace("-", "_"), run_name="__main__",
                     alter_sys=True)
    return 0
