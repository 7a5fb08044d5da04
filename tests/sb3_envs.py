"""Small envs for the SB3 adapter's tests (tests/test_sb3_parity.py), served by entry point
(``tests.sb3_envs:GoalEnv``, ...) and made in process for SB3's DummyVecEnv alike."""

from __future__ import annotations

import os
import time
from typing import Any, cast

import gymnasium as gym
import numpy as np

from tests.envs import CameraClockEnv, ClockEnv

__all__ = [
    "DiscreteObsEnv",
    "Float64BoxEnv",
    "GatedGoalEnv",
    "GoalEnv",
    "GoalVectorsEnv",
    "MonitoredCartPole",
    "SwitchesEnv",
    "ZeroStartCameraEnv",
]


class GoalEnv(gym.Env[np.ndarray, np.int64]):
    """An env written for ``options=None`` when no options are given, as SB3's DummyVecEnv gives them:
    its reset reads ``options["goal"]`` when it gets options, else takes 3 (``{}`` fails, KeyError).

    Observations ``[goal, t, w]`` (``w``: the sum of ``options["w"]``, an array, where given); episodes
    last ``goal`` steps, ending by termination at an even goal, by truncation at an odd one. The reset
    info says whether options came (``got_options``) and the goal."""

    observation_space = gym.spaces.Box(0.0, 1000.0, (3,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.goal = int(options["goal"]) if options is not None else 3
        self.w = float(np.sum(options["w"])) if options is not None and "w" in options else 0.0
        self.t = 0
        return self._obs(), {"got_options": options is not None, "goal": self.goal}

    def _obs(self) -> np.ndarray:
        return np.array([self.goal, self.t, self.w], dtype=np.float32)

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.t += 1
        ended = self.t >= self.goal
        return self._obs(), 1.0, ended and self.goal % 2 == 0, ended and self.goal % 2 == 1, {"t": self.t}


class GatedGoalEnv(GoalEnv):
    """A GoalEnv whose step number ``at`` (counted over the env's life) waits while the file ``gate``
    exists (the test makes it, and removes it to let the step go on), at most ``hold_s``; so a step
    can be held as long as the test needs, every env's (none makes the gate again)."""

    def __init__(self, gate: str, at: int = 2, hold_s: float = 60.0) -> None:
        self.gate, self.at, self.hold_s = gate, at, hold_s
        self._steps = 0

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._steps += 1
        if self._steps == self.at:
            deadline = time.monotonic() + self.hold_s
            while os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.01)
        return super().step(action)


class DiscreteObsEnv(gym.Env[Any, np.int64]):
    """Discrete observations returned as Python ints, as gymnasium's own Discrete envs (FrozenLake, ...)
    return them: ``(start + t) % 5``; episodes of 3 steps, ended by termination."""

    observation_space = gym.spaces.Discrete(5)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        super().reset(seed=seed)
        self.start, self.t = int(self.np_random.integers(0, 5)), 0
        return self.start, {}

    def step(self, action: np.int64) -> tuple[int, float, bool, bool, dict[str, Any]]:
        self.t += 1
        return (self.start + self.t) % 5, 1.0, self.t >= 3, False, {}


class Float64BoxEnv(gym.Env[np.ndarray, np.int64]):
    """Declares float32 Box observations and returns float64 arrays, as many custom envs do;
    episodes of 3 steps, ended by truncation."""

    observation_space = gym.spaces.Box(-10.0, 10.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.1, 0.2]), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.t += 1
        return np.array([self.t + 0.1, 1 / 3]), 1.0, False, self.t >= 3, {}


class SwitchesEnv(gym.Env[np.ndarray, Any]):
    """MultiBinary(3) actions (``dict_actions``: inside a Dict, with a Discrete part), whose values it
    observes (float32); its step asserts the action is in its action space. Episodes of 10 steps."""

    observation_space = gym.spaces.Box(0.0, 1.0, (3,), np.float32)

    def __init__(self, dict_actions: bool = False) -> None:
        self.dict_actions = dict_actions
        switches = gym.spaces.MultiBinary(3)
        self.action_space = (
            gym.spaces.Dict({"level": gym.spaces.Discrete(2), "switches": switches}) if dict_actions else switches
        )

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(3, np.float32), {}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        assert self.action_space.contains(action), repr(action)
        self.t += 1
        switches = action["switches"] if self.dict_actions else action
        return np.asarray(switches, np.float32), float(np.sum(switches)), False, self.t >= 10, {}


def MonitoredCartPole() -> gym.Env[Any, Any]:
    """CartPole-v1 in SB3's Monitor, as an operator's factory may make it (its info["episode"] comes
    through): which no server's spec says."""
    from stable_baselines3.common.monitor import Monitor

    return Monitor(gym.make("CartPole-v1"))


class ZeroStartCameraEnv(CameraClockEnv):
    """tests.envs:CameraClockEnv (``multi``: its MultiBinary and MultiDiscrete keys too) as SB3 takes it: its
    Discrete and MultiDiscrete keys start at 0 (SB3's policies one-hot from 0: CameraClockEnv's start=1 fails
    there, as under DummyVecEnv), ``phase`` returned as a Python int, as gymnasium's Discrete envs return theirs
    (``terminal_observation`` then holds what DummyVecEnv's holds)."""

    def __init__(self, length: int = 3, multi: bool = False) -> None:
        super().__init__(length=length, multi=multi)
        spaces = cast(gym.spaces.Dict, self.observation_space).spaces
        spaces["phase"] = gym.spaces.Discrete(2)
        if multi:
            spaces["gear"] = gym.spaces.MultiDiscrete([3, 4])

    def _obs(self) -> Any:
        obs = super()._obs()
        obs["phase"] = int(obs["phase"]) - 1
        if self.multi:
            obs["gear"] = obs["gear"] - np.array([1, 0])
        return obs


class GoalVectorsEnv(ClockEnv):
    """A goal env's Dict of vectors only (SB3's VecFrameStack stacks Box keys alone): ``observation`` (float32, 3),
    ``achieved_goal`` (float64, 2: a dtype the wire keeps) and ``desired_goal`` (float32, 2), from ClockEnv's time;
    its episodes, actions and rewards are ClockEnv's (truncated after ``length`` steps)."""

    def __init__(self, length: int = 4) -> None:
        super().__init__(length=length)
        self.observation_space = gym.spaces.Dict(  # type: ignore[assignment]
            {
                "observation": gym.spaces.Box(-1.0, 1.0, (3,), np.float32),
                "achieved_goal": gym.spaces.Box(-1.0, 1.0, (2,), np.float64),
                "desired_goal": gym.spaces.Box(-1.0, 1.0, (2,), np.float32),
            }
        )

    def _obs(self) -> Any:
        late, early = super()._obs()
        return {
            "observation": np.array([late, early, 0.5], dtype=np.float32),
            "achieved_goal": np.array([late, -early / 3], dtype=np.float64),
            "desired_goal": np.array([0.25, 0.5], dtype=np.float32),
        }
