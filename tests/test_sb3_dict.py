"""learner.sb3.RemoteVecEnv on Dict observations, as a user of SB3 takes them: a robot's camera frame beside its
state (tests.sb3_envs:ZeroStartCameraEnv: uint8 image, float32 state, Discrete, MultiBinary and MultiDiscrete keys)
and a goal env's Dict of vectors (tests.sb3_envs:GoalVectorsEnv). The same transitions as SB3's own vec envs over
the same env, through VecNormalize (norm_obs_keys) and VecFrameStack too; PPO's MultiInputPolicy trains on it, and
saves, loads and evaluates; an observation a step returned is not changed by the next step; Discrete keys of a
non-zero start, which SB3's policies cannot take, are warned of by name."""

from __future__ import annotations

import copy
import logging
from typing import Any, cast

import numpy as np
import pytest

from tests.compare import assert_same
from tests.conftest import HAS_SB3, StartServers
from tests.sb3_envs import GoalVectorsEnv, ZeroStartCameraEnv
from tests.test_sb3 import assert_same_step

pytestmark = pytest.mark.skipif(
    not HAS_SB3,
    reason="stable-baselines3 is not installed (pip install 'envfleet[sb3]')",
)


@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
def test_dict_transitions_equal_dummy_vec_envs(start_servers: StartServers, mode: str) -> None:
    """2 servers x 2 envs of a camera Dict (every key kind SB3's MultiInputPolicy takes) give what DummyVecEnv gives
    over 4 such envs for the same actions: observations per key (dtypes included), dones, infos with the Dict's
    terminal_observation, reset_infos; under either autoreset mode of the servers."""
    from stable_baselines3.common.vec_env import DummyVecEnv

    from learner.sb3 import RemoteVecEnv

    kwargs: dict[str, Any] = {"length": 3, "multi": True}
    addresses = start_servers(
        "tests.sb3_envs:ZeroStartCameraEnv", 2, 2, env_kwargs=kwargs, server_args=["--autoreset-mode", mode]
    )
    reference = DummyVecEnv([lambda: ZeroStartCameraEnv(**kwargs)] * 4)
    with RemoteVecEnv(addresses) as vec_env:
        assert vec_env.observation_space == reference.observation_space
        for env in (vec_env, reference):
            env.seed(5)
        assert_same(vec_env.reset(), reference.reset(), "reset")
        rng = np.random.default_rng(0)
        ended = 0
        for t in range(8):
            actions = rng.integers(0, 2, size=4)
            got, want = vec_env.step(actions), reference.step(actions)
            assert_same_step(got, want, f"step {t}")
            assert_same(vec_env.reset_infos, reference.reset_infos, f"step {t} reset infos")
            ended += int(want[2].sum())
        assert ended == 8  # (every env's episode ended twice: terminal_observation compared)
    reference.close()


def test_vec_normalize_and_frame_stack_over_a_dict_equal_subproc_vec_env(start_servers: StartServers) -> None:
    """VecFrameStack over VecNormalize with norm_obs_keys (a goal env's vectors: some keys normalised, one left as
    it is) gives what the same stack over SB3's SubprocVecEnv gives: stacked keys, normalised rewards (float64
    rewards, as SubprocVecEnv's: the same statistics), episode ends and their terminal observations."""
    from stable_baselines3.common.vec_env import SubprocVecEnv, VecEnv, VecFrameStack, VecNormalize

    from learner.sb3 import RemoteVecEnv

    def stack(vec_env: VecEnv) -> VecFrameStack:
        return VecFrameStack(VecNormalize(vec_env, norm_obs_keys=["observation", "achieved_goal"]), n_stack=3)

    addresses = start_servers("tests.sb3_envs:GoalVectorsEnv", 2, 2, server_args=["--autoreset-mode", "SameStep"])
    remote = stack(RemoteVecEnv(addresses))
    local = stack(SubprocVecEnv([GoalVectorsEnv] * 4, start_method="spawn"))
    try:
        assert remote.observation_space == local.observation_space
        assert remote.observation_space["observation"].shape == (9,)  # type: ignore[index]
        for env in (remote, local):
            env.seed(2)
        assert_same(remote.reset(), local.reset(), "reset")
        rng = np.random.default_rng(1)
        for t in range(10):
            actions = rng.integers(0, 2, size=4)
            (obs, rewards, dones, infos), want = remote.step(actions), local.step(actions)
            assert_same(obs, want[0], f"step {t} observations")
            assert_same(rewards, want[1], f"step {t} rewards")
            assert_same(dones, want[2], f"step {t} dones")
            assert_same(list(infos), list(want[3]), f"step {t} infos")  # (SubprocVecEnv's: a tuple)
    finally:
        remote.close()
        local.close()


def test_ppo_multi_input_policy_trains_saves_loads_and_evaluates(start_servers: StartServers, tmp_path: Any) -> None:
    """PPO("MultiInputPolicy") (a CNN on the image, the rest flattened) trains on a camera Dict under VecNormalize
    of its float key alone; the model and the statistics saved and loaded act as before, and evaluate_policy
    counts its episodes (ClockEnv's: 3 steps, a return of at most 3)."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.vec_env import VecMonitor, VecNormalize

    from learner.sb3 import RemoteVecEnv

    addresses = start_servers(
        "tests.sb3_envs:ZeroStartCameraEnv",
        2,
        2,
        env_kwargs={"multi": True},
        server_args=["--autoreset-mode", "SameStep"],
    )
    with RemoteVecEnv(addresses) as remote:
        vec_env = VecNormalize(VecMonitor(remote), norm_obs_keys=["state"], norm_reward=False)
        model = PPO("MultiInputPolicy", vec_env, n_steps=32, batch_size=64, n_epochs=2, seed=0).learn(256)
        assert model.num_timesteps == 256
        model.save(tmp_path / "model.zip")
        vec_env.save(str(tmp_path / "vec_normalize.pkl"))
        obs = vec_env.reset()
        loaded = PPO.load(tmp_path / "model.zip", env=vec_env)
        assert_same(loaded.predict(obs, deterministic=True)[0], model.predict(obs, deterministic=True)[0], "actions")
        again = VecNormalize.load(str(tmp_path / "vec_normalize.pkl"), VecMonitor(remote))
        again.training = False
        mean, std = cast(tuple[float, float], evaluate_policy(loaded, again, n_eval_episodes=4))
        assert 0.0 <= mean <= 3.0 and np.isfinite(std), (mean, std)


@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
def test_an_observation_a_step_returned_is_not_changed_by_the_next(start_servers: StartServers, mode: str) -> None:
    """SB3 keeps a step's observations (PPO's _last_obs, a rollout buffer's reference) while it takes the next:
    each key's array is the step's own, none shared with the next step's, and a terminal_observation stays as
    it was too."""
    from learner.sb3 import RemoteVecEnv

    addresses = start_servers(
        "tests.sb3_envs:ZeroStartCameraEnv", 2, 1, env_kwargs={"length": 2}, server_args=["--autoreset-mode", mode]
    )
    with RemoteVecEnv(addresses) as vec_env:
        kept: list[tuple[Any, Any]] = []
        obs = cast(dict[str, np.ndarray], vec_env.reset())
        for _ in range(5):
            kept.append((obs, copy.deepcopy(obs)))
            stepped, _, _, infos = vec_env.step(np.zeros(2, dtype=np.int64))
            obs = cast(dict[str, np.ndarray], stepped)
            kept += [
                (info["terminal_observation"], copy.deepcopy(info["terminal_observation"]))
                for info in infos
                if "terminal_observation" in info
            ]
            for key, value in obs.items():
                assert not any(np.shares_memory(value, old[key]) for old, _ in kept if isinstance(old[key], np.ndarray))
        assert len(kept) > 6  # (terminal observations came, and were kept)
        for i, (held, copied) in enumerate(kept):
            assert_same(held, copied, f"observation {i} kept")


def test_discrete_keys_of_a_non_zero_start_are_warned_of_by_name(
    start_servers: StartServers, caplog: pytest.LogCaptureFixture
) -> None:
    """SB3's policies one-hot Discrete and MultiDiscrete observations from 0: CameraClockEnv's phase
    (Discrete(2, start=1)) fails in torch's one_hot at its first 2 ("Class values must be smaller than
    num_classes"), as under DummyVecEnv. The adapter refuses nothing (SB3 may learn to take them) but warns, naming
    the keys; an env of zero starts is not warned of."""
    from learner.sb3 import RemoteVecEnv

    with caplog.at_level(logging.WARNING, logger="learner.sb3"):
        RemoteVecEnv(start_servers("tests.envs:CameraClockEnv", 1, 1, env_kwargs={"multi": True})).close()
        warned = [r.getMessage() for r in caplog.records if r.name == "learner.sb3"]
        assert len(warned) == 1, warned
        assert (
            "observation['gear']: MultiDiscrete([3 4], start=[1 0]), observation['phase']: Discrete(2, start=1)"
            in warned[0]
        )
        assert "Class values must be smaller than num_classes" in warned[0]
        caplog.clear()
        RemoteVecEnv(start_servers("tests.sb3_envs:ZeroStartCameraEnv", 1, 1, env_kwargs={"multi": True})).close()
        assert not [r for r in caplog.records if r.name == "learner.sb3"]


def test_a_negative_start_is_warned_of_as_what_fails_there(
    start_servers: StartServers, caplog: pytest.LogCaptureFixture
) -> None:
    """DictEnv's mode is a Discrete(5, start=-2): SB3 one-hots it as if it started at 0, and what fails is its
    values below 0, in torch's one_hot ("Class values must be non-negative"), none above. The warning said only
    that "their highest values (start + n - 1)" fail ("smaller than num_classes") and that actions are sampled
    "from 0, below start": both wrong for a negative start (SB3's actions then run past the space's top)."""
    import gymnasium as gym
    import torch
    from stable_baselines3.common.preprocessing import preprocess_obs

    from learner.sb3 import RemoteVecEnv

    space = gym.spaces.Discrete(5, start=-2)
    with pytest.raises(RuntimeError) as failed:  # (what SB3 does with its lowest value)
        preprocess_obs(torch.tensor([-2]), space)
    with caplog.at_level(logging.WARNING, logger="learner.sb3"):
        RemoteVecEnv(start_servers("tests.envs:DictEnv", 1, 1)).close()
    [warned] = [r.getMessage() for r in caplog.records if r.name == "learner.sb3"]
    assert "observation['mode']: Discrete(5, start=-2) starts at a non-zero value" in warned, warned
    assert str(failed.value).rstrip(".") in warned, warned
    assert "below start" not in warned, warned
