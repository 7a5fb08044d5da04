"""learner.checkpointing.Checkpointer on its own: the checkpoint cadence, best.pt, and what a run's end writes."""

from __future__ import annotations

import logging
import threading
from collections import deque
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
import torch

from learner import rundir
from learner.checkpoint import capture_rng, restore_rng
from learner.checkpointing import Checkpointer, stopped_in_update
from learner.config import Args, resolve_ppo
from learner.errors import RunCompleteError
from learner.ppo import Agent
from learner.resume import RECENT, Counters, from_other_versions
from learner.train import train
from tests.conftest import QUIET

OBS = gym.spaces.Box(-1.0, 1.0, (3,), np.float32)
ACTIONS = gym.spaces.Discrete(2)


def checkpointer(run_dir: Path, counters: Counters | None = None, **options: Any) -> Checkpointer:
    args = Args(env="CartPole-v1", **options)
    agent = Agent(OBS, ACTIONS)
    counters = counters or Counters()
    made = Checkpointer(
        run_dir,
        args=args,
        hp=resolve_ppo(args, OBS, ACTIONS),
        obs_space=OBS,
        action_space=ACTIONS,
        served={},
        agent=agent,
        optimizer=torch.optim.Adam(agent.parameters()),
        counters=counters,
        recent_returns=deque(counters.recent_returns, maxlen=RECENT),
        recent_lengths=deque(counters.recent_lengths, maxlen=RECENT),
        obs_rms=None,
        reward_scaler=None,
        update_rng=None,
        resumed=False,
        logger=logging.getLogger("learner.train"),
    )
    made.last_update = made.rollout_state()
    return made


def update(made: Checkpointer, steps: int = 8, returns: tuple[float, ...] = ()) -> None:
    """One update done, as the loop counts it (the Recorder counts updates), with ``returns`` ended in its rollout."""
    made.counters.global_step += steps
    made.recent_returns.extend(returns)
    made.updating = True
    made.counters.update += 1
    made.finished(made.rollout_state())


def steps_saved(run_dir: Path) -> list[str]:
    return [p.name for p in rundir.list_checkpoints(run_dir)]


def test_a_new_run_is_checkpointed_at_its_first_update_then_every_checkpoint_every(tmp_path: Path) -> None:
    made = checkpointer(tmp_path, checkpoint_every=2, checkpoint_seconds=0.0, keep_checkpoints=5)
    for _ in range(5):
        update(made)
        assert not made.updating
    assert steps_saved(tmp_path) == ["step-0000000008.pt", "step-0000000024.pt", "step-0000000040.pt"]
    assert (made.saved_step, made.saved_update) == (40, 5)
    assert made.last_update["counters"]["update"] == 5


def test_the_checkpoint_writer_is_the_one_given(tmp_path: Path) -> None:
    written: list[tuple[int, int]] = []

    def write(run_dir: Path, step: int, payload: dict[str, Any], keep: int = 3) -> Path:
        written.append((step, keep))
        assert payload["counters"]["global_step"] == step and "model" in payload and "optimizer" in payload
        return Path(run_dir) / f"{step}.pt"

    made = checkpointer(tmp_path, keep_checkpoints=4)
    made.write = write
    update(made)
    assert written == [(8, 4)] and made.saved_step == 8


def test_a_new_best_mean_return_is_kept_as_best_pt_once_enough_episodes_ended(tmp_path: Path) -> None:
    made = checkpointer(tmp_path, save_best=True)
    update(made, returns=(1.0,) * (RECENT - 1))
    assert made.counters.best_return is None and not (tmp_path / "checkpoints" / "best.pt").exists()
    update(made, returns=(1.0,))
    assert (made.counters.best_return, made.counters.best_step) == (1.0, 16)
    assert (tmp_path / "checkpoints" / "best.pt").is_file()
    update(made, returns=(0.0,))  # (a lower mean: the best stands)
    assert (made.counters.best_return, made.counters.best_step) == (1.0, 16)
    assert made.last_update["counters"]["best_step"] == 16


def test_stopped_during_an_update_writes_no_checkpoint_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    made = checkpointer(tmp_path, checkpoint_every=10)
    update(made)  # (a new run's first: checkpointed)
    made.counters.global_step += 8
    made.updating = True
    with caplog.at_level(logging.WARNING, logger="learner.train"):
        counters = made.end("interrupted")
    assert stopped_in_update(8) in caplog.text
    assert steps_saved(tmp_path) == ["step-0000000008.pt"]
    assert (counters.global_step, counters.update) == (8, 1)  # (as of the last update)


def test_stopped_mid_rollout_checkpoints_the_last_update_unless_it_is_on_disk(tmp_path: Path) -> None:
    made = checkpointer(tmp_path, checkpoint_every=10, checkpoint_seconds=0.0)
    update(made)
    update(made)  # (not checkpointed: every 10 updates)
    made.counters.global_step += 4  # (a partial rollout: not learned from)
    assert made.end("interrupted").global_step == 16
    assert steps_saved(tmp_path) == ["step-0000000008.pt", "step-0000000016.pt"]
    made.end("interrupted")  # (on disk already: none written again)
    assert steps_saved(tmp_path) == ["step-0000000008.pt", "step-0000000016.pt"]


@pytest.mark.parametrize("reason", ["interrupted", "stopped", "error: ValueError: no"])
def test_a_run_stopped_before_its_first_update_writes_no_checkpoint(tmp_path: Path, reason: str) -> None:
    """Nets that never learned, at step 0 (a Ctrl-C in the first rollout or reset, an error there): none
    written (was step-0000000000.pt, and "continue with --resume" for what is a run started over)."""
    made = checkpointer(tmp_path, checkpoint_every=10)
    made.counters.global_step += 4
    assert made.end(reason).global_step == 0
    assert steps_saved(tmp_path) == []


def test_a_finished_run_is_checkpointed_as_of_its_end(tmp_path: Path) -> None:
    made = checkpointer(tmp_path, checkpoint_every=10)
    update(made)
    made.counters.global_step += 8
    counters = made.end("total_timesteps")
    assert counters is made.counters and counters.global_step == 16
    assert steps_saved(tmp_path) == ["step-0000000008.pt", "step-0000000016.pt"]


@pytest.mark.parametrize("reason", ["total_timesteps", "stop_at_return"])
def test_a_run_that_ends_at_a_checkpointed_update_does_not_write_it_again(tmp_path: Path, reason: str) -> None:
    """The last update checkpointed as it ended (--checkpoint-seconds 0, or a run's first update) and the run's
    end at the same step: one write, not the same file twice ("checkpoint (update 2)" then "checkpoint
    (total_timesteps)"); written again where the end changed what it holds (a solve judged since, here)."""
    written: list[int] = []

    def write(run_dir: Path, step: int, payload: dict[str, Any], keep: int = 3) -> Path:
        written.append(step)
        return Path(run_dir) / f"{step}.pt"

    made = checkpointer(tmp_path, checkpoint_every=1, checkpoint_seconds=0.0)
    made.write = write
    update(made)
    update(made)
    assert written == [8, 16]
    assert made.end(reason).global_step == 16
    assert written == [8, 16]
    made.counters.solved_at_step, made.counters.solved_threshold = 16, 1.0
    made.end(reason)
    assert written == [8, 16, 16]


def test_a_run_saved_on_a_host_with_more_gpus_restores_the_rng_states_of_the_gpus_this_one_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A checkpoint holds one CUDA RNG state per GPU of the host that saved it; resumed on a host with
    fewer (a rescheduled Job's), those it has are restored, not an error for each it lacks."""
    state = capture_rng()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8) + i for i in range(4)]
    restored: list[list[torch.Tensor]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)
    restore_rng(state)
    assert [[int(s[0]) for s in states] for states in restored] == [[0, 1]]


def test_a_run_stopped_after_a_solve_in_its_last_partial_rollout_keeps_the_solve(tmp_path: Path) -> None:
    """Solved mid-rollout (the log says so), then stopped before the next update: the run is saved as of its
    last update, but its summary and checkpoint keep the solve, as a run stopped by --stop-at-return does."""
    # FrozenLake on a 1x2 map ("SG"): every episode reaches the goal; the 20th ends in the third rollout.
    options: dict[str, Any] = {"env": "FrozenLake-v1", "env_kwargs": {"desc": ["SG"], "is_slippery": False}}
    options |= {"backend": "gym", "num_envs": 2, "num_steps": 16, "plot": False, "progress": False}
    stop = threading.Event()

    class StopOnSolve(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("solved at step"):
                stop.set()

    handler, logger = StopOnSolve(), logging.getLogger("learner")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        summary = train(Args(**options, total_timesteps=128, run_dir=str(tmp_path / "run")), stop=stop)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert summary["stop_reason"] == "stopped" and summary["total_steps"] == 64  # (as of its last update)
    assert summary["solved"] is True and 64 < summary["solved_at_step"] <= 96 and summary["solved_threshold"] == 0.7
    saved = torch.load(rundir.list_checkpoints(tmp_path / "run")[-1], weights_only=False)
    assert saved["counters"]["global_step"] == 64 and saved["counters"]["solved_at_step"] == summary["solved_at_step"]
    resumed = train(Args(**options, resume=str(tmp_path / "run"), total_timesteps=96))
    assert resumed["solved_at_step"] == summary["solved_at_step"]


# -- checkpoints of other versions -------------------------------------------------------------------------------


def test_a_solved_run_from_before_its_bar_was_recorded_is_judged_by_its_stop_at_return_or_env_s_threshold(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # FrozenLake on a 1x2 map ("SG"): every episode reaches the goal, solved under the env's 0.7 at once.
    options: dict[str, Any] = {"env": "FrozenLake-v1", "env_kwargs": {"desc": ["SG"], "is_slippery": False}}
    options |= {"backend": "gym", "num_envs": 2, "num_steps": 16, "plot": False, "progress": False}
    run = tmp_path / "run"
    summary = train(Args(**options, total_timesteps=128, tensorboard=False, run_dir=str(run)))
    solved_at = summary["solved_at_step"]
    assert solved_at is not None
    # As a checkpoint of 2026-11-30's first versions holds it (no solved_threshold), with a counter of
    # a newer version's besides.
    last = rundir.list_checkpoints(run)[-1]
    saved = torch.load(last, weights_only=False)
    del saved["counters"]["solved_threshold"]
    saved["counters"]["counted_by_a_newer_version"] = 3
    torch.save(saved, last)
    with pytest.raises(
        RunCompleteError, match=rf"was solved at step {solved_at:,} \(mean return of the last 20 episodes >= 0\.7\)"
    ):
        train(Args(**options, resume=str(run), stop_at_return=0.7, total_timesteps=160))
    with caplog.at_level(logging.WARNING, logger="learner"):
        summary = train(Args(**options, resume=str(run), total_timesteps=160))
    assert (summary["total_steps"], summary["solved_at_step"], summary["solved_threshold"]) == (160, solved_at, 0.7)
    assert (
        "written by a newer version of envfleet: its counters counted_by_a_newer_version are not known" in caplog.text
    )


def test_a_resumed_run_keeps_the_hyperparameters_it_resolved_not_a_preset_retuned_since(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As --like does: a later version's preset (here patched in) does not change a run under way; given
    options still do."""
    from learner.config import PRESETS
    from learner.resume import resume_args

    run = tmp_path / "run"
    train(
        Args(env="CartPole-v1", backend="gym", num_envs=2, num_steps=16, total_timesteps=64, run_dir=str(run), **QUIET)
    )
    monkeypatch.setitem(PRESETS, "classic", {**PRESETS["classic"], "learning_rate": 5e-2, "update_epochs": 1})
    resumed = resume_args(run, total_timesteps=128)
    assert (resumed.learning_rate, resumed.update_epochs, resumed.total_timesteps) == (1e-3, 20, 128)
    assert resume_args(run, learning_rate=1e-3).learning_rate == 1e-3


def test_checkpoints_of_other_versions_are_brought_to_this_one_s_form() -> None:
    by_bar: dict[str, Any] = {"args": {"env": "CartPole-v1", "stop_at_return": 200}, "counters": {"solved_at_step": 9}}
    by_env: dict[str, Any] = {"args": {"env": "CartPole-v1", "stop_at_return": None}, "counters": {"solved_at_step": 9}}
    unsolved: dict[str, Any] = {"args": {"env": "CartPole-v1"}, "counters": {"solved_at_step": None}}
    for checkpoint, bar in ((by_bar, 200.0), (by_env, 475.0), (unsolved, None)):
        from_other_versions(checkpoint, "step.pt")
        assert checkpoint["counters"].get("solved_threshold") == bar
        Counters(**checkpoint["counters"])


def test_a_resumed_run_is_not_given_norm_obs_its_observations_did_not_take(tmp_path: Path) -> None:
    """The MuJoCo preset normalises vector observations; a Discrete-observation run of it recorded
    ppo.norm_obs true all the same, which pinned on --resume made --norm-obs "given" (and warned of)."""
    from learner.resume import resume_args

    run = tmp_path / "run"
    args = Args(env="FrozenLake-v1", preset="mujoco", backend="gym", num_envs=2, num_steps=8, total_timesteps=16)
    train(Args(**{**args.to_json(), "run_dir": str(run), **QUIET}))
    assert rundir.read_json(run / rundir.CONFIG)["ppo"]["norm_obs"] is True
    assert resume_args(run, total_timesteps=32).norm_obs is None
