"""``learner train --track``: runs logged to Weights & Biases by a real wandb, offline (never the network), read
back from the files it writes; a resumed run goes on in the same W&B run; without wandb, an error naming the extra."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import struct
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import pytest
from google.protobuf.message import DecodeError

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
from learner import rundir
from learner.cli import main
from learner.config import Args
from learner.envs import FleetSpec, open_fleet
from learner.errors import TrainingInterrupted
from learner.train import train
from tests.conftest import CLOCK_ARGS, IN_PROCESS_ARGS
from tests.test_train import CtrlCAt

# In-process envs: a run of 32 steps takes about a second, W&B's start and finish about as long.
CLOCK = [*CLOCK_ARGS, *IN_PROCESS_ARGS, "--no-plot"]


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """wandb offline (it never reaches for the network), everything it writes under the folder given; no
    WANDB_* variable of the caller's (a WANDB_RUN_ID would pick the run's id)."""
    wandb = pytest.importorskip("wandb")
    folder = tmp_path / "wandb-files"
    for name in [name for name in os.environ if name.startswith("WANDB_")]:
        monkeypatch.delenv(name)
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": folder,
        "WANDB_CONFIG_DIR": folder / "config",
        "WANDB_CACHE_DIR": folder / "cache",
        "WANDB_DATA_DIR": folder / "data",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_ERROR_REPORTING": "false",
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_X_DISABLE_META": "true",
    }.items():
        monkeypatch.setenv(name, str(value))
    folder.mkdir()
    # (wandb-core 0.26, the floor, leaves an empty tea_debug.log in its working directory)
    monkeypatch.chdir(tmp_path)
    # wandb reads its settings from the environment once per process, until torn down.
    wandb.teardown()
    yield folder
    wandb.teardown()


def _records(path: Path) -> Iterator[Any]:
    """The records of a run's ``run-*.wandb`` file: a LevelDB-style log (wandb's "datastore": a 7-byte
    header, then 32 KiB blocks of chunks, each with a 7-byte header: CRC, length, type) of protobuf
    ``Record`` messages."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B", data[:7]
    pos, record = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # (a block's zero padding)
            pos += left
            continue
        record += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or its last chunk
            # (wandb is typed, but its generated protobuf modules make their classes at import: no stubs)
            message = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            message.ParseFromString(record)
            yield message
            record = b""


def read_offline_run(path: Path) -> dict[str, Any]:
    """An offline run (its ``offline-run-*`` folder) as wandb wrote it: id, name, project, started (ns),
    config, history (a row per step, by ``_step``), summary (what was put there) and exit code."""
    (log,) = path.glob("run-*.wandb")
    run: dict[str, Any] = {"config": {}, "history": {}, "summary": {}, "exit_code": None}

    def items(updates: Any) -> dict[str, Any]:
        return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in updates}

    for record in _records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(id=record.run.run_id, name=record.run.display_name, project=record.run.project)
            run["started"] = record.run.start_time.ToNanoseconds()
            run["config"].update(items(record.run.config.update))
        elif kind == "config":
            run["config"].update(items(record.config.update))
        elif kind == "history":
            row = items(record.history.item)
            run["history"][row["_step"]] = row
        elif kind == "summary":
            run["summary"].update((k, v) for k, v in items(record.summary.update).items() if not k.startswith("_"))
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


def offline_runs(folder: Path, wait: float = 30.0) -> list[dict[str, Any]]:
    """The offline runs under ``folder`` (WANDB_DIR), oldest first (their folders' names say the second),
    once each has its exit record: wandb.finish returns before wandb-core has written the records (a
    file of its 7-byte header only, read at once, now and then); a process's exit waits for them."""
    deadline = time.monotonic() + wait
    while True:
        paths = list(folder.glob("wandb/offline-run-*"))  # (made by wandb.init: none, none to wait for)
        try:
            runs = [read_offline_run(path) for path in paths]
        except (DecodeError, ValueError, AssertionError):  # (a file not made yet, or being written)
            runs = [{}]
        if all("started" in r and r["exit_code"] is not None for r in runs):
            return sorted(runs, key=lambda r: r["started"])
        assert time.monotonic() < deadline, f"no exit record after {wait:g} s in {paths}"
        time.sleep(0.1)


@pytest.mark.slow
def test_without_wandb_dir_the_wandb_files_go_to_the_run_dir(
    tmp_path: Path, offline_wandb: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """wandb's default, ./wandb, put a wandb/ folder among the run dirs (runs/, in the learner container):
    `learner plot runs/*` then failed on it. Without WANDB_DIR the files are the run dir's own."""
    monkeypatch.delenv("WANDB_DIR")
    run_dir = tmp_path / "runs" / "clock-run"
    assert main(["train", *CLOCK, "--total-timesteps", "32", "--run-dir", str(run_dir), "--track"]) == 0
    (run,) = offline_runs(run_dir)
    assert run["name"] == "clock-run"
    assert [path.name for path in (tmp_path / "runs").iterdir()] == ["clock-run"]
    assert not (tmp_path / "wandb").exists()
    assert f"wandb sync {run_dir.resolve()}/wandb/offline-run-" in capsys.readouterr().out


def test_a_tracked_run_logs_its_metrics_config_and_summary_to_a_wandb_run_named_after_its_run_dir(
    tmp_path: Path, offline_wandb: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("WANDB_PROJECT", "envfleet-tests")
    run_dir = tmp_path / "clock-run"
    assert main(["train", *CLOCK, "--total-timesteps", "32", "--run-dir", str(run_dir), "--track"]) == 0

    (run,) = offline_runs(offline_wandb)
    saved = rundir.read_json(run_dir / rundir.WANDB_RUN)
    assert (run["id"], run["name"], run["project"]) == (saved["id"], "clock-run", "envfleet-tests")
    assert f"W&B run: {saved['id']}, offline (upload it with: wandb sync {offline_wandb}/wandb/offline-run-" in (
        capsys.readouterr().out
    )
    # The W&B config is config.json's, with where the run dir is.
    config = rundir.read_json(run_dir / rundir.CONFIG)
    assert run["config"]["envs"] == config["envs"] and run["config"]["envs"]["env_id"] == "tests.envs:ClockEnv"
    assert run["config"]["args"]["track"] is True and run["config"]["args"]["wandb_project_name"] == "envfleet-tests"
    assert run["config"]["run_dir"] == str(run_dir.resolve())

    # Every update's figures at its global step, by TensorBoard's tags; each episode at the step it
    # ended (ClockEnv's: every 4th vector step of both envs, averaged).
    history = run["history"]
    assert all(row["global_step"] == step for step, row in history.items())
    rows = rundir.read_jsonl(run_dir / rundir.METRICS)
    assert [r["global_step"] for r in rows] == [16, 32]
    for row in rows:
        logged = history[row["global_step"]]
        assert logged["charts/SPS"] == row["sps"] and logged["losses/approx_kl"] == pytest.approx(row["approx_kl"])
        assert logged["charts/episodic_return_mean"] == row["episodic_return_mean"]
        assert logged["charts/update"] == row["update"] and logged["perf/rollout_seconds"] == row["rollout_seconds"]
        assert logged["faults/env_errors"] == 0
    episodes = {step: row for step, row in history.items() if "charts/episodic_return" in row}
    assert sorted(episodes) == [6, 14, 22, 30]
    assert all(
        row["charts/episodic_length"] == 3 and 0 <= row["charts/episodic_return"] <= 3 for row in episodes.values()
    )

    summary = rundir.read_json(run_dir / rundir.SUMMARY)
    assert run["summary"]["total_steps"] == summary["total_steps"] == 32
    assert run["summary"]["stop_reason"] == "total_timesteps" and run["exit_code"] == 0


@pytest.mark.slow
def test_a_resumed_run_goes_on_in_its_wandb_run_and_no_track_leaves_it_alone(
    tmp_path: Path, offline_wandb: Path
) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", *CLOCK, "--total-timesteps", "16", "--run-dir", str(run_dir), "--track"]) == 0
    # (recorded: the resumed run is tracked without being told again)
    assert main(["train", "--resume", str(run_dir), "--total-timesteps", "32"]) == 0
    first, resumed = offline_runs(offline_wandb)
    assert first["id"] == resumed["id"] == rundir.read_json(run_dir / rundir.WANDB_RUN)["id"]
    assert max(first["history"]) == 16 and min(resumed["history"]) > 16 and max(resumed["history"]) == 32
    assert resumed["summary"]["total_steps"] == 32 and resumed["exit_code"] == 0

    assert main(["train", "--resume", str(run_dir), "--total-timesteps", "48", "--no-track"]) == 0
    assert len(offline_runs(offline_wandb)) == 2
    # (--no-track: not this time; the run is still a tracked one, and its next session goes on in it)
    assert rundir.read_json(run_dir / rundir.CONFIG)["args"]["track"] is True
    assert main(["train", "--resume", str(run_dir), "--total-timesteps", "64"]) == 0
    runs = offline_runs(offline_wandb)
    assert len(runs) == 3 and runs[-1]["id"] == first["id"] and min(runs[-1]["history"]) > 48


def test_envfleet_track_turns_tracking_on_where_no_option_says_otherwise(
    tmp_path: Path, offline_wandb: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """$ENVFLEET_TRACK (compose passes it to the learner, whose command stays as it is): on tracks a new run
    given no --track, off does not, and --track or --no-track on the command line win; a resumed run keeps
    its own (as with $WANDB_PROJECT). A value that is no switch is refused, naming the variable."""
    monkeypatch.setenv("ENVFLEET_TRACK", "on")
    run_dir = tmp_path / "on"
    assert main(["train", *CLOCK, "--total-timesteps", "16", "--run-dir", str(run_dir)]) == 0
    (run,) = offline_runs(offline_wandb)
    assert run["name"] == "on" and rundir.read_json(run_dir / rundir.CONFIG)["args"]["track"] is True
    assert main(["train", *CLOCK, "--total-timesteps", "16", "--run-dir", str(tmp_path / "not"), "--no-track"]) == 0
    monkeypatch.setenv("ENVFLEET_TRACK", " OFF ")
    assert main(["train", *CLOCK, "--total-timesteps", "16", "--run-dir", str(tmp_path / "off")]) == 0
    assert main(["train", "--resume", str(run_dir), "--total-timesteps", "32"]) == 0  # (tracked: it goes on)
    assert main(["train", "--like", str(run_dir), "--total-timesteps", "16", "--run-dir", str(tmp_path / "like")]) == 0
    assert main(["train", *CLOCK, "--total-timesteps", "16", "--run-dir", str(tmp_path / "given"), "--track"]) == 0
    assert sorted(r["name"] for r in offline_runs(offline_wandb)) == ["given", "like", "on", "on"]
    assert rundir.read_json(run_dir / rundir.CONFIG)["args"]["track"] is True
    assert not (tmp_path / "not" / rundir.WANDB_RUN).exists() and not (tmp_path / "off" / rundir.WANDB_RUN).exists()
    monkeypatch.setenv("ENVFLEET_TRACK", "")  # (set and empty, as compose passes an unset one: off)
    assert main(["train", *CLOCK, "--total-timesteps", "16", "--run-dir", str(tmp_path / "empty")]) == 0
    assert len(offline_runs(offline_wandb)) == 4
    capsys.readouterr()
    monkeypatch.setenv("ENVFLEET_TRACK", "maybe")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *CLOCK, "--run-dir", str(tmp_path / "bad")])
    assert exit_info.value.code == 2 and not (tmp_path / "bad").exists()
    assert "$ENVFLEET_TRACK: expected on or off (or true/false, 1/0, yes/no), got 'maybe'" in capsys.readouterr().err


@contextlib.contextmanager
def _fleet_ctrl_c_at(spec: FleetSpec, at: int) -> Iterator[gym.vector.VectorEnv]:
    with open_fleet(spec) as envs:
        yield CtrlCAt(envs, at=at)


class _Broken(gym.vector.VectorWrapper):
    """Envs whose every step raises."""

    def step(self, actions: Any) -> Any:
        raise RuntimeError("the env broke")


def test_a_run_stopped_by_ctrl_c_or_an_error_finishes_its_wandb_run_with_the_exit_code(
    tmp_path: Path, offline_wandb: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = Args(
        env="tests.envs:ClockEnv",
        backend="gym",
        num_envs=2,
        num_steps=8,
        total_timesteps=64,
        progress=False,
        tensorboard=False,
        plot=False,
        track=True,
    )
    with monkeypatch.context() as patch:
        patch.setattr("learner.train.open_fleet", lambda spec: _fleet_ctrl_c_at(spec, at=8 + 3))
        with pytest.raises(TrainingInterrupted) as interrupted:
            train(dataclasses.replace(args, run_dir=str(tmp_path / "stopped")))
    assert interrupted.value.summary["stop_reason"] == "interrupted"

    @contextlib.contextmanager
    def failing(spec: FleetSpec) -> Iterator[gym.vector.VectorEnv]:
        with open_fleet(spec) as envs:
            yield _Broken(envs)

    with monkeypatch.context() as patch:
        patch.setattr("learner.train.open_fleet", failing)
        with pytest.raises(RuntimeError, match="the env broke"):  # (the error itself, not W&B's)
            train(dataclasses.replace(args, run_dir=str(tmp_path / "failed")))

    stopped, failed = offline_runs(offline_wandb)
    assert (stopped["name"], stopped["exit_code"]) == ("stopped", 130)
    assert stopped["summary"]["stop_reason"] == "interrupted" and max(stopped["history"]) == 16
    assert (failed["name"], failed["exit_code"]) == ("failed", 1)


def test_track_without_wandb_names_the_extra_to_install_before_any_env_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # (import wandb: ModuleNotFoundError)
    monkeypatch.delitem(sys.modules, "learner.tracking", raising=False)
    monkeypatch.setattr("learner.train.open_fleet", lambda spec: pytest.fail("envs started"))
    run_dir = tmp_path / "run"
    assert main(["train", "--env", "CartPole-v1", "--track", "--run-dir", str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert (
        "learner train: error: --track needs wandb, which is not installed here: pip install 'envfleet[track]'" in err
    )
    assert "Traceback" not in err and not run_dir.exists()
    monkeypatch.setenv("ENVFLEET_TRACK", "on")  # (what turned it on is said)
    assert main(["train", "--env", "CartPole-v1", "--run-dir", str(run_dir)]) == 1
    assert "--no-track); $ENVFLEET_TRACK turns it on here" in capsys.readouterr().err


def test_track_where_wandb_is_only_a_folder_in_the_working_directory_names_the_extra_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A folder ./wandb (CleanRL's runs leave one) imports as a namespace package where wandb is not installed
    (the learner command has the working directory on sys.path): was an AttributeError later."""
    namespace = types.ModuleType("wandb")  # (as a namespace package: no __file__)
    namespace.__path__ = [str(tmp_path / "wandb")]
    monkeypatch.setitem(sys.modules, "wandb", namespace)
    monkeypatch.delitem(sys.modules, "learner.tracking", raising=False)
    monkeypatch.setattr("learner.train.open_fleet", lambda spec: pytest.fail("envs started"))
    run_dir = tmp_path / "run"
    assert main(["train", "--env", "CartPole-v1", "--track", "--run-dir", str(run_dir)]) == 1
    err = capsys.readouterr().err
    assert "learner train: error: --track needs wandb, which is not installed here" in err, err
    assert "Traceback" not in err and not run_dir.exists()
    monkeypatch.setenv("ENVFLEET_TRACK", "off")  # (--track did: the variable is not named)
    assert main(["train", "--env", "CartPole-v1", "--track", "--run-dir", str(run_dir)]) == 1
    assert "ENVFLEET_TRACK" not in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--wandb-project-name", "--wandb-entity"])
def test_wandb_names_without_track_are_refused(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", option, "me"])
    assert exit_info.value.code == 2
    assert f"{option}: names where --track logs the run to W&B; give --track too" in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_without_track_never_imports_wandb(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from learner.cli import main\n"
        f"assert main(['train', *{CLOCK!r}, '--total-timesteps', '16', '--run-dir', {str(tmp_path / 'run')!r}]) == 0\n"
        "assert 'wandb' not in sys.modules and 'learner.tracking' not in sys.modules, 'imported'\n"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_train_help_lists_the_wandb_options_between_the_run_and_ppo(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    group = text[text.index("\ntracking with Weights & Biases") : text.index("\nPPO hyperparameters")]
    assert text.index("\nthe run:") < text.index("\ntracking with Weights & Biases")
    for option in ("--track, --no-track", "--wandb-project-name NAME", "--wandb-entity NAME", "envfleet[track]"):
        assert option in group, option
