"""The simulated backend's fault script: what goes wrong, on which GPU, and when.

One fault per line (or per ``;``), ``#`` starts a comment::

    # at(s)  kind          parameters
    10       xid           gpu=0 code=79
    20       ecc           gpu=1 count=2     # uncorrectable, with a row remap pending
    20       ecc-corrected gpu=1 count=500
    30       thermal       gpu=2 duration=60 temp=88
    30       power-brake   gpu=3 duration=60
    40       slow          gpu=4 factor=0.5
    45       nvlink        gpu=5 count=200
    45       pcie-replay   gpu=5 count=500
    48       remap-failure gpu=6
    50       off-bus       gpu=7
    60       agent-die

A JSON list of objects with the same fields (``[{"at": 10, "kind": "xid", "code": 79}]``)
is accepted too. ``at`` is seconds since the agent started; ``duration`` defaults to
forever. Any mistake raises ``FaultScriptError`` naming the line and the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

import msgspec

from tandem.common.errors import TandemError

FaultKind = Literal[
    "xid", "ecc", "ecc-corrected", "thermal", "power-brake", "slow", "off-bus",
    "nvlink", "pcie-replay", "remap-failure", "agent-die",
]


class FaultScriptError(TandemError, ValueError):
    """A fault script line is wrong; ``line`` is 1-based (0 for the script as a whole)."""

    def __init__(self, line: int, reason: str) -> None:
        self.line = line
        self.reason = reason
        super().__init__(f"fault script line {line}: {reason}" if line else
                         f"fault script: {reason}")


class Fault(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, frozen=True):
    at: float
    kind: FaultKind
    gpu: int = 0
    code: int = 0  # xid
    count: int = 1  # ecc, ecc-corrected, nvlink, pcie-replay; xid repeats
    duration: float = math.inf  # thermal, power-brake, slow
    factor: float = 0.5  # slow: SM clock multiplier
    temp: float = 88.0  # thermal: temperature the GPU settles at

    def __post_init__(self) -> None:
        if self.at < 0:
            raise ValueError("at must be >= 0")
        if self.gpu < 0:
            raise ValueError("gpu must be >= 0")
        if self.kind == "xid" and self.code <= 0:
            raise ValueError("xid needs code=<XID number>")
        if self.count < 1:
            raise ValueError("count must be >= 1")
        if self.duration <= 0:
            raise ValueError("duration must be > 0")
        if not 0 < self.factor <= 1:
            raise ValueError("factor must be in (0, 1]")

    def active(self, t: float) -> bool:
        """True while a lasting fault (thermal, power-brake, slow) is in effect at ``t``."""
        return self.at <= t < self.at + self.duration


def _convert(fields: dict[str, object], line: int) -> Fault:
    try:
        return msgspec.convert(fields, Fault, strict=False)
    except (msgspec.ValidationError, ValueError) as exc:
        raise FaultScriptError(line, str(exc)) from None


def _parse_line(text: str, line: int) -> Fault | None:
    text = text.split("#", 1)[0].strip()
    if not text:
        return None
    parts = text.split()
    if len(parts) < 2:
        raise FaultScriptError(line, f"expected '<at> <kind> [key=value ...]', got {text!r}")
    fields: dict[str, object] = {"at": parts[0].removesuffix("s"), "kind": parts[1]}
    for part in parts[2:]:
        key, eq, value = part.partition("=")
        if not eq or not key or not value:
            raise FaultScriptError(line, f"expected key=value, got {part!r}")
        fields[key] = value
    return _convert(fields, line)


def parse(text: str) -> list[Fault]:
    """Parse a script (lines, ``;``-separated, or a JSON list), sorted by time."""
    stripped = text.strip()
    faults: list[Fault] = []
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise FaultScriptError(0, f"invalid JSON: {exc}") from None
        for i, item in enumerate(items, 1):
            if not isinstance(item, dict):
                raise FaultScriptError(i, f"expected an object, got {item!r}")
            faults.append(_convert(item, i))
    else:
        lines = stripped.replace(";", "\n").splitlines()
        for i, raw in enumerate(lines, 1):
            fault = _parse_line(raw, i)
            if fault is not None:
                faults.append(fault)
    return sorted(faults, key=lambda f: f.at)


def load(value: str) -> list[Fault]:
    """``value`` is a path to a script file, or the script itself."""
    value = value.strip()
    if not value:
        return []
    path = Path(value)
    if "\n" not in value and ";" not in value and len(value) < 4096 and path.is_file():
        return parse(path.read_text())
    return parse(value)


def check_gpus(faults: list[Fault], gpus: int) -> None:
    for f in faults:
        if f.gpu >= gpus:
            raise FaultScriptError(0, f"{f.kind} at {f.at:g}s names gpu {f.gpu}, "
                                      f"but the node has {gpus} GPUs (0..{gpus - 1})")
