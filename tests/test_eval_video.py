"""``learner eval --video``'s GIF: written atomically, and the speed of ALE envs without the atari wrapper
(learner.video; the rest in test_video, and eval's side of it in test_eval)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from learner import video
from learner.envs import FleetSpec


def test_a_gif_that_fails_mid_write_leaves_the_previous_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk (or a file size limit, or Ctrl-C) mid-write: the GIF already there is kept whole, and no
    temporary file is left (the GIF was truncated and half written)."""
    from PIL import Image

    gif = tmp_path / "ep.gif"
    video.write_gif([np.zeros((6, 8, 3), np.uint8), np.full((6, 8, 3), 50, np.uint8)], gif, 100)
    before = gif.read_bytes()
    real_save = Image.Image.save

    def full_disk(image: Image.Image, fp: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(fp, str | os.PathLike):  # (as Pillow does with a path: opened, truncated)
            with open(fp, "wb") as f:
                f.write(b"GIF89a")
        else:
            fp.write(b"GIF89a")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Image.Image, "save", full_disk)
    with pytest.raises(ValueError, match=r"^video: cannot write '.*ep\.gif': No space left on device$"):
        video.write_gif([np.full((6, 8, 3), 100, np.uint8)], gif, 100)
    assert gif.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ep.gif"]  # (no temporary file left)
    monkeypatch.setattr(Image.Image, "save", real_save)
    video.write_gif([np.full((6, 8, 3), 100, np.uint8)], gif, 100)  # (and a write that works replaces it)
    assert gif.read_bytes() != before and sorted(p.name for p in tmp_path.iterdir()) == ["ep.gif"]


@pytest.mark.parametrize(
    ("env", "env_kwargs", "wrappers", "fps"),
    [
        ("ALE/Pong-v5", {}, (), 15.0),  # 4 frames of 60 Hz a step (its render_fps, 30, is no step rate)
        ("ALE/Pong-v5", {"frameskip": 2}, (), 30.0),
        ("ale_py:PongNoFrameskip-v4", {}, (), 60.0),
        ("ale_py:Pong-v4", {}, (), 20.0),  # a frameskip drawn from 2 to 4: 3 on average
        ("ALE/Pong-v5", {}, ("atari",), 15.0),  # the wrapper skips 4 (the env none)
    ],
)
def test_an_ale_env_plays_in_real_time_at_60_hz_over_its_frameskip(
    env: str,
    env_kwargs: dict[str, Any],
    wrappers: tuple[str, ...],
    fps: float,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("ale_py")
    monkeypatch.setattr(video, "MAX_STEPS", 1)
    spec = FleetSpec(
        env=env,
        backend="gym",
        num_servers=1,
        envs_per_server=1,
        env_kwargs={**env_kwargs, "render_mode": "rgb_array"},
        wrappers=wrappers,
    )
    recorded = video.record_episode(spec, lambda obs: [0], 0, tmp_path / "pong.gif", None)
    assert (recorded["fps"], recorded["keep_every"]) == (fps, video.gif_timing(fps)[0])
