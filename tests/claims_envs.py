"""Envs for the README-claim tests (tests/test_readme_claims_*.py), served by entry point.

Light on purpose (no torch, no pytest): env servers import this module to build the envs.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

__all__ = ["ConstantEnv"]


def _unix_socket_name() -> str:
    """The file name of this server's ``--unix-socket`` (its command line's), or ""."""
    argv = sys.argv
    if "--unix-socket" in argv[:-1]:
        return os.path.basename(argv[argv.index("--unix-socket") + 1])
    return ""


class ConstantEnv(gym.Env[np.ndarray, np.int64]):
    """Every real observation is ``[value, value]``; episodes are truncated after ``length`` steps.

    Faults on demand, counted within the server process (envs by creation order, steps over all of
    the process's envs):

    - ``broken_env``: that env's every reset raises, so its server reports it out of order from the
      start, with a placeholder observation (zeros: inside the space, and unlike any real one).
    - ``die_at``: the process kills itself (SIGKILL) as its ``die_at``-th env step begins; with ``victim``,
      only a server whose ``--unix-socket`` file is named ``victim``: a server that dies again after every
      restart (``learner train`` starts its servers again on the same socket path).
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": []}  # type: ignore[misc]  # (gymnasium types Env.metadata without ClassVar)
    _created: ClassVar[int] = 0
    _steps: ClassVar[int] = 0  # env steps taken in this process

    def __init__(
        self, value: float = 4.0, length: int = 5, broken_env: int = -1, die_at: int = -1, victim: str = ""
    ) -> None:
        self.index = ConstantEnv._created
        ConstantEnv._created += 1
        self.value = value
        self.length = length
        self.broken = self.index == broken_env
        self.die_at = die_at if not victim or _unix_socket_name() == victim else -1
        self.observation_space = gym.spaces.Box(-10.0, 10.0, shape=(2,), dtype=np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self._t = 0

    def _obs(self) -> np.ndarray:
        return np.full(2, self.value, dtype=np.float32)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        if self.broken:
            raise RuntimeError(f"reset of env {self.index} failed on purpose")
        self._t = 0
        return self._obs(), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        ConstantEnv._steps += 1
        if ConstantEnv._steps == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        self._t += 1
        return self._obs(), 1.0, False, self._t >= self.length, {}
