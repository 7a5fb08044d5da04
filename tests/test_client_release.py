"""Closing a fleet releases each server's session within the call deadline, at most RELEASE_TIMEOUT."""

from __future__ import annotations

import signal
import time

import numpy as np

from learner import RemoteVectorEnv
from learner.client import RELEASE_TIMEOUT
from tests.conftest import SpawnServer


def test_close_waits_for_a_hung_server_no_longer_than_the_deadline(spawn_server: SpawnServer) -> None:
    """Was a fixed 2 s per release, whatever ``timeout`` said."""
    server = spawn_server("CartPole-v1", 2)
    envs = RemoteVectorEnv([server.address], timeout=0.3)
    envs.reset(seed=0)
    envs.step(np.zeros(2, dtype=np.int64))
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)  # (hung: its kernel still accepts the connection's bytes)
    try:
        start = time.monotonic()
        envs.close()
        assert time.monotonic() - start < min(1.5, RELEASE_TIMEOUT)
    finally:
        server.proc.send_signal(signal.SIGCONT)
