"""Envs for the server's lifecycle tests (tests/test_server_lifecycle.py): builds that take as long as
a test says, in the server's process or in async vectorization's workers only; a constructor that
raises SystemExit or KeyboardInterrupt; an env that leaves a non-daemon thread running; an env that starts a
program of its own (a simulator's process)."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import threading
import time
import weakref
from typing import Any

import gymnasium as gym
import numpy as np

# Longest a build waits for its release file (a test that failed before creating it leaves no build behind).
_WAIT_LIMIT_S = 300.0


class Lifecycle(gym.Env[np.ndarray, np.int64]):
    """A quick env. Its constructor, in order:

    - appends its process id to the file ``building`` (when given);
    - with ``wait_for`` (a file path), waits until that file exists, in the process ``where`` says:
      ``"any"``, ``"server"`` (the server's own process: the env a sync server builds, or the one an
      async server builds first in its own process) or ``"workers"`` (async vectorization's workers);
    - raises ``raise_in_init`` (``"SystemExit"``: ``SystemExit(7)``; ``"KeyboardInterrupt"``);
    - with ``leave_thread``, starts a non-daemon thread named ``sim-io`` that runs for an hour (a
      simulator's I/O thread that the env's close does not stop);
    - with ``simulator`` (a file path), in async vectorization's workers: starts ``sleep 600`` (a simulator's
      own process; the test ends it) and appends its process id to that file.
    """

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(
        self,
        building: str | None = None,
        wait_for: str | None = None,
        where: str = "any",
        raise_in_init: str | None = None,
        leave_thread: bool = False,
        simulator: str | None = None,
    ) -> None:
        if building is not None:
            with open(building, "a") as f:
                f.write(f"{os.getpid()}\n")
        in_worker = multiprocessing.parent_process() is not None
        if wait_for is not None and (where == "any" or (where == "workers") == in_worker):
            deadline = time.monotonic() + _WAIT_LIMIT_S
            while not os.path.exists(wait_for) and time.monotonic() < deadline:
                time.sleep(0.02)
        if raise_in_init == "SystemExit":
            raise SystemExit(7)
        if raise_in_init == "KeyboardInterrupt":
            raise KeyboardInterrupt
        if leave_thread:
            threading.Thread(target=time.sleep, args=(3600,), name="sim-io").start()
        if simulator is not None and in_worker:
            program = subprocess.Popen(["sleep", "600"])
            with open(simulator, "a") as f:
                f.write(f"{program.pid}\n")

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return np.zeros(1, np.float32), 1.0, False, False, {}


LIVE: weakref.WeakSet[gym.Env[Any, Any]] = weakref.WeakSet()
"""The TooLargeToSend envs of this process not garbage yet."""


class TooLargeToSend(gym.Env[np.ndarray, np.int64]):
    """Observations of 40 MiB: an answer of two (a server of 2 envs) is over the largest message, so the server
    refuses them at its start, once they are built (server._check_answer_size). Each is in :data:`LIVE` while it
    lives."""

    observation_space = gym.spaces.Box(0, 255, (40 * 1024 * 1024,), np.uint8)
    action_space = gym.spaces.Discrete(2)

    def __init__(self) -> None:
        LIVE.add(self)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return np.zeros(self.observation_space.shape, np.uint8), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return np.zeros(self.observation_space.shape, np.uint8), 0.0, False, False, {}
