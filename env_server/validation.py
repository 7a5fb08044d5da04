"""Checking a batch of actions against the single action space, naming the first bad env."""

from __future__ import annotations

import re
import sys
from collections.abc import Collection
from typing import Any

import gymnasium as gym
import numpy as np

from env_server.codec import key_text

__all__ = ["InvalidActionError", "check_actions"]

# What an error shows of what the client sent (and so its log line on the server): its dict keys up
# to about this many characters in all, each as codec.key_text shows it; an env's action values up to
# _VALUES_SHOWN numbers (a few from each end of more).
_SHOWN_CHARS = 200
_VALUES_SHOWN = 16

# Box actions up to this much (relative to the bounds' magnitude, at least 1) past a bound are float
# rounding, clipped to it; farther is an error.
_ROUNDING = 1e-6


class InvalidActionError(ValueError):
    """A batch of actions does not fit the action space; ``env_index`` is the first bad env (or None)."""

    def __init__(self, message: str, env_index: int | None = None) -> None:
        # One line (the server logs each refusal as one): numpy prints a multi-dimensional space, and
        # bounds past 75 characters, over several.
        super().__init__(re.sub(r"\s*\n\s*", " ", message))
        self.env_index = env_index


def check_actions(space: gym.Space[Any], actions: Any, num_envs: int, where: str = "actions") -> Any:
    """Return ``actions`` cast to the space's dtypes (floats for a float Box: as sent), or raise
    InvalidActionError.

    ``actions`` is batched as ``gymnasium.vector.utils.batch_space(space, num_envs)`` lays it out:
    arrays with a leading dimension of ``num_envs``; dicts and tuples of such for Dict and Tuple spaces.
    """
    if isinstance(space, gym.spaces.Dict):
        if not isinstance(actions, dict):
            raise InvalidActionError(
                f"{where}: expected a dict with keys {list(space.spaces)} for {space}, got {_kind(actions)}"
            )
        if set(actions) != set(space.spaces):
            raise InvalidActionError(f"{where}: expected keys {list(space.spaces)}, got {_listed(actions)}")
        return {k: check_actions(sub, actions[k], num_envs, f"{where}[{k!r}]") for k, sub in space.spaces.items()}
    if isinstance(space, gym.spaces.Tuple):
        if not isinstance(actions, tuple) or len(actions) != len(space.spaces):
            raise InvalidActionError(
                f"{where}: expected a tuple of {len(space.spaces)} batches for {space}, got {_kind(actions)}"
            )
        return tuple(
            check_actions(sub, a, num_envs, f"{where}[{i}]")
            for i, (sub, a) in enumerate(zip(space.spaces, actions, strict=False))
        )
    if not isinstance(actions, np.ndarray):
        raise InvalidActionError(f"{where}: expected an array for {space}, got {_kind(actions)}")
    shape = (num_envs, *space.shape) if space.shape is not None else None
    if actions.shape != shape:
        raise InvalidActionError(
            f"{where}: expected shape {shape} ({num_envs} envs of {space}), got shape {actions.shape}"
        )
    if isinstance(space, gym.spaces.Box):
        return _check_box(space, actions, where)
    if isinstance(space, gym.spaces.Discrete | gym.spaces.MultiDiscrete | gym.spaces.MultiBinary):
        return _check_integer(space, actions, where)
    raise InvalidActionError(f"{where}: action space {space} is not supported")


def _check_box(space: gym.spaces.Box, actions: np.ndarray, where: str) -> np.ndarray:
    if actions.dtype.kind not in "biuf":
        raise InvalidActionError(f"{where}: expected numbers ({space.dtype}) for {space}, got dtype {actions.dtype}")
    if actions.dtype.kind == "f" and space.dtype.kind in "biu":  # (a bool Box too, as Box.contains has it)
        raise InvalidActionError(f"{where}: expected integers ({space.dtype}) for {space}, got dtype {actions.dtype}")
    bad = _first_bad(~np.isfinite(actions) if actions.dtype.kind == "f" else None)
    if bad is not None:
        raise InvalidActionError(f"{where}: env {bad}: action has NaN or infinite values: {_values(actions[bad])}", bad)
    outside = (actions < space.low) | (actions > space.high)
    if outside.any():
        # Within rounding of a float bound (gymnasium's RescaleAction computes in float64 from float32
        # bounds, and may land an ulp or a few past them): clipped, as the env would take it.
        if space.dtype.kind == "f":
            # (in float64: 1e-6 past a float16 bound of 1 is the bound itself in float16)
            low, high = space.low.astype(np.float64), space.high.astype(np.float64)
            bad = _first_bad((actions < low - _slack(low)) | (actions > high + _slack(high)))
        else:  # (integers do not round: past a bound is past it)
            bad = _first_bad(outside)
        if bad is not None:
            raise InvalidActionError(
                f"{where}: env {bad}: action {_values(actions[bad])} is outside the action space {space} "
                f"(low={space.low!r}, high={space.high!r}); clip actions to the bounds",
                bad,
            )
        actions = np.clip(actions, space.low, space.high)
    if actions.dtype.kind == "f" and space.dtype.kind == "f":
        # In the dtype sent, as a local vector env passes them: float64 actions for a float32 space
        # make the env compute in float64 (Pendulum's next state), and a cast would change its results.
        return actions
    return actions.astype(space.dtype, copy=False)


def _slack(bound: np.ndarray) -> np.ndarray:
    """How far past ``bound`` an action is still rounding (0 where the bound is infinite)."""
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(bound), _ROUNDING * np.maximum(1.0, np.abs(bound)), 0.0)


def _check_integer(space: gym.Space[Any], actions: np.ndarray, where: str) -> np.ndarray:
    if actions.dtype.kind not in "biu":
        raise InvalidActionError(f"{where}: expected integers for {space}, got dtype {actions.dtype}")
    if actions.dtype.kind == "b" and isinstance(space, gym.spaces.Discrete):
        # (as gymnasium's Discrete.contains, which a local env asserts: MultiDiscrete and MultiBinary take bools)
        raise InvalidActionError(f"{where}: expected integers for {space}, got dtype bool")
    if isinstance(space, gym.spaces.Discrete):
        low, high = space.start, space.start + space.n - 1
    elif isinstance(space, gym.spaces.MultiDiscrete):
        low, high = space.start, space.start + space.nvec - 1
    else:
        low, high = 0, 1
    values = actions.astype(np.int64, copy=False) if actions.dtype.kind != "u" else actions
    bad = _first_bad((values < low) | (values > high))
    if bad is not None:
        raise InvalidActionError(
            f"{where}: env {bad}: action {_values(actions[bad])} is outside the action space {space}", bad
        )
    return actions.astype(space.dtype, copy=False)


def _first_bad(mask: np.ndarray | None) -> int | None:
    """Index along the first axis of the first True entry, or None."""
    if mask is None or mask.ndim == 0 or not mask.any():
        return None
    per_env = mask.reshape(mask.shape[0], -1).any(axis=1)
    return int(np.argmax(per_env)) if per_env.any() else None


def _kind(obj: Any) -> str:
    if isinstance(obj, np.ndarray):
        return f"an array of shape {obj.shape}"
    return f"a {type(obj).__name__}"


def _listed(keys: Collection[Any]) -> str:
    """``keys`` as a list, shown up to about _SHOWN_CHARS characters, each key as key_text shows it; then
    ``...`` and how many there are. Keys a client sent: without a bound, an error (and the server's
    log line of it) would copy every one of them, however many and long."""
    shown: list[str] = []
    size = 0
    for key in keys:
        text = key_text(key)
        if shown and size + len(text) > _SHOWN_CHARS:
            break
        shown.append(text)
        size += len(text) + 2
        if size > _SHOWN_CHARS:
            break
    if len(shown) == len(keys):
        return f"[{', '.join(shown)}]"
    return f"[{', '.join(shown)}, ...] ({len(keys)} keys)"


def _values(action: np.ndarray) -> str:
    """One env's action, as a list (of a large one, a few numbers from each end of it flattened, on one line)."""
    if action.size <= _VALUES_SHOWN:
        return repr(action.tolist())
    flat = np.array2string(
        action.ravel(), threshold=_VALUES_SHOWN, edgeitems=3, separator=", ", max_line_width=sys.maxsize
    )
    return f"{flat} ({action.size} values, shape {action.shape})"
