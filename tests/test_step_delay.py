"""``--step-delay-ms``'s wrappers: every step takes at least the delay, its result unchanged."""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np
import pytest

from env_server.envs import EnvStepDelay, StepDelay


@pytest.mark.parametrize("delay_s", [0.0005, 0.003])
def test_every_batched_step_takes_at_least_the_delay(delay_s: float) -> None:
    plain = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 3)
    delayed = StepDelay(gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 3), delay_s)
    plain.reset(seed=5)
    delayed.reset(seed=5)
    for t in range(20):
        actions = np.array([t % 2, 1, 0])
        start = time.perf_counter()
        got = delayed.step(actions)
        assert time.perf_counter() - start >= delay_s
        want = plain.step(actions)
        for a, b in zip(got[:4], want[:4], strict=True):
            np.testing.assert_array_equal(a, b)


def test_each_env_step_takes_at_least_the_delay() -> None:
    env = EnvStepDelay(gym.make("CartPole-v1"), 0.002)
    env.reset(seed=1)
    for _ in range(10):
        start = time.perf_counter()
        env.step(0)
        assert time.perf_counter() - start >= 0.002
