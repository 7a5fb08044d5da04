"""A learner that was itself stopped for a while (SIGSTOP, a suspended laptop or VM): a server lost just after
is said to be maybe fine (was: "env server X lost" alone, sending the operator to a healthy server)."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from learner import RemoteVectorEnv, pauses
from tests.conftest import SpawnServer


@pytest.mark.slow
def test_a_pause_of_this_process_is_noticed() -> None:
    """SIGSTOP and SIGCONT of a process that watches (the pause threshold lowered to 1 s)."""
    code = textwrap.dedent(
        """
        import sys, threading, time
        from learner import pauses
        pauses.PAUSE_S = 1.0
        pauses.start()
        print(pauses.own_pause(), flush=True)
        sys.stdin.readline()  # (stopped and continued meanwhile)
        time.sleep(2 * pauses.TICK_S)
        print(pauses.own_pause(), flush=True)
        pauses.stop()  # (the last user gone, the thread ends: a fork later copies no thread of ours)
        deadline = time.monotonic() + 30
        while threading.active_count() > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        print(threading.active_count(), flush=True)
        """
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.readline().strip() == "None"
        proc.send_signal(signal.SIGSTOP)
        time.sleep(3.0)  # (the pause itself: what is measured)
        proc.send_signal(signal.SIGCONT)
        proc.stdin.write("\n")
        proc.stdin.flush()
        paused = float(proc.stdout.readline())
        threads = int(proc.stdout.readline())
    assert 2.0 <= paused <= 60.0, paused
    assert threads == 1


def test_a_pause_going_on_as_a_loss_is_said_counts_before_the_watcher_has_woken(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a SIGCONT the thread that meets the loss may run before the watcher: the pause is then the
    watcher's lateness now."""
    monkeypatch.setattr(pauses, "_watcher", object())  # (as while a fleet is open)
    monkeypatch.setattr(pauses, "_last_tick", pauses._now() - 20.0)
    paused = pauses.own_pause()
    assert paused is not None and paused >= 19.0
    monkeypatch.setattr(pauses, "_last_tick", pauses._now())
    assert pauses.own_pause() is None


def test_a_pause_asked_of_within_a_call_s_time_is_one_that_ended_then(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step stall is this learner's own only where its pause ended during the step: one 30 s before is no
    cause of it (it was said to be, for a minute after any pause)."""
    monkeypatch.setattr(pauses, "_last_pause", (6.0, pauses._now() - 30.0))
    assert pauses.own_pause() == 6.0 and pauses.own_pause(within=2.0) is None
    monkeypatch.setattr(pauses, "_last_pause", (6.0, pauses._now() - 1.0))
    assert pauses.own_pause(within=2.0) == 6.0


def test_a_server_lost_right_after_a_pause_of_this_learner_is_said_to_be_maybe_fine(
    spawn_server: SpawnServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    server = spawn_server("CartPole-v1", 2)
    with RemoteVectorEnv([server.address], fault_tolerant=True, timeout=10.0) as envs:
        envs.reset(seed=0)
        monkeypatch.setattr(pauses, "_last_pause", (25.0, pauses._now()))  # (as the watching thread records one)
        server.kill()
        with caplog.at_level(logging.WARNING, logger="learner.remote"):
            envs.step(np.zeros(2, dtype=np.int64))
    (lost,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"env server {server.address} lost")]
    assert lost.endswith(
        "; this learner itself was held up for 25 s just before (stopped, suspended, starved of CPU, or a long call "
        "holding the interpreter): the loss may be its own, and the server fine"
    ), lost
    monkeypatch.setattr(pauses, "_last_pause", (25.0, pauses._now() - pauses.RECENT_S - 1))  # (long ago: no word)
    assert pauses.own_pause() is None
