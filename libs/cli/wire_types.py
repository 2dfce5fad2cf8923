"""Every type that crosses the bus or the job API, listed once, and its JSON Schema.

``WIRE_TYPES`` is the one list: a name (what ``tandem schema <name>`` and
``docs/bus-api.md`` call it), the type (a msgspec Struct, a tagged union of Structs, or a
pydantic model) and where it travels. Adding a type to the contract is adding a line
here; ``tandem schema --write-docs`` then puts its schema in the doc, and
``tests/test_bus_api.py`` fails until it has.

Schemas are generated, never written by hand: ``msgspec.json.schema`` for Structs and
unions (JSON Schema 2020-12; unknown fields are allowed, as the decoders ignore them),
``model_json_schema()`` (validation mode) for pydantic models. Each schema stands alone,
with its own ``$defs``. Checks made in code rather than by type (the token rule on ids in
``GenerationTask.__post_init__``, pydantic validators) are not in the schemas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import BaseModel

from tandem.common import events
from tandem.common.jobs import GenerationRequest
from tandem.common.runs import RunConfig

DIALECT = "https://json-schema.org/draft/2020-12/schema"


@dataclass(frozen=True)
class WireType:
    name: str
    type: Any  # a msgspec Struct, a union of Structs, or a pydantic model
    travels: str  # where it travels: subjects (`<placeholder>` form), KV buckets, HTTP routes


# In the order the doc shows them: job bodies, generation, training, checkpoints, the DLQ,
# then the fleet's own traffic.
WIRE_TYPES: list[WireType] = [
    WireType("GenerationTask", events.GenerationTask,
             "`gen.<cluster>.<lane>` (JetStream, `GEN_<CLUSTER>`); the `task` of KV `tasks`"),
    WireType("GenerationRequest", GenerationRequest,
             "`tandem.jobs.generate` request (the job service), HTTP `POST /v1/generations` "
             "body"),
    WireType("RunConfig", RunConfig,
             "`tandem.jobs.train` request (the job service), HTTP `POST /v1/training-runs` "
             "body, `tandem train submit`; the `config` of KV `runs`"),
    WireType("TaskRecord", events.TaskRecord,
             "KV `tasks`, key `<task>`: each write on `$KV.tasks.<task>`"),
    WireType("GenerationProgress", events.GenerationProgress, "`gen.progress.<task>` (core NATS)"),
    WireType("CancelNotice", events.CancelNotice, "KV `cancels`, key `<task>`"),
    WireType("TrainEvent", events.TrainEvent,
             "stream `TRAIN`: `train.<run>.status`, `train.<run>.step`, `train.<run>.checkpoint`, "
             "tagged by `kind`"),
    WireType("TrainStatus", events.TrainStatus, "`train.<run>.status` (JetStream)"),
    WireType("TrainStep", events.TrainStep, "`train.<run>.step` (JetStream)"),
    WireType("CheckpointWritten", events.CheckpointWritten,
             "`train.<run>.checkpoint` and `mirror.<cluster>.<node>` (JetStream)"),
    WireType("RunRecord", events.RunRecord, "KV `runs`, key `<run>`"),
    WireType("CkptEvent", events.CkptEvent,
             "stream `CKPT`: `ckpt.<run>.mirrored`, `ckpt.<run>.failed`, `ckpt.<run>.pruned`, "
             "`ckpt.<run>.part`, tagged by `kind`"),
    WireType("CheckpointMirrored", events.CheckpointMirrored, "`ckpt.<run>.mirrored` (JetStream)"),
    WireType("CheckpointFailed", events.CheckpointFailed, "`ckpt.<run>.failed` (JetStream)"),
    WireType("CheckpointPruned", events.CheckpointPruned, "`ckpt.<run>.pruned` (JetStream)"),
    WireType("CheckpointPartMirrored", events.CheckpointPartMirrored,
             "`ckpt.<run>.part` (JetStream)"),
    WireType("DeadLetter", events.DeadLetter, "`dlq.<stream>` (JetStream, `DLQ`)"),
    WireType("NodeTelemetry", events.NodeTelemetry, "`telemetry.<cluster>.<node>` (JetStream)"),
    WireType("HealthTransition", events.HealthTransition, "`health.<cluster>.<node>` (JetStream)"),
    WireType("ModelsLoaded", events.ModelsLoaded, "`models.<cluster>.<node>` (core NATS)"),
    WireType("NodeHeartbeat", events.NodeHeartbeat, "KV `nodes`, key `<cluster>.<node>`"),
    WireType("DrainRecord", events.DrainRecord, "KV `drains`, key `<cluster>.<node>`"),
    WireType("IdempotencyRecord", events.IdempotencyRecord, "KV `idempotency`"),
    WireType("RateMark", events.RateMark, "KV `rates`, key `<API key name>`"),
    WireType("SseHolds", events.SseHolds, "KV `sse`, key `<API key name>`"),
    WireType("NodeLaunch", events.NodeLaunch,
             "`trainer.node.<cluster>.<node>` request (core NATS), tagged by `kind`"),
    WireType("NodeStop", events.NodeStop,
             "`trainer.node.<cluster>.<node>` request (core NATS), tagged by `kind`"),
    WireType("NodeInterrupt", events.NodeInterrupt,
             "`trainer.node.<cluster>.<node>` request (core NATS), tagged by `kind`"),
    WireType("NodeReply", events.NodeReply, "reply to `trainer.node.<cluster>.<node>`"),
    WireType("NodeReport", events.NodeReport, "`trainer.report.<cluster>.<run>` request "
             "(core NATS)"),
    WireType("NodeReportReply", events.NodeReportReply,
             "reply to `trainer.report.<cluster>.<run>`"),
]


class UnknownType(LookupError):
    """No wire type has this name; ``known`` lists those that do."""

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(f"no wire type {name!r}; known: {', '.join(known)}")
        self.name = name
        self.known = known


def names() -> list[str]:
    return [w.name for w in WIRE_TYPES]


def get(name: str) -> WireType:
    """The entry called ``name``; ``UnknownType`` naming the known ones otherwise."""
    for w in WIRE_TYPES:
        if w.name == name:
            return w
    raise UnknownType(name, names())


def schema(entry: WireType) -> dict[str, Any]:
    """The JSON Schema (2020-12) of one entry, self-contained."""
    t = entry.type
    if isinstance(t, type) and issubclass(t, BaseModel):
        out = t.model_json_schema()
    else:
        out = msgspec.json.schema(t)
    return {"$schema": DIALECT, "title": entry.name, **out}


def all_schemas() -> dict[str, dict[str, Any]]:
    """Name -> schema for every entry, in ``WIRE_TYPES`` order."""
    return {w.name: schema(w) for w in WIRE_TYPES}
