"""Envs for tests/test_env_thread.py: envs whose state is bound to the thread that made it, which the
server must call from one thread (its env thread) where they say so (metadata["envfleet_one_thread"]) or
render; and a vector env whose step raises a BaseException that is no Exception."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from typing import Any

import gymnasium as gym
import numpy as np


class ThreadRecorder(gym.Env[np.ndarray, np.int64]):
    """Says in its infos the thread (``threading.get_ident()``) that built it ("made_on") and the one that
    runs each reset and step ("on"); steps ``slow_from`` to ``slow_to`` (counted from 1 over the env's life)
    sleep ``slow_s`` (slow enough for the server to await them, the loop free)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, slow_from: int = 0, slow_to: int = 0, slow_s: float = 0.02, one_thread: bool = True) -> None:
        self.metadata = {**self.metadata, "envfleet_one_thread": one_thread}
        self.made_on = threading.get_ident()
        self.slow_from, self.slow_to, self.slow_s = slow_from, slow_to, slow_s
        self.steps = 0

    def _info(self) -> dict[str, Any]:
        return {"made_on": self.made_on, "on": threading.get_ident()}

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        return np.zeros(1, np.float32), self._info()

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        if self.slow_from <= self.steps <= self.slow_to:
            time.sleep(self.slow_s)
        return np.zeros(1, np.float32), 1.0, False, False, self._info()


def pixel_pendulum() -> gym.Env[Any, Any]:
    """MuJoCo's InvertedPendulum seen through its 64x64 frames (rendered with ``MUJOCO_GL``: under egl, the
    context is current on the thread that made it, and frames rendered on another are all zeros)."""
    env = gym.make("InvertedPendulum-v5", render_mode="rgb_array", width=64, height=64)
    return gym.wrappers.AddRenderObservation(env, render_only=True)


class SqliteEnv(gym.Env[np.ndarray, np.int64]):
    """Keeps its state in an sqlite3 database it opens in reset (a connection may only be used by the
    thread that made it); a step that runs on another thread raises ProgrammingError."""

    observation_space = gym.spaces.Box(0.0, 1e6, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, one_thread: bool = True) -> None:
        self.metadata = {**self.metadata, "envfleet_one_thread": one_thread}
        self.db: sqlite3.Connection | None = None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        if self.db is not None:
            self.db.close()
        self.db = sqlite3.connect(":memory:")
        self.db.execute("CREATE TABLE steps (action INTEGER)")
        return np.zeros(1, np.float32), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        assert self.db is not None
        self.db.execute("INSERT INTO steps VALUES (?)", (int(action),))
        (count,) = self.db.execute("SELECT COUNT(*) FROM steps").fetchone()
        return np.array([count], np.float32), 1.0, False, False, {}

    def close(self) -> None:
        if self.db is not None:
            self.db.close()


class AsyncClientEnv(gym.Env[np.ndarray, np.int64]):
    """Steps through an async client of its own (``asyncio.run`` in each step, as an env that talks to a
    remote simulator might): which cannot run inside a running event loop."""

    observation_space = gym.spaces.Box(0.0, 1e6, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self) -> None:
        self.metadata = {**self.metadata, "envfleet_one_thread": True}
        self.steps = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.steps = 0
        return np.zeros(1, np.float32), {}

    async def _remote_step(self) -> int:
        await asyncio.sleep(0)
        return self.steps + 1

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.steps = asyncio.run(self._remote_step())
        return np.array([self.steps], np.float32), 1.0, False, False, {}


class EnvsOwnError(BaseException):
    """An env's own BaseException that is no Exception."""


class RaisingVectorEnv(gym.vector.VectorEnv[np.ndarray, np.ndarray, np.ndarray]):
    """A vector env of its own (``--vectorization vector_entry_point``: no IsolateErrors catches what its step
    raises) whose step ``raise_at`` (counted from 1 after each reset) raises ``error``: "cancelled" an
    asyncio.CancelledError, "own" an EnvsOwnError, "exit" a GeneratorExit."""

    def __init__(self, num_envs: int = 1, raise_at: int = 3, error: str = "cancelled", **kwargs: Any) -> None:
        self.metadata = {"autoreset_mode": gym.vector.AutoresetMode.NEXT_STEP}
        self.num_envs = num_envs
        self.raise_at, self.error = raise_at, error
        self.single_observation_space = gym.spaces.Box(0.0, 1e6, (1,), np.float32)
        self.single_action_space = gym.spaces.Discrete(2)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)
        self.steps = 0

    def reset(
        self, *, seed: int | list[int] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        self.steps = 0
        return np.zeros((self.num_envs, 1), np.float32), {}

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        self.steps += 1
        if self.steps == self.raise_at:
            if self.error == "cancelled":
                raise asyncio.CancelledError("the simulator's client was cancelled")
            if self.error == "exit":
                raise GeneratorExit("the simulator's stream ended")
            raise EnvsOwnError("the simulator gave up")
        n = self.num_envs
        obs = np.full((n, 1), self.steps, np.float32)
        return obs, np.ones(n), np.zeros(n, np.bool_), np.zeros(n, np.bool_), {}


gym.register("ThreadEnvsRaising-v0", vector_entry_point=RaisingVectorEnv)
