"""What a server's EnvSpec says of its envs (GetSpec of real servers): the kwargs and the time limit
they are made with, whatever the vectorization; and how an observation that does not fit the space
is named."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from learner import RemoteVectorEnv
from learner.errors import EnvCrashedError
from tests.conftest import SpawnServer


def _spec(address: str) -> pb.EnvSpec:
    with grpc.insecure_channel(address) as channel:
        spec: pb.EnvSpec = pb_grpc.EnvServiceStub(channel).GetSpec(pb.GetSpecRequest(), timeout=10).spec
    return spec


@pytest.mark.parametrize(
    ("env", "args", "limit"),
    [
        # the registered limit: async vectorization said 0 (it looked for envs its vector env holds in
        # its worker processes), and learners recorded none and warned of a mixed fleet
        ("CartPole-v1", ["--vectorization", "sync"], 500),
        ("CartPole-v1", ["--vectorization", "async"], 500),
        ("CartPole-v1", ["--vectorization", "vector_entry_point"], 500),
        # --max-episode-steps over the registered one
        ("CartPole-v1", ["--vectorization", "async", "--max-episode-steps", "77"], 77),
        # gymnasium.make's own max_episode_steps, given in --env-kwargs (make_vec passes it to the
        # vectorized implementation, whose spec keeps the registered 500)
        ("CartPole-v1", ["--vectorization", "async", "--env-kwargs", '{"max_episode_steps": 60}'], 60),
        ("CartPole-v1", ["--vectorization", "vector_entry_point", "--env-kwargs", '{"max_episode_steps": 60}'], 60),
        # an entry point: none of its own, or a TimeLimit around it
        ("tests.envs:FaultyEnv", ["--vectorization", "async"], 0),
        ("tests.envs:FaultyEnv", ["--vectorization", "async", "--max-episode-steps", "9"], 9),
        ("tests.envs:FaultyEnv", ["--vectorization", "sync", "--max-episode-steps", "9"], 9),
    ],
)
def test_the_time_limit_is_the_one_the_envs_are_made_with_for_every_vectorization(
    spawn_server: SpawnServer, env: str, args: list[str], limit: int
) -> None:
    server = spawn_server(env, 2, *args)
    spec = _spec(server.address)
    assert spec.max_episode_steps == limit
    assert spec.vectorization == args[1]


def test_an_async_server_of_an_id_registered_with_a_lambda_serves_and_says_its_time_limit(
    spawn_server: SpawnServer,
) -> None:
    """Its spec cannot be pickled: the limit is read in the server's process, not asked of a worker."""
    server = spawn_server("tests.lambda_envs:LambdaClock-v0", 2, "--vectorization", "async")
    assert _spec(server.address).max_episode_steps == 50


def test_the_time_limit_the_spec_says_is_where_episodes_are_truncated(spawn_server: SpawnServer) -> None:
    """(Async: the limit said is the one the workers' envs truncate at.)"""
    server = spawn_server("CartPole-v1", 2, "--vectorization", "async", "--env-kwargs", '{"max_episode_steps": 3}')
    assert _spec(server.address).max_episode_steps == 3
    with RemoteVectorEnv([server.address]) as envs:
        envs.reset(seed=0)
        truncations = [envs.step(np.zeros(2, dtype=np.int64))[3] for _ in range(3)]
    assert [t.tolist() for t in truncations] == [[False, False], [False, False], [True, True]]


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        ([], ""),
        (["--env-kwargs", "{}"], ""),
        # canonical: keys sorted, json.dumps's separators, whatever the operator typed
        (
            ["--env-kwargs", '{"sutton_barto_reward":true,   "render_mode": "rgb_array"}'],
            '{"render_mode": "rgb_array", "sutton_barto_reward": true}',
        ),
        (
            ["--vectorization", "async", "--env-kwargs", '{"sutton_barto_reward": true}'],
            '{"sutton_barto_reward": true}',
        ),
        (
            ["--vectorization", "vector_entry_point", "--env-kwargs", '{"sutton_barto_reward": true}'],
            '{"sutton_barto_reward": true}',
        ),
    ],
)
def test_the_spec_carries_the_env_kwargs_as_canonical_json(
    spawn_server: SpawnServer, args: list[str], kwargs: str
) -> None:
    server = spawn_server("CartPole-v1", 1, *args)
    spec = _spec(server.address)
    assert spec.HasField("env_kwargs") and spec.env_kwargs == kwargs  # ("" said: none; absent: an older server)


def test_the_spec_carries_the_kwargs_the_atari_wrapper_adds(spawn_server: SpawnServer) -> None:
    """What the envs are made with, not only what was typed: the ALE env under the atari wrapper gets
    frameskip=1 (the wrapper skips frames itself), which changes what a step is."""
    pytest.importorskip("ale_py")
    server = spawn_server("ALE/Pong-v5", 1, "--wrappers", "atari", "--env-kwargs", '{"repeat_action_probability": 0.0}')
    assert _spec(server.address).env_kwargs == '{"frameskip": 1, "repeat_action_probability": 0.0}'


@pytest.mark.parametrize("vectorization", ["sync", "async"])
@pytest.mark.parametrize("method", ["step", "reset"])
def test_an_observation_that_does_not_fit_after_the_first_is_named_with_its_env(
    spawn_server: SpawnServer, method: str, vectorization: str
) -> None:
    """An env whose observations go wrong after the first ones (the server checks those): not numpy's
    "all input arrays must have the same shape" (sync) or "could not broadcast input array from shape
    (3,) into shape (2,)" (async), but the env's index, its call, the shape and dtype, the space's."""
    kwargs = json.dumps({"bad_seed": 2, "method": method, "at": 2})
    server = spawn_server("tests.envs:MisshapenEnv", 4, "--env-kwargs", kwargs, "--vectorization", vectorization)
    named = (
        rf"ObservationLayoutError: the server's env 2: its {method} returned an observation of shape \(3,\) and dtype float32, "
        r"not the observation space's \(2,\) \(Box\(-1.0, 1.0, \(2,\), float32\)\)"
    )
    with RemoteVectorEnv([server.address]) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))  # (the first step fits)
        with pytest.raises(EnvCrashedError, match=named) as raised:
            if method == "reset":
                envs.reset()
            envs.step(np.zeros(4, dtype=np.int64))
        assert raised.value.env_index == 2
        if vectorization == "sync" and method == "step":  # (async: gymnasium shut the worker down)
            envs.reset(seed=5)  # the server goes on: a reset, and env 2 fits until its next step
    assert "ObservationLayoutError: the server's env 2: its" in server.logs()


def test_a_first_observation_that_does_not_fit_names_its_env_index_too(spawn_server: SpawnServer) -> None:
    kwargs = json.dumps({"bad_seed": 1, "method": "reset", "at": 1})
    server = spawn_server("tests.envs:MisshapenEnv", 3, "--env-kwargs", kwargs)
    with RemoteVectorEnv([server.address]) as envs, pytest.raises(EnvCrashedError) as raised:
        envs.reset(seed=0)
    assert raised.value.env_index == 1
    assert "reset(): observation has shape (3,), expected (2,)" in str(raised.value)
    assert "(env 1 of the server's)" in str(raised.value)


def test_a_dict_observation_missing_a_key_is_named_with_its_env() -> None:
    """(The words for a misfit inside a Dict or Tuple space, and for one numpy cannot convert.)"""
    import gymnasium as gym

    from env_server.envs import misfit_message

    space = gym.spaces.Dict({"pos": gym.spaces.Box(-1, 1, (2,)), "id": gym.spaces.Discrete(3)})
    assert misfit_message({"pos": np.zeros(2), "id": 1}, space, 0, "step") is None
    assert misfit_message({"pos": np.zeros(3, dtype=np.float64), "id": 1}, space, 1, "step") == (
        "the server's env 1: its step returned an observation whose ['pos'] has shape (3,) and dtype float64, not the observation "
        "space's (2,) (Box(-1.0, 1.0, (2,), float32))"
    )
    assert misfit_message({"pos": np.zeros(2)}, space, 3, "reset") == (
        "the server's env 3: its reset returned an observation that does not fit the observation space: observation has keys "
        "['pos'], missing ['id'] of ['id', 'pos']"
    )
    box = gym.spaces.Box(-1, 1, (2,))
    assert misfit_message(np.array(["a", "b"]), box, 0, "step") == (
        "the server's env 0: its step returned an observation of dtype <U1, which does not convert to the observation space's "
        "float32 (Box(-1.0, 1.0, (2,), float32))"
    )
    assert misfit_message([[1, 2], [3]], box, 0, "step") is None  # (too odd to describe: the stacking's own error)
