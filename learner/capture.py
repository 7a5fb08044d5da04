"""``learner train --capture-video`` (CleanRL's flag): GIFs of the policy as it learns.

One episode of the deterministic policy (the mode, as ``learner eval --video`` plays it) of the nets at each
evaluation (--eval-every: the nets and --norm-obs statistics it evaluated, reset with its seed) and of the nets the
run ends with, written to ``RUN_DIR/videos/step-<global step, 10 digits>.gif``. The env is made in this process
with ``render_mode="rgb_array"`` and the training envs' kwargs, wrappers and time limit (as the servers said
them: frames never cross the wire), by :func:`learner.video.render_spec`, as ``learner eval --video`` makes its
own; :meth:`VideoCapture.check` makes it once at the start, so that an env or renderer missing here fails
before the run dir is made, not at the first video.

Training goes on exactly as without it: the videos' env is none of training's, the policy's mode draws nothing,
and the random generators (Python's, NumPy's, torch's) are put back as they were after each video (and after
:meth:`VideoCapture.check`'s frame at the start, the run seeded already). A video that fails mid-run (its env raised, a
full disk) is said once, as a warning, and no more are recorded; training goes on.
A Ctrl-C during one stops the run as during an evaluation: that video is left out (not written), and is due in the
step's checkpoint (its counters' ``due``), which a --resume records first. An evaluation
left out (its eval server left down, or failed) is filmed all the same, its warning saying so: the video's env is
this process's, not the evaluation's, and the video is then the one look at the policy at that step.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import torch

from learner import rundir
from learner.checkpoint import capture_rng, restore_rng
from learner.config import Args, check_served_env_here
from learner.envs import FleetSpec
from learner.normalize import DictRunningMeanStd, RunningMeanStd
from learner.periodic_eval import EVAL_SEED_BASE, policy_as_of
from learner.ppo import Agent
from learner.progress import StopRequest
from learner.video import check_rendering, record_episode, render_spec

if TYPE_CHECKING:
    from learner.records import Recorder
    from learner.tracking import WandbRun

__all__ = ["VideoCapture", "check_videos_folder", "listed_videos", "video_path"]

log = logging.getLogger(__name__)

VIDEO_EXTRA = "pip install 'envfleet[video]'"
"""What classic control's renderer (pygame) is installed with."""


def video_path(run_dir: Path, step: int) -> Path:
    """Where --capture-video writes the video of the nets at env step ``step``."""
    return run_dir / rundir.VIDEOS / f"step-{step:010d}.gif"


def check_videos_folder(run_dir: Path) -> None:
    """--capture-video at the run's start: ValueError naming the option and the path where ``RUN_DIR/videos`` is
    there but no folder (a file, put there by hand or by a copy gone wrong), which no video could be written in:
    else each video failed with a bare "File exists", the run filmed nothing."""
    folder = run_dir / rundir.VIDEOS
    if folder.exists() and not folder.is_dir():
        raise ValueError(
            f"--capture-video: {folder} is a file, not a folder: the videos go in {folder}/; move that file away "
            "(or rename it), or leave --capture-video out"
        )


def listed_videos(run_dir: Path, recorded: Sequence[Path] = ()) -> list[str]:
    """summary.json's ``videos``: the run's GIFs in RUN_DIR/videos (its earlier sessions' too, with --capture-video
    in this one or not), by step, relative to the run dir; where the folder cannot be read, ``recorded``, those this
    session wrote (:attr:`VideoCapture.recorded`)."""
    try:
        found = rundir.list_videos(run_dir)
    except OSError:
        found = list(recorded)
    return [str(p.relative_to(run_dir)) for p in found]


def video_seed(seed: int, step: int) -> int:
    """The video's env's reset seed at ``step``: the evaluation's there (env 0's), ``EVAL_SEED_BASE + --seed +
    step``; ``learner eval CHECKPOINT --video PATH.gif --seed`` that number plays the same episode."""
    return EVAL_SEED_BASE + seed + step


@dataclasses.dataclass(eq=False)
class VideoCapture:
    """The videos of a run (--capture-video): :meth:`record` of the nets as they are, at an evaluation or the end."""

    run_dir: Path
    spec: FleetSpec
    """The env the videos are played on (:func:`learner.video.render_spec`)."""
    spaces: tuple[str, str]
    """The training envs' (observation, action) spaces, as text: the policy's."""
    agent: Agent
    """The nets trained (the updated ones, not --overlap-update's acting copy)."""
    obs_rms: RunningMeanStd | DictRunningMeanStd | None
    envs: gym.vector.VectorEnv
    """The training envs (the policy's spaces; nothing is stepped on them)."""
    device: torch.device
    stop: StopRequest
    seed: int
    """--seed."""
    tracker: WandbRun | None = None
    """--track: each video is logged to the W&B run too."""
    shown: Recorder | None = None
    """Where the run is shown: its progress bar or lines say each video while it is recorded
    (:meth:`Recorder.recording_video <learner.records.Recorder.recording_video>`), as an evaluation is said, then
    the last update's figures again. None: not said."""
    total_timesteps: int | None = None
    """--total-timesteps: the run's last update is at or past it, and its nets are filmed as the run ends
    (:meth:`at_end`). None: not known."""
    failed: bool = dataclasses.field(default=False, init=False)
    """Whether a video failed (said once): no more are recorded."""
    recorded: list[Path] = dataclasses.field(default_factory=list, init=False)
    """The videos this session wrote, in order."""
    last_step: int | None = dataclasses.field(default=None, init=False)
    """The step of the last video asked for (one per step: the end's where its last update's evaluation made one)."""
    stopped: bool = dataclasses.field(default=False, init=False)
    """Whether the last video :meth:`record` was asked for was cut short (or not begun) by a stop (Ctrl-C, SIGTERM,
    SIGHUP): still due at its step (:attr:`Counters.due <learner.resume.Counters.due>`, which a --resume does
    first); not one that failed (no more are recorded) nor one made already."""

    @classmethod
    def check(cls, args: Args, envs: gym.vector.VectorEnv, env_id: str, given_env: str | None) -> FleetSpec:
        """The env --capture-video's videos are played on, for ``args``' run on ``envs`` (their env ``env_id``; the
        --env given on the command line, ``given_env``), made once here and a frame rendered: ValueError naming
        --capture-video and what to install where it cannot be (the env or its renderer not installed here, no
        display where MuJoCo needs one, other spaces than the training envs'), before the run dir is made. A run
        on --servers makes the env the servers serve, with the kwargs, wrappers and time limit they said (an env
        that imports a module must be named with --env, as learner eval --video asks)."""
        try:
            check_served_env_here(env_id, args.servers, given_env, "--capture-video", "--env")
        except ValueError as err:
            raise ValueError(f"{err}, or leave --capture-video out") from None
        kwargs = getattr(envs, "env_kwargs", None)
        if kwargs is None:
            kwargs = dict(args.env_kwargs)
            if args.servers is not None:
                log.warning(
                    "--capture-video: the servers did not say the env kwargs they make their envs with (too old to): "
                    "the videos' env is made with none"
                )
        wrappers = list(getattr(envs, "wrappers", args.server_wrappers()))
        limit = getattr(envs, "time_limit", None) or getattr(getattr(envs, "spec", None), "max_episode_steps", None)
        spec = render_spec(env_id, kwargs, wrappers, limit)
        spaces = (str(envs.single_observation_space), str(envs.single_action_space))
        # (put back after, as each video's are: the run has seeded them already, and an env or renderer that draws
        # from them here left the run's generators, and so its checkpoints, other than without --capture-video)
        rng = capture_rng()
        try:
            check_rendering(spec, video_seed(args.seed, 0), spaces, hint=" (the training envs')")
        except ValueError as err:
            reason = str(err).removeprefix("video: ")
            # (not where the reason is MuJoCo's OpenGL, which video._reason says how to mend: pygame is no part of it)
            said = VIDEO_EXTRA in reason or "MUJOCO_GL=" in reason
            extra = "" if said else f" (classic control renders with pygame: {VIDEO_EXTRA})"
            raise ValueError(
                f"--capture-video: {reason}; the videos are played on an env made in the learner's process, as frames "
                f"never cross the wire: install the env and its renderer here{extra}, or leave --capture-video out"
            ) from None
        finally:
            restore_rng(rng)
        return spec

    def at_end(self, step: int) -> bool:
        """Whether the update at env step ``step`` is the run's last (--total-timesteps reached), whose nets are
        filmed as the run ends and not yet: its checkpoint says the video is due (Counters.due), so that a learner
        killed while it plays films it on --resume."""
        total = self.total_timesteps
        return total is not None and step >= total and not self.failed and step != self.last_step

    def record(self, step: int, state: dict[str, Any] | None = None) -> Path | None:
        """The video of the nets as they are now, those of the update at env step ``step``, at
        ``RUN_DIR/videos/step-<step>.gif``; where it was written, else None (one at that step already, a stop
        asked for, a video failed before or now: said once, and no more are recorded).

        ``state``: the run's state the nets go with (--overlap-update's as of the end of the rollout the update
        learned from; a run's last update's): its --norm-obs statistics, as :meth:`PeriodicEval.run
        <learner.periodic_eval.PeriodicEval.run>` takes them; None: the run's as they are now."""
        self.stopped = False
        if self.failed or step == self.last_step:
            return None
        if self.stop.requested:
            self.stopped = True
            return None
        self.last_step = step
        policy = policy_as_of(self.agent, self.obs_rms, state, self.envs, self.device)
        path = video_path(self.run_dir, step)
        rng = capture_rng()  # (put back after: nothing here may change what training draws next)
        shown = self.shown
        try:
            with rundir.writing(path):
                result = record_episode(
                    self.spec,
                    functools.partial(policy, video=True),
                    video_seed(self.seed, step),
                    path,
                    None,
                    self.spaces,
                    stop=lambda: self.stop.requested,
                    write_cut=False,
                    # (the bar, or a line at the lines' period, says it while it plays: else it looked hung)
                    on_step=None if shown is None else lambda steps: shown.recording_video(step, steps),
                )
        except Exception as err:  # (its env raised, its renderer failed, the disk is full: training goes on)
            self.failed = True
            log.warning(
                "--capture-video: the video at step %s failed, and no more are recorded (training goes on): %s",
                f"{step:,}",
                str(err).removeprefix("video: "),
            )
            return None
        finally:
            restore_rng(rng)
            if shown is not None:
                shown.evaluated()
        if result["path"] is None:  # (a Ctrl-C: the run stops next, as during an evaluation; a --resume films it)
            self.stopped = True
            return None
        self.recorded.append(path)
        if self.tracker is not None:
            self.tracker.video(step, path)
        return path
