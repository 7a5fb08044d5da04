"""Env factories for the local baselines: the same envs the servers build, picklable for subprocesses."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import gymnasium as gym

from env_server.config import ServerConfig
from env_server.envs import EnvStepDelay, make_env

__all__ = ["env_fns"]


def _make(config: ServerConfig, delay_s: float) -> gym.Env[Any, Any]:
    env = make_env(config)
    return EnvStepDelay(env, delay_s) if delay_s > 0 else env


def env_fns(config: ServerConfig, num_envs: int) -> list[Callable[[], gym.Env[Any, Any]]]:
    """``num_envs`` picklable env constructors: the server's env for ``config`` (its step delay per env)."""
    delay_s = config.step_delay_ms / 1000.0
    return [functools.partial(_make, config, delay_s)] * num_envs
