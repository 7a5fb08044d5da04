"""The commands' edges of process and file system: a closed stdout or stderr, an output encoding short of a
path's letters, a name in a path over 255 bytes, a removed working directory, a non-ASCII entry point."""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from env_server.__main__ import build_parser as server_parser
from env_server.envs import is_entry_point
from learner import rundir
from learner.cli import build_parser, main
from learner.video import check_path
from tests.certs import make_server_certs
from tests.conftest import CLOCK_ARGS, IN_PROCESS_ARGS

ROOT = Path(__file__).resolve().parents[1]
CLOCK = CLOCK_ARGS
TINY = ["--device", "cpu", *IN_PROCESS_ARGS, "--total-timesteps", "32", "--no-plot"]
LONG_NAME = "m" * 256
TOO_LONG = "File name too long (a name in the path is 256 bytes, over 255)"
DEADLINE_S = 120.0


def _closed(fd: int, *command: str) -> subprocess.CompletedProcess[str]:
    """``command`` run with its file descriptor ``fd`` (1: stdout, 2: stderr) closed, as by ``>&-``; the other
    of the two captured."""
    return subprocess.run(
        ["bash", "-c", f'exec {fd}>&-; exec "$@"', "bash", *command],
        stdout=None if fd == 1 else subprocess.PIPE,
        stderr=None if fd == 2 else subprocess.PIPE,
        text=True,
        cwd=ROOT,
        timeout=300,
    )


def _learner(*args: str) -> list[str]:
    return [sys.executable, "-m", "learner", *args]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny run (in-process envs: a second)."""
    run = tmp_path_factory.mktemp("runs") / "clock"
    assert main(["train", *CLOCK, *TINY, "--run-dir", str(run)]) == 0
    return run


# A closed stdout or stderr (Python's sys.stdout/sys.stderr None): os.devnull's, nothing lost.


@pytest.mark.slow
@pytest.mark.needs_torch
@pytest.mark.parametrize("fd", [1, 2])
def test_train_with_stdout_or_stderr_closed_trains_and_checkpoints(tmp_path: Path, fd: int) -> None:
    run = tmp_path / "run"
    # (progress as by default: a bar where stderr is a terminal, which it asks)
    unshown = [arg for arg in CLOCK if arg != "--no-progress"]
    done = _closed(fd, *_learner("train", *unshown, *TINY, "--run-dir", str(run)))
    said = done.stderr if fd == 1 else done.stdout
    assert done.returncode == 0, said
    assert "Traceback" not in said
    assert rundir.list_checkpoints(run) and (run / rundir.SUMMARY).is_file()
    if fd == 2:  # (what it says on stdout is all there)
        assert f"run dir: {run}" in done.stdout


@pytest.mark.slow
@pytest.mark.needs_torch
@pytest.mark.parametrize("fd", [1, 2])
def test_eval_with_stdout_or_stderr_closed_evaluates(trained_run: Path, fd: int) -> None:
    done = _closed(fd, *_learner("eval", str(trained_run), "--episodes", "2", "--backend", "gym"))
    said = done.stderr if fd == 1 else done.stdout
    assert done.returncode == 0, said
    assert "Traceback" not in said
    if fd == 2:
        assert "2 episodes of the deterministic policy" in done.stdout


def _wait_for(stream: int, text: str, proc: subprocess.Popen[bytes]) -> str:
    """What the process wrote to ``stream`` (a pipe's descriptor) until ``text`` (the process's end, or
    DEADLINE_S: a failure)."""
    seen = b""
    deadline = time.monotonic() + DEADLINE_S
    with selectors.DefaultSelector() as selector:
        selector.register(stream, selectors.EVENT_READ)
        while text.encode() not in seen:
            left = deadline - time.monotonic()
            assert left > 0, f"no {text!r} in {DEADLINE_S:g} s: {seen.decode(errors='replace')}"
            if not selector.select(left):
                continue
            chunk = os.read(stream, 1 << 16)
            assert chunk, f"ended ({proc.wait()}) without {text!r}: {seen.decode(errors='replace')}"
            seen += chunk
    return seen.decode(errors="replace")


@contextlib.contextmanager
def _serving(
    command: Sequence[str], *, fd: int | None = None, cwd: Path = ROOT, environ: dict[str, str] | None = None
) -> Iterator[str]:
    """Start env-server (``command``), wait until it serves (its log's "serving" line, or with stderr closed
    its "listening on" line), give what it said, then stop it. The tests' env_server, wherever it runs (the
    checkout is on every test's PYTHONPATH: see conftest)."""
    proc = subprocess.Popen(
        list(command),
        stdout=subprocess.PIPE if fd == 2 else subprocess.DEVNULL,
        stderr=subprocess.DEVNULL if fd == 2 else subprocess.PIPE,
        cwd=cwd,
        env={**os.environ, **(environ or {})},
    )
    try:
        pipe = proc.stdout if fd == 2 else proc.stderr
        assert pipe is not None
        yield _wait_for(pipe.fileno(), "listening on" if fd == 2 else "serving 1 x", proc)
    finally:
        proc.terminate()
        proc.wait(timeout=DEADLINE_S)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def _server(*args: str) -> list[str]:
    return [sys.executable, "-m", "env_server", "--port", "0", "--host", "127.0.0.1", *args]


@pytest.mark.slow
@pytest.mark.parametrize("fd", [1, 2])
def test_env_server_with_stdout_or_stderr_closed_serves(fd: int) -> None:
    command = ["bash", "-c", f'exec {fd}>&-; exec "$@"', "bash", *_server("--env", "CartPole-v1")]
    with _serving(command, fd=fd) as said:
        assert "Traceback" not in said


# An output encoding short of a path's letters: those written as escapes, not an error at the end.


def _ascii_learner(*args: str) -> subprocess.CompletedProcess[str]:
    """``learner ARGS`` with an ASCII stdout (strict, as a C locale's or PYTHONIOENCODING=ascii's)."""
    environ = {**os.environ, "PYTHONIOENCODING": "ascii:strict"}
    return subprocess.run(
        _learner(*args), capture_output=True, text=True, encoding="ascii", env=environ, cwd=ROOT, timeout=300
    )


@pytest.mark.slow
@pytest.mark.needs_torch
def test_train_with_ascii_output_writes_escapes(tmp_path: Path) -> None:
    run = tmp_path / "asc é"
    trained = _ascii_learner("train", *CLOCK, *TINY, "--run-dir", str(run))
    assert trained.returncode == 0, trained.stderr
    assert f"run dir: {tmp_path}/asc \\xe9\n" in trained.stdout
    assert rundir.list_checkpoints(run) and (run / rundir.SUMMARY).is_file()


@pytest.mark.slow
@pytest.mark.needs_torch
def test_eval_with_ascii_output_writes_escapes(trained_run: Path, tmp_path: Path) -> None:
    run = shutil.copytree(trained_run, tmp_path / "asc é")
    evaluated = _ascii_learner("eval", str(run), "--episodes", "2", "--backend", "gym")
    assert evaluated.returncode == 0, evaluated.stderr
    assert f"2 episodes of the deterministic policy in {tmp_path}/asc \\xe9/" in evaluated.stdout


@pytest.mark.slow
@pytest.mark.needs_torch
def test_plot_with_ascii_output_writes_escapes(trained_run: Path, tmp_path: Path) -> None:
    run = shutil.copytree(trained_run, tmp_path / "asc é")
    plotted = _ascii_learner("plot", str(run), "-o", str(run / "plot é.png"))
    assert plotted.returncode == 0, plotted.stderr
    assert plotted.stdout == f"plot: {tmp_path}/asc \\xe9/plot \\xe9.png\n"
    assert (run / "plot é.png").is_file()


@pytest.mark.slow
def test_env_server_ascii_output_encoding_writes_escapes(tmp_path: Path) -> None:
    # An env that prints as it is built (a banner, with letters ASCII has not: stdout is stderr's then)
    (tmp_path / "banner_env.py").write_text(
        "from gymnasium.envs.classic_control import CartPoleEnv\n\n\nclass BannerEnv(CartPoleEnv):\n"
        "    def __init__(self) -> None:\n        print('Bienvenue à CartPole')\n        super().__init__()\n",
        encoding="utf-8",
    )
    command = _server("--env", "banner_env:BannerEnv")
    with _serving(command, cwd=tmp_path, environ={"PYTHONIOENCODING": "ascii:strict", "PYTHONUNBUFFERED": "1"}) as said:
        assert "Bienvenue \\xe0 CartPole" in said
        assert "Traceback" not in said and "UnicodeEncodeError" not in said


# A name in a path over 255 bytes: said of the option that gave it, as its other errors (status 2).


def test_check_name_lengths(tmp_path: Path) -> None:
    from learner.rundir import check_name_lengths

    check_name_lengths(tmp_path / ("m" * 255) / "x")  # (the most a name can have)
    check_name_lengths("")
    for path in (tmp_path / LONG_NAME, tmp_path / "not" / "made" / LONG_NAME / "x", Path(LONG_NAME), "é" * 128):
        with pytest.raises(ValueError, match=r"^File name too long \(a name in the path is 256 bytes, over 255\)$"):
            check_name_lengths(path)
    with pytest.raises(ValueError, match=r"^File name too long \(the path is [\d,]+ bytes\)$"):
        check_name_lengths(tmp_path.joinpath(*["m" * 200] * 30))
    long_gif = str(tmp_path / LONG_NAME / "a.gif")
    with pytest.raises(
        ValueError, match=f"^video: cannot write '{long_gif}': {TOO_LONG.replace('(', '.').replace(')', '.')}$"
    ):
        check_path(long_gif)


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["train", "--run-dir", "{long}"], "--run-dir"),
        (["train", "--resume", "{long}"], "--resume"),
        (["train", "--like", "{long}"], "--like"),
        (["eval", "{long}"], "PATH"),
        (["eval", "--checkpoint", "{long}"], "--checkpoint"),
        (["plot", "{long}"], "RUN_DIR"),
        (["plot", "{tmp}", "-o", "{long}/returns.png"], "-o/--output"),
        (["bench", "--out", "{long}"], "--out"),
    ],
)
def test_a_name_over_255_bytes_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], option: str
) -> None:
    long = str(tmp_path / LONG_NAME)
    with pytest.raises(SystemExit) as exit_info:
        main([arg.format(long=long, tmp=tmp_path) for arg in args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    path = long + ("/returns.png" if option == "-o/--output" else "")
    assert err.endswith(f": error: argument {option}: {path}: {TOO_LONG}\n"), err
    assert not list(tmp_path.iterdir())  # (nothing made)


def test_a_video_name_over_255_bytes_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gif = str(tmp_path / LONG_NAME / "a.gif")
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(tmp_path), "--video", gif])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.endswith(f": error: argument --video: cannot write '{gif}': {TOO_LONG}\n")


# A removed working directory: env-server serves all the same (nothing there to import from).


@pytest.mark.slow
def test_env_server_in_a_removed_working_directory_serves(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    command = ["bash", "-c", 'cd "$1" && rmdir "$1" && shift && exec "$@"', "bash", str(gone)]
    with _serving([*command, *_server("--env", "CartPole-v1")]) as said:
        assert "serving 1 x CartPole-v1" in said
        assert "Traceback" not in said and not gone.exists()


# Entry points named in any script: Python's identifiers.


def test_is_entry_point_takes_python_identifiers() -> None:
    for env in ("ünï:Ënv", "mymod:日本Env", "pkg.ünï:_Ë", "_m:_C", "a.b:C", "é:Ñ.x"):
        assert is_entry_point(env), env
    for env in (
        "CartPole-v1",
        "m:Env-v0",
        "1m:C",
        "m:1C",
        "²m:C",
        "m:²C",
        "m:\u0661C",  # (an Arabic-Indic digit one)
        ":C",
        "m:",
        "m:C:D",
        "m :C",
        "ALE/Pong-v5",
    ):
        assert not is_entry_point(env), env


@pytest.mark.slow
@pytest.mark.parametrize("env", ["ünï:Ënv", "mymod:日本Env"])
def test_env_server_serves_a_non_ascii_entry_point(tmp_path: Path, env: str) -> None:
    module, _, name = env.partition(":")
    (tmp_path / f"{module}.py").write_text(
        f"from gymnasium.envs.classic_control import CartPoleEnv\n\n\nclass {name}(CartPoleEnv):\n    pass\n",
        encoding="utf-8",
    )
    with _serving(_server("--env", env), cwd=tmp_path) as said:  # (the module found in the working directory)
        assert f"serving 1 x {env}" in said


@pytest.mark.slow
@pytest.mark.needs_torch
def test_a_run_dir_named_in_bytes_that_are_not_utf8_trains_with_tensorboard_off_and_says_so_with_it_on(
    tmp_path: Path,
) -> None:
    """A --run-dir named b"caf\\xe9" (Latin-1), as Python names it ('caf\\udce9'): TensorBoard's UTF-8 encoding of
    it ended the run with "error: 'utf-8' codec can't encode character", naming neither the option nor a way
    out; with --no-tensorboard, the plot at the end raised matplotlib's TypeError on the legend."""
    run = tmp_path / os.fsdecode(b"caf\xe9")
    with_tensorboard = [arg for arg in CLOCK if arg != "--no-tensorboard"]
    failed = subprocess.run(
        _learner("train", *with_tensorboard, *TINY, "--run-dir", str(run)), capture_output=True, text=True, cwd=ROOT
    )
    error = failed.stderr.strip().splitlines()[-1]
    assert failed.returncode == 1 and "caf\\udce9" in error, failed.stderr
    assert "pass --no-tensorboard, or give a --run-dir of UTF-8" in error, error
    plotted = [arg for arg in TINY if arg != "--no-plot"]
    run = tmp_path / os.fsdecode(b"r\xe9")
    trained = subprocess.run(
        _learner("train", *CLOCK, *plotted, "--run-dir", str(run)), capture_output=True, text=True, cwd=ROOT
    )
    assert trained.returncode == 0 and (run / rundir.PLOT).is_file(), trained.stderr


def test_a_closed_stdout_is_devnull_for_the_children_a_command_starts_too() -> None:
    """An env's simulator binary, started by the server: its fd 1 was left closed (devnull, made on the closed
    descriptor, was not inheritable), so its first open() took it, and its writes there failed."""
    script = (
        "import os, subprocess, sys\n"
        "from env_server.__main__ import usable_stdio\n"
        "usable_stdio()\n"
        "child = subprocess.run(['bash', '-c', 'echo hi'], stderr=subprocess.PIPE, text=True)\n"
        "print(os.get_inheritable(1), child.returncode, repr(child.stderr), file=sys.stderr)\n"
    )
    done = _closed(1, sys.executable, "-c", script)
    assert done.returncode == 0 and done.stderr.strip().splitlines()[-1] == "True 0 ''", done.stderr


def test_a_path_option_s_leading_tilde_is_the_home_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No shell expands a ~ after "=": --run-dir=~/runs/a made a folder named "~" in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path))
    parser = build_parser()
    assert parser.parse_args(["train", "--run-dir=~/runs/a"]).run_dir == str(tmp_path / "runs" / "a")
    assert parser.parse_args(["train", "--resume=~/runs/a"]).resume == str(tmp_path / "runs" / "a")
    plotted = parser.parse_args(["plot", "~/runs/a", "--output=~/plot.png"])
    assert plotted.runs == [str(tmp_path / "runs" / "a")] and plotted.output == str(tmp_path / "plot.png")
    assert parser.parse_args(["eval", "~/runs/a", "--video=~/v.gif"]).video == str(tmp_path / "v.gif")
    files = ["--tls-ca=~/ca.pem", "--tls-client-cert=~/c.pem", "--tls-client-key=~/k.pem", "--auth-token-file=~/t"]
    for command in ("train", "servers"):
        given = parser.parse_args([command, *files])
        assert (given.tls_ca, given.tls_client_cert, given.tls_client_key, given.auth_token_file) == tuple(
            str(tmp_path / name) for name in ("ca.pem", "c.pem", "k.pem", "t")
        ), command


def test_env_server_s_path_options_take_a_leading_tilde(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As the learner's: --unix-socket=~/a.sock listened on ./~/a.sock (or found no folder ~ to make it in)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("ENVFLEET_TLS_CLIENT_CA", "~/ca.pem")  # (a variable's value too)
    given = server_parser().parse_args(
        ["--unix-socket=~/a.sock", "--tls-cert=~/c.pem", "--tls-key=~/k.pem", "--auth-token-file=~/t"]
    )
    assert (given.unix_socket, given.tls_cert, given.tls_key, given.tls_client_ca, given.auth_token_file) == tuple(
        str(tmp_path / name) for name in ("a.sock", "c.pem", "k.pem", "ca.pem", "t")
    )


def test_path_variables_take_a_leading_tilde_as_the_options_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """env-server reads ENVFLEET_UNIX_SOCKET=~/a.sock as its option's type does; its health probe looked for
    ./~/a.sock, and the learner read its own ENVFLEET_* files (the CA, the token) without the ~ expanded."""
    from env_server.health import default_addresses
    from learner import cli

    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_addresses({"ENVFLEET_UNIX_SOCKET": "~/a.sock"}) == [f"unix:{tmp_path / 'a.sock'}"]
    make_server_certs(tmp_path / "certs").ca.rename(tmp_path / "ca.pem")  # (a CA that can be read as one)
    monkeypatch.setenv("ENVFLEET_TLS_CA", "~/ca.pem")
    assert cli._tls_variables("127.0.0.1:1", False, None, None)[0] == str(tmp_path / "ca.pem")
    (tmp_path / "token").write_text("secret\n")
    monkeypatch.setenv("ENVFLEET_AUTH_TOKEN_FILE", "~/token")
    assert cli._auth_token(None, None) == "secret"
