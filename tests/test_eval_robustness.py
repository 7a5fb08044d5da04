"""``learner eval`` on servers of another env, damaged checkpoints and a run's checkpoints folder, errors
that stop its episodes (the ones finished are reported), and ``learner plot`` of one-point runs, folders
that are no runs and an output it cannot write."""

from __future__ import annotations

import errno
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import matplotlib.figure
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
import torch

from learner import rundir
from learner.checkpoint import UnreadableCheckpointError, find_checkpoint, load_checkpoint, load_latest_readable
from learner.cli import main
from learner.errors import RemoteTimeoutError
from learner.evaluate import evaluate
from learner.stats import format_return
from tests.conftest import QUIET_FLAGS as QUIET
from tests.conftest import ServerProcess, SpawnServer, StartServers


@pytest.fixture(scope="module")
def cartpole_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CartPole-v1 run of 4 updates, each checkpointed: 3 checkpoints kept (in-process envs: a second)."""
    run = tmp_path_factory.mktemp("runs") / "cartpole"
    steps = ["--num-envs", "1", "--num-steps", "8", "--total-timesteps", "32", "--checkpoint-seconds", "0"]
    argv = ["train", "--env", "CartPole-v1", "--backend", "gym", *steps, "--run-dir", str(run), *QUIET]
    assert main(argv) == 0
    assert len(rundir.list_checkpoints(run)) == 3
    return run


def _eval(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["eval", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# -- servers of another env ---------------------------------------------------------------------------------


def test_eval_refuses_servers_of_another_env_with_the_same_spaces_as_training_does(
    cartpole_run: Path, start_servers: StartServers, capsys: pytest.CaptureFixture[str]
) -> None:
    """CartPole-v0 has v1's spaces (only its time limit and threshold differ): its return is no sample of
    the policy on CartPole-v1, and was printed as one."""
    (v0,) = start_servers("CartPole-v0", 1, 2)
    code, out, err = _eval(capsys, str(cartpole_run), "--episodes", "2", "--servers", v0)
    assert code == 1 and not out, out
    assert err.rstrip().endswith(
        f"learner eval: error: --servers: the checkpoint's policy was trained on CartPole-v1, but the servers at {v0} "
        "serve CartPole-v0; evaluate it on servers of CartPole-v1"
    ), err
    (v1,) = start_servers("CartPole-v1", 1, 2)
    code, out, err = _eval(capsys, str(cartpole_run), "--episodes", "2", "--servers", v1, "--json")
    assert code == 0, err
    assert json.loads(out)["episodes"] == 2


# -- errors that stop the episodes --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gate_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run on tests.envs:GateEnv (ClockEnv's 3-step episodes), trained in process without reaching its
    gate; its servers' gate, at the env's 10th step, comes after 3 episodes have finished."""
    run = tmp_path_factory.mktemp("runs") / "gate"
    never = json.dumps({"gate": str(run.parent / "never"), "at": 10**9})
    argv = ["train", "--env", "tests.envs:GateEnv", "--env-kwargs", never, "--backend", "gym", "--num-envs", "1"]
    assert main([*argv, "--num-steps", "8", "--total-timesteps", "32", "--run-dir", str(run), *QUIET]) == 0
    return run


def _gate_server(spawn_server: SpawnServer, gate: Path, **kwargs: Any) -> ServerProcess:
    """A server of one GateEnv whose 10th step waits at ``gate`` (the 4th episode's first step)."""
    return spawn_server("tests.envs:GateEnv", 1, "--env-kwargs", json.dumps({"gate": str(gate), "at": 10, **kwargs}))


def _kill_at(gate: Path, server: ServerProcess) -> threading.Thread:
    """Kill ``server`` (SIGKILL) once its env waits at ``gate``: a server that dies mid-evaluation."""

    def kill() -> None:
        deadline = time.monotonic() + 60
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        server.kill()

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def test_eval_stopped_by_a_server_that_died_reports_the_episodes_finished_before_the_error(
    gate_run: Path, spawn_server: SpawnServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """They are a sample of the return all the same (a Ctrl-C reports them too): printed as a result,
    marked partial, then the error, exit status 1 as before; --json has them with the error."""
    gate = tmp_path / "gate"
    server = _gate_server(spawn_server, gate)
    checkpoint = rundir.list_checkpoints(gate_run)[-1]
    killer = _kill_at(gate, server)
    code, out, err = _eval(capsys, str(gate_run), "--episodes", "10", "--servers", server.address)
    killer.join(timeout=30)
    assert code == 1, err
    first, returns = out.splitlines()
    assert first == (
        f"tests.envs:GateEnv: 3 of 10 episodes finished before the error, of the deterministic policy in "
        f"{checkpoint}, on env servers at {server.address}, 1 envs"
    ), out
    assert err.startswith(f"learner eval: error: env server {server.address}: Step failed [UNAVAILABLE]"), err
    # --json: the same episodes, and the error as printed.
    gate.unlink()
    server.start()  # (again, on the same address: its env's steps counted from 0)
    killer = _kill_at(gate, server)
    code, out, err = _eval(capsys, str(gate_run), "--episodes", "10", "--servers", server.address, "--json")
    killer.join(timeout=30)
    assert code == 1, err
    result = json.loads(out)
    assert (result["episodes"], result["episodes_asked"], len(result["returns"])) == (3, 10, 3)
    mean, low, high = (format_return(result[key]) for key in ("return_mean", "return_min", "return_max"))
    assert returns == f"return {mean} +- 0 (min {low}, max {high}), mean length 3.0", (returns, result)
    assert err.startswith(f"learner eval: error: {result['error']}"), (err, result["error"])


@pytest.mark.slow
def test_eval_whose_step_passed_its_deadline_reports_the_episodes_finished_and_evaluate_keeps_them(
    gate_run: Path, spawn_server: SpawnServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The 10th step takes 3 s (its gate is never opened), past --timeout 1. The library's evaluate()
    raises the error with those episodes' result as its ``partial_result``."""
    gate = tmp_path / "gate"
    server = _gate_server(spawn_server, gate, hold_s=3.0)
    code, out, err = _eval(capsys, str(gate_run), "--episodes", "10", "--servers", server.address, "--timeout", "1")
    assert code == 1, err
    assert ": 3 of 10 episodes finished before the error, of the deterministic policy in " in out, out
    assert "mean length 3.0" in out
    assert "Step failed [DEADLINE_EXCEEDED]: no answer within the 1 s deadline" in err, err
    assert err.rstrip().endswith("; raise --timeout if the env is slow"), err
    server.kill()
    server.start()
    with pytest.raises(RemoteTimeoutError) as raised:
        evaluate(gate_run, 10, servers=server.address, timeout=1.0, progress=False)
    assert str(raised.value).endswith("; raise `timeout` if the env is slow"), raised.value
    partial = raised.value.partial_result
    assert partial is not None and (partial["episodes"], partial["episodes_asked"]) == (3, 10), partial
    assert partial["length_mean"] == 3.0 and len(partial["returns"]) == 3 and partial["return_std"] == 0.0
    assert partial["checkpoint"] == str(rundir.list_checkpoints(gate_run)[-1]) and "interrupted" not in partial


# -- damaged checkpoints, the checkpoints folder ------------------------------------------------------------


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            "hello",
            "it is not a checkpoint torch can read (torch.save writes a zip archive; this file starts b'hello\\n')",
        ),
        ("empty", "the file is empty"),
        # (torch's own errors: RuntimeError: PytorchStreamReader failed ..., OSError: [Errno 22] Invalid argument)
        ("first-half", "the file is truncated or corrupt: not a checkpoint torch can read (RuntimeError: "),
        ("small-end-cut", "the file is truncated or corrupt: not a checkpoint torch can read (OSError: "),
    ],
)
def test_eval_of_a_damaged_checkpoint_names_the_file_and_says_what_is_wrong(
    damage: str, message: str, cartpole_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "x.pt"
    if damage == "small-end-cut":
        torch.save({"format": 1, "model": {"weight": torch.zeros(1000)}}, path)
        path.write_bytes(path.read_bytes()[:-20])
    else:
        good = rundir.list_checkpoints(cartpole_run)[-1].read_bytes()
        path.write_bytes({"hello": b"hello\n", "empty": b"", "first-half": good[: len(good) // 2]}[damage])
    code, _, err = _eval(capsys, str(path), "--episodes", "1", "--backend", "gym")
    assert code == 1
    assert f"learner eval: error: {path}: expected an envfleet checkpoint, but {message}" in err, err
    assert "Traceback" not in err and "KeyError" not in err


def test_eval_takes_a_runs_checkpoints_folder_as_its_latest_checkpoint_but_resume_does_not(
    cartpole_run: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    latest = rundir.list_checkpoints(cartpole_run)[-1]
    folder = cartpole_run / rundir.CHECKPOINTS
    code, out, err = _eval(capsys, str(folder), "--episodes", "1", "--backend", "gym", "--json")
    assert code == 0, err
    assert json.loads(out)["checkpoint"] == str(latest)
    monkeypatch.chdir(folder)  # (".": a folder without a name of its own)
    assert find_checkpoint(".", checkpoints_folder=True) == Path(latest.name)
    # --resume goes on in the folder it is given: only a run dir will do, as before.
    with pytest.raises(FileNotFoundError, match=r"checkpoints: expected a run dir with checkpoints/step-\*\.pt, found"):
        find_checkpoint(folder)
    # A folder with best.pt only: that file is named.
    (folder.parent.parent / "best-only" / rundir.CHECKPOINTS).mkdir(parents=True)
    best_only = folder.parent.parent / "best-only" / rundir.CHECKPOINTS
    (best_only / rundir.BEST_CHECKPOINT).write_bytes(latest.read_bytes())
    code, _, err = _eval(capsys, str(best_only), "--episodes", "1", "--backend", "gym")
    assert code == 1
    assert err.rstrip().endswith(
        f"{best_only}: expected a run dir with checkpoints/step-*.pt (or that checkpoints folder), found none; "
        f"{best_only / rundir.BEST_CHECKPOINT} is there: pass that file to evaluate it"
    ), err


def test_eval_of_a_best_pt_a_run_has_not_written_says_why(
    cartpole_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    best = cartpole_run / rundir.CHECKPOINTS / rundir.BEST_CHECKPOINT  # (32 steps: fewer than 20 episodes ended)
    assert not best.exists()
    code, _, err = _eval(capsys, str(best), "--episodes", "1", "--backend", "gym")
    assert code == 1
    assert f"{best}: expected a checkpoint file or a run dir, but nothing is there (a run writes best.pt" in err
    assert f"this one has none; pass {cartpole_run} for its latest checkpoint)" in err, err


def test_load_latest_readable_goes_back_past_damaged_checkpoints(
    cartpole_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = tmp_path / "run"
    (run / rundir.CHECKPOINTS).mkdir(parents=True)
    oldest, middle, newest = (run / rundir.CHECKPOINTS / p.name for p in rundir.list_checkpoints(cartpole_run))
    for original, copy in zip(rundir.list_checkpoints(cartpole_run), (oldest, middle, newest), strict=True):
        copy.write_bytes(original.read_bytes())
    newest.write_bytes(newest.read_bytes()[:-20])
    path, payload, skipped = load_latest_readable(run)
    assert path == middle and payload["format"] == load_checkpoint(middle)["format"]
    assert [p for p, _ in skipped] == [newest] and "truncated or corrupt" in skipped[0][1]
    assert f"{newest}: expected an envfleet checkpoint, but the file is truncated" in caplog.text
    # None readable: the oldest's error.
    for p in (oldest, middle):
        p.write_bytes(b"")
    with pytest.raises(UnreadableCheckpointError, match=f"{oldest}: .* the file is empty"):
        load_latest_readable(run)


def _flip_tensor_bytes(path: Path) -> None:
    """Zero 64 bytes in the middle of ``path``'s largest record (a tensor's data): torch loads such a file."""
    import zipfile

    with zipfile.ZipFile(path) as archive:
        largest = max(archive.infolist(), key=lambda info: info.file_size)
    data = bytearray(path.read_bytes())
    at = largest.header_offset + 30 + len(largest.filename) + largest.file_size // 2  # (past its local header)
    data[at : at + 64] = bytes(64) if any(data[at : at + 64]) else b"\xff" * 64
    path.write_bytes(bytes(data))


def test_a_checkpoint_whose_tensor_bytes_changed_fails_its_checksum_and_resume_goes_back(
    cartpole_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's reader skips the archive's CRC-32s: changed weights loaded as if whole. They are checked."""
    run = tmp_path / "run"
    (run / rundir.CHECKPOINTS).mkdir(parents=True)
    for original in rundir.list_checkpoints(cartpole_run):
        (run / rundir.CHECKPOINTS / original.name).write_bytes(original.read_bytes())
    newest = rundir.list_checkpoints(run)[-1]
    _flip_tensor_bytes(newest)
    torch.load(newest, weights_only=True)  # (torch itself takes it)
    code, _, err = _eval(capsys, str(newest), "--episodes", "1", "--backend", "gym")
    assert code == 1
    assert f"{newest}: expected an envfleet checkpoint, but the file is corrupt: its record " in err, err
    assert "fails its checksum" in err
    path, _, skipped = load_latest_readable(run)
    assert path == rundir.list_checkpoints(run)[-2] and [p for p, _ in skipped] == [newest]
    # Given the run dir, whose latest it is: the one before is named, to evaluate instead.
    code, _, err = _eval(capsys, str(run), "--episodes", "1", "--backend", "gym")
    assert code == 1 and f"the run's checkpoint before it is {rundir.list_checkpoints(run)[-2]}: evaluate" in err, err
    monkeypatch.chdir(run / rundir.CHECKPOINTS)  # (`learner eval .` from inside the folder: named too)
    code, _, err = _eval(capsys, ".", "--episodes", "1", "--backend", "gym")
    assert code == 1 and "the run's checkpoint before it is " in err, err


def test_a_checkpoint_saved_without_checksums_still_loads(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({**_WHOLE, "format": 1, "model": {"weight": torch.ones(1000)}}, path)
    finally:
        torch.serialization.set_crc32_options(True)
    assert load_checkpoint(path)["model"]["weight"].sum() == 1000


# What every checkpoint holds besides its nets (learner.checkpoint.REQUIRED), as placeholders.
_WHOLE = {"args": {}, "ppo": {}, "observation_space": "Box(0, 1)", "action_space": "Discrete(2)"}


def test_eval_of_a_checkpoint_that_lacks_what_each_holds_names_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A torch file that says it is a checkpoint of this format, but lacks keys every checkpoint has: a
    KeyError's traceback, in eval and --resume."""
    path = tmp_path / "x.pt"
    torch.save({"format": 1, "model": {"weight": torch.zeros(10)}, "ppo": {}}, path)
    code, _, err = _eval(capsys, str(path), "--episodes", "1", "--backend", "gym")
    assert code == 1
    assert err.rstrip().endswith(
        f"learner eval: error: {path}: expected an envfleet checkpoint, missing 'args', 'observation_space', "
        "'action_space' (it has 'format', 'model', 'ppo')"
    ), err
    with pytest.raises(UnreadableCheckpointError, match="missing 'args'"):
        load_checkpoint(path)


def test_resume_of_a_checkpoint_that_lacks_what_resuming_reads_names_what_is_missing(tmp_path: Path) -> None:
    """Eval needs no counters, optimizer nor RNG states; --resume read them: a KeyError's traceback."""
    from learner.checkpoint import RESUMED
    from learner.config import Args
    from learner.train import train

    run = tmp_path / "run"
    train(
        Args(
            env="CartPole-v1",
            backend="gym",
            num_envs=2,
            num_steps=8,
            total_timesteps=16,
            run_dir=str(run),
            progress=False,
            plot=False,
            tensorboard=False,
        )
    )
    (path,) = sorted((run / "checkpoints").glob("step-*.pt"))
    kept = {k: v for k, v in torch.load(path, weights_only=True).items() if k != "rng"}
    torch.save(kept, path)
    load_checkpoint(path)  # (eval's look: enough)
    with pytest.raises(UnreadableCheckpointError, match=r"expected an envfleet checkpoint, missing 'rng' \(it has "):
        load_checkpoint(path, resuming=True)
    with pytest.raises(UnreadableCheckpointError, match=r"missing 'rng'"):
        train(Args(resume=str(path), run_dir=str(run), total_timesteps=32, progress=False, plot=False))
    assert "rng" in RESUMED


# -- learner plot -------------------------------------------------------------------------------------------


def _run(folder: Path, returns: list[float]) -> Path:
    folder.mkdir(parents=True)
    rows = [
        {"update": i, "global_step": 16 * i, "seconds": 0.1 * i, "episodic_return_mean": r}
        for i, r in enumerate(returns, 1)
    ]
    rundir.rewrite_jsonl(folder / rundir.METRICS, rows)
    return folder


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[matplotlib.figure.Figure]:
    """The figures ``learner plot`` saves (still written, to the file it names)."""
    saved: list[matplotlib.figure.Figure] = []
    savefig = matplotlib.figure.Figure.savefig

    def save(fig: matplotlib.figure.Figure, *args: Any, **kwargs: Any) -> None:
        saved.append(fig)
        savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", save)
    return saved


def test_plot_draws_a_run_of_one_point_as_a_dot(tmp_path: Path, figures: list[matplotlib.figure.Figure]) -> None:
    one, many = _run(tmp_path / "one", [3.0]), _run(tmp_path / "many", [1.0, 2.0])
    out = tmp_path / "plot.png"
    assert main(["plot", str(one), str(many), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    by_steps, by_time = figures.pop().axes
    for ax in (by_steps, by_time):
        # (a Line2D's data is a sequence: matplotlib types get_xdata as any ArrayLike, scalars too)
        markers = [(len(line.get_xdata()), line.get_marker()) for line in ax.get_lines()]  # type: ignore[arg-type]
        assert markers == [(1, "o"), (2, "None")], markers


def test_plot_leaves_out_a_folder_without_metrics_while_another_run_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="learner.plot")
    a, b = _run(tmp_path / "a", [1.0, 2.0]), _run(tmp_path / "b", [2.0, 3.0])
    z = tmp_path / "z"
    z.mkdir()
    out = tmp_path / "plot.png"
    assert main(["plot", str(a), str(b), str(z), "-o", str(out)]) == 0
    assert out.is_file()
    # (learner.plot's: main() notes GRPC_EXPERIMENTS where an earlier test in this process imported grpc)
    assert [r.getMessage() for r in caplog.records if r.name == "learner.plot"] == [
        f"{z}: expected a run dir with metrics.jsonl, found none; left out of the plot"
    ]
    # Nothing else to plot: an error naming each, and no file.
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / rundir.METRICS).write_text("")
    capsys.readouterr()
    assert main(["plot", str(z), str(empty), "-o", str(tmp_path / "none.png")]) == 1
    assert (
        f"learner plot: error: nothing to plot: no metrics.jsonl in {z}; no mean return in {empty} (a run's "
        "metrics.jsonl has one per update once an episode has ended)"
    ) in capsys.readouterr().err
    assert not (tmp_path / "none.png").exists()


def test_plot_to_a_path_it_cannot_write_names_the_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path / "a", [1.0, 2.0])
    capsys.readouterr()
    assert main(["plot", str(run), "-o", "/proc/x.png"]) == 1
    err = capsys.readouterr().err
    assert err.rstrip().endswith(
        "learner plot: error: -o/--output: expected a path where the plot can be written, got /proc/x.png "
        "(No such file or directory)"
    ), err


def test_plot_that_fails_mid_write_leaves_the_previous_png(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _run(tmp_path / "a", [1.0, 2.0])
    out = tmp_path / "plot.png"
    assert main(["plot", str(run), "-o", str(out)]) == 0
    before = out.read_bytes()

    def full_disk(fig: matplotlib.figure.Figure, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"\x89PNG")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full_disk)
    capsys.readouterr()
    assert main(["plot", str(run), "-o", str(out)]) == 1
    assert f"-o/--output: expected a path where the plot can be written, got {out} (No space left on device)" in (
        capsys.readouterr().err
    )
    assert out.read_bytes() == before
    # Without -o (beside the run): no option to blame, the way out said.
    assert main(["plot", str(run)]) == 1
    assert (
        capsys.readouterr()
        .err.rstrip()
        .endswith(
            f"learner plot: error: cannot write the plot {run / 'returns.png'} (No space left on device); give "
            "-o/--output a path where it can be"
        )
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "plot.png"]  # (no temporary file left)
