"""A step the fleet waited long for, because one server answered far slower than it usually does (a
stalled link, a paused server), is warned of, naming the server; an env whose every step is slow is not.

Servers are paused for real (SIGSTOP, then SIGCONT from a timer: its kernel keeps the connection, as
a link that stalls does)."""

from __future__ import annotations

import itertools
import logging
import os
import re
import signal
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest

from learner import faults, pauses, remote
from learner.local import LocalServers, label_of
from learner.remote import RemoteVectorEnv
from learner.stats import StepTimer

ACTIONS = np.zeros(4, dtype=np.int64)


@pytest.fixture(scope="module")
def servers() -> Iterator[LocalServers]:
    with LocalServers("CartPole-v1", 2, 2, transport="unix") as started:
        yield started


def _paused(pid: int, seconds: float) -> threading.Timer:
    """Pause process ``pid`` now, for ``seconds``."""
    os.kill(pid, signal.SIGSTOP)
    timer = threading.Timer(seconds, os.kill, (pid, signal.SIGCONT))
    timer.start()
    return timer


def _stalls(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if " of it outside its envs (usually " in r.getMessage()]


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.slow
def test_a_server_paused_mid_run_is_named_once_per_period_with_the_count_of_its_stalls(
    servers: LocalServers, groups: int, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over step() and over pipelined recv(): the first stall is warned of, the second (within the
    period) only counted, and said with the next warning once the period is over."""
    monkeypatch.setattr(faults, "STALL", (0.5, 10.0, 3.0))
    paused_address, paused_pid = servers.addresses[1], servers.pids[1]
    with RemoteVectorEnv(servers.addresses, num_groups=groups) as envs, caplog.at_level(logging.WARNING):
        envs.reset(seed=0)

        def step() -> None:
            if groups == 1:
                envs.step(ACTIONS)
                return
            for g, sl in enumerate(envs.group_slices):
                envs.send(ACTIONS[sl], g)
            for _ in envs.group_slices:
                envs.recv()

        for _ in range(30):
            step()
        assert not _stalls(caplog)
        for stall in range(3):
            timer = _paused(paused_pid, 1.0)
            step()
            timer.join()
            for _ in range(25):
                step()
            if stall == 1:
                threading.Event().wait(3.0)  # (the period is over by the third)
        counted = {r.address: r.stalls for r in envs.replica_stats()}
    assert counted == {servers.addresses[0]: 0, paused_address: 3}, counted  # (every one, warned of or not)
    first, third = _stalls(caplog)
    took = (  # (local-1, as the learner names a server of a LocalServers it runs)
        rf"env server {re.escape(label_of(paused_address))} took 1\.\d s to answer a step, 1\.\d s of it outside "
        r"its envs "
    )
    assert re.match(took + r"\(usually [\d.]+ ms\); the fleet waited 1\.\d s for it \(a stalled link, ", first), first
    assert first.endswith("(a stalled link, a paused or overloaded server, or a busy learner host)"), first
    assert re.match(took, third) and re.search(r"; 1 more such step in the last \d+ s$", third), third


@pytest.mark.slow
def test_a_stall_while_the_learner_itself_was_held_up_says_so(
    servers: LocalServers, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A learner stopped for 15 s (SIGSTOP) blamed its server's link first; only a later line said that the
    learner itself had been held up."""
    monkeypatch.setattr(faults, "STALL", (0.5, 10.0, 3.0))
    with RemoteVectorEnv(servers.addresses) as envs, caplog.at_level(logging.WARNING):
        envs.reset(seed=0)
        for _ in range(30):
            envs.step(ACTIONS)
        monkeypatch.setattr(pauses, "_last_pause", (6.0, pauses._now()))  # (as the watcher leaves a 6-s stop)
        timer = _paused(servers.pids[1], 1.0)
        envs.step(ACTIONS)
        timer.join()
    (stall,) = _stalls(caplog)
    assert stall.endswith(
        "(this learner itself was held up for 6 s meanwhile (stopped, suspended, starved of CPU, or a long call "
        "holding the interpreter): the wait may be its own, and the server fine)"
    ), stall


@pytest.mark.slow
def test_an_env_whose_every_step_is_slow_is_no_stall(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(faults, "STALL", (0.05, 10.0, 60.0))
    with (
        LocalServers("CartPole-v1", 1, 2, transport="unix", server_args=["--step-delay-ms", "60"]) as slow,
        RemoteVectorEnv(slow.addresses) as envs,
        caplog.at_level(logging.WARNING),
    ):
        envs.reset(seed=0)
        for _ in range(30):
            envs.step(np.zeros(2, dtype=np.int64))
    assert not _stalls(caplog)


@pytest.mark.slow
def test_an_env_slow_to_reset_is_no_stall(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step in which an env resets for 0.6 s (ClockEnv's episodes: 3 steps) is waited for as long,
    but its envs took that time (each answer says how long): no stall."""
    monkeypatch.setattr(faults, "STALL", (0.3, 10.0, 60.0))
    with (
        LocalServers(
            "tests.envs:SlowResetEnv", 1, 1, transport="unix", env_kwargs={"slow_from": 2, "sleep_s": 0.6}
        ) as slow,
        RemoteVectorEnv(slow.addresses) as envs,
        caplog.at_level(logging.WARNING),
    ):
        envs.reset(seed=0)
        for _ in range(32):  # (8 slow resets, after the first 20 steps some)
            envs.step(np.zeros(1, dtype=np.int64))
    assert not _stalls(caplog)


def test_learner_train_s_closing_line_counts_the_stalled_steps_by_server() -> None:
    from learner.cli import _faults_line

    replicas = {"local-0": {"stalls": 0}, "local-1": {"stalls": 3}, "10.0.0.5:50051": {"stalls": 1}}
    assert _faults_line({"total_steps": 100, "replicas": replicas}) == (
        "faults: 4 stalled steps (local-1 3, 10.0.0.5:50051 1)"
    )
    assert _faults_line({"total_steps": 100, "replicas": {"local-0": {"stalls": 0}}}) == ""
    assert _faults_line({"total_steps": 100, "failures": 1, "replicas": {"local-1": {"stalls": 1}}}) == (
        "faults: 1 server failure, 1 stalled step (local-1 1)"
    )


@pytest.mark.slow
def test_a_server_lost_past_its_deadline_makes_no_stall_of_a_step_socket_server_that_answered(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paused TCP server, lost at its step deadline: the answer of the other server, on a step socket,
    was taken in only after that wait, and the healthy server was warned of and counted as stalled."""
    monkeypatch.setattr(faults, "STALL", (0.5, 10.0, 3.0))
    with (
        LocalServers("CartPole-v1", 1, 2, transport="tcp") as tcp,
        LocalServers("CartPole-v1", 1, 2, transport="unix") as unix,
        RemoteVectorEnv([*tcp.addresses, *unix.addresses], fault_tolerant=True, timeout=1.0) as envs,
        caplog.at_level(logging.WARNING),
    ):
        envs.reset(seed=0)
        for _ in range(30):
            envs.step(ACTIONS)
        timer = _paused(tcp.pids[0], 3.0)
        try:
            _, _, _, _, infos = envs.step(ACTIONS)
        finally:
            timer.cancel()
            os.kill(tcp.pids[0], signal.SIGCONT)
        assert infos["env_unavailable"].tolist() == [True, True, False, False]  # (the TCP server lost)
        counted = {r.address: r.stalls for r in envs.replica_stats()}
    assert counted == {tcp.addresses[0]: 0, unix.addresses[0]: 0}, counted
    assert not _stalls(caplog), _stalls(caplog)


@pytest.mark.slow
def test_a_tcp_server_that_stalls_beside_a_step_socket_server_is_the_one_named_and_timed_so(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A paused TCP server that answers late, in a step of a step-socket server too: the step socket's
    answer is taken in as it comes, not once the gRPC step's wait is over; its latency was the paused
    server's, and it was named as stalled (counted too) for it."""
    monkeypatch.setattr(faults, "STALL", (1.0, 10.0, 60.0))
    with (
        LocalServers("CartPole-v1", 1, 2, transport="unix") as unix,
        LocalServers("CartPole-v1", 1, 2, transport="tcp") as tcp,
        RemoteVectorEnv([*unix.addresses, *tcp.addresses], timeout=60.0) as envs,
        caplog.at_level(logging.WARNING),
    ):
        assert [bool(c.step_socket) for c in envs._clients] == [True, False]
        envs.reset(seed=0)
        for _ in range(30):
            envs.step(ACTIONS)
        envs.replica_stats(reset=True)
        timer = _paused(tcp.pids[0], 2.5)
        envs.step(ACTIONS)  # (answered by both)
        timer.join()
        stats = {r.address: r for r in envs.replica_stats()}
        named = label_of(tcp.addresses[0])  # (as the learner's lines name it while it runs)
    healthy, paused = unix.addresses[0], tcp.addresses[0]
    assert stats[paused].latency_max_ms > 2000, stats[paused]
    assert stats[healthy].latency_max_ms < 1000, stats[healthy]  # (a few ms, unless the machine is loaded)
    assert {address: s.stalls for address, s in stats.items()} == {healthy: 0, paused: 1}
    (said,) = _stalls(caplog)
    assert re.match(rf"env server {re.escape(named)} took \d+\.\d s to answer a step", said), said


@pytest.mark.slow
def test_a_stall_in_a_step_in_which_another_server_failed_at_once_is_named(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server killed (its connections reset: a loss long before the step's deadline) in the step a
    paused server answers late: the stall is named and counted (a step in which a server was lost was
    no stall of any, as a loss at the deadline made healthy step-socket servers' answers late)."""
    monkeypatch.setattr(faults, "STALL", (1.0, 10.0, 60.0))
    with (
        LocalServers("CartPole-v1", 1, 2, transport="unix", restarts=0) as killed,
        LocalServers("CartPole-v1", 1, 2, transport="tcp") as tcp,
        RemoteVectorEnv([*killed.addresses, *tcp.addresses], fault_tolerant=True, timeout=60.0) as envs,
        caplog.at_level(logging.WARNING),
    ):
        envs.reset(seed=0)
        for _ in range(30):
            envs.step(ACTIONS)
        os.kill(killed.pids[0], signal.SIGSTOP)  # (killed while its step is in flight, as the fleet waits)
        killing = threading.Timer(0.5, os.kill, (killed.pids[0], signal.SIGKILL))
        killing.start()
        timer = _paused(tcp.pids[0], 2.5)
        _, _, _, _, infos = envs.step(ACTIONS)
        killing.join()
        timer.join()
        assert infos["env_unavailable"].tolist() == [True, True, False, False]  # (the killed server lost)
        counted = {r.address: r.stalls for r in envs.replica_stats()}
        named = label_of(tcp.addresses[0])  # (as the learner's lines name it while it runs)
    assert counted == {killed.addresses[0]: 0, tcp.addresses[0]: 1}, counted
    (said,) = _stalls(caplog)
    assert re.match(rf"env server {re.escape(named)} took \d+\.\d s to answer a step", said), said


def test_the_lines_about_a_server_that_keeps_stalling_come_further_apart() -> None:
    """A server that stalls every few seconds for an hour (an overloaded host) was said to once a minute, 60 lines
    an hour: once its stalls have gone on for longer than three periods, the gap is a third of that time, up to 10
    minutes (faults.reminder_gap), 12 lines; stalls a period apart or more begin anew (a line at the next)."""
    clock = [1000.0]
    fleet = SimpleNamespace(_stalls={})
    timer = StepTimer("127.0.0.1:1", 4)
    for _ in range(faults.STALL_BASELINE):
        timer.record(latency_s=0.001, env_s=0.0005)
    timer.record(latency_s=2.0, env_s=0.0005)  # (a stall: every step below is judged with it)
    lines: list[float] = []
    with (
        mock.patch.object(remote.time, "monotonic", lambda: clock[0]),
        mock.patch.object(remote.log, "warning", lambda *args: lines.append(clock[0])),
    ):
        for _ in range(720):  # (a stall every 5 s for an hour)
            RemoteVectorEnv._note_stall(fleet, timer, 2.0)  # type: ignore[arg-type]
            clock[0] += 5.0
        assert len(lines) == 12, [round(t - 1000) for t in lines]
        assert [round(b - a) for a, b in itertools.pairwise(lines[:4])] == [60, 60, 60]
        clock[0] += 120.0  # (two minutes without a stall: the next begins anew, said at once)
        RemoteVectorEnv._note_stall(fleet, timer, 2.0)  # type: ignore[arg-type]
        clock[0] += 5.0
        RemoteVectorEnv._note_stall(fleet, timer, 2.0)  # type: ignore[arg-type]
    assert len(lines) == 13
