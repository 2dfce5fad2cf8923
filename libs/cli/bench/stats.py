"""Repeats, spread and goals: what every ``tandem bench`` reports the same way.

A bench measures each figure ``--repeat`` times. Where a figure has a raw baseline, each
repeat measures Tandem *and* the baseline (``interleaved``), so drift on a shared
machine (a neighbour starting, the page cache filling, a CPU throttling) hits both sides
instead of one block of Tandem runs and then one block of baseline runs. A ratio is taken
per repeat (Tandem over the baseline of the same repeat), then summarised.

Each ``Figure`` reports min / median / max of its runs, and its goal is judged on the
median. ``Figure.json`` is the one JSON shape every bench carries under ``figures``;
``markdown`` renders figures of one or many benches as a table for a README.

Contract of the JSON shape (``figures.<name>``)::

    {"label": str, "unit": str,
     "tandem":   {"min", "median", "max", "runs": [...]},
     "baseline": {"min", "median", "max", "runs": [...]} | null,
     "baseline_label": str,            # what the baseline is ("" when none)
     "ratio":    {"min", "median", "max", "runs": [...]} | null,
     "goal": {"on": "ratio" | "tandem", "op": ">=" | "<=", "value": float} | null,
     "met": bool | null,               # the goal judged on the median; null: no goal
     "why": str | null}                # when not met: the saturation note, measured
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from tandem.cli.args import (  # noqa: F401 - the benches' argparse types: stats.<name>
    non_negative_float,
    positive_float,
    positive_int,
    whole_number,
)

R = TypeVar("R")

NO_BASELINE = "no raw baseline: judged against its goal only"


# ------------------------------------------------------------------------------- repeats


def add_repeat(p: argparse.ArgumentParser, default: int, *aliases: str,
               what: str = "repeats, Tandem and baseline interleaved in each") -> None:
    """The ``--repeat N`` every bench takes (``aliases``: the option's older names)."""
    p.add_argument("--repeat", *aliases, dest="repeat", type=positive_int, default=default,
                   metavar="N", help=f"{what} (default {default}; min/median/max reported, "
                   "goals judged on the median)")


def order(r: int, sides: Sequence[str]) -> list[str]:
    """The order ``sides`` run in within repeat ``r``: as given in even repeats, reversed
    in odd ones (a bench that runs its sides inside its own repeat loop uses this)."""
    return list(sides) if r % 2 == 0 else list(reversed(sides))


def schedule(repeat: int, sides: Sequence[str]) -> list[tuple[int, str]]:
    """The order in which ``repeat`` repeats of ``sides`` run: every repeat runs each side
    once, one after the other (A B, A B, ..., never A A A then B B B), and the side that
    goes first alternates between repeats (A B, B A, A B), so neither side always gets the
    warmer (or colder) slot of a pair."""
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, not {repeat}")
    return [(r, side) for r in range(repeat) for side in order(r, sides)]


async def interleaved(repeat: int, sides: Mapping[str, Callable[[int], Awaitable[R]]]
                      ) -> dict[str, list[R]]:
    """Run each side once per repeat in ``schedule`` order; the runs of each side, in
    repeat order. A side is called with the repeat's index (for unique names)."""
    runs: dict[str, list[R]] = {side: [] for side in sides}
    for r, side in schedule(repeat, list(sides)):
        runs[side].append(await sides[side](r))
    return runs


async def repeated(repeat: int, once: Callable[[int], Awaitable[R]]) -> list[R]:
    """``once(r)`` for each repeat, in turn: for a bench whose one run already measures
    Tandem and its baseline side by side (``once`` is then one A-B pair)."""
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, not {repeat}")
    return [await once(r) for r in range(repeat)]


def median_run(runs: Sequence[R], key: Callable[[R], float]) -> R:
    """The run whose ``key`` is the median (the lower middle one for an even count): the
    one a bench shows in detail, so its figures and their ratio stay one run's."""
    ranked = sorted(runs, key=key)
    return ranked[(len(ranked) - 1) // 2]


# -------------------------------------------------------------------------------- figures


@dataclass(frozen=True)
class Spread:
    """min / median / max of a figure's runs (the median of an even count is the mean of
    the two middle runs, as ``statistics.median``)."""

    runs: tuple[float, ...]

    @property
    def min(self) -> float:
        return min(self.runs)

    @property
    def median(self) -> float:
        return float(statistics.median(self.runs))

    @property
    def max(self) -> float:
        return max(self.runs)

    def json(self, digits: int) -> dict[str, Any]:
        return {"min": round(self.min, digits), "median": round(self.median, digits),
                "max": round(self.max, digits), "runs": [round(x, digits) for x in self.runs]}


@dataclass(frozen=True)
class Goal:
    """``on`` (the ratio, or Tandem's own figure where there is no baseline) ``op``
    ``value``; judged on the median."""

    op: Literal[">=", "<="]
    value: float
    on: Literal["ratio", "tandem"] = "ratio"

    def met(self, x: float) -> bool:
        return x >= self.value if self.op == ">=" else x <= self.value

    def __str__(self) -> str:
        return f"{self.on} {self.op} {self.value:g}"


@dataclass
class Figure:
    """One measured figure: Tandem's runs, the baseline's runs of the same repeats (or
    none), their per-repeat ratio and the goal.

    ``ratio`` defaults to Tandem / baseline per repeat; a bench passes its own where the
    ratio is not that quotient (a latency against raw plus the HTTP hop). ``why`` is the
    saturation note a bench attaches when the goal is not met.
    """

    name: str
    label: str
    unit: str
    tandem: Sequence[float]
    baseline: Sequence[float] | None = None
    baseline_label: str = ""
    ratio: Sequence[float] | None = None
    goal: Goal | None = None
    digits: int = 3
    why: str | None = None
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.tandem:
            raise ValueError(f"{self.name}: no runs")
        if self.baseline is not None and self.ratio is None:
            if len(self.baseline) != len(self.tandem):
                raise ValueError(f"{self.name}: {len(self.tandem)} Tandem runs but "
                                 f"{len(self.baseline)} baseline runs: ratios pair repeats")
            self.ratio = [t / b for t, b in zip(self.tandem, self.baseline, strict=True)]
        if self.goal is not None and self.goal.on == "ratio" and self.ratio is None:
            raise ValueError(f"{self.name}: a goal on the ratio needs a baseline")

    @property
    def spread(self) -> Spread:
        return Spread(tuple(self.tandem))

    @property
    def baseline_spread(self) -> Spread | None:
        return Spread(tuple(self.baseline)) if self.baseline else None

    @property
    def ratio_spread(self) -> Spread | None:
        return Spread(tuple(self.ratio)) if self.ratio else None

    @property
    def judged(self) -> float | None:
        """The median the goal is judged on."""
        if self.goal is None:
            return None
        s = self.ratio_spread if self.goal.on == "ratio" else self.spread
        return s.median if s else None

    @property
    def met(self) -> bool | None:
        judged = self.judged
        return None if self.goal is None or judged is None else self.goal.met(judged)

    def json(self) -> dict[str, Any]:
        b, r = self.baseline_spread, self.ratio_spread
        return {
            "label": self.label, "unit": self.unit,
            "tandem": self.spread.json(self.digits),
            "baseline": b.json(self.digits) if b else None,
            "baseline_label": self.baseline_label if b else "",
            "ratio": r.json(3) if r else None,
            "goal": ({"on": self.goal.on, "op": self.goal.op, "value": self.goal.value}
                     if self.goal else None),
            "met": self.met,
            "why": self.why if self.met is False else None,
            **({"notes": self.notes} if self.notes else {}),
        }


def figures_json(figures: Sequence[Figure]) -> dict[str, dict[str, Any]]:
    """``figures`` as the ``figures`` object of a bench's JSON, keyed by name."""
    names = [f.name for f in figures]
    if len(set(names)) != len(names):
        raise ValueError(f"figure names repeat: {names}")
    return {f.name: f.json() for f in figures}


def all_met(figures: Mapping[str, Mapping[str, Any]]) -> bool:
    """Every figure with a goal meets it (on its median)."""
    return all(f["met"] is not False for f in figures.values())


# ------------------------------------------------------------------------------ rendering


def fmt(x: float | None, digits: int = 3) -> str:
    """A figure for people: thousands separated, at most ``digits`` significant decimals."""
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if x == int(x):
        return str(int(x))
    if abs(x) >= 100:
        return f"{x:.1f}"
    return f"{x:.{digits}g}" if x else "0"


def spread_text(s: Mapping[str, Any] | None) -> str:
    """``median [min-max]`` of a figure's JSON spread; just the median for one run."""
    if not s:
        return "-"
    if len(s["runs"]) == 1:
        return fmt(s["median"])
    return f"{fmt(s['median'])} [{fmt(s['min'])}-{fmt(s['max'])}]"


def goal_text(g: Mapping[str, Any] | None) -> str:
    return f"{g['on']} {g['op']} {g['value']:g}" if g else "-"


def met_text(met: bool | None) -> str:
    return {True: "met", False: "NOT MET", None: "-"}[met]


def render(figures: Mapping[str, Mapping[str, Any]], repeat: int | None = None) -> str:
    """The figures block under a bench's own lines: each figure with its spread, its
    baseline (or that it has none), its ratio, its goal and met / not met on the median,
    and, under a goal not met, why (what was saturated, measured)."""
    n = repeat or max((len(f["tandem"]["runs"]) for f in figures.values()), default=1)
    lines = [f"figures over {n} repeat{'s' * (n != 1)}: median [min-max]; goals judged on "
             "the median"]
    for name, f in figures.items():
        base = (f"{f['baseline_label']} {spread_text(f['baseline'])}" if f["baseline"]
                else "no baseline")
        ratio = f"  ratio {spread_text(f['ratio'])}" if f["ratio"] else ""
        goal = f"  goal {goal_text(f['goal'])}: {met_text(f['met'])}" if f["goal"] else ""
        lines.append(f"  {f['label'] or name} ({f['unit']}): tandem {spread_text(f['tandem'])}"
                     f"; {base}{ratio}{goal}")
        if f.get("why"):
            lines.append(f"    why not met: {f['why']}")
        lines += [f"    note: {note}" for note in f.get("notes", [])]
    return "\n".join(lines)


def markdown(benches: Mapping[str, Mapping[str, Any]]) -> str:
    """One table over every bench's figures (``benches``: name -> that bench's JSON, with
    its ``figures``): figure, Tandem, baseline, ratio (each median [min-max]), goal, met."""
    rows = ["| bench | figure | Tandem | baseline | ratio | goal | met |",
            "|---|---|---|---|---|---|---|"]
    for bench, result in benches.items():
        if "error" in result:
            rows.append(f"| {bench} | (failed: {_cell(str(result['error']))}) | | | | | |")
            continue
        for name, f in result.get("figures", {}).items():
            base = (f"{_cell(f['baseline_label'])}: {spread_text(f['baseline'])}"
                    if f["baseline"] else "none")
            met = met_text(f["met"]) + (f" ({_cell(f['why'])})" if f.get("why") else "")
            rows.append(f"| {bench} | {_cell(f['label'] or name)} ({f['unit']}) | "
                        f"{spread_text(f['tandem'])} | {base} | {spread_text(f['ratio'])} | "
                        f"{goal_text(f['goal'])} | {met} |")
    return "\n".join(rows) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
