"""docs/bus-api.md and `tandem schema`: generated from the declarations, never stale, and
the printed schemas accept what the encoders write and refuse what the decoders refuse."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest

from tandem.cli import bus_api, wire_types
from tandem.cli.main import main
from tandem.common import events, subjects
from tandem.common.events import (
    CheckpointManifest,
    CheckpointMirrored,
    CheckpointWritten,
    DeadLetter,
    FileEntry,
    GenerationTask,
    TaskState,
    TrainStep,
)
from tandem.common.runs import RunConfig
from tandem.common.subjects import Subject

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / bus_api.DOC

# Functions of subjects.py that build something other than a subject.
NOT_SUBJECTS = {"token", "token_list", "node", "lane", "node_key", "cluster_keys",
                "gen_stream_name", "is_inbox", "service_inbox"}


def _printed(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        main(["schema", *argv])
    out = capsys.readouterr()
    return int(exit_.value.code or 0), out.out, out.err


def _validator(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    return jsonschema.Draft202012Validator(schema)


# ------------------------------------------------------------------------------- the doc


def test_bus_api_doc_matches_its_generator() -> None:
    text = DOC.read_text()
    assert bus_api.rewrite(text) == text, (
        f"{bus_api.DOC} is stale: run `{bus_api.REGENERATE}` and commit the result")


def test_every_declared_subject_stream_and_bucket_is_in_the_doc() -> None:
    text = DOC.read_text()
    declared = [v for v in vars(subjects).values() if isinstance(v, Subject)]
    routed = {id(r.subject) for r in bus_api.ROUTES}
    assert [s.template for s in declared if id(s) not in routed] == []
    for route in bus_api.ROUTES:
        assert f"`{route.form}`" in text
    for kind in subjects.TRAIN_KINDS:
        assert f"`train.<run>.{kind}`" in text
    for kind in subjects.CKPT_KINDS:
        assert f"`ckpt.<run>.{kind}`" in text
    builders = [name for name, f in vars(subjects).items()
                if inspect.isfunction(f) and f.__module__ == subjects.__name__
                and not name.startswith("_") and name not in NOT_SUBJECTS]
    assert [b for b in builders if f"`subjects.{b}(" not in text] == []
    for spec in bus_api.stream_specs():
        assert f"`{bus_api.placeholder(spec.name)}`" in text
    for kv in bus_api.kv_specs():
        assert f"| `{kv.bucket}` |" in text
    for c in bus_api.consumer_specs():
        assert f"`{bus_api.placeholder(c.durable)}`" in text
    assert "## Job service (tandem-jobs)" in text


def test_each_subjects_payload_is_a_wire_type_that_says_it_travels_there() -> None:
    for route in bus_api.ROUTES:
        if route.payload is not None:
            entry = wire_types.get(route.payload)
            assert f"`{route.form}`" in entry.travels, entry.name
    for _, value in bus_api.KV_VALUES.values():
        wire_types.get(value)


def test_check_fails_on_a_stale_doc_naming_the_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "bus-api.md"
    stale.write_text(DOC.read_text().replace("| `TRAIN` |", "| `TRAINS` |", 1))
    code, _, err = _printed(capsys, "--check", "--doc", str(stale))
    assert code == 1 and bus_api.REGENERATE in err
    code, _, _ = _printed(capsys, "--write-docs", "--doc", str(stale))
    assert code == 0 and stale.read_text() == DOC.read_text()


def test_a_doc_without_a_generated_block_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "bus-api.md"
    doc.write_text("# x\n<!-- generated: subjects -->\n<!-- end generated -->\n")
    code, _, err = _printed(capsys, "--check", "--doc", str(doc))
    assert code == 2 and "missing" in err and "schemas" in err


def test_readme_links_the_bus_api_doc() -> None:
    assert "docs/bus-api.md" in (ROOT / "README.md").read_text()


# ---------------------------------------------------------------------------- the schemas


@pytest.mark.parametrize("name", wire_types.names())
def test_every_schema_is_valid_json_schema(name: str) -> None:
    jsonschema.Draft202012Validator.check_schema(wire_types.schema(wire_types.get(name)))


def test_schema_with_no_name_prints_every_type(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _printed(capsys)
    printed = json.loads(out)
    assert code == 0 and list(printed) == wire_types.names()
    assert printed == json.loads(json.dumps(wire_types.all_schemas()))


def test_list_names_every_type(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _printed(capsys, "--list")
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()] == wire_types.names()


def test_unknown_name_exits_2_naming_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _printed(capsys, "Nope")
    assert code == 2 and out == ""
    assert "'Nope'" in err and all(n in err for n in wire_types.names())


MANIFEST = CheckpointManifest(run_id="r1", step=100, files=[
    FileEntry(name="model.safetensors", size=10, sha256="ab" * 32)])

# (schema name, an event Tandem encodes, the same payload with one field of the wrong type)
ROUND_TRIPS: list[tuple[str, Any, dict[str, Any]]] = [
    ("GenerationTask",
     GenerationTask(task_id="t1", model="digits", class_label=3, cluster="east"),
     {"steps": "twenty"}),
    ("TaskRecord", events.TaskRecord(task=GenerationTask(task_id="t1", model="digits"),
                                     state=TaskState.succeeded, images=["images/t1/0.png"],
                                     timings={"generate_s": 0.5}),
     {"images": "images/t1/0.png"}),
    ("CancelNotice", events.CancelNotice(task_id="t1", reason="cancelled by client"),
     {"task_id": 1}),
    ("TrainEvent", TrainStep(run_id="r1", step=3, loss=0.5), {"kind": "weights"}),
    ("TrainEvent", CheckpointWritten(run_id="r1", step=100, path="/c/step-100",
                                     manifest=MANIFEST), {"manifest": {"files": 3}}),
    ("CkptEvent", CheckpointMirrored(run_id="r1", step=100, uri="s3://b/runs/r1/"),
     {"step": 1.5}),
    ("DeadLetter", DeadLetter(stream="GEN_EAST", subject="gen.east.batch", seq=4,
                              num_delivered=5, reason="exhausted", data=b"\x00\xff{"),
     {"seq": "4"}),
    ("TaskRecord", events.TaskRecord(task=GenerationTask(task_id="t1", model="digits")),
     {"task": {"task_id": 1, "model": "digits"}}),
]


@pytest.mark.parametrize(("name", "event", "wrong"), ROUND_TRIPS,
                         ids=[f"{n}-{type(e).__name__}" for n, e, _ in ROUND_TRIPS])
def test_printed_schema_accepts_the_encoded_event_and_refuses_a_wrong_type(
        capsys: pytest.CaptureFixture[str], name: str, event: Any,
        wrong: dict[str, Any]) -> None:
    code, out, _ = _printed(capsys, name)
    assert code == 0
    validator = _validator(json.loads(out))
    payload = json.loads(events.encode(event))
    validator.validate(payload)
    bad = {**payload, **wrong}
    assert not validator.is_valid(bad)
    with pytest.raises(events.EventDecodeError):  # the decoder refuses it as well
        events.decode(msgspec.json.encode(bad), wire_types.get(name).type)


def test_pydantic_job_bodies_round_trip_through_their_printed_schemas(
        capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = _printed(capsys, "RunConfig")
    run = _validator(json.loads(out))
    run.validate(RunConfig(run_id="r1", steps=50).model_dump(mode="json"))
    assert not run.is_valid({"steps": "fifty"})
    assert not run.is_valid({"stepz": 50})  # unknown keys are errors in a run config

    _, out, _ = _printed(capsys, "GenerationRequest")
    request = _validator(json.loads(out))
    request.validate({"model": "digits", "class_label": 3, "steps": 50})
    assert not request.is_valid({"model": "digits", "num_images": "two"})
    assert not request.is_valid({"model": "a.b"})  # the token pattern is in this schema


def test_the_client_column_says_admin_where_the_client_user_may_not() -> None:
    """The doc told integrators to publish on gen.* and subscribe to the DLQ, which the
    shared client NATS user is refused; the column now comes from its permissions."""
    cells = {r.form: bus_api.client_may(r) for r in bus_api.ROUTES}
    assert cells["gen.<cluster>.<lane>"] == "publish (admin)"
    assert cells["dlq.<stream>"] == "subscribe (admin)"
    assert cells["tasks.written.<task>"] == "subscribe"
    assert cells["tandem.jobs.generate"] == "request"
    assert cells["$KV.tasks.<task>"] == "—"
