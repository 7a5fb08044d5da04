"""learner.video: recording an episode as a GIF, its timing and its errors (the CLI's in test_cli)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from learner import video
from learner.envs import FleetSpec


def clock(length: int = 3, env: str = "tests.envs:ClockEnv", **kwargs: object) -> FleetSpec:
    """One in-process ClockEnv made to render (a 6x8 frame per step)."""
    env_kwargs = {"length": length, "render_mode": "rgb_array", **kwargs} if env.endswith("ClockEnv") else kwargs
    return FleetSpec(env=env, backend="gym", num_servers=1, envs_per_server=1, env_kwargs=env_kwargs)


@pytest.mark.parametrize(
    ("fps", "every", "delay_cs"),
    [
        (10, 1, 10),
        (50, 1, 2),
        (30, 1, 3),  # (33.3 fps: a GIF counts in hundredths)
        (125, 5, 4),  # MuJoCo's Hopper: every 5th frame, 4 hundredths: real time
        (67, 2, 3),  # Humanoid: every 2nd
        (60, 3, 5),
        (1000, 20, 2),
        (0.01, 1, 10_000),
    ],
)
def test_gif_timing_plays_in_real_time_within_what_a_gif_can_show(fps: float, every: int, delay_cs: int) -> None:
    assert video.gif_timing(fps) == (every, delay_cs)


def test_a_fast_env_keeps_every_kth_frame(tmp_path: Path) -> None:
    from PIL import GifImagePlugin, Image

    recorded = video.record_episode(clock(10), lambda obs: [0], 0, tmp_path / "fast.gif", 125.0)
    assert (recorded["steps"], recorded["keep_every"]) == (10, 5)
    with Image.open(tmp_path / "fast.gif") as image:
        assert isinstance(image, GifImagePlugin.GifImageFile)  # (n_frames: a multi-frame format's)
        assert (image.n_frames, image.info["duration"]) == (3, 40)  # frames 0, 5, 10 (the last: always)


def test_an_episode_too_long_is_cut(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(video, "MAX_STEPS", 2)
    recorded = video.record_episode(clock(5), lambda obs: [0], 0, tmp_path / "cut.gif", None)
    assert (recorded["steps"], recorded["episode_ended"]) == (2, False)


def test_an_env_that_cannot_render_or_other_spaces_say_why(tmp_path: Path) -> None:
    spec = clock(env="tests.envs:SlowToBuildEnv", build_s=0, render_mode="rgb_array")  # takes no render_mode
    with pytest.raises(ValueError, match=r"video: rendering tests.envs:SlowToBuildEnv \(render_mode='rgb_array'\)"):
        video.record_episode(spec, lambda obs: [0], 0, tmp_path / "never.gif", None)
    with pytest.raises(ValueError, match=r"video: tests\.envs:ClockEnv made here has observations Box"):
        video.record_episode(clock(), lambda obs: [0], 0, tmp_path / "never.gif", None, spaces=("Box(0, 1)", "x"))
    assert not (tmp_path / "never.gif").exists()


def test_paths_and_speeds_that_cannot_be_written_are_refused(tmp_path: Path) -> None:
    assert video.check_path(tmp_path / "a" / "b" / "ep.GIF") == tmp_path / "a" / "b" / "ep.GIF"
    assert not (tmp_path / "a").exists()  # (made when the GIF is written)
    (tmp_path / "notes.txt").write_text("a file\n")
    for bad, message in [
        ("ep.mp4", "expected a file name ending in .gif"),
        (".gif", "expected a file name ending"),
        ("ep.gif/", "expected a file name ending"),
        ("notes.txt/x/ep.gif", "notes.txt' is a file, not a folder"),
    ]:
        with pytest.raises(ValueError, match=message):
            video.check_path(f"{tmp_path}/{bad}")
    for fps in (0, -1, 0.001, 2000, float("nan")):
        with pytest.raises(ValueError, match=r"video_fps: expected frames per second in \[0.002, 1000\]"):
            video.check_fps(fps)


def test_a_still_scene_is_one_frame_shown_longer_within_what_a_gif_can_hold(tmp_path: Path) -> None:
    """Identical frames in a row become one frame shown as long as they all were, at most 655.35 s a
    frame (a GIF's limit: Pillow would overflow on more)."""
    from PIL import Image, ImageSequence

    recorded = video.record_episode(clock(4, still=True), lambda obs: [0], 0, tmp_path / "still.gif", 0.002)
    assert recorded["steps"] == 4
    with Image.open(tmp_path / "still.gif") as image:
        assert [frame.info["duration"] for frame in ImageSequence.Iterator(image)] == [655_350]


def test_frames_other_than_uint8_are_refused_unless_within_its_range(tmp_path: Path) -> None:
    """Cast to uint8, a float frame of 0-1 made a black GIF (0.5 -> 0) and an integer one beyond 255 another
    picture (300 -> 44), without a word; integers (and floats) within 0-255 are the same picture."""
    from PIL import Image

    def frames(kind: str) -> FleetSpec:
        return clock(env="tests.eval_envs:FramesEnv", frames=kind, length=3, render_mode="rgb_array")

    gif = tmp_path / "ep.gif"
    with pytest.raises(
        ValueError,
        match=r"^video: tests\.eval_envs:FramesEnv rendered a frame of float64 \(values 0\.5 to 0\.5\) with "
        r"render_mode='rgb_array', not an RGB frame of uint8 values 0-255 \(floats of 0-1 would be written black: have render return ",
    ):
        video.record_episode(frames("float"), lambda obs: [0], 0, gif, None)
    with pytest.raises(ValueError, match=r"rendered a frame of int64 \(values 300 to 300\) with render_mode="):
        video.record_episode(frames("wide"), lambda obs: [0], 0, gif, None)
    assert not gif.exists()
    for kind in ("int", "float255"):
        assert video.record_episode(frames(kind), lambda obs: [0], 0, gif, None)["steps"] == 3
        with Image.open(gif) as image:
            image.seek(3)  # (frame t of ClockEnv's is 50 t bright)
            assert image.convert("RGB").getpixel((0, 0)) == (150, 150, 150)


def test_a_path_on_a_read_only_file_system_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """(Said "permission denied", which sent one to chmod; root, whom no permission stops, got it too.)"""
    monkeypatch.setattr(video.os, "access", lambda *args, **kwargs: False)
    with pytest.raises(ValueError, match=r"ep\.gif': permission denied$"):
        video.check_path(tmp_path / "ep.gif")
    read_only = SimpleNamespace(f_flag=os.ST_RDONLY)
    monkeypatch.setattr(video.os, "statvfs", lambda path: read_only)
    with pytest.raises(ValueError, match=r"ep\.gif': read-only file system$"):
        video.check_path(tmp_path / "ep.gif")
