"""Run dirs written by older commits of envfleet (tests/data/old-runs/, see its README.md): this version
evaluates them, resumes them, repeats them (--like) and plots them; where it cannot (nets of a layout it no
longer builds) its error names the version that wrote the checkpoint and what to do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
import torch

from learner import rundir
from learner.checkpoint import FORMAT, load_checkpoint, nets_differ, written_by
from learner.cli import main
from learner.evaluate import evaluate
from learner.plot import plot_runs
from learner.ppo import Agent
from learner.train import like_args, resume_args, train

OLD_RUNS = Path(__file__).parent / "data" / "old-runs"
CARTPOLE = "250e8e2-cartpole"  # (the first learner's: config.json without versions, counters without best_*)
PENDULUM = "a1d43b5-pendulum"  # (the last before Dict observations: --norm-obs and --norm-reward statistics)
QUIET = {"progress": False, "tensorboard": False, "plot": False}


def _copy(name: str, tmp_path: Path) -> Path:
    """A copy of the old run dir ``name`` (resuming writes into it)."""
    run = tmp_path / name
    shutil.copytree(OLD_RUNS / name, run)
    return run


def _checkpoint_of(run: Path) -> Path:
    (path,) = rundir.list_checkpoints(run)
    return path


@pytest.mark.parametrize("name", [CARTPOLE, PENDULUM])
def test_an_old_run_dir_is_evaluated_by_the_cli_and_by_evaluate(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _copy(name, tmp_path)
    assert main(["eval", "--checkpoint", str(run), "--episodes", "1", "--backend", "gym", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["episodes"] == 1 and np.isfinite(result["return_mean"]), result
    assert evaluate(run, episodes=1, backend="gym")["episodes"] == 1


@pytest.mark.parametrize("name", [CARTPOLE, PENDULUM])
def test_an_old_run_is_resumed_for_a_few_updates_and_plotted(name: str, tmp_path: Path) -> None:
    """Its nets, optimizer, RNG states and (Pendulum) observation and reward statistics load; the run goes on
    from its step and its metrics.jsonl, old rows and new, plots."""
    run = _copy(name, tmp_path)
    before = load_checkpoint(_checkpoint_of(run), resuming=True)
    step = int(before["counters"]["global_step"])
    summary = train(resume_args(run, total_timesteps=step + 512, **QUIET))
    assert summary["total_steps"] == step + 512, summary
    after = load_checkpoint(rundir.list_checkpoints(run)[-1], resuming=True)
    assert after["counters"]["global_step"] == step + 512
    assert list(after["ppo"]["hidden_sizes"]) == list(before["ppo"]["hidden_sizes"]) == [8]
    assert after["versions"]["envfleet"], after["versions"]  # (this version's checkpoints say what wrote them)
    if before["obs_rms"] is not None:  # (its statistics went on from the old run's, not from scratch)
        assert float(after["obs_rms"]["count"]) > float(before["obs_rms"]["count"])
        assert after["reward_scaler"] is not None
    steps = [row["global_step"] for row in rundir.read_jsonl(run / rundir.METRICS)]
    assert steps == sorted(steps) and steps[-1] == step + 512, steps
    plot_runs([run], tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


@pytest.mark.parametrize("name", [CARTPOLE, PENDULUM])
def test_an_old_run_is_repeated_with_like(name: str, tmp_path: Path) -> None:
    run = _copy(name, tmp_path)
    recorded = json.loads((run / rundir.CONFIG).read_text())
    new = tmp_path / "again"
    summary = train(like_args(run, run_dir=str(new), total_timesteps=256, **QUIET))
    assert summary["total_steps"] == 256
    config = json.loads((new / rundir.CONFIG).read_text())
    assert config["ppo"]["hidden_sizes"] == recorded["ppo"]["hidden_sizes"] == [8]
    assert config["ppo"]["norm_obs"] == recorded["ppo"]["norm_obs"]
    assert main(["plot", str(run), str(new), "-o", str(tmp_path / "both.png")]) == 0


def _refit(path: Path) -> None:
    """The checkpoint at ``path`` with nets of another layout than its spaces get now (an MLP over
    (40, 40) frames, as envfleet built for grayscale frames before 8e003e0), its spaces those frames'."""
    state = torch.load(path, weights_only=True)
    frames = gym.spaces.Box(0, 255, (40, 40), np.uint8)
    state["observation_space"], state["action_space"] = str(frames), str(gym.spaces.Discrete(3))
    state["model"] = Agent(gym.spaces.Box(0.0, 255.0, (40, 40), np.float32), gym.spaces.Discrete(3)).state_dict()
    state["args"] = {**state["args"], "env": "tests.test_eval:ChannelLastEnv", "env_kwargs": {"gray": True}}
    torch.save(state, path)


@pytest.mark.parametrize(
    ("name", "wrote"),
    [
        (CARTPOLE, "recorded its version neither in its checkpoints nor in its run's config.json"),
        (
            PENDULUM,
            "written by envfleet 0.1.0, commit a1d43b5509fb (as its run's config.json says) (this one is envfleet ",
        ),
    ],
)
def test_nets_an_old_version_built_that_this_one_does_not_are_refused_naming_that_version(
    name: str, wrote: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where this version builds other nets for a checkpoint's spaces (a layout changed), eval and --resume
    say how they differ, which version wrote it (the run's config.json says so since 2026-12-02) and what to
    do: that version evaluates it (its commit named), --like trains the run anew."""
    run = _copy(name, tmp_path)
    path = _checkpoint_of(run)
    _refit(path)
    assert main(["eval", str(run), "--episodes", "1", "--backend", "gym", "--env-kwargs", '{"gray": true}']) == 1
    err = capsys.readouterr().err
    assert (
        f"checkpoint {path}: its nets do not fit the policy this envfleet builds for its spaces (it holds an MLP "
        in err
    )
    assert "over 1600 inputs where this version builds the Nature CNN); it was " in err, err
    assert wrote in err, err
    assert f"or train the run anew with this one (learner train --like {run})" in err, err
    if name == PENDULUM:
        assert "git worktree add ../envfleet-a1d43b5 a1d43b5509fb)" in err, err
    assert "Traceback" not in err


def test_new_checkpoints_say_which_version_wrote_them_wherever_they_are_copied(tmp_path: Path) -> None:
    train(resume_args(_copy(CARTPOLE, tmp_path), total_timesteps=1024, **QUIET))
    copied = tmp_path / "step.pt"  # (out of its run dir: no config.json beside it)
    shutil.copy(rundir.list_checkpoints(tmp_path / CARTPOLE)[-1], copied)
    checkpoint = load_checkpoint(copied)
    config = json.loads((tmp_path / CARTPOLE / rundir.CONFIG).read_text())
    assert checkpoint["versions"] == config["versions"]
    said = written_by(checkpoint, copied)
    assert said is not None and said.startswith(f"envfleet {config['versions']['envfleet']}"), said
    assert said.endswith("(as its own record says)"), said
    assert written_by(load_checkpoint(OLD_RUNS / CARTPOLE), None) is None


def test_a_checkpoint_of_a_newer_format_says_to_upgrade(tmp_path: Path) -> None:
    path = tmp_path / "step.pt"
    state = torch.load(_checkpoint_of(OLD_RUNS / PENDULUM), weights_only=True)
    torch.save({**state, "format": FORMAT + 1, "versions": {"envfleet": "9.0.0"}}, path)
    with pytest.raises(ValueError, match=r"a checkpoint of format 2, written by a newer envfleet \(envfleet 9\.0\.0 "):
        load_checkpoint(path)
    with pytest.raises(ValueError, match="upgrade envfleet to evaluate or resume it"):
        load_checkpoint(path)


def test_nets_differ_says_how_a_checkpoint_s_nets_differ_from_this_version_s() -> None:
    here = {"actor.0.weight": torch.zeros(8, 4), "actor.0.bias": torch.zeros(8)}
    assert nets_differ(here, dict(here)) is None
    assert nets_differ(here, {"actor.0.weight": torch.zeros(8, 4)}) == "it lacks actor.0.bias"
    assert (
        nets_differ(here, {**here, "actor.9.bias": torch.zeros(1)}) == "it has actor.9.bias that this version's do not"
    )
    assert nets_differ(here, {"actor.0.weight": torch.zeros(8, 4), "actor.1.bias": torch.zeros(8)}) == (
        "it has actor.1.bias where this version's have actor.0.bias"
    )
    assert (
        nets_differ(here, {**here, "actor.0.bias": torch.zeros(16)}) == "its actor.0.bias is (16,), this version's (8,)"
    )
    assert nets_differ(here, {"actor.0.weight": torch.zeros(8, 6)}) == (
        "it holds an MLP over 6 inputs where this version builds an MLP over 4 inputs"
    )
    cnn = {"cnn.convs.0.weight": torch.zeros(32, 1, 8, 8), "actor.weight": torch.zeros(2, 512)}
    assert nets_differ(cnn, here) == "it holds an MLP over 4 inputs where this version builds the Nature CNN"


@pytest.mark.parametrize("read", [like_args, resume_args])
def test_an_old_run_on_frames_that_did_not_record_its_policy_gets_no_hidden_sizes(read: Any, tmp_path: Path) -> None:
    """A run of frames by 250e8e2, whose config.json does not say its policy was the Nature CNN: --like and
    --resume leave --hidden-sizes unset (its ppo's, the preset's, were pinned, and train warned that the user's
    --hidden-sizes were ignored for images), and keep the other hyperparameters it resolved."""
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(OLD_RUNS / "250e8e2-frames-config.json", run / rundir.CONFIG)
    args = read(run, **({"run_dir": str(tmp_path / "again")} if read is like_args else {}))
    assert args.hidden_sizes is None
    recorded = json.loads((run / rundir.CONFIG).read_text())
    assert args.num_steps == recorded["ppo"]["num_steps"] == 16
    assert args.learning_rate == recorded["ppo"]["learning_rate"]
