"""What a fleet leaves behind: nothing of its calls on its loop after close(), no zombie of a dead local
server, and a server's shutdown mid-run said at WARNING."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from learner import LocalServers, RemoteVectorEnv
from learner.loop import LoopRunner
from tests.conftest import SpawnServer, StartServers, needs_proc

K = 2  # envs per server


def _pending(loop: asyncio.AbstractEventLoop) -> set[asyncio.Task[object]]:
    return {t for t in asyncio.all_tasks(loop) if not t.done()}


def _name(task: asyncio.Task[object]) -> str:
    return str(getattr(task.get_coro(), "__qualname__", task))


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_closed_fleet_leaves_no_task_of_its_calls_on_its_loop(start_servers: StartServers, transport: str) -> None:
    """close() cancels the step stream and the Hold stream; gRPC ends each cancelled call in a task of its
    own when the loop next takes in gRPC's events. Was: in 1 close of 7-14, one of them (and its server's
    connection) was still pending when close() returned, until the thread's next call ran the loop."""
    addresses = start_servers("CartPole-v1", 2, K, transport=transport)
    runner = LoopRunner.for_this_thread()
    runner.run(asyncio.sleep(0.1))  # (what earlier tests left to this thread's loop ends first)
    loop = runner.loop
    left: list[str] = []
    for _ in range(40):
        before = _pending(loop)  # (another test's, on this thread's loop: not this fleet's)
        envs = RemoteVectorEnv(addresses)
        envs.reset(seed=0)
        for _ in range(3):
            envs.step(np.zeros(2 * K, dtype=np.int64))
        envs.close()
        left += [_name(t) for t in _pending(loop) - before]
    assert left == [], left


def _state(pid: int) -> str | None:
    """The State line of /proc/<pid>/status ("Z (zombie)", say); None once the process is reaped."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return None
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("State:")), "?")


@needs_proc
def test_a_local_server_that_dies_without_restarts_is_reaped_while_the_fleet_stays_open(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """restarts=0: a server killed while the fleet is open is not started again, and nothing more is said of
    it than before; but it is reaped as it is noticed, not left a zombie until close()."""
    with (
        caplog.at_level(logging.INFO, logger="learner.local"),
        LocalServers("CartPole-v1", 2, K, restarts=0) as servers,
        RemoteVectorEnv(servers.addresses, fault_tolerant=True, backoff=(0.05, 0.5)) as envs,
    ):
        envs.reset(seed=0)
        pids = servers.pids
        said = len(caplog.records)
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _state(pids[1]) is not None:
            assert time.monotonic() < deadline, f"server {pids[1]} not reaped within 10 s: {_state(pids[1])}"
            envs.step(np.zeros(2 * K, dtype=np.int64))  # (the fleet goes on without it)
            time.sleep(0.05)
        assert servers.pids == pids and _state(pids[0]) not in (None, "Z (zombie)")  # not started again
        infos = envs.step(np.zeros(2 * K, dtype=np.int64))[4]
        assert infos["_env_unavailable"][K:].all()
        assert [r.getMessage() for r in caplog.records[said:] if r.name == "learner.local"] == []


def test_a_server_that_shuts_down_mid_run_is_warned_of(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A server stopped with SIGTERM mid-run (it says so) takes its envs away until it is back: a WARNING,
    as a lost server's, not an INFO line that only the final faults line would echo. Our own close says
    nothing of the kind."""
    caplog.set_level(logging.INFO, logger="learner")
    stopped = spawn_server("CartPole-v1", K)
    other = spawn_server("CartPole-v1", K)
    with RemoteVectorEnv([stopped.address, other.address], fault_tolerant=True, backoff=(0.05, 0.5)) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(2 * K, dtype=np.int64))
        assert stopped.kill(signal.SIGTERM) == 0
        deadline = time.monotonic() + 10
        while envs.fault_stats().shutdowns == 0:
            assert time.monotonic() < deadline, "the shutdown was not noticed within 10 s"
            envs.step(np.zeros(2 * K, dtype=np.int64))
        assert envs.fault_stats().failures == 0
    said = [r for r in caplog.records if "shut down (it said so" in r.getMessage()]
    assert [(r.levelno, r.getMessage().split(";")[0]) for r in said] == [
        (logging.WARNING, f"env server {stopped.address} shut down (it said so: a scale-down or a restart, say)")
    ]
