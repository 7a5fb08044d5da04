"""Envs for ``learner train --capture-video``'s tests (tests/test_train_video.py): one whose renderer breaks after
a number of frames (over the process's life), as a renderer that fails mid-run does."""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from tests.envs import ClockEnv

__all__ = ["RENDERED", "DitheringEnv", "NoOpenGLEnv", "RendererBreaksEnv"]

RENDERED = [0]
"""The frames RendererBreaksEnv rendered in this process (set back to 0 by a test)."""


class RendererBreaksEnv(ClockEnv):
    """ClockEnv whose ``render`` raises RuntimeError once ``frames_ok`` frames have been rendered in this process
    (all its instances together: the start's check renders one; each video renders one a step, and one more)."""

    def __init__(self, frames_ok: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.frames_ok = frames_ok

    def render(self) -> np.ndarray | None:
        if self.render_mode == "rgb_array":
            RENDERED[0] += 1
            if RENDERED[0] > self.frames_ok:
                raise RuntimeError("the renderer's context was lost")
        return super().render()


class NoOpenGLEnv(ClockEnv):
    """ClockEnv whose ``render`` fails as MuJoCo's does where its OpenGL backend cannot make a context here (MUJOCO_GL
    glfw without a display)."""

    def render(self) -> np.ndarray | None:
        if self.render_mode == "rgb_array":
            raise RuntimeError("an OpenGL platform library has not been loaded into this process")
        return super().render()


class DitheringEnv(ClockEnv):
    """ClockEnv whose ``render`` dithers its frame with the process's own random generators (Python's and NumPy's
    global ones), as a renderer may: each frame it renders moves them on."""

    def render(self) -> np.ndarray | None:
        frame = super().render()
        if frame is None:
            return None
        noise = np.random.randint(0, 2, size=frame.shape, dtype=np.uint8) * random.randint(0, 1)
        return np.asarray(frame, dtype=np.uint8) ^ noise
