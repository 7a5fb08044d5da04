"""Envs whose outputs go wrong (tests/test_env_output_checks.py): rewards, flags and observations of other
types than gymnasium's vector envs store, named by a kwarg."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

REWARDS: dict[str, Callable[[], Any]] = {
    # none a vector env can store: it fails the whole batch, or stores something else without a word
    "one_element": lambda: np.array([1.0]),
    "two_elements": lambda: np.array([1.0, 2.0]),
    "huge_int": lambda: 10**400,
    "complex": lambda: 1 + 1j,
    "none": lambda: None,
    "str": lambda: "1.0",
    "list": lambda: [1.0],
    # numbers
    "float": lambda: 0.5,
    "np_float32": lambda: np.float32(0.5),
    "zero_d": lambda: np.array(0.5),
    "zero_d_int": lambda: np.array(3),
    "int": lambda: 3,
    "np_int": lambda: np.int64(-3),
    "bool": lambda: True,
    "np_bool": lambda: np.bool_(True),
    "big_int": lambda: 2**70,  # (beyond an int64, but a float64 holds it)
    "nan": lambda: float("nan"),  # (a number: the learner names it)
    "inf": lambda: float("inf"),
}

FLAGS: dict[str, Callable[[], Any]] = {
    # no bool: stored as one without a word (None as False, NaN and 2 as True)
    "none": lambda: None,
    "nan": lambda: float("nan"),
    "two": lambda: 2,
    "one_element": lambda: np.array([True]),
    "str": lambda: "yes",
    "float": lambda: 1.0,
    # bools
    "true": lambda: True,
    "np_bool": lambda: np.bool_(True),
    "zero_d": lambda: np.array(True),
    "one": lambda: 1,
    "zero": lambda: 0,
    "np_int": lambda: np.int64(1),
}

OBSERVATIONS: dict[str, Callable[[], Any]] = {
    # (of a Discrete(3) space, discrete=True)
    "float": lambda: 1.0,
    "np_float": lambda: np.float64(2.0),
    "float_array": lambda: np.array(1.5),
    "int": lambda: 1,
    "np_int": lambda: np.int64(2),
    "bool": lambda: True,
    # (of a Box(-1, 1, (2,), float32), discrete=False)
    "float64": lambda: np.array([0.5, -0.5]),
    "python_ints": lambda: [1, 0],
    "python_floats": lambda: [0.25, 0.5],
    "int_array": lambda: np.array([1, 0]),
    "shape3": lambda: np.zeros(3, dtype=np.float32),
    "column": lambda: np.zeros((2, 1), dtype=np.float32),  # (as many values, another shape)
    "complex": lambda: np.array([1 + 1j, 0.5]),
    # (of either)
    "none": lambda: None,
}


class OutputEnv(gym.Env[Any, np.int64]):
    """Box(-1, 1, (2,), float32) observations (Discrete(3) with ``discrete``), Discrete(2) actions, episodes of 8
    steps, reward 1.0. The env whose first reset had seed ``bad_seed`` (a vector env's env i gets ``s + i``: env
    ``bad_seed`` of one reset with seed 0; -1: every env) returns, from its ``at``-th step on (counted over its
    life), the reward ``reward`` (a key of REWARDS), the flags ``terminated`` and ``truncated`` (of FLAGS) and
    the observation ``obs`` (of OBSERVATIONS) where given, in its steps and (``obs``) resets."""

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}  # type: ignore[misc]  # (gymnasium types Env.metadata without ClassVar)

    def __init__(
        self,
        bad_seed: int = 1,
        at: int = 2,
        reward: str | None = None,
        terminated: str | None = None,
        truncated: str | None = None,
        obs: str | None = None,
        discrete: bool = False,
    ) -> None:
        self.observation_space: gym.Space[Any] = (
            gym.spaces.Discrete(3) if discrete else gym.spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        )
        self.action_space = gym.spaces.Discrete(2)
        self.bad_seed, self.at = bad_seed, at
        self.outputs = {"reward": reward, "terminated": terminated, "truncated": truncated, "obs": obs}
        self.bad: bool | None = None
        self.steps = 0
        self.t = 0

    def _going_wrong(self, what: str) -> Any:
        name = self.outputs[what]
        if name is None or not self.bad or self.steps < self.at:
            return None
        return (OBSERVATIONS if what == "obs" else REWARDS if what == "reward" else FLAGS)[name]

    def _obs(self) -> Any:
        bad = self._going_wrong("obs")
        if bad is not None:
            return bad()
        if isinstance(self.observation_space, gym.spaces.Discrete):
            return self.t % 3
        return np.array([0.1 * self.t, 0.5], dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        if self.bad is None:
            self.bad = self.bad_seed in (-1, seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action: np.int64) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
        self.steps += 1
        self.t += 1
        values: list[Any] = [1.0, self.t >= 8, False]
        for i, what in enumerate(("reward", "terminated", "truncated")):
            bad = self._going_wrong(what)
            if bad is not None:
                values[i] = bad()
        return self._obs(), *values, {}
