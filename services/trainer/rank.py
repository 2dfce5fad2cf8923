"""A rank: ``python -m torch.distributed.run ... -m tandem.trainer.rank <launch.json>``.

Reads the attempt's ``LaunchSpec``, joins the process group (NCCL on CUDA, gloo on CPU,
chosen by the run's ``device``), resumes from the checkpoint the coordinator chose,
trains, checkpoints asynchronously every ``checkpoint_every`` steps (and at the end),
and reports to the coordinator. SIGUSR1 dumps every thread's stack to
``<attempt_dir>/stacks-rank<r>.txt`` (the watchdog asks for it on a hang).

SIGTERM (torchrun passes on its own: its node agent stopping, a spot node reclaimed, a
rolling upgrade) asks the ranks to stop, not to die (``StopRequest``): at the next step
boundary every rank learns it (the flag rides on the step's all_gather, so a signal to
one node's ranks stops all of them at the same step), tells the coordinator
(``channel.Preempted``), checkpoints that step through the periodic path, waits until
the checkpoint is written on every node and exits ``PREEMPTED``.

Exit codes: 0 done, 1 crashed, ``ANOMALY`` (3) stopped on a loss anomaly before applying
the bad update, ``INVALID`` (4) the run cannot be built or trained as configured (told
to the coordinator first: ``channel.Invalid``), ``PREEMPTED`` (5) told to stop and
checkpointed, ``channel.ORPHANED`` (17) coordinator gone.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import msgspec

from tandem.common.events import CheckpointWritten
from tandem.common.models import leave_out
from tandem.common.runs import RunConfig, parse_stored_run_config
from tandem.trainer.channel import (
    ERROR_CHARS,
    Anomaly,
    Bye,
    CheckpointWriteFailed,
    Done,
    EventChannel,
    Hello,
    Invalid,
    Preempted,
    Resumed,
    StepReport,
)
from tandem.trainer.spec import LaunchSpec

ANOMALY = 3
INVALID = 4
PREEMPTED = 5


class StopRequest:
    """SIGTERM as a request to checkpoint and stop at the next step boundary.

    The handler only sets flags (``asked``, and the loop's ``stop_asked`` once there is
    a loop): whatever the main thread is in (a collective, a checkpoint's copy) goes on,
    and the loop's next step tells every rank. A rank stuck before its first step stays
    until torchrun's shutdown timeout (``STOP_CHECKPOINT_S``) ends in SIGKILL."""

    def __init__(self) -> None:
        self.asked = False
        self.loop: Any = None
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.asked = True
        if self.loop is not None:
            self.loop.stop_asked = True

    def attach(self, loop: Any) -> None:
        """From now on a SIGTERM sets ``loop.stop_asked``; one already received, too."""
        self.loop = loop  # first: a signal between the two lines is then not lost
        loop.stop_asked = loop.stop_asked or self.asked


def pick_device(cfg: RunConfig, local_rank: int):  # type: ignore[no-untyped-def]
    import torch

    want = cfg.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("the run asks for device=cuda but no CUDA device is visible")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", local_rank % torch.cuda.device_count()), "nccl"
    return torch.device("cpu"), "gloo"


def threads(asked: int) -> int:
    """torch intra-op threads for this rank: ``asked``, or with 0 the cores this process
    may use but one, shared by the ranks of this node (torchrun's LOCAL_WORLD_SIZE).

    The core left over is for what runs beside the ranks: each rank's own checkpoint
    writer and relay threads, torchrun, the node's agents. torch's threads meet at the
    end of every op, so one of them waiting for a core stalls them all: on 2 cores with
    the local stack and other work beside it, 2 threads made the demo's steps 7x slower
    (median 1.33 s) until its watchdog took them for a hang, where 1 thread trained."""
    if asked > 0:
        return asked
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, (len(os.sched_getaffinity(0)) - 1) // ranks)


def main(argv: list[str] | None = None) -> NoReturn:
    args = sys.argv[1:] if argv is None else argv
    stop = StopRequest()  # first: a SIGTERM while importing or loading is not lost
    spec = msgspec.json.decode(Path(args[0]).read_bytes(), type=LaunchSpec)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    # The node is the environment's (its launcher sets TANDEM_NODE per node): the c10d
    # rendezvous, not the placement, decides which ranks land on which node.
    node = os.environ.get("TANDEM_NODE") or (
        spec.rank_nodes[rank] if rank < len(spec.rank_nodes) else spec.node)
    attempt_dir = Path(spec.attempt_dir)
    attempt_dir.mkdir(parents=True, exist_ok=True)
    stacks = open(attempt_dir / f"stacks-rank{rank}.txt", "w")  # open for the process's life
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)

    channel = EventChannel(spec.events or None)
    channel.send(Hello(rank=rank, pid=os.getpid(), node=node, attempt=spec.attempt,
                       world=world))

    leave_out()  # a rank trains diffusers' own UNet or DiT, on every restart
    import torch
    import torch.distributed as dist

    from tandem.trainer.loop import TrainLoop

    cfg = run_config(spec, say=local_rank == 0)
    torch.set_num_threads(threads(spec.threads))
    device, backend = pick_device(cfg, local_rank)
    distributed = world > 1 or cfg.parallelism == "fsdp"
    rank_nodes = [node]
    if distributed:
        dist.init_process_group(backend, timeout=timedelta(minutes=10))
        rank_nodes = [""] * world
        dist.all_gather_object(rank_nodes, node)  # every rank's node, for reports and hooks
    # Building the data and the model, loading and the first step are where a config
    # that validates but cannot train fails: the run ends there (``configured``).
    loop = configured(channel, rank, lambda: TrainLoop(
        cfg, rank=rank, world=world, device=device, distributed=distributed,
        skipped=spec.skipped, data_root=spec.data_root))
    stop.attach(loop)
    if spec.resume_path:
        configured(channel, rank, loop.load, Path(spec.resume_path))
    elif spec.resume_steps:  # nodes with disks of their own: each fetches it from S3
        from tandem.trainer.fetch import fetch

        path, step, skipped = fetch(spec, local_rank=local_rank, world=world, node=node)
        if rank == 0:
            channel.send(Resumed(step=step, skipped=skipped))
        if path is not None:
            configured(channel, rank, loop.load, path)

    if cfg.parallelism == "fsdp":
        writer = checkpoint_writer(spec, channel, node, pin=device.type == "cuda",
                                   rank=rank, local_rank=local_rank, world=world,
                                   rank_nodes=rank_nodes)
    else:
        writer = (checkpoint_writer(spec, channel, node, pin=device.type == "cuda")
                  if rank == 0 else None)
    faults = cfg.faults
    samples = cfg.batch_size * world
    code = 0
    first = True
    while loop.step < cfg.steps:
        if faults.crash_at_step == loop.step + 1 and rank == faults.crash_rank:
            to_stderr(f"tandem rank {rank}: fault hook crash_at_step={faults.crash_at_step}")
            os._exit(1)
        r = configured(channel, rank, loop.train_step) if first else loop.train_step()
        first = False
        if r.anomaly is not None:
            if rank == 0:
                channel.send(Anomaly(step=r.step + 1, data_pos=r.data_pos,
                                     anomaly=r.anomaly.kind, loss=_num(r.loss),
                                     grad_norm=_num(r.grad_norm),
                                     evidence=r.anomaly.evidence))
            code = ANOMALY
            break
        if r.stop and loop.step < cfg.steps:
            # Every rank saw the same flags (``TrainLoop.train_step``): all stop here.
            channel.send(Preempted(rank=rank, node=node, step=r.step, signalled=stop.asked))
            after_step(loop, r, channel, writer, samples, rank_nodes, checkpoint=True)
            code = PREEMPTED
            break
        after_step(loop, r, channel, writer, samples, rank_nodes)
    if writer is not None:
        writer.close(timeout=None)  # the last checkpoint is written (or its failure told)
    if code == PREEMPTED and distributed:
        # NOTE: no rank leaves before every node's writes ended: torchrun stops a
        # node's remaining ranks once one of them has exited non-zero.
        dist.barrier()
    if code == 0 and rank == 0:
        channel.send(Done(step=loop.step))
    channel.send(Bye(rank=rank, code=code))
    channel.close()
    if distributed:
        dist.destroy_process_group()
    if faults.hang_on_exit_rank == rank and code == 0:
        to_stderr(f"tandem rank {rank}: fault hook hang_on_exit_rank")
        while True:
            signal.pause()  # until the coordinator stops it
    leave(code)


def run_config(spec: LaunchSpec, say: bool = False) -> RunConfig:
    """The run's config from ``spec``. Fields this version does not know (a newer
    coordinator's, while node agents are upgraded one by one) are left out; with ``say``
    they are named once on stderr (the node's first rank: one line per node)."""
    cfg, unknown = parse_stored_run_config(spec.config)
    if unknown and say:
        to_stderr(f"tandem rank: run {spec.run_id}: config fields this version does not "
                  f"know were left out: {', '.join(unknown)}")
    return cfg


def configured(channel: EventChannel, rank: int, build: Any, *args: Any) -> Any:
    """``build(*args)``; where it raises because of the run's config (not a peer lost),
    the coordinator is told (``Invalid``, the exception's type and text) and the rank
    exits ``INVALID``: the coordinator ends the run failed rather than restarting an
    attempt that would fail alike. An error of the process group (a peer killed, its
    node gone: ``DistError``, or gloo's own ``RuntimeError``) is raised as before: a
    crash, which the coordinator restarts."""
    try:
        return build(*args)
    except Exception as exc:
        if peer_lost(exc):
            raise
        import traceback

        to_stderr(traceback.format_exc().rstrip("\n"))
        error = f"{type(exc).__name__}: {exc}"
        if len(error) > ERROR_CHARS:
            error = error[:ERROR_CHARS - 3] + "..."
        channel.send(Invalid(rank=rank, error=error))
        channel.close()
        leave(INVALID)


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is the process group's (another rank or the store gone), not the
    run's config: torch's ``DistError`` (NCCL, the store), or gloo's ``RuntimeError``,
    which names gloo (its source file) in its text."""
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or "gloo" in str(exc).lower()


def to_stderr(text: str) -> None:
    """``text`` as a line on stderr (the node's rank log), or nowhere once no one reads
    it: with its launcher killed -9 the pipe is broken, and a ``BrokenPipeError`` raised
    here would end a rank on its way to the checkpoint that SIGTERM asks of it (or turn
    a config it tells ``Invalid`` into a crash)."""
    with contextlib.suppress(OSError):
        print(text, file=sys.stderr, flush=True)


def leave(code: int) -> NoReturn:
    """Exit now, without the interpreter's teardown and while the caller's locals (the
    model, the process group, gloo's threads) are still alive, so no destructor runs.

    A finished rank was seen to hang in such a destructor (a native thread of
    torch.distributed), first at interpreter exit and then, with ``os._exit`` after
    ``main`` returned, while ``main``'s frame was freed: its launcher never exited and
    the watchdog restarted a run that had already trained every step.
    """
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):  # the launcher's reader gone (killed -9)
            stream.flush()
    os._exit(code)


def checkpoint_writer(spec: LaunchSpec, channel: EventChannel, node: str,
                      pin: bool = False, *, rank: int | None = None, local_rank: int = 0,
                      world: int = 1, rank_nodes: list[str] | None = None) -> Any:
    """Rank 0's async checkpointer, announcing each written checkpoint to the coordinator;
    with ``rank`` (an FSDP run) this rank's sharded checkpointer, whose node's first rank
    announces the node's committed folder."""
    from tandem.common.checkpoints import Lineage
    from tandem.trainer.async_ckpt import AsyncCheckpointer, Written
    from tandem.trainer.sharded_ckpt import ShardedCheckpointer

    def written(w: Written) -> None:
        channel.send(CheckpointWritten(
            run_id=spec.run_id, step=w.step, path=str(w.path), manifest=w.manifest,
            blocked_s=w.blocked_s, write_s=w.write_s, node=node, cluster=spec.cluster))

    def failed(step: int, exc: BaseException) -> None:
        channel.send(CheckpointWriteFailed(step=step, error=repr(exc)))

    line = Lineage.of(spec.forks)
    if rank is not None:
        return ShardedCheckpointer(spec.checkpoint_root, spec.run_id, rank=rank,
                                   local_rank=local_rank, world=world, node=node, pin=pin,
                                   on_written=written, on_error=failed, line=line,
                                   before_commit=fault_hook(spec, node, rank_nodes or []))
    return AsyncCheckpointer(spec.checkpoint_root, spec.run_id, pin=pin, on_written=written,
                             on_error=failed, line=line,
                             before_commit=fault_hook(spec, node, rank_nodes or []))


def fault_hook(spec: LaunchSpec, node: str, rank_nodes: list[str]) -> Any:
    """The checkpoint fault hooks of ``spec``'s run for this node's writer (called with the
    step once its files are written, before the commit), or None:

    - ``faults.stall_checkpoint_at_step``: in the first attempt, the node of
      ``stall_checkpoint_rank`` (``rank_nodes``: every rank's) never commits its part of
      that step (its first rank waits here until the drill kills it);
    - ``faults.fail_checkpoint_write_at_step``: the node of rank 0 (every attempt) fails
      that step's write as a full disk would (``OSError`` ENOSPC).
    """
    faults = run_config(spec).faults
    stall, victim = faults.stall_checkpoint_at_step, faults.stall_checkpoint_rank
    if stall is not None and (spec.attempt != 1 or victim >= len(rank_nodes)
                              or rank_nodes[victim] != node):
        stall = None  # sharded runs only: a whole checkpoint's writer has no rank_nodes
    first = rank_nodes[0] if rank_nodes else node  # a whole checkpoint: rank 0 writes it
    full = faults.fail_checkpoint_write_at_step if first == node else None
    if stall is None and full is None:
        return None

    def hook(step: int) -> None:
        if step == stall:
            to_stderr(f"tandem node {node}: fault hook stall_checkpoint_at_step={stall}")
            threading.Event().wait()  # until killed: the drill's whole point
        if step == full:
            to_stderr(f"tandem node {node}: fault hook fail_checkpoint_write_at_step={full}")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return hook


def after_step(loop: Any, r: Any, channel: EventChannel, writer: Any, samples: int,
               rank_nodes: list[str], checkpoint: bool = False) -> float:
    """What Tandem adds to a step: a checkpoint every ``checkpoint_every`` steps (and at the
    last one, and with ``checkpoint``: the step the ranks stop at; a collective, so every
    rank calls this) and, on rank 0, the step report.
    Returns the seconds this rank was blocked by the checkpoint (0 without one): the whole
    call, the gathering of every rank's RNG states and the state's own collection
    included, not only the writer's copy."""
    cfg = loop.cfg
    blocked = 0.0
    if checkpoint or r.step % cfg.checkpoint_every == 0 or r.step == cfg.steps:
        t0 = time.perf_counter()
        loop.checkpoint(writer)
        blocked = time.perf_counter() - t0
    if loop.rank == 0:
        channel.send(StepReport(
            step=r.step, data_pos=r.data_pos, loss=r.loss, grad_norm=r.grad_norm, lr=r.lr,
            step_time=r.wall_s,
            samples_per_s=samples / r.wall_s if r.wall_s > 0 else 0.0,
            rank_step_times=r.rank_times, rank_nodes=rank_nodes, blocked_s=blocked))
    return blocked


def _num(x: float) -> float | str:
    """JSON has no NaN: send non-finite numbers as their names."""
    import math

    return x if math.isfinite(x) else str(x)


if __name__ == "__main__":
    main()
