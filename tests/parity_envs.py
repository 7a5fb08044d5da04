"""Envs for tests/test_parity.py (served as ``tests.parity_envs:PrevActionEnv``, ...): infos whose values
are None in some envs and numbers or arrays in others, and reset options as the envs see them."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["OptionsEnv", "PrevActionEnv", "SeededInfoEnv"]


class PrevActionEnv(gym.Env[np.ndarray, np.ndarray]):
    """``info["prev_action"]``: None right after a reset, the last action (a float32 array) after a
    step; episodes of 2 to 4 steps (drawn from the env's seed), so envs reset at different steps."""

    observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
    action_space = gym.spaces.Box(-1, 1, (2,), np.float32)

    def __init__(self) -> None:
        self._t, self._len = 0, 2

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        self._t, self._len = 0, 2 + int(self.np_random.integers(3))
        return np.zeros(2, np.float32), {"prev_action": None}

    def step(self, action: np.ndarray) -> Any:
        self._t += 1
        return np.zeros(2, np.float32), 0.0, self._t >= self._len, False, {"prev_action": np.array(action)}


class SeededInfoEnv(gym.Env[np.int64, np.int64]):
    """Infos picked by the env's reset seed ``i`` (env i of a fleet reset with seed 0), as ``case`` says:

    - ``float_then_none``: ``dist`` 1.5 in env 0, None in the others (no target yet, say);
    - ``none_then_npint``: ``k`` None in env 0, ``np.int64(i)`` in the others;
    - ``none_among_arrays``: ``x`` None in env 2, an array of 2 floats in the others.
    """

    observation_space = gym.spaces.Discrete(2)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, case: str = "float_then_none") -> None:
        self._case, self._i = case, 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        if seed is not None:
            self._i = seed
        i = self._i
        if self._case == "float_then_none":
            return 0, {"dist": 1.5 if i == 0 else None}
        if self._case == "none_then_npint":
            return 0, {"k": None if i == 0 else np.int64(i)}
        if self._case == "none_among_arrays":
            return 0, {"x": None if i == 2 else np.arange(2.0) + i}
        raise ValueError(f"unknown case {self._case!r}")

    def step(self, action: np.int64) -> Any:
        return 0, 0.0, False, False, {}


class OptionsEnv(gym.Env[np.int64, np.int64]):
    """``info["options"]``: repr of the options its last reset had (``None`` or a dict); every step ends
    the episode."""

    observation_space = gym.spaces.Discrete(2)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        return 0, {"options": repr(options)}

    def step(self, action: np.int64) -> Any:
        return 0, 0.0, True, False, {}
