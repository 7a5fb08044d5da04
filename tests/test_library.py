"""The learner as a library, as a script or a notebook uses it: the README's "Training from Python"
snippets run as printed, and an interrupt stops what called train(), not only the run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import gymnasium as gym
import pytest

from learner import rundir
from learner.envs import FleetSpec, open_fleet
from tests.test_readme_snippets import snippet
from tests.test_train import CtrlCAt


@pytest.mark.slow
def test_the_python_api_snippet_runs_as_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two seeds, an evaluation, a plot of both, and the first resumed to a longer budget."""
    monkeypatch.chdir(tmp_path)  # (its runs/ and cartpole.png)
    scope: dict[str, object] = {}
    exec(snippet("python-api"), scope)
    first = scope["first"]
    assert isinstance(first, dict) and first["stop_reason"] == "total_timesteps" and first["total_steps"] >= 15_000
    assert (tmp_path / "cartpole.png").is_file()
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all((run / rundir.SUMMARY).is_file() for run in runs)


def test_the_snippet_of_an_interrupted_run_gets_its_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Ctrl-C (SIGINT, as a notebook's interrupt sends) at a step of the second rollout."""

    @contextlib.contextmanager
    def interrupted_fleet(spec: FleetSpec) -> Iterator[gym.vector.VectorEnv]:
        with open_fleet(spec) as envs:
            yield CtrlCAt(envs, at=128 + 3)  # (the classic preset's rollouts: 128 steps)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("learner.train.open_fleet", interrupted_fleet)
    scope: dict[str, object] = {}
    exec(snippet("python-api-stopped"), scope)
    summary = scope["summary"]
    assert isinstance(summary, dict) and summary["stop_reason"] == "interrupted" and summary["total_steps"] == 1024
    run = Path(summary["run_dir"])
    assert (run / rundir.SUMMARY).is_file() and (run / rundir.PLOT).is_file() and rundir.list_checkpoints(run)
    assert capsys.readouterr().out.splitlines()[-1] == f"interrupted 1024 {run}"


def test_the_snippet_of_servers_kept_across_cells_runs_as_printed() -> None:
    scope: dict[str, object] = {}
    exec(snippet("python-api-servers"), scope)
    assert scope["envs"].closed  # type: ignore[attr-defined]
    assert not any(Path(a.removeprefix("unix:")).parent.exists() for a in scope["servers"].addresses)  # type: ignore[attr-defined]


@pytest.mark.slow
def test_the_snippet_that_waits_for_learner_train_lets_it_write_all_after_an_interrupt(tmp_path: Path) -> None:
    """As a notebook's interrupt does: SIGINT to the kernel's process group (here, a process standing in for
    the kernel). ``learner train`` writes its plot and says how to resume, which it would not have time
    to under ``!learner train`` or ``subprocess.run`` (killed 0.2 s, 0.25 s after)."""
    code = snippet("python-api-command").replace('"10000"]', f'"1000000", "--run-dir", {str(tmp_path / "run")!r}]')
    assert code != snippet("python-api-command")
    kernel = subprocess.Popen(
        [sys.executable, "-c", code + "print('kernel: went on', proc.returncode)\n"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "run" / rundir.METRICS).is_file() or not rundir.read_jsonl(
            tmp_path / "run" / rundir.METRICS
        ):
            assert time.monotonic() < deadline and kernel.poll() is None, "no update within 60 s"
            time.sleep(0.2)
        os.killpg(kernel.pid, signal.SIGINT)
        out, _ = kernel.communicate(timeout=60)
    finally:
        if kernel.poll() is None:
            os.killpg(kernel.pid, signal.SIGKILL)
    assert "continue with: learner train --resume" in out, out
    assert out.splitlines()[-1] == "kernel: went on 130", textwrap.shorten(out, 2000)
    assert (tmp_path / "run" / rundir.PLOT).is_file()


def test_the_snippet_of_a_run_in_the_background_stops_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run in a thread as printed, its stop set once it has made an update (as a later cell would): it
    stops at a step, writes what a run stopped by Ctrl-C writes, and returns (not raises) its summary."""
    monkeypatch.chdir(tmp_path)

    def after_an_update() -> None:
        deadline = time.monotonic() + 60
        while not any(rundir.read_jsonl(m) for m in tmp_path.glob(f"runs/*/{rundir.METRICS}")):
            assert time.monotonic() < deadline, "no update within 60 s"
            time.sleep(0.1)

    code = snippet("python-api-thread")
    scope: dict[str, object] = {"after_an_update": after_an_update}
    exec(code.replace("\nstop.set()", "\nafter_an_update()\nstop.set()"), scope)
    summary = scope["summary"]
    assert isinstance(summary, dict) and summary["stop_reason"] == "stopped", summary
    run = Path(summary["run_dir"])
    last_update = rundir.read_jsonl(run / rundir.METRICS)[-1]
    assert summary["total_steps"] == last_update["global_step"] > 0
    assert rundir.read_json(run / rundir.SUMMARY)["stop_reason"] == "stopped"
    assert (run / rundir.PLOT).is_file() and rundir.list_checkpoints(run)
    assert capsys.readouterr().out.splitlines()[-1] == f"stopped {summary['total_steps']} {run}"
