"""An env whose step raises KeyboardInterrupt, as a Ctrl-C landing in a slow env's step does in the
learner's process (in a server, signals raise none: it can only be the env's own)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.envs import ClockEnv


class InterruptedEnv(ClockEnv):
    """ClockEnv whose ``at``-th step of its life raises KeyboardInterrupt."""

    def __init__(self, at: int = 2, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.at, self.steps = at, 0

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self.steps += 1
        if self.steps == self.at:
            raise KeyboardInterrupt
        return super().step(action)
