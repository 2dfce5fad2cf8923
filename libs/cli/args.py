"""argparse types of the CLI's numbers: a bad one is refused at parse time, one line
naming the option (argparse adds it) and what it must be, exit 2."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)


def bounded(parse: Callable[[str], N], low: N, *, above: bool, what: str
            ) -> Callable[[str], N]:
    """An argparse type: ``parse(text)``, finite, at least ``low`` (above it when
    ``above``); else ``ArgumentTypeError`` saying ``what`` to give."""

    def check(text: str) -> N:
        try:
            value = parse(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < low or (above and
                                                                        value == low):
            raise argparse.ArgumentTypeError(f"{text!r}: give {what}")
        return value

    check.__name__ = what  # argparse names a type by it in some messages
    return check


# NOTE: a zero or negative count would wait for ever on messages never sent (bench bus).
positive_int = bounded(int, 1, above=False, what="a whole number, at least 1")
whole_number = bounded(int, 0, above=False, what="a whole number, at least 0")
positive_float = bounded(float, 0.0, above=True, what="a number above 0")
non_negative_float = bounded(float, 0.0, above=False, what="a number, at least 0")
