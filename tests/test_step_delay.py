"""``--step-delay-ms``'s wrappers: every step takes at least the delay, its result unchanged."""

from __future__ import annotations

import time

import gymnasium as gym
import numpy as np
import pytest

from env_server.config import ServerConfig
from env_server.envs import _DELAY_AWAKE_S, EnvStepDelay, StepDelay
from learner.benchmarks.envs import env_fns


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


@pytest.mark.parametrize("awake", [True, False])
def test_each_env_step_takes_at_least_the_delay(awake: bool) -> None:
    env = EnvStepDelay(gym.make("CartPole-v1"), 0.002, awake=awake)
    env.reset(seed=1)
    for _ in range(10):
        start = time.perf_counter()
        env.step(0)
        assert time.perf_counter() - start >= 0.002


def test_the_baselines_envs_wait_awake_only_while_there_are_no_more_of_them_than_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More subprocess envs than CPUs each waiting 0.2 ms awake per step take the CPUs from each other's
    work: the latency suite's AsyncVectorEnv(64) ran at ~20 % of its ideal on 2 CPUs."""
    import learner.benchmarks.envs

    monkeypatch.setattr(learner.benchmarks.envs, "usable_cpus", lambda: 2)  # (a 2-CPU quota on a larger host, say)
    config = ServerConfig(env="CartPole-v1", step_delay_ms=2)
    for num_envs, awake_s in ((1, _DELAY_AWAKE_S), (2, _DELAY_AWAKE_S), (3, 0.0), (64, 0.0)):
        fns = env_fns(config, num_envs)
        assert len(fns) == num_envs
        env = fns[0]()
        assert isinstance(env, EnvStepDelay) and env.awake_s == awake_s, num_envs
        env.close()
