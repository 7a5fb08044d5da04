"""Envs whose numbers are finite but extreme, for tests/test_numeric_edges.py: values beyond float32's range,
squares beyond float64's, sums beyond float64's."""

from __future__ import annotations

from typing import Any, ClassVar

import gymnasium as gym
import numpy as np


class ExtremeEnv(gym.Env[np.ndarray, np.int64]):
    """Observations ``[t mod 4, 0.5]`` in a float64 Box(-inf, inf, (2,)), Discrete(2) actions, reward ``action``,
    episodes of ``length`` steps. From its step number ``at`` (counted over the env's life) on, in the env whose first
    reset had an odd seed (a vector env's env i gets ``s + i``: env 1 of two seeded 0), ``obs`` replaces the
    observation's first value and ``reward`` the reward, where given; ``signed``, the reward is +``reward``
    for action 1 and -``reward`` for action 0 (1e308: finite each, their sum overflows float64)."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}  # type: ignore[misc]  # (gymnasium types Env.metadata without ClassVar)

    def __init__(
        self, obs: float | None = None, reward: float | None = None, at: int = 1, signed: bool = False, length: int = 4
    ) -> None:
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(2,), dtype=np.float64)
        self.action_space = gym.spaces.Discrete(2)
        self.obs, self.reward, self.at, self.signed, self.length = obs, reward, at, signed, length
        self.bad: bool | None = None
        self.steps = 0  # (over the env's life)
        self._t = 0

    def _observation(self) -> np.ndarray:
        first = float(self._t % 4)
        if self.bad and self.obs is not None and self.steps >= self.at:
            first = self.obs
        return np.array([first, 0.5], dtype=np.float64)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        if self.bad is None:
            self.bad = seed is not None and seed % 2 == 1
        self._t = 0
        return self._observation(), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        self._t += 1
        reward = float(action)
        if self.bad and self.reward is not None and self.steps >= self.at:
            reward = (self.reward if action == 1 else -self.reward) if self.signed else self.reward
        return self._observation(), reward, self._t >= self.length, False, {}
