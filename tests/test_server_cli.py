"""The env-server command: ready line, fast clear failures, no torch."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from env_server.config import ServerConfig
from env_server.server import _check_bindable


def run_server(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "env_server", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--env", "NoSuchEnv-v0"], "NoSuchEnv-v0"),
        (
            ["--env", "CartPole-v1", "--env-kwargs", '{"gravity_typo": 1}'],
            "with kwargs {'gravity_typo': 1}: CartPoleEnv.__init__() got an unexpected keyword argument 'gravity_typo'",
        ),
        (
            ["--env", "CartPole-v1", "--wrappers", "atari"],
            "wrapper 'atari': expected an Atari env of ale-py (ALE/Pong-v5, ...), got CartPole-v1",
        ),
        (
            ["--env", "CartPole-v1", "--wrappers", "clip-action"],
            "wrapper 'clip-action': expected Box actions, got Discrete(2)",
        ),
        (
            ["--env", "CartPole-v1", "--env-kwargs", "{not json"],
            "--env-kwargs: expected a JSON object, got '{not json': not valid JSON (Expecting property name enclosed "
            "in double quotes at column 2)",
        ),
        (  # (json raises a plain ValueError there: argparse said "invalid _json_object value")
            ["--env", "CartPole-v1", "--env-kwargs", '{"a": ' + "1" * 5000 + "}"],
            "--env-kwargs: expected a JSON object Python can read, got one it cannot: Exceeds the limit (4300 digits)",
        ),
        (  # (a RecursionError: it was a traceback. Its words vary: "maximum recursion depth exceeded ...",
            # on Python 3.14 "Stack overflow (used ... kB) while decoding a JSON array ...")
            ["--env", "CartPole-v1", "--env-kwargs", "[" * 100_000],
            "--env-kwargs: expected a JSON object, got JSON nested too deeply to read (",
        ),
        (["--env", "no_such_module:Env"], "cannot import module 'no_such_module'"),
        (["--env", "CartPole-v1", "--wrappers", "nope"], "unknown wrapper 'nope'"),
        (["--env", "CartPole-v1", "--num-envs", "0"], "--num-envs: expected a positive integer"),
        (
            ["--env", "CartPole-v1", "--spin-wait-ms", "2s"],
            "--spin-wait-ms: expected milliseconds in [0, 10], got '2s'",
        ),
        ([], "--env is required"),
    ],
)
def test_bad_configuration_exits_quickly_with_one_line(args: list[str], fragment: str) -> None:
    start = time.monotonic()
    result = run_server(*args, "--port", "0")
    assert time.monotonic() - start < 15
    assert result.returncode != 0
    assert result.stdout == ""
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("env-server: error:") and fragment in last, result.stderr
    assert "was raised from the environment creator" not in last  # (gymnasium's suffix, repeating the kwargs)


@pytest.mark.parametrize(
    ("variable", "fragment"),
    [
        ("ENVFLEET_VECTORIZATION=asnyc", "ENVFLEET_VECTORIZATION (for --vectorization): invalid choice 'asnyc'"),
        ("ENVFLEET_AUTORESET_MODE=bogus", "ENVFLEET_AUTORESET_MODE (for --autoreset-mode): invalid choice 'bogus'"),
        ("ENVFLEET_LOG_LEVEL=verbose", "ENVFLEET_LOG_LEVEL (for --log-level): invalid choice 'verbose'"),
    ],
)
def test_a_bad_choice_from_an_envfleet_variable_is_refused_like_the_flag(variable: str, fragment: str) -> None:
    name, value = variable.split("=")
    result = subprocess.run(
        [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, name: value},
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines()[-1].startswith(f"env-server: error: {fragment} (choose from "), (
        result.stderr
    )


def test_a_port_in_use_is_one_line_that_says_so() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_server("--env", "CartPole-v1", "--host", "127.0.0.1", "--port", str(port))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines[-1] == (
        f"env-server: error: cannot listen on 127.0.0.1:{port}: Address already in use "
        "(another process has it; pick another --port, or 0 for a free one)"
    )
    assert not any("add_port" in line or "GRPC_VERBOSITY" in line for line in lines), lines


def test_a_unix_socket_path_that_cannot_be_one_is_one_line_that_says_why(tmp_path: Path) -> None:
    (tmp_path / "file").touch()
    for path, why in [
        (tmp_path / "file", "exists and is a regular file, not a socket; remove it or pick another path"),
        (tmp_path, "exists and is a folder, not a socket; remove it or pick another path"),
        (tmp_path / "no" / "env.sock", f"no folder {tmp_path / 'no'} to make it in"),
        (
            tmp_path / "a,b.sock",
            "a comma in the path, where gRPC clients split a unix: address (a list of addresses), so no learner "
            "could connect; pick a path without one",
        ),
    ]:
        result = run_server("--env", "CartPole-v1", "--unix-socket", str(path))
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and lines[-1] == f"env-server: error: --unix-socket {path}: {why}", lines
        assert not any("add_port" in line for line in lines), lines


def test_the_bind_check_leaves_hosts_without_ipv6_to_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    real_socket = socket.socket

    def no_ipv6(family: int = socket.AF_INET, *args: Any, **kwargs: Any) -> socket.socket:
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real_socket(family, *args, **kwargs)

    monkeypatch.setattr(socket, "socket", no_ipv6)
    _check_bindable(ServerConfig(env="CartPole-v1", host="::", port=50051))  # gRPC falls back to 0.0.0.0


def test_prints_listening_line_then_stops_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--num-envs", "2", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        host, _, port = line.removeprefix("listening on ").rpartition(":")
        assert line.startswith("listening on ") and host == "127.0.0.1" and int(port) > 0
        proc.terminate()
        assert proc.wait(timeout=15) == 0
        assert proc.stdout.read() == ""  # nothing else on stdout
    finally:
        proc.kill()


def test_env_server_does_not_import_torch() -> None:
    code = "import sys, env_server, env_server.server, env_server.__main__; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_help_explains_the_options() -> None:
    result = run_server("--help")
    assert result.returncode == 0
    for text in ("--env", "--num-envs", "--port", "--env-kwargs", "--vectorization", "listening on"):
        assert text in result.stdout
    assert "on|off" not in result.stdout  # (--step-socket on|off: a form no released version had)
