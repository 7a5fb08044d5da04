"""Per-replica statistics: round trips end when the answer arrives, and env_busy tells a replica the
fleet waits for from the others (env_steps_per_s cannot, in synchronous stepping)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from learner import RemoteVectorEnv, ServerUnavailableError
from learner import stats as stats_module
from learner.stats import ReplicaStats, StepTimer
from tests.conftest import ServerProcess, SpawnServer, StartServers


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """learner.stats' clock (time.perf_counter), which a test moves on by hand (``clock.now += ...``)."""
    fake = SimpleNamespace(now=100.0)
    monkeypatch.setattr(stats_module, "time", SimpleNamespace(perf_counter=lambda: fake.now))
    return fake


def test_env_busy_is_the_share_of_wall_time_the_envs_stepped(clock: SimpleNamespace) -> None:
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


def test_the_slowest_round_trip_is_the_windows_however_many_steps_it_has() -> None:
    """A pause early in a window longer than the ring (RING steps) is still its latency_max_ms; the
    percentiles are of the last RING steps (was: the max too, 5.5 ms for a 300 ms pause)."""
    timer = StepTimer("10.0.0.1:50051", num_envs=4)
    for _ in range(100):
        timer.record(latency_s=0.002, env_s=0.001)
    timer.record(latency_s=0.3, env_s=0.001)  # (a paused server)
    for _ in range(stats_module.RING + 1000):
        timer.record(latency_s=0.002, env_s=0.001)
    stats = timer.stats()
    assert stats.steps == stats_module.RING + 1101
    assert stats.latency_max_ms == pytest.approx(300.0) and stats.latency_p99_ms == pytest.approx(2.0)
    timer.reset()
    assert math.isnan(timer.stats().latency_max_ms)
    timer.record(latency_s=0.004, env_s=0.001)
    assert timer.stats().latency_max_ms == pytest.approx(4.0)  # (the new window's, not the pause)


def test_env_time_a_server_does_not_measure_is_not_taken_for_0(clock: SimpleNamespace) -> None:
    """env_seconds 0 is "not measured" (the proto): NaN env figures, not 0 ms and env_busy 0."""
    foreign = StepTimer("10.0.0.1:50051", num_envs=4)
    for _ in range(10):
        foreign.record(latency_s=0.030, env_s=0.0)
    clock.now += 0.5
    stats = foreign.stats()
    assert math.isnan(stats.env_p50_ms) and math.isnan(stats.env_p99_ms) and math.isnan(stats.env_busy)
    assert stats.latency_p50_ms == pytest.approx(30.0) and stats.env_steps_per_s == pytest.approx(80.0)
    # The whole round trip is outside the envs, as far as the learner can tell (stalls).
    assert foreign.last_outside_envs() == pytest.approx(0.030)
    assert foreign.usual_outside_envs(at_least=5) == pytest.approx(0.030)
    # A window with some steps measured: the env figures are theirs.
    foreign.reset()
    for _ in range(3):
        foreign.record(latency_s=0.012, env_s=0.010)
    foreign.record(latency_s=0.012, env_s=0.0)
    clock.now += 1.0
    stats = foreign.stats()
    assert stats.env_p50_ms == pytest.approx(10.0) and stats.env_p99_ms == pytest.approx(10.0)
    assert stats.env_busy == pytest.approx(0.03)


@pytest.mark.slow
def test_a_server_that_left_has_the_rates_of_its_time_in_the_fleet(spawn_server: SpawnServer, tmp_path: Path) -> None:
    """Its window ends as it leaves (refresh()): its env-steps/s and env_busy are not diluted by the time the
    fleet went on without it (was: 206 env-steps/s for 286 in the fleet); back with the same envs, its
    window goes on from the time it joins again."""
    a = spawn_server("CartPole-v1", 2)
    b = spawn_server("CartPole-v1", 2)
    listed = tmp_path / "fleet.txt"
    listed.write_text(f"{a.address}\n{b.address}\n")

    def elapsed(window: ReplicaStats) -> float:  # (the window's time, from its rate)
        return window.steps * window.num_envs / window.env_steps_per_s

    with RemoteVectorEnv(f"file:{listed}") as envs:
        envs.reset(seed=0)
        started = time.perf_counter()
        envs.replica_stats(reset=True)
        for _ in range(5):
            envs.step(np.zeros(4, dtype=np.int64))
        listed.write_text(f"{a.address}\n")
        assert envs.refresh() is not None
        left = time.perf_counter()
        in_fleet = left - started  # (b's window, at most)
        while time.perf_counter() - left < max(0.5, 2 * in_fleet):  # (the fleet goes on without b)
            envs.step(np.zeros(2, dtype=np.int64))
        gone = next(w for w in envs.replica_stats() if w.address == b.address)
        assert not gone.available and gone.steps == 5
        assert elapsed(gone) <= in_fleet * (1 + 1e-6), (elapsed(gone), in_fleet)

        listed.write_text(f"{a.address}\n{b.address}\n")
        asked = time.perf_counter()
        change = envs.refresh(wait=30)
        assert change is not None and change.added == (b.address,)
        back = time.perf_counter()
        while time.perf_counter() - back < max(0.5, 2 * in_fleet):
            envs.step(np.zeros(4, dtype=np.int64))
        stepped = time.perf_counter()
        windows = envs.replica_stats()
        read = time.perf_counter()
        [again] = [w for w in windows if w.address == b.address]
        assert again.available and again.steps > 5
        # Its time before it left, and since it joined again: not the time it was away.
        assert stepped - back <= elapsed(again) <= (in_fleet + read - asked) * (1 + 1e-6), (
            elapsed(again),
            in_fleet,
            stepped - back,
        )


def test_the_latency_percentiles_are_the_p50_and_p99_of_the_windows_steps() -> None:
    """Round trips of 1 ... 100 ms: the p50 and p99 are numpy's of those (a p90 taken for the p99 read
    90.1 ms, not 99.01), for the env's time as for the round trip's."""
    timer = StepTimer("10.0.0.1:50051", num_envs=1)
    for ms in range(1, 101):
        timer.record(latency_s=ms / 1000.0, env_s=ms / 2000.0)
    stats = timer.stats()
    latencies = np.arange(1, 101)
    assert stats.latency_p50_ms == pytest.approx(np.percentile(latencies, 50))
    assert stats.latency_p99_ms == pytest.approx(np.percentile(latencies, 99))
    assert stats.env_p99_ms == pytest.approx(np.percentile(latencies / 2, 99))


def test_after_a_reset_the_percentiles_are_of_the_new_windows_steps_only() -> None:
    """A reset starts a new window: 5 steps of 2 ms after 50 of 100 ms have a p99 of 2 ms."""
    timer = StepTimer("10.0.0.1:50051", num_envs=1)
    for _ in range(50):
        timer.record(latency_s=0.1, env_s=0.05)
    timer.reset()
    for _ in range(5):
        timer.record(latency_s=0.002, env_s=0.001)
    stats = timer.stats()
    assert stats.steps == 5 and stats.latency_p99_ms == pytest.approx(2.0) and stats.env_p99_ms == pytest.approx(1.0)
