"""Settings, subject tokens and event decoding reject bad input with errors that name it."""

from __future__ import annotations

import msgspec
import pytest

from tandem.common import streams, subjects
from tandem.common.errors import EventDecodeError, InvalidToken, SettingsError
from tandem.common.events import (
    GenerationTask,
    NodeLaunch,
    NodeOrder,
    NodeStop,
    TrainEvent,
    TrainStep,
    decode,
    encode,
)
from tandem.common.settings import Settings, load


def test_bad_setting_names_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_METRICS_PORT", "not-a-port")
    monkeypatch.setenv("TANDEM_NATS_URL", "http://example")
    with pytest.raises(SettingsError) as err:
        load(Settings, "gateway")
    assert set(err.value.problems) == {"TANDEM_METRICS_PORT", "TANDEM_NATS_URL"}
    assert "gateway" in str(err.value)


def test_settings_read_from_prefixed_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CLUSTER", "east")
    monkeypatch.setenv("TANDEM_NATS_URL", "nats://a:1, nats://b:2")
    s = load(Settings)
    assert s.cluster == "east"
    assert s.nats_servers == ["nats://a:1", "nats://b:2"]


@pytest.mark.parametrize("bad", ["", "a.b", "a*", ">", "a b", "x" * 65, "é"])
def test_bad_subject_token_raises_naming_it(bad: str) -> None:
    with pytest.raises(InvalidToken) as err:
        subjects.gen(bad, "batch")
    assert err.value.kind == "cluster"
    assert repr(bad) in str(err.value)


def test_subjects_are_built_from_tokens() -> None:
    assert subjects.gen("east", "interactive") == "gen.east.interactive"
    # A task's record writes travel on its KV key's subject, in the bucket streams declares.
    assert subjects.task_record("t-1") == f"$KV.{streams.KV_TASKS}.t-1"
    assert subjects.TASK_RECORD.wildcard == f"$KV.{streams.KV_TASKS}.*"
    with pytest.raises(InvalidToken):
        subjects.task_record("t.1")
    assert subjects.GEN.wildcard == "gen.*.*"
    with pytest.raises(InvalidToken):
        subjects.gen("east", "urgent")
    with pytest.raises(InvalidToken):
        subjects.train("run1", "weights")
    assert subjects.trainer_node("east", "gpu-7") == "trainer.node.east.gpu-7"
    assert subjects.trainer_report("east", "r1") == "trainer.report.east.r1"
    assert subjects.TRAINER_REPORT.filter(cluster="east") == "trainer.report.east.*"
    with pytest.raises(InvalidToken):
        subjects.trainer_node("east", "gpu.7")


def test_a_kubernetes_node_name_with_dots_is_one_token_on_every_side(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """EKS names nodes ``ip-10-0-0-1.ec2.internal``: the pod's TANDEM_NODE (from
    spec.nodeName), a run's ``nodes`` and the subjects built from them agree on one token."""
    from tandem.common.runs import RunConfig

    eks = "ip-10-0-0-1.us-west-2.compute.internal"
    monkeypatch.setenv("TANDEM_NODE", eks)
    node = load(Settings).node
    assert node == "ip-10-0-0-1_us-west-2_compute_internal"
    assert subjects.trainer_node("east", node) == f"trainer.node.east.{node}"
    run = RunConfig(run_id="r1", nodes=[eks, "gpu-node-7"])
    assert run.nodes == [node, "gpu-node-7"]
    with pytest.raises(ValueError, match="repeat"):  # the same node, named either way
        RunConfig(run_id="r1", nodes=[eks, node])
    # What is neither a Kubernetes name nor a token is refused, naming what is wrong.
    for bad in ("a..b", ".a", "a.", "a.*", "a.>", "Gpu.Node", "a b.c", "a_b.c"):
        with pytest.raises(InvalidToken, match="Kubernetes node name") as err:
            subjects.node(bad)
        assert err.value.kind == "node"
    monkeypatch.setenv("TANDEM_NODE", "gpu.*")
    with pytest.raises(SettingsError) as serr:
        load(Settings)
    assert "TANDEM_NODE" in serr.value.problems


def test_event_decoding_ignores_unknown_fields() -> None:
    data = b'{"task_id":"t1","model":"digits","future_field":{"x":1},"v":2}'
    task = decode(data, GenerationTask)
    assert task.task_id == "t1" and task.v == 2


@pytest.mark.parametrize("payload", [b"", b"not json", b"[]", b'{"task_id": 5}',
                                     b'{"task_id":"a.b","model":"m"}', b"\xff\xfe"])
def test_malformed_payload_raises_one_typed_error(payload: bytes) -> None:
    with pytest.raises(EventDecodeError) as err:
        decode(payload, GenerationTask)
    assert err.value.event_type == "GenerationTask"
    assert err.value.reason


def test_tagged_unions_decode_each_kind() -> None:
    step = TrainStep(run_id="r", step=3, loss=0.5)
    assert decode(encode(step), TrainEvent) == step
    with pytest.raises(EventDecodeError):
        decode(msgspec.json.encode({"kind": "nope", "run_id": "r"}), TrainEvent)
    launch = NodeLaunch(run_id="r", attempt=2, node="n", node_rank=1, nnodes=2, per_node=8,
                        master_addr="10.0.0.1", master_port=29500, spec={"run_id": "r"})
    stop = NodeStop(run_id="r", attempt=2, reason="attempt ended")
    assert decode(encode(launch), NodeOrder) == launch
    assert decode(encode(stop), NodeOrder) == stop
    with pytest.raises(EventDecodeError):
        decode(b'{"kind":"reboot","run_id":"r","attempt":1}', NodeOrder)
