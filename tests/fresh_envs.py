"""Env factories for tests/test_fresh_envs.py (env-server --fresh-envs), served by entry point.

Light on purpose (no pytest): env servers import this module to build the envs.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import gymnasium as gym
import numpy as np

__all__ = ["make_normalized"]


def make_normalized(fail_file: str = "", gate_file: str = "", other_file: str = "") -> gym.Env[Any, Any]:
    """Pendulum-v1 as CleanRL's continuous-action ``make_env`` wraps it: NormalizeObservation and
    NormalizeReward keep running statistics, which a session's steps change. Raises while ``fail_file``
    exists (a build that fails, as a simulator that cannot start does); waits while ``gate_file`` exists
    (a slow build), having written :data:`WAITING` to stderr (the server's log); is another env while
    ``other_file`` exists (CartPole-v1: other spaces)."""
    if other_file and os.path.exists(other_file):
        return gym.make("CartPole-v1")
    if fail_file and os.path.exists(fail_file):
        raise RuntimeError(f"simulator unavailable ({os.path.basename(fail_file)} exists)")
    if gate_file and os.path.exists(gate_file):
        print(WAITING, file=sys.stderr, flush=True)
        while os.path.exists(gate_file):
            time.sleep(0.02)
    env: gym.Env[Any, Any] = gym.make("Pendulum-v1")
    env = gym.wrappers.ClipAction(env)
    env = gym.wrappers.NormalizeObservation(env)
    env = gym.wrappers.TransformObservation(env, lambda obs: np.clip(obs, -10, 10), env.observation_space)
    env = gym.wrappers.NormalizeReward(env, gamma=0.99)
    return SaysClosed(env)


class SaysClosed(gym.Wrapper[Any, Any, Any, Any]):
    """Writes :data:`CLOSED` to stderr (the server's log) when closed."""

    def close(self) -> None:
        print(CLOSED, file=sys.stderr, flush=True)
        super().close()


CLOSED = "fresh_envs: an env closed"
WAITING = "fresh_envs: an env's build waits at its gate"
