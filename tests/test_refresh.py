"""RemoteVectorEnv.refresh: servers that join or leave between rollouts, on real servers.

The fleet's addresses come from a resolver the tests control (``testfleet:NAME``), as compose or DNS
would give them: each refresh looks them up again.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import grpc
import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError

from env_server.health import check
from learner import RemoteVectorEnv, ServerUnavailableError
from learner.fleet import FleetChange, carry_over, describe_change
from tests.conftest import Serve, SpawnServer, fleet


def test_nothing_changed_returns_none(serve: Serve) -> None:
    address, _ = fleet(serve()[1], serve()[1])
    with RemoteVectorEnv(address) as envs:
        envs.reset(seed=0)
        assert envs.refresh() is None
        assert envs.num_envs == 4


def test_an_added_server_grows_the_fleet_and_its_envs_start_with_a_reset(serve: Serve) -> None:
    a, b, c = serve(num_envs=2)[1], serve(num_envs=2)[1], serve(num_envs=3)[1]
    address, servers = fleet(a, b)
    with RemoteVectorEnv(address) as envs:
        envs.reset(seed=0)
        for t in range(3):
            last_obs, *_ = envs.step(np.full(4, t % 2))
        servers.append(c)
        change = envs.refresh()
        assert isinstance(change, FleetChange)
        assert (change.added, change.removed) == ((c,), ())
        assert (change.previous_num_envs, change.num_envs, envs.num_envs) == (4, 7, 7)
        assert change.previous_index.tolist() == [0, 1, 2, 3, -1, -1, -1]
        assert change.new_envs.tolist() == [False] * 4 + [True] * 3
        assert envs.addresses == [a, b, c]
        assert envs.observation_space.shape == (7, 4) and envs.action_space.shape == (7,)
        np.testing.assert_array_equal(change.observations[:4], last_obs)
        assert np.all(np.abs(change.observations[4:]) <= 0.05)  # CartPole's reset state
        obs, rewards, *_ = envs.step(np.zeros(7, dtype=np.int64))
        assert obs.shape == (7, 4) and rewards.shape == (7,)


def test_envs_that_stay_continue_their_episodes_exactly(serve: Serve) -> None:
    """Survivors are untouched: they match gymnasium's own envs stepped with the same seeds and actions."""
    a, b = serve(num_envs=2)[1], serve(num_envs=2)[1]
    address, servers = fleet(a)
    reference = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 2)
    rng = np.random.default_rng(0)
    with RemoteVectorEnv(address) as envs:
        obs, _ = envs.reset(seed=7)
        ref_obs, _ = reference.reset(seed=7)
        for t in range(40):
            if t == 10:
                servers.append(b)
                assert envs.refresh() is not None
            if t == 25:
                servers.remove(b)
                assert envs.refresh() is not None
            actions = rng.integers(0, 2, envs.num_envs)
            obs, rewards, terminations, truncations, _ = envs.step(actions)
            ref_obs, ref_rewards, ref_terminations, ref_truncations, _ = reference.step(actions[:2])
            np.testing.assert_array_equal(obs[:2], ref_obs)
            np.testing.assert_array_equal(rewards[:2], ref_rewards)
            np.testing.assert_array_equal(terminations[:2], ref_terminations)
            np.testing.assert_array_equal(truncations[:2], ref_truncations)


def test_a_removed_server_shrinks_the_fleet_and_is_released(serve: Serve) -> None:
    a, b, c = serve()[1], serve()[1], serve()[1]
    address, servers = fleet(a, b, c)
    with RemoteVectorEnv(address) as envs:
        envs.reset(seed=0)
        servers.remove(a)
        change = envs.refresh()
        assert change is not None and (change.added, change.removed) == ((), (a,))
        assert change.previous_index.tolist() == [2, 3, 4, 5] and envs.num_envs == 4
        envs.step(np.zeros(4, dtype=np.int64))
        with RemoteVectorEnv(a) as other:  # released: another learner may claim it at once
            assert other.num_envs == 2


def test_a_server_that_stopped_is_dropped_though_still_listed(serve: Serve) -> None:
    (proc, a), (_, b) = serve(), serve()
    address, _ = fleet(a, b)
    with RemoteVectorEnv(address) as envs:
        envs.reset(seed=0)
        proc.send_signal(signal.SIGTERM)  # as `docker compose up --scale env=N` does to surplus replicas
        proc.wait(timeout=15)
        with pytest.raises(ServerUnavailableError) as info:
            envs.step(np.zeros(4, dtype=np.int64))
        change = envs.refresh(drop=[info.value.address])
        assert change is not None and change.removed == (a,) and change.added == ()
        assert envs.addresses == [b]
        # The failed step left b's envs a step ahead of what the learner saw: they start over.
        assert change.new_envs.tolist() == [True, True]
        assert (change.restarted, change.added_envs, change.removed_envs) == (2, 0, 2)
        assert np.all(np.abs(change.observations) <= 0.05)
        envs.step(np.zeros(2, dtype=np.int64))


@pytest.mark.slow
def test_a_server_that_stopped_between_rollouts_is_let_go(serve: Serve) -> None:
    (proc, a), (_, b) = serve(), serve()
    address, _ = fleet(a, b)
    with RemoteVectorEnv(address) as envs:
        envs.reset(seed=0)
        last_obs, *_ = envs.step(np.zeros(4, dtype=np.int64))
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        change = until(envs.refresh, "the stopped server is let go")
        assert change.removed == (a,) and change.previous_index.tolist() == [2, 3]
        np.testing.assert_array_equal(change.observations, last_obs[2:])
        stats = envs.fault_stats()  # it said it was shutting down as it ended the session: planned
        assert (stats.shutdowns, stats.failures, stats.servers_left) == (1, 0, 1)


@pytest.mark.parametrize("fault_tolerant", [True, False])
@pytest.mark.slow
def test_a_scale_down_counts_as_servers_shut_down_and_a_kill_as_a_failure(serve: Serve, fault_tolerant: bool) -> None:
    """As `docker compose up --scale env=N` stops surplus replicas (SIGTERM) and lists them no more;
    a replica killed (SIGKILL: out of memory, say) says nothing and counts as a failure."""
    (stopped, a), (killed, b), (_, c) = serve(), serve(), serve()
    address, servers = fleet(a, b, c)
    with RemoteVectorEnv(address, fault_tolerant=fault_tolerant) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(6, dtype=np.int64))
        stopped.send_signal(signal.SIGTERM)
        killed.kill()
        stopped.wait(timeout=15), killed.wait(timeout=15)
        servers.remove(a)
        servers.remove(b)
        change = envs.refresh()
        assert change is not None and set(change.removed) == {a, b} and envs.addresses == [c]
        stats = envs.fault_stats()
        assert (stats.shutdowns, stats.failures, stats.servers_left) == (1, 1, 2)


def test_a_server_that_starts_later_joins_at_a_later_refresh(serve: Serve) -> None:
    a = serve()[1]
    with socket.socket() as sock:  # a free port, for a server that is not there yet
        sock.bind(("127.0.0.1", 0))
        late = f"127.0.0.1:{sock.getsockname()[1]}"
    address, servers = fleet(a)
    with RemoteVectorEnv(address) as envs:
        servers.append(late)  # listed before it listens, as compose DNS lists a starting replica
        assert envs.refresh(wait=0.1) is None
        proc = subprocess.Popen(
            [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--port", late.rpartition(":")[2]],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            change = until(lambda: envs.refresh(wait=0.1), "the late server joins")
            assert change.added == (late,) and envs.num_envs == 3
        finally:
            proc.kill()
            proc.wait(timeout=10)


def until(refresh: Callable[[], FleetChange | None], what: str, timeout: float = 30) -> FleetChange:
    """Refresh until something changed (a bounded wait: connections come and go asynchronously)."""
    deadline = time.monotonic() + timeout
    while (change := refresh()) is None:
        if time.monotonic() > deadline:
            pytest.fail(f"no change within {timeout:g} s: expected {what}")
        time.sleep(0.1)
    return change


@pytest.mark.slow
def test_servers_that_fail_their_reset_after_a_failed_step_leave_too(serve: Serve) -> None:
    """Several replicas stopping at once: the step names one; the others fail the reset and leave as well."""
    (killed, a), (hung, b), (_, c) = serve(), serve(), serve()
    address, _ = fleet(a, b, c)
    with RemoteVectorEnv(address, timeout=1.0) as envs:
        envs.reset(seed=0)
        killed.kill()
        killed.wait(timeout=10)
        hung.send_signal(signal.SIGSTOP)  # still connected, answers nothing
        with pytest.raises(ServerUnavailableError) as info:
            envs.step(np.zeros(6, dtype=np.int64))
        assert info.value.address == a
        change = envs.refresh(drop=[a], wait=0.1)
        assert change is not None and change.removed == (a, b) and envs.addresses == [c]
        assert change.new_envs.all()
        envs.step(np.zeros(2, dtype=np.int64))
        hung.send_signal(signal.SIGCONT)


def test_a_listed_server_that_does_not_answer_waits_its_turn(serve: Serve) -> None:
    a = serve()[1]
    address, servers = fleet(a)
    with RemoteVectorEnv(address) as envs:
        envs.reset(seed=0)
        servers.append("127.0.0.1:1")  # nothing listens there
        assert envs.refresh(wait=0.2) is None
        assert envs.num_envs == 2
        servers.remove("127.0.0.1:1")
        assert envs.refresh(wait=0.2) is None


def test_a_server_of_another_env_is_left_out(serve: Serve) -> None:
    a, b = serve("CartPole-v1")[1], serve("Acrobot-v1")[1]
    address, servers = fleet(a)
    with RemoteVectorEnv(address) as envs:
        envs.reset(seed=0)
        servers.append(b)
        assert envs.refresh() is None
        assert envs.addresses == [a]
    with RemoteVectorEnv(b) as other:  # and not kept claimed
        assert other.num_envs == 2


def test_no_server_left_is_an_error_naming_what_left(serve: Serve) -> None:
    a = serve()[1]
    address, servers = fleet(a)
    with RemoteVectorEnv(address) as envs:
        envs.reset(seed=0)
        servers.clear()
        with pytest.raises(ServerUnavailableError, match=f"no env server left.*{a}"):
            envs.refresh()


def test_refresh_needs_an_idle_open_env(serve: Serve) -> None:
    envs = RemoteVectorEnv(serve()[1])
    envs.reset(seed=0)
    envs.step_async(np.zeros(2, dtype=np.int64))
    with pytest.raises(AlreadyPendingCallError, match="refresh"):
        envs.refresh()
    envs.step_wait()
    envs.close()
    with pytest.raises(ClosedEnvironmentError):
        envs.refresh()


def test_carry_over_lays_per_env_values_out_for_the_new_fleet() -> None:
    change = FleetChange(
        added=("c",),
        removed=("a",),
        num_envs=4,
        previous_num_envs=4,
        previous_index=np.array([2, 3, -1, -1]),
        observations=np.zeros((4, 1)),
        infos={},
    )
    assert carry_over(np.array([1.0, 2.0, 3.0, 4.0]), change, 0.0).tolist() == [3.0, 4.0, 0.0, 0.0]
    assert carry_over(np.array([True, False, False, True]), change, True).tolist() == [False, True, True, True]
    with pytest.raises(ValueError, match="expected 4 envs"):
        carry_over(np.zeros(3), change, 0)


def test_describe_change_counts_envs_by_the_servers_that_came_and_went_and_those_restarted() -> None:
    def change(added: tuple[str, ...], removed: tuple[str, ...], index: list[int], before: int, restarted: int) -> str:
        return describe_change(
            FleetChange(added, removed, len(index), before, np.array(index), np.zeros((len(index), 1)), {}, restarted)
        )

    assert (
        change(("c",), ("a",), [2, 3, -1, -1], 4, 0)
        == "fleet: +2 -2 envs (1 server joined: c; 1 server left: a); 4 envs now"
    )
    # After a failed step: 3 servers x 2 envs, a left, and the envs of b and c started over.
    assert change((), ("a",), [-1] * 4, 6, 4) == "fleet: -2 envs (1 server left: a); 4 envs restarted; 4 envs now"
    # A failed step that cost no server (it came back in time): every env started over.
    assert change((), (), [-1] * 4, 4, 4) == "fleet: 4 envs restarted; 4 envs now"
    assert (
        change(("d", "e"), (), [-1] * 3, 1, 1) == "fleet: +2 envs (2 servers joined: d, e); 1 env restarted; 3 envs now"
    )


def test_pipelining_groups_follow_the_fleet(serve: Serve) -> None:
    a, b, c = serve()[1], serve()[1], serve()[1]
    address, servers = fleet(a, b)
    with RemoteVectorEnv(address, num_groups=2) as envs:
        envs.reset(seed=0)
        servers.remove(b)
        assert envs.refresh() is not None
        assert (envs.num_groups, envs.group_slices) == (1, [slice(0, 2)])
        servers.extend([b, c])
        assert envs.refresh() is not None
        assert (envs.num_groups, envs.group_slices) == (2, [slice(0, 4), slice(4, 6)])
        obs, *_ = envs.step_groups(lambda sl: np.zeros(sl.stop - sl.start, dtype=np.int64))
        assert obs.shape == (6, 4)


@pytest.mark.slow
def test_every_server_restarting_and_still_building_its_envs_is_waited_for_up_to_connect_timeout(
    spawn_server: SpawnServer,
) -> None:
    """No server left but all restarting (a host rebooted; a big simulator builds its envs for a while,
    answering UNAVAILABLE, "starting"): refresh() gives them ``connect_timeout`` to answer again, handshakes
    tried again meanwhile as at the start, before it gives up."""
    server = spawn_server("tests.envs:SlowToBuildEnv", 2, "--env-kwargs", '{"build_s": 0.0}')
    with RemoteVectorEnv(server.address, connect_timeout=30) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))
        server.kill()
        port = server.address.rpartition(":")[2]
        slow = ["--env-kwargs", '{"build_s": 3.0}', "--num-envs", "2", "--host", "127.0.0.1", "--port", port]
        argv = ["--env", "tests.envs:SlowToBuildEnv", *slow]
        with subprocess.Popen(
            [sys.executable, "-m", "env_server", *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        ) as again:
            try:
                deadline = time.monotonic() + 60
                while _health(server.address) != "NOT_SERVING":  # (it listens, and builds its envs)
                    assert again.poll() is None, "the server started again exited (its port taken meanwhile?)"
                    assert time.monotonic() < deadline, "the server started again did not answer within 60 s"
                    time.sleep(0.1)
                change = envs.refresh()
                assert change is not None and change.added == (server.address,) and envs.num_envs == 2
            finally:
                again.kill()


def _health(address: str) -> str | None:
    """The server's health (None: nothing answers yet)."""
    try:
        return check(address, timeout=1.0)
    except grpc.RpcError:
        return None
