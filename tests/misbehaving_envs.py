"""Envs that break gymnasium's Env API, served in tests/test_misbehaving_envs.py (after a reviewer's envs): each does
one thing wrong, from step 2 on where it is about step (a first step that works shows the server serves on)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from pathlib import Path
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


class OldGymPairReset(Base):
    """The old gym API's reset, of an observation that is a pair: (1, 2) of Tuple((Discrete(3), Discrete(4))) looked
    like (obs, info) with an info of type int."""

    observation_space = gym.spaces.Tuple((gym.spaces.Discrete(3), gym.spaces.Discrete(4)))  # type: ignore[assignment]

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        self.t = 0
        return (1, 2)

    def step(self, action: Any) -> Any:
        self.t += 1
        return (1, 2), 1.0, self.t >= 5, False, {}


class ResetTakesNoKeywords(Base):
    """An old gym env's reset: no seed, no options (Python's own "reset() got an unexpected keyword argument 'seed'")."""

    def reset(self) -> Any:  # type: ignore[override]
        self.t = 0
        return self.obs()


class ResetTakesNoOptions(Base):
    def reset(self, seed: int | None = None) -> Any:  # type: ignore[override]
        return super().reset(seed=seed)


class FailsInProcess(Base):
    """Served (a server's process: its argv has --parent-pid), a Base; elsewhere (a learner's, or learner check's
    worker) ``how`` at step ``at`` of its life, or in every reset with ``at`` 0: "segfault" (reads address 0),
    "exit" (os._exit(7)) or "hang" (never returns)."""

    def __init__(self, how: str = "segfault", at: int = 10) -> None:
        super().__init__()
        self.how, self.at, self.steps = how, at, 0
        self.served = "--parent-pid" in sys.argv

    def _fail(self) -> None:
        if self.served:
            return
        if self.how == "segfault":
            import ctypes

            ctypes.string_at(0)
        if self.how == "exit":
            os._exit(7)
        threading.Event().wait()

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        if self.at == 0:
            self._fail()
        return super().reset(seed=seed, options=options)

    def step(self, action: Any) -> Any:
        self.steps += 1
        if self.steps == self.at:
            self._fail()
        return super().step(action)


class ExitsOrHangs(Base):
    """At step 2, env 0 (reset with an even seed) ends its process, env 1 (odd) hangs: its step never returns."""

    def step(self, action: Any) -> Any:
        if self.t >= 1:
            if (self.seed or 0) % 2 == 0:
                os._exit(7)
            threading.Event().wait()
        return super().step(action)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie, or reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


class FailInTurn(Base):
    """At step 2 (async vectorization, 3 envs reset with seeds 0, 1, 2): env 0's process ends, so that the server's
    read of its reply fails first, and envs 2 then 1 return an observation that does not fit (their workers fail):
    env 1 only once env 2's worker has ended (its failure's report on the error queue first), by the pid env 2 wrote
    to ``path`` when it was reset."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = Path(path)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> Any:
        if seed == 2:
            self.path.write_text(str(os.getpid()))
        return super().reset(seed=seed, options=options)

    def step(self, action: Any) -> Any:
        if self.t >= 1:
            if self.seed == 0:
                os._exit(7)
            if self.seed == 1:
                deadline = time.monotonic() + 60.0
                while not _gone(int(self.path.read_text())) and time.monotonic() < deadline:
                    time.sleep(0.01)
            self.t += 1
            return np.zeros(3, np.float32), 1.0, False, False, {}
        return super().step(action)


class HoldsSetAttr(Base):
    """Its attribute ``hold``, set to ``(pid, path)``, waits (60 s at most) for a file at ``path``, having sent process
    ``pid`` SIGUSR1 first (a pid of 0: none); set to None, nothing."""

    @property
    def hold(self) -> Any:
        return None

    @hold.setter
    def hold(self, value: Any) -> None:
        if value is None:
            return
        pid, path = value
        if pid:
            os.kill(pid, signal.SIGUSR1)
        deadline = time.monotonic() + 60.0
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
