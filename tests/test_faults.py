"""Servers that die, hang or come back, and envs that raise: the learner neither crashes nor hangs.

Real servers (subprocesses) killed with SIGKILL and started again on the same port; envs from
tests.envs that raise or hang on cue. IndexEnv observations ``[token, index, t, last_action]`` show
that every result reaches the env it belongs to.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import gymnasium as gym
import numpy as np
import pytest

from env_server.health import check
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from learner import (
    EnvCrashedError,
    InvalidArgumentError,
    RemoteTimeoutError,
    RemoteVectorEnv,
    ServerBusyError,
    ServerUnavailableError,
    SessionError,
    SpecMismatchError,
    faults,
)
from learner.client import translate_error
from tests.conftest import FAST, ServerProcess, SpawnServer, fleet, slow_to_build_server
from tests.faulty_server import Faults, FaultyServer

K = 2  # envs per server


ENDLESS = ("--env-kwargs", '{"length": 100000}')  # (IndexEnv episodes that outlast a test)


@contextlib.contextmanager
def _second_server_lost(spawn_server: SpawnServer) -> Iterator[tuple[RemoteVectorEnv, ServerProcess]]:
    """A fault-tolerant fleet of two servers of K endless IndexEnvs, reset, whose second server was killed
    and lost in a step: the fleet, and that server (to start again)."""
    a = spawn_server("tests.envs:IndexEnv", K, *ENDLESS)
    b = spawn_server("tests.envs:IndexEnv", K, *ENDLESS)
    with RemoteVectorEnv([a.address, b.address], fault_tolerant=True, **FAST) as envs:
        envs.reset(seed=0)
        b.kill()
        envs.step(actions_for(0, 2 * K))  # the loss
        yield envs, b


def actions_for(step: int, num_envs: int) -> np.ndarray:
    """A different action for every env and step (IndexEnv echoes it back)."""
    return (np.arange(num_envs) * 7 + step * 13) % 1000


def check_echo(obs: np.ndarray, sent: np.ndarray, ok: np.ndarray) -> None:
    """Envs in ``ok`` returned the result of the action they were sent, and their own index."""
    assert np.array_equal(obs[ok, 3], sent[ok]), (obs[ok], sent[ok])
    assert np.array_equal(obs[:, 1], np.tile(np.arange(K), len(obs) // K))


def step_until(
    envs: RemoteVectorEnv, t0: int, done: Any, limit_s: float, act: Any = actions_for
) -> tuple[int, tuple[Any, ...]]:
    """Step with ``act(t, num_envs)`` actions until ``done(result)``; (steps taken, last result)."""
    deadline = time.monotonic() + limit_s
    t = t0
    while True:
        result = envs.step(act(t, envs.num_envs))
        t += 1
        if done(result):
            return t, result
        assert time.monotonic() < deadline, f"not within {limit_s} s"
        time.sleep(0.01)


def unavailable(infos: dict[str, Any], n: int) -> np.ndarray:
    return np.asarray(infos.get("_env_unavailable", np.zeros(n, dtype=bool)))


@pytest.mark.slow
def test_server_killed_mid_rollout_and_restarted_on_the_same_address_rejoins(spawn_server: SpawnServer) -> None:
    # Episodes that outlast the test: a's reaching IndexEnv's default 100 steps during the 5 steps
    # checked after the rejoin would make one of them a reset step, echoing no action.
    a = spawn_server("tests.envs:IndexEnv", K, *ENDLESS)
    b = spawn_server("tests.envs:IndexEnv", K, *ENDLESS)
    with RemoteVectorEnv([a.address, b.address], fault_tolerant=True, **FAST) as envs:
        obs, infos = envs.reset(seed=0)
        assert "env_unavailable" not in infos
        token_b = obs[K, 0]
        for t in range(5):
            sent = actions_for(t, 2 * K)
            obs, rewards, terms, truncs, infos = envs.step(sent)
            check_echo(obs, sent, np.ones(2 * K, dtype=bool))
            assert "env_unavailable" not in infos
        before = obs.copy()

        assert b.kill() == -signal.SIGKILL
        start = time.monotonic()
        sent = actions_for(5, 2 * K)
        obs, rewards, terms, truncs, infos = envs.step(sent)
        assert time.monotonic() - start < FAST["timeout"] + 1.0
        lost = unavailable(infos, 2 * K)
        assert lost.tolist() == [False] * K + [True] * K
        assert truncs.tolist() == [False] * K + [True] * K  # the episodes in progress end, truncated
        assert rewards[K:].tolist() == [0.0] * K and not terms.any()
        assert np.array_equal(obs[K:], before[K:])  # their last observations
        check_echo(obs, sent, ~lost)  # the other server's envs got their actions
        assert envs.fault_stats().servers_down == 1

        # While it is down: the other envs step on; the lost ones are no transitions, never truncated again.
        for t in range(6, 12):
            sent = actions_for(t, 2 * K)
            obs, rewards, terms, truncs, infos = envs.step(sent)
            assert unavailable(infos, 2 * K).tolist() == [False] * K + [True] * K
            assert not truncs.any() and not terms.any()
            check_echo(obs, sent, ~unavailable(infos, 2 * K))

        back = b.start()  # same port
        t, (obs, rewards, terms, truncs, infos) = step_until(envs, 12, lambda r: r[0][K, 0] != token_b, limit_s=10.0)
        assert time.monotonic() - back < 10.0, "the envs rejoin within 10 s of their server being back"
        # The rejoin step: new episodes' first observations, still no transition.
        assert unavailable(infos, 2 * K).tolist() == [False] * K + [True] * K
        assert obs[K:, 2].tolist() == [0.0] * K and obs[K:, 3].tolist() == [-1.0] * K
        assert rewards[K:].tolist() == [0.0] * K
        for step in range(t, t + 5):
            sent = actions_for(step, 2 * K)
            obs, _, _, _, infos = envs.step(sent)
            assert "env_unavailable" not in infos
            check_echo(obs, sent, np.ones(2 * K, dtype=bool))
        stats = envs.fault_stats()
        assert (stats.failures, stats.reconnects, stats.server_restarts, stats.servers_down) == (1, 1, 1, 0)
        assert stats.env_steps_lost >= 8 * K
        replicas = envs.replica_stats()
        assert [(r.failures, r.reconnects, r.available) for r in replicas] == [(0, 0, True), (1, 1, True)]


@pytest.mark.slow
def test_a_server_that_never_comes_back_leaves_the_others_stepping(spawn_server: SpawnServer) -> None:
    servers = [spawn_server("tests.envs:IndexEnv", K) for _ in range(3)]
    with RemoteVectorEnv([s.address for s in servers], fault_tolerant=True, **FAST) as envs:
        envs.reset(seed=0)
        envs.step(actions_for(0, 3 * K))
        servers[1].kill()
        start = time.monotonic()
        for t in range(1, 40):
            sent = actions_for(t, 3 * K)
            obs, _, _, _, infos = envs.step(sent)
            lost = unavailable(infos, 3 * K)
            assert lost.tolist() == [False] * K + [True] * K + [False] * K
            check_echo(obs, sent, ~lost)
        assert time.monotonic() - start < 20
        assert envs.available.tolist() == [True] * K + [False] * K + [True] * K
        stats = envs.fault_stats()
        assert (stats.failures, stats.reconnects, stats.envs_unavailable) == (1, 0, K)
    # Closing does not wait for the dead server.


def test_same_step_a_lost_servers_cut_episodes_come_as_gymnasium_lays_final_infos_out(
    spawn_server: SpawnServer,
) -> None:
    """Same-step autoreset: the envs of a server lost mid-episode end truncated, with their last
    observations as ``final_obs`` and ``final_info`` a dict of the envs' final infos joined key by key
    (none here), as gymnasium's vector envs give it, so it joins the other servers' ``final_info``."""
    servers = [spawn_server("tests.envs:IndexEnv", K, "--autoreset-mode", "SameStep") for _ in range(2)]
    with RemoteVectorEnv([s.address for s in servers], fault_tolerant=True, **FAST) as envs:
        envs.reset(seed=0)
        obs, *_ = envs.step(actions_for(0, 2 * K))
        last = obs[K:].copy()
        servers[1].kill()
        _, _, _, truncs, infos = envs.step(actions_for(1, 2 * K))
        assert truncs.tolist() == [False] * K + [True] * K
        assert infos["_final_obs"].tolist() == [False] * K + [True] * K
        assert [o.tolist() for o in infos["final_obs"][K:]] == last.tolist()
        assert isinstance(infos["final_info"], dict) and infos["_final_info"].tolist() == [False] * K + [True] * K


@pytest.mark.slow
def test_all_servers_down_steps_return_without_spinning(spawn_server: SpawnServer) -> None:
    server = spawn_server("tests.envs:IndexEnv", K)
    with RemoteVectorEnv([server.address], fault_tolerant=True, **FAST) as envs:
        envs.reset(seed=0)
        server.kill()
        envs.step(actions_for(0, K))  # the loss
        start = time.monotonic()
        for t in range(3):
            _, _, _, _, infos = envs.step(actions_for(t, K))
            assert unavailable(infos, K).all()
        # Each step waited (up to 1 s) for the server to come back, instead of returning at once.
        assert 2.0 < time.monotonic() - start < 10.0
        server.start()
        step_until(envs, 3, lambda r: "env_unavailable" not in r[4], limit_s=10.0)


def test_without_fault_tolerance_a_lost_server_raises(spawn_server: SpawnServer) -> None:
    server = spawn_server("tests.envs:IndexEnv", K)
    with RemoteVectorEnv([server.address], timeout=2.0) as envs:
        envs.reset(seed=0)
        server.kill()
        with pytest.raises(ServerUnavailableError) as info:
            envs.step(actions_for(0, K))
        assert info.value.address == server.address


def test_without_fault_tolerance_a_full_reset_takes_a_restarted_server_back(spawn_server: SpawnServer) -> None:
    """As the README says: after a lost server, reset() (not only refresh()) goes on, once it is back
    (it gets a new session; was: "does not own this server ...; call Handshake again" for ever)."""
    a = spawn_server("CartPole-v1", K)
    b = spawn_server("CartPole-v1", K)
    local = gym.make_vec("CartPole-v1", num_envs=2 * K, vectorization_mode="sync")
    with RemoteVectorEnv([a.address, b.address], timeout=2.0) as envs:
        envs.reset(seed=0)
        b.kill()
        with pytest.raises(ServerUnavailableError):
            envs.step(np.zeros(2 * K, dtype=np.int64))
        b.start()
        # Another learner got there first: refused, and the next reset tries again.
        with RemoteVectorEnv([b.address]) as other, pytest.raises(ServerBusyError):
            other.reset(seed=0)
            envs.reset(seed=3)
        np.testing.assert_array_equal(envs.reset(seed=3)[0], local.reset(seed=3)[0])
        for t in range(3):
            actions = np.arange(2 * K) % 2 if t % 2 else np.ones(2 * K, dtype=np.int64)
            np.testing.assert_array_equal(envs.step(actions)[0], local.step(actions)[0])
        # Back with other envs: named, and refresh() is the way on.
        b.kill()
        port = b.address.rpartition(":")[2]
        b.argv = ["--env", "CartPole-v1", "--num-envs", str(K + 1)]
        b.start(port)
        with pytest.raises(
            SpecMismatchError, match=r"came back with another num_envs .*refresh\(\) takes the fleet"
        ) as refused:
            envs.reset(seed=0)
        assert refused.value.address == b.address
        assert envs.refresh() is not None and envs.num_envs == 2 * K + 1
        envs.reset(seed=0)
    local.close()


@pytest.mark.slow
def test_without_fault_tolerance_a_masked_reset_of_all_a_restarted_servers_envs_takes_it_back(
    spawn_server: SpawnServer,
) -> None:
    """A server restarted between calls: a step names reset() as the way on (not the server's
    "call Handshake", which this class's users never do); a reset_mask reset that takes all its envs
    renews its session as a full reset does; one that takes some of them is refused before anything is
    sent (a new session starts them all over); one that takes none leaves it as it is."""
    a = spawn_server("CartPole-v1", K)
    b = spawn_server("CartPole-v1", K)
    local = gym.make_vec("CartPole-v1", num_envs=K, vectorization_mode="sync")
    with RemoteVectorEnv([a.address, b.address], timeout=2.0) as envs:
        envs.reset(seed=0)
        b.kill()
        b.start()
        time.sleep(0.5)  # (the session's Hold stream has seen the old server go)
        with pytest.raises(SessionError, match=r"Handshake again \(for this RemoteVectorEnv: reset\(\) does so"):
            envs.step(np.zeros(2 * K, dtype=np.int64))
        envs.reset(seed=0)
        b.kill()
        b.start()
        time.sleep(0.5)
        partial = np.array([False, True] + [True, False] * (K - 1))
        with pytest.raises(
            SessionError, match=rf"session ended .*its envs {K}-{2 * K - 1} all start over .*nothing was reset"
        ):
            envs.reset(options={"reset_mask": partial})
        envs.reset(options={"reset_mask": np.arange(2 * K) < 1})  # none of B's: A's env 0 only
        obs, _ = envs.reset(seed=5, options={"reset_mask": np.arange(2 * K) >= K})
        np.testing.assert_array_equal(obs[K:], local.reset(seed=5 + K)[0])
        actions = np.ones(2 * K, dtype=np.int64)
        np.testing.assert_array_equal(envs.step(actions)[0][K:], local.step(actions[K:])[0])
    local.close()


def test_servers_of_other_envs_with_the_same_spaces_are_warned_of(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture
) -> None:
    a = spawn_server("CartPole-v1", 1)
    b = spawn_server("CartPole-v0", 1)
    with caplog.at_level(logging.WARNING, logger="learner.remote"), RemoteVectorEnv([a.address, b.address]) as envs:
        envs.reset(seed=0)
    assert (
        f"env server {b.address} serves another env than the rest (env_id 'CartPole-v0', not env server "
        f"{a.address}'s 'CartPole-v1'; max_episode_steps 200, not env server {a.address}'s 500)"
    ) in caplog.text


def test_servers_of_the_same_env_made_with_other_kwargs_are_warned_of(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture
) -> None:
    """CartPole with sutton_barto_reward on one server: the same spaces, another reward."""
    a = spawn_server("CartPole-v1", 1)
    b = spawn_server("CartPole-v1", 1, "--env-kwargs", '{"sutton_barto_reward": true}')
    with caplog.at_level(logging.WARNING, logger="learner.remote"), RemoteVectorEnv([a.address, b.address]) as envs:
        envs.reset(seed=0)
        assert envs.env_kwargs == {}
    assert (
        f'env server {b.address} serves another env than the rest (env kwargs {{"sutton_barto_reward": true}}, '
        f"not env server {a.address}'s {{}})"
    ) in caplog.text


def test_an_async_server_older_than_env_kwargs_said_no_time_limit_and_is_not_warned_of_for_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Such servers said max_episode_steps 0 under async vectorization, whatever the limit: a rolling
    upgrade's fleet, old and new servers side by side, is not a mixed one for that."""
    from learner.specs import warn_if_other_env

    caplog.set_level(logging.WARNING, logger="learner.remote")
    new = pb.EnvSpec(env_id="CartPole-v1", vectorization="async", max_episode_steps=500, env_kwargs="")
    old = pb.EnvSpec(env_id="CartPole-v1", vectorization="async", max_episode_steps=0)
    warn_if_other_env(new, old, "a:1", "env server b:2's")
    warn_if_other_env(old, new, "a:1", "its old")
    assert not caplog.records
    other = pb.EnvSpec(env_id="CartPole-v1", vectorization="sync", max_episode_steps=200)
    warn_if_other_env(new, other, "a:1", "x's")
    assert "max_episode_steps 200, not x's 500" in caplog.text


@pytest.mark.slow
def test_without_fault_tolerance_a_failed_step_must_be_followed_by_a_reset(spawn_server: SpawnServer) -> None:
    """Server B hangs past the deadline: the step raises. Server A's envs stepped meanwhile, unseen (an
    episode may have ended), so stepping on is refused until a reset."""
    a = spawn_server("tests.envs:FaultyEnv", K)
    b = spawn_server("tests.envs:FaultyEnv", K, "--env-kwargs", '{"hang_at": 2, "hang_s": 2}')
    with RemoteVectorEnv([a.address, b.address], timeout=1.0) as envs:  # (A's steps: 1 s even on a loaded host)
        envs.reset(seed=0)
        envs.step(np.zeros(2 * K, dtype=np.int64))
        with pytest.raises(RemoteTimeoutError):
            envs.step(np.zeros(2 * K, dtype=np.int64))
        with pytest.raises(
            SessionError,
            match=r"step: the last step or reset failed .*call reset\(\) first \(or refresh\(\), which also lets go",
        ):
            envs.step(np.zeros(2 * K, dtype=np.int64))
        time.sleep(2.0)  # B's hang ends
        obs, _ = envs.reset(seed=1)
        assert obs[:, 0].tolist() == [0.0] * (2 * K)
        obs, *_ = envs.step(np.zeros(2 * K, dtype=np.int64))
        assert obs[:, 0].tolist() == [1.0] * (2 * K)


@pytest.mark.slow
def test_an_env_that_hangs_past_the_deadline(spawn_server: SpawnServer) -> None:
    """Server B's env hangs 4 s in its 4th step: the learner's step returns at the deadline, B's envs are
    unavailable meanwhile, and rejoin once it answers again (same process: no restart)."""
    a = spawn_server("tests.envs:FaultyEnv", K)
    b = spawn_server("tests.envs:FaultyEnv", K, "--env-kwargs", '{"hang_at": 4, "hang_s": 4}')
    with RemoteVectorEnv([a.address, b.address], fault_tolerant=True, timeout=2.0, backoff=(0.05, 0.5)) as envs:
        envs.reset(seed=0)
        for _ in range(3):
            _, _, _, _, infos = envs.step(np.zeros(2 * K, dtype=np.int64))
            assert "env_unavailable" not in infos
        start = time.monotonic()
        _, _, _, truncs, infos = envs.step(np.zeros(2 * K, dtype=np.int64))
        assert time.monotonic() - start < 3.5, "the step returned at its deadline (not when the 4 s hang ended)"
        assert unavailable(infos, 2 * K).tolist() == [False] * K + [True] * K
        assert truncs.tolist() == [False] * K + [True] * K
        zeros = lambda t, n: np.zeros(n, dtype=np.int64)  # noqa: E731
        step_until(envs, 0, lambda r: not unavailable(r[4], 2 * K).any(), limit_s=15.0, act=zeros)
        stats = envs.fault_stats()
        assert (stats.failures, stats.reconnects, stats.server_restarts) == (1, 1, 0)
        assert check(b.address) == "SERVING"


@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
def test_an_env_that_raises_in_step_costs_its_own_episode_only(spawn_server: SpawnServer, mode: str) -> None:
    """Env 0 of a server raises in its 3rd step: its result is an error record, the others' results stand."""
    server = spawn_server(
        "tests.envs:FaultyEnv", 3, "--env-kwargs", '{"raise_at": 3, "length": 100}', "--autoreset-mode", mode
    )
    with RemoteVectorEnv([server.address], fault_tolerant=True) as envs:
        envs.reset(seed=0)
        for _ in range(2):
            envs.step(np.zeros(3, dtype=np.int64))
        obs, rewards, _, truncs, infos = envs.step(np.zeros(3, dtype=np.int64))
        assert infos["_env_error"].tolist() == [True, False, False]
        assert "step: ValueError: step 3 failed on purpose (env 0)" in infos["env_error"][0]
        assert infos["_env_unavailable"].tolist() == [True, False, False]
        assert truncs.tolist() == [True, False, False] and rewards.tolist() == [0.0, 1.0, 1.0]
        assert obs[1:, 0].tolist() == [3.0, 3.0]  # the others stepped
        if mode == "SameStep":
            assert obs[0].tolist() == [0.0, 2.0]  # reset at once: a new episode
            assert infos["final_obs"][0].tolist() == [2.0, 1.0]  # the last good observation
        else:
            obs, rewards, *_, infos = envs.step(np.zeros(3, dtype=np.int64))  # the reset step
            assert obs[0].tolist() == [0.0, 2.0] and "env_error" not in infos  # the error was said once
        obs, _, _, _, infos = envs.step(np.zeros(3, dtype=np.int64))
        assert "env_error" not in infos and obs[0, 0] == 1.0
        assert envs.fault_stats().env_errors == 1  # one exception, counted once under either mode
    assert check(server.address) == "SERVING"

    # Not fault-tolerant: the env's exception raises, as a local vector env's does; a reset goes on.
    server = spawn_server(
        "tests.envs:FaultyEnv", 3, "--env-kwargs", '{"raise_at": 3, "length": 100}', "--autoreset-mode", mode
    )
    with RemoteVectorEnv([server.address]) as envs:
        envs.reset(seed=0)
        for _ in range(2):
            envs.step(np.zeros(3, dtype=np.int64))
        with pytest.raises(EnvCrashedError) as crash:
            envs.step(np.zeros(3, dtype=np.int64))
        assert (crash.value.address, crash.value.env_index) == (server.address, 0)
        assert str(crash.value).startswith(
            f"env server {server.address}: env 0 raised in step: ValueError: step 3 failed on purpose (env 0)"
        )
        with pytest.raises(SessionError, match="call reset"):
            envs.step(np.zeros(3, dtype=np.int64))
        obs, _ = envs.reset(seed=0)
        assert obs[:, 0].tolist() == [0.0, 0.0, 0.0]
        envs.step(np.zeros(3, dtype=np.int64))


def test_internal_from_the_server_is_a_crash_and_internal_from_grpc_is_a_lost_server(
    spawn_server: SpawnServer,
) -> None:
    """The vector env as a whole fails: EnvCrashedError; gRPC's own INTERNAL (a connection that broke
    mid-stream, "Internal error from Core") carries no envfleet-origin mark: ServerUnavailableError."""
    server = spawn_server("tests.envs:FaultyEnv", 2, "--env-kwargs", '{"bad_reward_at": 2}')
    with RemoteVectorEnv([server.address]) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))
        with pytest.raises(EnvCrashedError, match=r"Step failed \[INTERNAL\]: the env raised in step: ValueError"):
            envs.step(np.zeros(2, dtype=np.int64))
    assert check(server.address) == "SERVING"

    broke = grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "Internal error from Core"
    )
    err = translate_error(broke, address="10.0.0.7:50051", method="Step")
    assert isinstance(err, ServerUnavailableError)
    assert (
        str(err) == "env server 10.0.0.7:50051: Step failed [INTERNAL]: the connection broke (Internal error from Core)"
    )


def test_an_env_whose_reset_raises_stays_out_of_order_and_the_others_go_on(spawn_server: SpawnServer) -> None:
    """Env 1's resets raise after its first: when its first episode ends it is out of order for good."""
    server = spawn_server(
        "tests.envs:FaultyEnv", 3, "--env-kwargs", '{"raise_in_reset": 1, "fault_env": 1, "length": 2}'
    )
    with RemoteVectorEnv([server.address], fault_tolerant=True) as envs:
        envs.reset(seed=0)
        for t in range(12):
            obs, rewards, _, _, infos = envs.step(np.zeros(3, dtype=np.int64))
            if t >= 2:  # the episode ended at step 2 (index 1); its reset failed at index 2
                assert infos["_env_unavailable"].tolist() == [False, True, False], (t, infos)
                assert "reset failed on purpose (env 1)" in infos["env_error"][1]
        assert rewards[[0, 2]].tolist() in ([1.0, 1.0], [0.0, 0.0])

    # An env whose very first reset raises: reset() reports it, the other envs start.
    server = spawn_server("tests.envs:FaultyEnv", 2, "--env-kwargs", '{"raise_in_reset": 0, "fault_env": 1}')
    with RemoteVectorEnv([server.address], fault_tolerant=True) as envs:
        obs, infos = envs.reset(seed=0)
        assert infos["_env_unavailable"].tolist() == [False, True]
        assert "reset: RuntimeError: reset failed on purpose (env 1)" in infos["env_error"][1]
        assert obs.tolist() == [[0.0, 1.0], [0.0, 0.0]]  # a placeholder of zeros
        envs.step(np.zeros(2, dtype=np.int64))
    assert check(server.address) == "SERVING"
    # Not fault-tolerant: the reset raises, naming the env.
    server = spawn_server("tests.envs:FaultyEnv", 2, "--env-kwargs", '{"raise_in_reset": 0, "fault_env": 1}')
    crash = (
        r"env 1 raised in reset: RuntimeError: reset failed on purpose \(env 1\) \(its reset failed, so it is out of "
        "order: its server tries its reset again at each step"
    )
    with RemoteVectorEnv([server.address]) as envs, pytest.raises(EnvCrashedError, match=crash):
        envs.reset(seed=0)


class _FixedObservation(gym.Env[Any, Any]):
    def __init__(self, space: gym.Space[Any], obs: Any) -> None:
        self.observation_space, self.action_space, self._obs = space, gym.spaces.Discrete(2), obs

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        return self._obs, {}


@pytest.mark.parametrize("transport", ["unix", "tcp"])
@pytest.mark.slow
def test_a_step_interrupted_while_waiting_is_refused_after_and_no_answer_goes_astray(
    start_servers: Any, transport: str
) -> None:
    """Ctrl-C in a notebook while step() waits: the next step must not take the interrupted step's
    answers (off by one from then on, or a wait for the full timeout); it is refused until a reset,
    after which the envs step as local ones do."""
    # Every step takes 1.5 s (the one interrupted, and the two after the reset, whose wait is the test's cost).
    addresses = start_servers("CartPole-v1", 2, 2, transport=transport, server_args=["--step-delay-ms", "1500"])

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt  # (what Ctrl-C raises; asyncio lets it through where it lands)

    previous = signal.signal(signal.SIGALRM, interrupt)
    local = gym.make_vec("CartPole-v1", num_envs=4, vectorization_mode="sync")
    try:
        with RemoteVectorEnv(addresses, timeout=30) as envs:
            envs.reset(seed=0)
            # (0.5 s: the step is sent by then, within milliseconds; the interrupt lands 1 s before the answer
            # can come, however loaded the machine)
            signal.setitimer(signal.ITIMER_REAL, 0.5)
            with pytest.raises(KeyboardInterrupt):
                envs.step(np.zeros(4, dtype=np.int64))
            with pytest.raises(SessionError, match=r"the step was interrupted \(KeyboardInterrupt\)"):
                envs.step(np.ones(4, dtype=np.int64))
            np.testing.assert_array_equal(envs.reset(seed=5)[0], local.reset(seed=5)[0])
            for t in range(2):
                actions = np.array([t % 2, 1, 0, 1])
                np.testing.assert_array_equal(envs.step(actions)[0], local.step(actions)[0])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        local.close()


@pytest.mark.parametrize("vectorization", ["sync", "async"])
@pytest.mark.parametrize("method", ["reset", "step"])
def test_an_observation_that_does_not_fit_the_space_is_named(
    spawn_server: SpawnServer, method: str, vectorization: str
) -> None:
    """Not numpy's "Output array is the wrong shape": the env, the method, the shapes and the space."""
    kwargs = json.dumps({"wrong_shape_in": method, "fault_env": -1})
    server = spawn_server("tests.envs:FaultyEnv", 2, "--env-kwargs", kwargs, "--vectorization", vectorization)
    named = (
        rf"ObservationLayoutError: env 'tests.envs:FaultyEnv', {method}\(\): observation has shape \(3,\), "
        r"expected \(2,\) \(observation_space Box\(0.0, inf, \(2,\), float32\)\)"
    )
    with RemoteVectorEnv([server.address]) as envs:
        with pytest.raises(EnvCrashedError, match=named):
            envs.reset(seed=0)
            envs.step(np.zeros(2, dtype=np.int64))
        if vectorization == "async":
            # gymnasium shut the worker down: every later call says so, not "'NoneType' has no attribute".
            with pytest.raises(EnvCrashedError, match=r"worker processes ended when the env returned in .*restart it"):
                envs.reset(seed=0)
            # and its health says so: probes (compose:, Kubernetes) leave it out
            deadline = time.monotonic() + 10
            while check(server.address) != "NOT_SERVING" and time.monotonic() < deadline:
                time.sleep(0.05)
            assert check(server.address) == "NOT_SERVING"
        else:
            assert check(server.address) == "SERVING"
    assert server.proc is not None and server.proc.poll() is None
    assert "ObservationLayoutError" in server.logs()


def test_layout_mismatch_names_the_part_that_does_not_fit() -> None:
    from env_server.envs import layout_mismatch

    space = gym.spaces.Dict(
        {
            "pos": gym.spaces.Box(-1, 1, (2,)),
            "parts": gym.spaces.Tuple([gym.spaces.Discrete(3), gym.spaces.Box(0, 1, (2, 2))]),
        }
    )
    fits = {"pos": np.zeros(2), "parts": (1, np.zeros((2, 2)))}
    assert layout_mismatch(fits, space) is None
    assert layout_mismatch({**fits, "pos": np.zeros(3)}, space) == (
        "observation['pos'] has shape (3,), expected (2,) (observation_space Box(-1.0, 1.0, (2,), float32))"
    )
    assert layout_mismatch({"pos": np.zeros(2)}, space) == (
        "observation has keys ['pos'], missing ['parts'] of ['parts', 'pos']"
    )
    assert layout_mismatch({**fits, "parts": (1,)}, space) == (
        "observation['parts'] is a tuple of length 1, expected a tuple of length 2"
    )
    # What gymnasium's vector envs stack anyway: extra keys (left out), a list for a Tuple.
    assert layout_mismatch({**fits, "debug": "x"}, space) is None
    assert layout_mismatch({**fits, "parts": [1, np.zeros((2, 2))]}, space) is None
    local = gym.vector.SyncVectorEnv([lambda: _FixedObservation(space, {**fits, "debug": "x"})] * 2)
    local.reset(seed=0)
    local.close()
    assert "observation['parts'][1] has shape (2,)" in str(layout_mismatch({**fits, "parts": (1, np.zeros(2))}, space))
    assert layout_mismatch(np.zeros(2), space) == "observation is a ndarray, expected a dict with keys ['parts', 'pos']"
    assert layout_mismatch(np.int64(2), gym.spaces.Discrete(3)) is None


@pytest.mark.slow
def test_sigterm_drains_finishing_the_step_in_flight(spawn_server: SpawnServer) -> None:
    """SIGTERM while a slow step is in flight: the step's result arrives, the server exits 0, then the
    learner sees the server gone (fault-tolerant: its envs become unavailable)."""
    server = spawn_server("CartPole-v1", K, "--step-delay-ms", "3000", "--grace", "8")
    with RemoteVectorEnv([server.address], fault_tolerant=True, timeout=10.0, backoff=(0.05, 0.5)) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(K, dtype=np.int64))  # opens the step stream
        envs.step_async(np.zeros(K, dtype=np.int64))
        time.sleep(1.0)  # (the step reaches the server before its drain: a loaded machine may take a while)
        start = time.monotonic()
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)
        _, rewards, _, _, infos = envs.step_wait()
        assert rewards.tolist() == [1.0] * K and "env_unavailable" not in infos  # finished, not cut off
        assert server.proc.wait(timeout=10) == 0
        assert time.monotonic() - start < 8.0, "exits once the call in flight is done, within the grace period"
        _, _, _, truncs, infos = envs.step(np.zeros(K, dtype=np.int64))
        assert infos["_env_unavailable"].all() and truncs.all()
        stats = envs.fault_stats()  # it said it was shutting down: planned, not a failure
        assert (stats.shutdowns, stats.failures, stats.servers_down) == (1, 0, 1)
        (replica,) = envs.replica_stats()  # per server too
        assert (replica.shutdowns, replica.failures, replica.available) == (1, 0, False)
    assert "shutting down" in server.logs()


@pytest.mark.slow
def test_health_is_not_serving_until_the_envs_exist() -> None:
    """A server whose envs take a while to build listens at once and answers NOT_SERVING meanwhile."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "env_server",
            "--env",
            "tests.envs:SlowToBuildEnv",
            "--port",
            "0",
            "--log-level",
            "debug",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        port = ""
        for line in proc.stderr:  # the server logs its port before it builds the envs
            if "building" in line and "listening on port" in line:
                port = line.rsplit(" ", 1)[-1].strip()
                break
        assert port, "no 'listening on port' log line"
        address = f"127.0.0.1:{port}"
        assert check(address) == "NOT_SERVING"
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.EnvServiceStub(channel).GetSpec(pb.GetSpecRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "being built" in info.value.details()
        # A learner that connects meanwhile waits (within its connect_timeout) for the envs.
        with RemoteVectorEnv([address], connect_timeout=30) as envs:
            envs.reset(seed=0)
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("listening on ")
        assert check(address) == "SERVING"
    finally:
        proc.terminate()
        assert proc.wait(timeout=15) == 0


def test_every_call_of_a_session_is_unavailable_while_the_envs_are_built() -> None:
    """As GetSpec and Handshake are: a server starting, not a session it does not know (was:
    FAILED_PRECONDITION "does not own this server" for Reset, Step, StepStream and Hold)."""
    request = pb.StepRequest(session_id="0" * 32)
    request.actions.tensor.dtype = pb.DTYPE_INT64
    request.actions.tensor.shape[:] = [1]
    request.actions.tensor.data = np.zeros(1, "<i8").tobytes()
    with slow_to_build_server(60.0, 1) as address, grpc.insecure_channel(address) as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        stub = pb_grpc.EnvServiceStub(channel)
        calls = {
            "Reset": lambda: stub.Reset(pb.ResetRequest(session_id=request.session_id), timeout=10),
            "Step": lambda: stub.Step(request, timeout=10),
            "StepStream": lambda: next(iter(stub.StepStream(iter([request]), timeout=10))),
            "Hold": lambda: next(iter(stub.Hold(pb.HoldRequest(session_id=request.session_id), timeout=10))),
        }
        for method, call in calls.items():
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, (method, info.value.details())
            assert "its envs are being built" in str(info.value.details()), (method, info.value.details())


def test_unavailable_envs_of_a_gymnasium_wrapper_view(spawn_server: SpawnServer) -> None:
    """The mask is gymnasium-style: a bool array under "env_unavailable" with its "_env_unavailable" twin."""
    server = spawn_server("tests.envs:IndexEnv", K)
    with RemoteVectorEnv([server.address], fault_tolerant=True, **FAST) as envs:
        assert isinstance(envs, gym.vector.VectorEnv)
        envs.reset(seed=0)
        server.kill()
        _, _, _, _, infos = envs.step(actions_for(0, K))
        assert infos["env_unavailable"].dtype == np.bool_ and infos["env_unavailable"].shape == (K,)
        assert np.array_equal(infos["env_unavailable"], infos["_env_unavailable"])


def test_pipelined_groups_go_on_when_a_server_of_one_is_lost(spawn_server: SpawnServer) -> None:
    servers = [spawn_server("tests.envs:IndexEnv", K) for _ in range(2)]
    with RemoteVectorEnv([s.address for s in servers], fault_tolerant=True, num_groups=2, **FAST) as envs:
        envs.reset(seed=0)
        slices = envs.group_slices
        servers[1].kill()
        for t in range(3):
            sent = actions_for(t, 2 * K)
            for g, sl in enumerate(slices):
                envs.send(sent[sl], g)
            got = {}
            for _ in slices:
                group, obs, _, _, truncs, infos = envs.recv()
                got[group] = (obs, truncs, infos)
            obs, _, infos = got[0]
            assert "env_unavailable" not in infos and np.array_equal(obs[:, 3], sent[slices[0]])
            _, truncs, infos = got[1]
            assert infos["_env_unavailable"].all() and truncs.all() == (t == 0)
        servers[1].start()
        step_until(envs, 3, lambda r: "env_unavailable" not in r[4], limit_s=10.0)


def test_keepalive_settings_agree() -> None:
    """Both sides ping idle connections (dead peers are noticed within ~15 s), and the server accepts the
    client's pings: a server that thinks them too frequent closes the connection (GOAWAY too_many_pings)."""
    from env_server.server import server_options
    from learner.client import channel_options

    server, client = dict(server_options()), dict(channel_options())
    for options in (server, client):
        assert options["grpc.keepalive_time_ms"] + options["grpc.keepalive_timeout_ms"] <= 15_000
        assert options["grpc.keepalive_permit_without_calls"] == 1
        assert options["grpc.http2.ping_timeout_ms"] <= options["grpc.keepalive_timeout_ms"]  # (else it wins)
    assert server["grpc.http2.min_recv_ping_interval_without_data_ms"] <= client["grpc.keepalive_time_ms"]
    assert server["grpc.http2.max_ping_strikes"] == 0  # and never closes a connection over pings


def test_a_keepalive_timeout_given_reaches_every_connection(
    spawn_server: SpawnServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """keepalive_timeout (learner train/eval --keepalive-timeout): the channels' ping-answer timeouts, for
    links on which one answer takes longer to cross than the default 5 s; refused unless seconds > 0."""
    import learner.client
    from learner.client import channel_options
    from learner.config import Args
    from learner.envs import fleet_spec, open_fleet

    options = dict(channel_options(42.5))
    assert options["grpc.keepalive_timeout_ms"] == options["grpc.http2.ping_timeout_ms"] == 42_500
    given: list[float] = []

    def recorded(keepalive_timeout: float) -> list[tuple[str, Any]]:
        given.append(keepalive_timeout)
        return channel_options(keepalive_timeout)

    monkeypatch.setattr(learner.client, "channel_options", recorded)
    server = spawn_server("CartPole-v1", 2)
    with RemoteVectorEnv([server.address], keepalive_timeout=42.5) as envs:
        envs.reset(seed=0)
    assert given and set(given) == {42.5}
    given.clear()
    with open_fleet(fleet_spec(Args(servers=server.address, keepalive_timeout=42.5))) as opened:  # (learner train's)
        opened.reset(seed=0)
    assert given and set(given) == {42.5}
    assert dict(channel_options(1e9))["grpc.keepalive_timeout_ms"] == 2**31 - 1  # (a C int: no OverflowError)
    for bad in (0, -1.0, float("inf"), "5"):
        with pytest.raises(InvalidArgumentError, match=r"keepalive_timeout: expected finite seconds > 0"):
            RemoteVectorEnv([server.address], keepalive_timeout=bad)  # type: ignore[arg-type]


def test_a_keepalive_ping_that_went_unanswered_says_what_it_may_mean() -> None:
    """gRPC's own words for it ("Stream removed (ping timeout)") name no cause: a server stopped or cut off,
    or a link too slow for an answer to cross within the keepalive timeout, which the error says how to raise."""
    from learner.client import status_error

    err = status_error(
        grpc.StatusCode.UNAVAILABLE, "Stream removed (ping timeout)", address="h:1", method="Step", from_server=False
    )
    assert isinstance(err, ServerUnavailableError)
    assert str(err).startswith("env server h:1: Step failed [UNAVAILABLE]: Stream removed (ping timeout): the server ")
    assert "stopped, or its host is cut off" in str(
        err
    ) and "raise `keepalive_timeout`, --keepalive-timeout, 5 s by default, or have the servers compress" in str(err)


HOLD_AND_SLEEP = """
import sys, time
from learner import RemoteVectorEnv
envs = RemoteVectorEnv([sys.argv[1]], timeout=5)
envs.reset(seed=0)
print("holding", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_learner_that_stops_answering_loses_its_claim_to_keepalive(spawn_server: SpawnServer) -> None:
    """A learner whose process stops (SIGSTOP; as a host that hangs: its kernel still acks TCP) is
    noticed by the server's keepalive within ~15 s, not gRPC core's 60 s ping-ack default."""
    server = spawn_server("CartPole-v1", 2)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_AND_SLEEP, server.address], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        holder.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        while True:
            try:
                RemoteVectorEnv([server.address], timeout=5).close()
                break
            except ServerBusyError:
                assert time.monotonic() - stopped < 40, "the stopped learner kept its claim"
                time.sleep(1)
    finally:
        holder.kill()  # (SIGKILL ends a stopped process too)
        holder.wait(timeout=30)
        holder.stdout.close()  # type: ignore[union-attr]


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_the_step_after_a_sigterm_is_told_the_server_is_shutting_down(tmp_path: Path, transport: str) -> None:
    """SIGTERM while a step is held in the env: that step's result arrives, and the learner's next step
    (sent at once, over StepStream or the step socket) gets UNAVAILABLE "shutting down", not a broken
    connection (the server leaves the stream open a moment for it, rather than ending it under the write)."""
    gate = tmp_path / "gate"
    argv = [sys.executable, "-m", "env_server", "--env", "tests.envs:GateEnv", "--num-envs", "1"]
    argv += ["--env-kwargs", json.dumps({"gate": str(gate), "at": 2}), "--grace", "10", "--log-level", "info"]
    argv += ["--step-delay-ms", "200"]  # slow enough that steps run on the env thread, not the event loop
    argv += ["--unix-socket", str(tmp_path / "env.sock")] if transport == "unix" else ["--port", "0"]
    log = tmp_path / "log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip().removeprefix("listening on ")
        with RemoteVectorEnv([address], timeout=30) as envs:
            envs.reset(seed=0)
            envs.step(np.zeros(1, dtype=np.int64))  # opens the step stream (or socket)
            assert bool(envs._clients[0].step_socket) == (transport == "unix")
            envs.step_async(np.zeros(1, dtype=np.int64))
            deadline = time.monotonic() + 30
            while not gate.exists():  # the step is in the env, held there
                assert time.monotonic() < deadline, "the step never reached the env"
                time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            while "shutting down" not in log.read_text():  # the drain began
                assert time.monotonic() < deadline, "the server did not start shutting down"
                time.sleep(0.01)
            gate.unlink()
            _, _, _, _, infos = envs.step_wait()
            assert "env_unavailable" not in infos  # the step in flight finished
            with pytest.raises(ServerUnavailableError, match="shutting down") as info:
                envs.step(np.zeros(1, dtype=np.int64))
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def _error_records(mode: str, steps: int, **faults: int) -> list[tuple[int, str]]:
    """(step, where) of each step whose top-level infos carry env_error, for one FaultyEnv built as a
    server builds it (IsolateErrors inside; no server), masked resets after truncations under Disabled."""
    from env_server.config import ServerConfig
    from env_server.envs import build_vector_env

    kwargs = {**faults, "fault_env": -1, "length": 100}
    config = ServerConfig(env="tests.envs:FaultyEnv", num_envs=1, env_kwargs=kwargs, autoreset_mode=mode)
    envs = build_vector_env(config)
    envs.reset(seed=0)
    reported = []
    for t in range(1, steps + 1):
        *_, truncs, infos = envs.step(np.zeros(1, dtype=np.int64))
        if "env_error" in infos:
            reported.append((t, infos["env_error"][0].split(":")[0]))
        if mode == "Disabled" and truncs[0]:
            _, infos = envs.reset(options={"reset_mask": np.array([True])})
            if "env_error" in infos:
                reported.append((t, "masked " + infos["env_error"][0].split(":")[0]))
    envs.close()
    return reported


def test_a_keyboard_interrupt_in_an_env_s_step_is_the_env_s_error_in_a_server_and_a_ctrl_c_in_process() -> None:
    """A server's signals raise nothing, so a KeyboardInterrupt in its env's step is the env's own
    (isolated: its episode ends). In the learner's process it is a Ctrl-C landing in a slow step (the
    second, which aborts: the first only asks the run to stop), and was taken for the env's error."""
    from env_server.config import ServerConfig
    from env_server.envs import build_vector_env
    from learner.envs import FleetSpec, open_fleet

    env, kwargs = "tests.ctrl_c_envs:InterruptedEnv", {"at": 2}
    served = build_vector_env(ServerConfig(env=env, num_envs=2, env_kwargs=kwargs))
    served.reset(seed=0)
    served.step(np.zeros(2, dtype=np.int64))
    *_, truncs, infos = served.step(np.zeros(2, dtype=np.int64))
    assert truncs.all() and infos["env_error"][0] == "step: KeyboardInterrupt"
    served.close()
    spec = FleetSpec(env=env, backend="gym", num_servers=1, envs_per_server=2, env_kwargs=kwargs)
    with open_fleet(spec) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))
        with pytest.raises(KeyboardInterrupt):
            envs.step(np.zeros(2, dtype=np.int64))


@pytest.mark.parametrize("mode", ["NextStep", "SameStep", "Disabled"])
def test_one_exception_is_one_error_record_under_every_autoreset_mode(mode: str) -> None:
    """The step that raised, and only it, carries env_error in the vector env's top-level infos (the
    reset after it worked: no second error); an env out of order is reported on each step."""
    assert _error_records(mode, 6, raise_at=3) == [(3, "step")]
    # Its resets keep raising: out of order. (Under same-step autoreset, step 2's top-level infos are
    # its failed reset's: "reset: ...".)
    reported = _error_records(mode, 5, raise_at=2, raise_in_reset=1)
    assert reported[0][0] == 2 and len(reported) >= 3 and all("reset" in kind for _, kind in reported[1:]), reported


@pytest.mark.slow
def test_a_server_back_with_another_num_envs_is_warned_of_once_and_refresh_takes_it_in(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Fault-tolerant: it cannot take its old place, and is retried every backoff; was a warning at every
    attempt for the rest of the run. refresh() (between rollouts in learner train) lets it go and takes it
    in again as it is now."""
    caplog.set_level(logging.DEBUG, logger="learner.faults")
    # (episodes longer than the ~100 steps 3 s may take: one ending just before the step checked below
    # would make that a reset step, whose observations echo no action)
    with _second_server_lost(spawn_server) as (envs, b):
        b.argv = ["--env", "tests.envs:IndexEnv", "--num-envs", str(K + 1), *ENDLESS]
        b.start(b.address.rpartition(":")[2])
        # several reconnect attempts (backoff at most 0.5 s): stepped until 3 are logged
        deadline = time.monotonic() + 30.0
        t = 1
        while True:
            _, _, _, _, infos = envs.step(actions_for(t, 2 * K))
            assert unavailable(infos, 2 * K).tolist() == [False] * K + [True] * K
            t += 1
            warned = [r.getMessage() for r in caplog.records if "came back with another num_envs" in r.getMessage()]
            if len(warned) >= 3:
                break
            assert time.monotonic() < deadline, f"not 3 reconnect attempts within 30 s: {warned}"
        assert len(warned) >= 3, warned  # tried again and again ...
        assert [r.levelname for r in caplog.records if "came back with another num_envs" in r.getMessage()].count(
            "WARNING"
        ) == 1  # ... said once
        assert "refresh(), which learner train calls between rollouts, takes it in" in warned[0]

        change = envs.refresh()
        assert change is not None and (change.added, change.removed) == ((b.address,), (b.address,))
        assert (change.num_envs, envs.num_envs) == (2 * K + 1, 2 * K + 1)
        assert change.previous_index.tolist() == [*range(K), -1, -1, -1]
        sent = actions_for(t, 2 * K + 1)
        obs, _, _, _, infos = envs.step(sent)
        assert "env_unavailable" not in infos
        assert np.array_equal(obs[:, 3], sent) and obs[:, 1].tolist() == [*range(K), *range(K + 1)]
        assert envs.fault_stats().servers_down == 0
        assert [r.num_envs for r in envs.replica_stats()] == [K, K + 1]  # (its own stats, not the old server's)


@pytest.mark.slow
def test_a_server_back_serving_another_time_limit_is_warned_of_as_it_rejoins(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Fault-tolerant: a server killed and started again otherwise (another time limit here; another
    checkout's library versions alike) rejoined its place without a word, where one back in a reset, or
    one joining, is warned of."""
    caplog.set_level(logging.WARNING)
    with _second_server_lost(spawn_server) as (envs, b):
        b.argv = [*b.argv, "--max-episode-steps", "77"]
        b.start()
        step_until(envs, 1, lambda r: "env_unavailable" not in r[4], limit_s=30.0)
    warned = [r.getMessage() for r in caplog.records if "serves another env than the rest" in r.getMessage()]
    assert len(warned) == 1 and "max_episode_steps 77, not its old" in warned[0], warned


def test_the_lines_saying_a_server_flaps_come_further_apart_as_it_goes_on_flapping() -> None:
    """A server whose every return fails at once (a broken env) was said to be lost again every 10 s for as long
    as it flapped, 360 lines an hour: the gap is now a third of the time it has flapped, once longer, up to 10
    minutes (as for a server that stays down). Its relapses in a row start the count; settling ends it."""
    replica = faults.Replica(client=None, spec=pb.EnvSpec())  # type: ignore[arg-type]  # (its times only)
    replica.note_loss(100.0)  # (a first loss: not flapping)
    assert replica.relapses == 0 and replica.flapping_since == 0.0
    replica.back_at = 101.0
    for at in (102.0, 103.0, 110.0):  # (lost again each time before it settled)
        replica.note_loss(at)
        replica.back_at = at + 0.5
    assert replica.relapses == 3 and replica.flapping_since == 102.0
    replica.note_loss(103.0, planned=True)  # (a shutdown between: the count goes on)
    assert replica.flapping_since == 102.0
    gaps = [faults.reminder_gap(flapping, faults.RELAPSE_LOG_S) for flapping in (0, 30, 60, 300, 1800, 86400)]
    assert gaps == [10.0, 10.0, 20.0, 100.0, 600.0, 600.0]
    lines, said_at = 0, -math.inf
    for now in range(3600):  # (a relapse every second for an hour: the lines the rule lets through)
        if now - said_at >= faults.reminder_gap(now, faults.RELAPSE_LOG_S):
            lines, said_at = lines + 1, now
    assert lines <= 20, lines
    # (settled, back long enough and at its SETTLE_STEPS-th answer: the relapses end)
    replica.back_at, replica.answered = time.monotonic() - faults.SETTLE_S - 1, faults.SETTLE_STEPS - 1
    assert replica.note_answer() == 3 and replica.flapping_since == 0.0


@pytest.mark.slow
def test_a_server_that_fails_every_step_is_taken_back_later_each_time_and_logged_once_in_a_while(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that answers handshakes and resets at once but fails each step is lost, back at once,
    lost again: each loss soon after coming back waits longer before it is taken back (the reconnect
    backoff's schedule) and such losses are logged at most once in a while, so it costs a few
    reconnects and lines, not one per step. Mended, it is taken back and settles."""
    monkeypatch.setattr(faults, "SETTLE_S", 0.5)  # (10 s: too long to wait for here)
    caplog.set_level(logging.INFO, logger="learner")
    broken = spawn_server("tests.envs:BrokenStepEnv", K)
    healthy = spawn_server("tests.envs:FaultyEnv", K)
    backoff = (0.1, 1.0)
    with RemoteVectorEnv([broken.address, healthy.address], fault_tolerant=True, timeout=5.0, backoff=backoff) as envs:
        envs.reset(seed=0)
        start = time.monotonic()
        steps = 0
        while time.monotonic() - start < 4.0:
            _, _, _, _, infos = envs.step(np.zeros(2 * K, dtype=np.int64))
            assert not unavailable(infos, 2 * K)[K:].any()  # the other server steps on
            steps += 1
        # Losses at about 0, 0 (back at once), 0.1, 0.3, 0.7, 1.5, 2.5, 3.5 s: not one every other step.
        failures = envs.fault_stats().failures
        assert steps > 20 and 2 <= failures <= 15, (steps, failures)  # (loose: a loaded machine steps slower)
        said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        losses = [m for m in said if m.startswith(f"env server {broken.address} lost")]
        assert len(losses) == 2 and "lost again soon after coming back" in losses[1], losses  # (then one per 10 s)
        assert "(1 since the last such line; the next such line in 10 s at the soonest)" in losses[1], losses
        # (back as the same process: INFO, no warning)
        back = [
            r.getMessage() for r in caplog.records if r.getMessage().startswith(f"env server {broken.address} is back")
        ]
        assert len(back) == 1, back

        # Mended (the same address, an env that steps): taken back within the longest wait, and settled.
        broken.argv[1] = "tests.envs:FaultyEnv"
        broken.kill()
        broken.start()
        mended = time.monotonic()
        step_until(envs, 0, lambda r: "env_unavailable" not in r[4], limit_s=10.0, act=lambda t, n: np.zeros(n, int))
        assert time.monotonic() - mended < backoff[1] * 1.2 + 5.0
        step_until(envs, 0, lambda r: "steady again" in caplog.text, limit_s=5.0, act=lambda t, n: np.zeros(n, int))
        replica = envs._replicas[0]
        assert (replica.relapses, replica.failing_since) == (0, 0.0)


def test_a_server_that_left_saying_so_soon_after_coming_back_is_not_flapping() -> None:
    """A rolling restart may stop a server again within SETTLE_S of its start: a planned departure is
    no relapse (no growing wait before it is taken back); a failure then is."""
    replica = faults.Replica(client=None, spec=pb.EnvSpec())  # type: ignore[arg-type]  # (its counters only)
    replica.back_at, replica.answered = time.monotonic(), 1  # back a moment ago, not settled
    replica.note_loss(time.monotonic(), planned=True)
    assert (replica.relapses, replica.hold_off((0.1, 2.0))) == (0, 0.0)
    replica.note_loss(time.monotonic())
    assert (replica.relapses, replica.hold_off((0.1, 2.0))) == (1, 0.1)
    # A planned departure of a flapping server leaves its count: a stop loop does not clear its backoff.
    replica.note_loss(time.monotonic(), planned=True)
    assert replica.relapses == 1


@pytest.mark.slow
def test_a_fleet_of_servers_that_fail_every_step_gives_up_after_give_up_after(spawn_server: SpawnServer) -> None:
    """A server that keeps coming back but fails each step gives no more steps than one that is gone:
    it counts as down from its first loss, and a fleet of such servers gives up."""
    broken = spawn_server("tests.envs:BrokenStepEnv", K)
    with RemoteVectorEnv(
        [broken.address], fault_tolerant=True, timeout=5.0, backoff=(0.1, 1.0), give_up_after=1.5
    ) as envs:
        envs.reset(seed=0)
        start = time.monotonic()
        with pytest.raises(
            ServerUnavailableError, match=r"failing each step since they came back\) for more than 1.5 s"
        ):
            while time.monotonic() - start < 15.0:
                envs.step(np.zeros(K, dtype=np.int64))
        assert time.monotonic() - start < 12.0  # (gives up, not the 15 s loop; loose: a loaded machine is slow)


def test_the_lines_saying_a_server_is_still_down_come_further_apart_as_it_stays_down() -> None:
    """64 servers left down printed 64 lines every 20 s, ~11,500 an hour: after a minute down, the gap is a third
    of the time down, up to 10 minutes (about 15 lines an hour for each)."""
    replica = faults.Replica(client=None, spec=pb.EnvSpec())  # type: ignore[arg-type]  # (its times only)
    replica.down_since = 1000.0
    gaps = [faults._still_down_gap(replica, 1000.0 + down) for down in (0, 30, 60, 90, 300, 1800, 3600, 86400)]
    assert gaps == [20.0, 20.0, 20.0, 30.0, 100.0, 600.0, 600.0, 600.0]
    # Each line says when the next may come: the first moment the gap is reached (was the gap at its own time).
    for down in (0, 30, 45, 63, 90, 300, 1199, 1200, 1800, 86400):
        said = faults._next_still_down_in(replica, 1000.0 + down)
        assert faults._still_down_gap(replica, 1000.0 + down + said) <= said
        assert faults._still_down_gap(replica, 1000.0 + down + said - 1) > said - 1, (down, said)


@pytest.mark.slow
def test_a_server_that_stays_down_is_said_to_be_so_once_in_a_while_with_its_last_error(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server whose resets outlast the deadline answers each reconnect's handshake, then misses its
    reset: lost once, and down for good. Between its loss and a give-up, lines say now and then that
    it is still down, how many attempts failed, and the last one's error with its hint (rather than
    nothing while the server sees a new session come and go at every attempt)."""
    monkeypatch.setattr(faults, "STILL_DOWN_LOG_S", 1.0)  # (20 s: too long to wait for here)
    caplog.set_level(logging.INFO, logger="learner")
    slow = spawn_server("tests.envs:SlowResetEnv", K, "--env-kwargs", '{"slow_from": 2, "sleep_s": 1.0}')
    healthy = spawn_server("tests.envs:ClockEnv", K)
    with RemoteVectorEnv(
        # (reset_timeout, not timeout, short: the healthy server's steps keep a deadline that a loaded host's
        # bursts do not reach; CI-like load once made one miss 0.5 s)
        [slow.address, healthy.address],
        fault_tolerant=True,
        timeout=2.0,
        reset_timeout=0.5,
        backoff=(0.05, 0.2),
    ) as envs:
        envs.reset(seed=0)
        envs.reset(seed=0)  # the slow server's second reset: lost
        start = time.monotonic()
        while time.monotonic() - start < 4.5:
            _, _, _, _, infos = envs.step(np.zeros(2 * K, dtype=np.int64))
            assert unavailable(infos, 2 * K).tolist() == [True] * K + [False] * K
            time.sleep(0.01)
    said = [r for r in caplog.records if r.getMessage().startswith(f"env server {slow.address}")]
    assert said[0].getMessage().startswith(f"env server {slow.address} lost (env server {slow.address}: Reset")
    still = [r for r in said[1:] if " still down after " in r.getMessage()]
    assert len(said) == len(still) + 1 and 2 <= len(still) <= 4, [r.getMessage() for r in said]
    assert all(r.levelno == logging.WARNING for r in still)
    for record in still:
        text = record.getMessage()
        assert re.search(r" \d+ reconnect attempts? failed \(", text), text
        assert re.search(r"since the last such line; the next such line in \d+ s at the soonest\), the last", text)
        assert "the last: env server" in text and "failed [DEADLINE_EXCEEDED]" in text, text
        # (the last attempt's deadline: its Reset's, or its GetSpec's while the server's loop is held up by
        # a reset it took for a quick one)
        assert re.search(
            r"raise `(reset_)?timeout` if the env is slow( to reset)?; its 2 envs stay unavailable, and "
            r"it is tried again$",
            text,
        ), text


@pytest.mark.slow
def test_a_server_that_shut_down_and_stays_down_turns_into_a_warning_after_a_while(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server stopped with SIGTERM says it is shutting down: its loss is one WARNING, and the lines saying it
    is still down are INFO, a restart being a matter of seconds. One still down after SHUT_DOWN_WARN_S was
    stopped for good (or cannot start): those lines turn WARNING, saying so (was: INFO for the rest of the run,
    which learner train's default log level hides, while the fleet went on without its envs)."""
    monkeypatch.setattr(faults, "STILL_DOWN_LOG_S", 0.5)  # (20 s and a minute: too long to wait for here)
    monkeypatch.setattr(faults, "SHUT_DOWN_WARN_S", 2.5)
    caplog.set_level(logging.INFO, logger="learner")
    stopped = spawn_server("tests.envs:ClockEnv", K)
    healthy = spawn_server("tests.envs:ClockEnv", K)
    with RemoteVectorEnv(
        [stopped.address, healthy.address], fault_tolerant=True, connect_timeout=0.5, backoff=(0.05, 0.2)
    ) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(2 * K, dtype=np.int64))
        assert stopped.kill(signal.SIGTERM) == 0
        start = time.monotonic()
        while time.monotonic() - start < 6.0:
            _, _, _, _, infos = envs.step(np.zeros(2 * K, dtype=np.int64))
            time.sleep(0.01)
        assert unavailable(infos, 2 * K).tolist() == [True] * K + [False] * K
        assert envs.fault_stats().shutdowns == 1
    said = [r for r in caplog.records if r.getMessage().startswith(f"env server {stopped.address}")]
    assert said[0].getMessage().startswith(f"env server {stopped.address} shut down (it said so")
    assert said[0].levelno == logging.WARNING
    still = [r for r in said if " still down after " in r.getMessage()]
    levels = [r.levelno for r in still]
    assert logging.INFO in levels and logging.WARNING in levels, [r.getMessage() for r in still]
    first_warning = levels.index(logging.WARNING)
    assert set(levels[first_warning:]) == {logging.WARNING}, "INFO while it may be restarting, WARNING after"
    for record in still:
        told = "it said it was shutting down as it left, and a restart takes seconds: stopped for good, or" in (
            record.getMessage()
        )
        assert told == (record.levelno == logging.WARNING), record.getMessage()
        down = float(re.search(r" still down after (\d+) s", record.getMessage()).group(1))  # type: ignore[union-attr]
        assert (down >= 2) if told else (down <= 3), record.getMessage()


@pytest.mark.slow
def test_a_server_restarting_that_takes_long_to_build_its_envs_is_not_warned_of_as_stopped_for_good(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server restarted (SIGTERM, started again at its address: an update) whose envs take longer than
    SHUT_DOWN_WARN_S to build answers UNAVAILABLE "the server is starting" meanwhile: it is up, and coming.
    The lines saying it is still down turned WARNING all the same, "stopped for good, or failing to start
    again?": now INFO while its last answer says it is starting."""
    monkeypatch.setattr(faults, "STILL_DOWN_LOG_S", 0.5)  # (20 s and a minute: too long to wait for here)
    monkeypatch.setattr(faults, "SHUT_DOWN_WARN_S", 2.0)
    caplog.set_level(logging.INFO, logger="learner")
    slow = spawn_server("tests.envs:SlowToBuildEnv", K, "--env-kwargs", '{"build_s": 2.0}')
    healthy = spawn_server("tests.envs:ClockEnv", K)
    with RemoteVectorEnv(
        [slow.address, healthy.address], fault_tolerant=True, connect_timeout=10.0, backoff=(0.05, 0.2)
    ) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(2 * K, dtype=np.int64))
        assert slow.kill(signal.SIGTERM) == 0
        # (its start returns once it is ready: its envs, ~4 s to build, while it listens already)
        restart = threading.Thread(target=slow.start)
        restart.start()
        try:
            start = time.monotonic()
            back = False
            while time.monotonic() - start < 15.0 and not back:
                _, _, _, _, infos = envs.step(np.zeros(2 * K, dtype=np.int64))
                back = not unavailable(infos, 2 * K)[:K].any()
                time.sleep(0.01)
        finally:
            restart.join()
        assert back, caplog.text
    still = [r for r in caplog.records if r.getMessage().startswith(f"env server {slow.address} still down after ")]
    starting = [r for r in still if "the server is starting" in r.getMessage()]
    assert starting, [r.getMessage() for r in still]
    assert {r.levelno for r in starting} == {logging.INFO}, [r.getMessage() for r in starting]


@pytest.mark.slow
@pytest.mark.parametrize("scaled_down", [True, False])
def test_a_server_shut_down_in_a_long_rollout_is_warned_of_only_once_a_look_up_still_lists_it(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, scaled_down: bool
) -> None:
    """A replica scaled down (docker compose up --scale, docker service scale) says it is shutting down; the
    look-up between rollouts drops it. A rollout longer than SHUT_DOWN_WARN_S (a minute: 2048 steps of a slow
    env, or over a slow link) kept it in the fleet that long, and the lines saying it was still down turned
    WARNING, "stopped for good, or failing to start again? ... start it at its address again", in a healthy
    scale-down. Now they turn WARNING once a look-up SHUT_DOWN_WARN_S after it left still lists it (a fleet
    that is never looked up again, as before: after SHUT_DOWN_WARN_S)."""
    monkeypatch.setattr(faults, "STILL_DOWN_LOG_S", 0.5)  # (20 s and a minute: too long to wait for here)
    monkeypatch.setattr(faults, "SHUT_DOWN_WARN_S", 1.5)
    caplog.set_level(logging.INFO, logger="learner")
    stopped = spawn_server("tests.envs:ClockEnv", K)
    healthy = spawn_server("tests.envs:ClockEnv", K)
    address, servers = fleet(stopped.address, healthy.address)
    told = "it said it was shutting down as it left, and a restart takes seconds: stopped for good, or"

    def warned() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.WARNING and told in r.getMessage() and stopped.address in r.getMessage()
        ]

    with RemoteVectorEnv(address, fault_tolerant=True, connect_timeout=0.5, backoff=(0.05, 0.2)) as envs:
        envs.reset(seed=0)
        assert envs.refresh(wait=0.2) is None  # (learner train's, before its first rollout)
        envs.step(np.zeros(2 * K, dtype=np.int64))
        assert stopped.kill(signal.SIGTERM) == 0
        start = time.monotonic()
        while time.monotonic() - start < 4.0:  # (one long rollout: no refresh)
            envs.step(np.zeros(2 * K, dtype=np.int64))
            time.sleep(0.01)
        if scaled_down:
            servers.remove(stopped.address)
        change = envs.refresh(wait=0.2)
        assert (change is not None and change.removed == (stopped.address,)) if scaled_down else change is None
        start = time.monotonic()
        while not scaled_down and time.monotonic() - start < 2.0:  # (the next rollout)
            envs.step(np.zeros(2 * K, dtype=np.int64))
            time.sleep(0.01)
    still = [r for r in caplog.records if r.getMessage().startswith(f"env server {stopped.address} still down after ")]
    assert still, caplog.text
    if scaled_down:
        assert not warned(), warned()
        assert {r.levelno for r in still} == {logging.INFO}, [r.getMessage() for r in still]
    else:
        assert warned(), [r.getMessage() for r in still]


@pytest.mark.slow
def test_a_server_that_joined_at_a_look_up_and_shut_down_in_the_next_long_rollout_is_not_warned_of(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica scaled up, then down (an autoscaler's swing; docker compose up --scale env=3, then 2): it joins
    at a look-up, which listed it, then leaves saying it is shutting down in the next rollout, longer than
    SHUT_DOWN_WARN_S, and the next look-up drops it. Was: the look-up that found it did not count as one that
    listed it (Replica.looked_up_at was set for the servers that stayed only), so its lines turned WARNING,
    "stopped for good, or failing to start again? ... start it at its address again", as those of a server of a
    fleet never looked up again."""
    monkeypatch.setattr(faults, "STILL_DOWN_LOG_S", 0.5)  # (20 s and a minute: too long to wait for here)
    monkeypatch.setattr(faults, "SHUT_DOWN_WARN_S", 1.5)
    caplog.set_level(logging.INFO, logger="learner")
    healthy = spawn_server("tests.envs:ClockEnv", K)
    joiner = spawn_server("tests.envs:ClockEnv", K)
    address, servers = fleet(healthy.address)
    told = "it said it was shutting down as it left, and a restart takes seconds: stopped for good, or"
    with RemoteVectorEnv(address, fault_tolerant=True, connect_timeout=0.5, backoff=(0.05, 0.2)) as envs:
        envs.reset(seed=0)
        assert envs.refresh(wait=0.2) is None
        servers.append(joiner.address)
        change = envs.refresh(wait=5.0)  # (learner train's, before the rollout: the new replica joins)
        assert change is not None and change.added == (joiner.address,), change
        envs.step(np.zeros(2 * K, dtype=np.int64))
        assert joiner.kill(signal.SIGTERM) == 0
        start = time.monotonic()
        while time.monotonic() - start < 4.0:  # (one long rollout: no refresh)
            envs.step(np.zeros(2 * K, dtype=np.int64))
            time.sleep(0.01)
        servers.remove(joiner.address)
        change = envs.refresh(wait=0.2)
        assert change is not None and change.removed == (joiner.address,), change
    still = [r for r in caplog.records if r.getMessage().startswith(f"env server {joiner.address} still down after ")]
    assert still, caplog.text
    assert {r.levelno for r in still} == {logging.INFO}, [r.getMessage() for r in still]
    assert not [r for r in caplog.records if told in r.getMessage()], caplog.text


@pytest.mark.slow
@pytest.mark.needs_sb3
def test_a_fault_tolerant_start_goes_on_without_a_server_that_does_not_answer_and_it_joins_later(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One host of three down as the run starts costs its envs, as it would in the run, not the run: the
    others start, and it joins at a refresh once it answers (said once in a while until then). Not
    fault-tolerant, it is an error as before; SB3's adapter, whose number of envs is fixed, refuses it."""
    from learner.sb3 import RemoteVecEnv

    monkeypatch.setattr(faults, "STILL_DOWN_LOG_S", 0.0)
    caplog.set_level(logging.INFO, logger="learner")
    a = spawn_server("tests.envs:IndexEnv", K)
    b = spawn_server("tests.envs:IndexEnv", K)
    b.kill()
    # (2 s: the healthy server connects within it on a loaded machine too)
    with pytest.raises(ServerUnavailableError, match=rf"env server {b.address}: nothing answered within 2 s"):
        RemoteVectorEnv([a.address, b.address], connect_timeout=2.0)
    with pytest.raises(ServerUnavailableError, match=rf"RemoteVecEnv: env server {b.address} did not answer"):
        RemoteVecEnv([a.address, b.address], fault_tolerant=True, connect_timeout=2.0)
    with RemoteVectorEnv([a.address, b.address], fault_tolerant=True, connect_timeout=2.0, num_groups=2) as envs:
        assert (envs.num_envs, envs.addresses, envs.num_groups) == (K, [a.address], 1)
        assert envs.servers_not_joined == [b.address] and envs.fault_stats().servers_not_joined == 1
        assert (
            f"env server {b.address}: nothing answered within 2 s (connection refused); starting with the 1 of 2 "
            "that answered (fault-tolerant): its envs join when it answers"
        ) in caplog.text
        envs.reset(seed=0)
        envs.step(actions_for(0, K))
        assert envs.refresh() is None  # (still down)
        assert f"env server {b.address} has not joined since the start went on without it" in caplog.text
        b.start()
        deadline = time.monotonic() + 20.0  # (gRPC's reconnect backoff)
        while (change := envs.refresh()) is None:
            assert time.monotonic() < deadline, "the server did not join"
            time.sleep(0.2)
        assert change.added == (b.address,) and envs.num_envs == 2 * K and envs.num_groups == 2
        assert envs.servers_not_joined == [] and f"env server {b.address} joined, " in caplog.text
        assert envs.fault_stats().servers_not_joined == 0
        envs.reset(seed=1)
        obs, *_ = envs.step(actions_for(1, 2 * K))
        assert obs[:, 1].tolist() == [*range(K), *range(K)]


@pytest.mark.slow
@pytest.mark.needs_sb3
def test_a_fault_tolerant_start_goes_on_without_a_server_another_learner_holds(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A server still claimed by another learner (one cut off by a partition holds its claim until the
    server notices, ~15 s) costs its envs, not the start: it joins once the claim ends; listed under two
    names, it is used once. Not fault-tolerant, or every server claimed, or claimed by this very process (only
    closing that RemoteVectorEnv frees it): the ServerBusyError it was."""
    from learner.sb3 import RemoteVecEnv

    a = spawn_server("tests.envs:IndexEnv", K)
    b = spawn_server("tests.envs:IndexEnv", K)
    alias = f"localhost:{b.address.rpartition(':')[2]}"
    with RemoteVectorEnv([b.address]) as here:  # (this process's: a notebook cell run twice)
        here.reset(seed=0)
        with pytest.raises(ServerBusyError, match="that learner is this process"):
            RemoteVectorEnv([a.address, b.address], fault_tolerant=True)
    holder = subprocess.Popen([sys.executable, "-c", HOLD_AND_SLEEP, b.address], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        busy = rf"env server {b.address}: Handshake failed \[RESOURCE_EXHAUSTED\]"
        with pytest.raises(ServerBusyError, match=busy):
            RemoteVectorEnv([a.address, b.address])
        with pytest.raises(ServerBusyError, match=busy):
            RemoteVectorEnv([b.address], fault_tolerant=True)
        with pytest.raises(ServerBusyError, match=busy):  # (SB3's number of envs is fixed: no later join)
            RemoteVecEnv([a.address, b.address], fault_tolerant=True)
        with RemoteVectorEnv([a.address, b.address, alias], fault_tolerant=True) as envs:
            assert (envs.num_envs, envs.servers_not_joined) == (K, [b.address, alias])
            assert f"env server {b.address}: Handshake failed [RESOURCE_EXHAUSTED]: " in caplog.text
            assert "starting with the 1 of 3 that answered (fault-tolerant)" in caplog.text
            envs.reset(seed=0)
            assert envs.refresh() is None  # (still held)
            holder.kill()
            deadline = time.monotonic() + 20.0
            while (change := envs.refresh()) is None:
                assert time.monotonic() < deadline, "the server did not join once released"
                time.sleep(0.2)
            assert len(change.added) == 1 and envs.num_envs == 2 * K
            # Its other name, refused by the fleet's own claim, is known for the same server: used once.
            deadline = time.monotonic() + 20.0
            while envs.servers_not_joined:
                assert time.monotonic() < deadline, f"{envs.servers_not_joined} still waited for"
                assert envs.refresh() is None
                time.sleep(0.2)
            assert "are the same env server" in caplog.text and envs.num_envs == 2 * K
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.slow
def test_a_fault_tolerant_start_goes_on_without_a_server_still_building_its_envs(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that listens but is still building its envs at connect_timeout (a big simulator) joins
    later too, as one that did not answer: a slow host costs no more than a down one."""
    a = spawn_server("tests.envs:ClockEnv", K)  # (the same spaces as SlowToBuildEnv)
    # (it listens within ~1 s, then builds its envs for 4 s: answering UNAVAILABLE, "starting")
    with (
        slow_to_build_server(4.0, K) as slow,
        RemoteVectorEnv([a.address, slow], fault_tolerant=True, connect_timeout=2.0) as envs,
    ):
        assert (envs.num_envs, envs.servers_not_joined) == (K, [slow])
        assert f"env server {slow}: " in caplog.text and "starting with the 1 of 2 that answered" in caplog.text
        deadline = time.monotonic() + 30.0
        while (change := envs.refresh()) is None:
            assert time.monotonic() < deadline, "the server did not join"
            time.sleep(0.2)
        assert change.added == (slow,) and envs.num_envs == 2 * K


def hung_server(spawn_server: SpawnServer) -> ServerProcess:
    """A server whose event loop hangs (an env step that never returns, run on the loop as quick steps
    are): it takes connections, and answers no call."""
    server = spawn_server("tests.hang_envs:HangLater", 1)
    with RemoteVectorEnv([server.address], timeout=1.0) as first:
        first.reset(seed=0)
        with pytest.raises(RemoteTimeoutError):
            for _ in range(5):
                first.step(first.action_space.sample())
    return server


@pytest.mark.slow
def test_a_fault_tolerant_start_goes_on_without_a_server_that_does_not_answer_its_handshake(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A server that connects but whose handshake gets no answer in time (its event loop hangs) costs its
    envs, not the start, as one that does not connect at all: it joins later, if it ever answers."""
    a = spawn_server("CartPole-v1", K)
    hung = hung_server(spawn_server)
    with RemoteVectorEnv([a.address, hung.address], fault_tolerant=True, connect_timeout=5.0, timeout=1.0) as envs:
        assert (envs.num_envs, envs.servers_not_joined) == (K, [hung.address])
        assert f"env server {hung.address}: Handshake failed [DEADLINE_EXCEEDED]" in caplog.text
        assert "starting with the 1 of 2 that answered" in caplog.text


def test_a_fault_tolerant_start_says_once_which_servers_it_goes_on_without_and_with_how_many(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Servers missing for different reasons (one does not connect, another learner holds one) are said
    in one warning, with the number of servers the fleet starts with out of all those listed."""
    a = spawn_server("CartPole-v1", K)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))  # (kept bound, not listening: no other test's server gets the port meanwhile)
        nothing = f"127.0.0.1:{free.getsockname()[1]}"
        with (
            FaultyServer(Faults(claimed=True)) as held,
            RemoteVectorEnv([a.address, nothing, held.address], fault_tolerant=True, connect_timeout=2.0) as envs,
        ):
            assert envs.servers_not_joined == [nothing, held.address]
    said = [r.getMessage() for r in caplog.records if "starting with the" in r.getMessage()]
    assert len(said) == 1 and "starting with the 1 of 3 that answered" in said[0], said
    assert f"{nothing}: nothing answered within 2 s" in said[0] and f"{held.address}: Handshake failed" in said[0]
