"""An id registered with a lambda entry point (a common idiom): its EnvSpec cannot be pickled."""

from __future__ import annotations

import gymnasium as gym

from tests.envs import ClockEnv

gym.register("LambdaClock-v0", entry_point=lambda **kwargs: ClockEnv(**kwargs), max_episode_steps=50)
