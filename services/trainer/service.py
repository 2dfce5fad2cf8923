"""The trainer coordinator: claims pending runs of its cluster and supervises each one.

- ``train.*.status`` (durable ``trainer-<cluster>``): a ``pending`` run whose cluster is
  this one (or unset) is claimed by compare-and-set on its KV record (``coordinator`` =
  ``<cluster>.<node>``), so of several coordinators exactly one runs it.
- ``health.<cluster>.*`` (a core subscription) and KV ``drains`` (a watch of the
  cluster's node keys): node health changes go to every supervisor, which restarts a
  run without a node that turned bad. The drains are a watch for the reason the runs'
  records are (below): a drain written while this coordinator's connection was away is
  in the watch's current values when it watches again, and reaches the runs it touches.
  A health change published meanwhile is not heard by the subscription: after each
  reconnect the heartbeats (KV ``nodes``) of the nodes the runs are placed on are read,
  and one that says ``unhealthy`` goes to its runs as the event would have
  (``recheck_health``).
- KV ``runs`` (a watch): a client's cancel reaches the run's supervisor. A watch, not a
  core subscription on ``$KV.runs.*``: a core subscriber hears every publish to the
  subject, a compare-and-set the bucket refused as well, and would act on a record that
  was never stored; a watch delivers stored revisions only, in order, and watches again
  after a server restart (a cancel written meanwhile is in its current values).
- Each attempt is started by the configured ``Launcher`` (``TANDEM_LAUNCHER``): local
  torchrun children, or each node's trainer agent ordered over the bus (``nodes.py``).
- On start, runs this coordinator owned that are not finished are adopted (their ranks
  died with the previous coordinator process) and resume from their newest checkpoint.
- A pending run of this cluster still unclaimed ``unclaimed_after_s`` after this
  coordinator saw it is claimed from KV ``runs`` directly (``_claim_unclaimed``): its
  announcement never went out (a gateway that died between writing the record and
  publishing, or a stream that refused the publish for longer than the gateway
  retried), and without this it would wait forever, counting against its key's limit
  of unfinished runs.

One module past 450 lines: claiming, adoption, health, drains and cancels all act on
one table of supervisors in one task group, and the settings are a fifth of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from tandem.common import checkpoints, events, ports, storage, subjects
from tandem.common.bus import Bus, Delivery, MapWatch, describe
from tandem.common.errors import CheckpointNotFound
from tandem.common.events import (
    Health,
    HealthTransition,
    NodeHeartbeat,
    RunRecord,
    RunState,
    TrainStatus,
    struct_replace,
)
from tandem.common.model_size import rank_state_over
from tandem.common.runner import Context, Service
from tandem.common.runs import parse_stored_run_config
from tandem.common.settings import Settings
from tandem.common.streams import (
    KV_DRAINS,
    KV_NODES,
    KV_RUNS,
    Spec,
    core_streams,
    trainer_consumer,
)
from tandem.trainer import run_metrics
from tandem.trainer.launcher import Launcher, LocalLauncher
from tandem.trainer.nodes import NodeLauncher
from tandem.trainer.rank_output import RankLogs, RankLogSettings
from tandem.trainer.supervisor import TERMINAL, RunSupervisor, SupervisorConfig

# What a drain keeps past STOP_CHECKPOINT_S: a node agent's report of its torchrun's exit
# (a coordinator's: the run's record).
STOP_REPORT_S = 5.0


class TrainerSettings(RankLogSettings):
    checkpoint_root: str = Field(
        ".tandem/checkpoints", description="Local checkpoints: <root>/<run>/step-<N>/.")
    work_root: str = Field(
        ".tandem/trainer", description="Per-attempt launch specs, agent logs, stack dumps.")
    relay_host: str = Field(
        "127.0.0.1", description="Address ranks connect to for their events.")
    python: str = Field(sys.executable, description="Interpreter that runs torchrun.")
    threads_per_rank: int = Field(
        0, ge=0, le=256, description="torch threads per rank; 0: the node's cores but one "
        "(left for what runs beside the ranks) shared by its ranks (one rank on 2 cores "
        "gets 1, on 16 gets 15).")
    max_runs: int = Field(4, ge=1, description="Runs this coordinator supervises at once.")
    status_every_s: float = Field(
        2.0, gt=0, description="How often progress and goodput go to KV runs.")
    restore_from_s3: bool = Field(
        True, description="Resume from S3 (the checkpointer's commits) when no local "
        "checkpoint is valid, with the TANDEM_S3_* settings (no endpoint: AWS's own); "
        "false where there is no S3. With launcher=nodes each node fetches the checkpoint "
        "onto its own disk.")
    data_root: str = Field(
        "", description="Directory every image_folder data set must be under (relative "
        "data.path values start there); empty: any path this host can read.")
    max_rank_state_gb: float = Field(
        8.0, gt=0, description="Coordinator: the most training state (fp32 weights, "
        "gradients, AdamW's two moments, the EMA: 20 bytes a parameter; with fsdp a rank's "
        "share) one rank of a run it claims may hold: what a node's memory takes beside "
        "the activations. A run past it fails at claim, naming both figures.")
    trainer_role: Literal["coordinator", "node"] = Field(
        "coordinator", description="coordinator: claims and supervises runs; node: this "
        "node's trainer agent, which runs torchrun for the node when a coordinator orders "
        "it (node_agent.py). Same image, same settings.")
    rendezvous_host: str = Field(
        "127.0.0.1", description="Node agent: the address of this node that the other "
        "nodes reach it at: the c10d rendezvous its torchrun hosts as node rank 0, and "
        "torchrun's --local-addr (where rank 0's store is, on its node); on Kubernetes the "
        "pod's IP.")
    rendezvous_ports: str = Field(
        "", description="Node agent (and the local launcher): the ports the c10d rendezvous "
        "it hosts may take, as first-last (what a firewall or NetworkPolicy between "
        "training nodes admits); empty: 4,000 ports just below the kernel's ephemeral "
        "range (ip_local_port_range), where no outgoing connection takes one. Drawn at "
        "random and found free by binding.")
    orphan_after_s: float = Field(
        10.0, gt=0, le=600, description="Node agent: with no answer from the coordinator "
        "this long, it kills its ranks (nobody supervises them any more).")
    launcher: Literal["local", "nodes"] = Field(
        "local", description="Coordinator: local runs every node's torchrun as a child "
        "process of this host (one box); nodes orders each node's trainer agent over the "
        "bus (a cluster: one agent per node).")
    report_every_s: float = Field(
        1.0, gt=0, le=60, description="launcher=nodes: how often node agents report a "
        "running torchrun (their liveness).")
    agent_lost_after_s: float = Field(
        10.0, gt=0, le=600, description="Coordinator, launcher=nodes: a node agent silent "
        "this long is lost; its attempt restarts from the newest valid checkpoint.")
    unclaimed_after_s: float = Field(
        30.0, gt=0, le=3600, description="Coordinator: a pending run of this cluster still "
        "unclaimed this long after this coordinator saw it (its announcement never went "
        "out) is claimed from KV runs.")
    metrics_keep_ended: int = Field(
        8, ge=0, le=10_000, description="Coordinator: ended runs whose series stay on its "
        "/metrics (the newest), so a scrape after a run's end still reads its final figures "
        "while /metrics stays bounded.")
    launch_within_s: float = Field(
        30.0, gt=0, le=3600, description="Coordinator, launcher=nodes: how long a launch "
        "order is retried while a node has no agent (a pod restarting) before the attempt "
        "fails.")
    stop_checkpoint_s: float = Field(
        0.0, ge=0, le=590, description="How long ranks told to stop (SIGTERM to a node "
        "agent, or to torchrun) have to checkpoint their step and exit before torchrun "
        "SIGKILLs them; a node agent stopping waits this long for its torchrun. "
        "Coordinator: the same for its own stop (launcher=local), and, launcher=nodes with "
        "S3, how long it waits for a preempted attempt's checkpoint to be committed. 0: "
        "DRAIN_TIMEOUT less 5 s (at least 1 s); set, at least 5 s under DRAIN_TIMEOUT (the "
        "exit is reported within the drain).")

    @model_validator(mode="after")
    def _stop_within_drain(self) -> TrainerSettings:
        if self.stop_checkpoint_s and self.stop_checkpoint_s + STOP_REPORT_S > self.drain_timeout:
            raise ValueError(
                f"TANDEM_STOP_CHECKPOINT_S ({self.stop_checkpoint_s:g}) must be at least "
                f"{STOP_REPORT_S:g}s under TANDEM_DRAIN_TIMEOUT ({self.drain_timeout:g}): "
                "the ranks' exit is reported within the drain")
        return self

    def stop_bound(self) -> float:
        """``stop_checkpoint_s``, or with 0 the drain timeout less ``STOP_REPORT_S``."""
        return self.stop_checkpoint_s or max(1.0, self.drain_timeout - STOP_REPORT_S)

    @field_validator("rendezvous_ports")
    @classmethod
    def _port_range(cls, v: str) -> str:
        if v.strip():
            ports.parse_range(v.strip())  # its ValueError names what is wrong
        return v.strip()

    def rendezvous_port_range(self) -> range | None:
        """``rendezvous_ports`` as a range; None when unset."""
        return ports.parse_range(self.rendezvous_ports) if self.rendezvous_ports else None


class Trainer(Service):
    name = "trainer"
    settings_class = TrainerSettings

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        assert isinstance(settings, TrainerSettings)
        self.s: TrainerSettings = settings
        run_metrics.KEEP_ENDED = settings.metrics_keep_ended  # one coordinator a process
        self.me = subjects.node_key(settings.cluster, settings.node)
        self.supervisors: dict[str, RunSupervisor] = {}
        self.launcher: Launcher = LocalLauncher(
            python=settings.python, rendezvous_ports=settings.rendezvous_port_range(),
            stop_checkpoint_s=settings.stop_bound(), logs=RankLogs.of(settings))
        self._slots = asyncio.Semaphore(settings.max_runs)
        # Pending runs of this cluster nobody claimed yet: run id -> when to claim it
        # (loop time, unclaimed_after_s after this coordinator first saw it pending).
        self._unclaimed: dict[str, float] = {}
        self._unclaimed_changed = asyncio.Event()

    def streams(self) -> Sequence[Spec]:
        return [*core_streams(self.settings.stream_replicas),
                trainer_consumer(self.settings.cluster)]

    def health(self) -> dict[str, Any]:
        return {"runs": sorted(self.supervisors)}

    def supervisor_config(self) -> SupervisorConfig:
        return SupervisorConfig(
            checkpoint_root=Path(self.s.checkpoint_root).resolve(),
            work_root=Path(self.s.work_root).resolve(), cluster=self.s.cluster,
            node=self.s.node, relay_host=self.s.relay_host,
            threads_per_rank=self.s.threads_per_rank, status_every_s=self.s.status_every_s,
            data_root=self.s.data_root, stop_checkpoint_s=self.s.stop_bound(),
            # NOTE: S3 is AWS's own when no endpoint is set (the Kubernetes default), so
            # whether to restore is this setting alone, not whether an endpoint is named.
            restore=self._restore if self.s.restore_from_s3 else None,
            # Node agents run on nodes with disks of their own: each fetches for itself.
            s3_steps=self._committed if self.s.restore_from_s3 and self.s.launcher == "nodes"
            else None)

    async def run(self, ctx: Context) -> None:
        self.ctx = ctx
        if self.s.launcher == "nodes":
            self.launcher = NodeLauncher(
                ctx.bus, self.s.cluster, report_every_s=self.s.report_every_s,
                lost_after_s=self.s.agent_lost_after_s,
                launch_within_s=self.s.launch_within_s, log=ctx.log,
                attempts_kept=self.s.attempts_kept)
        kv = await ctx.bus.typed(KV_RUNS, RunRecord)
        subs = [
            await ctx.bus.nc.subscribe(subjects.HEALTH.filter(cluster=self.s.cluster),
                                       cb=self._on_health),
        ]
        runs = MapWatch(ctx.bus, KV_RUNS, self._on_run_record)
        drains = self.drain_watch(ctx.bus)
        recheck = self.recheck_health_on_reconnect(ctx.bus)
        try:
            await runs.start()  # every record's current value noted (``_on_run_record``)
            await drains.start()
            async with asyncio.TaskGroup() as tg:
                self.tg = tg
                for run_id, rec in (await kv.items()).items():
                    if rec.coordinator == self.me and rec.state not in TERMINAL:
                        ctx.log.info("trainer.adopt", run_id=run_id, state=rec.state.value)
                        self._start(run_id, rec, adopted=True)
                unclaimed = tg.create_task(self._claim_unclaimed())
                consumer = ctx.bus.consumer(trainer_consumer(self.s.cluster), TrainStatus,
                                            self._on_status)
                await consumer.run(ctx.stopping)
                unclaimed.cancel()
        finally:
            ctx.bus.reconnected.remove(recheck)
            await runs.stop()
            await drains.stop()
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    # ------------------------------------------------------------------------ claiming

    async def _on_status(self, d: Delivery[TrainStatus]) -> None:
        if d.event.state == RunState.pending:
            await self._claim(d.event.run_id)

    async def _claim(self, run_id: str, unannounced: bool = False) -> None:
        """Claim a pending run of this cluster (compare-and-set: of several coordinators
        exactly one gets it) and supervise it."""
        kv = await self.ctx.bus.typed(KV_RUNS, RunRecord)
        got = await kv.get(run_id)
        if got is None or not self._ours(got[0]):
            return

        def claim(cur: RunRecord | None) -> RunRecord | None:
            if cur is None or cur.state != RunState.pending or cur.coordinator:
                return None
            return struct_replace(cur, coordinator=self.me, state=RunState.starting,
                                  updated_at=events.now())

        rec = await kv.update(run_id, claim)
        if rec is not None and rec.coordinator == self.me and run_id not in self.supervisors:
            if unannounced:
                self.ctx.log.warning("trainer.claim_unannounced", run_id=run_id,
                                     after_s=self.s.unclaimed_after_s)
            self._start(run_id, rec)

    def _ours(self, rec: RunRecord) -> bool:
        return rec.config.get("cluster") in (None, "", self.s.cluster)

    def _note(self, run_id: str, rec: RunRecord | None) -> None:
        """Track ``run_id`` while it is pending, unclaimed and this cluster's; forget it
        once it is not (claimed, cancelled, deleted: a refused submission's record)."""
        if (rec is None or rec.state != RunState.pending or rec.coordinator or rec.cancel
                or not self._ours(rec)):
            self._unclaimed.pop(run_id, None)
        elif run_id not in self._unclaimed:
            # Timed from when this coordinator saw it, not the record's created_at: no
            # other host's clock decides, and a refused submission's record (deleted
            # within milliseconds) is never claimed.
            due = asyncio.get_running_loop().time() + self.s.unclaimed_after_s
            self._unclaimed[run_id] = due
            self._unclaimed_changed.set()

    async def _claim_unclaimed(self) -> None:
        """Claim each run still pending and unclaimed ``unclaimed_after_s`` after it was
        first seen so: nobody announced it (``_on_status`` claims announced ones)."""
        loop = asyncio.get_running_loop()
        while True:
            self._unclaimed_changed.clear()
            for run_id, due in list(self._unclaimed.items()):
                if due > loop.time():
                    continue
                del self._unclaimed[run_id]
                try:
                    await self._claim(run_id, unannounced=True)
                except Exception as exc:  # NATS away: try again later
                    self.ctx.log.warning("trainer.claim_failed", run_id=run_id,
                                         error=describe(exc))
                    self._unclaimed[run_id] = loop.time() + min(5.0, self.s.unclaimed_after_s)
            first = min(self._unclaimed.values(), default=None)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(None if first is None else first - loop.time()):
                    await self._unclaimed_changed.wait()

    def _start(self, run_id: str, rec: RunRecord, adopted: bool = False) -> None:
        try:
            # Read as stored, not as a request: a newer gateway's fields are left out.
            config, unknown = parse_stored_run_config(rec.config)
            if unknown:
                self.ctx.log.warning("trainer.config_fields_unknown", run_id=run_id,
                                     fields=unknown, effect="left out: this version does "
                                     "not know them")
            config = config.model_copy(update={"data": config.data.confined(self.s.data_root)})
            # An adopted run was let through before: its size is not judged again.
            too_big = None if adopted else rank_state_over(config, self.s.max_rank_state_gb)
            if too_big is not None:
                raise ValueError(too_big)
        except Exception as exc:
            self.tg.create_task(self._reject(run_id, str(exc)))
            return
        sup = RunSupervisor(self.ctx.bus, self.supervisor_config(), run_id, config,
                            self.launcher, self.ctx.log)
        if rec.cancel:  # cancelled while no coordinator watched it
            sup.request_cancel(rec.cancel)
        self.supervisors[run_id] = sup
        self.tg.create_task(self._supervise(sup, adopted), name=f"run-{run_id}")

    async def _supervise(self, sup: RunSupervisor, adopted: bool) -> None:
        slot = False
        try:
            slot = await self._slot(sup)
            if not slot and not sup.cancelled.is_set():
                # This coordinator is stopping: the run, never launched here, stays
                # claimed as it is, for the coordinator that adopts it.
                self.ctx.log.info("trainer.run_left", run_id=sup.run_id,
                                  reason="coordinator stopping before it had a slot")
                return
            # A run cancelled while it waited ends without a slot: it launches nothing.
            state = await sup.run(self.ctx.stopping, adopted)
            self.ctx.log.info("trainer.run_ended", run_id=sup.run_id, state=state.value)
        except Exception as exc:  # a supervisor bug must not take the other runs down
            self.ctx.log.error("trainer.supervisor_crashed", run_id=sup.run_id,
                               error=repr(exc), exc_info=exc)
            with contextlib.suppress(Exception):
                await sup._status(RunState.failed, f"coordinator error: {exc!r}")
        finally:
            if slot:
                self._slots.release()
            self.supervisors.pop(sup.run_id, None)

    async def _slot(self, sup: RunSupervisor) -> bool:
        """Wait for one of the ``max_runs`` slots, but not past the run's cancel or this
        coordinator's stop: True once a slot is taken (the caller releases it)."""
        stopping = self.ctx.stopping
        if sup.cancelled.is_set() or stopping.is_set():
            return False
        take = asyncio.ensure_future(self._slots.acquire())
        ends = [asyncio.ensure_future(e.wait()) for e in (sup.cancelled, stopping)]
        try:
            await asyncio.wait([take, *ends], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (take, *ends):
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await take
        if not take.cancelled() and take.exception() is None:
            if not (sup.cancelled.is_set() or stopping.is_set()):
                return True
            self._slots.release()  # taken as the run ended or the coordinator stopped
        return False

    async def _reject(self, run_id: str, reason: str) -> None:
        """A run this coordinator refuses (its config fails here: a ``data.path`` outside
        ``DATA_ROOT``, a rank's state past ``MAX_RANK_STATE_GB``): failed, with the reason
        as an incident (``invalid_config``). A run that ended meanwhile (cancelled) is
        left as it is."""
        kv = await self.ctx.bus.typed(KV_RUNS, RunRecord)
        incident = {"kind": "invalid_config", "reason": reason, "at": events.now(),
                    "detector": "the coordinator's check of the run's config"}
        def fail(cur: RunRecord | None) -> RunRecord | None:
            if cur is None or cur.state.terminal:
                return None
            return struct_replace(cur, state=RunState.failed, updated_at=events.now(),
                                  incidents=[*cur.incidents, incident])

        if await kv.applied(run_id, fail) is None:
            return
        await self.ctx.bus.publish(subjects.train(run_id, "status"), TrainStatus(
            run_id=run_id, state=RunState.failed, reason=reason, incident=incident),
            retry_for=5.0)

    # -------------------------------------------------------------------------- health

    async def _on_health(self, msg: Any) -> None:
        try:
            ev = events.decode(msg.data, HealthTransition)
        except Exception:
            return
        if ev.previous == ev.current:  # a further finding on a node already that bad
            return
        for sup in list(self.supervisors.values()):
            if sup.cluster == ev.cluster:
                sup.on_health(ev.node, ev.current.value, f"{ev.rule}: {ev.reason}")

    def _on_run_record(self, run_id: str, value: bytes | None, initial: bool) -> None:
        """A run record as stored (the watch's current values, then each change): a
        cancel asked for a run this coordinator supervises stops it
        (``runs.cancel_run``); a pending one is tracked until claimed."""
        rec = None
        if value:
            try:
                rec = events.decode(value, RunRecord)
            except Exception:
                return
        self._note(run_id, rec)
        sup = self.supervisors.get(run_id)
        if sup is not None and rec is not None and rec.cancel:
            sup.request_cancel(rec.cancel)

    def recheck_health_on_reconnect(self, bus: Bus) -> Callable[[], Awaitable[None]]:
        """``recheck_health`` after each reconnect of ``bus``; the hook, to remove."""
        async def recheck() -> None:
            await self.recheck_health(bus)

        bus.reconnected.append(recheck)
        return recheck

    async def recheck_health(self, bus: Bus) -> None:
        """The heartbeat of each node a run is placed on: one whose health is bad goes to
        the run's supervisor (as a ``health`` event would have; one it already knows
        changes nothing, as the attempt it would stop is not on that node any more)."""
        beats = await bus.typed(KV_NODES, NodeHeartbeat)
        for sup in list(self.supervisors.values()):
            for node in list(sup.placement.nodes if sup.placement else ()):
                got = await beats.get(subjects.node_key(sup.cluster, node))
                if got is not None and got[0].health == Health.unhealthy:
                    sup.on_health(node, got[0].health.value, "heartbeat read after a "
                                  "reconnect: " + (", ".join(got[0].findings) or "unhealthy"))

    def drain_watch(self, bus: Bus) -> MapWatch:
        """KV ``drains``, this cluster's nodes: each drain and undrain to every
        supervisor (``_on_drain``), once started."""
        return MapWatch(bus, KV_DRAINS, self._on_drain,
                        keys=subjects.cluster_keys(self.s.cluster))

    def _on_drain(self, key: str, value: bytes | None, initial: bool) -> None:
        """A node's drain as stored (``<cluster>.<node>``; None: undrained). The current
        values of a watch made again after a reconnect come here too: a supervisor takes
        a drain it already knows as a no-op (the attempt it would stop is gone)."""
        node = key.rsplit(".", 1)[-1]
        drained = value is not None
        for sup in list(self.supervisors.values()):
            sup.on_health(node, "drained" if drained else "healthy",
                          "drained by operator" if drained else "undrained")

    # --------------------------------------------------------------------------- restore

    async def _committed(self, run_id: str, line: checkpoints.Lineage) -> list[int]:
        """The committed steps of ``line``'s history in S3, oldest first (listed, not
        downloaded)."""
        def listing() -> list[int]:
            return checkpoints.committed_steps(storage.s3_client(self.settings),
                                               self.settings.s3_bucket, run_id, line)

        return await asyncio.to_thread(listing)

    async def _restore(self, run_id: str, dest: Path,
                       line: checkpoints.Lineage) -> checkpoints.Resume | None:
        """Seam to the checkpointer: the newest committed checkpoint of ``line``'s
        history in S3, verified; None only when S3 says none is committed (or none
        verifies). Any other error (S3 unreachable, throttling) is raised."""

        def fetch() -> Any:
            s3 = storage.s3_client(self.settings)
            return checkpoints.restore(s3, self.settings.s3_bucket, run_id, dest, line=line)

        try:
            restored = await asyncio.to_thread(fetch)
        except CheckpointNotFound as exc:  # nothing committed (or nothing that verifies)
            self.ctx.log.info("trainer.s3_nothing_to_restore", run_id=run_id,
                              reason=exc.reason)
            return None
        except Exception as exc:
            # NOTE: S3 could not say (a 503, a timeout): raised, not None, so the attempt
            # fails and is retried with backoff instead of starting afresh over
            # committed checkpoints (the supervisor's RestoreFailed).
            self.ctx.log.warning("trainer.s3_restore_failed", run_id=run_id, error=repr(exc))
            raise
        self.ctx.log.info("trainer.s3_restored", run_id=run_id, step=restored.step)
        return checkpoints.Resume(step=restored.step, path=restored.path,
                                  manifest=restored.manifest)
