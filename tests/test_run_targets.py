"""What a training run aims at and anneals by, to the step: --stop-at-return's bar and window, the learning
rate's and clip range's linear annealing over env steps, and the episode ends the rollout stores."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")

import learner.train as train_module
from learner import rundir
from learner.config import Args
from learner.train import train
from learner.update import Batch, Rollout
from tests.conftest import QUIET

# MountainCar cut to 3 steps, in this process: every episode returns exactly -3 (-1 a step, the goal out of
# reach). With next-step autoreset and one env, episode k ends at env step 4k - 1: the 20th at step 79.
SHORT_MOUNTAIN_CAR: dict[str, Any] = {
    "env": "MountainCar-v0",
    "max_episode_steps": 3,
    "backend": "gym",
    "num_envs": 1,
    **QUIET,
}


def test_stop_at_return_stops_at_the_20th_episode_when_their_mean_equals_the_bar(tmp_path: Path) -> None:
    """The bar is reached by a mean of the last 20 returns equal to it (>=, not >), and no sooner than
    the 20th episode's end; the run says when, in steps and in seconds since it started."""
    run = tmp_path / "run"
    summary = train(Args(**SHORT_MOUNTAIN_CAR, num_steps=8, total_timesteps=96, stop_at_return=-3.0, run_dir=str(run)))
    assert summary["solved"] is True and summary["stop_reason"] == "stop_at_return"
    assert summary["solved_at_step"] == 79
    assert 0 < summary["solved_at_seconds"] <= summary["seconds"]
    means = [row["episodic_return_mean"] for row in rundir.read_jsonl(run / rundir.METRICS)]
    assert means and all(mean == -3.0 for mean in means if mean is not None)


def test_the_learning_rate_and_clip_range_anneal_linearly_over_env_steps(tmp_path: Path) -> None:
    """--anneal-lr and --anneal-clip scale both by 1 - (env steps so far) / total: four updates of 8 steps
    out of 32 run at 1, 3/4, 1/2 and 1/4 of each (unscaled, every update ran at the full rate and range)."""
    run = tmp_path / "run"
    train(
        Args(
            **SHORT_MOUNTAIN_CAR,
            num_steps=8,
            total_timesteps=32,
            learning_rate=1e-3,
            anneal_lr=True,
            clip_coef=0.2,
            anneal_clip=True,
            stop_at_return=math.inf,
            run_dir=str(run),
        )
    )
    rows = rundir.read_jsonl(run / rundir.METRICS)
    assert [row["learning_rate"] for row in rows] == pytest.approx([1e-3, 0.75e-3, 0.5e-3, 0.25e-3])
    assert [row["clip_coef"] for row in rows] == pytest.approx([0.2, 0.15, 0.1, 0.05])


def test_the_rollout_stores_terminations_and_truncations_as_the_envs_gave_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Episodes that terminate are stored as terminations, not truncations (which GAE bootstraps from the
    final observation's value, as if the episode went on)."""
    seen: list[tuple[np.ndarray, np.ndarray]] = []
    real_make_batch = train_module.make_batch

    def spying(made: Rollout, *args: Any, **kwargs: Any) -> Batch:
        seen.append((made.terminations.copy(), made.truncations.copy()))
        return real_make_batch(made, *args, **kwargs)

    monkeypatch.setattr(train_module, "make_batch", spying)
    train(
        Args(
            env="tests.envs:ClockEnv",
            env_kwargs={"length": 3, "end": "terminate"},  # (episodes of 3 steps that terminate, never truncate)
            backend="gym",
            num_envs=2,
            num_steps=8,
            total_timesteps=16,
            run_dir=str(tmp_path / "run"),
            **QUIET,
        )
    )
    terminations, truncations = seen[0]
    assert terminations.any() and not truncations.any()
