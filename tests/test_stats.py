"""Per-replica statistics: round trips end when the answer arrives, and env_busy tells a replica the
fleet waits for from the others (env_steps_per_s cannot, in synchronous stepping)."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import numpy as np
import pytest

from learner import RemoteVectorEnv, ServerUnavailableError
from learner import stats as stats_module
from learner.stats import StepTimer
from tests.conftest import ServerProcess, SpawnServer, StartServers


def test_env_busy_is_the_share_of_wall_time_the_envs_stepped(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(stats_module, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    timer = StepTimer("10.0.0.1:50051", num_envs=4)
    for _ in range(10):
        timer.record(latency_s=0.012, env_s=0.010)
    clock.now += 0.5  # 10 steps in 0.5 s, 0.1 s of it in the envs
    stats = timer.stats()
    assert stats.steps == 10 and stats.env_steps_per_s == pytest.approx(80.0)
    assert stats.env_busy == pytest.approx(0.2)
    assert stats.latency_p50_ms == pytest.approx(12.0) and stats.env_p50_ms == pytest.approx(10.0)
    timer.reset()
    clock.now += 1.0
    assert timer.stats().env_busy == 0.0 and math.isnan(timer.stats().latency_p50_ms)

    metrics = stats.metrics("replicas/10.0.0.1:50051/")
    assert metrics["replicas/10.0.0.1:50051/env_busy"] == pytest.approx(0.2)
    assert all(isinstance(v, float) for v in metrics.values()) and not any(k.endswith("address") for k in metrics)
    assert stats.address == "10.0.0.1:50051"  # (the key to group them by: not among the numbers)


def test_one_slow_step_among_hundreds_shows_in_the_max_not_the_p99() -> None:
    timer = StepTimer("10.0.0.1:50051", num_envs=4)
    for _ in range(199):
        timer.record(latency_s=0.001, env_s=0.0005)
    timer.record(latency_s=0.8, env_s=0.0005)  # (a stalled link, say: under STALL's 1 s)
    stats = timer.stats()
    assert stats.latency_p99_ms == pytest.approx(1.0) and stats.latency_max_ms == pytest.approx(800.0)
    timer.reset()
    assert math.isnan(timer.stats().latency_max_ms)  # (no steps in the new window)
    assert (timer.failures, timer.shutdowns, timer.reconnects, timer.stalls) == (0, 0, 0, 0)


@pytest.mark.slow
def test_env_busy_tells_the_slow_replica_in_synchronous_stepping(start_servers: StartServers) -> None:
    (fast,) = start_servers("CartPole-v1", envs_per_server=2, transport="unix")
    (slow,) = start_servers("CartPole-v1", envs_per_server=2, transport="unix", server_args=["--step-delay-ms", "20"])
    with RemoteVectorEnv([fast, slow]) as envs:
        envs.reset(seed=0)
        envs.replica_stats(reset=True)
        for _ in range(20):
            envs.step(np.ones(4, dtype=np.int64))
        a, b = envs.replica_stats()
    assert a.env_steps_per_s == pytest.approx(b.env_steps_per_s, rel=0.05)  # the fleet's pace, both
    assert b.env_busy > 0.05 and b.env_busy > 10 * a.env_busy, (a.env_busy, b.env_busy)  # (loose: load slows steps)
    assert b.env_busy <= 1.0


@pytest.mark.parametrize("transport", ["unix", "tcp"])  # (the step socket; StepStream)
@pytest.mark.slow
def test_a_quick_replicas_round_trip_ends_when_its_answer_arrives(start_servers: StartServers, transport: str) -> None:
    """Pipelined, the learner waits for the slow group first: the quick group's answer, in meanwhile,
    must not count as late as the slow one's (was: read, and timed, only when its group was taken in)."""
    (fast,) = start_servers("CartPole-v1", envs_per_server=2, transport=transport)
    (slow,) = start_servers(
        "CartPole-v1", envs_per_server=2, transport=transport, server_args=["--step-delay-ms", "30"]
    )
    with RemoteVectorEnv([fast, slow], num_groups=2) as envs:
        assert all(bool(c.step_socket) == (transport == "unix") for c in envs._clients)
        envs.reset(seed=0)
        envs.replica_stats(reset=True)
        for _ in range(15):
            envs.send(np.ones(2, dtype=np.int64), 0)
            envs.send(np.ones(2, dtype=np.int64), 1)
            envs.recv(1)
            envs.recv(0)
        a, b = envs.replica_stats()
    assert b.latency_p50_ms >= 30.0
    assert a.latency_p50_ms < b.latency_p50_ms / 2, (a.latency_p50_ms, b.latency_p50_ms)


def test_a_quick_replica_after_a_slow_one_is_timed_by_its_own_answer(start_servers: StartServers) -> None:
    """Synchronous steps over step sockets: the answers are read as they come, whichever server's
    (was: in server order, so a quick server after a slow one was timed as slow as it)."""
    (slow,) = start_servers("CartPole-v1", envs_per_server=2, transport="unix", server_args=["--step-delay-ms", "30"])
    (fast,) = start_servers("CartPole-v1", envs_per_server=2, transport="unix")
    with RemoteVectorEnv([slow, fast]) as envs:
        envs.reset(seed=0)
        envs.replica_stats(reset=True)
        for _ in range(15):
            envs.step(np.ones(4, dtype=np.int64))
        a, b = envs.replica_stats()
    assert a.latency_p50_ms >= 30.0
    assert b.latency_p50_ms < a.latency_p50_ms / 2, (a.latency_p50_ms, b.latency_p50_ms)


def _lose(envs: RemoteVectorEnv, server: ServerProcess) -> None:
    """Kill ``server``: the next step of ``envs`` (4 envs, not fault-tolerant) fails on it."""
    server.kill()
    with pytest.raises(ServerUnavailableError):
        envs.step(np.zeros(4, dtype=np.int64))


@pytest.mark.slow
def test_a_server_lost_without_fault_tolerance_shows_in_its_own_statistics(spawn_server: SpawnServer) -> None:
    """Its failure, counted by refresh(), is in its window (once, unavailable, after it left the fleet), and
    in the window of the server back at its address (was: 0 in both, against 1 in fault_stats())."""
    a, b, c = (spawn_server("CartPole-v1", 2) for _ in range(3))
    with RemoteVectorEnv([a.address, b.address], fault_tolerant=False, timeout=5.0) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))
        envs.replica_stats(reset=True)
        envs.step(np.zeros(4, dtype=np.int64))
        _lose(envs, b)
        envs.refresh()
        windows = envs.replica_stats(reset=True)
        assert [(w.address, w.failures, w.available, w.steps) for w in windows] == [
            (a.address, 0, True, 2),
            (b.address, 1, False, 1),
        ]
        assert envs.fault_stats().failures == 1
        assert [w.address for w in envs.replica_stats()] == [a.address]  # (given once)
    with RemoteVectorEnv([a.address, c.address], fault_tolerant=False, timeout=5.0) as envs:
        envs.reset(seed=0)
        envs.replica_stats(reset=True)
        _lose(envs, c)
        c.start()  # (back at its address, with the same envs: its timer goes on)
        envs.refresh(wait=30)
        assert [(w.address, w.failures) for w in envs.replica_stats()] == [(a.address, 0), (c.address, 1)]


@pytest.mark.slow
def test_a_server_that_left_and_came_back_within_a_window_is_given_once(spawn_server: SpawnServer) -> None:
    """Back with the same envs, it takes its timer back, its failure counted (was: given twice, the one
    that left last, whose figures overwrote the live server's in learner train's rows)."""
    a, b = (spawn_server("CartPole-v1", 2) for _ in range(2))
    with RemoteVectorEnv([a.address, b.address], fault_tolerant=False, timeout=5.0) as envs:
        envs.reset(seed=0)
        envs.replica_stats(reset=True)
        _lose(envs, b)
        envs.refresh(wait=0.5)  # (b does not answer: it leaves)
        assert envs.addresses == [a.address]
        b.start()
        deadline = time.monotonic() + 30
        while len(envs.addresses) < 2:  # (taken back once its join backoff is over)
            assert time.monotonic() < deadline, "b did not join again"
            envs.refresh(wait=1.0)
            time.sleep(0.2)
        envs.step(np.zeros(4, dtype=np.int64))
        windows = envs.replica_stats()
        assert [(w.address, w.available, w.failures) for w in windows] == [(a.address, True, 0), (b.address, True, 1)]
