"""The ``learner`` command: train, eval, plot, servers, bench and demo from the command line, and its errors."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from learner import cli, rundir
from learner.cli import aborted_line, build_parser, interrupted_line, main
from learner.progress import DOUBLE_TAP_S, ending_as_interrupt
from learner.stats import format_return
from tests.certs import make_server_certs
from tests.conftest import CLOCK_ARGS, CTRL_C_EXIT, IN_PROCESS_ARGS, SpawnServer, StartServers, not_found_at_once

CLOCK = CLOCK_ARGS


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run made by ``learner train`` itself (in-process envs, so it takes a second); it trains, so the tests
    that use it are marked needs_torch."""
    run = tmp_path_factory.mktemp("runs") / "clock"
    code = main(
        [
            "train",
            *CLOCK,
            "--device",  # (its tests read a CPU run's config: torch's threads; auto picks CUDA on a GPU host)
            "cpu",
            *IN_PROCESS_ARGS,
            "--total-timesteps",
            "32",
            "--run-dir",
            str(run),
        ]
    )
    assert code == 0
    return run


@pytest.mark.needs_torch
def test_train_writes_its_run_dir_and_plot(trained_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (trained_run / rundir.SUMMARY).is_file() and (trained_run / rundir.PLOT).is_file()
    assert rundir.list_checkpoints(trained_run)


@pytest.mark.needs_torch
def test_more_local_servers_than_cpus_are_said_to_take_a_while_to_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """64 servers on 2 CPUs took ~30 s to start with nothing said (~0.6 s of CPU each)."""
    from learner import local

    argv = ["train", *CLOCK, "--num-steps", "8", "--total-timesteps", "16", "--no-plot"]
    monkeypatch.setattr(local, "usable_cpus", lambda root="/": 1)
    monkeypatch.setattr(local, "SERVERS_PER_CPU", 1)  # (4: more than 4 servers on each CPU are said)
    assert main([*argv, "--run-dir", str(tmp_path / "two")]) == 0
    said = capsys.readouterr()
    assert said.out.startswith("learner train: PPO")  # (stdout's first line stays the run's, for `| head -1`)
    assert (
        said.err.splitlines()[0]
        == "learner train: starting 2 local env servers (4 x tests.envs:ClockEnv each) on 1 CPU: they take a while"
    )
    assert main([*argv, "--num-servers", "1", "--run-dir", str(tmp_path / "one")]) == 0  # (1 on 1 CPU: not said)
    assert "starting" not in capsys.readouterr().err


@pytest.mark.needs_torch
def test_a_device_this_host_lacks_is_a_usage_error(
    trained_run: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found once train or eval ran, it was an error of the run's (exit 1, no usage line), as no other bad option."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (
        ["train", *CLOCK, *IN_PROCESS_ARGS, "--device", "cuda"],
        ["eval", str(trained_run), "--device", "cuda"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"learner {argv[0]}: error: --device: cuda was asked for, but torch sees no CUDA device" in err
        assert err.rstrip().endswith("): give --device cpu, or auto"), err  # (what to do: not only what is wrong)


@pytest.mark.needs_torch
def test_resume_continues_a_run_with_more_steps(
    trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "resumed"
    shutil.copytree(trained_run, run)
    # A total the run already reached: said at once, nothing touched.
    before = sorted(p.name for p in run.iterdir())
    with pytest.raises(SystemExit) as exit_info:  # (a usage error: the Kubernetes Job fails at once, no retry)
        main(["train", "--resume", str(run), "--total-timesteps", "32"])
    assert exit_info.value.code == 2
    assert (
        "--total-timesteps: the run in" in capsys.readouterr().err and sorted(p.name for p in run.iterdir()) == before
    )
    assert main(["train", "--resume", str(run), "--total-timesteps", "48", "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "plot:" not in out and "TensorBoard" not in out  # the run has neither (CLOCK: --no-tensorboard)
    rows = rundir.read_jsonl(run / rundir.METRICS)
    assert [r["global_step"] for r in rows] == [16, 32, 48]
    config = rundir.read_json(run / rundir.CONFIG)
    assert config["args"]["total_timesteps"] == 48 and config["args"]["num_envs"] == 2
    assert set(config["versions"]) - {"envfleet_commit"} == {
        "python",
        "envfleet",
        "torch",
        "gymnasium",
        "numpy",
        "grpcio",
        "protobuf",
    }
    # Run from a git checkout: the commit too, the version being the same at every commit.
    if (Path(rundir.__file__).resolve().parent.parent / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", config["versions"]["envfleet_commit"])
    machine = config["machine"]
    assert machine["torch_threads"] == 1 and machine["cpus"] >= 1 and machine["hostname"] and machine["cpu"]


@pytest.mark.needs_torch
def test_like_starts_a_new_run_with_a_runs_options_and_those_given(
    trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`learner train --like RUN --seed 2`: another seed of the same experiment, in a run dir of its own,
    from scratch; the run dir or its config.json; the same seed again gives the same curve."""
    first = rundir.read_json(trained_run / rundir.CONFIG)
    for source, given, run in (
        (trained_run, ["--seed", "2"], tmp_path / "seed2"),
        (trained_run / rundir.CONFIG, [], tmp_path / "again"),
    ):
        assert main(["train", "--like", str(source), *given, "--run-dir", str(run), "--no-plot"]) == 0
        config = rundir.read_json(run / rundir.CONFIG)
        differ = {k for k in config["args"] if config["args"][k] != first["args"][k]} - {"progress"}  # (this session's)
        # (the hyperparameters the preset gave, recorded as resolved: a later version's preset may differ)
        pinned = {k for k in differ if k in first["ppo"] and first["args"][k] is None}
        assert config["ppo"] == first["ppo"] and all(
            config["args"][k] == first["ppo"][k] for k in pinned - {"hidden_sizes"}
        )
        assert differ - pinned == ({"seed", "run_dir", "plot"} if given else {"run_dir", "plot"}), differ
        assert config["resumed_at_step"] is None and [
            r["global_step"] for r in rundir.read_jsonl(run / rundir.METRICS)
        ] == [16, 32]
    losses = [
        [r["value_loss"] for r in rundir.read_jsonl(run / rundir.METRICS)] for run in (trained_run, tmp_path / "again")
    ]
    assert losses[0] == losses[1]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--like", str(trained_run), "--resume", str(trained_run)])
    assert exit_info.value.code == 2
    assert (
        "--like: starts a new run with another run's options, so it cannot go with --resume" in capsys.readouterr().err
    )
    for bad, said in (
        (
            tmp_path / "nothing",
            f"--like: expected a run dir or its config.json, but {tmp_path / 'nothing'} does not exist",
        ),
        (trained_run / rundir.METRICS, f"--like: {trained_run / rundir.METRICS} is no run's config.json"),
    ):
        with pytest.raises(SystemExit):
            main(["train", "--like", str(bad)])
        assert said in capsys.readouterr().err


@pytest.mark.needs_torch
def test_resuming_a_solved_run_needs_a_higher_stop_at_return(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from learner.checkpoint import load_checkpoint

    # ClockEnv's returns are >= 0, so --stop-at-return 0 is reached once 20 episodes have ended (at step 78, mid-rollout).
    run = tmp_path / "solved"
    argv = [*CLOCK, *IN_PROCESS_ARGS, "--total-timesteps", "160"]
    assert main(["train", *argv, "--stop-at-return", "0", "--no-plot", "--run-dir", str(run)]) == 0
    summary = rundir.read_json(run / rundir.SUMMARY)
    assert summary["stop_reason"] == "stop_at_return" and summary["solved_at_step"] == summary["total_steps"] == 78
    # The partial rollout (steps 65-78) was not learned from: the checkpoint is as of the last update (step 64),
    # as after a Ctrl-C, with the solve; a resumed run collects that rollout again.
    saved = load_checkpoint(run / "checkpoints" / "step-0000000064.pt")
    assert saved["counters"]["global_step"] == 64 and saved["counters"]["update"] == 4
    assert saved["counters"]["solved_at_step"] == 78 and saved["counters"]["solved_threshold"] == 0
    assert not (run / "checkpoints" / "step-0000000078.pt").exists()
    capsys.readouterr()
    before = sorted(p.name for p in run.iterdir())
    # Without a new target: done already, exit 0 (a Kubernetes Job's pod that resumes a finished run succeeds).
    assert main(["train", "--resume", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"learner train: done already: --stop-at-return: the run in {run} was solved at step 78" in out, out
    for again in (["--stop-at-return", "0"], ["--total-timesteps", "1000"]):  # a new target: a usage error
        with pytest.raises(SystemExit) as exit_info:
            main(["train", "--resume", str(run), *again])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"--stop-at-return: the run in {run} was solved at step 78" in err, err
        assert "pass --no-stop-at-return to train it on to --total-timesteps, or a higher --stop-at-return" in err
    assert sorted(p.name for p in run.iterdir()) == before  # nothing started, nothing written

    # --no-stop-at-return: trained on to --total-timesteps, still solved where it was (the env has no threshold
    # of its own, so the bar it was solved against stands).
    fork = tmp_path / "trained-on"
    shutil.copytree(run, fork)
    assert main(["train", "--resume", str(fork), "--no-stop-at-return", "--total-timesteps", "112"]) == 0
    assert "solved (mean return >= 0) at step 78" in capsys.readouterr().out
    summary = rundir.read_json(fork / rundir.SUMMARY)
    assert (summary["stop_reason"], summary["total_steps"], summary["solved_at_step"]) == ("total_timesteps", 112, 78)
    assert rundir.read_json(fork / rundir.CONFIG)["args"]["stop_at_return"] is None

    assert main(["train", "--resume", str(run), "--stop-at-return", "5"]) == 0  # returns are <= 3
    out = capsys.readouterr().out
    checkpoint = run / "checkpoints" / "step-0000000064.pt"
    assert f"resuming from {checkpoint} (64 steps)" in out
    assert "not solved (mean return >= 5 not reached)" in out
    summary = rundir.read_json(run / rundir.SUMMARY)
    assert summary["stop_reason"] == "total_timesteps" and summary["solved_at_step"] is None


@pytest.mark.parametrize(
    ("again", "message"),
    [
        (["--run-dir", "elsewhere"], "--run-dir: a resumed run goes on in its own run dir, {run}; --run-dir cannot"),
        (["--hidden-sizes", "32"], "--hidden-sizes: the run in {run} was trained with --hidden-sizes 64,64; a resumed"),
        (["--env", "CartPole-v1"], "--env: the run in {run} was trained with --env tests.envs:ClockEnv; a resumed"),
        (
            ["--env-kwargs", '{"length": 3, "action": "box"}'],
            "--resume: the run in {run} trained its nets on actions Discrete(2), but these envs (in-process "
            "gymnasium SyncVectorEnv, 2 x tests.envs:ClockEnv) have Box(-1.0, 1.0, (1,), float32); resume it on the same env, wrappers and env kwargs",
        ),
    ],
)
@pytest.mark.needs_torch
def test_resume_refuses_options_that_would_change_the_nets(
    trained_run: Path, tmp_path: Path, again: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.name != rundir.LOCK}
    try:  # refused as it parses (exit code 2), or once the envs say what they are (1)
        code: int | str | None = main(["train", "--resume", str(run), "--total-timesteps", "48", *again])
    except SystemExit as exit_info:
        code = exit_info.code
    assert code in (1, 2)
    err = " ".join(capsys.readouterr().err.split())
    assert message.format(run=run) in err, err
    assert "Traceback" not in err
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.name != rundir.LOCK} == before  # nothing written
    # Given as it was saved, it is no change.
    assert main(["train", "--resume", str(run), "--total-timesteps", "48", "--run-dir", str(run), "--no-plot"]) == 0


@pytest.mark.needs_torch
def test_resume_on_servers_of_another_env_names_both(
    trained_run: Path, tmp_path: Path, start_servers: StartServers, capsys: pytest.CaptureFixture[str]
) -> None:
    addresses = start_servers("CartPole-v1", 1, 2)
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    argv = ["--servers", addresses[0], "--backend", "remote", "--total-timesteps", "48"]
    assert main(["train", "--resume", str(run), *argv]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert (
        f"--servers: the run in {run} trained on tests.envs:ClockEnv, but the server at {addresses[0]} serves "
        "CartPole-v1; resume it on servers of tests.envs:ClockEnv"
    ) in err, err


@pytest.mark.needs_torch
def test_a_solved_run_on_running_servers_is_judged_on_resume_by_the_threshold_it_was_solved_against(
    tmp_path: Path, start_servers: StartServers, capsys: pytest.CaptureFixture[str]
) -> None:
    from learner.checkpoint import load_checkpoint

    # FrozenLake on a 1x2 map ("SG"): every episode reaches the goal (return 1), so the run is solved under
    # the env's own threshold (0.7), without --stop-at-return, within a few rollouts.
    addresses = start_servers("FrozenLake-v1", 1, 2, env_kwargs={"desc": ["SG"], "is_slippery": False})
    run = tmp_path / "run"
    argv = ["--servers", ",".join(addresses), "--num-steps", "16", "--no-plot", "--no-progress", "--no-tensorboard"]
    assert main(["train", *argv, "--total-timesteps", "128", "--run-dir", str(run)]) == 0
    summary = rundir.read_json(run / rundir.SUMMARY)
    solved_at = summary["solved_at_step"]
    assert summary["solved_threshold"] == 0.7 and solved_at is not None and summary["total_steps"] == 128
    assert load_checkpoint(rundir.list_checkpoints(run)[-1])["counters"]["solved_threshold"] == 0.7
    capsys.readouterr()

    # The bar is in the checkpoint: a resumed run is judged by it.
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--resume", str(run), "--stop-at-return", "0.7", "--total-timesteps", "192"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"the run in {run} was solved at step {solved_at:,} (mean return of the last 20 episodes >= 0.7)" in err

    # Trained on (no --stop-at-return): still solved where it was, not judged again.
    assert main(["train", "--resume", str(run), "--total-timesteps", "192", *argv[2:]]) == 0
    summary = rundir.read_json(run / rundir.SUMMARY)
    assert (summary["total_steps"], summary["solved_at_step"]) == (192, solved_at)
    assert f"solved (mean return >= 0.7) at step {solved_at:,}" in capsys.readouterr().out


@pytest.mark.needs_torch
def test_eval_reports_the_deterministic_policy_on_local_servers(
    trained_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(trained_run), "--episodes", "3", "--num-envs", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["episodes"] == 3 and result["deterministic"] is True
    assert result["length_mean"] == 3.0 and 0.0 <= result["return_mean"] <= 3.0
    assert main(["eval", str(trained_run), "--episodes", "1", "--backend", "gym"]) == 0  # PATH, as plot takes it
    out = capsys.readouterr().out
    assert "1 episode of the deterministic policy" in out
    assert re.search(r"^return [-\d.]+, length 3$", out, re.MULTILINE), out  # (one episode: no "+- 0")
    assert "on in-process gymnasium SyncVectorEnv, 1 x tests.envs:ClockEnv" in out, out


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (0.9615, "0.9615"),
        (1.0, "1"),
        (0.0, "0"),
        (-2.02901, "-2.029"),
        (21.3456, "21.35"),
        (500.0, "500.0"),
        (-1234.56, "-1234.6"),
    ],
)
def test_returns_print_with_4_significant_digits_and_1_decimal_from_100(value: float, text: str) -> None:
    assert format_return(value) == text


@pytest.mark.needs_torch
def test_closing_lines_of_train_and_eval_show_returns_as_summary_json_holds_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Box ClockEnv: returns in (-3, 0], not whole numbers; one decimal would hide all but the first digit.
    run = tmp_path / "box"
    box = ["--env", "tests.envs:ClockEnv", "--env-kwargs", '{"length": 3, "action": "box"}', "--no-progress"]
    argv = ["train", *box, "--no-tensorboard", "--no-plot", "--backend", "gym", "--num-envs", "2", "--num-steps", "8"]
    assert main([*argv, "--num-minibatches", "2", "--total-timesteps", "96", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    summary = rundir.read_json(run / rundir.SUMMARY)
    recent = summary["final_return_mean"]
    assert f"mean return of the last 20 episodes: {recent:.4g}\n" in out, out
    assert f"best: mean return {summary['best_return']:.4g} at step" in out, out
    assert main(["eval", str(run), "--episodes", "3", "--backend", "gym", "--stochastic", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert main(["eval", str(run), "--episodes", "3", "--backend", "gym", "--stochastic"]) == 0  # (same seed)
    line = f"return {result['return_mean']:.4g} +- {result['return_std']:.4g} (min {result['return_min']:.4g}, "
    assert line in capsys.readouterr().out


@pytest.mark.needs_torch
def test_eval_records_one_more_episode_as_a_gif(
    trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from PIL import Image, ImageSequence

    gif = tmp_path / "videos" / "clock.gif"  # its folder is made
    capsys.readouterr()
    assert main(["eval", str(trained_run), "--episodes", "2", "--num-envs", "1", "--video", str(gif), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["episodes"] == 2  # the recorded episode is one more, not one of them
    video = {"path": str(gif), "steps": 3, "fps": 10.0, "keep_every": 1, "episode_ended": True}
    assert result["video"] == {**video, "return": result["returns"][0]}
    with Image.open(gif) as image:
        frames = [frame.convert("RGB") for frame in ImageSequence.Iterator(image)]
        assert image.info["duration"] == 100 and image.info["loop"] == 0
    # ClockEnv's frame t has value 50 t: the reset's frame, then one per step of the 3-step episode.
    assert [frame.getpixel((0, 0)) for frame in frames] == [(0, 0, 0), (50, 50, 50), (100, 100, 100), (150, 150, 150)]
    assert main(["eval", str(trained_run), "--episodes", "1", "--video", str(gif), "--video-fps", "25"]) == 0
    assert f"video: {gif} (one more episode, in process: 3 steps, return" in capsys.readouterr().out
    with Image.open(gif) as image:
        assert image.info["duration"] == 40


@pytest.mark.parametrize(
    ("video", "message"),
    [
        ("{tmp}", "argument --video: '{tmp}' is a folder; expected a file name ending in .gif"),
        (
            "{tmp}/notes.txt/x.gif",
            "argument --video: cannot write '{tmp}/notes.txt/x.gif': '{tmp}/notes.txt' is a file",
        ),
    ],
)
@pytest.mark.needs_torch
def test_eval_refuses_a_video_path_it_cannot_write_before_any_episode(
    trained_run: Path, tmp_path: Path, video: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked as the command line is read (video.check_path, as evaluate() checks it)."""
    (tmp_path / "notes.txt").write_text("a file, not a folder\n")
    folder = tmp_path / "d.gif"
    folder.mkdir()
    video = video.format(tmp=folder if video == "{tmp}" else tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(trained_run), "--episodes", "1", "--video", video])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert message.format(tmp=folder if "is a folder" in message else tmp_path) in captured.err, captured.err
    assert "return" not in captured.out and "Traceback" not in captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "expected a checkpoint file or run dir, as PATH or --checkpoint PATH"),
        (["a.pt", "--video", "a.mp4"], "argument --video: writes an animated GIF; expected a file name ending in .gif"),
        (["a.pt", "--video", "out/.gif"], "argument --video: writes an animated GIF; expected a file name ending in"),
        (
            ["a.pt", "--video", "a.gif", "--video-fps", "0"],
            "argument --video-fps: expected frames per second in [0.002,",
        ),
        (["a.pt", "--video", "a.gif", "--video-fps", "0.001"], "argument --video-fps: expected frames per second in"),
        (["a.pt", "--video", "a.gif", "--video-fps", "nan"], "argument --video-fps: expected frames per second in"),
        (["a.pt", "--video-fps", "5"], "--video-fps: sets the speed of the GIF that --video PATH.gif writes"),
        (["a.pt", "--checkpoint", "b.pt"], "expected one checkpoint, got PATH a.pt and --checkpoint b.pt"),
        (["a.pt", "--servers", "h:1", "--backend", "gym"], "--servers: evaluates on running env servers, so it cannot"),
        (["a.pt", "--servers", "h:1", "--num-envs", "16"], "--num-envs: sets the envs of the local server"),
        (["a.pt", "--servers", "h:1", "--transport", "tcp"], "--transport: says how to reach the local env server;"),
        (
            ["a.pt", "--backend", "gym", "--transport", "tcp"],
            "--transport: says how to reach the local env server; --backend gym has no servers",
        ),
        (["a.pt", "--backend", "gym", "--no-step-socket"], "--no-step-socket: says how to reach env servers"),
        (["a.pt", "--timeout", "0"], "argument --timeout: expected seconds > 0, got '0'"),
    ],
)
def test_eval_refuses_options_that_do_not_go_together(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"learner eval: error: {message}" in err, err


@pytest.mark.needs_torch
def test_eval_on_running_servers_with_the_token_from_the_environment(
    trained_run: Path, start_servers: StartServers, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    addresses = start_servers("tests.envs:ClockEnv", 2, 1, env_kwargs={"length": 3}, auth_token="s3cret")
    monkeypatch.setenv("ENVFLEET_AUTH_TOKEN", "s3cret")
    capsys.readouterr()
    args = ["eval", "--checkpoint", str(trained_run), "--episodes", "4", "--servers", ",".join(addresses)]
    assert main([*args, "--timeout", "10", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["episodes"] == 4 and result["length_mean"] == 3.0


@pytest.mark.needs_torch
def test_plot_overlays_runs_into_one_png(trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other"
    other.mkdir()
    rows = [
        {"update": i, "global_step": 16 * i, "seconds": 0.1 * i, "episodic_return_mean": float(i)} for i in range(1, 6)
    ]
    rundir.rewrite_jsonl(other / rundir.METRICS, rows)
    out = tmp_path / "both.png"
    assert main(["plot", str(trained_run), str(other), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(out) in capsys.readouterr().out
    assert main(["plot", str(tmp_path / "missing")]) == 1
    assert f"{tmp_path / 'missing'}: no such run dir" in capsys.readouterr().err
    assert main(["plot", str(tmp_path)]) == 1
    assert f"{tmp_path}: expected a run dir with metrics.jsonl, found none" in capsys.readouterr().err
    # Runs with no mean return yet: left out, or, when that is every run, nothing is written.
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / rundir.METRICS).write_text('{"update": 1, "global_step": 8, "episodic_return_mean": null}\n{"upd')
    assert main(["plot", str(empty), "-o", str(tmp_path / "none.png")]) == 1
    assert f"nothing to plot: no mean return in {empty}" in capsys.readouterr().err
    assert not (tmp_path / "none.png").exists()
    assert main(["plot", str(empty), str(other), "-o", str(tmp_path / "one.png")]) == 0
    assert (tmp_path / "one.png").is_file()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-envs", "3"], "--num-envs: 3 envs do not split evenly over --num-servers 2"),
        (["--num-steps", "0"], "--num-steps: expected an integer >= 1, got 0"),
        (["--seed", str(2**32)], "--seed: expected an integer from 0 to 2**32 - 1 (4294967295), got 4294967296"),
        (["--device", "tpu"], "--device: expected auto, cpu, cuda or cuda:N, got 'tpu'"),
        (["--env-kwargs", "[1]"], "expected a JSON object like '{\"key\": 1}', got list: '[1]'"),
        (["--env-kwargs", "{a: 1}"], "expected a JSON object, got '{a: 1}': not valid JSON (Expecting property name"),
        (["--env-kwargs", "[" * 100_000], "--env-kwargs: expected a JSON object, got JSON nested too deeply to read"),
        (["--env-kwargs", '{"a": ' + "1" * 5000 + "}"], "expected a JSON object Python can read, got one it cannot"),
        (["--servers", "a:1", "--backend", "gym"], "cannot go with --backend gym"),
        (["--servers", "a:1", "--num-envs", "4"], "--num-envs: configures the env servers this command starts"),
        (["--servers", ""], "--servers: expected addresses such as host:port,host:port, got ''"),
        # (was exit status 1, once started: "error: server address ...", no option named)
        (["--servers", "localhost:notaport"], "--servers: server address 'localhost:notaport': port 'notaport' is not"),
        (["--servers", "a:1,http://b:2"], "--servers: server address 'http://b:2': unknown scheme 'http'"),
        pytest.param(
            ["--resume", "/nonexistent/run"],
            "--resume: expected a run dir holding config.json",
            marks=pytest.mark.needs_torch,  # (checked once torch is imported)
        ),
        (["--steps", "8"], "unrecognized arguments: --steps 8"),
        (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
        (["--hidden-sizes", "64,,64"], "argument --hidden-sizes: expected comma-separated integers such as 64,64"),
        (["--total-timesteps", "1.5e3x"], "argument --total-timesteps: expected an integer, got '1.5e3x'"),
        (["--total-timesteps", "1.5"], "argument --total-timesteps: expected an integer, got '1.5'"),
        (["--stop-at-return", "nan"], "--stop-at-return: expected a finite number, or inf (never), got nan"),
        (["--stop-at-return=-inf"], "--stop-at-return: expected a finite number, or inf (never), got -inf"),
        (["--timeout", "inf"], "--timeout: expected a finite number, got inf"),
        (["--connect-timeout", "inf"], "--connect-timeout: expected a finite number, got inf"),
        (["--give-up-after", "nan"], "--give-up-after: expected a value > 0, got nan"),
        (["--step-delay-ms", "nan"], "--step-delay-ms: expected a finite number, got nan"),
        (["--timeout", "abc"], "argument --timeout: expected a number, got 'abc'"),
        (["--learning-rate", "fast"], "argument --learning-rate: expected a number, got 'fast'"),
        (["--vf-coef", "-1"], "--vf-coef: expected a value >= 0, got -1.0"),
        (["--wrappers", "foo"], "--wrappers: expected names among atari, clip-action, flatten, got unknown wrapper"),
        (["--wrappers", "atari,atari"], "--wrappers: expected each wrapper at most once"),
        (["--env", ""], "--env: expected a value, got an empty string"),
        (["--run-dir", ""], "--run-dir: expected a value, got an empty string"),
        pytest.param(
            ["--resume", ""],
            "--resume: expected a value, got an empty string",
            marks=pytest.mark.needs_torch,  # (checked once torch is imported)
        ),
        (["--tls"], "--tls: connects to running --servers with TLS; the env servers this command starts speak"),
        (["--tls-ca", "ca.pem"], "--tls-ca: connects to running --servers with TLS"),
        (["--servers", "a:1", "--tls-ca", "/nonexistent/ca.pem"], "--tls-ca /nonexistent/ca.pem: cannot read it"),
    ],
)
def test_train_rejects_bad_options_naming_them(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *argv])
    assert exit_info.value.code == 2
    # A short usage line (not train's ~30 lines of options) and the error.
    usage, error = capsys.readouterr().err.splitlines()
    assert usage == "usage: learner train [options]; see learner train --help"
    assert error.startswith("learner train: error: ") and message in error, error


@pytest.mark.needs_torch
def test_a_run_dir_that_cannot_be_made_is_named_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "notes.txt"
    a_file.write_text("")
    for run_dir in (a_file, a_file / "run"):
        assert main(["train", *CLOCK, "--backend", "gym", "--run-dir", str(run_dir)]) == 1
        err = capsys.readouterr().err
        assert f"--run-dir: cannot make {run_dir}: {a_file} is a file, not a directory" in err, err


@pytest.mark.parametrize("argv", [[], ["--bogus"], ["--log-level", "info"]])
def test_no_command_names_the_commands(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "learner: error: expected a command, one of: demo, check, train, eval, servers, plot, bench (learner COMMAND --help "
        "says more)"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["eval", "--checkpoint", "notes.txt"], "notes.txt: expected an envfleet checkpoint"),
    ],
)
@pytest.mark.needs_torch
def test_eval_refuses_bad_input_before_doing_anything(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    argv = [str(tmp_path / a) if a == "notes.txt" else a for a in argv]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert f"learner {argv[0]}: error: " in err and message in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rounds", "0"], "--rounds: expected an integer >= 1, got 0"),
        (["--seconds", "-1"], "argument --seconds: expected seconds > 0, got '-1'"),
        (["--seconds", "inf"], "argument --seconds: expected seconds > 0, got 'inf'"),
        (["--seconds", "abc"], "argument --seconds: expected seconds > 0, got 'abc'"),
        (["--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'"),
        (["--suites", "speed"], "--suites: unknown ['speed']"),
        (["--suites", ""], "--suites: expected some of ['throughput', 'latency', 'ppo', 'rpc'], got none"),
        (["--suites", "throughput", "--workloads", ""], "--workloads: expected some of ['cartpole-8', "),
        (["--ppo-sizes", "0"], "--ppo-sizes: expected numbers of envs >= 1 such as 1,8,64"),
        (["--ppo-layouts", "gym,udp"], "--ppo-layouts: unknown ['udp']; expected some of ['gym', 'tcp', 'grpc', "),
        (["--suites", "ppo", "--ppo-layouts", ""], "--ppo-layouts: expected some of ['gym', 'tcp', "),
        (["--suites", "ppo", "--ppo-sizes", "3"], "--ppo-sizes: [3] do not split evenly over the layouts' servers"),
        (["--suites", "ppo", "--ppo-sizes", "1,8"], "--ppo-sizes: [1] do not split evenly"),
        (["--suites", "ppo", "--ppo-sizes", "4,10"], "--ppo-sizes: [10] do not split evenly"),
        (["--suites", "latency", "--latency-sizes", "1,3"], "--latency-sizes: [3] do not split evenly"),
        (["--suites", "latency", "--latency-sizes", "2,18"], "--latency-sizes: [18] do not split evenly"),
        (["--latency-sizes", "1,,2"], "argument --latency-sizes: expected comma-separated numbers of envs such as"),
        (["--latency-delay-ms", "0"], "argument --latency-delay-ms: expected milliseconds > 0, got '0'"),
        pytest.param(
            ["--suites", "ppo", "--ppo-env", "Nope-v0"],
            "--ppo-env: cannot build 'Nope-v0'",
            marks=pytest.mark.needs_torch,  # (checked once torch is imported)
        ),
        pytest.param(
            ["--out", "notes.txt/bench"],
            "--out: cannot make {tmp}/notes.txt/bench: {tmp}/notes.txt is a file, not a",
            marks=pytest.mark.needs_torch,  # (checked once torch is imported)
        ),
    ],
)
@pytest.mark.slow
def test_bench_refuses_bad_options_before_measuring(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("a file\n")
    argv = [str(tmp_path / a) if a.startswith("notes.txt") else a for a in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "bench")]
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv, *out])
    assert exit_info.value.code == 2
    usage, error = capsys.readouterr().err.splitlines()
    assert usage.startswith("usage: learner bench") and error.startswith("learner bench: error: "), error
    assert message.format(tmp=tmp_path) in error, error
    assert not (tmp_path / "bench").exists()


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ("p", "argument -o/--output: writes a PNG; expected a file name ending in .png (e.g. returns.png), got"),
        ("p.jpg", "argument -o/--output: writes a PNG; expected a file name ending in .png"),
        ("notes.txt/p.png", "-o/--output: cannot write {tmp}/notes.txt/p.png: {tmp}/notes.txt is a file, not a"),
        ("folder.png", "-o/--output: {tmp}/folder.png is a directory; expected a file name ending in .png"),
    ],
)
@pytest.mark.needs_torch
def test_plot_refuses_an_output_it_cannot_write_as_a_png(
    trained_run: Path, tmp_path: Path, output: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "notes.txt").write_text("a file\n")
    (tmp_path / "folder.png").mkdir()
    with pytest.raises(SystemExit) as exit_info:
        main(["plot", str(trained_run), "-o", str(tmp_path / output)])
    assert exit_info.value.code == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err


@pytest.mark.needs_torch
def test_train_reports_an_unknown_env_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--env", "NoSuchEnv-v0", "--backend", "gym", "--run-dir", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err
    assert "NoSuchEnv-v0" in err and "Traceback" not in err


def test_importing_learner_and_env_server_does_not_import_torch() -> None:
    code = "import sys, learner, learner.cli, env_server, env_server.server; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_closed_stdout_ends_a_command_without_a_traceback(tmp_path: Path) -> None:
    """``learner servers ... | head -1``: the reader gone, the command ends with status 1 and no
    BrokenPipeError traceback (nor Python's "Exception ignored" at its exit)."""
    read, write = os.pipe()
    os.close(read)  # (the first write to stdout fails)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "learner", "servers", "--timeout", "1", f"unix:{tmp_path / 'none.sock'}"],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write)
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr
    # Another pipe's (a socket's), stdout open: an error as any other, its traceback shown.
    code = "import learner.cli as c\ndef broken(*a, **k):\n    raise BrokenPipeError(32, 'a socket')\n"
    code += "c._command = broken\nc.run()\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "BrokenPipeError: [Errno 32] a socket" in proc.stderr, proc.stderr


def test_train_help_lists_every_option_with_its_docstring() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "learner", "train", "--help"], check=True, capture_output=True, text=True
    ).stdout
    assert "--stop-at-return X" in out and "last 20 finished" in out and "--servers ADDRESSES" in out
    assert "--norm-obs, --no-norm-obs" in out and "classic" in out and "ALE/Pong-v5" in out
    flat = " ".join(out.split())
    assert "as a JSON object, for the servers this command starts" in flat  # --env-kwargs, as --wrappers says
    for variable in ("ENVFLEET_TLS_CA", "ENVFLEET_TLS_SERVER_NAME", "ENVFLEET_AUTH_TOKEN_FILE"):
        assert f"${variable}" in flat, variable


def test_log_level_goes_before_or_after_the_command_and_every_option_says_what_it_does() -> None:
    parser = build_parser()
    assert parser.parse_args(["plot", "r"]).log_level == "warning"
    assert parser.parse_args(["--log-level", "debug", "plot", "r"]).log_level == "debug"
    assert parser.parse_args(["--log-level", "debug", "train", "--log-level", "info"]).log_level == "info"
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert sorted(commands) == ["bench", "check", "demo", "eval", "plot", "servers", "train"]
    for name, command in [("learner", parser), *commands.items()]:
        for action in command._actions:
            assert action.help or action.dest == "command", (
                f"{name} {'/'.join(action.option_strings) or action.dest}: no help"
            )
        assert "--log-level LEVEL" in command.format_help(), name
    assert commands["train"].format_help().count("(default: CartPole-v1") == 1


def test_a_command_that_needs_torch_says_how_to_install_it(tmp_path: Path) -> None:
    for argv in (["train", "--backend", "gym", "--run-dir", str(tmp_path / "r")], ["eval", "--checkpoint", "r"]):
        code = f"import sys; sys.modules['torch'] = None; from learner.cli import main; sys.exit(main({argv!r}))"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert proc.returncode == 1, proc.stderr
        assert proc.stderr.splitlines() == [
            f"learner {argv[0]}: error: needs torch, which is not installed here: pip install torch (on a CPU-only "
            "machine, the small CPU build: pip install torch --index-url https://download.pytorch.org/whl/cpu), "
            "then pip install 'envfleet[learner]' (from a clone: pip install -e '.[learner]')"
        ]


def test_training_from_python_without_torch_says_how_to_install_it() -> None:
    code = "import sys; sys.modules['torch'] = None; from learner.train import train"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        "ModuleNotFoundError: learner.train needs torch, which is not installed here: pip install torch (on a "
        "CPU-only machine, the small CPU build: pip install torch --index-url https://download.pytorch.org/whl/cpu), "
        "then pip install 'envfleet[learner]' (from a clone: pip install -e '.[learner]')"
    )


@pytest.mark.needs_torch
def test_the_demo_counts_threads_python_does_not_know_of_before_it_forks() -> None:
    """torch's (OpenMP) and gRPC's C-core threads: a demo run after them forked a multi-threaded process
    (Python 3.12+ warns of its deadlocks): its forkserver is for any thread, not Python's alone."""
    code = (
        "import threading, torch; torch.set_num_threads(2); torch.ones(300, 300) @ torch.ones(300, 300); "
        "from learner.cli import _threads; print(_threads() > threading.active_count())"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "True", proc.stderr


def test_a_broken_torch_install_is_not_said_to_be_missing(tmp_path: Path) -> None:
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("import a_module_torch_needs_xyz\n")
    environ = {**os.environ, "PYTHONPATH": str(tmp_path)}
    code = "from learner.train import train"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ)
    assert proc.stderr.splitlines()[-1] == "ModuleNotFoundError: No module named 'a_module_torch_needs_xyz'"


def _train_until_its_first_update(argv: list[str], run: Path) -> subprocess.Popen[str]:
    """``learner train ARGV --run-dir RUN`` in a subprocess, returned once it has made its first update."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "learner", "train", *argv, "--run-dir", str(run)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not (run / rundir.METRICS).exists() or not rundir.read_jsonl(run / rundir.METRICS):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no update from learner train {' '.join(argv)}: {proc.communicate()}")
        time.sleep(0.05)
    return proc


@pytest.mark.slow
@pytest.mark.needs_torch
def test_ctrl_c_stops_a_shell_loop_of_runs_not_only_the_run_it_came_in(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches the shell and its command: bash goes on with the loop where the command
    exited (even with 130: taken as handled there), and stops it where the command died of the SIGINT."""
    command = shlex.join([sys.executable, "-m", "learner", "train", *CLOCK, "--backend", "gym", "--num-envs", "2"])
    loop = f'for seed in 1 2; do {command} --num-steps 8 --total-timesteps 100000000 --seed $seed --run-dir run-$seed; echo "went on: $?"; done'
    shell = subprocess.Popen(
        ["bash", "-c", loop],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # (its own process group, as a terminal's foreground job)
        # (a CI's background job has SIGINT ignored, and a shell keeps an ignored signal ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "run-1" / rundir.METRICS).exists() or not rundir.read_jsonl(
            tmp_path / "run-1" / rundir.METRICS
        ):
            assert shell.poll() is None and time.monotonic() < deadline, shell.communicate()
            time.sleep(0.05)
        os.killpg(shell.pid, signal.SIGINT)  # Ctrl-C
        out, err = shell.communicate(timeout=60)
    finally:
        if shell.poll() is None:
            os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
    assert shell.returncode == -signal.SIGINT and "went on" not in out, (out, err[-3000:])  # (bash too)
    assert rundir.read_json(tmp_path / "run-1" / rundir.SUMMARY)["stop_reason"] == "interrupted"
    assert not (tmp_path / "run-2").exists() and "Traceback" not in err, err


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux's /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the local servers in /proc")
@pytest.mark.slow
@pytest.mark.needs_torch
def test_a_second_ctrl_c_aborts_in_one_line_and_still_stops_the_local_servers(tmp_path: Path) -> None:
    run, gate = tmp_path / "run", tmp_path / "in-step"
    # One local server whose env holds its second step (the second rollout's, after an update and its
    # checkpoint) until the gate file is removed: both Ctrl-Cs come while the learner waits for that step.
    env = ["--env", "tests.envs:GateEnv", "--env-kwargs", json.dumps({"gate": str(gate), "at": 2})]
    argv = [*env, "--num-servers", "1", "--envs-per-server", "1", "--num-steps", "1", "--total-timesteps", "1000"]
    argv += ["--no-progress", "--no-tensorboard", "--no-plot", "--run-dir", str(run)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "learner", "train", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not gate.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"the learner never reached its second step: {proc.communicate()}")
            time.sleep(0.05)
        servers = _children(proc.pid)
        assert servers and rundir.read_jsonl(run / rundir.METRICS)
        proc.send_signal(signal.SIGINT)  # a stop after this step is asked for
        assert proc.stderr is not None
        for line in proc.stderr:
            if "Ctrl-C again to abort at once" in line:
                break
        time.sleep(DOUBLE_TAP_S)  # (sooner, it would be the same press)
        proc.send_signal(signal.SIGINT)  # the step still waits at the gate
        # At once: the learner leaves the step still held at the gate and writes its summary. Then the
        # gate opens, so that the server, which the learner stops next, need not wait for its step.
        while not (run / rundir.SUMMARY).exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        summarised_in_step = (run / rundir.SUMMARY).exists()  # (the step cannot end before the gate opens)
        gate.unlink()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == CTRL_C_EXIT, err
    # It says where a resumed run starts: the checkpoint of the update before the step it was aborted in.
    assert err.strip().splitlines()[-1] == (
        f"learner train: aborted; resuming starts from its last checkpoint, step-0000000001.pt, with: "
        f"learner train --resume {run}"
    )
    assert "Traceback" not in err, err
    assert summarised_in_step
    assert not [pid for pid in servers if Path(f"/proc/{pid}").exists()]
    assert rundir.read_json(run / rundir.SUMMARY)["stop_reason"] == "interrupted"


@pytest.mark.parametrize(
    ("signals", "backend"),
    [
        ([signal.SIGINT], "gym"),
        ([signal.SIGINT, signal.SIGINT], "gym"),  # (a double tap: the same press)
        ([signal.SIGINT, signal.SIGINT], "remote"),  # (the second while its servers stop)
        ([signal.SIGTERM, signal.SIGTERM], "gym"),  # (a second one changes nothing)
        ([signal.SIGINT, signal.SIGTERM], "remote"),  # (nor a SIGTERM after a Ctrl-C)
        ([signal.SIGHUP], "gym"),  # (the terminal closed)
    ],
    ids=["ctrl-c", "ctrl-c-double-tap", "ctrl-c-double-tap-remote", "sigterm-twice", "ctrl-c-sigterm-remote", "sighup"],
)
@pytest.mark.slow
@pytest.mark.needs_torch
def test_ctrl_c_stops_at_the_next_step_with_a_checkpoint_and_a_summary(
    signals: list[signal.Signals], backend: str, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    argv = [*CLOCK, "--backend", backend, "--num-envs", "2", "--num-steps", "8", "--total-timesteps", "100000000"]
    proc = _train_until_its_first_update([*argv, "--no-plot"], run)
    try:
        for signum in signals:
            proc.send_signal(signum)
            # (the second: while the run stops, its servers stop, or the process exits; well within the
            # 0.5 s double-tap window even when a loaded machine stalls the sender)
            time.sleep(0.05)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == (CTRL_C_EXIT if signals[0] == signal.SIGINT else 130), err
    assert "aborted" not in err and "Traceback" not in err, err
    summary = rundir.read_json(run / rundir.SUMMARY)
    assert summary["stop_reason"] == "interrupted"
    assert rundir.list_checkpoints(run)[-1].name == f"step-{summary['total_steps']:010d}.pt"
    assert "not solved" not in out
    assert f"interrupted at step {summary['total_steps']:,} (its last update); " in out
    assert f"continue with: learner train --resume {run}" in out
    assert "learner eval" not in out  # (what a finished run suggests)


@pytest.mark.needs_torch
def test_a_run_stopped_in_an_update_says_whether_and_where_it_resumes() -> None:
    # Two Ctrl-Cs land in an update only by chance: the wording is checked on its own, as the run words it.
    from learner.checkpointing import stopped_in_update

    assert stopped_in_update(None) == (
        "stopped during an update: no checkpoint written, and none was before (see --checkpoint-every): "
        "resuming starts this run over"
    )
    assert stopped_in_update(1600).endswith("no checkpoint of it written; resuming starts at the last one, step 1,600")


def test_a_run_stopped_says_from_what_is_on_disk_whether_and_where_it_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert interrupted_line(run, 48) == (
        f"interrupted at step 48; no checkpoint is on disk: learner train --resume {run} starts it over"
    )
    rundir.checkpoint_path(run, 32).parent.mkdir(parents=True)
    rundir.checkpoint_path(run, 32).touch()
    assert interrupted_line(run, 48) == (
        "interrupted at step 48 (its last update, not checkpointed); continue from its last checkpoint, "
        f"step-0000000032.pt, with: learner train --resume {run}"
    )
    rundir.checkpoint_path(run, 48).touch()
    assert (
        interrupted_line(run, 48)
        == f"interrupted at step 48 (its last update); continue with: learner train --resume {run}"
    )
    # A second Ctrl-C: the checkpoint a resumed run starts from, or that there is none.
    assert aborted_line(None) == "aborted"  # (before a new run's dir was made)
    assert aborted_line(tmp_path / "new") == "aborted (before the run dir was made)"
    (tmp_path / "new").mkdir()
    new = tmp_path / "new"
    # (its config.json not written yet: --resume would refuse the dir)
    assert aborted_line(new) == f"aborted before anything of the run was written to {new}: run the same command again"
    (new / rundir.CONFIG).write_text("{}")
    assert aborted_line(new) == f"aborted; no checkpoint is in {new}: learner train --resume {new} starts it over"
    (run / rundir.CONFIG).write_text("{}")
    assert aborted_line(run) == (
        f"aborted; resuming starts from its last checkpoint, step-0000000048.pt, with: learner train --resume {run}"
    )


@pytest.mark.parametrize("argv", [["--version"], ["train", "--version"], ["eval", "--version"]])
def test_version(argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The version and, where known, the commit (the version is the same at every commit), as config.json's
    envfleet_commit says it, shortened; git is run for --version only, not to build the parser."""
    from env_server import protocol

    def no_git() -> str:
        raise AssertionError("source_commit() called without --version")

    monkeypatch.setattr(protocol, "source_commit", no_git)
    build_parser().parse_args(["plot", "r"])
    for commit, said in (("863ce9c5ab12" + "0" * 28 + "+dirty", " (commit 863ce9c5ab12+dirty)"), (None, "")):
        monkeypatch.setattr(protocol, "source_commit", lambda commit=commit: commit)
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 0
        assert re.fullmatch(
            rf"learner \(envfleet\) \d\S*( \(not installed\))?{re.escape(said)}\n", capsys.readouterr().out
        )


def test_the_error_a_command_ends_with_is_a_json_record_under_log_format_json(tmp_path: Path) -> None:
    """Was the plain line "learner plot: error: ..." among the JSON records, the one that says why the
    process exited without a time or a level, which a log collector cannot parse."""
    missing = tmp_path / "none"
    command = [sys.executable, "-m", "learner", "--log-format", "json", "plot", str(missing)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    [record] = [json.loads(line) for line in proc.stderr.splitlines()]
    assert (record["level"], record["logger"], record["message"]) == (
        "ERROR",
        "learner.cli",
        f"{missing}: no such run dir",
    )
    proc = subprocess.run(
        [*command[:3], *command[5:]], capture_output=True, text=True, timeout=120
    )  # (text: as it was)
    assert (proc.returncode, proc.stderr) == (1, f"learner plot: error: {missing}: no such run dir\n")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["eval", ""], "argument PATH: expected a path, got an empty string"),
        (["eval", "--checkpoint", ""], "argument --checkpoint: expected a path, got an empty string"),
        (["eval", "r", "--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'"),
        (["eval", "r", "--device", "gpu"], "argument --device: expected auto, cpu, cuda or cuda:N, got 'gpu'"),
        (["eval", "r", "--wrappers", "foo"], "--wrappers: expected names among atari, clip-action, flatten"),
        (["eval", "r", "--tls"], "--tls: connects to running --servers with TLS; the env server this command"),
        (["eval", "r", "--auth-token", "a b"], "--auth-token: expected printable ASCII without spaces"),
        (["eval", "r", "--auth-token", ""], "--auth-token: expected a non-empty token, got an empty one"),
        (["eval", "r", "--servers", "a:1", "--tls-server-name", "x"], "--tls-server-name: applies to TLS connections"),
        (["servers", "--servers", ""], "--servers: expected addresses such as host:port,host:port, got ''"),
        (["eval", "r", "--servers", "a:x"], "--servers: server address 'a:x': port 'x' is not a number"),
        (["servers", "a:1,b:x"], "ADDRESSES: server address 'b:x': port 'x' is not a number"),
        (["servers", "--servers", "[::1:5"], "--servers: server address '[::1:5': unbalanced brackets"),
        (
            ["servers"],
            "expected the servers' addresses, as ADDRESSES or --servers ADDRESSES (one of the two), got neither",
        ),
        (["servers", "a:1", "--servers", "b:2"], "ADDRESSES (one of the two), got both: a:1 and --servers b:2"),
        (["servers", "--servers", "a:1", "--tls-server-name", "x"], "--tls-server-name: applies to TLS connections"),
        (["servers", "--servers", "a:1", "--tls-ca", "/nonexistent/ca.pem"], "--tls-ca /nonexistent/ca.pem: cannot"),
        (["servers", "--servers", "a:1", "--auth-token", ""], "--auth-token: expected a non-empty token"),
        (["demo", "--env", ""], "--env: expected a gymnasium id or a package.module:Name entry point, got ''"),
    ],
)
def test_eval_servers_and_demo_refuse_bad_options_as_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked as train checks the same options, before anything starts: exit status 2 and a usage line."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    usage, error = capsys.readouterr().err.splitlines()
    assert usage == f"usage: learner {argv[0]} [options]; see learner {argv[0]} --help"
    assert error.startswith(f"learner {argv[0]}: error: ") and message in error, error


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--env", "NoSuchEnv-v0"], "--env NoSuchEnv-v0: cannot build it: NameNotFound: Environment `NoSuchEnv`"),
        (["--env-kwargs", '{"foo": 1}'], 'cannot build it with --env-kwargs {"foo": 1}: TypeError: '),
    ],
)
def test_demo_names_an_env_it_cannot_build_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", *argv, "--steps", "1"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and message in err, err
    assert "envfleet demo:" not in capsys.readouterr().out  # (said before any banner or server)


def _descendants(pid: int) -> list[int]:
    """Process ``pid``'s children, theirs, and so on (Linux's /proc/PID/task/TID/children)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        try:  # (one that ended meanwhile: the glob itself raised ProcessLookupError, ESRCH, failing the test)
            listings = list(Path(f"/proc/{todo.pop()}/task").glob("*/children"))
        except OSError:
            continue
        for listed in listings:
            with contextlib.suppress(OSError, ValueError):
                children = [int(child) for child in listed.read_text().split()]
                found += children
                todo += children
    return found


@pytest.mark.slow
@pytest.mark.parametrize("when", ["starting", "stepping"])
def test_a_ctrl_c_while_the_demo_steps_asyncvectorenv_prints_no_worker_traceback(when: str) -> None:
    """A terminal's Ctrl-C reaches the whole process group: the AsyncVectorEnv's workers, forked with the
    learner's handlers, each printed a KeyboardInterrupt traceback (and a BrokenPipeError); started by a
    forkserver (numpy's threads are enough for one), they and it printed one as they imported what they run."""
    command = [sys.executable, "-m", "learner", "demo", "--steps", "1000000"]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as demo:
        try:
            assert demo.stdout is not None
            assert demo.stdout.readline().startswith("envfleet demo: ")
            if when == "starting":  # (once its forkserver starts workers: its resource tracker, it and 2 of them)
                deadline = time.monotonic() + 60
                while len(_descendants(demo.pid)) < 4:
                    assert time.monotonic() < deadline and demo.poll() is None, "no workers started"
                    time.sleep(0.001)
            else:
                time.sleep(1.0)  # (its workers stepping)
            os.killpg(demo.pid, signal.SIGINT)
            rest = demo.stdout.read()
            assert demo.wait(timeout=60) == CTRL_C_EXIT, rest
        finally:  # (a failure before the Ctrl-C: the demo of a million steps is not waited for, by Popen's exit)
            if demo.poll() is None:
                os.killpg(demo.pid, signal.SIGKILL)
    assert rest.strip() == "learner demo: aborted", rest


@pytest.mark.needs_torch
def test_resume_given_a_checkpoint_file_goes_on_from_it_in_its_run_dir(
    trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """README's `--resume RUN/checkpoints/step-N.pt` (it was refused: only a run dir was taken), and a
    checkpoint outside a run dir's checkpoints/ refused, saying what to pass."""
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    first, *newer = rundir.list_checkpoints(run)
    assert newer, "the run has a checkpoint after its first"
    assert main(["train", "--resume", str(first), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "32 env steps in" in out and f"run dir: {run}" in out, out
    assert (run / rundir.CHECKPOINTS / f"{newer[0].name}.abandoned").is_file()  # (the run it went on from: first)
    elsewhere = tmp_path / "copy.pt"
    shutil.copy(first, elsewhere)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--resume", str(elsewhere)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"or a checkpoint in its checkpoints/ folder, got the file {elsewhere}; pass the run dir it belongs" in err


@pytest.mark.needs_torch
def test_a_run_with_nothing_to_learn_from_exits_with_its_envs_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env = ["--env", "tests.envs:FaultyEnv", "--env-kwargs", '{"raise_in_reset": 0, "fault_env": -1}']
    argv = [*env, "--backend", "gym", "--num-envs", "2", "--num-steps", "4", "--total-timesteps", "1000000"]
    run = tmp_path / "run"
    assert main(["train", *argv, "--no-progress", "--no-tensorboard", "--no-plot", "--run-dir", str(run)]) == 1
    err = capsys.readouterr().err
    assert (
        "learner train: error: no env gave a transition in 3 rollouts in a row: nothing to learn from, the run "
        "stops; the envs reported: reset: RuntimeError: reset failed on purpose"
    ) in err, err
    assert "Traceback" not in err
    assert rundir.read_json(run / rundir.SUMMARY)["stop_reason"].startswith("error: NothingToLearnError: ")


@pytest.mark.parametrize(
    ("argv", "environ", "token_file", "message"),
    [
        (["--auth-token", "a"], {}, "b\n", "--auth-token and --auth-token-file: give one of them, not both"),
        ([], {}, " \n", "--auth-token-file {file}: expected a non-empty token, got an empty one"),
        ([], {"ENVFLEET_AUTH_TOKEN_FILE": "{file}"}, "", "$ENVFLEET_AUTH_TOKEN_FILE {file}: expected a non-empty"),
        (
            [],
            {"ENVFLEET_AUTH_TOKEN_FILE": "{file}", "ENVFLEET_AUTH_TOKEN": "a"},
            "b",
            "$ENVFLEET_AUTH_TOKEN and $ENVFLEET_AUTH_TOKEN_FILE: both are set; set one of them, not both",
        ),
        ([], {"ENVFLEET_AUTH_TOKEN_FILE": "{file}.missing"}, "b", "{file}.missing: cannot read it: No such file"),
    ],
)
def test_train_refuses_a_token_file_it_cannot_use(
    argv: list[str],
    environ: dict[str, str],
    token_file: str,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    file = tmp_path / "token"
    file.write_text(token_file)
    monkeypatch.delenv("ENVFLEET_AUTH_TOKEN", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value.format(file=file))
    if not environ:
        argv = [*argv, "--auth-token-file", str(file)]
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *CLOCK, "--backend", "gym", "--run-dir", str(tmp_path / "run"), *argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith("learner train: error: ") and message.format(file=file) in error, error
    assert not (tmp_path / "run").exists()


@pytest.mark.needs_torch
def test_train_takes_tls_and_a_token_file_from_the_environment_as_a_service_does(
    spawn_server: SpawnServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A learner service (compose, Swarm) is configured by variables: the CA and server name env-server's
    health probe reads, and a mounted token file; the token never reaches the run dir."""
    certs = make_server_certs(tmp_path / "certs", names=("localhost", "127.0.0.1", "envfleet.test"))
    tls = ["--tls-cert", str(certs.cert), "--tls-key", str(certs.key)]
    server = spawn_server("tests.envs:ClockEnv", 2, *tls, environ={"ENVFLEET_AUTH_TOKEN": "s3cret"})
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")  # (as `echo s3cret > secret` writes it)
    monkeypatch.delenv("ENVFLEET_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("ENVFLEET_AUTH_TOKEN_FILE", str(secret))
    monkeypatch.setenv("ENVFLEET_TLS_CA", str(certs.ca))
    monkeypatch.setenv("ENVFLEET_TLS_SERVER_NAME", "envfleet.test")
    run = tmp_path / "run"
    argv = ["--servers", server.address, "--num-steps", "4", "--total-timesteps", "8", "--no-progress", "--no-plot"]
    assert main(["train", *argv, "--no-tensorboard", "--run-dir", str(run)]) == 0, capsys.readouterr().err
    config = rundir.read_json(run / rundir.CONFIG)
    saved = config["args"]
    assert (saved["tls_ca"], saved["tls_server_name"]) == (str(certs.ca), "envfleet.test")
    assert list(config["server_versions"]) == [server.address]  # what the server runs, as it said
    assert config["server_versions"][server.address]["gymnasium"] == config["versions"]["gymnasium"]
    assert "s3cret" not in (run / rundir.CONFIG).read_text()
    assert all("s3cret" not in path.read_text() for path in run.glob("*.json*"))
    # eval, from the same variables; and locally, its own server needs neither (nor inherits the file).
    capsys.readouterr()
    assert main(["eval", str(run), "--episodes", "2", "--servers", server.address, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["episodes"] == 2
    assert main(["eval", str(run), "--env", "tests.envs:ClockEnv", "--episodes", "2", "--json"]) == 0
    # A CA path for containers (compose's /certs/ca.crt), exported in the host's shell: named as the variable's.
    monkeypatch.setenv("ENVFLEET_TLS_CA", "/certs/ca.crt")
    with pytest.raises(SystemExit):
        main(["eval", str(run), "--episodes", "2", "--servers", server.address])
    assert "$ENVFLEET_TLS_CA /certs/ca.crt: cannot read it (No such file or directory); it gives --tls-ca" in (
        capsys.readouterr().err
    )


@pytest.mark.needs_torch
def test_connect_timeout_is_how_long_train_waits_for_servers_to_come_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dns: name with no server ready yet (a Kubernetes Service before its first pod is Ready) is
    waited for --connect-timeout seconds, then named; and the option is checked."""
    not_found_at_once(monkeypatch, "env-not-there.invalid")
    started = time.monotonic()
    argv = ["train", "--servers", "dns:///env-not-there.invalid:50051", "--total-timesteps", "64"]
    assert main([*argv, "--connect-timeout", "2", "--run-dir", str(tmp_path / "run")]) == 1
    assert 1 <= time.monotonic() - started < 30  # (looked up every 0.5 s until the next would be late)
    assert "cannot resolve 'env-not-there.invalid'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit):
        main([*argv, "--connect-timeout", "0"])
    assert "--connect-timeout: expected a value > 0, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["sigterm", "sighup"])
@pytest.mark.slow
@pytest.mark.needs_torch
def test_sigterm_while_train_starts_aborts_as_ctrl_c_does(signum: signal.Signals, tmp_path: Path) -> None:
    """Before training begins (here: waiting for a server that does not answer), SIGTERM or SIGHUP ends
    the command as Ctrl-C does, saying so, not silently by the signal's default."""
    # The port stays bound (not listening) until the learner has ended: connections to it are refused, and no
    # other process can listen there meanwhile. Closed at once, as it was, another process could take it in the
    # seconds before the learner connected (an env server on port 0, of a test running beside this one): the
    # learner then connected to that server and trained, never said it waits, and was never signalled.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"  # (bound, not listening: nothing answers there)
        argv = ["--servers", address, "--connect-timeout", "60", "--run-dir", str(tmp_path / "run"), "--no-progress"]
        proc = subprocess.Popen(
            [sys.executable, "-X", "faulthandler", "-m", "learner", "train", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        said: list[str] = []  # (its lines up to the signal: the failures' messages show them too)
        try:
            assert proc.stderr is not None
            for line in proc.stderr:
                said.append(line)
                if "not answering yet" in line:
                    break
            else:
                pytest.fail(f"it ended ({proc.wait()}) without saying it waits for the server: {''.join(said)}")
            proc.send_signal(signum)
            try:
                err = "".join(said) + proc.communicate(timeout=30)[1]
            except subprocess.TimeoutExpired:  # (once, in CI, it ran on: where each thread was, for the report)
                proc.send_signal(signal.SIGABRT)  # (-X faulthandler: the threads' tracebacks, on stderr)
                left = proc.communicate(timeout=30)[1]
                pytest.fail(f"still running 30 s after the signal; it said: {''.join(said)}{left}")
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1].startswith("learner train: aborted"), err
    assert "Traceback" not in err, err


def test_the_learner_command_runs_with_its_signals_going_straight_to_ignored_after_a_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The console script (run()) passes then_exit; main(), a library's or a test's call, does not."""
    seen: list[bool] = []

    def command(argv: Any, *, then_exit: bool) -> int:
        seen.append(then_exit)
        return 0

    monkeypatch.setattr(cli, "_command", command)
    with pytest.raises(SystemExit) as exited:
        cli.run()
    assert exited.value.code == 0 and main([]) == 0 and seen == [True, False]


def test_a_command_takes_sigterm_once_and_leaves_an_ignored_signal_ignored() -> None:
    """ending_as_interrupt: the first SIGTERM interrupts, a later one (closing down, then exiting)
    changes nothing; a SIGHUP that was ignored (nohup) stays so; without either, the handlers are put
    back after (the entry point's, after a stop: ignored until the process exits)."""
    before, before_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    previous_hup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with ending_as_interrupt():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is before
        with ending_as_interrupt():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(1)
            os.kill(os.getpid(), signal.SIGTERM)  # (closing down: nothing happens)
            time.sleep(0.1)
        assert signal.getsignal(signal.SIGTERM) is before
        # The entry point's (then_exit): after a stop the signals go from its handlers straight to
        # ignored, not by way of their defaults (a SIGTERM just then ended learner train -15); with
        # no stop, they are put back as ever.
        with ending_as_interrupt(then_exit=True):
            pass
        assert signal.getsignal(signal.SIGTERM) is before and signal.getsignal(signal.SIGINT) is before_int
        with pytest.raises(KeyboardInterrupt), ending_as_interrupt(then_exit=True):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)
        signal.signal(signal.SIGINT, before_int)
        signal.signal(signal.SIGHUP, previous_hup)


@pytest.mark.needs_torch
def test_a_run_whose_envs_have_no_time_limit_and_ended_no_episode_says_what_to_give(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = ["--backend", "gym", "--num-envs", "2", "--num-steps", "8", "--total-timesteps", "16", "--no-progress"]
    steps += ["--no-tensorboard", "--no-plot"]
    capsys.readouterr()
    # CliffWalking is registered without a time limit; CartPole's 500 steps are not reached in 16.
    assert main(["train", "--env", "CliffWalking-v1", *steps, "--run-dir", str(tmp_path / "cliff")]) == 0
    assert (
        "no episode ended (its envs have no time limit, so an episode may never end: give --max-episode-steps N "
        "(learner train passes it to the envs it makes))"
    ) in capsys.readouterr().out
    assert main(["train", "--env", "CartPole-v1", *steps, "--run-dir", str(tmp_path / "cart")]) == 0
    out = capsys.readouterr().out
    assert "no episode ended" in out and "time limit" not in out


def test_a_ctrl_c_that_python_wraps_in_a_runtime_error_aborts_the_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Ctrl-C raised as a class is made (a dataclass field's ``__set_name__``, as ``learner train`` imports
    learner.train a second in): Python 3.11 wraps it, ``RuntimeError: Error calling __set_name__ ...``, and the
    command ended in that traceback, status 1. It ends as aborted, 130, as at any other point."""
    import learner.cli

    class Field:
        def __set_name__(self, owner: type, name: str) -> None:
            raise KeyboardInterrupt  # (the Ctrl-C's handler runs there, and raises it)

    def importing(args: object) -> int:
        class Made:  # (a class of a module the command imports)
            field = Field()

        return 0

    monkeypatch.setattr(learner.cli, "cmd_plot", importing)
    assert learner.cli.main(["plot", "somewhere"]) == 130
    err = capsys.readouterr().err
    assert "aborted" in err and "Traceback" not in err, err


def test_a_ctrl_c_while_the_parser_is_built_ends_the_command_by_the_sigint_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its first second or so (the parser imports gymnasium): `learner: aborted`, then the process ends as
    one Ctrl-C killed (run() re-raises KeyboardInterrupt for Python to do so), as after a later Ctrl-C."""
    import learner.cli
    import learner.progress

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(learner.cli, "build_parser", interrupted)
    monkeypatch.setattr(learner.progress, "_stop_at", None)
    monkeypatch.setattr(learner.progress, "_stop_signal", None)
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(sys, "argv", ["learner", "train"])
    with pytest.raises(KeyboardInterrupt):
        learner.cli.run()
