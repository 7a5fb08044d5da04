"""learner.sb3.RemoteVecEnv against SB3's DummyVecEnv where they parted: the options an env's reset
gets (autoresets, per-env options), MultiBinary actions as SB3 samples them, recovery after a failed
step, set_options checked up front, env_is_wrapped and indices, and terminal observations alike under
either autoreset mode. Envs: tests/sb3_envs.py."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, cast

import gymnasium as gym
import numpy as np
import pytest

from env_server.rpc import env_pb2 as pb
from learner import InvalidArgumentError, RemoteTimeoutError, RemoteVectorEnv
from tests.compare import assert_same
from tests.conftest import HAS_SB3, StartServers
from tests.sb3_envs import DiscreteObsEnv, Float64BoxEnv, GoalEnv
from tests.test_sb3 import assert_same_step

pytestmark = pytest.mark.skipif(
    not HAS_SB3,
    reason="stable-baselines3 is not installed (pip install 'envfleet[sb3]')",
)


@pytest.mark.parametrize(("mode", "vectorization"), [("NextStep", "sync"), ("NextStep", "async"), ("SameStep", "sync")])
def test_envs_get_options_none_where_dummy_vec_env_gives_none(
    start_servers: StartServers, mode: str, vectorization: str
) -> None:
    """GoalEnv reads options["goal"] when it gets options: {} fails. Under next-step autoreset the
    adapter resets ended envs itself (a reset_mask reset), and with set_options([...]) envs of other
    options alone; an env whose options are None or {} gets options=None there too, as DummyVecEnv
    gives (was: {}, from gymnasium's vector envs on the server, whose reset_mask they take out)."""
    from stable_baselines3.common.vec_env import DummyVecEnv

    from learner.sb3 import RemoteVecEnv

    server_args = ["--autoreset-mode", mode, "--vectorization", vectorization]
    addresses = start_servers("tests.sb3_envs:GoalEnv", 2, 2, server_args=server_args)
    reference = DummyVecEnv([GoalEnv] * 4)
    with RemoteVecEnv(addresses) as vec_env:
        per_env = [{"goal": 2}, {}, None, {"goal": 4, "w": np.array([1.0, 2.0])}]
        options: Any  # (SB3 types set_options' list as dicts only; DummyVecEnv takes None for "no options")
        for options in (None, per_env, {"goal": 5}, [None, {"goal": 2}, {"goal": 2}, {}]):
            for env in (vec_env, reference):
                env.seed(1)
                env.set_options(options)
            assert_same(vec_env.reset(), reference.reset(), f"reset with options {options}")
            assert_same(vec_env.reset_infos, reference.reset_infos, f"reset infos with options {options}")
            for t in range(9):  # (autoresets of every env, with no options: GoalEnv's goal is 3 then)
                actions = np.zeros(4, dtype=np.int64)
                assert_same_step(vec_env.step(actions), reference.step(actions), f"step {t} after options {options}")
                assert_same(vec_env.reset_infos, reference.reset_infos, f"step {t} reset infos")
    reference.close()


@pytest.mark.parametrize("vectorization", ["sync", "async"])
def test_a_masked_reset_request_without_options_gives_the_envs_none(
    start_servers: StartServers, vectorization: str
) -> None:
    """On the wire: a Reset with a reset_mask and no options field resets the envs with options=None (as
    ResetRequest.options says: unset for None); with options {} (what RemoteVectorEnv.reset(options=
    {"reset_mask": mask}) sends, as gymnasium's SyncVectorEnv gives its envs), with {}."""
    addresses = start_servers("tests.parity_envs:OptionsEnv", 1, 3, server_args=["--vectorization", vectorization])
    mask = np.array([True, False, True])
    with RemoteVectorEnv(addresses) as envs:
        envs.reset(seed=0)
        infos = envs._reset_unset_options(mask)[1]
        assert infos["options"][mask].tolist() == ["None", "None"]
        infos = envs.reset(options={"reset_mask": mask})[1]
        assert infos["options"][mask].tolist() == ["{}", "{}"]
        infos = envs._reset_unset_options(mask, options={"x": 1})[1]
        assert infos["options"][mask].tolist() == ["{'x': 1}"] * 2


@pytest.mark.parametrize("dict_actions", [False, True], ids=["MultiBinary", "Dict"])
def test_multi_binary_actions_sampled_as_floats_are_taken(start_servers: StartServers, dict_actions: bool) -> None:
    """SB3's PPO and A2C sample MultiBinary actions as float32 0. and 1., which DummyVecEnv's envs take;
    the servers take integers only: the adapter casts such floats (other values stay refused, by the
    servers' own check, which names the dtype)."""
    from learner.sb3 import RemoteVecEnv

    kwargs = '{"dict_actions": true}' if dict_actions else "{}"
    addresses = start_servers("tests.sb3_envs:SwitchesEnv", 1, 2, server_args=["--env-kwargs", kwargs])

    def actions(switches: np.ndarray) -> Any:
        return {"level": np.zeros(2, dtype=np.int64), "switches": switches} if dict_actions else switches

    obs: Any  # (an array here: SB3's VecEnvObs is a union of an array, a dict and a tuple of them)
    with RemoteVecEnv(addresses) as vec_env:
        vec_env.reset()
        switches = np.array([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]], dtype=np.float32)
        obs, rewards, _, _ = vec_env.step(actions(switches))
        assert np.array_equal(obs, switches) and rewards.tolist() == [2.0, 1.0]
        obs, _, _, _ = vec_env.step(actions(np.array([[0, 1, 0], [1, 1, 1]], dtype=np.int8)))
        assert obs.tolist() == [[0.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
        with pytest.raises(InvalidArgumentError, match="expected integers"):
            vec_env.step(actions(np.array([[0.5, 0.0, 1.0], [0.0, 0.0, 1.0]], dtype=np.float32)))
        obs, _, _, _ = vec_env.step(actions(switches.astype(np.float64)))  # (nothing was sent: it steps on)
        assert np.array_equal(obs, switches)


@pytest.mark.slow
def test_a2c_and_ppo_learn_on_multi_binary_actions(start_servers: StartServers) -> None:
    """What failed: SB3's A2C and PPO on an env of MultiBinary actions (their float32 samples refused)."""
    import torch
    from stable_baselines3 import A2C, PPO
    from stable_baselines3.common.base_class import BaseAlgorithm
    from stable_baselines3.common.logger import Logger

    from learner.sb3 import RemoteVecEnv

    addresses = start_servers("tests.sb3_envs:SwitchesEnv", 1, 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with RemoteVecEnv(addresses) as vec_env:
            models: list[BaseAlgorithm] = [
                A2C("MlpPolicy", vec_env, n_steps=8, device="cpu", seed=0),
                PPO("MlpPolicy", vec_env, n_steps=8, batch_size=16, device="cpu", seed=0),
            ]
            for model in models:
                model.set_logger(Logger(folder=None, output_formats=[]))
                model.learn(total_timesteps=32)
                assert model.num_timesteps >= 32
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_per_env_options_after_a_failed_step_recover_the_fleet(start_servers: StartServers, tmp_path: Path) -> None:
    """A step that fails (here it times out: the envs' 2nd step waits at a gate) leaves the envs of the
    servers that did answer ahead of what the caller saw, and the servers refuse a reset_mask until a
    full reset: a reset() with per-env options resets every env first, then each options' envs (was:
    reset_mask resets only, refused, and the fleet never stepped again)."""
    from learner.sb3 import RemoteVecEnv

    gate = tmp_path / "gate"
    kwargs = json.dumps({"gate": str(gate), "at": 2})
    addresses = start_servers("tests.sb3_envs:GatedGoalEnv", 2, 2, server_args=["--env-kwargs", kwargs])
    zeros = np.zeros(4, dtype=np.int64)
    with RemoteVecEnv(addresses, timeout=2.0) as vec_env:
        vec_env.reset()
        vec_env.step(zeros)
        gate.touch()  # (the envs' next step waits until it is gone)
        with pytest.raises(RemoteTimeoutError):
            vec_env.step(zeros)
        gate.unlink()  # (the step goes on, on the servers: its answers are lost)
        vec_env.set_options([{"goal": 5}, {"goal": 4}, None, {"goal": 5}])
        obs: Any = vec_env.reset()
        assert obs[:, 0].tolist() == [5.0, 4.0, 3.0, 5.0] and obs[:, 1].tolist() == [0.0] * 4
        assert [info["got_options"] for info in vec_env.reset_infos] == [True, True, False, True]
        for t in range(1, 3):
            obs, _, dones, _ = vec_env.step(zeros)
            assert obs[:, 1].tolist() == [float(t)] * 4 and not dones.any()


def test_set_options_is_checked_before_anything_is_reset(start_servers: StartServers) -> None:
    """One dict or None per env: a list of another length, or of other things, is an
    InvalidArgumentError naming set_options (was: a list of 1 applied to every env, one of 6 an
    IndexError after some envs were reset, None a TypeError; arrays in options an ambiguous truth
    value); the options set before stay, and nothing is reset."""
    from learner.sb3 import RemoteVecEnv

    addresses = start_servers("tests.sb3_envs:GoalEnv", 2, 2)
    zeros = np.zeros(4, dtype=np.int64)
    with RemoteVecEnv(addresses) as vec_env:
        vec_env.set_options({"goal": 9})
        vec_env.reset()
        vec_env.set_options({"goal": 8})
        refused: list[tuple[Any, str]] = [
            ([{"goal": 1}], r"a list of 4 .*got a list of 1"),
            ([{"goal": i} for i in range(6)], r"a list of 4 .*got a list of 6"),
            ([{"goal": 1}, 5, None, None], r"env 1's options: expected a dict or None, got int"),
            ("goal", r"env 0's options: expected a dict or None, got str"),
            ([None, None, {"reset_mask": np.ones(4, dtype=np.bool_)}, None], r"env 2's options: the key 'reset_mask'"),
            ([None, {"goal": object()}, None, None], r"env 1's options\['goal'\]: cannot send"),
        ]
        for options, match in refused:
            with pytest.raises(InvalidArgumentError, match=rf"^set_options: .*{match}"):
                vec_env.set_options(options)
        assert vec_env._options == [{"goal": 8}] * 4  # (the options set before stay)
        vec_env._options = [{"goal": 1}]  # (SB3's own attribute, set otherwise: reset() checks it too)
        with pytest.raises(InvalidArgumentError, match=r"^set_options: .*got a list of 1"):
            vec_env.reset()
        obs: Any = vec_env.step(zeros)[0]
        assert obs[:, :2].tolist() == [[9.0, 1.0]] * 4  # (nothing was reset)

        # Options holding arrays, equal ones in envs 0 and 3 (one reset_mask reset for both).
        w = np.array([1.0, 2.0])
        vec_env.set_options([{"goal": 2, "w": w}, {"goal": 2, "w": w * 2}, None, {"goal": 2, "w": w.copy()}])
        obs = vec_env.reset()
        assert obs.tolist() == [[2.0, 0.0, 3.0], [2.0, 0.0, 6.0], [3.0, 0.0, 0.0], [2.0, 0.0, 3.0]]


@pytest.mark.parametrize("env", ["DiscreteObsEnv", "Float64BoxEnv"])
def test_terminal_observations_alike_under_either_autoreset_mode(start_servers: StartServers, env: str) -> None:
    """terminal_observation as the observation space holds it, under next-step and same-step autoreset
    alike (was: a Discrete one np.int64 under NextStep, an int under SameStep; a float64 observation of
    a float32 Box cast under NextStep only): what DummyVecEnv gives for an env that returns its
    observations so (a Discrete one as an int, as gymnasium's Discrete envs return theirs)."""
    from stable_baselines3.common.vec_env import DummyVecEnv

    from learner.sb3 import RemoteVecEnv

    fleets = {
        mode: RemoteVecEnv(start_servers(f"tests.sb3_envs:{env}", 1, 2, server_args=["--autoreset-mode", mode]))
        for mode in ("NextStep", "SameStep")
    }
    make: type[gym.Env[Any, Any]] = DiscreteObsEnv if env == "DiscreteObsEnv" else Float64BoxEnv
    reference = DummyVecEnv([make] * 2)
    try:
        for vec_env in (*fleets.values(), reference):
            vec_env.seed(3)
            vec_env.reset()
        ends = 0
        for t in range(7):
            actions = np.zeros(2, dtype=np.int64)
            got = {mode: vec_env.step(actions) for mode, vec_env in fleets.items()}
            want = reference.step(actions)
            assert_same(got["NextStep"], got["SameStep"], f"step {t}: NextStep against SameStep")
            for i, info in enumerate(got["NextStep"][3]):
                if "terminal_observation" not in info:
                    continue
                ends += 1
                if env == "DiscreteObsEnv":
                    assert_same(info["terminal_observation"], want[3][i]["terminal_observation"], f"step {t}")
                else:  # (DummyVecEnv's is the env's float64 array; the servers' batch is float32)
                    last = want[3][i]["terminal_observation"]
                    assert_same(info["terminal_observation"], last.astype(np.float32), f"step {t}")
        assert ends == 4
    finally:
        for vec_env in (*fleets.values(), reference):
            vec_env.close()


def test_env_is_wrapped_answers_what_the_servers_say_and_indices_are_checked(start_servers: StartServers) -> None:
    """env_is_wrapped: True for the wrappers a server's spec tells of (a time limit's TimeLimit, its
    --wrappers), False for SB3's Monitor (what evaluate_policy and VecMonitor ask: both run on the
    adapter), AttributeError for other wrappers, which the operator's env may or may not have (was:
    False for every class, TimeLimit too); False for every class of a vector_entry_point server's.
    Indices out of range: IndexError, as DummyVecEnv's (was: answered)."""
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import VecMonitor

    from learner.sb3 import RemoteVecEnv, _served_wrappers

    cartpole = start_servers("CartPole-v1", 1, 2)
    flat = start_servers("tests.envs:DictEnv", 1, 2, server_args=["--wrappers", "flatten"])
    with RemoteVecEnv(cartpole) as vec_env:
        assert vec_env.env_is_wrapped(gym.wrappers.TimeLimit) == [True, True]
        assert vec_env.env_is_wrapped(gym.Wrapper, indices=[-1]) == [True]
        assert vec_env.env_is_wrapped(Monitor) == [False, False]
        with pytest.raises(AttributeError, match=r"env_is_wrapped\(OrderEnforcing\).*not known"):
            vec_env.env_is_wrapped(gym.wrappers.OrderEnforcing)
        for call, indices in (("get_attr", 2), ("env_is_wrapped", [0, -3]), ("set_attr", [5]), ("env_method", 2)):
            with pytest.raises(IndexError, match=rf"RemoteVecEnv\.{call}: env index -?\d is out of range"):
                if call == "get_attr":
                    vec_env.get_attr("spec", indices)
                elif call == "env_is_wrapped":
                    vec_env.env_is_wrapped(gym.wrappers.TimeLimit, indices)
                elif call == "set_attr":
                    vec_env.set_attr("render_mode", None, indices)
                else:
                    vec_env.env_method("render", indices=indices)
        assert [s.id for s in vec_env.get_attr("spec", [-1, 1])] == ["CartPole-v1"] * 2

        class Zeros:  # (a policy for evaluate_policy, which needs only predict)
            def predict(
                self,
                observation: np.ndarray | dict[str, np.ndarray],
                state: tuple[np.ndarray, ...] | None = None,
                episode_start: np.ndarray | None = None,
                deterministic: bool = False,
            ) -> tuple[np.ndarray, tuple[np.ndarray, ...] | None]:
                return np.zeros(2, dtype=np.int64), None

        with pytest.warns(UserWarning, match="not wrapped with a ``Monitor``"):  # (it counts episodes itself)
            mean, _ = cast(tuple[float, float], evaluate_policy(Zeros(), vec_env, n_eval_episodes=2))
        assert 5 < mean < 50
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (VecMonitor warns of envs in a Monitor already)
            monitored = VecMonitor(vec_env)
            mean, _ = cast(tuple[float, float], evaluate_policy(Zeros(), monitored, n_eval_episodes=2))
        assert 5 < mean < 50
    with RemoteVecEnv(flat) as vec_env:
        assert vec_env.env_is_wrapped(gym.wrappers.FlattenObservation) == [True, True]
        assert vec_env.env_is_wrapped(gym.ObservationWrapper) == [True, True]
        with pytest.raises(AttributeError, match=r"spec tells only of some \(FlattenObservation\)"):
            vec_env.env_is_wrapped(gym.wrappers.TimeLimit)  # (DictEnv has no time limit: not known here)
    # (an env's own vectorized implementation has no per-env wrappers; none that gymnasium has takes
    # SameStep, which RemoteVecEnv needs of a vector_entry_point server, so told from its spec alone)
    spec = pb.EnvSpec(env_id="CartPole-v1", vectorization="vector_entry_point", max_episode_steps=500)
    assert _served_wrappers(spec) == ([], True)


def test_option_groups_take_equal_dicts_whose_keys_came_in_another_order_as_one() -> None:
    """From the diff's review: groups keyed by the options' wire form kept insertion order, so equal dicts made
    two groups (two resets; on a vector_entry_point server refused as options differing per env)."""
    from learner.sb3 import _option_groups

    same = [{"a": 1, "b": {"c": 2, "d": [3]}}, {"b": {"d": [3], "c": 2}, "a": 1}]
    assert [members for _, members in _option_groups(same, 2)] == [[0, 1]]
    other = [{"a": 1}, {"a": 2}]
    assert [members for _, members in _option_groups(other, 2)] == [[0], [1]]
