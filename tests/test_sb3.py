"""learner.sb3.RemoteVecEnv: env servers as a Stable-Baselines3 VecEnv.

Its transitions equal DummyVecEnv's for the same seeds and actions, under either autoreset mode of
the servers; by-name calls are answered here or refused; a fault-tolerant fleet's lost server
costs its envs' episodes, not the run; SB3's PPO trains on it and evaluate_policy runs on it.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, cast

import gymnasium as gym
import numpy as np
import pytest

from learner import InvalidArgumentError, RemoteVectorEnv, ServerUnavailableError, SpecMismatchError
from tests.compare import assert_same
from tests.conftest import FAST, HAS_SB3, SpawnServer, StartServers
from tests.envs import DictEnv

needs_sb3 = pytest.mark.skipif(
    not HAS_SB3,
    reason="stable-baselines3 is not installed (pip install 'envfleet[sb3]')",
)

K = 2  # envs per server where the layout does not matter

# Served env -> (env-server options, the same env made here for DummyVecEnv, actions for n envs at step t).
# DictEnv's nested Dict observations are not for SB3 (it takes flat Dicts only): flattened on both
# sides, it ends episodes by termination and by truncation, with infos of every kind the wire carries
# (ints, floats, bools, strings, arrays, nested dicts; keys that come and go).
CASES: dict[str, tuple[list[str], Callable[[], gym.Env[Any, Any]], Callable[[np.random.Generator, int], Any]]] = {
    "CartPole-v1": ([], lambda: gym.make("CartPole-v1"), lambda rng, n: rng.integers(0, 2, size=n)),
    "tests.envs:DictEnv": (
        ["--wrappers", "flatten"],
        lambda: gym.wrappers.FlattenObservation(DictEnv()),
        lambda rng, n: rng.uniform(-1, 1, size=(n, 2)).astype(np.float32),
    ),
}


def assert_same_step(got: tuple[Any, ...], want: tuple[Any, ...], where: str) -> None:
    obs, rewards, dones, infos = got
    want_obs, want_rewards, want_dones, want_infos = want
    assert_same(obs, want_obs, f"{where} observations")
    # The fleet's rewards are float64, as SubprocVecEnv's for Python floats; DummyVecEnv rounds them to float32.
    assert rewards.dtype == np.float64 and want_rewards.dtype == np.float32, (rewards.dtype, want_rewards.dtype)
    assert np.array_equal(rewards.astype(np.float32), want_rewards), f"{where} rewards: {rewards} vs {want_rewards}"
    assert_same(dones, want_dones, f"{where} dones")
    assert_same(infos, want_infos, f"{where} infos")


@needs_sb3
@pytest.mark.parametrize("fault_tolerant", [False, True], ids=["plain", "fault-tolerant"])
@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
@pytest.mark.parametrize("env_id", list(CASES))
def test_transitions_equal_dummy_vec_envs(
    start_servers: StartServers, env_id: str, mode: str, fault_tolerant: bool
) -> None:
    """2 servers x 3 envs give exactly what SB3's DummyVecEnv over 6 envs gives for the same seeds and
    actions: observations (the new episode's first where one ended), dones, rewards, infos with
    terminal_observation and TimeLimit.truncated, reset_infos; under next-step autoreset (the
    adapter resets ended envs itself, losing and repeating no transition) and same-step alike."""
    from stable_baselines3.common.vec_env import DummyVecEnv

    from learner.sb3 import RemoteVecEnv

    server_args, make_env, act = CASES[env_id]
    addresses = start_servers(env_id, 2, 3, server_args=[*server_args, "--autoreset-mode", mode])
    reference = DummyVecEnv([make_env] * 6)
    with RemoteVecEnv(addresses, fault_tolerant=fault_tolerant) as vec_env:
        assert vec_env.num_envs == 6
        assert vec_env.observation_space == reference.observation_space
        assert vec_env.action_space == reference.action_space
        assert vec_env.render_mode is None

        assert vec_env.seed(123) == reference.seed(123)
        assert_same(vec_env.reset(), reference.reset(), "reset observations")
        assert_same(vec_env.reset_infos, reference.reset_infos, "reset infos")
        rng = np.random.default_rng(7)
        terminated = truncated = 0
        for t in range(300):
            actions = act(rng, 6)
            got = vec_env.step(actions)
            want = reference.step(actions)
            assert_same_step(got, want, f"step {t}")
            assert_same(vec_env.reset_infos, reference.reset_infos, f"step {t} reset infos")
            for done, info in zip(got[2], got[3], strict=True):
                truncated += bool(done and info["TimeLimit.truncated"])
                terminated += bool(done and not info["TimeLimit.truncated"])
        assert terminated >= 10, f"only {terminated} episodes terminated; the test should span many"
        if env_id != "CartPole-v1":  # (random CartPole episodes end long before its time limit)
            assert truncated >= 10, f"only {truncated} episodes truncated"

        # A second reset, seeded again: the same start as the first.
        vec_env.seed(123)
        reference.seed(123)
        assert_same(vec_env.reset(), reference.reset(), "second reset")
    reference.close()


@needs_sb3
@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
def test_seeds_and_options_reach_each_env_once(start_servers: StartServers, mode: str) -> None:
    """seed() and set_options() as SB3's VecEnv defines them: used by the next reset() only; options
    one dict for every env, or a list of one per env (those differing: one reset_mask reset each)."""
    from stable_baselines3.common.vec_env import DummyVecEnv

    from learner.sb3 import RemoteVecEnv

    server_args, make_env, act = CASES["tests.envs:DictEnv"]
    addresses = start_servers("tests.envs:DictEnv", 2, 2, server_args=[*server_args, "--autoreset-mode", mode])
    reference = DummyVecEnv([make_env] * 4)
    with RemoteVecEnv(addresses) as vec_env:
        rng = np.random.default_rng(0)
        per_env: list[dict[str, Any]] = [{"level": 1}, {}, {"level": 2, "name": "hard"}, {"level": 1}]
        for options in (per_env, {"level": 3}, None, per_env):  # per-env options before any other reset, too
            for env in (vec_env, reference):
                env.seed(5)
                env.set_options(options)
            assert_same(vec_env.reset(), reference.reset(), f"reset with options {options}")
            assert_same(vec_env.reset_infos, reference.reset_infos, f"reset infos with options {options}")
            assert vec_env._options == [{}] * 4 and vec_env._seeds == [None] * 4  # used once
            for t in range(10):
                actions = act(rng, 4)
                assert_same_step(vec_env.step(actions), reference.step(actions), f"step {t} after options {options}")
        # An unseeded reset with no options: every env's reset info says no options came.
        vec_env.reset()
        assert all("options_seen" not in info for info in vec_env.reset_infos)
    reference.close()


@needs_sb3
def test_by_name_calls_are_answered_here_or_refused_saying_why(start_servers: StartServers) -> None:
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env import VecMonitor

    from learner.sb3 import RemoteVecEnv

    addresses = start_servers("CartPole-v1", 1, K)
    with RemoteVecEnv(addresses) as vec_env:
        # What SB3 asks itself (VecEnv.__init__, VecMonitor, evaluate_policy) is answered here.
        assert vec_env.render_mode is None
        assert vec_env.get_attr("render_mode") == [None] * K
        assert vec_env.get_attr("observation_space", indices=[1]) == [vec_env.observation_space]
        assert vec_env.get_attr("action_space", indices=0) == [vec_env.action_space]
        metadata = vec_env.get_attr("metadata")
        assert metadata[0]["render_fps"] == gym.make("CartPole-v1").metadata["render_fps"]
        assert "autoreset_mode" not in metadata[0]
        assert [spec.id for spec in vec_env.get_attr("spec")] == ["CartPole-v1"] * K
        assert vec_env.env_is_wrapped(Monitor) == [False] * K
        assert vec_env.env_is_wrapped(Monitor, indices=[1]) == [False]
        assert vec_env.has_attr("render_mode") and not vec_env.has_attr("gravity")
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # (VecMonitor warns when the envs are Monitor-wrapped already)
            VecMonitor(vec_env)
        assert vec_env.get_images() == [None] * K

        # Anything else would have a server read, set or call something by name: refused, saying so.
        with pytest.raises(AttributeError, match=r"get_attr\('gravity'\).*by name.*infos"):
            vec_env.get_attr("gravity")
        with pytest.raises(AttributeError, match=r"set_attr\('gravity', \.\.\.\).*set_options.*reset\(options"):
            vec_env.set_attr("gravity", 5.0)
        with pytest.raises(AttributeError, match=r"env_method\('compute_reward', \.\.\.\).*by name"):
            vec_env.env_method("compute_reward", None, None, {}, indices=[0])
        # Refusals change nothing: the fleet steps on.
        vec_env.reset()
        vec_env.step(np.zeros(K, dtype=np.int64))


@needs_sb3
def test_configurations_it_cannot_serve_are_refused(start_servers: StartServers) -> None:
    from learner.sb3 import RemoteVecEnv

    addresses = start_servers("CartPole-v1", 1, K)
    with pytest.raises(InvalidArgumentError, match="copy=False"):
        RemoteVecEnv(addresses, copy=False)
    with RemoteVectorEnv(addresses) as remote:
        with pytest.raises(InvalidArgumentError, match=r"options \['timeout'\]"):
            RemoteVecEnv(remote, timeout=5.0)
        vec_env = RemoteVecEnv(remote)  # a RemoteVectorEnv of the caller's
        assert vec_env.remote is remote
        vec_env.close()
        assert remote.closed  # (closing the VecEnv closes the fleet, as SB3's close does its envs)
    with pytest.raises(InvalidArgumentError, match="is closed"):
        RemoteVecEnv(remote)

    # An env's own vectorized implementation may ignore reset_mask (gymnasium's CartPole one resets
    # all its envs): under next-step autoreset the adapter needs it, so such servers are refused...
    vectorized = start_servers("CartPole-v1", 1, K, server_args=["--vectorization", "vector_entry_point"])
    with pytest.raises(
        SpecMismatchError,
        match=r"env server local-0 (\(unix:\S+\) )?step their envs with --vectorization "
        r"vector_entry_point.*--autoreset-mode SameStep",
    ) as refused:
        RemoteVecEnv(vectorized)  # (named as this process's local servers are named everywhere)
    assert refused.value.address == vectorized[0]
    # ... and the fleet it made to find out was closed: the server takes another learner at once.
    with RemoteVectorEnv(vectorized + addresses[:1], connect_timeout=5.0) as remote:
        assert remote.vectorizations == ["vector_entry_point", "sync"]  # (what the refusal was judged by)
        remote.reset(seed=0)


@needs_sb3
@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
def test_an_env_that_raises_ends_its_episode_and_is_reset_once(spawn_server: SpawnServer, mode: str) -> None:
    """Fault-tolerant: env 0 raises in its 3rd step; SB3 sees its episode end (truncated, the error in
    its info) and a new one start in that step; the next step is a step of the new episode (no
    second reset: under next-step autoreset the adapter's reset stands in for the server's).
    FaultyEnv's observations are [t, resets]."""
    from learner.sb3 import RemoteVecEnv

    server = spawn_server(
        "tests.envs:FaultyEnv", 3, "--env-kwargs", '{"raise_at": 3, "length": 100}', "--autoreset-mode", mode
    )
    obs: Any  # (an array here: SB3's VecEnvObs is a union of an array, a dict and a tuple of them)
    with RemoteVecEnv([server.address], fault_tolerant=True) as vec_env:
        vec_env.reset()
        zeros = np.zeros(3, dtype=np.int64)
        for _ in range(2):
            vec_env.step(zeros)
        obs, rewards, dones, infos = vec_env.step(zeros)
        assert dones.tolist() == [True, False, False] and rewards.tolist() == [0.0, 1.0, 1.0]
        assert infos[0]["TimeLimit.truncated"] is True and infos[0]["env_unavailable"] is True
        assert "step: ValueError: step 3 failed on purpose (env 0)" in infos[0]["env_error"]
        assert infos[0]["terminal_observation"].tolist() == [2.0, 1.0]  # the last good observation
        assert obs.tolist() == [[0.0, 2.0], [3.0, 1.0], [3.0, 1.0]]  # env 0: a new episode's first
        assert "env_error" not in infos[1] and "env_unavailable" not in infos[1]
        obs, rewards, dones, infos = vec_env.step(zeros)
        assert obs[0].tolist() == [1.0, 2.0] and rewards[0] == 1.0  # stepped, not reset again
        assert not dones.any() and all("env_error" not in info for info in infos)


@needs_sb3
@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
def test_a_lost_server_costs_its_envs_episodes_not_the_run(spawn_server: SpawnServer, mode: str) -> None:
    """Fault-tolerant: a killed server's envs end their episodes (truncated) on the step it is lost,
    repeat their last observation with reward 0 while it is down, and start new episodes once it is
    back, the stretch while it was down ending there as a truncation (so that no transition bootstraps
    across it); every such step says env_unavailable. IndexEnv's observations are [token, index, t,
    action]."""
    from learner.sb3 import RemoteVecEnv

    endless = ("--env-kwargs", '{"length": 100000}', "--autoreset-mode", mode)
    a = spawn_server("tests.envs:IndexEnv", K, *endless)
    b = spawn_server("tests.envs:IndexEnv", K, *endless)
    lost = [False] * K + [True] * K
    obs: Any  # (an array here: SB3's VecEnvObs is a union of an array, a dict and a tuple of them)
    with RemoteVecEnv([a.address, b.address], fault_tolerant=True, **FAST) as vec_env:
        obs = vec_env.reset()
        token_b = obs[K, 0]
        for t in range(3):
            obs, _, _, infos = vec_env.step(np.full(2 * K, t))
            assert not any("env_unavailable" in info for info in infos)
        before = obs.copy()

        assert b.kill() == -signal.SIGKILL
        obs, rewards, dones, infos = vec_env.step(np.full(2 * K, 3))
        assert dones.tolist() == lost and rewards[K:].tolist() == [0.0] * K
        assert [info.get("env_unavailable", False) for info in infos] == lost
        for i in range(K, 2 * K):
            assert infos[i]["TimeLimit.truncated"] is True
            assert np.array_equal(infos[i]["terminal_observation"], before[i])
        assert np.array_equal(obs[K:], before[K:])  # (no new episode to start yet)
        assert obs[:K, 3].tolist() == [3.0] * K  # the other server's envs stepped

        for t in range(4, 7):  # down: no transitions, and no more episode ends
            obs, rewards, dones, infos = vec_env.step(np.full(2 * K, t))
            assert not dones.any() and rewards[K:].tolist() == [0.0] * K
            assert [info.get("env_unavailable", False) for info in infos] == lost
            assert np.array_equal(obs[K:], before[K:]) and obs[:K, 3].tolist() == [float(t)] * K

        b.start()
        deadline = time.monotonic() + 10.0
        t = 7
        while obs[K, 0] == token_b:  # until the restarted server's envs are back (another token)
            assert time.monotonic() < deadline, "the envs did not rejoin within 10 s"
            obs, rewards, dones, infos = vec_env.step(np.full(2 * K, t))
            t += 1
            assert not dones[:K].any() and dones[K:].tolist() == [obs[K, 0] != token_b] * K
            time.sleep(0.01)
        assert [info.get("env_unavailable", False) for info in infos] == lost  # the rejoin step: first observations
        assert obs[K:, 2].tolist() == [0.0] * K
        for i in range(K, 2 * K):  # the stretch while down ends: truncated, at the observation it repeated
            assert infos[i]["TimeLimit.truncated"] is True
            assert np.array_equal(infos[i]["terminal_observation"], before[i])
            assert vec_env.reset_infos[i].get("env_unavailable") is True  # (the reset's infos, as fleet gives them)
        for step in range(t, t + 3):
            obs, _, dones, infos = vec_env.step(np.full(2 * K, step))
            assert not dones.any() and not any("env_unavailable" in info for info in infos)
            assert obs[:, 3].tolist() == [float(step)] * (2 * K)
        assert vec_env.remote.fault_stats().env_steps_lost >= 5 * K


@needs_sb3
def test_without_fault_tolerance_a_lost_server_raises(spawn_server: SpawnServer) -> None:
    from learner.sb3 import RemoteVecEnv

    server = spawn_server("tests.envs:IndexEnv", K)
    with RemoteVecEnv([server.address], timeout=2.0) as vec_env:
        vec_env.reset()
        server.kill()
        with pytest.raises(ServerUnavailableError) as info:
            vec_env.step(np.zeros(K, dtype=np.int64))
        assert info.value.address == server.address


@needs_sb3
def test_reset_drops_a_step_in_flight(start_servers: StartServers) -> None:
    """SB3's reset() cancels a step_async not waited for; the fleet goes on from the reset."""
    from stable_baselines3.common.vec_env import DummyVecEnv

    from learner.sb3 import RemoteVecEnv

    addresses = start_servers("CartPole-v1", 2, K)
    reference = DummyVecEnv([CASES["CartPole-v1"][1]] * (2 * K))
    with RemoteVecEnv(addresses) as vec_env:
        vec_env.reset()
        vec_env.step_async(np.ones(2 * K, dtype=np.int64))
        for env in (vec_env, reference):
            env.seed(3)
        assert_same(vec_env.reset(), reference.reset())
        actions = np.zeros(2 * K, dtype=np.int64)
        assert_same_step(vec_env.step(actions), reference.step(actions), "after the reset")


def test_import_learner_does_not_import_sb3_and_without_it_the_extra_is_named() -> None:
    script = (
        "import sys\n"
        "import learner\n"
        "learner.RemoteVectorEnv\n"
        "assert 'stable_baselines3' not in sys.modules, 'import learner imported stable_baselines3'\n"
        "sys.modules['stable_baselines3'] = None  # (as if not installed)\n"
        "try:\n"
        "    learner.RemoteVecEnv\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert "needs stable-baselines3" in done.stdout and "pip install 'envfleet[sb3]'" in done.stdout, done


@needs_sb3
@pytest.mark.slow
def test_ppo_trains_on_a_fleet_and_evaluate_policy_runs_on_one(start_servers: StartServers) -> None:
    """The one-line swap: SB3's PPO on RemoteVecEnv (in VecMonitor, as make_vec_env's Monitor) where
    SubprocVecEnv was, on CartPole served by 2 local servers x 4 envs under their default autoreset
    mode (next-step); then evaluate_policy on another fleet. It learns: after 5k steps the
    evaluation's mean return is well above a random policy's (~22; 95-500 on seeds 0-4)."""
    import torch
    from stable_baselines3 import PPO
    from stable_baselines3.common.evaluation import evaluate_policy
    from stable_baselines3.common.logger import Logger
    from stable_baselines3.common.vec_env import VecMonitor

    from learner.sb3 import RemoteVecEnv

    train_addresses = start_servers("CartPole-v1", 2, 4)
    eval_addresses = start_servers("CartPole-v1", 1, 4)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (a tiny MLP: more threads only contend with the servers)
    try:
        with RemoteVecEnv(train_addresses) as train_env, RemoteVecEnv(eval_addresses) as eval_env:
            model = PPO(
                "MlpPolicy",
                VecMonitor(train_env),
                n_steps=32,
                batch_size=256,
                n_epochs=20,
                gae_lambda=0.8,
                gamma=0.98,
                learning_rate=0.001,
                ent_coef=0.0,
                clip_range=0.2,
                seed=0,
                device="cpu",
            )  # (RL Zoo's CartPole-v1 hyperparameters)
            model.set_logger(Logger(folder=None, output_formats=[]))  # (not SB3's: an empty /tmp/SB3-<time> folder)
            model.learn(total_timesteps=5_000)
            assert model.ep_info_buffer is not None
            assert len(model.ep_info_buffer) > 0  # VecMonitor's episodes reached SB3's logger
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # (evaluate_policy warns of an env without a Monitor)
                eval_env.seed(0)
                # (the mean and std of the returns: evaluate_policy's return type also has its per-episode lists)
                mean, std = cast(tuple[float, float], evaluate_policy(model, VecMonitor(eval_env), n_eval_episodes=8))
            assert mean > 50, f"mean evaluation return {mean} +- {std} after {model.num_timesteps} steps"
    finally:
        torch.set_num_threads(threads)


@needs_sb3
def test_an_episode_that_terminates_on_its_time_limits_step_is_no_time_limit_truncation(
    start_servers: StartServers,
) -> None:
    """SB3's TimeLimit.truncated is True only for an episode cut by its time limit: one that terminates on
    the limit's last step is a termination (with it True, SB3 bootstrapped a value past the end)."""
    from learner.sb3 import RemoteVecEnv

    addresses = start_servers(
        "tests.envs:ClockEnv",
        envs_per_server=K,
        env_kwargs={"length": 3, "end": "terminate"},
        server_args=["--max-episode-steps", "3"],
    )
    with RemoteVecEnv(addresses) as vec_env:
        vec_env.reset()
        for _ in range(3):
            _, _, dones, infos = vec_env.step(np.zeros(K, dtype=np.int64))
        assert dones.all()
        assert [info["TimeLimit.truncated"] for info in infos] == [False] * K
