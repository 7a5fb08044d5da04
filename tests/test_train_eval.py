"""``learner train --eval-every``: periodic evaluations of the current policy on envs of their own (an extra
local server, in process, or --eval-servers), recorded beside training's figures, and leaving training as it
would be without them. Tiny budgets, real local servers."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
import torch

import learner.local
from learner import rundir
from learner.checkpoint import load_checkpoint
from learner.config import Args
from learner.envs import FleetSpec, fleet_spec, open_fleet
from learner.errors import TrainingInterrupted
from learner.evaluate import evaluate
from learner.live_metrics import _metric_name
from learner.local import label_of
from learner.periodic_eval import EVAL_COLUMNS, EVAL_SEED_BASE, eval_fleet
from learner.plot import _eval_points, plot_runs
from learner.resume import like_args, resume_args
from learner.stats import format_return
from learner.train import train
from tests.conftest import QUIET, SpawnServer, StartServers
from tests.test_train import CtrlCAt, _resumable, resume_as_killed

QUIET_RUN: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "timeout": 120}
"""subprocess.run's arguments for a learner train run whose output is not looked at."""

TIMING = ("seconds", "sps", "sps_update", "transitions_per_s", "rollout_seconds", "update_seconds", "other_seconds")
"""A row's wall-clock columns, which differ between runs of the same trajectory."""


def _cartpole(run: Path, **options: Any) -> Args:
    """A CartPole run of 5 updates of 32 steps (1 local server x 2 envs x 16 steps)."""
    values: dict[str, Any] = {
        "env": "CartPole-v1",
        "num_servers": 1,
        "envs_per_server": 2,
        "num_steps": 16,
        "total_timesteps": 160,
        "checkpoint_seconds": 0.0,
        "run_dir": str(run),
        **QUIET,
    }
    return Args(**{**values, **options})


def _pendulum(run: Path, **options: Any) -> Args:
    """A Pendulum run (Box actions, clipped to their bounds as learner eval clips them) of 3 updates of 32 steps on
    in-process envs (2 x 16 steps), with --norm-obs: its evaluations' (and videos') observations normalised with the
    statistics of the update they are of."""
    local: dict[str, Any] = {"env": "Pendulum-v1", "backend": "gym", "num_servers": 1, "envs_per_server": None}
    return _cartpole(run, **{**local, "num_envs": 2, "total_timesteps": 96, "norm_obs": True, **options})


def _training_columns(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows without their wall-clock, eval/ and servers' (latencies, busy shares) columns: the trajectory the
    run learned."""
    dropped = ("eval/", "replicas/", "fleet/")
    return [{k: v for k, v in row.items() if k not in TIMING and not k.startswith(dropped)} for row in rows]


def test_evaluations_are_recorded_and_leave_the_training_trajectory_as_it_is(tmp_path: Path) -> None:
    evaluated, plain = tmp_path / "evaluated", tmp_path / "plain"
    summary = train(_cartpole(evaluated, eval_every=64, eval_episodes=3, eval_envs=2, tensorboard=True, plot=True))
    train(_cartpole(plain))

    rows = rundir.read_jsonl(evaluated / rundir.METRICS)
    assert [r["global_step"] for r in rows] == [32, 64, 96, 128, 160]
    # At the first update at or past each multiple of 64, and at the run's last update (one ran before).
    assert [r["global_step"] for r in rows if "eval/return_mean" in r] == [64, 128, 160]
    for row in rows:
        if "eval/return_mean" in row:
            assert set(EVAL_COLUMNS) <= set(row)
            assert row["eval/episodes"] == 3 and row["eval/seconds"] > 0
            # CartPole: a reward of 1 a step, so the (raw) return is the length.
            assert row["eval/return_mean"] == row["eval/length_mean"] >= 8
        else:
            assert not any(key.startswith("eval/") for key in row)
    # The same trajectory as the run without evaluations: the same losses, returns and steps.
    assert _training_columns(rows) == _training_columns(rundir.read_jsonl(plain / rundir.METRICS))
    a, b = (torch.load(rundir.list_checkpoints(run)[-1], weights_only=True) for run in (evaluated, plain))
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), key
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])

    evals = [r for r in rows if "eval/return_mean" in r]
    best = max(evals, key=lambda r: r["eval/return_mean"])
    on_disk = rundir.read_json(evaluated / rundir.SUMMARY)
    for found in (summary, on_disk):
        assert found["eval_return_mean"] == evals[-1]["eval/return_mean"]
        assert (found["best_eval_return"], found["best_eval_step"]) == (best["eval/return_mean"], best["global_step"])
    plain_summary = rundir.read_json(plain / rundir.SUMMARY)
    assert plain_summary["best_eval_return"] is plain_summary["best_eval_step"] is None
    assert plain_summary["eval_return_mean"] is None
    assert not (plain / rundir.CHECKPOINTS / rundir.BEST_EVAL_CHECKPOINT).exists()

    # best-eval.pt: the nets of the best evaluation, which learner eval reads as any checkpoint.
    best_file = evaluated / rundir.CHECKPOINTS / rundir.BEST_EVAL_CHECKPOINT
    saved = load_checkpoint(best_file)
    assert saved["counters"]["best_eval_step"] == best["global_step"]
    assert saved["counters"]["global_step"] == best["global_step"]
    # (its episodes again, seeded as that evaluation's were: the same deterministic returns)
    again = evaluate(best_file, 3, num_envs=2, seed=EVAL_SEED_BASE + 1 + best["global_step"], progress=False)
    assert again["return_mean"] == best["eval/return_mean"]

    # TensorBoard: SB3's EvalCallback tags, at the steps evaluated.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(evaluated)).Reload()
    assert [e.step for e in events.Scalars("eval/mean_reward")] == [64, 128, 160]
    assert [e.value for e in events.Scalars("eval/mean_ep_length")] == pytest.approx(
        [r["eval/length_mean"] for r in evals]
    )
    # learner plot marks them on the returns-by-steps panel.
    assert _eval_points(evaluated) == ([64, 128, 160], [r["eval/return_mean"] for r in evals])
    assert _eval_points(plain) == ([], [])
    assert plot_runs([evaluated, plain], tmp_path / "both.png").is_file()
    # --resume and --like carry the options.
    assert resume_args(evaluated).eval_every == 64 and like_args(evaluated).eval_episodes == 3


def test_the_eval_server_is_eval_0_beside_the_training_servers_local_n(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The evaluation's server is a second LocalServers: it was labelled local-0 as well, so the training
    # server's log lines and errors read "local-0 (unix:/tmp/...)" and both servers' forwarded lines
    # "env_server[local-0]", indistinguishable. It is eval-0; training's names are as they were.
    caplog.set_level(logging.INFO)  # (the servers log at the level their forwarded lines are shown at)
    run = tmp_path / "run"
    train(_cartpole(run, num_servers=2, envs_per_server=1, eval_every=64, eval_episodes=2, total_timesteps=64))
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "local-0 (" in m]
    assert any(m.startswith("started 1 local env server (2 x CartPole-v1 each): eval-0 on ") for m in messages)
    assert "connected to 1 env server(s), 2 envs of CartPole-v1: eval-0" in messages
    stopped = sorted(r.name for r in caplog.records if r.getMessage().startswith("env_server.server: stopped after"))
    assert stopped == ["env_server[eval-0]", "env_server[local-0]", "env_server[local-1]"]
    rows = rundir.read_jsonl(run / rundir.METRICS)
    assert {"replicas/local-0/steps", "replicas/local-1/steps"} <= set(rows[-1])
    assert not any("eval-0" in key for row in rows for key in row)
    # While both run, each name says which server it is (label_of: by address).
    with contextlib.ExitStack() as stack:
        training = stack.enter_context(open_fleet(FleetSpec("CartPole-v1", num_servers=1, envs_per_server=1)))
        evaluating = stack.enter_context(
            open_fleet(eval_fleet(_cartpole(tmp_path / "unused", eval_every=32), fleet_spec(Args()), "CartPole-v1"))
        )
        assert [label_of(address) for address in training.addresses] == ["local-0"]  # type: ignore[attr-defined]
        assert [label_of(address) for address in evaluating.addresses] == ["eval-0"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("overlap_update", [False, True])
def test_a_run_solved_evaluates_the_nets_it_ends_with(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overlap_update: bool
) -> None:
    # A run stopped by --stop-at-return (mid-rollout: that rollout is not learned from) ended with its last update's
    # nets, which no evaluation had played where none was due there: summary.json's eval_return_mean was an older
    # policy's (here: none at all, --eval-every being past the run). They are evaluated as it stops, and recorded as
    # an evaluation at that update is: its row's eval/ columns, the summary, best-eval.pt, the last checkpoint's
    # counters; learner eval of that checkpoint, seeded as the evaluation was, plays the same episodes.
    # (--overlap-update: the update finished in the background as the run ends is the last one.)
    run = tmp_path / "run"
    options: dict[str, Any] = {"backend": "gym", "num_servers": 1, "envs_per_server": None, "num_envs": 4}
    args = _cartpole(run, **options, total_timesteps=4096, stop_at_return=1.0, overlap_update=overlap_update)
    args = dataclasses.replace(args, eval_every=100_000, eval_episodes=2, eval_envs=2, checkpoint_every=1)
    summary = train(dataclasses.replace(args, tensorboard=True, progress=True))
    assert summary["stop_reason"] == "stop_at_return" and summary["total_steps"] < 4096, summary
    rows = rundir.read_jsonl(run / rundir.METRICS)
    assert [r["update"] for r in rows] == list(range(1, summary["updates"] + 1))  # (one row an update, still)
    *before, last = rows
    assert not any(key.startswith("eval/") for row in before for key in row)
    assert set(EVAL_COLUMNS) <= set(last) and last["eval/episodes"] == 2
    assert last["global_step"] < summary["total_steps"]  # (the rollout solved in is not learned from)
    assert summary["eval_return_mean"] == summary["best_eval_return"] == last["eval/return_mean"]
    assert summary["best_eval_step"] == last["global_step"]
    checkpoint = rundir.list_checkpoints(run)[-1]
    saved = load_checkpoint(checkpoint)["counters"]
    assert saved["global_step"] == last["global_step"] and saved["eval_return_mean"] == last["eval/return_mean"]
    assert saved["best_eval_step"] == last["global_step"] and saved["solved_at_step"] is not None
    best = load_checkpoint(run / rundir.CHECKPOINTS / rundir.BEST_EVAL_CHECKPOINT)["counters"]
    assert best["global_step"] == best["best_eval_step"] == last["global_step"] and best["update"] == last["update"]
    seed = EVAL_SEED_BASE + args.seed + last["global_step"]
    again = evaluate(checkpoint, 2, num_envs=2, seed=seed, backend="gym", progress=False)
    assert again["return_mean"] == last["eval/return_mean"]
    # TensorBoard has it at that step, learner plot marks it, and the bar's last state says it.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run)).Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/mean_reward")] == [
        (last["global_step"], pytest.approx(last["eval/return_mean"]))
    ]
    assert _eval_points(run) == ([last["global_step"]], [last["eval/return_mean"]])
    drawn = [frame.rstrip() for frame in re.split(r"[\r\n]", capsys.readouterr().err) if "steps [" in frame]
    assert drawn[-1].endswith(f", eval {format_return(last['eval/return_mean'])}]"), drawn[-1]


def kill_when_said(argv: list[str], said: bytes) -> subprocess.Popen[bytes]:
    """``learner train ARGV --progress`` in a subprocess, SIGKILLed (as the OOM killer, or a pod killed without
    grace, kills it) once its bar has said ``said``; the killed process."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "learner", "train", *argv, "--progress"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert proc.stderr is not None
    seen = b""
    deadline = time.monotonic() + 120
    try:
        while said not in seen:  # (the bar's frames: no newline between them)
            chunk = os.read(proc.stderr.fileno(), 65536)
            if not chunk or time.monotonic() > deadline:
                pytest.fail(f"{said!r} was never said: {seen.decode(errors='replace')[-2000:]}")
            seen += chunk
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stderr.close()
    return proc


def test_a_solved_run_killed_during_its_final_evaluation_is_resumed_as_solved_and_evaluated(tmp_path: Path) -> None:
    # A run solved by --stop-at-return evaluated its last nets (PeriodicEval.final) before its last checkpoint was
    # written (Checkpointer.end, after it): a learner SIGKILLed meanwhile (the OOM killer, a pod killed without
    # grace), for the evaluation's length (minutes with --eval-episodes 1000), left the solve off the disk, and
    # --resume trained on. The checkpoint is now written first, saying the evaluation is due (its counters' due);
    # --resume then said "nothing to do", and the evaluation's figures were never had. It now plays it, as the run
    # would have (the same figures, row, summary, best-eval.pt), and ends there, solved.
    # (CartPole on in-process envs, solved by --stop-at-return 1 after a few updates; its final evaluation, of
    # 40 episodes on 1 env, --eval-every being past the run, the only one)
    run, full = tmp_path / "run", tmp_path / "full"
    argv = ["--env", "CartPole-v1", "--backend", "gym", "--num-envs", "4", "--num-steps", "16"]
    argv += ["--total-timesteps", "100000", "--stop-at-return", "1", "--checkpoint-every", "1"]
    argv += ["--checkpoint-seconds", "0", "--eval-every", "100000", "--eval-episodes", "40", "--eval-envs", "1"]
    argv += ["--no-tensorboard", "--no-plot"]
    kill_when_said([*argv, "--run-dir", str(run)], b"evaluating at step")
    saved = load_checkpoint(rundir.list_checkpoints(run)[-1])["counters"]
    assert saved["solved_at_step"] is not None and saved["solved_threshold"] == 1.0, saved
    assert saved["eval_return_mean"] is None and saved.get("due", []) == ["eval"]  # (killed: none recorded, but due)
    subprocess.run([sys.executable, "-m", "learner", "train", *argv, "--run-dir", str(full)], check=True, **QUIET_RUN)

    summary = train(resume_args(run, progress=False))
    last, uninterrupted = rundir.read_jsonl(run / rundir.METRICS)[-1], rundir.read_jsonl(full / rundir.METRICS)[-1]
    assert last["eval/episodes"] == 40 and last["global_step"] == saved["global_step"]
    timing = (*TIMING, "eval/seconds")
    assert {k: v for k, v in last.items() if k not in timing} == {
        k: v for k, v in uninterrupted.items() if k not in timing
    }
    expected = rundir.read_json(full / rundir.SUMMARY)
    assert summary["stop_reason"] == "stop_at_return" and summary["updates"] == expected["updates"]
    for key in ("eval_return_mean", "best_eval_return", "best_eval_step", "solved_at_step", "solved"):
        assert summary[key] == expected[key], key
    on_disk = load_checkpoint(rundir.list_checkpoints(run)[-1])["counters"]
    assert on_disk["eval_return_mean"] == last["eval/return_mean"] and on_disk.get("due", []) == []
    a, b = (load_checkpoint(d / rundir.CHECKPOINTS / rundir.BEST_EVAL_CHECKPOINT) for d in (full, run))
    assert a["counters"]["best_eval_step"] == b["counters"]["best_eval_step"] == last["global_step"]
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), key
    # Done now: a --resume more has nothing left to do.
    with pytest.raises(ValueError, match=r"was solved at step .* leaves nothing to do"):
        train(resume_args(run, progress=False))


def test_a_solved_run_ctrl_c_d_during_its_final_evaluation_says_that_resume_does_it(tmp_path: Path) -> None:
    # A Ctrl-C during a solved run's final evaluation: the run ends solved (exit 0, its lines and summary as a done
    # run's), the evaluation due in its last checkpoint. Only an INFO line, which the bar does not show, said it was
    # left out: the run looked done, and its user had no cue to --resume it. A warning says so now, with the command.
    # (The solved run of the test above; its final evaluation the only one, 40 episodes on 1 env.)
    run = tmp_path / "run"
    argv = ["--env", "CartPole-v1", "--backend", "gym", "--num-envs", "4", "--num-steps", "16"]
    argv += ["--total-timesteps", "100000", "--stop-at-return", "1", "--checkpoint-every", "1"]
    argv += ["--checkpoint-seconds", "0", "--eval-every", "100000", "--eval-episodes", "40", "--eval-envs", "1"]
    argv += ["--no-tensorboard", "--no-plot", "--run-dir", str(run), "--progress"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "learner", "train", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stderr is not None
    seen = b""
    deadline = time.monotonic() + 120
    while b"evaluating at step" not in seen:
        chunk = os.read(proc.stderr.fileno(), 65536)
        assert chunk and time.monotonic() < deadline, seen.decode(errors="replace")[-2000:]
        seen += chunk
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=60)
    said = (seen + rest).decode(errors="replace")
    assert proc.returncode == 0, said[-2000:]
    saved = load_checkpoint(rundir.list_checkpoints(run)[-1])["counters"]
    assert saved["solved_at_step"] is not None and saved["due"] == ["eval"]
    step = f"{saved['global_step']:,}"
    assert (
        f"WARNING learner.train: the evaluation of step {step}, the run's last, was cut short: learner train --resume "
        f"{run} does it (and ends there)"
    ) in said
    assert rundir.read_json(run / rundir.SUMMARY)["stop_reason"] == "stop_at_return"


def test_a_run_killed_during_an_evaluation_past_its_last_checkpoint_evaluates_there_again(tmp_path: Path) -> None:
    # SIGKILLed during the evaluation at step 32, the run's last checkpoint is step 16's (--checkpoint-every 1000:
    # the first update's alone), which owes nothing (its counters hold no due): --resume trains from there and
    # evaluates at step 32 when it gets there again, as the uninterrupted run did: the same rows and figures.
    # (Real local servers; ClockEnv, whose episodes all end at the updates' ends, so that a resumed run's reset
    # finds the envs where the uninterrupted run had them, as test_train's resume tests.)
    run, full = tmp_path / "run", tmp_path / "full"
    argv = ["--env", "tests.envs:ClockEnv", "--env-kwargs", '{"length": 3, "action": "box"}', "--num-servers", "1"]
    argv += ["--envs-per-server", "2", "--num-steps", "8", "--num-minibatches", "2", "--update-epochs", "3"]
    argv += ["--total-timesteps", "48", "--checkpoint-every", "1000", "--checkpoint-seconds", "0", "--norm-obs"]
    argv += ["--eval-every", "32", "--eval-episodes", "150", "--eval-envs", "1", "--no-tensorboard", "--no-plot"]
    kill_when_said([*argv, "--run-dir", str(run)], b"evaluating at step 32")
    assert [p.name for p in rundir.list_checkpoints(run)] == ["step-0000000016.pt"]
    # (nothing due, no such counter: the version before it, 9375238, read it without a warning that it left it out)
    assert "due" not in load_checkpoint(rundir.checkpoint_path(run, 16))["counters"]
    subprocess.run([sys.executable, "-m", "learner", "train", *argv, "--run-dir", str(full)], check=True, **QUIET_RUN)
    summary = train(resume_args(run, progress=False))
    rows, expected = rundir.read_jsonl(run / rundir.METRICS), rundir.read_jsonl(full / rundir.METRICS)
    assert [r["global_step"] for r in rows if "eval/return_mean" in r] == [32, 48]
    timing, servers = (*TIMING, "eval/seconds"), ("replicas/", "fleet/")
    assert [{k: v for k, v in r.items() if k not in timing and not k.startswith(servers)} for r in rows] == [
        {k: v for k, v in r.items() if k not in timing and not k.startswith(servers)} for r in expected
    ]
    assert summary["best_eval_return"] == rundir.read_json(full / rundir.SUMMARY)["best_eval_return"]


def test_a_solved_run_s_last_row_is_never_left_out_of_metrics_jsonl_as_its_evaluation_is_added(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The final evaluation's columns went into the last update's row by cutting that row off metrics.jsonl
    # (drop_rows_after, fsynced) and appending it again: a learner killed between the two (SIGKILL, the OOM
    # killer; an fsync takes milliseconds on a real disk), or an append that failed (a full disk), left the file
    # without that update's row, for good, while the run's last checkpoint counts it (a resumed run keeps the rows
    # up to it: one missing). The row is now written again in place, in one write: the old row, or the new one.
    # (Here the append that followed the cut fails, as on a full disk; the row is no longer cut nor appended.)
    written = rundir.append_jsonl

    def append_jsonl(f: Any, row: dict[str, Any]) -> None:
        if "eval/return_mean" in row:  # (--eval-every past the run: the final evaluation's row alone has them)
            raise OSError(28, "No space left on device")
        written(f, row)

    monkeypatch.setattr(rundir, "append_jsonl", append_jsonl)
    run = tmp_path / "run"
    options: dict[str, Any] = {"backend": "gym", "num_servers": 1, "envs_per_server": None, "num_envs": 4}
    args = _cartpole(run, **options, total_timesteps=4096, stop_at_return=1.0, checkpoint_every=1)
    summary = train(dataclasses.replace(args, eval_every=100_000, eval_episodes=2, eval_envs=2))
    assert summary["stop_reason"] == "stop_at_return", summary
    rows = rundir.read_jsonl(run / rundir.METRICS)
    assert [r["update"] for r in rows] == list(range(1, summary["updates"] + 1))  # (one row an update, the last too)
    assert rows[-1]["eval/return_mean"] == summary["eval_return_mean"] is not None
    assert load_checkpoint(rundir.list_checkpoints(run)[-1])["counters"]["update"] == rows[-1]["update"]


def test_a_solved_run_s_gauges_say_it_is_solved_while_its_last_nets_are_evaluated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Solved mid-rollout, a run's --metrics-port gauges said it only at its end (LearnerMetrics.run_ended): "solved"
    # 0 and the last update's steps, a few ms before. The final evaluation now comes in between (minutes with
    # --eval-episodes 1000 on a slow env): they say it is solved, at its steps, from the evaluation's start.
    import urllib.request

    from learner.records import Recorder
    from tests.test_learner_metrics import parse, value

    scraped: list[tuple[float, float]] = []
    evaluating = Recorder.evaluating

    def scraping(self: Recorder, step: int, ended: int, episodes: int) -> None:
        if not scraped and self.live is not None and self.live.url:  # (its first word: a scrape as it starts)
            with urllib.request.urlopen(self.live.url, timeout=10) as response:
                samples, _ = parse(response.read().decode())
            scraped.append((value(samples, "envfleet_learner_solved"), value(samples, "envfleet_learner_global_step")))
        evaluating(self, step, ended, episodes)

    monkeypatch.setattr(Recorder, "evaluating", scraping)
    run = tmp_path / "run"
    options: dict[str, Any] = {"backend": "gym", "num_servers": 1, "envs_per_server": None, "num_envs": 4}
    args = _cartpole(run, **options, total_timesteps=4096, stop_at_return=1.0, metrics_port=0)
    summary = train(dataclasses.replace(args, eval_every=100_000, eval_episodes=2, eval_envs=2))
    assert summary["stop_reason"] == "stop_at_return" and summary["eval_return_mean"] is not None, summary
    assert scraped == [(1.0, summary["total_steps"])]  # (--eval-every past the run: the final evaluation's alone)


def test_a_run_stopped_before_it_ends_has_its_last_nets_left_unevaluated(tmp_path: Path) -> None:
    # (stopped as Ctrl-C or SIGTERM stops it: the user wants out, not an evaluation more)
    import threading

    stop = threading.Event()
    run = tmp_path / "run"
    options: dict[str, Any] = {"backend": "gym", "num_servers": 1, "envs_per_server": None, "num_envs": 2}
    args = _cartpole(run, **options, eval_every=100_000, eval_episodes=1)
    summary = train(args, on_update=lambda row: stop.set() if row["update"] == 2 else None, stop=stop)
    assert summary["stop_reason"] == "stopped" and summary["eval_return_mean"] is None
    assert not any(key.startswith("eval/") for row in rundir.read_jsonl(run / rundir.METRICS) for key in row)


def test_no_save_best_leaves_best_eval_pt_out(tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = train(_cartpole(run, eval_every=96, eval_episodes=1, total_timesteps=96, save_best=False))
    assert summary["best_eval_step"] == 96
    assert not (run / rundir.CHECKPOINTS / rundir.BEST_EVAL_CHECKPOINT).exists()


@pytest.mark.parametrize("overlap_update", [False, True])
def test_in_process_runs_evaluate_in_process(tmp_path: Path, overlap_update: bool) -> None:
    options: dict[str, Any] = {
        "backend": "gym",
        "num_servers": 1,
        "envs_per_server": None,
        "num_envs": 2,
        "total_timesteps": 96,
        "overlap_update": overlap_update,
    }
    run, plain = tmp_path / "run", tmp_path / "plain"
    summary = train(_cartpole(run, **options, eval_every=32, eval_episodes=2))
    train(_cartpole(plain, **options))
    rows = rundir.read_jsonl(run / rundir.METRICS)
    assert [r["eval/episodes"] for r in rows] == [2, 2, 2]
    assert summary["best_eval_step"] in (32, 64, 96)
    # (--overlap-update: evaluated once the update in the background is done, the nets its)
    assert _training_columns(rows) == _training_columns(rundir.read_jsonl(plain / rundir.METRICS))


def test_a_run_on_servers_evaluates_on_eval_servers(tmp_path: Path, start_servers: StartServers) -> None:
    training = start_servers("CartPole-v1", 1, 2)
    evaluating = start_servers("CartPole-v1", 1, 2)
    run = tmp_path / "run"
    summary = train(
        Args(
            servers=",".join(training),
            eval_servers=",".join(evaluating),
            eval_every=32,
            eval_episodes=2,
            num_steps=16,
            total_timesteps=64,
            run_dir=str(run),
            **QUIET,
        )
    )
    rows = rundir.read_jsonl(run / rundir.METRICS)
    assert [r["eval/episodes"] for r in rows] == [2, 2]
    assert summary["eval_return_mean"] == rows[-1]["eval/return_mean"]
    # Servers of another env are refused, naming the option, before the run dir is made.
    other = start_servers("Acrobot-v1", 1, 1)
    with pytest.raises(ValueError, match=r"--eval-servers: the servers at .* serve Acrobot-v1, but the run trains"):
        train(
            Args(
                servers=",".join(training),
                eval_servers=",".join(other),
                eval_every=32,
                num_steps=16,
                total_timesteps=32,
                run_dir=str(tmp_path / "refused"),
                **QUIET,
            )
        )
    assert not (tmp_path / "refused").exists()


def test_a_training_server_written_another_way_in_eval_servers_is_refused_at_the_start(
    tmp_path: Path, start_servers: StartServers
) -> None:
    # Args compares --servers and --eval-servers as written: 127.0.0.1:P and localhost:P passed, and the evaluation's
    # handshake was refused by the server's claim once training had connected, with an error that said to close a
    # RemoteVectorEnv of this process. The servers' ids tell them apart (as learner servers tells them), before the
    # run dir is made.
    training = start_servers("CartPole-v1", 2, 1, transport="tcp")
    port = training[1].rsplit(":", 1)[1]
    assert training[1] == f"127.0.0.1:{port}"
    message = (
        rf"^--eval-servers localhost:{port} and --servers 127\.0\.0\.1:{port} are the same env server \(server id "
        r"[0-9a-f]{8}\), written two ways: a server serves one learner connection at a time, .* give --eval-servers "
        r"other running servers of the same env$"
    )
    with pytest.raises(ValueError, match=message):
        train(
            Args(
                servers=",".join(training),
                eval_servers=f"localhost:{port}",
                eval_every=32,
                num_steps=16,
                total_timesteps=32,
                run_dir=str(tmp_path / "refused"),
                **QUIET,
            )
        )
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("written", ["servers", "eval_servers"])
def test_a_training_server_written_as_a_dns_name_is_named_as_written_when_refused(
    tmp_path: Path, start_servers: StartServers, written: str
) -> None:
    # The refusal named both sides by the addresses the fleets reached: --servers dns:///127.0.0.1:P (resolved to
    # 127.0.0.1:P) with --eval-servers 127.0.0.1:P read "--eval-servers 127.0.0.1:P and --servers 127.0.0.1:P are
    # the same env server ..., written two ways", the two ways one. Each side as written, with the address behind.
    training = start_servers("CartPole-v1", 2, 1, transport="tcp")
    address = training[1]
    assert address.startswith("127.0.0.1:")
    named = f"dns:///{address}"
    servers = ",".join([training[0], named] if written == "servers" else training)
    eval_servers = named if written == "eval_servers" else address
    said = re.escape(f"{named} (at {address})")
    message = (
        rf"^--eval-servers {said if written == 'eval_servers' else re.escape(address)} and --servers "
        rf"{said if written == 'servers' else re.escape(address)} are the same env server \(server id [0-9a-f]{{8}}\), "
        r"written two ways: a server serves one learner connection at a time"
    )
    with pytest.raises(ValueError, match=message):
        train(
            Args(
                servers=servers,
                eval_servers=eval_servers,
                eval_every=32,
                num_steps=16,
                total_timesteps=32,
                run_dir=str(tmp_path / "refused"),
                **QUIET,
            )
        )
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"servers": "localhost:1", "eval_every": 1000}, r"--eval-every: a run on --servers .* give --eval-servers"),
        ({"eval_every": -1}, r"--eval-every: expected env steps >= 0 \(0: no evaluation\), got -1"),
        ({"eval_episodes": 0}, r"--eval-episodes: expected an integer >= 1, got 0"),
        ({"eval_envs": 0}, r"--eval-envs: expected an integer >= 1, got 0"),
        ({"eval_servers": " , "}, r"--eval-servers: expected addresses"),
        ({"backend": "gym", "eval_servers": "localhost:1"}, r"--eval-servers: .* cannot go with --backend gym"),
        # (was the claim's error, once training had connected: "... that learner is this process: close the
        # RemoteVectorEnv that holds the server (envs.close() ...)", which a user of the command cannot do)
        (
            {"servers": "localhost:1,localhost:2", "eval_servers": "localhost:2", "eval_every": 1000},
            r"^--eval-servers: localhost:2 is one of the training servers \(--servers\); a server serves one ",
        ),
    ],
)
def test_eval_options_are_checked_naming_the_option(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Args(**options)


def test_eval_options_defaults_and_the_served_gauge() -> None:
    assert Args().eval_every == 0 and Args().eval_num_envs() == 4
    assert Args(eval_episodes=2).eval_num_envs() == 2 and Args(eval_envs=8, eval_episodes=20).eval_num_envs() == 8
    assert _metric_name("eval/return_mean") == "envfleet_learner_eval_return_mean"
    assert _metric_name("faults/servers_down") == "envfleet_learner_servers_down"


def test_resuming_a_run_with_evaluations_gives_the_same_next_update_and_evaluation(tmp_path: Path) -> None:
    # As test_train's resume test: a run killed after its second update (checkpoint at step 32) and resumed
    # learns and evaluates as the uninterrupted one did (ClockEnv, Box actions, --norm-obs in use).
    common = {**_resumable(), "checkpoint_every": 1, "eval_every": 16, "eval_episodes": 2}
    full = tmp_path / "full"
    train(Args(**common, run_dir=str(full)))
    part = tmp_path / "part"
    resume_as_killed(full, part, "step-0000000032.pt")

    full_rows, part_rows = rundir.read_jsonl(full / rundir.METRICS), rundir.read_jsonl(part / rundir.METRICS)
    assert [r["global_step"] for r in part_rows if "eval/return_mean" in r] == [16, 32, 48]
    timing = (*TIMING, "eval/seconds")
    for a, b in zip(full_rows, part_rows, strict=True):
        assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
    a, b = (torch.load(rundir.list_checkpoints(d)[-1], weights_only=True) for d in (full, part))
    for key, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][key]), key
    assert torch.equal(a["rng"]["torch"], b["rng"]["torch"])
    assert a["counters"]["best_eval_step"] == b["counters"]["best_eval_step"] is not None


def ctrl_c_at_step_2(args: Args, module: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """train(``args``) with a Ctrl-C at the 2nd step of the envs ``module``'s open_fleet makes
    (``learner.periodic_eval``: the evaluations'; ``learner.video``: --capture-video's): the summary of the run it
    stopped, as its TrainingInterrupted carries it. (test_train_video stops a video so.)"""

    @contextlib.contextmanager
    def interrupted(spec: FleetSpec) -> Iterator[gym.vector.VectorEnv]:
        with open_fleet(spec) as envs:
            yield CtrlCAt(envs, at=2)

    with monkeypatch.context() as patch:
        patch.setattr(f"{module}.open_fleet", interrupted)
        with pytest.raises(TrainingInterrupted) as stopped:
            train(args)
    return stopped.value.summary


@pytest.mark.parametrize("overlap_update", [False, True])
def test_ctrl_c_during_an_evaluation_stops_the_run_and_resume_does_it_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, overlap_update: bool
) -> None:
    # The Ctrl-C comes at the 2nd step of the first evaluation (after update 1, step 16): the evaluation is left
    # out, and the run stops there with the checkpoint of update 1, as a Ctrl-C in the next rollout would; that
    # checkpoint says the evaluation is due (its counters' due). Resumed, the run played it no more: the row of step
    # 16 never got its eval/ columns, best-eval.pt never had it in view. Now --resume plays it first, with the
    # checkpoint's nets, --norm-obs statistics and seed: the run's rows, summary and best-eval.pt are the
    # uninterrupted run's. (ClockEnv, Box actions, --norm-obs in use.) --overlap-update, whose evaluation of update 1
    # runs once the next rollout is collected, learned from that rollout too: its last checkpoint was update 2's, and
    # the evaluation cut short was lost; it stops at update 1 now, as without it.
    common = {**_resumable(), "checkpoint_every": 1, "eval_every": 16, "eval_episodes": 4, "norm_obs": True}
    common |= {"tensorboard": True, "overlap_update": overlap_update}
    full = tmp_path / "full"
    full_summary = train(Args(**common, run_dir=str(full)))
    part = tmp_path / "part"
    summary = ctrl_c_at_step_2(Args(**common, run_dir=str(part)), "learner.periodic_eval", monkeypatch)
    assert summary["stop_reason"] == "interrupted" and summary["total_steps"] == 16 and summary["updates"] == 1
    assert summary["best_eval_step"] is None
    assert [p.name for p in rundir.list_checkpoints(part)] == ["step-0000000016.pt"]
    assert load_checkpoint(rundir.checkpoint_path(part, 16))["counters"].get("due", []) == ["eval"]
    (row,) = rundir.read_jsonl(part / rundir.METRICS)
    assert not any(key.startswith("eval/") for key in row)
    without, again = tmp_path / "without", tmp_path / "again"
    shutil.copytree(part, without)
    shutil.copytree(part, again)

    with caplog.at_level(logging.INFO):
        summary = train(resume_args(part))
    assert "resume: the evaluation of step 16, cut short in the last session, first" in caplog.text
    part_rows, full_rows = rundir.read_jsonl(part / rundir.METRICS), rundir.read_jsonl(full / rundir.METRICS)
    assert [r["global_step"] for r in part_rows if "eval/return_mean" in r] == [16, 32, 48]
    timing = (*TIMING, "eval/seconds")
    # (--overlap-update: a resumed run's actor starts with the checkpoint's nets, where the uninterrupted run's lagged
    # an update behind: only the rows up to the checkpoint's are the same, step 16's with its evaluation)
    same = len(full_rows) if not overlap_update else 1
    for a, b in zip(full_rows[:same], part_rows[:same], strict=True):
        assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
    if not overlap_update:
        for key in ("eval_return_mean", "best_eval_return", "best_eval_step"):
            assert summary[key] == full_summary[key], key
        a, b = (load_checkpoint(d / rundir.CHECKPOINTS / rundir.BEST_EVAL_CHECKPOINT) for d in (full, part))
        assert a["counters"]["best_eval_step"] == b["counters"]["best_eval_step"]
        assert b["counters"].get("due", []) == []  # (written as the evaluation it holds is done: not due)
        for key, tensor in a["model"].items():
            assert torch.equal(tensor, b["model"][key]), key
    assert all("due" not in load_checkpoint(c)["counters"] for c in rundir.list_checkpoints(part)[1:])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(part)).Reload()
    assert [e.step for e in events.Scalars("eval/mean_reward")] == [16, 32, 48]

    # Resumed without --eval-every: none played (what the user asked), said in a line.
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train(resume_args(without, eval_every=0))
    assert (
        "resume: the evaluation of step 16, cut short in the last session, is left out: this session runs without "
        "--eval-every"
    ) in caplog.text
    assert not any(key.startswith("eval/") for r in rundir.read_jsonl(without / rundir.METRICS) for key in r)

    # Resumed, the evaluation played, then a Ctrl-C in the session's first rollout (before any update of its own):
    # the checkpoint of step 16 was not written again (its step on disk already), and still said the evaluation
    # was due, with the figures from before it (best_eval_* older than summary.json's): each --resume played it
    # again, TensorBoard holding its point once more each time. That checkpoint is now written as it is done.
    @contextlib.contextmanager
    def first_rollout_stopped(spec: FleetSpec) -> Iterator[gym.vector.VectorEnv]:
        with open_fleet(spec) as envs:
            yield CtrlCAt(envs, at=2)

    with monkeypatch.context() as patch:
        patch.setattr("learner.train.open_fleet", first_rollout_stopped)
        with pytest.raises(TrainingInterrupted) as stopped:
            train(resume_args(again))
    assert stopped.value.summary["updates"] == 1
    saved = load_checkpoint(rundir.checkpoint_path(again, 16))["counters"]
    assert saved.get("due", []) == [] and saved["eval_return_mean"] == full_rows[0]["eval/return_mean"]
    assert saved["best_eval_step"] == stopped.value.summary["best_eval_step"] == 16
    caplog.clear()
    with caplog.at_level(logging.INFO):
        train(resume_args(again))
    assert "cut short in the last session" not in caplog.text
    events = EventAccumulator(str(again)).Reload()
    assert [e.step for e in events.Scalars("eval/mean_reward")] == [16, 32, 48]
    assert [r["global_step"] for r in rundir.read_jsonl(again / rundir.METRICS)] == [16, 32, 48]


def test_the_served_gauge_is_the_last_evaluation_s_mean_return() -> None:
    from prometheus_client import generate_latest

    from learner.live_metrics import LearnerMetrics
    from tests.test_learner_metrics import parse, row, value

    metrics = LearnerMetrics(env_id="CartPole-v1", run_dir="runs/r")
    metrics.observe_update(row(1, 3, []), solved=False)
    samples, helps = parse(generate_latest(metrics.registry).decode())
    assert math.isnan(value(samples, "envfleet_learner_eval_return_mean"))  # (none ran yet)
    assert "--eval-every" in helps["envfleet_learner_eval_return_mean"]
    metrics.observe_update({**row(2, 3, []), "eval/return_mean": 500.0}, solved=False)
    metrics.observe_update(row(3, 3, []), solved=False)  # (not evaluated: the gauge keeps the last one)
    samples, _ = parse(generate_latest(metrics.registry).decode())
    assert value(samples, "envfleet_learner_eval_return_mean") == 500.0


@pytest.mark.parametrize("overlap_update", [False, True])
def test_an_evaluation_is_of_its_update_s_nets_and_statistics_as_its_step_s_checkpoint(
    tmp_path: Path, overlap_update: bool
) -> None:
    # --overlap-update evaluates an update once it is done in the background, after the next rollout: with
    # --norm-obs, that rollout's newer statistics normalised the evaluation's observations (not those the nets
    # were trained with, nor those of the step's checkpoint), best-eval.pt held them with the next rollout's
    # counters (global_step one rollout on), and the step's checkpoint did not count the evaluation.
    # (Pendulum: Box actions, clipped to their bounds as learner eval clips them.)
    run = tmp_path / "run"
    args = _pendulum(run, overlap_update=overlap_update)
    train(dataclasses.replace(args, eval_every=32, eval_episodes=2, eval_envs=2, checkpoint_every=1))
    evals = [r for r in rundir.read_jsonl(run / rundir.METRICS) if "eval/return_mean" in r]
    assert [r["global_step"] for r in evals] == [32, 64, 96]
    for row in evals:
        step = row["global_step"]
        checkpoint = rundir.checkpoint_path(run, step)
        # learner eval of the step's checkpoint, seeded as the evaluation was: the same deterministic returns
        again = evaluate(checkpoint, 2, num_envs=2, seed=EVAL_SEED_BASE + 1 + step, backend="gym", progress=False)
        assert again["return_mean"] == row["eval/return_mean"], step
        assert load_checkpoint(checkpoint)["counters"]["eval_return_mean"] == row["eval/return_mean"], step
    best = max(evals, key=lambda r: r["eval/return_mean"])
    saved = load_checkpoint(run / rundir.CHECKPOINTS / rundir.BEST_EVAL_CHECKPOINT)
    of_step = load_checkpoint(rundir.checkpoint_path(run, best["global_step"]))
    assert saved["counters"]["global_step"] == saved["counters"]["best_eval_step"] == best["global_step"]
    assert saved["counters"]["update"] == of_step["counters"]["update"]
    for key, tensor in of_step["obs_rms"].items():
        assert torch.equal(saved["obs_rms"][key], tensor), key


def test_the_bar_shows_the_last_evaluation_until_the_next(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bar said ", eval 161.2" at the update evaluated only: the next update's figures, a tenth of a second
    # later on CartPole, took it away (4 of 61 redraws of a 30,000-step run said it), as did the progress lines.
    monkeypatch.setenv("TQDM_MININTERVAL", "0")  # (redrawn at every update)
    train(_cartpole(tmp_path / "run", eval_every=64, eval_episodes=1, progress=True))
    drawn = [line for line in capsys.readouterr().err.replace("\r", "\n").split("\n") if "SPS" in line]
    evaluated = [i for i, line in enumerate(drawn) if ", eval " in line]
    assert evaluated and evaluated == list(range(evaluated[0], len(drawn))), drawn


@pytest.mark.parametrize("shown", ["lines", "bar"])
def test_an_evaluation_is_said_while_it_runs_then_the_figures_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, shown: str
) -> None:
    # While an evaluation ran (play_episodes without a bar of its own), the bar and the lines showed nothing new:
    # with --eval-episodes 1000, minutes of a run that looked hung. They say it as it runs (here at every step:
    # the bar once a second, the lines at their period, in use), then the updates' figures again.
    from learner import train as train_module

    if shown == "lines":
        monkeypatch.setattr(train_module, "PROGRESS_LINE_S", 0.0)  # (a line at every update, and at each eval step)
    else:
        from tqdm import tqdm

        # (redrawn at every update, not at tqdm's mininterval; and at every step of an evaluation, not once a second)
        monkeypatch.setattr("learner.progress._tqdm_class", lambda: lambda **kwargs: tqdm(**kwargs, mininterval=0.0))
        monkeypatch.setattr("learner.records.OUTAGE_REDRAW_S", 0.0)
    args = _cartpole(tmp_path / "run", eval_every=64, eval_episodes=3, eval_envs=1, total_timesteps=96)
    train(dataclasses.replace(args, progress=None if shown == "lines" else True))
    out, err = capsys.readouterr()
    if shown == "lines":
        said = [line for line in out.splitlines() if line.startswith("step ")]
    else:
        said = [frame.rstrip() for frame in re.split(r"[\r\n]", err) if "steps [" in frame]
    running = re.compile(r", evaluating at step (\d+): (\d) of 3 episodes")
    # The evaluations at steps 64 and 96 (the run's last update), each said throughout, as its episodes end.
    blocks: list[tuple[int, list[int], int]] = []  # (its step, its counts said, the index of the line after it)
    for i, line in enumerate(said):
        if match := running.search(line):
            if not blocks or blocks[-1][2] != i or int(match[1]) != blocks[-1][0]:
                blocks.append((int(match[1]), [], i))
            blocks[-1][1].append(int(match[2]))
            blocks[-1] = (blocks[-1][0], blocks[-1][1], i + 1)
    assert [step for step, _, _ in blocks] == [64, 96], said
    for _, counts, after in blocks:
        assert counts[0] == 0 and counts[-1] == 3 and counts == sorted(counts), said
        # Then the figures again: the evaluated update's (a bar redrawn first with the last update's), no word of it.
        assert after < len(said) and "evaluating" not in said[after], said
    if shown == "lines":  # (waiting_line's: the last update's figures, no time left, then what is under way)
        first = said.index(next(line for line in said if running.search(line)))
        assert said[first].startswith("step 32/96 (33%), ") and " left" not in said[first], said
        assert said[blocks[0][2]].startswith("step 64/96 (67%), ") and ", eval " in said[blocks[0][2]], said
    assert ", eval " in said[-1], said


def test_an_evaluation_is_said_as_it_starts_before_its_envs_reset(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    start_servers: StartServers,
    spawn_server: SpawnServer,
) -> None:
    # The lines (and the bar) said an evaluation only once its envs were reset: a reset that waits (an --eval-servers
    # server down: up to --connect-timeout, 10 s by default, at every evaluation; a slow env's reset) showed the last
    # update's figures, frozen, and an evaluation that then failed was never said at all. It is said as it starts.
    from learner import train as train_module

    monkeypatch.setattr(train_module, "PROGRESS_LINE_S", 0.0)  # (a line at every update, and as an evaluation goes)
    training = start_servers("CartPole-v1", 1, 2)
    evaluating = spawn_server("CartPole-v1", 1)
    args = Args(
        servers=",".join(training),
        eval_servers=evaluating.address,
        eval_every=64,
        eval_episodes=3,
        num_steps=16,
        total_timesteps=96,
        connect_timeout=1.0,
        run_dir=str(tmp_path / "run"),
        **{**QUIET, "progress": None},
    )
    # (the eval server killed after the first update: the evaluation at step 64 waits for it, then fails)
    train(args, on_update=lambda row: evaluating.kill() if row["update"] == 1 else None)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert any(line.endswith(", evaluating at step 64: 0 of 3 episodes") for line in said), said


def test_the_bar_says_an_evaluation_s_count_on_an_80_column_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The bar said "evaluating at step X: k of N episodes" after the last update's SPS and return, and tqdm cuts its
    # line at the terminal's width: on an 80-column one the count was cut off ("evaluating at step 64: 2 o"; at
    # step 1,024,000, "evaluating at step 1,024,000:"), a bar frozen again while the evaluation ran. It comes first.
    from tqdm import tqdm

    from learner.progress import _narrow_as_well

    text_bar = _narrow_as_well(tqdm)  # (the text bar learner train draws, on a terminal 80 columns wide)
    monkeypatch.setattr(
        "learner.progress._tqdm_class",
        lambda: lambda **kwargs: text_bar(**{**kwargs, "dynamic_ncols": False}, ncols=80, mininterval=0.0),
    )
    monkeypatch.setattr("learner.records.OUTAGE_REDRAW_S", 0.0)  # (redrawn at every step of an evaluation)
    args = _cartpole(tmp_path / "run", eval_every=64, eval_episodes=3, eval_envs=1, total_timesteps=96)
    train(dataclasses.replace(args, progress=True))
    frames = [frame.rstrip() for frame in re.split(r"[\r\n]", capsys.readouterr().err) if "evaluating" in frame]
    assert frames and all(len(frame) <= 80 for frame in frames), frames
    counts = [re.search(r", evaluating at step (64|96): ([0-3]) of 3 episodes", frame) for frame in frames]
    assert all(counts), frames
    assert {(match[1], match[2]) for match in counts if match} >= {("64", "0"), ("64", "3"), ("96", "0"), ("96", "3")}


def leave_eval_server_down(row: dict[str, Any]) -> None:
    """train()'s ``on_update``: after update 1, the run's local eval server (``eval-0``) marked left down, as its
    supervisor marks one that died too often (the restarts themselves take over 15 s): the evaluations from the
    next one due on are left out (PeriodicEval._left_down). (test_train_video films such a run's evaluations.)"""
    if row["update"] == 1:
        for address, (label, children) in list(learner.local._LABELS.items()):
            if label == "eval-0":
                children.left_down[address] = "was killed by SIGKILL, and was left down after 5 restarts"


def test_evaluations_are_skipped_at_once_once_the_eval_server_is_left_down(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # An eval server that died too often is left down by its supervisor; every evaluation after that waited
    # --connect-timeout (10 s by default) for it and failed, with a warning that did not say it would stay down
    # (a CartPole run of 50,000 steps killed its eval server 6 times: 2 min 18 s instead of ~12 s, 12 warnings).
    # It is marked left down here as its supervisor marks it (the restarts themselves take over 15 s).
    run = tmp_path / "run"
    train(_cartpole(run, eval_every=32, eval_episodes=1, connect_timeout=30.0), on_update=leave_eval_server_down)
    rows = rundir.read_jsonl(run / rundir.METRICS)
    assert [r["global_step"] for r in rows if "eval/return_mean" in r] == [32]
    said = [
        r.getMessage() for r in caplog.records if r.name == "learner.periodic_eval" and r.levelno >= logging.WARNING
    ]
    assert said == [
        "the eval server eval-0 was killed by SIGKILL, and was left down after 5 restarts: the evaluations from "
        "step 64 on are left out (training goes on)"
    ]


def test_after_an_evaluation_failed_on_a_down_eval_server_the_next_ones_are_left_out_at_once_until_it_is_back(
    tmp_path: Path, spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture
) -> None:
    # Each evaluation on a down --eval-servers server waited the whole --connect-timeout (10 s by default) and failed,
    # a warning each (a 40,000-step CartPole run whose eval server was SIGKILLed 6 s in: 18 of them, 3 min 33 s
    # where the run takes ~15 s). After the first failure the next ones try a plain connection first, refused at
    # once while the server is down: left out at once, an INFO line each; once it runs again, evaluated again.
    evaluating = spawn_server("CartPole-v1", 1)
    updates: list[int] = []

    def kill_then_start(row: dict[str, Any]) -> None:
        updates.append(row["update"])
        if row["update"] == 1:  # (evaluated at 32: its server killed before the next, at 64)
            evaluating.kill()
        elif row["update"] == 5:  # (64, 96, 128 and 160 not evaluated: started again for 192)
            evaluating.start()

    run = tmp_path / "run"
    args = _cartpole(run, eval_every=32, eval_episodes=1, eval_servers=evaluating.address, connect_timeout=2.0)
    with caplog.at_level(logging.INFO, logger="learner.periodic_eval"):
        train(dataclasses.replace(args, total_timesteps=224), on_update=kill_then_start)
    rows = rundir.read_jsonl(run / rundir.METRICS)
    assert [r["global_step"] for r in rows if "eval/return_mean" in r] == [32, 192, 224], rows
    said = [r for r in caplog.records if r.name == "learner.periodic_eval"]
    failed = [r.getMessage() for r in said if r.levelno >= logging.WARNING]
    assert len(failed) == 1 and failed[0].startswith("the evaluation at step 64 failed"), failed
    assert failed[0].endswith("(the next evaluations try it for 1 s first, and are left out at once while it is down)")
    left_out = [r.getMessage() for r in said if "still does not answer" in r.getMessage()]
    assert [re.sub(r" \(.*\)$", "", m) for m in left_out] == [
        f"the evaluation at step {step} is left out: the eval server {label_of(evaluating.address)} still does not "
        "answer"
        for step in (96, 128, 160)
    ], left_out


def test_an_evaluation_s_endless_episode_is_warned_of_as_an_eval_env_s(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Envs without a time limit: learner.evaluate's warning of an episode that goes on and on said "env 0's
    # episode", in learner train's log, where env 0 is a training env; it was the evaluation's (ClockEnv, a class,
    # has no registered time limit; its episodes of 40 steps, warned of past 30 here).
    monkeypatch.setattr("learner.evaluate.LONG_EPISODE", 30)
    options: dict[str, Any] = {"env": "tests.envs:ClockEnv", "env_kwargs": {"length": 40}, "backend": "gym"}
    args = _cartpole(tmp_path / "run", **options, num_servers=1, envs_per_server=None, num_envs=2, total_timesteps=32)
    with caplog.at_level(logging.WARNING, logger="learner.evaluate"):
        train(dataclasses.replace(args, eval_every=32, eval_episodes=1))
    said = [r.getMessage() for r in caplog.records if "no time limit" in r.getMessage()]
    assert said == [
        "eval env 0's episode has gone on for 30 steps, and these envs have no time limit: the policy may never end "
        "it (give --max-episode-steps N)"
    ]
