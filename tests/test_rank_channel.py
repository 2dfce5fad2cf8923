"""The rank → coordinator channel: every kind round-trips as its type, anything else is
refused with the reason, and the coordinator's end treats a bad line as the rank failing."""

from __future__ import annotations

import asyncio
import typing
from pathlib import Path

import msgspec
import pytest
import structlog

from tandem.common import log
from tandem.common.errors import EventDecodeError
from tandem.common.events import CheckpointManifest, CheckpointWritten, FileEntry
from tandem.common.runs import parse_run_config
from tandem.trainer import channel
from tandem.trainer.channel import Hello, StepReport

ONE_OF_EACH = [
    Hello(rank=1, pid=4242, node="n1", attempt=3, world=2),
    StepReport(step=7, data_pos=6, loss=0.25, grad_norm=1.5, lr=1e-3, step_time=0.05,
               samples_per_s=640.0, rank_step_times=[0.04, 0.05], rank_nodes=["n0", "n1"],
               blocked_s=0.002, at=1.0),
    CheckpointWritten(run_id="r1", step=8, path="/ckpt/r1/step-8", node="n0", cluster="c",
                      manifest=CheckpointManifest(run_id="r1", step=8, created_at=2.0, files=[
                          FileEntry(name="model.safetensors", size=10, sha256="ab" * 32)]),
                      blocked_s=0.01, write_s=0.2, at=3.0),
    channel.CheckpointWriteFailed(step=9, error="OSError(28, 'No space left on device')"),
    channel.Anomaly(step=10, data_pos=9, anomaly="nonfinite", loss="nan", grad_norm=2.0,
            evidence={"loss_finite": False, "grad_norm_finite": True}),
    channel.Invalid(rank=1, error="ValueError: data.path '/data/x' is not a directory"),
    channel.Preempted(rank=1, node="n1", step=12, signalled=True),
    channel.Done(step=10),
    channel.Bye(rank=0, code=0),
    channel.Resumed(step=40, skipped={60: "n1: shards/__2_0.distcp: sha256 0f..."}),
]


def test_the_union_holds_every_kind_the_rank_sends() -> None:
    assert set(typing.get_args(channel.RankMessage)) == {type(m) for m in ONE_OF_EACH}


@pytest.mark.parametrize("message", ONE_OF_EACH, ids=lambda m: type(m).__name__)
def test_every_kind_round_trips_as_its_own_type(message: channel.RankMessage) -> None:
    line = msgspec.json.encode(message)
    assert msgspec.json.decode(line)["kind"] == msgspec.inspect.type_info(type(message)).tag
    back = channel.decode(line)
    assert type(back) is type(message) and back == message


def test_a_non_finite_step_loss_arrives_as_none() -> None:
    step = msgspec.structs.replace(ONE_OF_EACH[1], loss=float("nan"), grad_norm=float("inf"))
    back = channel.decode(msgspec.json.encode(step))
    assert isinstance(back, StepReport) and back.loss is None and back.grad_norm is None


@pytest.mark.parametrize(("line", "reason"), [
    (b'{"kind": "helo", "rank": 0}', "Invalid value 'helo' - at `$.kind`"),
    (b'{"rank": 0, "code": 0}', "missing required field `kind`"),
    (b'{"kind": "step", "step": "seven"}', "Expected `int`, got `str` - at `$.step`"),
    (b'{"kind": "hello", "rank": 0, "node": "n", "attempt": 1, "world": 1}',
     "missing required field `pid`"),
    (b'{"kind": "bye", "rank": 0, "code": 0', "truncated"),
])
def test_an_unknown_kind_or_a_bad_field_is_refused_with_the_reason(line: bytes,
                                                                   reason: str) -> None:
    with pytest.raises(EventDecodeError) as exc:
        channel.decode(line)
    assert exc.value.event_type == "rank message"
    assert reason in exc.value.reason and exc.value.payload == line
    assert reason in str(exc.value)


async def test_the_coordinator_decodes_what_the_rank_sends_and_a_bad_line_is_a_death(
        tmp_path: Path) -> None:
    from tandem.trainer.launcher import LocalLauncher
    from tandem.trainer.supervisor import RunSupervisor, SupervisorConfig

    cfg = parse_run_config({"run_id": "r1", "ranks": 1})
    sup = RunSupervisor(None, SupervisorConfig(  # type: ignore[arg-type]  # no bus used
        checkpoint_root=tmp_path, work_root=tmp_path, cluster="c", node="n0"), "r1", cfg,
        LocalLauncher(), log.get("test"))
    server = await asyncio.start_server(sup.handle_connection, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        sender = channel.EventChannel(f"127.0.0.1:{port}", exit_on_loss=False)
        hello = Hello(rank=0, pid=1, node="n0", attempt=1, world=1)
        for message in (hello, *ONE_OF_EACH[1:-1]):
            sender.send(message)
        await asyncio.to_thread(sender.close)
        got = [await asyncio.wait_for(sup.q.get(), 10) for _ in range(len(ONE_OF_EACH))]
        assert got[-1] == ("closed", 1, 0)
        assert [m for _, _, _, m in got[:-1]] == [hello, *ONE_OF_EACH[1:-1]]
        assert {(tag, attempt, rank) for tag, attempt, rank, _ in got[:-1]} == {("msg", 1, 0)}

        # A line that does not decode: logged with the reason, then the connection ends
        # without a goodbye, which the watchdog reads as the rank dying.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        with structlog.testing.capture_logs() as logs:
            writer.write(msgspec.json.encode(hello) + b"\n" + b'{"kind": "stepp"}\n'
                         + msgspec.json.encode(channel.Bye(rank=0, code=0)) + b"\n")
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed by the coordinator
            assert (await asyncio.wait_for(sup.q.get(), 10))[3] == hello
            assert await asyncio.wait_for(sup.q.get(), 10) == ("closed", 1, 0)
        assert sup.q.empty()  # the bye after the bad line was never read
        bad = [e for e in logs if e["event"] == "relay.bad_message"]
        assert len(bad) == 1 and bad[0]["rank"] == 0 and "$.kind" in bad[0]["reason"]
        writer.close()
        await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()


async def test_the_largest_step_report_a_run_can_send_reaches_the_coordinator(
        tmp_path: Path) -> None:
    """A StepReport of RunConfig's most ranks (1024), every node named with the longest
    token (64 characters): a line well over asyncio's default 64 KiB limit, which would
    end rank 0's connection (read as its death). The relay (``listen``) reads it whole."""
    from tandem.common.subjects import MAX_TOKEN
    from tandem.trainer.launcher import LocalLauncher
    from tandem.trainer.supervisor import RunSupervisor, SupervisorConfig

    ranks = 1024
    nodes = [f"gke-train-pool-{i:04d}-".ljust(MAX_TOKEN, "x") for i in range(ranks // 8)]
    cfg = parse_run_config({"run_id": "big", "ranks": ranks, "nodes": nodes, "batch_size": 1})
    sup = RunSupervisor(None, SupervisorConfig(  # type: ignore[arg-type]  # no bus used
        checkpoint_root=tmp_path, work_root=tmp_path, cluster="c", node="n0"), "big", cfg,
        LocalLauncher(), log.get("test"))
    report = StepReport(step=1, data_pos=1, loss=0.1234567, grad_norm=0.98765, lr=2e-4,
                        step_time=0.123456789, samples_per_s=12345.678,
                        rank_step_times=[0.012345678901234 + i * 1e-9 for i in range(ranks)],
                        rank_nodes=[n for n in nodes for _ in range(8)])
    assert len(msgspec.json.encode(report)) > 64 * 1024
    server = await sup.listen()
    try:
        sender = channel.EventChannel(sup.relay_address, exit_on_loss=False)
        hello = Hello(rank=0, pid=1, node=nodes[0], attempt=1, world=ranks)
        for message in (hello, report, channel.Bye(rank=0, code=0)):
            sender.send(message)
        await asyncio.to_thread(sender.close)
        got = [await asyncio.wait_for(sup.q.get(), 10) for _ in range(4)]
        assert [g[3] for g in got[:3]] == [hello, report, channel.Bye(rank=0, code=0)]
        assert got[3] == ("closed", 1, 0)
    finally:
        server.close()
        await server.wait_closed()


async def test_a_coordinator_stopping_with_ranks_connected_logs_no_callback_error(
        tmp_path: Path) -> None:
    """A coordinator stopping (SIGTERM) cancels each rank's connection handler, as the
    event loop's end does: the handler ends quietly (its rank's close still queued), not
    with asyncio's "Exception in callback" from the server's done callback."""
    from tandem.trainer.launcher import LocalLauncher
    from tandem.trainer.supervisor import RunSupervisor, SupervisorConfig

    cfg = parse_run_config({"run_id": "stop", "ranks": 1})
    sup = RunSupervisor(None, SupervisorConfig(  # type: ignore[arg-type]  # no bus used
        checkpoint_root=tmp_path, work_root=tmp_path, cluster="c", node="n0"), "stop", cfg,
        LocalLauncher(), log.get("test"))
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    server = await sup.listen()
    sender = channel.EventChannel(sup.relay_address, exit_on_loss=False)
    try:
        sender.send(Hello(rank=0, pid=1, node="n0", attempt=1, world=1))
        assert (await asyncio.wait_for(sup.q.get(), 10))[3].rank == 0
        handlers = [t for t in asyncio.all_tasks()
                    if t.get_coro().__qualname__.endswith("handle_connection")]
        assert len(handlers) == 1
        handlers[0].cancel()
        await asyncio.wait(handlers)
        assert await asyncio.wait_for(sup.q.get(), 10) == ("closed", 1, 0)
        await asyncio.sleep(0)  # the server's done callback runs on the next turn
        assert errors == []
    finally:
        loop.set_exception_handler(previous)
        await asyncio.to_thread(sender.close)
        server.close()
        await server.wait_closed()
