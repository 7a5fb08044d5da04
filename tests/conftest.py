"""Shared fixtures: real env servers, started as subprocesses on port 0."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import IO, Any

import pytest
from hypothesis import settings

from learner import LocalServers
from learner.discovery import register_resolver

ROOT = Path(__file__).resolve().parent.parent

# Hypothesis keeps a cache of its own in the working directory (.hypothesis/, whatever the database), read
# from this variable when it first writes there: not in the checkout.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "envfleet-hypothesis"))
# Property tests: no example database (it was written into the checkout), and under CI the same
# examples every run, so a red CI is about the change under test, not a newly drawn example.
settings.register_profile("dev", database=None)
settings.register_profile("ci", database=None, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def _undo_ignored_stop_signals() -> None:
    """A suite started with SIGHUP or SIGINT ignored (``nohup make test &``, a CI runner that ignores
    them, a non-interactive shell's background job) would hand that on to every process the tests start,
    and the tests that send those signals would see them ignored (as the product rightly does under
    nohup): ignored ones are put back to Python's defaults here, in each pytest process (xdist's workers
    too); a handler of another kind is left alone."""
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_undo_ignored_stop_signals()

# The env servers and scripts the tests start import the tests' envs (--env tests.envs:ClockEnv) whatever the
# working directory the suite runs from (`cd tests && pytest test_local.py`): the checkout is on their
# PYTHONPATH. And a shell's ENVFLEET_* variables (a token, TLS files, a W&B setting: see learner.local) are
# for its own servers and runs, not the ones the tests start.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
for _name in [name for name in os.environ if name.startswith("ENVFLEET_")]:
    del os.environ[_name]


@pytest.fixture(autouse=True)
def _environ_as_it_was() -> Iterator[None]:
    """Each test leaves os.environ as it found it: a command run in-process sets variables for the process
    (learner eval --video: MUJOCO_GL, SDL_VIDEODRIVER), which every later test's servers would inherit."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


# For tests that read /proc (Linux's; macOS and the BSDs have none): skipped where there is none.
needs_proc = pytest.mark.skipif(not Path("/proc/self").exists(), reason="reads /proc, which this system has not")


# train()'s keyword arguments for a test's run: no progress bar, plot or TensorBoard files (read-only: shared).
QUIET: Mapping[str, Any] = MappingProxyType({"progress": False, "plot": False, "tensorboard": False})
# The same for `learner train` on the command line.
QUIET_FLAGS = ("--no-progress", "--no-tensorboard", "--no-plot")
# RemoteVectorEnv's keyword arguments for tests of faults: a short call timeout and back-off (read-only: shared).
FAST: Mapping[str, Any] = MappingProxyType({"timeout": 2.0, "backoff": (0.05, 0.5)})


def parent_of(pid: int) -> int | None:
    """``pid``'s parent process (from /proc; None once it has gone). Tests that find processes by their
    command line check it: a process that forks (a server starting its env's simulator, or git) has a
    child holding the same command line until that child's exec."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


# torch (and so SB3) is the learner's extra: an env-server-only install has neither. A test that
# trains, or imports what needs torch, is marked needs_torch (or needs_sb3), and skipped there; a
# module that imports it at module level starts with pytest.importorskip("torch").


def promtool_check(registry: Any) -> None:
    """Prometheus' linter (``promtool check metrics``: naming, units, _total suffixes, help texts) on what
    ``registry`` exposes: nothing to fix. Skipped where promtool is not installed (Debian: apt install
    prometheus)."""
    from prometheus_client import generate_latest

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs promtool (Prometheus' linter; Debian: apt install prometheus)")
    linted = subprocess.run([promtool, "check", "metrics"], input=generate_latest(registry), capture_output=True)
    assert linted.returncode == 0, (linted.stdout.decode(), linted.stderr.decode())


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # (a finder that refuses it: tests/test_portability.py's, standing for an install without)
        return False


HAS_TORCH = _installed("torch")
HAS_SB3 = _installed("stable_baselines3")
NEEDS = {
    "needs_torch": (HAS_TORCH, "needs torch (pip install 'envfleet[learner]')"),
    "needs_sb3": (HAS_SB3, "needs stable-baselines3 (pip install 'envfleet[sb3]')"),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    cuda: bool | None = None  # (asked of torch once, at the first test that runs on_cuda)
    for item in items:
        for marker, (installed, reason) in NEEDS.items():
            if not installed and item.get_closest_marker(marker) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))
        if item.get_closest_marker("needs_cuda") is not None:
            if cuda is None:
                cuda = HAS_TORCH and _cuda()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


# For tests that need a CUDA GPU: skipped where there is none. Asked at collection, of the tests marked so only,
# not here: importing torch takes ~5 s, which every pytest process would pay at its start (xdist's controller,
# which runs no test, and a run of files that need no torch included).
on_cuda = pytest.mark.needs_cuda

# A learner command stopped by Ctrl-C ends by the SIGINT once its files are written (learner.cli.run), as
# Python does with a KeyboardInterrupt nothing caught: a shell's loop over runs then stops too.
CTRL_C_EXIT = -signal.SIGINT

# learner train's options for a tiny, quiet run of ClockEnv (no bar, no TensorBoard), and for one on 2
# in-process envs, 8 steps a rollout (an update every 16 env steps): what the CLI's tests train with.
CLOCK_ARGS = ["--env", "tests.envs:ClockEnv", "--env-kwargs", '{"length": 3}', "--no-progress", "--no-tensorboard"]
IN_PROCESS_ARGS = ["--backend", "gym", "--num-envs", "2", "--num-steps", "8"]

StartServers = Callable[..., list[str]]
Serve = Callable[..., tuple[subprocess.Popen[str], str]]


@pytest.fixture
def start_servers() -> Iterator[StartServers]:
    """``start_servers(env, num_servers, envs_per_server, **kwargs)`` -> addresses; stopped after the test."""
    started: list[LocalServers] = []

    def start(env: str, num_servers: int = 1, envs_per_server: int = 1, **kwargs: Any) -> list[str]:
        servers = LocalServers(env, num_servers, envs_per_server, **kwargs)
        started.append(servers)
        return servers.addresses

    yield start
    for servers in started:
        servers.close()


class ServerProcess:
    """One ``env-server`` subprocess a test controls: kill it (SIGKILL or SIGTERM), start it again on the same address."""

    def __init__(self, env: str, num_envs: int, *args: str, environ: dict[str, str] | None = None) -> None:
        self.argv = ["--env", env, "--num-envs", str(num_envs), *args]
        self.environ = environ
        self.address = ""
        self.proc: subprocess.Popen[str] | None = None
        self.start("0")

    def start(self, port: str | None = None) -> float:
        """Start (again, on the same port unless ``port``); returns the time.monotonic() it said it was listening."""
        port = port if port is not None else self.address.rpartition(":")[2]
        env = {**os.environ, **self.environ} if self.environ else None
        # The server's log lines, in a file: a pipe nobody reads could fill up and block the server.
        if self.proc is not None:
            self._close_files()  # (the last process's: a restart's new process has its own)
        self.log: IO[str] = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "env_server", *self.argv, "--host", "127.0.0.1", "--port", port],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if not line.startswith("listening on "):
            self.proc.kill()
            self.proc.wait(timeout=30)
            self.proc.stdout.close()  # (its log stays open for logs(), until stop())
            raise RuntimeError(f"env-server did not start: {line!r} {self.logs()[-2000:]}")
        self.address = line.removeprefix("listening on ")
        return time.monotonic()

    def logs(self) -> str:
        """What the server (its latest start) logged so far."""
        self.log.seek(0)
        return self.log.read()

    def kill(self, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` and wait for the process to end; its exit code."""
        assert self.proc is not None
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)

    def _close_files(self) -> None:
        """Close what this object holds of its (latest) process: its pipes and its log file."""
        assert self.proc is not None
        for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()
        self.log.close()

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=30)
        finally:
            self._close_files()


SpawnServer = Callable[..., ServerProcess]


@pytest.fixture
def serve(spawn_server: SpawnServer) -> Serve:
    """``serve(env, num_envs)`` -> (process, address): one env server of its own (to stop or kill), killed after
    (:func:`spawn_server`'s, for tests that want its process alone)."""

    def start(env: str = "CartPole-v1", num_envs: int = 2) -> tuple[subprocess.Popen[str], str]:
        server = spawn_server(env, num_envs)
        assert server.proc is not None
        return server.proc, server.address

    return start


@pytest.fixture
def spawn_server() -> Iterator[SpawnServer]:
    """``spawn_server(env, num_envs, *env_server_args, environ=None)`` -> a ServerProcess, stopped after the test."""
    started: list[ServerProcess] = []

    def spawn(env: str, num_envs: int = 1, *args: str, environ: dict[str, str] | None = None) -> ServerProcess:
        server = ServerProcess(env, num_envs, *args, environ=environ)
        started.append(server)
        return server

    yield spawn
    with contextlib.ExitStack() as stack:  # (each stopped, its files closed, should another's stop fail)
        for server in started:
            stack.callback(server.stop)


def not_found_at_once(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """``name`` does not resolve, answered at once: the tests' timing must not hang on this machine's
    resolver (an unseen name took 0.5-2.9 s to come back "not found" here)."""
    real = socket.getaddrinfo

    def getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        if host == name:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


# A fleet whose server list a test changes (refresh() tests): ``fleet(*addresses)``.
_FLEETS: dict[str, list[str]] = {}
register_resolver("testfleet", lambda name: list(_FLEETS[name]))
_fleet_names = itertools.count()


@contextlib.contextmanager
def slow_to_build_server(build_s: float, num_envs: int) -> Iterator[str]:
    """An env server of ``tests.envs:SlowToBuildEnv`` on a free loopback port, its address: it listens
    within ~1 s, then builds its envs for ``build_s`` seconds, answering UNAVAILABLE ("starting")
    meanwhile. Killed on leaving."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    argv = [
        "--env",
        "tests.envs:SlowToBuildEnv",
        "--env-kwargs",
        f'{{"build_s": {build_s}}}',
        "--num-envs",
        str(num_envs),
    ]
    with subprocess.Popen(
        [sys.executable, "-m", "env_server", *argv, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    ) as proc:
        try:
            yield f"127.0.0.1:{port}"
        finally:
            proc.kill()


def fleet(*addresses: str) -> tuple[str, list[str]]:
    """A fleet address ``testfleet:N`` and the list it resolves to (change it to add or remove servers)."""
    name = f"f{next(_fleet_names)}"
    _FLEETS[name] = list(addresses)
    return f"testfleet:{name}", _FLEETS[name]


def started_logs(*args: str) -> str:
    """What an env-server of CartPole-v1 started with ``args`` logged by the time it was ready (then it is
    stopped)."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("listening on "), line
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            proc.stdout.close()  # type: ignore[union-attr]
        log.seek(0)
        return log.read()
