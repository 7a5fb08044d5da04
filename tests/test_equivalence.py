"""RemoteVectorEnv over 2 servers x 3 envs gives exactly what gymnasium's SyncVectorEnv over 6 gives."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from learner import RemoteVectorEnv
from tests.compare import assert_same
from tests.envs import DictEnv

STEPS = 1000

CASES = {
    "CartPole-v1": lambda: gym.make("CartPole-v1"),
    "Pendulum-v1": lambda: gym.make("Pendulum-v1"),
    "tests.envs:DictEnv": DictEnv,
}


@pytest.mark.parametrize("fault_tolerant", [False, True], ids=["plain", "fault-tolerant"])
@pytest.mark.parametrize("env_id", list(CASES))
@pytest.mark.slow
def test_remote_equals_sync_vector_env(start_servers: Any, env_id: str, fault_tolerant: bool) -> None:
    """Fault-tolerant or not, when nothing fails the results are exactly SyncVectorEnv's (no extra info keys)."""
    addresses = start_servers(env_id, num_servers=2, envs_per_server=3)
    reference = gym.vector.SyncVectorEnv([CASES[env_id]] * 6)
    with RemoteVectorEnv(addresses, fault_tolerant=fault_tolerant) as remote:
        assert remote.num_envs == 6
        assert remote.single_observation_space == reference.single_observation_space
        assert remote.single_action_space == reference.single_action_space
        assert remote.observation_space == reference.observation_space
        assert remote.action_space == reference.action_space
        assert remote.metadata["autoreset_mode"] == reference.metadata["autoreset_mode"]

        obs, infos = remote.reset(seed=123)
        ref_obs, ref_infos = reference.reset(seed=123)
        assert_same(obs, ref_obs, "reset observations")
        assert_same(infos, ref_infos, "reset infos")

        reference.action_space.seed(7)
        episodes_ended = 0
        for t in range(STEPS):
            actions = reference.action_space.sample()
            got = remote.step(actions)
            want = reference.step(actions)
            for name, g, w in zip(
                ("observations", "rewards", "terminations", "truncations", "infos"), got, want, strict=False
            ):
                assert_same(g, w, f"step {t} {name}")
            episodes_ended += int(np.sum(got[2] | got[3]))
        assert episodes_ended >= 20, f"only {episodes_ended} episodes ended; the test should span many"
    reference.close()


def test_results_do_not_depend_on_layout(start_servers: Any) -> None:
    """reset(seed=s) seeds env i with s + i however envs are spread over servers."""
    one = start_servers("CartPole-v1", num_servers=1, envs_per_server=6)
    three = start_servers("CartPole-v1", num_servers=3, envs_per_server=2)
    with RemoteVectorEnv(one) as a, RemoteVectorEnv(three) as b:
        assert_same(a.reset(seed=5), b.reset(seed=5))
        rng = np.random.default_rng(0)
        for _ in range(300):
            actions = rng.integers(0, 2, size=6)
            assert_same(a.step(actions), b.step(actions))


@pytest.mark.parametrize("vectorization", ["sync", "async"])
def test_infos_whose_types_differ_between_envs_do_not_depend_on_layout(start_servers: Any, vectorization: str) -> None:
    """An info key that is an int in some envs and a float in others: gymnasium casts all into the
    first env's type (0.5 into an int array: 0), so each server cut its own envs' values by its own
    first env, and the fleet's infos depended on the layout. Servers widen such keys now, as the
    learner joins servers' infos: every layout gives the same, uncut values."""
    env, args = "tests.envs:MixedInfoEnv", ["--vectorization", vectorization]
    layouts = [start_servers(env, n, 4 // n, server_args=args) for n in (1, 2, 4)]
    fleets = [RemoteVectorEnv(addresses) for addresses in layouts]
    try:
        for fleet in fleets:
            fleet.reset(seed=0)
        for actions in ([1, 1, 0, 1], [0, 0, 1, 1], [0, 0, 0, 0]):
            steps = [fleet.step(np.array(actions)) for fleet in fleets]
            for got in steps[1:]:
                assert_same(got, steps[0])
            infos = steps[0][4]
            assert infos["x"].tolist() == [0.5 if a else 1 for a in actions]
            assert infos["d"]["y"].tolist() == [1.5 if a else 2 for a in actions]
    finally:
        for fleet in fleets:
            fleet.close()


def test_step_async_and_wait_match_step(start_servers: Any) -> None:
    addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=2)
    reference = gym.vector.SyncVectorEnv([CASES["CartPole-v1"]] * 4)
    with RemoteVectorEnv(addresses) as remote:
        assert_same(remote.reset(seed=1), reference.reset(seed=1))
        for _ in range(50):
            actions = np.ones(4, dtype=np.int64)
            remote.step_async(actions)
            assert_same(remote.step_wait(), reference.step(actions))


def test_seed_list_options_and_reset_mask(start_servers: Any) -> None:
    addresses = start_servers("tests.envs:DictEnv", num_servers=2, envs_per_server=2)
    reference = gym.vector.SyncVectorEnv([DictEnv] * 4)
    with RemoteVectorEnv(addresses) as remote:
        # Per-env seeds (None: unseeded) and options reach every env.
        got_obs, got_infos = remote.reset(seed=[3, None, 10, 11], options={"level": 2, "name": "hard"})
        want_obs, want_infos = reference.reset(seed=[3, 4, 10, 11], options={"level": 2, "name": "hard"})
        assert_same(got_infos["options_seen"], want_infos["options_seen"])
        assert_same(got_obs["position"][[0, 2, 3]], want_obs["position"][[0, 2, 3]])

        # A partial reset (gymnasium's options["reset_mask"]) resets only the selected envs.
        assert_same(remote.reset(seed=100), reference.reset(seed=100))
        reference.action_space.seed(0)
        for _ in range(5):
            actions = reference.action_space.sample()
            assert_same(remote.step(actions), reference.step(actions))
        mask = np.array([False, True, False, True])
        assert_same(remote.reset(options={"reset_mask": mask}), reference.reset(options={"reset_mask": mask}))
        only_first = np.array([True, False, False, False])  # one server gets no call at all
        assert_same(
            remote.reset(options={"reset_mask": only_first}), reference.reset(options={"reset_mask": only_first})
        )
        for _ in range(5):
            actions = reference.action_space.sample()
            assert_same(remote.step(actions), reference.step(actions))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_box_actions_reach_the_envs_in_the_dtype_sent(start_servers: Any, dtype: type[np.floating[Any]]) -> None:
    """float64 actions for Pendulum's float32 space: a local vector env passes them as they are (the
    env computes in float64); servers cast them to float32, which changed rewards from the first step."""
    addresses = start_servers("Pendulum-v1", 2, 2)
    reference = gym.vector.SyncVectorEnv([CASES["Pendulum-v1"]] * 4)
    rng = np.random.default_rng(0)
    with RemoteVectorEnv(addresses) as remote:
        assert_same(remote.reset(seed=3), reference.reset(seed=3))
        for t in range(100):
            actions = rng.uniform(-2.0, 2.0, size=(4, 1)).astype(dtype)
            assert_same(remote.step(actions), reference.step(actions), f"step {t}")
    reference.close()


def test_the_clip_action_wrapper_clips_where_the_envs_are(start_servers: Any) -> None:
    """``--wrappers clip-action`` (CleanRL's make_env ClipAction, on the server): actions far outside
    the bounds are taken and clipped there, as a SyncVectorEnv of ClipAction-wrapped envs does."""
    addresses = start_servers("Pendulum-v1", 1, 2, server_args=["--wrappers", "clip-action"])
    reference = gym.vector.SyncVectorEnv([lambda: gym.wrappers.ClipAction(gym.make("Pendulum-v1"))] * 2)
    with RemoteVectorEnv(addresses) as remote:
        assert remote.single_action_space == reference.single_action_space  # unbounded: any finite action
        assert_same(remote.reset(seed=3), reference.reset(seed=3))
        for t in range(50):
            actions = np.array([[10.0 * (-1) ** t], [0.5]], dtype=np.float32)
            assert_same(remote.step(actions), reference.step(actions), f"step {t}")
    reference.close()
