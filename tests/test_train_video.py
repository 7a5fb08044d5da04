"""``learner train --capture-video`` (CleanRL's flag): a GIF of the deterministic policy at each evaluation
(--eval-every) and at the run's end, played on an env made in the learner's process, leaving training as it would
be without it. Tiny budgets; real local servers or in-process envs (CartPole and Pendulum render with pygame,
ClockEnv draws its own frames)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
import torch

from learner import rundir
from learner.capture import video_path
from learner.checkpoint import load_checkpoint
from learner.cli import main
from learner.config import Args
from learner.envs import FleetSpec, open_fleet
from learner.errors import TrainingInterrupted
from learner.evaluate import evaluate
from learner.local import LocalServers
from learner.periodic_eval import EVAL_SEED_BASE
from learner.resume import like_args, resume_args
from learner.rundir import VIDEOS
from learner.train import train
from tests import capture_envs
from tests.conftest import QUIET
from tests.test_tracking import offline_runs, offline_wandb  # noqa: F401 (offline_wandb: a fixture, by its name)
from tests.test_train import CtrlCAt, _resumable
from tests.test_train_eval import TIMING, _cartpole, _pendulum, ctrl_c_at_step_2, kill_when_said, leave_eval_server_down

RENDERS_WITH_PYGAME = pytest.mark.skipif(
    importlib.util.find_spec("pygame") is None, reason="needs pygame (pip install 'envfleet[video]')"
)


def _frames(gif: Path) -> int:
    """The frames of ``gif`` (a frame the same as the one before is one shown longer)."""
    from PIL import Image

    with Image.open(gif) as image:
        return int(getattr(image, "n_frames", 1))


def _videos(run: Path) -> list[str]:
    return sorted(p.name for p in (run / VIDEOS).glob("*"))


def _no_timing(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows without their wall-clock and servers' (latencies, busy shares) columns: what the run learned and
    its evaluations found."""
    timing, servers = (*TIMING, "eval/seconds"), ("replicas/", "fleet/")
    return [{k: v for k, v in row.items() if k not in timing and not k.startswith(servers)} for row in rows]


@RENDERS_WITH_PYGAME
def test_videos_at_each_evaluation_and_the_end_leave_the_run_as_it_is(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 5 updates of 32 steps on a local server, evaluated at 64, 128 and 160 (the last update: one ran before): a
    # GIF of each, and the run learns and evaluates exactly what the same run without them does.
    filmed, plain = tmp_path / "filmed", tmp_path / "plain"
    options: dict[str, Any] = {"eval_every": 64, "eval_episodes": 2, "eval_envs": 2}
    with caplog.at_level(logging.INFO, logger="learner.video"):
        summary = train(_cartpole(filmed, **options, capture_video=True))
    train(_cartpole(plain, **options))

    steps = [64, 128, 160]
    assert _videos(filmed) == [f"step-{step:010d}.gif" for step in steps]
    for step in steps:
        assert _frames(video_path(filmed, step)) >= 2, step  # (CartPole: reset, then a frame a step)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("video: ")]
    assert [line.split(" (")[0] for line in said] == [f"video: {video_path(filmed, step)}" for step in steps]
    expected = [f"videos/step-{step:010d}.gif" for step in steps]
    assert summary["videos"] == expected and rundir.read_json(filmed / rundir.SUMMARY)["videos"] == expected
    assert "videos" not in rundir.read_json(plain / rundir.SUMMARY)
    # The same losses, returns and evaluations; the same random generators' states at the end.
    rows = rundir.read_jsonl(filmed / rundir.METRICS)
    assert _no_timing(rows) == _no_timing(rundir.read_jsonl(plain / rundir.METRICS))
    a, b = (torch.load(rundir.list_checkpoints(d)[-1], weights_only=True) for d in (filmed, plain))
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"]) and a["rng"]["python"] == b["rng"]["python"]
    assert torch.equal(a["rng"]["numpy"]["keys"], b["rng"]["numpy"]["keys"])
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), key
    # Recorded, so --resume and --like keep it.
    assert resume_args(filmed).capture_video and like_args(filmed).capture_video


@RENDERS_WITH_PYGAME
@pytest.mark.parametrize("overlap_update", [False, True])
def test_a_video_is_the_episode_learner_eval_video_plays_of_its_step_s_checkpoint(
    tmp_path: Path, overlap_update: bool
) -> None:
    # The nets and --norm-obs statistics the evaluation used (--overlap-update: those of the update evaluated, not
    # the next rollout's statistics), reset with the evaluation's seed: learner eval --video of the step's
    # checkpoint, seeded so, writes the very same GIF. (Pendulum: Box actions, an env kwarg, a time limit of 40.)
    run = tmp_path / "run"
    args = _pendulum(run, overlap_update=overlap_update, env_kwargs={"g": 9.0}, max_episode_steps=40)
    args = dataclasses.replace(args, checkpoint_every=1)
    summary = train(dataclasses.replace(args, eval_every=48, eval_episodes=1, eval_envs=1, capture_video=True))
    assert summary["videos"] == ["videos/step-0000000064.gif", "videos/step-0000000096.gif"]
    for step in (64, 96):
        again = tmp_path / f"again-{step}.gif"
        result = evaluate(
            rundir.checkpoint_path(run, step), 1, seed=EVAL_SEED_BASE + args.seed + step, backend="gym", video=again
        )
        assert result["video"]["steps"] == 40
        assert video_path(run, step).read_bytes() == again.read_bytes(), step


def test_without_eval_every_only_the_nets_the_run_ends_with_are_filmed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = train(Args(**{**_resumable(), "capture_video": True, "run_dir": str(run)}))
    assert summary["videos"] == ["videos/step-0000000048.gif"]
    assert _frames(video_path(run, 48)) == 4  # (ClockEnv: 3 steps, a frame each after the reset's)


@pytest.mark.parametrize("eval_every", [0, 100_000])
def test_a_solved_run_films_the_nets_it_ends_with_once(tmp_path: Path, eval_every: int) -> None:
    # Solved mid-rollout (not learned from): the nets of its last update, at that update's step; with --eval-every,
    # the final evaluation's step, and one video there, not two.
    run = tmp_path / "run"
    options: dict[str, Any] = {"backend": "gym", "num_servers": 1, "envs_per_server": None, "num_envs": 4}
    args = _cartpole(run, **options, total_timesteps=4096, stop_at_return=1.0, capture_video=True)
    summary = train(dataclasses.replace(args, env="tests.envs:ClockEnv", eval_every=eval_every, eval_episodes=1))
    assert summary["stop_reason"] == "stop_at_return" and summary["updates"] >= 1, summary
    last = rundir.read_jsonl(run / rundir.METRICS)[-1]
    assert last["global_step"] < summary["total_steps"]
    assert summary["videos"] == [f"videos/step-{last['global_step']:010d}.gif"]
    if eval_every:
        assert summary["best_eval_step"] == last["global_step"]


def test_a_run_stopped_before_its_end_is_not_filmed_at_its_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A Ctrl-C (or SIGTERM) is a user who wants out: no episode more, as no evaluation more.
    @contextlib.contextmanager
    def interrupted_fleet(spec: FleetSpec) -> Iterator[gym.vector.VectorEnv]:
        with open_fleet(spec) as envs:
            yield CtrlCAt(envs, at=8 + 3)

    run = tmp_path / "run"
    monkeypatch.setattr("learner.train.open_fleet", interrupted_fleet)
    with pytest.raises(TrainingInterrupted) as stopped:
        train(Args(**{**_resumable(), "capture_video": True, "run_dir": str(run)}))
    assert stopped.value.summary["updates"] == 1 and stopped.value.summary["videos"] == []
    assert not (run / VIDEOS).exists()


def test_ctrl_c_during_a_video_stops_the_run_and_resume_films_it_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The Ctrl-C comes at the 2nd step of the first video (after update 1's evaluation, step 16): that video is left
    # out (not written), and the run stops there with the checkpoint of update 1, which says the video is due (its
    # counters' due). Resumed, the run filmed on from step 32, and step 16 never got a video; it is filmed first now,
    # the GIF the uninterrupted run wrote. A session without --capture-video films none, and says so.
    common = {**_resumable(), "checkpoint_every": 1, "eval_every": 16, "eval_episodes": 2, "capture_video": True}
    full = tmp_path / "full"
    train(Args(**common, run_dir=str(full)))
    assert _videos(full) == [f"step-{step:010d}.gif" for step in (16, 32, 48)]
    part = tmp_path / "part"
    summary = ctrl_c_at_step_2(Args(**common, run_dir=str(part)), "learner.video", monkeypatch)
    assert summary["stop_reason"] == "interrupted" and summary["total_steps"] == 16 and summary["updates"] == 1
    assert summary["videos"] == [] and not list((part / VIDEOS).glob("*"))
    assert [p.name for p in rundir.list_checkpoints(part)] == ["step-0000000016.pt"]
    assert load_checkpoint(rundir.checkpoint_path(part, 16))["counters"].get("due", []) == ["video"]
    without = tmp_path / "without"
    shutil.copytree(part, without)
    with caplog.at_level(logging.INFO):
        summary = train(resume_args(part))
    assert "resume: the video of step 16, cut short in the last session, first" in caplog.text
    assert summary["videos"] == [f"videos/step-{step:010d}.gif" for step in (16, 32, 48)]
    assert _no_timing(rundir.read_jsonl(part / rundir.METRICS)) == _no_timing(rundir.read_jsonl(full / rundir.METRICS))
    for step in (16, 32, 48):
        assert video_path(part, step).read_bytes() == video_path(full, step).read_bytes(), step

    caplog.clear()
    with caplog.at_level(logging.INFO):
        train(resume_args(without, capture_video=False))
    assert (
        "resume: the video of step 16, cut short in the last session, is left out: this session runs without "
        "--capture-video"
    ) in caplog.text
    assert not (without / VIDEOS).exists()


def test_a_resumed_run_films_on_at_its_own_steps(tmp_path: Path) -> None:
    # Named by global step, a resumed run's videos go on where the session before left off, and summary.json lists
    # the run's (its earlier sessions' too).
    common = {**_resumable(), "checkpoint_every": 1, "eval_every": 16, "eval_episodes": 1, "capture_video": True}
    full, part = tmp_path / "full", tmp_path / "part"
    train(Args(**common, run_dir=str(full)))
    first = train(Args(**{**common, "total_timesteps": 32}, run_dir=str(part)))
    assert first["videos"] == ["videos/step-0000000016.gif", "videos/step-0000000032.gif"]
    summary = train(resume_args(part, total_timesteps=48))
    assert summary["videos"] == [f"videos/step-{step:010d}.gif" for step in (16, 32, 48)]
    assert video_path(part, 48).read_bytes() == video_path(full, 48).read_bytes()


def test_a_run_resumed_from_an_older_checkpoint_sets_its_later_videos_aside(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Resumed from step 16's checkpoint of a run filmed at 16, 32 and 48, the run abandons what came after it: its
    # videos of steps 32 and 48 were kept in videos/ and listed in summary.json, videos of nets no checkpoint nor
    # metrics row of the run is of (step 48's, the resumed session stopping at 32, for good). They are set aside as
    # the newer checkpoints are (*.abandoned), and the resumed session films step 32 again, as the run was.
    common = {**_resumable(), "checkpoint_every": 1, "eval_every": 16, "eval_episodes": 1, "capture_video": True}
    run, full, killed = tmp_path / "run", tmp_path / "full", tmp_path / "killed"
    args = Args(**common, run_dir=str(run))
    train(args)
    shutil.copytree(run, full)
    before = {step: video_path(run, step).read_bytes() for step in (16, 32, 48)}
    older = rundir.checkpoint_path(run, 16)
    with caplog.at_level(logging.WARNING):
        summary = train(dataclasses.replace(args, run_dir=None, resume=str(older), total_timesteps=32))
    assert summary["videos"] == ["videos/step-0000000016.gif", "videos/step-0000000032.gif"], summary["videos"]
    assert rundir.read_json(run / rundir.SUMMARY)["videos"] == summary["videos"]
    assert _videos(run) == [
        "step-0000000016.gif",
        "step-0000000032.gif",
        "step-0000000032.gif.abandoned",
        "step-0000000048.gif.abandoned",
    ]
    assert (
        f"resume: the run goes on from step 16: the videos of later steps in {run / VIDEOS} (step-0000000032.gif, "
        "step-0000000048.gif) are set aside as step-0000000032.gif.abandoned, step-0000000048.gif.abandoned"
    ) in caplog.text
    assert (run / VIDEOS / "step-0000000048.gif.abandoned").read_bytes() == before[48]
    assert video_path(run, 32).read_bytes() == before[32]  # (the same nets, filmed again)

    # A run killed after its video of step 48, before that update's checkpoint: resumed from step 32's (its latest),
    # it redoes update 3, and its video of step 48 is set aside (this session without --capture-video: else kept,
    # and listed by a later session's summary.json as the run's own, of nets it never made).
    shutil.copytree(full, killed)
    rundir.checkpoint_path(killed, 48).unlink()
    train(dataclasses.replace(resume_args(killed), capture_video=False))
    assert _videos(killed) == ["step-0000000016.gif", "step-0000000032.gif", "step-0000000048.gif.abandoned"]


@RENDERS_WITH_PYGAME
def test_a_run_killed_during_its_end_video_has_its_last_checkpoint_and_resume_films_it(tmp_path: Path) -> None:
    # A run at its --total-timesteps filmed its last nets before its last checkpoint was written: a learner SIGKILLed
    # during that video (a Pendulum episode of 200 frames here; a MuJoCo one of 1,000 takes a minute) left the
    # checkpoint of --checkpoint-every's last due update (here the first: every 1,000), and a resume redid the rest.
    # The last checkpoint is written first now, saying the video is due; --resume then said "nothing to do", and
    # the run had no video of its end. It films it now (the uninterrupted run's GIF), and ends, done.
    run, full = tmp_path / "run", tmp_path / "full"
    argv = ["--env", "Pendulum-v1", "--backend", "gym", "--num-envs", "2", "--num-steps", "16", "--norm-obs"]
    argv += ["--total-timesteps", "96", "--checkpoint-every", "1000", "--checkpoint-seconds", "0", "--capture-video"]
    argv += ["--no-tensorboard", "--no-plot"]
    kill_when_said([*argv, "--run-dir", str(run)], b"recording a video at step 96")
    assert rundir.list_checkpoints(run)[-1] == rundir.checkpoint_path(run, 96)
    assert not video_path(run, 96).exists()  # (killed while it played)
    assert load_checkpoint(rundir.checkpoint_path(run, 96))["counters"].get("due", []) == ["video"]
    summary = train(resume_args(run, progress=False))
    assert summary["stop_reason"] == "total_timesteps" and summary["videos"] == ["videos/step-0000000096.gif"]
    train(like_args(run, run_dir=str(full), progress=False))
    assert video_path(run, 96).read_bytes() == video_path(full, 96).read_bytes()
    # The end's video alone wrote the last checkpoint once: it still says the video is due, but its GIF is there.
    assert load_checkpoint(rundir.checkpoint_path(full, 96))["counters"].get("due", []) == ["video"]
    with pytest.raises(ValueError, match=r"already has 96 env steps, so 96 leaves nothing to do"):
        train(resume_args(run, progress=False))


def test_a_session_without_capture_video_lists_the_run_s_videos_all_the_same(tmp_path: Path) -> None:
    # summary.json is replaced by each session's: a run filmed, resumed without --capture-video, had its summary
    # without `videos`, though its GIFs stayed in videos/ (the run's record, which learner plot and a reader go by).
    # Listed whenever the run dir has some; a run never filmed has no `videos` still.
    common = {**_resumable(), "checkpoint_every": 1, "eval_every": 16, "eval_episodes": 1, "capture_video": True}
    run = tmp_path / "run"
    train(Args(**{**common, "total_timesteps": 32}, run_dir=str(run)))
    summary = train(resume_args(run, total_timesteps=48, capture_video=False))
    assert summary["total_steps"] == 48 and _videos(run) == ["step-0000000016.gif", "step-0000000032.gif"]
    assert summary["videos"] == ["videos/step-0000000016.gif", "videos/step-0000000032.gif"], summary
    assert rundir.read_json(run / rundir.SUMMARY)["videos"] == summary["videos"]
    never = train(Args(**{**common, "capture_video": False}, run_dir=str(tmp_path / "never")))
    assert "videos" not in never and "videos" not in rundir.read_json(tmp_path / "never" / rundir.SUMMARY)


def test_a_videos_path_that_is_a_file_is_refused_at_the_start_naming_the_option(tmp_path: Path) -> None:
    # RUN_DIR/videos a regular file (by hand, a copy gone wrong): each video failed with a bare "File exists" (said
    # as a warning, the run then filmed nothing). Refused at the start now, naming --capture-video and the path,
    # before any update; without --capture-video the file is no matter.
    common = {**_resumable(), "checkpoint_every": 1}
    run = tmp_path / "run"
    train(Args(**{**common, "total_timesteps": 16}, run_dir=str(run)))
    (run / VIDEOS).write_text("not a folder")
    with pytest.raises(ValueError) as refused:
        train(resume_args(run, total_timesteps=32, capture_video=True, eval_every=16, eval_episodes=1))
    assert str(refused.value) == (
        f"--capture-video: {run / VIDEOS} is a file, not a folder: the videos go in {run / VIDEOS}/; move that file "
        "away (or rename it), or leave --capture-video out"
    )
    assert [r["update"] for r in rundir.read_jsonl(run / rundir.METRICS)] == [1]  # (no update made)
    assert train(resume_args(run, total_timesteps=32))["total_steps"] == 32


def test_a_videos_folder_that_cannot_be_written_does_not_stop_a_resume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A read-only videos/ (as a read-only bind mount makes it: run so for real, learner train --resume
    # RUN/checkpoints/step-N.pt failed with "cannot write RUN/videos/step-....gif: Read-only file system", after the
    # newer checkpoints were set aside, and every resume of the run failed so, with --capture-video or not). Its
    # renames fail here as they do on such a folder; the run goes on from its checkpoint, the GIFs left as they are.
    common = {**_resumable(), "checkpoint_every": 1, "eval_every": 16, "eval_episodes": 1, "capture_video": True}
    run = tmp_path / "run"
    args = Args(**common, run_dir=str(run))
    train(args)
    rename = Path.rename

    def read_only_videos(self: Path, target: Any) -> Path:
        if self.parent.name == VIDEOS:
            raise OSError(30, "Read-only file system", str(self))
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", read_only_videos)
    with caplog.at_level(logging.WARNING):
        summary = train(
            dataclasses.replace(args, run_dir=None, resume=str(rundir.checkpoint_path(run, 16)), capture_video=False)
        )
    assert summary["total_steps"] == 48 and summary["stop_reason"] == "total_timesteps", summary
    assert _videos(run) == [f"step-{step:010d}.gif" for step in (16, 32, 48)]
    assert (
        f"resume: the run goes on from step 16, but the videos of later steps in {run / VIDEOS} could not be set "
        f"aside (cannot write {video_path(run, 32)}: Read-only file system"
    ) in caplog.text, caplog.text


def test_a_run_started_over_where_one_stopped_before_its_first_checkpoint_sets_its_videos_aside_too(
    tmp_path: Path,
) -> None:
    # Killed after its first evaluation's video (recorded before that update's row and checkpoint): the run started
    # over in its run dir set its config, metrics and checkpoints aside in previous/, but left videos/step-16.gif,
    # which it then listed in its summary.json as its own (another run's nets), until it overwrote it, if ever.
    run = tmp_path / "run"
    common = {**_resumable(), "eval_every": 16, "eval_episodes": 1, "capture_video": True, "run_dir": str(run)}
    train(Args(**common))
    # As a kill right after the video at step 16 leaves it: no checkpoint, no summary, no row.
    shutil.rmtree(run / rundir.CHECKPOINTS)
    (run / rundir.SUMMARY).unlink()
    rundir.rewrite_jsonl(run / rundir.METRICS, [])
    for step in (32, 48):
        video_path(run, step).unlink()
    summary = train(Args(**{**common, "eval_every": 0}))
    assert summary["videos"] == ["videos/step-0000000048.gif"], summary["videos"]
    assert [p.name for p in (run / "previous" / VIDEOS).iterdir()] == ["step-0000000016.gif"]


@pytest.mark.parametrize("shown", ["lines", "bar"])
def test_a_video_is_said_while_it_is_recorded_as_an_evaluation_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, shown: str
) -> None:
    # While a video was recorded the bar and the lines said nothing: the last update's figures (or the evaluation's
    # last count), frozen, for the seconds a MuJoCo episode takes. They say it as an evaluation is said, step by
    # step (here at every step: ClockEnv's 3), then the figures again; the video at the run's end too.
    from learner import train as train_module

    if shown == "lines":
        monkeypatch.setattr(train_module, "PROGRESS_LINE_S", 0.0)  # (a line at every update, and at each step)
    else:
        from tqdm import tqdm

        monkeypatch.setattr("learner.progress._tqdm_class", lambda: lambda **kwargs: tqdm(**kwargs, mininterval=0.0))
        monkeypatch.setattr("learner.records.OUTAGE_REDRAW_S", 0.0)
    common = {**_resumable(), "eval_every": 32, "eval_episodes": 1, "capture_video": True}
    train(Args(**{**common, "progress": None if shown == "lines" else True}, run_dir=str(tmp_path / "run")))
    out, err = capsys.readouterr()
    if shown == "lines":
        said = [line for line in out.splitlines() if line.startswith("step ")]
    else:
        said = [frame.rstrip() for frame in re.split(r"[\r\n]", err) if "steps [" in frame]
    counts = [
        (int(m[1]), int(m[2]))
        for line in said
        if (m := re.search(r", recording a video at step (\d+): (\d) steps?", line))
    ]
    assert {(32, n) for n in range(4)} <= set(counts) and {(48, n) for n in range(4)} <= set(counts), said
    # After the video of step 32, the next update's figures (step 48's), the video no more said.
    after = max(i for i, line in enumerate(said) if "recording a video at step 32" in line) + 1
    assert after < len(said) and "recording a video" not in said[after], said


@RENDERS_WITH_PYGAME
def test_an_evaluation_left_out_is_filmed_all_the_same_and_its_warning_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The eval server left down after update 1 (as test_train_eval marks it): the evaluations from step 64 on are
    # left out, but the videos' env is in the learner's process, not on that server: each evaluation's step is filmed
    # all the same (the look at the policy there that is left), and the warning said nothing of them (it read as if
    # they went too).
    run = tmp_path / "run"
    args = _cartpole(run, eval_every=32, eval_episodes=1, connect_timeout=30.0, total_timesteps=96, capture_video=True)
    summary = train(args, on_update=leave_eval_server_down)
    rows = rundir.read_jsonl(run / rundir.METRICS)
    assert [r["global_step"] for r in rows if "eval/return_mean" in r] == [32]
    assert summary["videos"] == [f"videos/step-{step:010d}.gif" for step in (32, 64, 96)]
    said = [
        r.getMessage() for r in caplog.records if r.name == "learner.periodic_eval" and r.levelno >= logging.WARNING
    ]
    assert said == [
        "the eval server eval-0 was killed by SIGKILL, and was left down after 5 restarts: the evaluations from "
        "step 64 on are left out (training goes on; their videos are recorded all the same, --capture-video playing "
        "in this process)"
    ]


def test_an_evaluation_left_out_after_a_video_failed_does_not_say_its_video_is_recorded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The start's check renders the one frame the renderer gives: the video at step 16 fails (no more are recorded);
    # the eval server is then left down, and the warning of the evaluations left out said their videos were recorded
    # all the same.
    monkeypatch.setattr(capture_envs, "RENDERED", [0])
    common = {**_resumable(), "eval_every": 16, "eval_episodes": 1, "capture_video": True, "connect_timeout": 30.0}
    common.update(
        env="tests.capture_envs:RendererBreaksEnv",
        env_kwargs={**common["env_kwargs"], "frames_ok": 1},
        backend="remote",
        num_servers=1,
        envs_per_server=2,
        num_envs=None,
    )
    summary = train(Args(**common, run_dir=str(tmp_path / "run")), on_update=leave_eval_server_down)
    assert summary["videos"] == []
    said = [
        r.getMessage() for r in caplog.records if r.name == "learner.periodic_eval" and r.levelno >= logging.WARNING
    ]
    assert len(said) == 1 and "the evaluations from step 32 on are left out (training goes on)" in said[0], said


def test_a_video_that_fails_mid_run_is_said_once_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The start's check renders 1 frame, the video at step 16 4 (ClockEnv: 3 steps): the renderer breaks at the
    # next frame, in the video at step 32. One warning; none at step 48 (not tried); the run ends as asked.
    monkeypatch.setattr(capture_envs, "RENDERED", [0])
    common = {**_resumable(), "eval_every": 16, "eval_episodes": 1, "capture_video": True}
    common.update(env="tests.capture_envs:RendererBreaksEnv", env_kwargs={**common["env_kwargs"], "frames_ok": 5})
    run, plain = tmp_path / "run", tmp_path / "plain"
    with caplog.at_level(logging.WARNING):
        summary = train(Args(**common, run_dir=str(run)))
    assert summary["stop_reason"] == "total_timesteps" and summary["total_steps"] == 48
    assert summary["videos"] == ["videos/step-0000000016.gif"] and _videos(run) == ["step-0000000016.gif"]
    warned = [r.getMessage() for r in caplog.records if "--capture-video" in r.getMessage()]
    assert warned == [
        "--capture-video: the video at step 32 failed, and no more are recorded (training goes on): rendering "
        "tests.capture_envs:RendererBreaksEnv (render_mode='rgb_array') in this process failed: RuntimeError: the "
        "renderer's context was lost"
    ]
    train(Args(**{**common, "capture_video": False}, run_dir=str(plain)))
    assert _no_timing(rundir.read_jsonl(run / rundir.METRICS)) == _no_timing(rundir.read_jsonl(plain / rundir.METRICS))


def test_the_start_s_check_leaves_the_random_generators_as_they_were(tmp_path: Path) -> None:
    # The start's check (VideoCapture.check) makes the videos' env and renders a frame once the run has seeded the
    # process's generators, and did not put them back as each video does: with an env whose renderer draws from them,
    # the run's checkpoints held other generator states than the same run's without --capture-video (a run resumed
    # from one drew otherwise). Now the same states, the same rows, the same nets.
    common = {**_resumable("tests.capture_envs:DitheringEnv"), "eval_every": 16, "eval_episodes": 1}
    run, plain = tmp_path / "run", tmp_path / "plain"
    train(Args(**common, capture_video=True, run_dir=str(run)))
    train(Args(**common, run_dir=str(plain)))
    assert _videos(run) == [f"step-{step:010d}.gif" for step in (16, 32, 48)]
    assert _no_timing(rundir.read_jsonl(run / rundir.METRICS)) == _no_timing(rundir.read_jsonl(plain / rundir.METRICS))
    for ours, theirs in zip(rundir.list_checkpoints(run), rundir.list_checkpoints(plain), strict=True):
        a, b = (torch.load(path, weights_only=True) for path in (ours, theirs))
        assert a["rng"]["python"] == b["rng"]["python"], ours.name
        assert torch.equal(a["rng"]["numpy"]["keys"], b["rng"]["numpy"]["keys"]), ours.name
        assert torch.equal(a["rng"]["torch"], b["rng"]["torch"]), ours.name


def test_an_env_that_cannot_render_here_is_refused_at_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No pygame in the learner's process (the local servers have theirs: they render nothing): refused before the
    # run dir is made, naming the option and the extra to install.
    run = tmp_path / "run"
    monkeypatch.setitem(sys.modules, "pygame", None)  # (import pygame raises ImportError)
    with pytest.raises(ValueError) as refused:
        train(_cartpole(run, capture_video=True))
    message = str(refused.value)
    assert message.startswith("--capture-video: rendering CartPole-v1 (render_mode='rgb_array') in this process failed")
    assert "pip install 'envfleet[video]'" in message, message
    assert not run.exists()
    # An env that renders no RGB frame: said as learner eval --video says it.
    with pytest.raises(ValueError, match=r"^--capture-video: .* rendered a frame of float64 .* not an RGB frame"):
        train(Args(**{**_resumable("tests.eval_envs:FramesEnv"), "capture_video": True, "run_dir": str(run)}))
    assert not run.exists()


def test_an_opengl_renderer_missing_here_is_refused_without_a_word_of_pygame(tmp_path: Path) -> None:
    # MuJoCo's OpenGL backend failing here (MUJOCO_GL=glfw without a display): the refusal said how to mend it
    # (MUJOCO_GL egl or osmesa), then "classic control renders with pygame: pip install 'envfleet[video]'", which
    # pygame installed does not mend.
    run = tmp_path / "run"
    with pytest.raises(ValueError) as refused:
        train(Args(**{**_resumable("tests.capture_envs:NoOpenGLEnv"), "capture_video": True, "run_dir": str(run)}))
    message = str(refused.value)
    assert "an OpenGL platform library has not been loaded" in message and "MUJOCO_GL=" in message, message
    assert "pygame" not in message and "envfleet[video]" not in message, message
    assert not run.exists()


def test_a_run_on_servers_films_the_env_they_serve_with_their_kwargs(tmp_path: Path) -> None:
    # Servers of ClockEnv(length=5): the env imports a module, so it is made here only where --env names it too
    # (as learner eval --video asks); then with the kwargs the servers said, not the command's (none).
    run = tmp_path / "run"
    steps: dict[str, Any] = {"num_steps": 8, "total_timesteps": 32, "run_dir": str(run), **QUIET}
    with LocalServers("tests.envs:ClockEnv", 1, 2, env_kwargs={"length": 5}) as servers:
        address = servers.addresses[0]
        with pytest.raises(
            ValueError, match=r"^--capture-video: makes the run's env here, tests\.envs:ClockEnv.*--env"
        ):
            train(Args(servers=address, capture_video=True, **steps))
        assert not run.exists()
        summary = train(Args(servers=address, env="tests.envs:ClockEnv", capture_video=True, **steps))
    assert summary["videos"] == ["videos/step-0000000032.gif"]
    assert _frames(video_path(run, 32)) == 6  # (length 5: the reset's frame and 5 steps')


def test_the_command_sets_up_headless_rendering_and_says_where_the_videos_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("DISPLAY", "WAYLAND_DISPLAY", "SDL_VIDEODRIVER"):
        monkeypatch.delenv(name, raising=False)
    run = tmp_path / "run"
    argv = ["train", "--env", "tests.envs:ClockEnv", "--backend", "gym", "--num-envs", "2", "--num-steps", "8"]
    argv += ["--total-timesteps", "32", "--eval-every", "16", "--eval-episodes", "1", "--capture-video"]
    assert main([*argv, "--run-dir", str(run), "--no-progress", "--no-tensorboard", "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "videos/ (2 GIFs)" in out, out
    assert _videos(run) == ["step-0000000016.gif", "step-0000000032.gif"]
    assert os.environ.get("SDL_VIDEODRIVER") == "dummy"  # (set before the envs were made)
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--capture-video" in capsys.readouterr().out


@pytest.mark.usefixtures("offline_wandb")
def test_track_logs_each_video_to_w_and_b_at_its_step(tmp_path: Path) -> None:
    # (held until its update's row is logged: W&B drops points of steps before its last one)
    run = tmp_path / "run"
    common = {**_resumable(), "eval_every": 16, "eval_episodes": 1, "capture_video": True, "track": True}
    summary = train(Args(**common, run_dir=str(run)))
    assert len(summary["videos"]) == 3
    (logged,) = offline_runs(tmp_path / "wandb-files")  # (offline_wandb's WANDB_DIR)
    history = logged["history"]
    videos = {step: row for step, row in history.items() if "videos/policy/_type" in row}
    assert sorted(videos) == [16, 32, 48], history
    for step, row in videos.items():  # (with the row of the update at that step: its figures and evaluation)
        assert row["videos/policy/_type"] == "video-file" and row["videos/policy/path"].endswith(".gif"), row
        assert row["charts/update"] == step // 16 and "eval/mean_reward" in row, row
