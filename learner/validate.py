"""Checks of RemoteVectorEnv's arguments, shared by learner/remote.py and its mixins (learner/membership.py).

Here, not in learner/remote.py, so that the mixins, which learner/remote.py imports, import them at the top.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from learner.errors import InvalidArgumentError

__all__ = ["flag", "is_finite", "seconds"]


def flag(name: str, value: Any) -> bool:
    """``value``, a bool (or numpy's), refused otherwise, naming the argument ``name`` (``"off"`` is
    true to ``bool()``: taken, it would do the opposite of what was meant)."""
    if not isinstance(value, bool | np.bool_):
        raise InvalidArgumentError(f"{name}: expected True or False, got {value!r}")
    return bool(value)


def is_finite(value: Any) -> bool:
    """Whether ``value`` is a finite real number (an int, a float, a numpy number; not a bool)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_) and math.isfinite(value)


def seconds(name: str, value: Any, *, zero: bool = False) -> float:
    """``value`` as seconds, refused (naming the argument ``name``) unless finite and > 0 (>= 0 with ``zero``)."""
    if not (is_finite(value) and (value >= 0 if zero else value > 0)):
        raise InvalidArgumentError(f"{name}: expected finite seconds {'>=' if zero else '>'} 0, got {value!r}")
    return float(value)
