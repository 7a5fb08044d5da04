"""``learner eval --video``: one episode of a policy on an in-process env, rendered, as an animated GIF.

Frames never cross the wire (the servers serve observations, not renderings), so the env is made in
this process with ``render_mode="rgb_array"`` and the run's wrappers; the env must be installed here.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from env_server.envs import EnvBuildError
from env_server.isolation import error_phrase
from learner.envs import FleetSpec, open_fleet
from learner.errors import os_reason
from learner.rundir import atomic_write, check_name_lengths
from learner.stats import format_return

__all__ = [
    "MAX_FPS",
    "MAX_STEPS",
    "MIN_FPS",
    "check_fps",
    "check_path",
    "check_rendering",
    "gif_timing",
    "record_episode",
    "render_spec",
    "write_gif",
]

log = logging.getLogger(__name__)

MAX_STEPS = 10_000
"""Steps after which a recorded episode is cut (a policy that never fails an env without a time limit)."""

# GIF times each frame in hundredths of a second (0 to 65535), and viewers show 0 or 1 hundredth as
# 10 (browsers): 2 hundredths (50 frames per second) is the shortest delay that plays as written.
MIN_DELAY_CS = 2
MAX_DELAY_CS = 65_535
MAX_FPS = 1000.0
MIN_FPS = 0.002

ALE_HZ = 60.0
"""The Atari 2600's frame rate (NTSC), the emulator frames an ALE env steps ``frameskip`` of at a time."""
ATARI_FPS = ALE_HZ / 4
"""The atari wrapper's envs step 4 emulator frames of 60 Hz at a time: 15 steps are a second of play."""


def check_path(video: str | Path) -> Path:
    """``video`` as a GIF path that can be written (its missing folders are made when it is written),
    so that a bad path fails before any episode is played. ValueError naming ``video`` otherwise."""
    path = Path(video)
    if not path.name.lower().endswith(".gif") or path.name.lower() == ".gif" or str(video).endswith(("/", os.sep)):
        raise ValueError(f"video: writes an animated GIF; expected a file name ending in .gif, got {str(video)!r}")
    try:
        check_name_lengths(path)
    except ValueError as err:
        raise ValueError(f"video: cannot write {str(path)!r}: {err}") from None
    if path.is_dir():
        raise ValueError(f"video: {str(path)!r} is a folder; expected a file name ending in .gif")
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"video: cannot write {str(path)!r}: {str(existing)!r} is a file, not a folder")
    writable = os.access(existing, os.W_OK | os.X_OK) and (not path.exists() or os.access(path, os.W_OK))
    if not writable:
        raise ValueError(f"video: cannot write {str(path)!r}: {_why_not_writable(existing)}")
    return path


def _why_not_writable(folder: Path) -> str:
    """Why ``folder``, which os.access says cannot be written, cannot: its file system is mounted read-only
    (os.access says so for root too), or its permissions."""
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except (AttributeError, OSError):  # (no statvfs, as on Windows)
        read_only = False
    return "read-only file system" if read_only else "permission denied"


def check_fps(fps: float | None) -> float | None:
    if fps is not None and not (isinstance(fps, int | float) and MIN_FPS <= fps <= MAX_FPS):
        raise ValueError(f"video_fps: expected frames per second in [{MIN_FPS:g}, {MAX_FPS:g}], got {fps!r}")
    return fps


def gif_timing(fps: float) -> tuple[int, int]:
    """(keep every k-th frame, each kept frame's delay in hundredths of a second) that plays frames of
    ``fps`` per second near real time in a GIF. Up to 50 fps every frame is kept (30 fps: 3 hundredths,
    10 % fast: a GIF counts in hundredths); above, frames are dropped, as a GIF cannot show them
    faster: the fewest that keep the speed within 5 % (125 fps: every 5th frame, 4 hundredths each),
    else the closest of five."""
    if fps * MIN_DELAY_CS <= 100 + 1e-9:
        return 1, min(max(MIN_DELAY_CS, round(100 / fps)), MAX_DELAY_CS)
    first = math.ceil(fps * MIN_DELAY_CS / 100 - 1e-9)
    candidates = []
    for k in range(first, first + 5):
        exact = 100 * k / fps
        delay = max(MIN_DELAY_CS, round(exact))
        error = abs(delay - exact) / exact
        if error <= 0.05 + 1e-9:
            return k, delay
        candidates.append((error, k, delay))
    _, k, delay = min(candidates)
    return k, delay


def headless_rendering() -> None:
    """Where there is no display, offscreen renderers that need none (unless the user chose others):
    pygame (classic control) renders rgb_array without one but SDL complains; MuJoCo's default (glfw)
    needs one on Linux, EGL does not. Set before the envs are made: MuJoCo reads it when first imported. It
    changes the process's environment (local servers inherit it), so entry points call it (``learner eval
    --video``), not the library.

    MUJOCO_GL only on Linux: elsewhere no DISPLAY is no sign of no display (macOS and Windows have none
    of X11's variables), and MuJoCo takes egl on Linux only (elsewhere its rendering raises "invalid value
    for environment variable MUJOCO_GL")."""
    if os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"):
        return
    os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    if sys.platform.startswith("linux"):
        os.environ.setdefault("MUJOCO_GL", "egl")


def render_spec(
    env: str, env_kwargs: dict[str, Any], wrappers: Sequence[str], max_episode_steps: int | None
) -> FleetSpec:
    """The env a video is played on: one of ``env``, in this process, made with ``env_kwargs`` and
    ``render_mode="rgb_array"``, the env-server ``wrappers`` and the time limit ``max_episode_steps``
    (those of the run's envs: ``learner eval --video``'s and ``learner train --capture-video``'s)."""
    return FleetSpec(
        env=env,
        backend="gym",
        num_servers=1,
        envs_per_server=1,
        env_kwargs={**env_kwargs, "render_mode": "rgb_array"},
        wrappers=tuple(wrappers),
        max_episode_steps=max_episode_steps,
    )


def check_rendering(spec: FleetSpec, seed: int, spaces: tuple[str, str] | None = None, hint: str = "") -> None:
    """Make ``spec``'s env (a :func:`render_spec`), reset it with ``seed`` and render one frame, as
    :func:`record_episode` does first: its ValueError (``video: ...``) where the env cannot be made here
    (not installed), has other ``spaces`` than the policy's, or renders no RGB frame (no renderer: pygame,
    MuJoCo's OpenGL). ``learner train --capture-video`` asks at its start, not at its first video."""
    with _rendering(spec, spaces, hint) as envs:
        _, infos = envs.reset(seed=seed)
        _raise_env_error(infos, spec.env)
        _frame(envs.render(), spec.env)


@contextlib.contextmanager
def _rendering(spec: FleetSpec, spaces: tuple[str, str] | None, hint: str) -> Iterator[gym.vector.VectorEnv]:
    """``spec``'s env, made in this process and checked to have the policy's ``spaces`` (``hint``: see
    :func:`record_episode`), for :func:`check_rendering` and :func:`record_episode`: whatever making, stepping or
    rendering it raises in the block (mujoco.FatalError, pygame's, ...) is a ValueError ``video: rendering ... in
    this process failed: ...`` (one of this module's, ``video: ...``, as it is). (Each of the two wrote this out.)"""
    try:
        with open_fleet(spec) as envs:
            found = (str(envs.single_observation_space), str(envs.single_action_space))
            if spaces is not None and found != spaces:
                raise ValueError(
                    f"video: {spec.env} made here has observations {found[0]} and actions {found[1]}, but the "
                    f"policy was trained on {spaces[0]} and {spaces[1]}{hint}"
                )
            yield envs
    except Exception as err:
        if isinstance(err, ValueError) and str(err).startswith("video: "):
            raise
        what = f"rendering {spec.env} (render_mode='rgb_array') in this process"
        raise ValueError(f"video: {what} failed: {_reason(err)}") from err


def record_episode(
    spec: FleetSpec,
    policy: Callable[[Any], Any],
    seed: int,
    path: Path,
    fps: float | None,
    spaces: tuple[str, str] | None = None,
    stop: Callable[[], bool] | None = None,
    hint: str = "",
    *,
    write_cut: bool = True,
    on_step: Callable[[int], object] | None = None,
) -> dict[str, Any]:
    """Play one episode of ``policy`` on the one-env vector env ``spec`` (made with render_mode
    rgb_array), write its frames to ``path`` as a GIF, and say what was written. ``spaces``: the
    (observation, action) spaces the policy expects, as text (``hint``: what the error says after them
    where the env's differ, e.g. that the env kwargs the caller gave may be why). ``stop``: asked after
    each step (a Ctrl-C's :class:`~learner.progress.StopRequest`): true, the episode is cut there, and the
    frames so far are written (``episode_ended`` false). An env that raised (in-process envs isolate its
    exception: its episode ends, ``infos["env_error"]`` says why) is a ValueError naming its error, and
    nothing is written: its episode was cut short by it. ``write_cut`` false: an episode cut by ``stop`` is
    not written either (``learner train --capture-video``: a Ctrl-C leaves that video out, as it does that
    evaluation), and the result's ``path`` is None. ``on_step``: told the steps played so far, as it starts,
    before its env is made (0), and after each step (``learner train --capture-video``'s progress bar says
    the video under way)."""
    gif = _GifFrames()
    total = 0.0
    steps = 0
    done = stopped = False
    if on_step is not None:  # (as it starts: making the env, MuJoCo's GL context, may take a while)
        on_step(steps)
    with _rendering(spec, spaces, hint) as envs:
        if fps is None:
            fps = _real_time_fps(envs, spec)
        every, delay = gif_timing(fps)
        obs, infos = envs.reset(seed=seed)
        _raise_env_error(infos, spec.env)
        gif.add(_frame(envs.render(), spec.env))
        stopped = stop is not None and stop()
        while not done and not stopped and steps < MAX_STEPS:
            obs, rewards, terms, truncs, infos = envs.step(policy(obs))
            _raise_env_error(infos, spec.env)
            steps += 1
            if on_step is not None:
                on_step(steps)
            total += float(rewards[0])
            done = bool(terms[0] or truncs[0])
            stopped = stop is not None and stop()
            if steps % every == 0 or done or stopped or steps == MAX_STEPS:  # (the last frame always)
                gif.add(_frame(envs.render(), spec.env))
    if stopped and not done and not write_cut:
        log.info("video: %s left out: cut short at the stop asked for (%d steps)", path, steps)
        return {"path": None, "steps": steps, "fps": fps, "keep_every": every, "return": total, "episode_ended": False}
    gif.write(path, delay)
    cut = "" if done else ", cut short at the stop asked for" if stopped else ", cut short"
    log.info("video: %s (%d steps, return %s%s)", path, steps, format_return(total), cut)
    return {
        "path": str(path),
        "steps": steps,
        "fps": fps,
        "keep_every": every,
        "return": total,
        "episode_ended": done,
    }


def _raise_env_error(infos: dict[str, Any], env: str) -> None:
    """In-process envs isolate an env's exception (its episode ends as truncated, ``infos["env_error"]``
    says why): a video of that episode would show it ended as if it had, so fail, naming the error."""
    errors = infos.get("_env_error")
    if errors is not None and np.any(errors):
        raise ValueError(
            f"video: {env} {error_phrase(str(infos['env_error'][0]))} (in this process); no video written, as its episode "
            "was cut short by the error"
        )


def _real_time_fps(envs: gym.vector.VectorEnv, spec: FleetSpec) -> float:
    """The steps a second of ``envs``' one env in real time: with the atari wrapper 15 (4 emulator frames
    of 60 Hz a step); an ALE env without it, 60 over its ``frameskip`` (the mean of a stochastic one's:
    its ``render_fps`` is no step rate); any other, its ``render_fps`` (30 where it has none)."""
    if "atari" in spec.wrappers:
        return ATARI_FPS
    frameskip = _ale_frameskip(envs)
    if frameskip is not None:
        return ALE_HZ / frameskip
    return float(envs.metadata.get("render_fps") or 30)


def _ale_frameskip(envs: gym.vector.VectorEnv) -> float | None:
    """The emulator frames an ALE env (ale_py's AtariEnv) steps at a time: its ``frameskip``, or for a
    stochastic one ``(low, high)``, drawn from low to high - 1, their mean. None for other envs."""
    get_attr = getattr(envs, "get_attr", None)  # (Sync/AsyncVectorEnv's; not every vector env's)
    try:
        env = get_attr("unwrapped")[0] if get_attr is not None else None
    except Exception:  # (an env that says nothing of itself)
        return None
    if not type(env).__module__.startswith("ale_py"):
        return None
    frameskip = getattr(env, "_frameskip", None)
    if isinstance(frameskip, int) and frameskip > 0:
        return float(frameskip)
    if isinstance(frameskip, tuple) and len(frameskip) == 2 and 0 < frameskip[0] < frameskip[1]:
        return (frameskip[0] + frameskip[1] - 1) / 2
    return None


def _reason(err: Exception) -> str:
    reason = str(err) if isinstance(err, EnvBuildError) else f"{type(err).__name__}: {err}"
    if isinstance(err, gym.error.DependencyNotInstalled) and "pygame" in reason:
        reason += " (or pip install 'envfleet[video]')"
    if "OpenGL" in reason or type(err).__module__.startswith("mujoco"):
        reason += f" (MUJOCO_GL={os.environ.get('MUJOCO_GL', '')}; MuJoCo renders without a display with egl or osmesa)"
    return reason


def _frame(rendered: Any, env: str) -> np.ndarray:
    frame = rendered[0] if isinstance(rendered, tuple | list) and rendered else rendered
    if not (isinstance(frame, np.ndarray) and frame.ndim == 3 and frame.shape[2] in (3, 4)):
        raise ValueError(
            f"video: {env} rendered {type(frame).__name__} with render_mode='rgb_array', not an RGB frame "
            "(does it support rgb_array rendering?)"
        )
    if frame.dtype == np.uint8:
        return frame
    # (anything else cast to uint8 is no picture of it: floats of 0-1 truncate to 0, a black GIF; 300 wraps
    # to 44): integers within 0-255 are taken as they are, floats within it rounded, but for floats of 0-1
    low, high = (frame.min(), frame.max()) if frame.size and frame.dtype.kind in "iuf" else (None, None)
    if low is not None and high is not None and low >= 0 and high <= 255:
        if frame.dtype.kind in "iu":
            return frame.astype(np.uint8)
        if not 0 < high <= 1:  # (an all-black frame is one whatever the scale)
            return np.rint(frame).astype(np.uint8)
    values = f" (values {low:g} to {high:g})" if low is not None and high is not None else ""
    hint = ""
    if frame.dtype.kind == "f" and high is not None and 0 < high <= 1:
        hint = " (floats of 0-1 would be written black: have render return (255 * frame).astype(np.uint8))"
    raise ValueError(
        f"video: {env} rendered a frame of {frame.dtype}{values} with render_mode='rgb_array', not an RGB frame of "
        f"uint8 values 0-255{hint}"
    )


def _paletted(frame: np.ndarray) -> Any:
    from PIL import Image

    return Image.fromarray(np.asarray(frame, dtype=np.uint8)[..., :3]).quantize(
        colors=256, method=Image.Quantize.FASTOCTREE
    )


class _GifFrames:
    """A GIF's frames as they come: each made a 256-colour image at once (a byte per pixel, not three),
    a frame the same as the one before counted as that one shown longer."""

    def __init__(self) -> None:
        self.images: list[Any] = []
        self.counts: list[int] = []
        self._last: bytes | None = None

    def add(self, frame: np.ndarray) -> None:
        raw = np.ascontiguousarray(frame[..., :3]).tobytes()
        if raw == self._last:
            self.counts[-1] += 1
            return
        self._last = raw
        self.images.append(_paletted(frame))
        self.counts.append(1)

    def write(self, path: Path, delay_cs: int) -> None:
        """The GIF, each frame shown ``delay_cs`` hundredths of a second per time it came in a row (at
        most a GIF frame's 655.35 s: a still scene held longer plays shorter than it was)."""
        durations = [10 * min(count * delay_cs, MAX_DELAY_CS) for count in self.counts]
        write_gif(self.images, path, durations)


def write_gif(frames: Sequence[Any], path: str | Path, durations_ms: int | Sequence[int]) -> Path:
    """``frames`` (H x W x 3 or 4 uint8 arrays, or PIL images) as a looping GIF, each shown for its
    duration in milliseconds (GIF keeps hundredths of a second); the missing folders are made. Written
    atomically (a temporary file beside it, then a rename)."""
    if not frames:
        raise ValueError("video: no frames to write")
    images = [f if hasattr(f, "save") else _paletted(f) for f in frames]
    path = Path(path)
    duration = list(durations_ms) if not isinstance(durations_ms, int) else durations_ms

    def write(f: Any) -> None:
        images[0].save(f, format="GIF", save_all=True, append_images=images[1:], duration=duration, loop=0)

    try:
        # (atomically: a write that fails (a full disk, a file size limit, Ctrl-C) leaves a GIF already
        # there as it was, and no half of one)
        atomic_write(path, write)
    except OSError as err:
        raise ValueError(f"video: cannot write {str(path)!r}: {os_reason(err)}") from None
    return path
