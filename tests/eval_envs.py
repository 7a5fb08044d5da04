"""Envs for ``learner eval``'s tests (tests/test_eval.py, tests/test_video.py): one that asks the learner to
stop and then hangs, and one whose frames are of another dtype than uint8."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

from tests.envs import ClockEnv

__all__ = ["FramesEnv", "StopThenHangEnv"]


class StopThenHangEnv(ClockEnv):
    """ClockEnv whose ``signal_at``-th step (over its life) sends SIGINT to process ``signal_pid`` (the
    learner: a Ctrl-C while a step is under way), then sleeps ``hang_s`` seconds before it returns (a
    step stuck past the learner's deadline)."""

    def __init__(self, signal_pid: int = 0, signal_at: int = -1, hang_s: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.signal_pid, self.signal_at, self.hang_s = signal_pid, signal_at, hang_s
        self._steps = 0

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._steps += 1
        if self._steps == self.signal_at and self.signal_pid:
            os.kill(self.signal_pid, signal.SIGINT)
            time.sleep(self.hang_s)
        return super().step(action)


class FramesEnv(ClockEnv):
    """ClockEnv (made to render) whose frames are ``frames``: "float" (0.5, as renderers of 0-1 floats give
    them), "wide" (int64 300, beyond uint8's range), "int" (int64 within 0-255: ClockEnv's own frame), "float255"
    (float64 within 0-255: ClockEnv's own frame)."""

    def __init__(self, frames: str = "float", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.frames = frames

    def render(self) -> np.ndarray | None:
        frame = super().render()
        if frame is None:
            return None
        if self.frames == "float":
            return np.full(frame.shape, 0.5)
        if self.frames == "wide":
            return np.full(frame.shape, 300, dtype=np.int64)
        return frame.astype(np.float64 if self.frames == "float255" else np.int64)
