"""argparse types shared by the ``learner`` commands and the benchmark scripts.

Each refuses what does not fit with "expected <what>, got <the text given>", which argparse prefixes
with the option's name. Integers may be written in float notation when they are whole (``1e6``,
``2.5e5``), as budgets often are.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from env_server.config import parse_int

__all__ = ["int_list", "integer", "number", "parse_int", "positive_int", "positive_seconds", "real"]


def integer(text: str) -> int:
    """A type: an int, as :func:`parse_int` reads it."""
    try:
        return parse_int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def real(text: str) -> float:
    """A type: a float, range checks left to the caller (``inf`` and ``nan`` parse)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def number(low: float, *, above: bool = False, integer: bool = False, unit: str = "") -> Callable[[str], float]:
    """A type: a finite number >= ``low`` (> with ``above``), an int with ``integer``; ``unit`` names
    it in the message ("seconds > 0"; default: "a number" or "an integer")."""
    expected = f"{unit or ('an integer' if integer else 'a number')} {'>' if above else '>='} {low:g}"

    def parse(text: str) -> float:
        try:
            value = parse_int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not (math.isfinite(value) and (value > low if above else value >= low)):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


positive_int: Callable[[str], int] = number(1, integer=True)  # type: ignore[assignment]
positive_seconds = number(0, above=True, unit="seconds")


def int_list(
    what: str = "integers", example: str = "1,8,64", minimum: int | None = None
) -> Callable[[str], tuple[int, ...]]:
    """A type: comma-separated ints (``minimum`` or more each), no empty items."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(parse_int(part) for part in text.split(","))
        except ValueError:
            values = ()
        if not values or (minimum is not None and min(values) < minimum):
            raise argparse.ArgumentTypeError(f"expected comma-separated {what} such as {example}, got {text!r}")
        return values

    return parse
