"""The wall clock set back or ahead (an NTP step, a clock set by hand, a laptop's resume): a resumed run's
TensorBoard file still read after the earlier sessions', the progress bar's times still the run's."""

from __future__ import annotations

import dataclasses
import logging
import re
import time
import types
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
import tqdm.std

from learner import rundir
from learner.config import Args
from learner.progress import progress_bar
from learner.train import train

DAY = 86_400.0


def _resumable() -> dict[str, Any]:
    """Runs of 16-step updates, a checkpoint at each, whose every update boundary finds the envs at their start."""
    return {
        "env": "tests.envs:ClockEnv",
        "env_kwargs": {"length": 3, "action": "box"},
        "backend": "gym",
        "num_envs": 2,
        "num_steps": 8,
        "num_minibatches": 2,
        "update_epochs": 3,
        "keep_checkpoints": 10,
        "checkpoint_seconds": 0.0,
        "progress": False,
        "plot": False,
        "tensorboard": True,
    }


@pytest.mark.slow
def test_a_run_resumed_under_a_clock_set_back_writes_an_event_file_tensorboard_reads_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """tensorboard names an event file by the wall clock's time; TensorBoard reads a run's files in name order.
    Resumed with the clock set back a day, the run's new file sorted first: TensorBoard's data server showed
    the run up to the killed session's last step, EventAccumulator the series out of order with the killed
    session's tail (the updates after its checkpoint, redone) left in."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer

    run = tmp_path / "r"
    args = Args(**_resumable(), total_timesteps=48, checkpoint_every=1, run_dir=str(run))
    train(args)
    (before,) = run.glob("events.out.tfevents.*")
    checkpoint_32 = rundir.list_checkpoints(run)[1]  # (as if killed after the update to 48, its checkpoint lost)
    assert rundir.checkpoint_step(checkpoint_32) == 32
    wall = time.time
    monkeypatch.setattr(event_file_writer, "time", types.SimpleNamespace(time=lambda: wall() - DAY))
    caplog.set_level(logging.INFO, logger="learner.records")
    train(dataclasses.replace(args, run_dir=None, resume=str(checkpoint_32), total_timesteps=64))

    events = EventAccumulator(str(run)).Reload()
    assert [e.step for e in events.Scalars("charts/learning_rate")] == [16, 32, 48, 64]
    names = sorted(p.name for p in run.glob("events.out.tfevents.*"))
    assert len(names) == 2 and names[0] == before.name, names
    assert int(names[1].split(".")[3]) == int(before.name.split(".")[3]) + 1, names
    renamed = [r.getMessage() for r in caplog.records if "TensorBoard: event file named" in r.getMessage()]
    assert len(renamed) == 1 and names[1] in renamed[0] and before.name in renamed[0], renamed


@pytest.mark.parametrize("jump", [-DAY, 3 * DAY], ids=["back-a-day", "ahead-3-days"])
def test_the_progress_bar_s_times_and_redraws_are_unmoved_by_the_wall_clock_s_jumps(
    jump: float, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """tqdm keeps time by time.time: set back a day mid-run, the bar was not redrawn for the rest of the run
    (the time since its last redraw was negative) and ended [-23:59:50<00:00, ...]; set 3 days ahead it
    showed [72:00:08<41:24:31, ...] of a 14 s run."""
    offset = [0.0]
    wall = time.time
    monkeypatch.setattr(tqdm.std, "time", lambda: wall() + offset[0])  # (tqdm's clock: `from time import time`)
    with progress_bar(True, 100) as bar:
        bar.mininterval = 0  # (redrawn at every update: none is skipped for want of time since the last)
        bar.update(10)
        offset[0] = jump
        for _ in range(3):
            bar.update(10)
            assert bar.last_print_n == bar.n, "not redrawn"
            elapsed = bar.format_dict["elapsed"]
            assert 0 <= elapsed < 600, elapsed
    drawn = [line for line in capsys.readouterr().err.replace("\r", "\n").split("\n") if "steps [" in line]
    assert drawn and all(re.search(r"steps \[00:\d\d<(\?|00:\d\d)", line) for line in drawn), drawn
    assert "40.0/100" in drawn[-1], drawn
