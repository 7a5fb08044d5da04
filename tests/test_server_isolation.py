"""The placeholder observation of an env out of order (its reset raised) is a member of its space."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from env_server import ServerConfig, build_vector_env
from env_server.isolation import ENV_ERROR_KEY, placeholder_observation

SPACES: dict[str, gym.Space[Any]] = {
    "discrete": gym.spaces.Discrete(3, start=5),  # zero is outside
    "multi_discrete": gym.spaces.MultiDiscrete([3, 4], start=[2, -7]),
    "box": gym.spaces.Box(np.array([1, -3], np.float32), np.array([2, 3], np.float32)),
    "int_box": gym.spaces.Box(low=-5, high=-1, shape=(2,), dtype=np.int32),
    "multi_binary": gym.spaces.MultiBinary(3),
    "dict": gym.spaces.Dict(
        {"a": gym.spaces.Discrete(2, start=-3), "b": gym.spaces.Tuple([gym.spaces.Box(2.0, 3.0, shape=())])}
    ),
}


class BrokenResetEnv(gym.Env[Any, np.int64]):
    """Every reset raises; observations of ``SPACES[space]``."""

    action_space = gym.spaces.Discrete(2)

    def __init__(self, space: str = "discrete") -> None:
        self.observation_space = SPACES[space]

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        raise RuntimeError("the simulator did not come up")


@pytest.mark.parametrize("space", SPACES)
def test_an_env_whose_reset_raises_gets_a_placeholder_inside_its_space(space: str) -> None:
    # (zeros were outside Discrete(3, start=5): a learner one-hotting obs - start crashed)
    config = ServerConfig(env=f"{__name__}:BrokenResetEnv", num_envs=2, env_kwargs={"space": space})
    envs = build_vector_env(config)
    try:
        obs, infos = envs.reset(seed=0)
        assert infos["_" + ENV_ERROR_KEY].all()
        assert envs.observation_space.contains(obs), f"{space}: {obs!r} is outside {envs.observation_space}"
        obs, *_ = envs.step(np.zeros(2, dtype=np.int64))  # out of order: the placeholder again
        assert envs.observation_space.contains(obs), f"{space}: {obs!r} is outside {envs.observation_space}"
    finally:
        envs.close()


@pytest.mark.parametrize("space", SPACES)
def test_the_placeholder_is_zero_where_zero_is_a_member_else_the_nearest_member(space: str) -> None:
    obs = placeholder_observation(SPACES[space])
    assert SPACES[space].contains(obs)
    expected = {
        "discrete": 5,
        "multi_discrete": [2, -7],
        "box": [1.0, 0.0],
        "int_box": [-1, -1],
        "multi_binary": [0, 0, 0],
    }
    if space in expected:
        assert np.asarray(obs).tolist() == expected[space]


def test_spaces_no_wire_carries_get_a_member_without_touching_the_envs_random_stream() -> None:
    space = gym.spaces.Text(5, seed=1)
    twin = gym.spaces.Text(5, seed=1)
    assert space.contains(placeholder_observation(space))
    assert space.sample() == twin.sample()
