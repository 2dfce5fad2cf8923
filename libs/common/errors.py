"""Tandem's error tree.

Every error Tandem raises on purpose derives from ``TandemError`` and carries the data
that explains it, so a caller can log or act on fields rather than parse a message::

    TandemError
    ├── SettingsError          a setting is missing or invalid (names each one)
    ├── InvalidToken           a subject token / id failed validation (names the token)
    ├── EventDecodeError       a payload is not a valid event of the expected type
    ├── StreamConflict         an existing stream/consumer/bucket differs from its declaration
    ├── ServerStartError       a local server (nats-server, S3) could not start (e.g. port in use)
    ├── InvalidRunConfig       a training run config failed validation (names each field)
    ├── RunExists              a run id is taken by a run with another config or owner
    ├── RunNotFound            no run with that id in KV ``runs``
    ├── CheckpointError        a checkpoint in S3 cannot be used (names run and step)
    │   ├── CheckpointNotFound     no such committed checkpoint (lists what there is)
    │   └── CheckpointCorrupt      a file or the manifest fails verification (names the file)
    └── HandlerError           raised by message handlers to steer acknowledgement
        ├── Retry              nak with a delay: the message is redelivered
        └── Reject             terminate: the message goes to the DLQ with the reason
            ├── InvalidTask    a delivered task fails the job checks (names each field)
            └── TaskConflict   a task id already belongs to a different task body
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class TandemError(Exception):
    """Base of every error Tandem raises on purpose."""


class SettingsError(TandemError):
    """One or more settings are missing or invalid.

    ``problems`` maps the environment variable name to what is wrong with it.
    """

    def __init__(self, service: str, problems: dict[str, str]) -> None:
        self.service = service
        self.problems = problems
        lines = "; ".join(f"{k}: {v}" for k, v in problems.items())
        super().__init__(f"invalid settings for {service}: {lines}")


class InvalidToken(TandemError, ValueError):
    """A subject token or id is not ``[A-Za-z0-9_-]{1,max}``."""

    def __init__(self, kind: str, value: object, reason: str) -> None:
        self.kind = kind
        self.value = value
        self.reason = reason
        super().__init__(f"invalid {kind} {value!r}: {reason}")


class EventDecodeError(TandemError):
    """A payload could not be decoded as ``event_type``; ``reason`` says why."""

    def __init__(self, event_type: str, reason: str, payload: bytes = b"") -> None:
        self.event_type = event_type
        self.reason = reason
        self.payload = payload
        super().__init__(f"cannot decode {event_type}: {reason}")


@dataclass
class Difference:
    field: str
    existing: Any
    declared: Any


class StreamConflict(TandemError):
    """An existing JetStream object's config differs from its declaration.

    Tandem never deletes or reshapes existing data at start; the operator decides.
    """

    def __init__(self, kind: str, name: str, differences: list[Difference]) -> None:
        self.kind = kind
        self.name = name
        self.differences = differences
        what = ", ".join(
            f"{d.field} is {d.existing!r}, declared {d.declared!r}" for d in differences
        )
        super().__init__(f"{kind} {name} exists with a conflicting config: {what}")


class ServerStartError(TandemError):
    """A local server could not be started; ``reason`` says why (port in use, ...)."""

    def __init__(self, server: str, reason: str) -> None:
        self.server = server
        self.reason = reason
        super().__init__(f"cannot start {server}: {reason}")


class CheckpointError(TandemError):
    """A checkpoint in S3 cannot be used; ``run_id`` and ``step`` name it."""

    def __init__(self, run_id: str, step: int | None, reason: str) -> None:
        self.run_id = run_id
        self.step = step
        self.reason = reason
        where = f"run {run_id}" if step is None else f"run {run_id} step {step}"
        super().__init__(f"checkpoint of {where}: {reason}")


class CheckpointNotFound(CheckpointError):
    """No (valid) committed checkpoint matches; ``available`` lists the committed steps."""

    def __init__(self, run_id: str, step: int | None, reason: str,
                 available: list[int] | None = None) -> None:
        self.available = available or []
        super().__init__(run_id, step, reason)


class CheckpointCorrupt(CheckpointError):
    """``name`` (a file, or ``manifest.json``) does not match what the manifest promises."""

    def __init__(self, run_id: str, step: int | None, name: str, reason: str) -> None:
        self.name = name
        super().__init__(run_id, step, f"{name}: {reason}")


class HandlerError(TandemError):
    """Raised by a message handler to choose how its message is acknowledged."""


class Retry(HandlerError):
    """Nak the message; it is redelivered after ``delay`` seconds."""

    def __init__(self, reason: str, delay: float = 1.0) -> None:
        self.reason = reason
        self.delay = delay
        super().__init__(f"retry in {delay:.1f}s: {reason}")


class Reject(HandlerError):
    """Terminate the message and copy it to the DLQ with ``reason``; never retried."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class InvalidTask(Reject):
    """A delivered generation task fails ``jobs.check_task``; ``problems`` lists why."""

    def __init__(self, task_id: str, problems: list[Any]) -> None:
        self.task_id = task_id
        self.problems = problems
        super().__init__("invalid task: " + "; ".join(str(p) for p in problems))


class TaskConflict(Reject):
    """Task ``task_id`` is recorded with a different body: the delivery is someone
    else's message under that id (a hijack or a client bug), never run."""

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        super().__init__(f"conflict: task id {task_id!r} is already recorded with a "
                         "different task body")


class InvalidRunConfig(TandemError, ValueError):
    """A training run config is invalid; ``problems`` maps each field path to the reason."""

    def __init__(self, problems: dict[str, str]) -> None:
        self.problems = problems
        lines = "; ".join(f"{k}: {v}" for k, v in problems.items())
        super().__init__(f"invalid run config: {lines}")


class TooManyRuns(TandemError):
    """``owner`` has ``limit`` training runs or more not finished (``unfinished``)."""

    def __init__(self, owner: str, unfinished: list[str], limit: int) -> None:
        self.owner, self.unfinished, self.limit = owner, unfinished, limit
        super().__init__(f"key {owner!r} has {len(unfinished)} training runs not finished "
                         f"({', '.join(unfinished)}); the limit is {limit}")


class RunExists(TandemError):
    """``run_id`` is already used by a run with a different config."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(f"run {run_id!r} already exists with a different config or "
                         "owner")


class RunNotFound(TandemError, LookupError):
    """No run ``run_id`` in KV ``runs``."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        super().__init__(f"no run {run_id!r}")
