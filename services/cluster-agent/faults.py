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
is accepted too. ``at`` is seconds since the agent started (finite, >= 0); ``code`` is
an XID, 1 to ``XID_MAX`` (999); ``duration`` (> 0) defaults to forever; ``count`` is 1 to
``MAX_COUNT`` (1024, as many XIDs as the NVML backend reads in one sample); ``factor`` is
in (0, 1]; ``temp`` is in ``TEMP_RANGE`` (0 to 150 degrees C). Any mistake raises
``FaultScriptError`` naming the line (or the item of a JSON list), the fault as written
and the field.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

import msgspec

from tandem.cluster_agent.rules import XID_MAX, valid_xid
from tandem.common.errors import TandemError

FaultKind = Literal[
    "xid", "ecc", "ecc-corrected", "thermal", "power-brake", "slow", "off-bus",
    "nvlink", "pcie-replay", "remap-failure", "agent-die",
]
MAX_COUNT = 1024  # a count builds that many XIDs in one sample, or adds to a counter
TEMP_RANGE = (0.0, 150.0)  # degrees C a thermal fault may settle at


class FaultScriptError(TandemError, ValueError):
    """A fault of the script is wrong. ``line`` is its 1-based line, or its position in a
    JSON list (``item``), 0 for the script as a whole; ``text`` is the fault as written."""

    def __init__(self, line: int, reason: str, *, item: bool = False, text: str = "") -> None:
        self.line = line
        self.reason = reason
        self.text = text
        where = f"item {line} of the JSON list" if item else f"line {line}"
        if text:
            where += f" ({text!r})"
        super().__init__(f"fault script {where}: {reason}" if line else
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
        # NOTE: written so that NaN fails every check: a NaN ``at`` sorts first and would
        # block every later one-shot fault, a NaN ``duration`` is never active.
        if not (math.isfinite(self.at) and self.at >= 0):
            raise ValueError(f"at must be a finite number of seconds >= 0, got {self.at!r}")
        if self.gpu < 0:
            raise ValueError(f"gpu must be >= 0, got {self.gpu}")
        if self.kind == "xid" and not valid_xid(self.code):
            raise ValueError(f"xid needs code=<XID number>, 1 to {XID_MAX}, got {self.code}")
        if not 1 <= self.count <= MAX_COUNT:
            raise ValueError(f"count must be in 1..{MAX_COUNT}, got {self.count}")
        if not self.duration > 0:  # inf, the default, is forever
            raise ValueError(f"duration must be > 0 seconds, got {self.duration!r}")
        if not 0 < self.factor <= 1:
            raise ValueError(f"factor must be in (0, 1], got {self.factor!r}")
        low, high = TEMP_RANGE
        if not low <= self.temp <= high:
            raise ValueError(f"temp must be in [{low:g}, {high:g}] degrees C, got {self.temp!r}")

    def active(self, t: float) -> bool:
        """True while a lasting fault (thermal, power-brake, slow) is in effect at ``t``."""
        return self.at <= t < self.at + self.duration


def _convert(fields: dict[str, object], line: int, *, item: bool = False,
             text: str = "") -> Fault:
    try:
        return msgspec.convert(fields, Fault, strict=False)
    except (msgspec.ValidationError, ValueError) as exc:
        raise FaultScriptError(line, str(exc), item=item, text=text) from None


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
            raise FaultScriptError(line, f"expected key=value, got {part!r}", text=text)
        fields[key] = value
    return _convert(fields, line, text=text)


def parse(text: str) -> list[Fault]:
    """Parse a script (lines, ``;``-separated, or a JSON list), sorted by time."""
    stripped = text.strip()
    faults: list[Fault] = []
    if stripped.startswith(("[", "{")):
        try:
            items = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise FaultScriptError(0, f"invalid JSON: {exc}") from None
        if not isinstance(items, list):
            raise FaultScriptError(0, "a JSON script is a list of faults "
                                      '([{"at": 10, "kind": "xid", "code": 79}, ...]), '
                                      "got an object")
        for i, item in enumerate(items, 1):
            if not isinstance(item, dict):
                raise FaultScriptError(i, f"expected an object, got {item!r}", item=True)
            faults.append(_convert(item, i, item=True))
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
