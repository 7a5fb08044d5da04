"""Checks of RemoteVectorEnv's arguments (and of its callers: :func:`one_thread`), shared by learner/remote.py and
its mixins (learner/membership.py).

Here, not in learner/remote.py, so that the mixins, which learner/remote.py imports, import them at the top.
"""

from __future__ import annotations

import functools
import math
import numbers
import threading
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

import numpy as np

from learner.errors import ConcurrentUseError, InvalidArgumentError, InvalidArgumentTypeError

__all__ = ["addresses", "count", "flag", "is_finite", "one_thread", "seconds"]

P = ParamSpec("P")
R = TypeVar("R")
_UNREAD: Any = object()  # (one_thread: the caller not read yet, so no claim of this call's to release)


def one_thread(method: Callable[Concatenate[Any, P], R]) -> Callable[Concatenate[Any, P], R]:
    """``method`` of a RemoteVectorEnv, refused (:class:`ConcurrentUseError`) while another thread is in one of
    its calls: two threads stepping one env failed as the server's fault ("its answer is not to the request
    sent", "the connection broke"), and could leave one blocked. Calls within a call (``step_groups``' act)
    are the same thread's. The env's ``_caller_lock`` guards ``_caller``, the thread in a call."""
    name = method.__name__

    @functools.wraps(method)
    def guarded(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        # (left out of tracebacks by IPython and pytest: an error of the call is not about threads)
        __tracebackhide__ = True
        me, caller = threading.get_ident(), _UNREAD
        try:
            with self._caller_lock:
                caller = self._caller
                if caller is None:
                    self._caller, self._caller_call = me, name
                elif caller != me:
                    raise ConcurrentUseError(
                        f"{name}: another thread is in this RemoteVectorEnv's {self._caller_call}; use one env from "
                        "one thread at a time (or one env each)"
                    )
            return method(self, *args, **kwargs)
        finally:
            if caller is None and self._caller == me:  # (its own claim: not a call within its own, refused, or unread)
                self._caller = None

    return guarded


def addresses(value: Any) -> str | list[str]:
    """RemoteVectorEnv's ``addresses``: one comma-separated string, or a list of strings (any iterable of them
    in order: a generator is read once, here); refused otherwise, saying what to pass (a set has no order: the
    envs' would change from run to run; a dict's keys are no list of addresses)."""
    if isinstance(value, str):
        return value
    wanted = "addresses: expected a list of server addresses or one comma-separated string ('host:port,unix:/path')"
    if isinstance(value, set | frozenset):
        raise InvalidArgumentTypeError(f"{wanted}, got a {type(value).__name__}, whose order (the envs') is arbitrary")
    if isinstance(value, dict):  # (its keys would be taken for the addresses)
        raise InvalidArgumentTypeError(f"{wanted}, got a dict")
    try:
        listed = list(value)
    except TypeError:
        listed = None
    if listed is not None and all(isinstance(address, str) for address in listed):
        return listed
    hint = ""
    if hasattr(value, "addresses"):
        hint = f" (a {type(value).__name__}: pass its .addresses)"
    elif hasattr(value, "__enter__"):
        hint = " (a context manager: pass what it gives, `with local_servers(...) as addresses:`)"
    raise InvalidArgumentTypeError(f"{wanted}, got {value!r}"[:300] + hint)


def count(name: str, value: Any, minimum: int = 1) -> int:
    """``value``, an int (or numpy's) >= ``minimum``, refused otherwise (a bool too), naming the argument ``name``."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral) or value < minimum:
        raise InvalidArgumentError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return int(value)


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
