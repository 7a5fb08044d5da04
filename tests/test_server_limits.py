"""env-server under a container's limits, without the container: no usable temporary directory (a
read-only root with no tmpfs on /tmp), and a pids limit that fails the fork of an async worker.

The faults are injected into real ``python -m env_server`` subprocesses by a ``sitecustomize`` module
on their PYTHONPATH, which Python imports at start."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from env_server import server
from env_server.config import ServerConfig
from env_server.envs import EnvBuildError, build_vector_env
from learner import RemoteVectorEnv
from tests.conftest import SpawnServer, needs_proc

# tempfile finds no usable directory, as in `docker run --read-only` with no tmpfs on /tmp: its own error,
# "No usable temporary directory found in [...]" (a file made in a named directory, /dev/shm's for
# multiprocessing's shared memory, still can be, as there).
NO_TEMP_DIR = """\
import tempfile
tempfile.tempdir = None
tempfile._candidate_tempdir_list = lambda: ["/nonexistent/envfleet-no-tmp"]
"""

# Each start of a process after the first FORK_FAULT_AFTER fails as fork does, with errno FORK_FAULT_ERRNO
# (EAGAIN at a pids limit); the pids of those started are written to FORK_FAULT_PIDS.
PIDS_LIMIT = """\
import errno, multiprocessing.process, os
_start = multiprocessing.process.BaseProcess.start
_started = []
def start(self):
    if len(_started) >= int(os.environ["FORK_FAULT_AFTER"]):
        number = int(os.environ["FORK_FAULT_ERRNO"])
        raise OSError(number, os.strerror(number))  # (BlockingIOError for EAGAIN, as fork's)
    _start(self)
    _started.append(self.pid)
    with open(os.environ["FORK_FAULT_PIDS"], "a") as f:
        f.write(f"{self.pid}\\n")
multiprocessing.process.BaseProcess.start = start
"""


def site(tmp_path: Path, code: str) -> dict[str, str]:
    """The environment variables that make a Python subprocess import ``code`` as its sitecustomize."""
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)}


def run_server(*args: str, environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "env_server", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **environ},
    )


@pytest.mark.parametrize("vectorization", ["sync", "async"])
def test_a_server_starts_and_answers_without_a_temporary_directory(
    spawn_server: SpawnServer, tmp_path: Path, vectorization: str
) -> None:
    """`docker run --read-only` with no tmpfs on /tmp: the server listens (holding gRPC's log lines while it
    binds needs no file in a directory) and answers."""
    environ = site(tmp_path, NO_TEMP_DIR)
    probe = "import tempfile; tempfile.TemporaryFile()"  # (the fault is tempfile's own error, as in the container)
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, env={**os.environ, **environ}
    )
    assert result.returncode == 1 and "No usable temporary directory found in" in result.stderr, result.stderr
    started = spawn_server("CartPole-v1", 2, "--vectorization", vectorization, environ=environ)
    with RemoteVectorEnv([started.address]) as envs:
        observations, _ = envs.reset(seed=0)
        assert observations.shape == (2, 4)
        envs.step(np.zeros(2, dtype=np.int64))
    assert "temporary directory" not in started.logs()


@needs_proc
def test_grpc_s_log_line_is_still_held_and_shown_without_a_temporary_directory(tmp_path: Path) -> None:
    """(As tests/test_server_cli_errors.py's test of it, with no temporary directory: the line is held in
    memory and shown above the error.)"""
    result = run_server(
        "--env", "CartPole-v1", "--unix-socket", "/proc/envfleet-test.sock", environ=site(tmp_path, NO_TEMP_DIR)
    )
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and lines[-1] == (
        "env-server: error: cannot listen on unix:/proc/envfleet-test.sock: "
        "Failed to bind to address unix:/proc/envfleet-test.sock (gRPC's log line above says why)"
    ), lines
    assert any("/proc/envfleet-test.sock" in line and "No such file or directory" in line for line in lines[:-1]), lines


def no_temporary_file(*args: Any, **kwargs: Any) -> Any:
    raise FileNotFoundError(errno.ENOENT, "No usable temporary directory found in ['/tmp', '/var/tmp', '/usr/tmp']")


def test_stderr_is_held_where_it_can_be_and_binding_never_fails_for_it(capfd: pytest.CaptureFixture[str]) -> None:
    for memfd, temporary_file, held in [
        (True, False, True),  # Linux in a read-only container: in memory
        (False, True, True),  # macOS: a temporary file
        (False, False, False),  # neither: gRPC's lines go to stderr as they come, and binding goes on
    ]:
        if memfd and not hasattr(os, "memfd_create"):
            continue  # (this system has none)
        with pytest.MonkeyPatch.context() as patch:
            if not memfd:
                patch.delattr(os, "memfd_create", raising=False)
            if not temporary_file:
                patch.setattr(tempfile, "TemporaryFile", no_temporary_file)
            for drop in (False, True):
                case = f"memfd {memfd}, temporary file {temporary_file}, drop {drop}"
                capfd.readouterr()
                with server._StderrHeld() as holding:
                    os.write(2, b"E gRPC's line\n")
                    assert capfd.readouterr().err == ("" if held else "E gRPC's line\n"), case
                    if drop:
                        holding.drop()
                assert capfd.readouterr().err == ("E gRPC's line\n" if held and not drop else ""), case
                os.write(2, b"after\n")
                assert capfd.readouterr().err == "after\n", case  # (stderr is itself again)


@needs_proc
@pytest.mark.parametrize("number", [errno.EAGAIN, errno.ENOMEM, errno.EMFILE])
def test_an_async_worker_that_cannot_be_started_is_named_with_the_limit_and_none_is_left(
    tmp_path: Path, number: int
) -> None:
    """`docker run --pids-limit 32 ... --vectorization async --num-envs 40`: fork fails with EAGAIN for one
    worker. The error says which and why (not "can only join a started process", from cleaning up the
    workers after it), and the workers started before it are ended, none left running. The limits are
    named for EAGAIN and ENOMEM (a fork's at a pids limit, and out of memory), not for other errors."""
    pids = tmp_path / "pids"
    environ = {
        **site(tmp_path, PIDS_LIMIT),
        "FORK_FAULT_AFTER": "3",
        "FORK_FAULT_ERRNO": str(number),
        "FORK_FAULT_PIDS": str(pids),
    }
    argv = ["--env", "CartPole-v1", "--num-envs", "6", "--vectorization", "async", "--host", "127.0.0.1", "--port", "0"]
    result = run_server(*argv, environ=environ)
    limits = (
        ": each env is a process; a pids limit (docker --pids-limit, ulimit -u) or memory may be too low "
        "(or use fewer --num-envs, or --vectorization sync)"
    )
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        "env-server: error: cannot make env 'CartPole-v1': cannot start worker process 4 of 6 for "
        f"--vectorization async ({os.strerror(number)})" + (limits if number != errno.EMFILE else "")
    ), result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    started = [int(pid) for pid in pids.read_text().split()]
    assert len(started) == 3
    assert [pid for pid in started if running(pid)] == []


def running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):  # (FileNotFoundError: gone between the two)
        return False


class CannotStartItsSimulator(gym.Env[np.ndarray, np.int64]):
    """An env whose constructor starts a process of its own, which fails at a pids limit."""

    def __init__(self) -> None:
        raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))


class LicenseLocked(gym.Env[np.ndarray, np.int64]):
    """An env that says what went wrong itself, in an error of its own raised while handling an EAGAIN."""

    def __init__(self) -> None:
        try:
            raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        except OSError:
            raise gym.error.Error("the simulator's license file is locked") from None


def test_an_env_s_own_error_is_not_blamed_on_limits_it_did_not_name() -> None:
    with pytest.raises(EnvBuildError) as raised:
        build_vector_env(ServerConfig(env="tests.test_server_limits:LicenseLocked"))
    assert (
        str(raised.value)
        == "cannot make env 'tests.test_server_limits:LicenseLocked': the simulator's license file is locked"
    )


def test_an_env_that_cannot_start_a_process_of_its_own_is_told_of_the_limits() -> None:
    config = ServerConfig(env="tests.test_server_limits:CannotStartItsSimulator")
    with pytest.raises(EnvBuildError) as raised:
        build_vector_env(config)
    assert str(raised.value) == (
        "cannot make env 'tests.test_server_limits:CannotStartItsSimulator': BlockingIOError: "
        f"[Errno {errno.EAGAIN}] {os.strerror(errno.EAGAIN)}; if that was starting a process: a pids limit "
        "(docker --pids-limit, ulimit -u) or memory may be too low"
    )
