"""A task's record moves (``tandem.common.tasks``): forward only, one end, its owner's body."""

from __future__ import annotations

import pytest

from tandem.common import tasks as moves
from tandem.common.errors import TaskConflict
from tandem.common.events import GenerationTask, TaskRecord, TaskState, encode, struct_replace

TASK = GenerationTask(task_id="t1", model="digits", class_label=3, cluster="east")


def queued() -> TaskRecord:
    return moves.queued(TASK, "east")


def test_running_is_written_with_progress_and_only_forward() -> None:
    run = moves.to_running(0.25, cluster="east", worker="w1", attempt=1, started_at=10.0)
    rec = run(queued())
    assert rec is not None and rec.state == TaskState.running
    assert (rec.progress, rec.worker, rec.attempts, rec.started_at) == (0.25, "w1", 1, 10.0)
    # More progress moves it; the same or less from the same delivery does not.
    more = moves.to_running(0.5, cluster="east", worker="w1", attempt=1, started_at=11.0)(rec)
    assert more is not None and more.progress == 0.5 and more.started_at == 10.0
    assert moves.to_running(0.5, cluster="east", worker="w1", attempt=1,
                            started_at=11.0)(more) is None
    # A redelivery elsewhere takes it over from the start of its own run.
    over = moves.to_running(0.1, cluster="west", worker="w2", attempt=2, started_at=20.0)(more)
    assert over is not None and (over.worker, over.attempts, over.cluster) == ("w2", 2, "west")
    assert over.started_at == 10.0  # the first start stays
    for end in (TaskState.succeeded, TaskState.failed, TaskState.cancelled):
        assert run(struct_replace(queued(), state=end)) is None
    assert run(None) is None  # a record is claimed before anything runs


def test_the_end_is_written_once_from_a_live_state_with_the_result() -> None:
    end = moves.to_succeeded(["images/t1/0.png"], cluster="east", worker="w1", attempt=2,
                             started_at=10.0, checkpoint="r/step-4", checkpoint_step=4,
                             timings={"generate_s": 0.5})
    rec = end(queued())
    assert rec is not None and rec.state == TaskState.succeeded
    assert rec.images == ["images/t1/0.png"] and rec.progress == 1.0
    assert (rec.worker, rec.attempts, rec.started_at) == ("w1", 2, 10.0)
    assert (rec.checkpoint, rec.checkpoint_step, rec.timings) == ("r/step-4", 4,
                                                                 {"generate_s": 0.5})
    assert rec.finished_at is not None
    assert end(rec) is None  # never a second success
    cancelled = moves.to_cancelled()(queued())
    assert cancelled is not None and end(cancelled) is None  # a cancel comes first: it stays
    assert moves.to_failed("late")(rec) is None  # nor does a success end otherwise


def test_a_delivery_may_claim_only_its_own_bodys_record() -> None:
    assert moves.claim(TASK, None) is None
    assert moves.claim(TASK, queued()) == queued()
    intruder = struct_replace(TASK, class_label=7)
    with pytest.raises(TaskConflict):
        moves.claim(intruder, queued())
    # A dead-lettered intruder's failure never touches the owner's record.
    assert moves.to_failed("rejected", intruder)(queued()) is None


def test_succeeded_picks_successes_out_of_record_writes_without_being_fooled() -> None:
    done = moves.to_succeeded([], cluster="east", worker="w1", attempt=1,
                              started_at=1.0)(queued())
    assert done is not None and moves.succeeded(encode(done)) == done
    assert moves.succeeded(encode(queued())) is None
    # A prompt that spells the marker is a string: its quotes are escaped in the JSON.
    sly = moves.queued(struct_replace(TASK, prompt='"state":"succeeded"'), "east")
    assert moves.succeeded(encode(sly)) is None
    assert moves.succeeded(b'{"state":"succeeded"') is None  # not a record at all


def test_a_worker_death_in_its_call_is_counted_on_a_live_record_only() -> None:
    batched = moves.to_crashed(alone=False)(queued())
    assert batched is not None and (batched.crashes, batched.crashes_alone) == (1, 0)
    assert batched.state == TaskState.queued  # counted, not moved
    alone = moves.to_crashed(alone=True)(batched)
    assert alone is not None and (alone.crashes, alone.crashes_alone) == (2, 1)
    for end in (TaskState.succeeded, TaskState.failed, TaskState.cancelled):
        assert moves.to_crashed(alone=True)(struct_replace(alone, state=end)) is None
    assert moves.to_crashed(alone=True)(None) is None


KEY = b"a seal key of 16+ characters"


def test_a_seal_is_trusted_only_on_the_gateways_message_while_the_stream_dedupes_it() -> None:
    """A seal spares the read only on the message whose ``Nats-Msg-Id`` is the task id,
    while younger than the gen stream's duplicate window (less the clock allowance): a
    copy published under another id, or after the stream forgot the id, is read (it may
    be a replay of a task that ended or counts crashes)."""
    data = encode(TASK)
    now = 1_000_000.0
    seal = moves.seal(KEY, 7, data, at=now)
    assert seal is not None
    own = {**seal, "Nats-Msg-Id": TASK.task_id}
    assert moves.as_sealed(TASK, data, own, KEY, now=now + 1) == (queued(), 7)
    assert moves.as_sealed(TASK, data, {**seal, "Nats-Msg-Id": "another"}, KEY, now=now) is None
    assert moves.as_sealed(TASK, data, seal, KEY, now=now) is None  # no id at all
    window = moves.SEAL_WINDOW
    assert 0 < window < 600.0  # the gen stream's duplicate window, less the allowance
    assert moves.as_sealed(TASK, data, own, KEY, now=now + window - 1) is not None
    assert moves.as_sealed(TASK, data, own, KEY, now=now + window) is None
    assert moves.as_sealed(TASK, data, own, KEY, now=now - 3600) is None  # from the future
    # The issue time is under the MAC: moved back, the seal is no longer the gateway's.
    rev, issued, mac = seal[moves.RECORD_SEAL].split(".")
    forged = {moves.RECORD_SEAL: f"{rev}.{int(issued) + 3_600_000}.{mac}",
              "Nats-Msg-Id": TASK.task_id}
    assert moves.as_sealed(TASK, data, forged, KEY, now=now + 3600) is None


def test_hand_backs_are_noted_on_a_live_record_and_named_by_its_failure() -> None:
    back = moves.to_handed_back("model 'digits' is not served by w-a")
    rec = back(back(queued()))
    assert rec is not None and rec.reason == (
        "handed back 2 times: model 'digits' is not served by w-a")
    rec = moves.to_handed_back("model 'digits' is not served by w-b")(rec)
    assert rec is not None and moves.handed_back(rec) == (
        "handed back 3 times: model 'digits' is not served by w-a; model 'digits' is not "
        "served by w-b")
    failed = moves.to_failed("exhausted: delivered 5 times")(rec)
    assert failed is not None and failed.reason == f"exhausted: delivered 5 times; " \
        f"{moves.handed_back(rec)}"
    assert back(failed) is None and moves.handed_back(failed) == ""
    done = moves.to_succeeded([], cluster="east", worker="w-c", attempt=5, started_at=1.0)(rec)
    assert done is not None and done.reason == ""
