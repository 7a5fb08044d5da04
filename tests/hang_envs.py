"""Envs for the server's watchdog and start tests (tests/test_server_watchdog.py, test_foreign_client.py):
one whose step hangs after quick ones, one whose observations are too large to send."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np


class HangLater(gym.Env[np.ndarray, np.int64]):
    """Quick steps (so the server runs them on its event loop) until step ``hang_at`` of the process,
    which never returns (it sleeps, as a stuck robot's driver would); with ``once`` (a file path), only
    where that file does not exist yet (the hang creates it), so a restarted server serves on. With
    ``raise_in_close``, its close raises."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, hang_at: int = 3, once: str | None = None, raise_in_close: bool = False) -> None:
        self.hang_at, self.once, self.raise_in_close = hang_at, once, raise_in_close
        self.steps = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        if self.steps == self.hang_at and not (self.once is not None and os.path.exists(self.once)):
            if self.once is not None:
                open(self.once, "w").close()
            self.hang()
        return np.zeros(1, np.float32), 1.0, False, False, {}

    def hang(self) -> None:
        while True:
            time.sleep(0.05)

    def close(self) -> None:
        if self.raise_in_close:
            raise RuntimeError("the simulator's connection could not be closed")


class HangHoldingTheGil(HangLater):
    """A HangLater whose hang is native code that holds the GIL for ``stretch_s`` at a time (sum over a range,
    sized at the start of the hang), letting other threads run between stretches only: the watchdog wakes late
    at each, the process busy meanwhile."""

    def __init__(self, hang_at: int = 3, stretch_s: float = 2.0) -> None:
        super().__init__(hang_at)
        self.stretch_s = stretch_s

    def hang(self) -> None:
        begun = time.perf_counter()
        sum(range(2_000_000))
        size = int(2_000_000 * self.stretch_s / max(time.perf_counter() - begun, 1e-6))
        while True:
            sum(range(size))


class HugeObservations(gym.Env[np.ndarray, np.int64]):
    """Observations of ``mib`` MiB each (16: 4 of them leave an answer no room under the largest
    message; 33: one fits, and its spec too, its bounds 0 and 255 sent as one value each to learners that
    read compact bounds, not at full shape as to older ones, twice that); ``uniform`` False: a low bound of 1
    in one element and a high bound of 254 in another (33 MiB: one observation fits, not the spec, whose bounds
    go at full shape); ``shape``, where given, instead of ``mib``'s (a camera's [1080, 1920, 3]: the README's figures
    of a server's memory); observations within the bounds."""

    action_space = gym.spaces.Discrete(2)
    observation_space: gym.spaces.Box

    def __init__(self, mib: int = 16, uniform: bool = True, shape: Sequence[int] | None = None) -> None:
        shape = (mib, 1024, 1024) if shape is None else tuple(shape)
        low, high = np.zeros(shape, np.uint8), np.full(shape, 255, np.uint8)
        if not uniform:
            low[0, 0, 0], high[-1, -1, -1] = 1, 254
        self.observation_space = gym.spaces.Box(low, high, dtype=np.uint8)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return self.observation_space.low.copy(), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        return self.observation_space.low.copy(), 0.0, False, False, {}
