"""An env that records its build and its close in a file, the Nth of them failing to build (tests/test_build_cleanup.py):
each a line, ``made N``, ``failed N`` or ``closed N``, N counting the builds of all processes (async workers' too)."""

from __future__ import annotations

import fcntl
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np


def _builds(file: Any) -> int:
    """The builds ``file`` (the record, locked) holds so far."""
    file.seek(0)
    return sum(1 for line in file.read().splitlines() if not line.startswith("closed "))


class LooseBox(gym.spaces.Box):
    """A Box whose ``==`` minds its shape and dtype only, not its bounds."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, gym.spaces.Box) and self.shape == other.shape and self.dtype == other.dtype


class OwnSpace(gym.Space[Any]):
    """A space of an env's own (gymnasium batches it as its generic kind, a Tuple of copies, and cannot tell its
    shape and dtype: is_space_dtype_shape_equiv raises NotImplementedError), equal to any other of its class."""

    def __init__(self) -> None:
        super().__init__()

    def contains(self, x: Any) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OwnSpace)


class Recorded(gym.Env[Any, Any]):
    """Build number ``fail_at`` raises; a close raises where ``close_fails`` (after it is recorded); build number
    ``obs_differs_at`` has a high bound of 2 (not 1), number ``action_differs_at`` 3 actions (not 2). ``spaces``
    "own": each env's observation space an OwnSpace; "loose": build number 1's a LooseBox (high 1), the others' a
    Box with a high bound of 2, which the LooseBox's ``==`` says are equal to it."""

    observation_space: gym.Space[Any] = gym.spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(
        self,
        record: str,
        fail_at: int,
        close_fails: bool = False,
        obs_differs_at: int = 0,
        action_differs_at: int = 0,
        spaces: str = "",
    ) -> None:
        self.record = Path(record)
        self.close_fails = close_fails
        with self.record.open("a+") as file:
            fcntl.flock(file, fcntl.LOCK_EX)
            number = _builds(file) + 1
            file.write(f"{'failed' if number == fail_at else 'made'} {number}\n")
        if number == fail_at:
            raise RuntimeError(f"build {number} fails")
        self.number = number
        if number == obs_differs_at:
            self.observation_space = gym.spaces.Box(-1.0, 2.0, shape=(2,), dtype=np.float32)
        if number == action_differs_at:
            self.action_space = gym.spaces.Discrete(3)
        if spaces == "own":
            self.observation_space = OwnSpace()
        elif spaces == "loose":
            high = 1.0 if number == 1 else 2.0
            self.observation_space = (LooseBox if number == 1 else gym.spaces.Box)(-1.0, high, (2,), np.float32)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        return np.zeros(2, np.float32), {}

    def step(self, action: Any) -> Any:
        return np.zeros(2, np.float32), 0.0, False, False, {}

    def close(self) -> None:
        with self.record.open("a") as file:
            fcntl.flock(file, fcntl.LOCK_EX)
            file.write(f"closed {self.number}\n")
        if self.close_fails:
            raise OSError(f"env {self.number} cannot close")


def records(path: Path) -> dict[str, list[int]]:
    """What ``path`` recorded: the numbers of the envs made, failed and closed (closed: one per close)."""
    found: dict[str, list[int]] = {"made": [], "failed": [], "closed": []}
    for line in path.read_text().splitlines():
        what, number = line.split()
        found[what].append(int(number))
    return found
