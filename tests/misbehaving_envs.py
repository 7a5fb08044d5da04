"""Envs that break gymnasium's Env API, served in tests/test_misbehaving_envs.py (after a reviewer's envs): each does
one thing wrong, from step 2 on where it is about step (a first step that works shows the server serves on)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import gymnasium as gym
import numpy as np

BOX = gym.spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)


class Base(gym.Env[Any, Any]):
    observation_space = BOX
    action_space = gym.spaces.Discrete(2)

    def __init__(self) -> None:
        self.t = 0
        self.seed: int | None = None

    def obs(self) -> Any:
        return np.zeros(2, np.float32)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        self.t, self.seed = 0, seed
        return self.obs(), {}

    def step(self, action: Any) -> Any:
        self.t += 1
        return self.obs(), 1.0, self.t >= 5, False, {}


class MyBaseError(BaseException):
    """An env's own BaseException."""


RAISED: dict[str, BaseException] = {
    "cancelled": asyncio.CancelledError(),
    "generator_exit": GeneratorExit(),
    "own": MyBaseError("custom"),
}


class StepRaisesBase(Base):
    """Its step raises a BaseException (``what``: a key of RAISED) from step 2 on."""

    def __init__(self, what: str = "own") -> None:
        super().__init__()
        self.what = what

    def step(self, action: Any) -> Any:
        if self.t >= 1:
            raise RAISED[self.what]
        return super().step(action)


class ResetRaisesBase(Base):
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        raise asyncio.CancelledError()


class StepInfoNotDict(Base):
    """Its step's info is a list (or a str) from step 2 on."""

    def __init__(self, info: str = "list") -> None:
        super().__init__()
        self.info = info

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, info = super().step(action)
        if self.t >= 2:
            info = [1, 2] if self.info == "list" else "oops"
        return obs, reward, terminated, truncated, info


class ResetInfoNotDict(Base):
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        return super().reset(seed=seed)[0], [1, 2]


class OldGymReset(Base):
    """The old gym API's reset: the observation alone (of shape (2,): unpacked, it was taken for obs and info)."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        self.t = 0
        return self.obs()


class OldGymStep(Base):
    """The old gym API's step: (obs, reward, done, info)."""

    def step(self, action: Any) -> Any:
        self.t += 1
        return self.obs(), 1.0, self.t >= 5, {}


class InfoTypesDiffer(Base):
    """Envs reset with an even seed have int info values, odd ones str: gymnasium's vector env fails the step
    storing them (a str into the ints' array), in its step_wait, past the isolation of each env."""

    def step(self, action: Any) -> Any:
        obs, reward, terminated, truncated, _ = super().step(action)
        return obs, reward, terminated, truncated, {"x": 1 if (self.seed or 0) % 2 == 0 else "a"}


class StepExits(Base):
    """Its step ends its process (os._exit) at step 2: an async worker gone without a word."""

    def step(self, action: Any) -> Any:
        if self.t >= 1:
            os._exit(7)
        return super().step(action)


class SpaceChanges(Base):
    """Its reset sets a new observation_space (and returns an observation of it)."""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        super().reset(seed=seed)
        self.observation_space = gym.spaces.Box(-1.0, 1.0, shape=(3,), dtype=np.float32)
        return np.zeros(3, np.float32), {}


class ObsNone(Base):
    def obs(self) -> Any:
        return None


class ObsDict(Base):
    def obs(self) -> Any:
        return {"a": np.zeros(2, np.float32)}


class NoneSpace(Base):
    observation_space = None  # type: ignore[assignment]


class NoneActionSpace(Base):
    action_space = None  # type: ignore[assignment]


class NeedsArgs(Base):
    def __init__(self, size: int) -> None:
        super().__init__()


def _helper(a: int, b: int) -> int:
    return a + b


class HelperMissesAnArgument(Base):
    """Its constructor's own call misses an argument: no constructor argument of the env's is missing."""

    def __init__(self) -> None:
        super().__init__()
        _helper(1)  # type: ignore[call-arg]


class BuildCancelled(Base):
    def __init__(self) -> None:
        super().__init__()
        raise asyncio.CancelledError()


class CloseRaises(Base):
    def close(self) -> None:
        raise RuntimeError("close failed")


class StepSegfaults(Base):
    """Its step reads address 0 (a segfault in native code) at step 2."""

    def step(self, action: Any) -> Any:
        if self.t >= 1:
            import ctypes

            ctypes.string_at(0)
        return super().step(action)
