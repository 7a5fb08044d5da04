"""RemoteVectorEnv's features meeting each other: pipelined recv() with timeouts and lost servers,
refresh() with reconnects and autoresets due, masked resets with servers lost or back.

Real servers (subprocesses on port 0, or LocalServers on Unix sockets). Waits are bounded generously
(the machine is shared and noisy): a deadline is checked as "reported within a few timeouts", never
to the millisecond.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import numpy as np
import pytest

from learner import RemoteTimeoutError, RemoteVectorEnv, ServerUnavailableError
from learner.faults import ReplicaState
from tests.conftest import FAST, SpawnServer, StartServers, fleet

K = 2  # envs per server
ENDLESS = ("--env-kwargs", '{"length": 100000}')  # IndexEnv episodes that outlast a test


def unavailable(infos: dict[str, Any], n: int) -> np.ndarray:
    return np.asarray(infos.get("_env_unavailable", np.zeros(n, dtype=bool)))


def wait_state(envs: RemoteVectorEnv, server: int, state: ReplicaState, limit_s: float = 15.0) -> None:
    """Run the loop (reconnect tasks go on) until server ``server`` is in ``state``, without stepping."""
    deadline = time.monotonic() + limit_s
    while envs._replicas[server].state is not state:
        assert time.monotonic() < deadline, f"server {server} not {state} within {limit_s} s"
        envs._runner.run(asyncio.sleep(0.05))


# -- recv() of whichever group is done ---------------------------------------------------------------


@pytest.mark.slow
def test_recv_reports_a_hung_group_while_another_keeps_answering(spawn_server: SpawnServer) -> None:
    """The documented loop ``g = recv(); send(g)``: a group that always answers first must not keep a
    hung group's timeout from being noticed (its server lost within about ``timeout`` of its send). Closing
    the fleet then does not wait for the hung server."""
    timeout = 1.0
    a = spawn_server("tests.envs:FaultyEnv", 1)
    b = spawn_server("tests.envs:FaultyEnv", 1, "--env-kwargs", '{"hang_at": 3, "hang_s": 60}')
    with RemoteVectorEnv(
        [a.address, b.address], timeout=timeout, num_groups=2, fault_tolerant=True, backoff=(0.05, 0.5)
    ) as envs:
        envs.reset(seed=0)
        sent_at: dict[int, list[float]] = {0: [], 1: []}
        for g in range(2):
            envs.send(np.zeros(1, dtype=np.int64), g)
            sent_at[g].append(time.monotonic())
        reported = None
        limit = time.monotonic() + 10 * timeout
        while reported is None and time.monotonic() < limit:
            g, *_, infos = envs.recv()
            if g == 1 and unavailable(infos, 1).any():
                # Answered by the 3rd step group 1 was sent (hang_at 3): the time since that send.
                reported = time.monotonic() - sent_at[1][2]
            time.sleep(0.005)  # (a policy's forward pass)
            envs.send(np.zeros(1, dtype=np.int64), g)
            sent_at[g].append(time.monotonic())
        assert reported is not None, "group 1's hung step was never reported (recv kept taking group 0 in)"
        assert reported < 3 * timeout, f"reported {reported:.2f} s after its send (timeout {timeout} s)"
        assert envs.fault_stats().failures == 1
        for g in range(2):
            envs.recv(g)
        closing = time.monotonic()
    # close() while the hung server is being reconnected to (its GetSpec in flight, for 60 s): bounded, not
    # as long as the hang (grpc.aio's call ends when the connection closes, not when cancelled).
    assert time.monotonic() - closing < 15, f"close() took {time.monotonic() - closing:.1f} s"


@pytest.mark.parametrize("transport", ["tcp", "unix"])
@pytest.mark.slow
def test_recv_of_any_group_times_out_once_from_the_send(
    spawn_server: SpawnServer, start_servers: StartServers, transport: str
) -> None:
    """Not fault-tolerant, every server hung: recv() raises about ``timeout`` after the send, however
    long the learner took before calling it (not that long again from the call, nor twice)."""
    timeout = 1.0
    # (hung 5 s: well past the deadline; a server still hung when the test ends is stopped only once its step returns)
    if transport == "tcp":
        hang = ("--env-kwargs", '{"hang_at": 3, "hang_s": 5}')
        addresses = [spawn_server("tests.envs:FaultyEnv", 1, *hang).address for _ in range(2)]
    else:  # (step sockets)
        addresses = start_servers(
            "tests.envs:FaultyEnv", 2, 1, env_kwargs={"hang_at": 3, "hang_s": 5}, restarts=0, transport="unix"
        )
    with RemoteVectorEnv(addresses, timeout=timeout, num_groups=2) as envs:
        assert [c.step_socket != "" for c in envs._clients] == [transport == "unix"] * 2
        envs.reset(seed=0)
        for _ in range(2):
            envs.step(np.zeros(2, dtype=np.int64))
        for g in range(2):
            envs.send(np.zeros(1, dtype=np.int64), g)
        sent = time.monotonic()
        time.sleep(0.8 * timeout)  # (the learner busy: its deadline runs all the same)
        with pytest.raises(RemoteTimeoutError, match=r"no answer within the 1 s deadline"):
            envs.recv()
        # Before: timeout from the call, then a whole timeout again (0.8 + 2 timeouts after the send).
        waited = time.monotonic() - sent
        assert waited < 2.2 * timeout, f"raised {waited:.2f} s after the send (timeout {timeout} s)"


@pytest.mark.slow
def test_a_group_whose_servers_are_all_down_does_not_hold_up_the_others(spawn_server: SpawnServer) -> None:
    """Group 1's only server is down (another is up): taking group 1 in waits for no rejoin, so group 0
    steps at its own pace; and group 1 keeps coming back (no starvation) without outpacing group 0."""
    a = spawn_server("tests.envs:IndexEnv", K, *ENDLESS)
    b = spawn_server("tests.envs:IndexEnv", K, *ENDLESS)
    with RemoteVectorEnv([a.address, b.address], fault_tolerant=True, num_groups=2, **FAST) as envs:
        envs.reset(seed=0)
        b.kill()
        for g in range(2):
            envs.send(np.zeros(K, dtype=np.int64), g)
        counts = {0: 0, 1: 0}
        start = time.monotonic()
        limit = start + 15.0
        while counts[0] < 20 and time.monotonic() < limit:
            g, *_, infos = envs.recv()
            counts[g] += 1
            if g == 1:
                assert unavailable(infos, K).all()
            else:
                assert "env_unavailable" not in infos
            envs.send(np.zeros(K, dtype=np.int64), g)
        took = time.monotonic() - start
        # Before: each recv of group 1 slept min(timeout, 1 s) waiting for b: ~20 s for 20 of group 0's.
        assert counts[0] == 20, f"group 0 answered {counts[0]} times in {took:.1f} s"
        assert took < 8.0, f"20 steps of group 0 took {took:.1f} s"
        assert 1 <= counts[1] <= counts[0] + 2, counts
        for g in range(2):
            envs.recv(g)
        # With every server down, a step still waits a moment for one to come back (no spinning).
        a.kill()
        envs.step(np.zeros(2 * K, dtype=np.int64))  # (a's loss noticed)
        start = time.monotonic()
        envs.step(np.zeros(2 * K, dtype=np.int64))
        assert time.monotonic() - start >= 0.9


# -- refresh() ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["moved", "shrunk"])
@pytest.mark.slow
def test_a_reconnect_under_way_across_refresh_counts_on_its_own_server(spawn_server: SpawnServer, case: str) -> None:
    """A server lost, then moved by refresh() (others left before it) while its reconnect runs: its
    return is counted on its own replica_stats, not on the server now at its old index (nor an
    IndexError in the reconnect task once the fleet shrank)."""
    servers = [spawn_server("tests.envs:IndexEnv", 1, *ENDLESS) for _ in range(3)]
    address, listed = fleet(*(s.address for s in servers))
    lost = servers[1] if case == "moved" else servers[2]
    with RemoteVectorEnv(address, fault_tolerant=True, step_socket=False, **FAST) as envs:
        envs.reset(seed=0)
        before = envs.addresses.index(lost.address)
        lost.kill()
        envs.step(np.zeros(3, dtype=np.int64))
        task = envs._replicas[before].reconnect_task
        assert task is not None and envs._replicas[before].state is ReplicaState.DOWN
        listed.remove(servers[0].address)
        if case == "shrunk":
            listed.remove(servers[1].address)
        envs.refresh()
        now = envs.addresses.index(lost.address)
        assert now < before
        lost.start()
        wait_state(envs, now, ReplicaState.READY)
        envs._runner.run(asyncio.sleep(0.1))  # (the task ends after on_ready)
        assert task.done() and task.exception() is None
        assert envs._rejoined.is_set()
        stats = envs.replica_stats()
        reconnects = {s.address: s.reconnects for s in stats[: len(envs.addresses)]}
        assert reconnects == {a: int(a == lost.address) for a in envs.addresses}
        # (those that left in the window, with steps in it, after them: unavailable, none reconnected)
        left = [s for s in servers if s.address not in envs.addresses]
        assert [(s.address, s.available, s.reconnects) for s in stats[len(envs.addresses) :]] == [
            (s.address, False, 0) for s in left
        ]
        assert envs.fault_stats().reconnects == 1


@pytest.mark.slow
def test_refresh_moves_the_autoresets_due_with_their_envs(spawn_server: SpawnServer) -> None:
    """Next-step autoreset: an env whose episode ended gets ``reset_timeout`` for its next step (it
    resets in it), also once refresh() moved it to another index (here: the server before it left
    and joined again behind it)."""
    a = spawn_server("tests.envs:ClockEnv", 1)
    # Its first reset is quick; the autoreset (its second) takes 3 s, over `timeout` (1 s: a's steps keep
    # it on a loaded host).
    b = spawn_server("tests.envs:SlowResetEnv", 1, "--env-kwargs", '{"slow_from": 2, "sleep_s": 3.0}')
    with RemoteVectorEnv(
        [a.address, b.address], timeout=1.0, reset_timeout=10.0, num_groups=2, step_socket=False
    ) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))  # (both at t=1: each env's autoreset due is known, none)
        truncated = False
        for _ in range(2):  # (ClockEnv: episodes of 3 steps)
            envs.send(np.zeros(1, dtype=np.int64), 1)
            *_, truncs, _ = envs.recv(1)
            truncated = bool(truncs[0])
        assert truncated, "b's episode ended at its last step: it resets at its next"
        change = envs.refresh(drop=[a.address])
        assert change is not None and envs.addresses == [b.address, a.address]
        envs.send(np.zeros(1, dtype=np.int64), 0)
        _, _, _, terms, truncs, _ = envs.recv(0)  # (before: a timeout after 1 s)
        assert not terms[0] and not truncs[0]


@pytest.mark.slow
def test_a_server_that_stayed_and_fails_its_reset_in_refresh_counts_as_a_failure(spawn_server: SpawnServer) -> None:
    """After a failed step every env starts over in refresh(): a server that stays listed but misses
    its reset's deadline leaves the fleet, counted in fault_stats().failures as the one dropped is."""
    a, b, c = (spawn_server("CartPole-v1", 1) for _ in range(3))
    with RemoteVectorEnv([a.address, b.address, c.address], timeout=1.0) as envs:
        envs.reset(seed=0)
        a.kill()
        assert b.proc is not None
        b.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises((ServerUnavailableError, RemoteTimeoutError)):
                envs.step(np.zeros(3, dtype=np.int64))
            change = envs.refresh(drop=[a.address], wait=0.1)
            assert change is not None and set(change.removed) == {a.address, b.address}
            stats = envs.fault_stats()
            assert (stats.failures, stats.shutdowns, stats.servers_left) == (2, 0, 2)
        finally:
            b.proc.send_signal(signal.SIGCONT)


# -- masked resets, servers lost or back --------------------------------------------------------------


def test_a_server_lost_in_a_reset_of_some_of_its_envs_ends_the_others_episodes(spawn_server: SpawnServer) -> None:
    """``reset(options={"reset_mask": ...})`` taking env 2 of server b, which is gone: its env 3 was
    mid-episode; that episode ends, truncated, on the next step (as a loss a step notices ends it),
    and the reset's infos flag both of b's envs unavailable. Env 2 had no episode under way."""
    a = spawn_server("tests.envs:IndexEnv", K, *ENDLESS)
    b = spawn_server("tests.envs:IndexEnv", K, *ENDLESS)
    with RemoteVectorEnv([a.address, b.address], fault_tolerant=True, **FAST) as envs:
        envs.reset(seed=0)
        for _ in range(3):
            envs.step(np.full(2 * K, 5))
        b.kill()
        _, infos = envs.reset(options={"reset_mask": np.array([True, False, True, False])})
        assert unavailable(infos, 2 * K).tolist() == [False, False, True, True]
        _, rewards, terms, truncs, infos = envs.step(np.full(2 * K, 6))
        assert truncs.tolist() == [False, False, False, True]
        assert not terms.any() and rewards[2:].tolist() == [0.0, 0.0]
        assert unavailable(infos, 2 * K).tolist() == [False, False, True, True]
        _, _, _, truncs, infos = envs.step(np.full(2 * K, 6))  # (once only)
        assert not truncs.any() and unavailable(infos, 2 * K).tolist() == [False, False, True, True]


@pytest.mark.parametrize("then", ["full-reset", "back"])
def test_the_truncation_a_masked_reset_loss_leaves_is_neither_repeated_nor_lost(
    spawn_server: SpawnServer, then: str
) -> None:
    """Server b is lost in a reset of env 2 (env 3 mid-episode, to be cut on the next step). A full
    reset before that step leaves no episode to cut (it was reported after the reset); b back
    before that step still cuts env 3's episode there, and hands its new episodes over on the next."""
    a = spawn_server("tests.envs:IndexEnv", K, *ENDLESS)
    b = spawn_server("tests.envs:IndexEnv", K, *ENDLESS)
    with RemoteVectorEnv([a.address, b.address], fault_tolerant=True, step_socket=False, **FAST) as envs:
        envs.reset(seed=0)
        for _ in range(3):
            envs.step(np.full(2 * K, 5))
        b.kill()
        envs.reset(options={"reset_mask": np.array([True, False, True, False])})
        if then == "full-reset":
            _, infos = envs.reset(seed=1)
            assert unavailable(infos, 2 * K).tolist() == [False, False, True, True]
            _, _, _, truncs, infos = envs.step(np.full(2 * K, 6))
            assert not truncs.any() and unavailable(infos, 2 * K).tolist() == [False, False, True, True]
        else:
            b.start()
            wait_state(envs, 1, ReplicaState.READY)
            _, _, _, truncs, infos = envs.step(np.full(2 * K, 6))
            assert truncs.tolist() == [False, False, False, True] and "env_rejoined" not in infos
            _, _, _, truncs, infos = envs.step(np.full(2 * K, 6))
            assert not truncs.any() and infos["_env_rejoined"].tolist() == [False, False, True, True]


def test_a_reset_of_some_envs_of_a_server_back_flags_its_others_rejoined(spawn_server: SpawnServer) -> None:
    """A server back from a loss (READY: its reconnect reset all its envs) and a masked reset taking
    some of them: the others start new episodes too, so the reset flags them ``env_rejoined`` (and
    unavailable), as the step a server rejoins does."""
    a = spawn_server("tests.envs:IndexEnv", K, *ENDLESS)
    b = spawn_server("tests.envs:IndexEnv", K, *ENDLESS)
    with RemoteVectorEnv([a.address, b.address], fault_tolerant=True, step_socket=False, **FAST) as envs:
        envs.reset(seed=0)
        for _ in range(5):
            obs, *_ = envs.step(np.full(2 * K, 7))
        token = obs[3, 0]  # IndexEnv: [token, index, t, last_action]
        b.kill()
        envs.step(np.full(2 * K, 8))
        b.start()
        wait_state(envs, 1, ReplicaState.READY)
        obs, infos = envs.reset(options={"reset_mask": np.array([True, False, True, False])})
        assert obs[3, 0] != token and obs[3, 2] == 0, "env 3's new episode (its reconnect's reset)"
        assert infos["_env_rejoined"].tolist() == [False, False, False, True]
        assert unavailable(infos, 2 * K).tolist() == [False, False, False, True]
        _, _, _, truncs, infos = envs.step(np.full(2 * K, 9))
        assert "env_unavailable" not in infos and not truncs.any()


def test_a_reset_with_a_server_down_loses_no_env_steps(spawn_server: SpawnServer) -> None:
    """fault_stats().env_steps_lost counts env steps that were no transition; a reset is no env step."""
    a = spawn_server("tests.envs:IndexEnv", K, *ENDLESS)
    b = spawn_server("tests.envs:IndexEnv", K, *ENDLESS)
    with RemoteVectorEnv([a.address, b.address], fault_tolerant=True, **FAST) as envs:
        envs.reset(seed=0)
        b.kill()
        _, infos = envs.reset(seed=1)
        assert unavailable(infos, 2 * K).tolist() == [False, False, True, True]
        assert envs.fault_stats().env_steps_lost == 0
        envs.step(np.zeros(2 * K, dtype=np.int64))
        assert envs.fault_stats().env_steps_lost == K


# -- answers that came while the learner was busy --------------------------------------------------


@pytest.mark.parametrize("step_socket", [True, False], ids=["step-socket", "grpc"])
@pytest.mark.slow
def test_an_answer_that_came_while_the_learner_was_busy_past_the_timeout_is_on_time(
    start_servers: StartServers, step_socket: bool
) -> None:
    """A step's deadline counts from its send, but the learner busy for longer than ``timeout``
    between step_async and step_wait (a long update, say) does not make a step late whose answer
    came meanwhile: a large one (2 x 1 MB infos, more than a socket buffer holds) included."""
    addresses = start_servers("tests.envs:InfoWidthEnv", 1, K, env_kwargs={"width": 1 << 17})
    with RemoteVectorEnv(addresses, timeout=1.0, step_socket=step_socket) as envs:
        envs.reset(seed=0)
        for t in range(1, 4):
            envs.step_async(np.zeros(K, dtype=np.int64))
            time.sleep(2.0)  # 2 x the timeout (of 1 s: a 2 MB answer on a loaded host)
            _, _, _, _, infos = envs.step_wait()
            assert infos["v"].shape == (K, 1 << 17) and (infos["v"] == t).all()


@pytest.mark.slow
def test_a_first_step_on_a_new_stream_counts_its_deadline_from_when_it_is_sent(start_servers: StartServers) -> None:
    """A gRPC step on a new StepStream is handed to gRPC only once the stream is open, a few turns of
    the loop after step_async: a learner then busy past the timeout found a healthy server (a 400 ms
    step) late, its step never sent. step_async now waits for the stream to open."""
    addresses = start_servers("CartPole-v1", 1, 1, server_args=["--step-delay-ms", "400"])
    with RemoteVectorEnv(addresses, timeout=1.0, step_socket=False) as envs:
        envs.reset(seed=0)
        for _ in range(2):  # (the first step opens the stream)
            envs.step_async(np.zeros(1, dtype=np.int64))
            time.sleep(1.5)
            envs.step_wait()
