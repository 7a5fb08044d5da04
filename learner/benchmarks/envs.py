"""Env factories for the local baselines: the same envs the servers build, picklable for subprocesses."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym

from env_server.config import ServerConfig
from env_server.envs import make_env

__all__ = ["EnvStepDelay", "env_fns"]


class EnvStepDelay(gym.Wrapper[Any, Any, Any, Any]):
    """Makes one env's step take at least ``delay_s`` (the env's own work included), like a robot.

    The single-env twin of the server's ``--step-delay-ms`` (``env_server.envs.StepDelay``): in a
    subprocess vector env each env waits in its own process, so the envs wait concurrently, as the
    K envs of a server with a step delay do.
    """

    def __init__(self, env: gym.Env[Any, Any], delay_s: float) -> None:
        super().__init__(env)
        self.delay_s = delay_s

    def step(self, action: Any) -> Any:
        deadline = time.perf_counter() + self.delay_s
        result = self.env.step(action)
        remaining = deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)
        return result


def _make(config: ServerConfig, delay_s: float) -> gym.Env[Any, Any]:
    env = make_env(config)
    return EnvStepDelay(env, delay_s) if delay_s > 0 else env


def env_fns(config: ServerConfig, num_envs: int) -> list[Callable[[], gym.Env[Any, Any]]]:
    """``num_envs`` picklable env constructors: the server's env for ``config`` (its step delay per env)."""
    delay_s = config.step_delay_ms / 1000.0
    return [functools.partial(_make, config, delay_s)] * num_envs
