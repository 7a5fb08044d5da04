"""The env server's process lifecycle, on real ``env-server`` subprocesses: another server at its Unix
socket's path while it builds (or drains), signals as it exits, socket files after an exit at once, its
parent gone during an async build, a thread an env leaves running, an env whose constructor raises
SystemExit, SIGHUP, and SIGTERM during a build."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest

from env_server import codec
from env_server.config import ServerConfig
from env_server.envs import EnvBuildError, build_vector_env
from env_server.protocol import DOUBLE_TAP_S, SHUTTING_DOWN_MESSAGE, STEP_SOCKET_SUFFIX
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from env_server.server import HARD_EXIT_STATUS, HUNG_EXIT_STATUS, START_FAILED_STATUS
from env_server.step_socket import StepSocketServer, file_identity
from learner import RemoteVectorEnv
from tests.conftest import needs_proc
from tests.servers import ServerSubprocess
from tests.test_readme_claims_server import SHORT_EXIT_MARGIN_S, env_server_argv
from tests.test_server_watchdog import _hang_a_step_on_the_loop

ENV = "tests.lifecycle_envs:Lifecycle"


# -- helpers ---------------------------------------------------------------------------------------------------


@pytest.fixture
def folder() -> Iterator[Path]:
    """A folder for a test's sockets and logs, of a short path (Unix socket paths are limited)."""
    with tempfile.TemporaryDirectory(prefix="ef-") as path:
        yield Path(path)


class _Server(ServerSubprocess):
    """An env-server subprocess (logging at info to ``folder``/``name``.log) a test controls; killed at the end
    of the test."""

    def __init__(
        self, folder: Path, *args: str, name: str = "server", exit_margin_s: float | None = None, **popen: Any
    ) -> None:
        argv = [*env_server_argv(*args, exit_margin_s=exit_margin_s), "--log-level", "info"]
        super().__init__(argv, folder / f"{name}.log", **popen)


@pytest.fixture
def server(folder: Path) -> Iterator[Callable[..., _Server]]:
    """``server(*args, name="server", exit_margin_s=None, **popen)`` -> a started _Server, killed after the test."""
    started: list[_Server] = []

    def start(*args: str, **kwargs: Any) -> _Server:
        started.append(_Server(folder, *args, **kwargs))
        return started[-1]

    yield start
    for each in started:
        each.stop()


def _until(predicate: Callable[[], object], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {within:g} s"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (not gone, nor a zombie that nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _listens(path: str) -> bool:
    """Whether a server takes connections on the Unix socket at ``path``."""
    with socket.socket(socket.AF_UNIX) as probe:
        probe.settimeout(5.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
    return True


def _pids(path: Path) -> list[int]:
    """The process ids written to ``path``, one a line (none if there is no such file yet)."""
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def _hup_at_default() -> None:
    """(a Popen's preexec_fn) SIGHUP at its default in the server, should this process ignore it (a test
    run under nohup): a server takes over no SIGHUP it was started with ignored."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _kwargs(**kwargs: object) -> str:
    return json.dumps(kwargs)


# -- another server at the path while the envs are built -------------------------------------------------------


@pytest.mark.slow
def test_a_server_done_building_its_async_envs_leaves_a_server_started_at_its_path_meanwhile_alone(
    folder: Path, server: Callable[..., _Server]
) -> None:
    """Under async vectorization nothing listens while the envs are built, so the path looked free when
    the server started: it is looked at again once they are built, and the server exits as a server
    started at a path another listens on does (gRPC would have replaced the other's socket)."""
    path, building, release = folder / "env.sock", folder / "building", folder / "release"
    first = server(
        "--env", ENV, "--env-kwargs", _kwargs(building=str(building), wait_for=str(release), where="server"),
        "--vectorization", "async", "--unix-socket", str(path), name="first",
    )  # fmt: skip
    _until(building.exists, 60, "the first server's build began")
    second = server("--env", ENV, "--unix-socket", str(path), name="second")
    assert second.ready() == f"unix:{path}"
    made = file_identity(str(path)), file_identity(f"{path}{STEP_SOCKET_SUFFIX}")
    release.touch()
    assert first.wait() == START_FAILED_STATUS, first.text()
    assert first.proc.stdout is not None and first.proc.stdout.read() == ""  # (never said it was ready)
    assert first.text().strip().splitlines()[-1] == (
        f"env-server: error: --unix-socket {path}: another server is listening there; stop it or pick another path"
    )
    assert (file_identity(str(path)), file_identity(f"{path}{STEP_SOCKET_SUFFIX}")) == made
    with grpc.insecure_channel(f"unix:{path}") as channel:  # (the second server still answers there)
        spec = pb_grpc.EnvServiceStub(channel).GetSpec(pb.GetSpecRequest(), timeout=30).spec
    assert spec.env_id == ENV and second.proc.poll() is None


def test_a_step_socket_another_server_listens_on_is_not_replaced_a_stale_one_is(folder: Path) -> None:
    path = str(folder / "env.sock.steps")
    service: Any = SimpleNamespace(on_session_end=None, draining=False)
    with socket.socket(socket.AF_UNIX) as other:
        other.bind(path)
        other.listen()
        made = file_identity(path)
        with pytest.raises(OSError, match="another server is listening there"):
            asyncio.run(StepSocketServer(service, path).start(mode_of=path))
        assert file_identity(path) == made
    # the same socket file, nothing listening on it any more (its server was killed): replaced
    (folder / "env.sock").touch()

    async def start_and_close() -> None:
        step_server = StepSocketServer(service, path)
        await step_server.start(mode_of=str(folder / "env.sock"))
        assert file_identity(path) not in (None, made)
        step_server.close()

    asyncio.run(start_and_close())
    assert not os.path.exists(path)


@pytest.mark.slow
def test_a_server_started_at_the_path_of_one_that_drains_takes_its_step_socket_over_too(
    folder: Path, server: Callable[..., _Server]
) -> None:
    """A server that drains stops listening on its step socket as on its gRPC socket, so that a server
    started at its path meanwhile (a restart) finds both stale and replaces both; the first one's teardown
    then leaves them to it."""
    path, gate = folder / "env.sock", folder / "gate"
    steps = f"{path}{STEP_SOCKET_SUFFIX}"
    first = server(
        "--env", "tests.envs:GateEnv", "--env-kwargs", _kwargs(gate=str(gate)), "--unix-socket", str(path),
        "--grace", "60", name="first",
    )  # fmt: skip
    with grpc.insecure_channel(first.ready()) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        session = stub.Handshake(pb.HandshakeRequest(client_name="lifecycle"), timeout=30).session_id
        stub.Reset(pb.ResetRequest(session_id=session), timeout=30)
        request = pb.StepRequest(session_id=session)
        codec.encode_value(np.zeros(1, dtype=np.int64), request.actions, "actions")
        call = stub.Step.future(request, timeout=120)  # (held at the gate: the drain waits for it)
        _until(gate.exists, 60, "the step began")
        first.proc.send_signal(signal.SIGTERM)
        _until(lambda: not _listens(str(path)) and not _listens(steps), 30, "the first server stopped listening")
        second = server("--env", ENV, "--unix-socket", str(path), name="second")
        second.ready()
        with RemoteVectorEnv(f"unix:{path}", timeout=30) as envs:
            envs.reset(seed=0)
            envs.step(np.zeros(1, dtype=np.int64))
            assert envs._clients[0].step_socket == steps, second.text()
        gate.unlink()
        call.result(timeout=60)  # (answered: the drain let it finish)
    assert first.wait() == 0, first.text()
    assert path.is_socket() and Path(steps).is_socket()  # (the second server's: left to it)
    with RemoteVectorEnv(f"unix:{path}", timeout=30) as envs:
        envs.reset(seed=0)
        assert envs._clients[0].step_socket == steps


# -- signals as the server exits ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["sigterm", "sigint", "sighup"])
def test_a_signal_again_as_the_server_exits_changes_nothing(
    folder: Path, server: Callable[..., _Server], signum: int
) -> None:
    """The signal again and again until the server has exited (a Ctrl-C: within its double tap's time,
    past which a second Ctrl-C exits at once, status 1): its status is still 0, not death by the
    signal (the handlers from before the server's, SIG_DFL, were put back on its way out)."""
    for attempt in range(2):
        proc = server(
            "--env", ENV, "--unix-socket", str(folder / "env.sock"),
            name=f"server-{attempt}", preexec_fn=_hup_at_default,
        )  # fmt: skip
        proc.ready()
        proc.proc.send_signal(signum)
        first = time.monotonic()
        while proc.proc.poll() is None and (signum != signal.SIGINT or time.monotonic() - first < DOUBLE_TAP_S * 0.8):
            proc.proc.send_signal(signum)
            time.sleep(0.002)
        assert proc.wait() == 0, proc.text()[-3000:]


# -- an exit at once ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("how", ["hang-timeout", "second-ctrl-c"])
def test_a_server_that_exits_at_once_removes_its_socket_files(
    folder: Path, server: Callable[..., _Server], how: str
) -> None:
    path, steps = folder / "env.sock", Path(f"{folder / 'env.sock'}{STEP_SOCKET_SUFFIX}")
    limits = ["--hang-timeout", "1"] if how == "hang-timeout" else ["--grace", "60"]
    proc = server("--env", "tests.hang_envs:HangLater", "--unix-socket", str(path), *limits)
    address = proc.ready()
    assert path.is_socket() and steps.is_socket()
    channel, _ = _hang_a_step_on_the_loop(address)
    try:
        if how == "second-ctrl-c":
            time.sleep(0.5)  # (the step is on the loop, hanging)
            proc.proc.send_signal(signal.SIGINT)
            time.sleep(DOUBLE_TAP_S + 0.5)
            proc.proc.send_signal(signal.SIGINT)
        assert proc.wait() == (HUNG_EXIT_STATUS if how == "hang-timeout" else HARD_EXIT_STATUS), proc.text()
    finally:
        channel.close()
    assert not path.exists() and not steps.exists(), proc.text()


# -- the parent gone during an async build -------------------------------------------------------------------------

# A learner's part: starts a server with --parent-pid (in a process group of its own, as learners do),
# says its pid, and waits to be killed.
_PARENT = """
import os, subprocess, sys, time
with open(sys.argv[1], "w") as log:
    proc = subprocess.Popen(
        [sys.executable, "-m", "env_server", "--parent-pid", str(os.getpid()), *sys.argv[2:]],
        stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
    )
print(proc.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
@needs_proc
@pytest.mark.parametrize("where", ["server", "workers"])
def test_a_server_whose_parent_dies_while_its_async_envs_are_built_exits_with_its_workers(
    folder: Path, where: str
) -> None:
    """No watchdog thread runs yet (the workers are forked first): the parent is looked for all the same
    while the build hangs in its workers (the server waits on their pipes), and while the env the server
    builds first, in its own process, is made (by a thread of its own then, ended before the workers fork:
    its constructor's system calls are left uninterrupted)."""
    building, release, log = folder / "building", folder / "release", folder / "server.log"
    kwargs = _kwargs(building=str(building), wait_for=str(release), where=where)
    argv = ["--env", ENV, "--env-kwargs", kwargs, "--num-envs", "2", "--vectorization", "async"]
    argv += ["--unix-socket", str(folder / "env.sock"), "--log-level", "info"]
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(log), *argv], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        assert parent.stdout is not None
        pids.append(int(parent.stdout.readline()))
        # (each constructor says its process: the server's own, then, under "workers", its 2 workers')
        _until(lambda: len(_pids(building)) >= (3 if where == "workers" else 1), 60, "the envs' build began")
        pids += [pid for pid in _pids(building) if pid not in pids]
        parent.kill()
        parent.wait(timeout=30)
        _until(lambda: not any(map(_alive, pids)), 30, f"the server and its workers {pids} exited")
        assert "parent process" in log.read_text() and "is gone" in log.read_text(), log.read_text()
    finally:
        release.touch()
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        for pid in pids:
            if _alive(pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)


# -- a thread an env leaves running --------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_thread_an_env_leaves_running_holds_the_exit_up_but_does_not_make_it_a_failure(
    folder: Path, server: Callable[..., _Server]
) -> None:
    """The interpreter waits for every non-daemon thread before it exits: the watchdog ends the wait
    (after the grace period and the exit margin, here SHORT_EXIT_MARGIN_S), with the status of a clean
    shutdown, naming the thread, not as a teardown that did not end."""
    proc = server(
        "--env", ENV, "--env-kwargs", _kwargs(leave_thread=True), "--unix-socket", str(folder / "env.sock"),
        "--grace", "0.5", exit_margin_s=SHORT_EXIT_MARGIN_S,
    )  # fmt: skip
    proc.ready()
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.wait() == 0, proc.text()
    text = proc.text()
    assert "stopped after 0 steps" in text and "non-daemon thread(s) 'sim-io'" in text, text
    assert "the teardown did not end" not in text, text


# -- an env whose constructor raises SystemExit or KeyboardInterrupt ------------------------------------------------


@pytest.mark.parametrize(
    ("raised", "said"),
    [
        ("SystemExit", r"SystemExit: 7 \(at .*lifecycle_envs\.py:\d+ in __init__\)"),  # (where in the env's code)
        ("KeyboardInterrupt", "KeyboardInterrupt"),  # (a Ctrl-C's line is no error's)
    ],
)
def test_an_env_whose_constructor_exits_fails_the_start_in_one_line_and_cleans_up(
    folder: Path, raised: str, said: str
) -> None:
    path = folder / "env.sock"
    argv = ["--env", ENV, "--env-kwargs", _kwargs(raise_in_init=raised), "--unix-socket", str(path)]
    result = subprocess.run(env_server_argv(*argv), capture_output=True, text=True, timeout=60)
    assert result.returncode == START_FAILED_STATUS and result.stdout == "", result.stderr
    assert re.fullmatch(
        f"env-server: error: cannot make env {re.escape(repr(ENV))}: {said}", result.stderr.strip().splitlines()[-1]
    )
    assert "Traceback" not in result.stderr, result.stderr
    assert sorted(os.listdir(folder)) == []  # (its teardown ran: no socket file left behind)


def test_a_ctrl_c_while_a_learner_builds_its_envs_in_its_own_process_stays_a_ctrl_c() -> None:
    """(the server's own process takes Ctrl-C over: a KeyboardInterrupt there is the env's)"""
    config = ServerConfig(env=ENV, env_kwargs={"raise_in_init": "KeyboardInterrupt"})
    with pytest.raises(KeyboardInterrupt):
        build_vector_env(config, ctrl_c=True)
    try:
        build_vector_env(config)
    except EnvBuildError as err:
        assert str(err) == f"cannot make env {ENV!r}: KeyboardInterrupt"
    except BaseException as err:  # (not let through: a KeyboardInterrupt would end the test session)
        pytest.fail(f"raised {err!r}, not EnvBuildError")
    else:
        pytest.fail("built")


# -- SIGHUP --------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sighup_to_the_process_group_drains_and_exits_0_without_the_workers_tracebacks(
    folder: Path, server: Callable[..., _Server]
) -> None:
    """A closed terminal sends SIGHUP to its foreground process group: the server's async workers too,
    which leave it to the server (as SIGINT and SIGTERM), whose drain closes them."""
    path = folder / "env.sock"
    proc = server(
        "--env", ENV, "--num-envs", "2", "--vectorization", "async", "--unix-socket", str(path),
        start_new_session=True, preexec_fn=_hup_at_default,
    )  # fmt: skip
    proc.ready()
    os.killpg(proc.proc.pid, signal.SIGHUP)
    assert proc.wait() == 0, proc.text()
    text = proc.text()
    assert "shutting down" in text and "stopped after 0 steps" in text and "Traceback" not in text, text
    assert not path.exists() and not Path(f"{path}{STEP_SOCKET_SUFFIX}").exists()


@pytest.mark.slow
@needs_proc
def test_the_workers_of_a_killed_async_server_end_quietly(folder: Path, server: Callable[..., _Server]) -> None:
    """Their pipe to the server closed, async vectorization's workers end (their envs closed) without a
    traceback each (EOFError, then BrokenPipeError telling the server of it) on the server's stderr."""
    building = folder / "building"
    proc = server(
        "--env", ENV, "--env-kwargs", _kwargs(building=str(building)), "--num-envs", "2",
        "--vectorization", "async", "--unix-socket", str(folder / "env.sock"),
    )  # fmt: skip
    proc.ready()
    workers = [pid for pid in _pids(building) if pid != proc.proc.pid]
    assert len(workers) == 2, (workers, proc.proc.pid)
    proc.proc.kill()
    proc.proc.wait(timeout=30)
    _until(lambda: not any(map(_alive, workers)), 30, f"the workers {workers} exited")
    assert "Traceback" not in proc.text(), proc.text()


@pytest.mark.slow
def test_a_server_started_with_sighup_ignored_leaves_it_ignored(folder: Path, server: Callable[..., _Server]) -> None:
    """As under ``nohup``: the terminal may close, the server goes on."""
    proc = server(
        "--env", ENV, "--unix-socket", str(folder / "env.sock"),
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN),
    )  # fmt: skip
    proc.ready()
    proc.proc.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    assert proc.proc.poll() is None and "shutting down" not in proc.text(), proc.text()
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.wait() == 0, proc.text()


def _ignored_signals(pid: int) -> set[int]:
    """The signals process ``pid`` ignores (SIG_IGN), from its SigIgn mask."""
    with open(f"/proc/{pid}/status") as f:
        mask = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
    return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}


@pytest.mark.slow
@needs_proc
def test_async_workers_and_the_programs_their_envs_start_leave_the_stop_signals_to_the_server(
    folder: Path, server: Callable[..., _Server]
) -> None:
    """Async workers ignore SIGINT/SIGTERM/SIGHUP (the server's drain closes them), and so does a program an env
    starts (a simulator's own process), which inherits that: a stop of the whole group does not end it before
    the drain's steps (README: its terminate() does not end it; kill() does). (A handler that does nothing
    instead, tried, interrupted the env's blocking system calls in C and let a group stop end simulators.)"""
    building, simulators, path = folder / "building", folder / "simulators", folder / "env.sock"
    proc = server(
        "--env", ENV, "--env-kwargs", _kwargs(building=str(building), simulator=str(simulators)),
        "--num-envs", "2", "--vectorization", "async", "--unix-socket", str(path), preexec_fn=_hup_at_default,
    )  # fmt: skip
    proc.ready()
    programs = _pids(simulators)
    try:
        assert len(programs) == 2, (programs, proc.text())
        for pid in programs:
            ignored = _ignored_signals(pid)
            assert {signal.SIGTERM, signal.SIGINT, signal.SIGHUP} <= ignored, (pid, ignored)
        # The workers themselves take SIGTERM and SIGINT sent to them alone, and serve on.
        workers = [pid for pid in _pids(building) if pid != proc.proc.pid]
        assert len(workers) == 2, (workers, proc.proc.pid)
        for sig in (signal.SIGTERM, signal.SIGINT):
            os.kill(workers[0], sig)
        time.sleep(0.5)
        assert all(map(_alive, workers)), proc.text()
        with RemoteVectorEnv(f"unix:{path}", timeout=30) as envs:
            envs.reset(seed=0)
            envs.step(np.zeros(2, np.int64))
        assert proc.proc.poll() is None and "Traceback" not in proc.text(), proc.text()
    finally:
        for pid in programs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# -- SIGTERM during a build -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_while_the_envs_are_built_says_the_server_waits_for_the_build(
    folder: Path, server: Callable[..., _Server]
) -> None:
    building, release = folder / "building", folder / "release"
    proc = server(
        "--env", ENV, "--env-kwargs", _kwargs(building=str(building), wait_for=str(release)),
        "--unix-socket", str(folder / "env.sock"),
    )  # fmt: skip
    _until(building.exists, 60, "the envs' build began")
    proc.proc.send_signal(signal.SIGTERM)
    _until(lambda: "shutting down while its envs are being built" in proc.text(), 30, "the server said so")
    # (it says so to callers too)
    with grpc.insecure_channel(f"unix:{folder / 'env.sock'}") as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.EnvServiceStub(channel).GetSpec(pb.GetSpecRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
    assert refused.value.details() == SHUTTING_DOWN_MESSAGE
    release.touch()
    assert proc.wait() == 0, proc.text()
    assert "stopped while building its envs" in proc.text()
    assert proc.proc.stdout is not None and proc.proc.stdout.read() == ""


def test_envs_refused_at_the_start_are_let_go_of_before_serve_raises() -> None:
    """The teardown lets go of the envs before its gc.collect, however the start ended (a simulator whose bindings
    are still alive at the interpreter's exit reports them as leaked: ale-py's nanobind, ~20 lines on stderr). Envs
    whose answers would not fit were held by a frame of the start's steps in the error's traceback, past the
    teardown, until the process exited."""
    from env_server.server import serve
    from tests import lifecycle_envs

    config = ServerConfig(env="tests.lifecycle_envs:TooLargeToSend", num_envs=2, host="127.0.0.1", port=0)
    with pytest.raises(EnvBuildError, match=r"each env's observation takes 41,943,040 bytes"):
        asyncio.run(serve(config, print))
    assert not list(lifecycle_envs.LIVE)  # (no gc.collect here: the teardown's own let them go)
