"""Env factories for the local baselines (the same envs the servers build, picklable for subprocesses), and
IndexEnv, whose observations say which env they come from (the soak test's check)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np

from env_server.config import ServerConfig
from env_server.envs import EnvStepDelay, make_env
from learner.local import usable_cpus

__all__ = ["IndexEnv", "env_fns"]


def _make(config: ServerConfig, delay_s: float, awake: bool) -> gym.Env[Any, Any]:
    env = make_env(config)
    return EnvStepDelay(env, delay_s, awake=awake) if delay_s > 0 else env


def env_fns(config: ServerConfig, num_envs: int) -> list[Callable[[], gym.Env[Any, Any]]]:
    """``num_envs`` picklable env constructors: the server's env for ``config`` (its step delay per env,
    whose end each env waits for awake only while there are no more envs than CPUs: with more, in a
    subprocess vector env their waits awake would starve each other's work, and the baseline would be
    measured below what it does with plain sleeps)."""
    delay_s = config.step_delay_ms / 1000.0
    awake = num_envs <= usable_cpus()  # (affinity and a cgroup's quota: what this process may use)
    return [functools.partial(_make, config, delay_s, awake)] * num_envs


class IndexEnv(gym.Env[np.ndarray, np.int64]):
    """An env whose observation says who it is and what it saw: for checking that no result is lost or misrouted.

    Observation ``[token, index, t, last_action]``: ``token`` is random per server process (a
    restarted server has a new one), ``index`` the env's creation order within the server, ``t``
    the step count within the episode (0 after reset), ``last_action`` the action of its last step
    (-1 after reset). Actions are Discrete(1000): a learner sends each env a different one and
    checks that the env echoes it.
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012 (gymnasium's own annotation)
    _created: ClassVar[int] = 0
    _token: ClassVar[float] = float(np.random.default_rng().integers(1, 2**24))

    def __init__(self, length: int = 100) -> None:
        self.index = IndexEnv._created
        IndexEnv._created += 1
        self.length = length
        self.observation_space = gym.spaces.Box(-1.0, np.inf, shape=(4,), dtype=np.float64)
        self.action_space = gym.spaces.Discrete(1000)
        self._t = 0
        self._last = -1

    def _obs(self) -> np.ndarray:
        return np.array([IndexEnv._token, self.index, self._t, self._last], dtype=np.float64)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._t, self._last = 0, -1
        return self._obs(), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._t += 1
        self._last = int(action)
        return self._obs(), 1.0, False, self._t >= self.length, {}
