"""An env for tests/test_session_races.py (calls of one session, or of two, that overlap), served by entry
point (``tests.session_envs:SessionEnv``).

Light on purpose (no pytest): env servers import this module to build the envs.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

from tests.envs import _wait_at_gate

__all__ = ["SessionEnv"]

# More values than the codec takes in one value (a list of them): an info the server cannot send.
_TOO_MANY = 200_000


class SessionEnv(gym.Env[np.ndarray, np.int64]):
    """Observations ``[1000 * resets + t]`` (its resets counted over the env's life, ``t`` its steps since
    the last), Discrete(2) actions, episodes truncated after ``length`` steps. Its reset's info is
    ``{"level": level}``: the level the options of a reset last chose (``options["level"]``), which
    stays for later resets, as a level selector's would; the reset's observation draws from
    ``np_random``.

    Waits and faults on demand, counted over the env's life:

    - ``step_s``: every step takes this long (so the server runs steps on its env thread);
      ``reset_s``: every reset from number ``slow_resets_from`` on.
    - ``gate``, ``gate_on`` ("step" or "reset"), ``gate_at``: that call waits at a gate the test opens
      (see tests.envs.GateEnv).
    - ``big_info_step``, ``big_info_reset``: that step's (reset's) info holds a list of more values
      than the codec takes, so that its answer cannot be built.
    - ``bad_obs_step``: that step returns an observation of shape (3,), which fails the vector env.
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}  # type: ignore[misc]  # (gymnasium types Env.metadata without ClassVar)

    def __init__(
        self,
        length: int = 100,
        step_s: float = 0.0,
        reset_s: float = 0.0,
        slow_resets_from: int = 1,
        gate: str = "",
        gate_on: str = "step",
        gate_at: int = 0,
        big_info_step: int = 0,
        big_info_reset: int = 0,
        bad_obs_step: int = 0,
    ) -> None:
        self.observation_space = gym.spaces.Box(0.0, 1e9, shape=(1,), dtype=np.float64)
        self.action_space = gym.spaces.Discrete(2)
        self.length, self.step_s, self.reset_s, self.slow_resets_from = length, step_s, reset_s, slow_resets_from
        self.gate, self.gate_on, self.gate_at = gate, gate_on, gate_at
        self.big_info_step, self.big_info_reset, self.bad_obs_step = big_info_step, big_info_reset, bad_obs_step
        self.level = 0
        self.resets = self.steps = self.t = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.resets += 1
        if self.reset_s and self.resets >= self.slow_resets_from:
            time.sleep(self.reset_s)
        if self.gate and self.gate_on == "reset" and self.resets == self.gate_at:
            _wait_at_gate(self.gate, 60.0)
        if options and "level" in options:
            self.level = int(options["level"])
        self.t = 0
        info: dict[str, Any] = {"level": self.level, "draw": float(self.np_random.random())}
        if self.resets == self.big_info_reset:
            info["big"] = list(range(_TOO_MANY))
        return np.array([1000.0 * self.resets]), info

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        if self.step_s:
            time.sleep(self.step_s)
        if self.gate and self.gate_on == "step" and self.steps == self.gate_at:
            _wait_at_gate(self.gate, 60.0)
        self.t += 1
        obs = np.array([1000.0 * self.resets + self.t])
        if self.steps == self.bad_obs_step:
            obs = np.zeros(3)
        info: dict[str, Any] = {"big": list(range(_TOO_MANY))} if self.steps == self.big_info_step else {}
        return obs, 1.0, False, self.t >= self.length, info
