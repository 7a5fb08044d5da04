"""The learner as a library, as a script or a notebook uses it: the README's "Training from Python"
snippets run as printed, and an interrupt stops what called train(), not only the run."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
import torch

from learner import rundir
from learner.checkpoint import load_checkpoint
from learner.config import Args
from learner.envs import FleetSpec, open_fleet
from learner.train import train
from tests.conftest import CTRL_C_EXIT
from tests.test_readme_snippets import snippet
from tests.test_train import CtrlCAt, clock


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
    assert out.splitlines()[-1] == f"kernel: went on {CTRL_C_EXIT}", textwrap.shorten(out, 2000)
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


class Pruned(Exception):
    """A sweep giving a trial up from its ``on_update`` (as ``optuna.TrialPruned`` does)."""


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap-update"])
@pytest.mark.parametrize("raise_at", [None, 3, 5], ids=["to-the-end", "pruned-at-3", "pruned-at-the-last"])
def test_on_update_gets_each_metrics_row_and_what_it_raises_ends_the_run(
    tmp_path: Path, overlap: bool, raise_at: int | None
) -> None:
    """Every update's row, as metrics.jsonl has it, on the calling thread (with --overlap-update too, whose
    last update finishes after the loop); an exception it raises reaches the caller, the run written up to
    that update (its checkpoint, summary.json's stop_reason naming it)."""
    rows: list[dict[str, object]] = []
    threads: set[int] = set()

    def on_update(row: dict[str, object]) -> None:
        rows.append(row)
        threads.add(threading.get_ident())
        row["global_step"] = -1  # (its own copy)
        if len(rows) == raise_at:
            raise Pruned(f"at update {len(rows)}")

    run = tmp_path / "run"
    args = Args(**clock(3), backend="gym", num_envs=2, num_steps=8, total_timesteps=80, run_dir=str(run))
    args = dataclasses.replace(args, overlap_update=overlap)
    if raise_at is None:
        summary = train(args, on_update=on_update)
        assert summary["stop_reason"] == "total_timesteps"
    else:
        with pytest.raises(Pruned, match=f"at update {raise_at}"):
            train(args, on_update=on_update)
        summary = rundir.read_json(run / rundir.SUMMARY)
        assert summary["stop_reason"] == f"error: Pruned: at update {raise_at}"
    written = rundir.read_jsonl(run / rundir.METRICS)
    assert len(rows) == len(written) == (raise_at or 5) and threads == {threading.get_ident()}
    assert [{**row, "global_step": w["global_step"]} for row, w in zip(rows, written, strict=True)] == written
    assert summary["total_steps"] == written[-1]["global_step"] == 16 * len(written)
    assert load_checkpoint(rundir.list_checkpoints(run)[-1])["counters"]["global_step"] == summary["total_steps"]


class TrialPruned(Exception):
    pass


class _Trial:
    """A stand-in for the part of ``optuna.Trial`` the README's sweep uses."""

    def __init__(self, number: int, prune_at: int | None) -> None:
        self.number, self.prune_at = number, prune_at
        self.reports: list[tuple[int, float]] = []
        self.asked = 0

    def suggest_float(self, name: str, low: float, high: float, *, log: bool = False) -> float:
        return low

    def suggest_categorical(self, name: str, choices: list[object]) -> object:
        return choices[self.number % len(choices)]

    def report(self, value: float, step: int) -> None:
        self.reports.append((step, value))

    def should_prune(self) -> bool:
        self.asked += 1
        return self.asked == self.prune_at


class _Study:
    def __init__(self) -> None:
        self.trials: list[tuple[_Trial, str]] = []
        self.best_params: dict[str, object] = {}

    def optimize(self, objective: Callable[[_Trial], float], n_trials: int) -> None:
        for number in range(n_trials):
            trial = _Trial(number, prune_at=2 if number == 1 else None)
            try:
                assert isinstance(objective(trial), float)
                self.trials.append((trial, "complete"))
            except TrialPruned:
                self.trials.append((trial, "pruned"))


@pytest.mark.slow
def test_the_sweep_snippet_runs_as_printed_against_optuna_s_api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Optuna is no dependency: the snippet runs against a stand-in of the API it uses (the snippet was run
    with Optuna 5.1 by hand), with 3 trials of 1,024 steps; the second is pruned at its second update."""
    study = _Study()
    optuna = types.ModuleType("optuna")
    optuna.__dict__.update(
        Trial=_Trial,
        TrialPruned=TrialPruned,
        create_study=lambda **_: study,
        pruners=types.SimpleNamespace(MedianPruner=lambda **_: None),
    )
    monkeypatch.setitem(sys.modules, "optuna", optuna)
    monkeypatch.chdir(tmp_path)
    code = snippet("python-api-sweep")
    small = code.replace("total_timesteps=30_000", "total_timesteps=1_024").replace("n_trials=6", "n_trials=3")
    assert small.count("1_024") == 1 and small.count("n_trials=3") == 1
    exec(small, {"__name__": "sweep"})
    assert [state for _, state in study.trials] == ["complete", "pruned", "complete"]
    for trial, state in study.trials:
        run = tmp_path / "runs" / "sweep" / f"trial-{trial.number}"
        rows = rundir.read_jsonl(run / rundir.METRICS)
        assert [step for step, _ in trial.reports] == [
            row["global_step"] for row in rows if row["episodic_return_mean"] is not None
        ]
        summary = rundir.read_json(run / rundir.SUMMARY)
        assert summary["stop_reason"] == ("total_timesteps" if state == "complete" else "error: TrialPruned")
        assert len(rows) == (2 if state == "pruned" else 1_024 // (8 * (16, 32, 64)[trial.number]))
        assert rundir.read_json(run / rundir.CONFIG)["ppo"]["num_steps"] == (16, 32, 64)[trial.number]


def test_train_leaves_the_caller_s_random_generators_as_it_found_them(tmp_path: Path) -> None:
    """A random search drawing each trial's settings from the global generators draws on from where it
    was, not from the run's seed (it drew the same settings after every run)."""

    def draws() -> tuple[float, float, float]:
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    draws()
    expected = draws()
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    draws()
    args = Args(**clock(3), backend="gym", num_envs=2, num_steps=8, total_timesteps=32, run_dir=str(tmp_path / "r"))
    train(args)
    assert draws() == expected
    with pytest.raises(Pruned):  # (also when it raises)
        train(dataclasses.replace(args, run_dir=str(tmp_path / "r2")), on_update=lambda row: _raise(Pruned()))
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    draws(), draws()
    after = draws()
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    draws(), draws()
    with pytest.raises(Pruned):
        train(dataclasses.replace(args, run_dir=str(tmp_path / "r3")), on_update=lambda row: _raise(Pruned()))
    assert draws() == after


def _raise(error: BaseException) -> None:
    raise error


def test_runs_in_threads_of_one_process_are_warned_of_and_a_stop_set_already_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Threads of one process share the global generators: neither run is reproducible from its seed."""
    args = Args(**clock(3), backend="gym", num_envs=2, num_steps=8, total_timesteps=10**9)
    stop, started = threading.Event(), threading.Event()

    def first() -> dict[str, object]:
        return train(
            dataclasses.replace(args, run_dir=str(tmp_path / "a")), on_start=lambda _: started.set(), stop=stop
        )

    with caplog.at_level(logging.WARNING, logger="learner.train"), ThreadPoolExecutor(1) as pool:
        running = pool.submit(first)
        assert started.wait(60)
        stop_set = threading.Event()
        stop_set.set()
        second = train(dataclasses.replace(args, run_dir=str(tmp_path / "b")), stop=stop_set)
        stop.set()
        assert running.result()["stop_reason"] == second["stop_reason"] == "stopped"
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("1 other train() run in this process: runs in threads of one process share") for m in said)
    assert any(m.startswith("stop was set before train() began: the run stops at its first step") for m in said)
    assert second["total_steps"] == 0 and not rundir.list_checkpoints(tmp_path / "b")  # (no update: none)


def test_runs_in_threads_that_overlap_leave_the_callers_settings_as_they_were(tmp_path: Path) -> None:
    """Two runs in threads, the first to start the first to end (two seeds in a notebook's pool): the
    process's global generators and cudnn's flag are the caller's again after both, not what the first
    run had set (each put back what it found)."""
    args = Args(**clock(3), backend="gym", num_envs=2, num_steps=8, total_timesteps=10**9)
    deterministic = torch.backends.cudnn.deterministic

    def draws() -> tuple[float, float, float]:
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    def run(name: str, started: threading.Event, stop: threading.Event) -> dict[str, object]:
        return train(
            dataclasses.replace(args, run_dir=str(tmp_path / name), torch_deterministic=not deterministic),
            on_start=lambda _: started.set(),
            stop=stop,
        )

    try:
        random.seed(7), np.random.seed(7), torch.manual_seed(7)
        expected = draws()
        random.seed(7), np.random.seed(7), torch.manual_seed(7)
        a_started, a_stop, b_started, b_stop = (threading.Event() for _ in range(4))
        with ThreadPoolExecutor(2) as pool:
            a = pool.submit(run, "a", a_started, a_stop)
            assert a_started.wait(60)
            b = pool.submit(run, "b", b_started, b_stop)
            assert b_started.wait(60)
            a_stop.set()
            assert a.result()["stop_reason"] == "stopped"
            b_stop.set()
            assert b.result()["stop_reason"] == "stopped"
        assert torch.backends.cudnn.deterministic == deterministic
        assert draws() == expected
    finally:
        torch.backends.cudnn.deterministic = deterministic


def test_an_editable_install_puts_the_checkout_where_type_checkers_see_it() -> None:
    """setuptools' default editable install is an import hook, which mypy and pyright do not follow: user code
    saw no `learner` (or `Any`). pyproject.toml's package-dir makes it a .pth file naming the checkout, with no
    option (setuptools' compat mode, which it deprecates, did that before)."""
    import importlib.metadata
    import json
    import site

    from tests.conftest import ROOT

    # (the installed one: the checkout's own envfleet.egg-info comes first on sys.path)
    installed = list(importlib.metadata.distributions(name="envfleet", path=site.getsitepackages()))
    if not installed:
        pytest.skip("envfleet is not installed here")
    dist = installed[0]
    if not json.loads(dist.read_text("direct_url.json") or "{}").get("dir_info", {}).get("editable"):
        pytest.skip("envfleet is not installed editable here")
    files = [str(f) for f in dist.files or []]
    assert not [f for f in files if f.endswith("_finder.py")], (
        f"an import hook, not `make setup`'s install (rm .venv/.installed; make setup): {files}"
    )
    [pth] = [f for f in dist.files or [] if str(f).endswith(".pth")]
    checkout = Path(str(pth.locate())).read_text().strip()
    if Path(checkout).resolve() != ROOT and (Path(checkout) / "learner").is_dir():
        pytest.skip(f"envfleet is installed from another checkout, {checkout}")
    assert checkout == str(ROOT)


def test_pyproject_makes_an_editable_install_a_pth_file_naming_the_checkout(tmp_path: Path) -> None:
    """pyproject.toml's package-dir: with no option, setuptools' editable install was an import hook (a
    ``_finder.py`` module), which type checkers do not follow; the compat mode that made it a .pth is deprecated."""
    import shutil
    import zipfile

    from tests.conftest import ROOT

    checkout = tmp_path / "checkout"  # (a copy: building writes envfleet.egg-info where it builds)
    checkout.mkdir()
    for name in ("pyproject.toml", "LICENSE", "README.md", "MANIFEST.in"):
        shutil.copy(ROOT / name, checkout / name)
    for package in ("env_server", "learner"):
        shutil.copytree(ROOT / package, checkout / package, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from setuptools import build_meta; print(build_meta.build_editable({str(tmp_path)!r}))",
        ],
        cwd=checkout,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    with zipfile.ZipFile(tmp_path / built.stdout.strip().splitlines()[-1]) as wheel:
        names = wheel.namelist()
        [pth] = [n for n in names if n.endswith(".pth")]
        assert wheel.read(pth).decode().strip() == str(checkout) and not [n for n in names if n.endswith("_finder.py")]


def test_both_packages_say_their_version() -> None:
    import importlib.metadata

    import env_server
    import learner

    assert learner.__version__ == env_server.__version__ == importlib.metadata.version("envfleet")
    with pytest.raises(AttributeError, match="module 'env_server' has no attribute 'nope'"):
        env_server.nope  # type: ignore[attr-defined]  # noqa: B018
