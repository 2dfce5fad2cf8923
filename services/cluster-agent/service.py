"""The cluster-agent service: one ``NodeAgent`` for this node under the common runner."""

from __future__ import annotations

import os
import signal
import zlib
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from tandem.cluster_agent import faults
from tandem.cluster_agent.agent import NodeAgent
from tandem.cluster_agent.announced import MAX_MODELS
from tandem.cluster_agent.backend import AgentDeath, Backend, NoGpus, NvmlUnavailable, make
from tandem.cluster_agent.claim import CLAIM_WAIT
from tandem.cluster_agent.clock import WallClock
from tandem.common import subjects
from tandem.common.errors import SettingsError
from tandem.common.runner import Context, Service
from tandem.common.settings import Settings


class AgentSettings(Settings):
    agent_backend: Literal["sim", "nvml"] = Field(
        "sim", description="Where GPU samples come from: 'nvml' (real GPUs through "
        "nvidia-ml-py) or 'sim' (simulated GPUs with a fault script). Set nvml on GPU nodes.")
    agent_interval: float = Field(
        1.0, gt=0.05, le=60, description="Seconds between telemetry samples.")
    agent_auto_drain: bool = Field(
        True, description="Drain the node when a rule with action drain/reset/replace makes "
        "it unhealthy; an operator undrains it after dealing with the fault.")
    agent_models: str = Field(
        "", description="Comma-separated models always reported as loaded (besides those "
        "workers announce on models.<cluster>.<node>).")
    agent_claim_wait: float = Field(
        CLAIM_WAIT, ge=0, le=600, description="Seconds a starting agent waits while another "
        "agent instance's heartbeat for this node is fresh (a replaced pod still stopping, or "
        "a killed one's heartbeat not yet expired) before it refuses to start. Default: "
        "Kubernetes' 30 s termination grace period plus the 6 s heartbeat TTL.")
    sim_gpus: int = Field(8, ge=1, le=4096, description="Simulated GPUs on this node.")
    sim_load: float = Field(
        0.0, ge=0.0, le=1.0, description="Simulated load: 0 idle, 0.95 a busy training job.")
    sim_seed: int | None = Field(
        None, description="Noise seed; default derives from cluster and node.")
    sim_faults: str = Field(
        "", description="Fault script for the sim backend: a file path or the script "
        "itself (lines or ';'-separated, e.g. '10 xid gpu=0 code=79; 30 thermal gpu=1').")

    @field_validator("agent_models")
    @classmethod
    def _models(cls, value: str) -> str:
        names = set(subjects.token_list(value, "model name"))
        if len(names) > MAX_MODELS:
            raise ValueError(f"{len(names)} models: at most {MAX_MODELS}")
        return value

    @field_validator("sim_faults")
    @classmethod
    def _faults(cls, value: str, info: ValidationInfo) -> str:
        parsed = faults.load(value)  # FaultScriptError is a ValueError: named in the error
        gpus = info.data.get("sim_gpus")
        if gpus:
            faults.check_gpus(parsed, gpus)
        return value


class ClusterAgent(Service):
    name = "cluster-agent"
    settings_class = AgentSettings

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.agent: NodeAgent | None = None

    def preflight(self) -> None:
        """NVML asked for: it must start here and see a GPU, or the agent exits 2 naming
        TANDEM_AGENT_BACKEND before it connects (not a crash loop of tracebacks)."""
        s: AgentSettings = self.settings  # type: ignore[assignment]
        if s.agent_backend != "nvml":
            return
        from tandem.cluster_agent import nvml

        try:
            if not nvml.probe():
                raise NoGpus("nvml", s.node)
        except (NvmlUnavailable, NoGpus) as exc:
            raise SettingsError(self.name, {"TANDEM_AGENT_BACKEND": str(exc)}) from None

    def backend(self) -> Backend:
        s: AgentSettings = self.settings  # type: ignore[assignment]
        if s.agent_backend == "nvml":
            return make("nvml")
        seed = s.sim_seed
        if seed is None:
            seed = zlib.crc32(f"{s.cluster}.{s.node}".encode())
        return make("sim", gpus=s.sim_gpus, load=s.sim_load, faults=faults.load(s.sim_faults),
                    seed=seed)

    def health(self) -> dict[str, Any]:
        a = self.agent
        if a is None:
            return {}
        return {"node_health": a.state.value, "drained": a.drain.drained, "gpus": a.gpus,
                "samples": a.samples, "active_rules": a.tracker.active(),
                "instance": a.instance, "waiting_for": a.waiting_for}

    async def run(self, ctx: Context) -> None:
        s: AgentSettings = ctx.settings  # type: ignore[assignment]
        models = subjects.token_list(s.agent_models, "model name")
        agent = self.agent = NodeAgent(
            ctx.bus, s.cluster, s.node, self.backend(), WallClock(), interval=s.agent_interval,
            auto_drain=s.agent_auto_drain, models=models, gpu_gauges=True,
            claim_wait=s.agent_claim_wait)
        # NodeTaken (another instance runs for this node) ends the service with its error.
        if not await agent.start(ctx.stopping):
            return  # stopped while another instance's heartbeat was awaited
        try:
            await agent.run(ctx.stopping)
        except AgentDeath as exc:
            # The sim script's agent-die: die as a kill -9 would, leaving the heartbeat to
            # expire and nothing flushed.
            ctx.log.error("agent.dying", reason=str(exc))
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            await agent.close()  # removes the heartbeat only if it is still this one's
