"""Local servers as subprocesses never outlive their learner."""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from env_server import health
from env_server.tuning import JsonLogFormatter
from learner import (
    AuthenticationError,
    LocalServers,
    RemoteVectorEnv,
    ServerStartError,
    ServerUnavailableError,
    local_servers,
)
from learner.config import Args
from learner.local import (
    DEFAULT_TRANSPORT,
    _Children,
    _forward_stderr,
    _forwarded_format,
    _server_environ,
    left_down,
)
from learner.outages import _left_down
from tests.conftest import SpawnServer, needs_proc, parent_of


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited, so count it as gone (where /proc tells).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # (no /proc: kill(0) is all there is to go by)


def wait_gone(pids: list[int], within: float) -> None:
    deadline = time.monotonic() + within
    while any(alive(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if alive(p)]}"
        time.sleep(0.1)


def test_local_servers_default_to_unix_sockets_and_their_step_sockets_as_learner_train_does() -> None:
    # Users' own scripts get the fast path too, not loopback TCP unless they ask for it.
    assert DEFAULT_TRANSPORT == "unix" and Args().transport == DEFAULT_TRANSPORT  # (Linux and macOS have them)
    with local_servers("CartPole-v1", 1, 2) as addresses, RemoteVectorEnv(addresses) as envs:
        assert addresses[0].startswith("unix:"), addresses
        envs.reset(seed=0)
        envs.step(envs.action_space.sample())
        assert envs._clients[0].step_socket  # (stepped on its step socket, not on gRPC)
    with local_servers("CartPole-v1", 1, 1, transport="tcp") as addresses:
        assert addresses[0].startswith("127.0.0.1:"), addresses


def test_a_temp_folder_too_long_a_path_for_unix_sockets_has_the_sockets_made_in_tmp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """$TMPDIR on an HPC scratch folder can be longer than a Unix socket path may be (107 bytes): the
    servers could not listen at all. Their sockets go in /tmp then, step sockets included."""
    long_dir = tmp_path / ("d" * 90)
    long_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_dir))
    caplog.set_level(logging.INFO, logger="learner.local")
    with local_servers("CartPole-v1", 2, 1) as addresses, RemoteVectorEnv(addresses) as envs:
        assert all(a.startswith(f"unix:/tmp/envfleet-{os.getpid()}-") for a in addresses), addresses
        envs.reset(seed=0)
        envs.step(envs.action_space.sample())
        assert all(client.step_socket for client in envs._clients)
    assert f"the temp folder {long_dir} is too long a path for Unix sockets" in caplog.text
    assert not any(Path(a.removeprefix("unix:")).parent.exists() for a in addresses)  # (removed at close)


def test_a_temp_folder_with_a_comma_has_the_sockets_made_in_tmp(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """gRPC splits a unix: address at commas: learners waited for servers listening there, then said they used
    TLS, say."""
    folder = tempfile.mkdtemp(prefix="t,", dir="/tmp")  # (short: tmp_path is too long a path already)
    monkeypatch.setattr(tempfile, "tempdir", folder)
    caplog.set_level(logging.INFO, logger="learner.local")
    try:
        with local_servers("CartPole-v1", 1, 1) as addresses, RemoteVectorEnv(addresses, connect_timeout=30) as envs:
            assert addresses[0].startswith(f"unix:/tmp/envfleet-{os.getpid()}-"), addresses
            envs.reset(seed=0)
    finally:
        shutil.rmtree(folder)
    assert f"the temp folder {folder} has a comma, where gRPC splits a unix: address" in caplog.text


def test_a_socket_path_with_what_grpc_reads_in_a_uri_names_the_file_it_says(
    tmp_path: Path, spawn_server: SpawnServer
) -> None:
    """gRPC reads a unix: address as a URI: a server told --unix-socket .../q%41.sock listened on .../qA.sock
    (another server's socket there taken over, its learners stepping the wrong envs), and "#", "?" cut the path."""
    plain = spawn_server("CartPole-v1", 1, "--unix-socket", str(tmp_path / "qA.sock"))
    odd_path = tmp_path / "q%41 #b?c.sock"
    odd = spawn_server("Acrobot-v1", 1, "--unix-socket", str(odd_path))
    assert odd.address == f"unix:{odd_path}" and odd_path.is_socket()
    assert health.check(odd.address, timeout=30) == "SERVING"  # (the container's probe)
    for address, env_id in ((plain.address, "CartPole-v1"), (odd.address, "Acrobot-v1")):
        with RemoteVectorEnv([address], connect_timeout=30) as envs:  # (a string is split at whitespace)
            spec = envs._clients[0].spec
            assert spec is not None and spec.env_id == env_id
            envs.reset(seed=0)
            envs.step(envs.action_space.sample())


def test_a_script_in_a_removed_working_directory_starts_its_local_servers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`python train.py`, its folder removed since: the servers' environment raised FileNotFoundError (the
    script's folder from os.path.abspath), so no server could be started, nor started again."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.setattr(sys, "path", ["", *sys.path])
    gone.rmdir()
    environ = _server_environ(None)
    assert environ.get("PYTHONPATH") == os.environ.get("PYTHONPATH")
    scripts = tmp_path / "scripts"  # (python /abs/scripts/train.py: its folder is known all the same)
    monkeypatch.setattr(sys, "argv", [str(scripts / "train.py")])
    monkeypatch.setattr(sys, "path", [str(scripts), *sys.path[1:]])
    assert _server_environ(None)["PYTHONPATH"].split(os.pathsep)[0] == str(scripts)


def test_an_env_used_after_its_local_servers_stopped_says_so_at_once() -> None:
    """Their socket folder is gone: no server can come back there, so connect_timeout is not waited out."""
    with local_servers("CartPole-v1", 1, 1) as addresses:
        envs = RemoteVectorEnv(addresses, connect_timeout=30)
        envs.reset(seed=0)
    start = time.monotonic()
    with pytest.raises(ServerUnavailableError, match=r"the folder of its socket, .* does not exist"):
        envs.reset(seed=0)
    assert time.monotonic() - start < 5
    envs.close()


def test_an_env_on_a_local_servers_dropped_at_once_says_so_at_once() -> None:
    """``RemoteVectorEnv(LocalServers(...).addresses)`` in a notebook cell: the LocalServers is garbage-
    collected at once, its servers stopped and their folder removed; the connect says why then, not after
    connect_timeout, as the handshake does."""
    addresses = LocalServers("CartPole-v1", 1, 2).addresses  # (as inline: nothing holds the LocalServers)
    start = time.monotonic()
    with pytest.raises(ServerUnavailableError) as info:
        RemoteVectorEnv(addresses, connect_timeout=30)
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert re.search(
        r"^env server unix:.*: nothing can answer there: the folder of its socket, .* does not exist", message
    )
    assert "LocalServers closed or garbage-collected: keep it in a variable" in message, message
    # Fault-tolerant the same, when no server is left to go on with.
    with pytest.raises(ServerUnavailableError, match="garbage-collected"):
        RemoteVectorEnv(LocalServers("CartPole-v1", 1, 1).addresses, connect_timeout=30, fault_tolerant=True)


@needs_proc
def test_context_manager_stops_every_server() -> None:
    with local_servers("CartPole-v1", 2, 2) as addresses:
        assert all(a.startswith("unix:") for a in addresses)
        with RemoteVectorEnv(addresses) as envs:
            envs.reset(seed=0)
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_server(int(p), addresses, os.getpid())]
        assert len(pids) == 2
    wait_gone(pids, within=5)


def _is_server(pid: int, addresses: list[str], parent: int) -> bool:
    """Whether ``pid`` is an env server ``parent`` started, listening at one of ``addresses``."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().decode(errors="replace")  # (another process's may hold bytes that are not UTF-8)
    except OSError:
        return False
    return parent_of(pid) == parent and "env_server" in cmd and any(a.removeprefix("unix:") in cmd for a in addresses)


def test_close_stops_every_server() -> None:
    servers = LocalServers("CartPole-v1", 3, 1)
    pids = servers.pids
    assert all(alive(p) for p in pids)
    servers.close()
    wait_gone(pids, within=5)


def test_servers_exit_when_the_learner_is_killed() -> None:
    script = textwrap.dedent(
        """
        import time
        from learner import LocalServers
        servers = LocalServers("CartPole-v1", 2, 1)
        print(*servers.pids, flush=True)
        time.sleep(600)
        """
    )
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            pids = [int(p) for p in proc.stdout.readline().split()]
            assert len(pids) == 2 and all(alive(p) for p in pids)
            proc.kill()
            proc.wait()
            wait_gone(pids, within=5)
        finally:
            proc.kill()


def test_failed_start_names_the_cause() -> None:
    try:
        LocalServers("NoSuchEnv-v0", 2, 1)
    except Exception as err:
        assert "NoSuchEnv-v0" in str(err) and "exited with code" in str(err)
    else:
        raise AssertionError("expected ServerStartError")


MY_ENVS = "import gymnasium as gym\n\n\ndef Env():\n    return gym.make('CartPole-v1')\n"


def test_a_script_s_own_env_module_is_found_by_the_servers_it_starts(tmp_path: Path) -> None:
    """`python project/train.py` run from elsewhere: the servers import project/myenvs.py as the script does."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "myenvs.py").write_text(MY_ENVS)
    (project / "train.py").write_text(
        textwrap.dedent(
            """
            import myenvs  # the script's own folder is on its path
            from learner import LocalServers, RemoteVectorEnv
            with LocalServers("myenvs:Env", 1, 2) as servers, RemoteVectorEnv(servers.addresses) as envs:
                print(envs.reset(seed=0)[0].shape)
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(project / "train.py")], cwd=elsewhere, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "(2, 4)", proc.stderr


def test_servers_started_in_a_clone_run_the_envfleet_this_process_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A learner of an installed envfleet, run in a clone (or any folder with an env_server package), starts
    servers of its own envfleet: was the clone's (``python -m`` puts the working directory first), without a
    word. Modules of the working directory are still found for ``--env`` (see the test below)."""
    clone = tmp_path / "clone"
    (clone / "env_server").mkdir(parents=True)
    (clone / "env_server" / "__init__.py").write_text("raise SystemExit('the working directory\\'s env_server')\n")
    (clone / "myenvs.py").write_text(MY_ENVS)
    monkeypatch.chdir(clone)
    with LocalServers("myenvs:Env", 1, 2) as servers, RemoteVectorEnv(servers.addresses) as envs:
        assert envs.reset(seed=0)[0].shape == (2, 4)


def test_the_env_server_command_finds_modules_in_the_working_directory(tmp_path: Path) -> None:
    """As `python -m env_server` does (the env-server command's own folder is the venv's bin)."""
    (tmp_path / "myenvs.py").write_text(MY_ENVS)
    command = Path(sys.executable).with_name("env-server")
    assert command.exists(), command
    with subprocess.Popen(
        [str(command), "--env", "myenvs:Env", "--port", "0"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("listening on "), proc.stderr.read() if proc.stderr else line
        finally:
            proc.kill()


@pytest.mark.needs_torch
@pytest.mark.slow
def test_the_learner_command_finds_modules_in_the_working_directory_for_its_own_envs(tmp_path: Path) -> None:
    """As its servers do (was: "cannot import module 'myenvs'" for --backend gym, eval's --video: the command's
    own folder is the venv's bin)."""
    (tmp_path / "myenvs.py").write_text(MY_ENVS)
    command = Path(sys.executable).with_name("learner")
    argv = ["train", "--env", "myenvs:Env", "--backend", "gym", "--num-envs", "2", "--num-steps", "8"]
    argv += ["--total-timesteps", "16", "--run-dir", "run", "--no-progress", "--no-plot", "--no-tensorboard"]
    proc = subprocess.run([str(command), *argv], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_a_socket_folder_of_another_name_not_there_yet_is_waited_for(tmp_path: Path) -> None:
    """A unix: address in a folder that is not a LocalServers' may be one a service manager makes as its
    server starts: the connect waits for it (connect_timeout), as for any server not up yet."""
    folder = tmp_path / "run-envfleet"
    start = time.monotonic()
    with pytest.raises(ServerUnavailableError):
        RemoteVectorEnv([f"unix:{folder}/env.sock"], connect_timeout=1.5)
    assert time.monotonic() - start >= 1.4


def _temp_folder_and_a_dead_pid(monkeypatch: Any) -> tuple[Path, int]:
    """A temp folder of its own for LocalServers' socket folders, and the pid of a process that has ended.
    (Short: under pytest-xdist tmp_path is long enough that the sockets would not fit, and LocalServers
    would put them in /tmp instead.)"""
    folder = Path(tempfile.mkdtemp(prefix="efl-"))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return folder, dead.pid


def test_socket_folders_of_killed_learners_are_removed(monkeypatch: Any) -> None:
    """A learner killed with SIGKILL leaves its socket folder (its servers exit by themselves); the
    next LocalServers on Unix sockets removes it, and leaves live learners' folders alone."""
    folder, dead_pid = _temp_folder_and_a_dead_pid(monkeypatch)
    orphan = folder / f"envfleet-{dead_pid}-abc123"
    orphan.mkdir()
    (orphan / "server-0.sock").write_text("")
    (orphan / "server-0.sock.steps").write_text("")
    staging = folder / f".envfleet-{dead_pid}-ghi789"  # (killed before it locked and named its folder)
    staging.mkdir()
    (staging / "owner.lock").write_text("")
    live = folder / f"envfleet-{os.getpid()}-def456"
    live.mkdir()
    try:
        with LocalServers("CartPole-v1", 1, 1, transport="unix") as servers:
            assert servers.addresses[0].startswith(f"unix:{folder}/envfleet-{os.getpid()}-")
        assert not orphan.exists() and not staging.exists() and live.is_dir()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_socket_folder_whose_pid_is_gone_but_whose_server_listens_is_left_alone(monkeypatch: Any) -> None:
    """A learner in another pid namespace (a second container sharing /tmp) has a pid this one does not
    see: its live folder must not be taken for a killed learner's, and its sockets removed from under it."""
    folder, dead_pid = _temp_folder_and_a_dead_pid(monkeypatch)
    elsewhere = folder / f"envfleet-{dead_pid}-abc123"  # (its pid, as this namespace sees it, is no process)
    elsewhere.mkdir()
    orphan = folder / f"envfleet-{dead_pid}-def456"
    orphan.mkdir()
    (orphan / "server-0.sock").write_text("")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as served:
            served.bind(str(elsewhere / "server-0.sock"))
            served.listen()
            with LocalServers("CartPole-v1", 1, 1, transport="unix"):
                pass
            assert sorted(os.listdir(elsewhere)) == ["server-0.sock"] and not orphan.exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_limit_on_the_user_s_processes_too_low_for_the_servers_threads_is_said_before_any_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under a low ``ulimit -u`` (a user's processes and threads), servers that could not start a thread
    crashed: dozens of core dumps, one server said to have been killed by SIGSEGV. Root is not held by it."""
    import resource

    from learner import local

    running = local._user_threads()
    assert running is not None and running > 0
    limits = {resource.RLIMIT_NPROC: (running + 1000, running + 1000)}  # (room for others' to come)
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits.get(which, (resource.RLIM_INFINITY,) * 2))
    monkeypatch.setattr(resource, "setrlimit", lambda which, values: limits.__setitem__(which, values))
    local._check_task_room(40)  # (as root: the limit does not hold)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    local._check_task_room(10)  # (fits)
    with pytest.raises(ServerStartError) as err:
        LocalServers("CartPole-v1", 200, 1)
    assert re.fullmatch(
        r"200 local env servers need at least 1600 threads \(about 8 each\), and this user runs \d+ already, over "
        r"its limit of \d+ processes and threads \(ulimit -u\): raise the limit or start fewer servers \(more envs "
        r"each: envs_per_server, --envs-per-server\)",
        str(err.value),
    ), err.value
    # A soft limit under the hard one is raised to it first (as the one on open files): no error where that fits.
    limits[resource.RLIMIT_NPROC] = (running + 100, running + 5000)
    local._check_task_room(200)
    assert limits[resource.RLIMIT_NPROC] == (running + 5000, running + 5000)


def test_mujoco_s_warnings_are_logged_not_printed_or_written_to_the_working_directory_nor_ale_s_banner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """MuJoCo's own handler printed its warning for gymnasium's half_cheetah.xml (settotalmass, deprecated)
    and appended it to MUJOCO_LOG.TXT in the working directory: `learner train --env HalfCheetah-v5` left
    one in the user's folder, from its servers. Servers and in-process envs log it at debug now, once. ale-py's
    banner is not printed either (`learner eval --video` on Pong printed it among its lines)."""
    pytest.importorskip("mujoco", reason="serves HalfCheetah-v5: needs MuJoCo (pip install 'envfleet[mujoco]')")
    from env_server.config import ServerConfig
    from env_server.envs import make_env

    monkeypatch.chdir(tmp_path)
    with LocalServers("HalfCheetah-v5", 1, 2, transport="unix"):
        pass
    with caplog.at_level(logging.DEBUG, logger="env_server.envs"):
        for _ in range(2):  # (in this process: --backend gym, the bench's baselines)
            make_env(ServerConfig(env="HalfCheetah-v5")).close()
    assert os.listdir(tmp_path) == []
    assert "settotalmass" not in capfd.readouterr().out
    # An env class that imports MuJoCo as it is built: its first env's warning goes by MuJoCo's own handler
    # (no other is set before it is imported); its later envs', logged. (A fresh process: this one has MuJoCo.)
    lazy = (
        "from env_server.config import ServerConfig\nfrom env_server.envs import make_env\n"
        "for _ in range(2): make_env(ServerConfig(env='tests.envs:lazy_half_cheetah')).close()\n"
        "import mujoco, env_server.envs as e\nassert mujoco.get_mju_user_warning() is e._mujoco_warning"
    )
    environ = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    lazily = subprocess.run([sys.executable, "-c", lazy], cwd=tmp_path, env=environ, capture_output=True, timeout=120)
    assert lazily.returncode == 0, lazily.stderr.decode()
    pytest.importorskip("ale_py", reason="needs ale-py (pip install 'envfleet[atari]')")
    make_env(ServerConfig(env="ALE/Pong-v5")).close()
    assert "A.L.E: Arcade Learning Environment" not in capfd.readouterr().err  # (ale-py's banner: printed before)
    said = [r for r in caplog.records if "settotalmass" in r.getMessage()]
    assert all(r.levelno == logging.DEBUG and r.getMessage().startswith("MuJoCo: compiler attribute") for r in said)


def test_server_stderr_is_logged_at_its_level_env_banners_at_info_and_known_noise_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """ale-py's banner at info; MuJoCo's deprecation line for gymnasium's half_cheetah.xml (one per env
    of HalfCheetah) at debug; anything else an env prints at warning."""
    lines = [
        "2026-12-01 03:00:00,000 INFO env_server.server: serving 1 x ALE/Pong-v5",
        "A.L.E: Arcade Learning Environment (version 0.12.1+8a8fafb)",
        "[Powered by Stella]",
        "WARNING: compiler attribute 'settotalmass' is deprecated and will be removed in a future release: scale "
        "the masses and densities in the model, or call mj_setTotalmass and mj_setConst on the compiled model",
        "something the env printed",
        "WARNING: compiler attribute 'other' is deprecated",
        "2026-12-01 03:00:01,000 ERROR env_server.service: the envs failed",
        "Traceback (most recent call last):",
        '  File "env.py", line 1, in step',
        "ValueError: bad",
        "",
        "During handling of the above exception, another exception occurred:",
        "RuntimeError: worse",
        "2026-12-01 03:00:02,000 INFO env_server.server: building 1 x ALE/Pong-v5",
        "A.L.E: Arcade Learning Environment (version 0.12.1+8a8fafb)",
        "Traceback (most recent call last):",
        "RuntimeError: an uncaught one",
        "2026-12-01 12:00:03,000+0900 WARNING env_server.service: a line with its UTC offset",
        "2026-12-01 03:00:03,000-0130 INFO env_server.service: another",
    ]
    code = "import sys\nfor line in sys.argv[1:]: print(line, file=sys.stderr)"
    proc = subprocess.Popen([sys.executable, "-c", code, *lines], stderr=subprocess.PIPE)
    with caplog.at_level(logging.DEBUG, logger="env_server[local-0]"):
        _forward_stderr(proc, 0, collections.deque(maxlen=10))
    proc.wait(timeout=30)
    # A server's own lines without their time (this process's lines have one); a traceback, chained ones
    # included, at the level of the server's line it follows, WARNING at least (an uncaught one).
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("INFO", "env_server.server: serving 1 x ALE/Pong-v5"),
        ("INFO", lines[1]),
        ("INFO", lines[2]),
        ("DEBUG", lines[3]),
        ("WARNING", lines[4]),
        ("WARNING", lines[5]),
        ("ERROR", "env_server.service: the envs failed"),
        ("ERROR", lines[7]),
        ("ERROR", lines[8]),
        ("ERROR", lines[9]),
        ("ERROR", lines[11]),
        ("ERROR", lines[12]),
        ("INFO", "env_server.server: building 1 x ALE/Pong-v5"),
        ("INFO", lines[14]),
        ("WARNING", lines[15]),
        ("WARNING", lines[16]),
        ("WARNING", "env_server.service: a line with its UTC offset"),
        ("INFO", "env_server.service: another"),
    ]
    assert {r.name for r in caplog.records} == {"env_server[local-0]"}  # (as metrics name the server: local-0)


def _printing(*lines: str) -> subprocess.Popen[bytes]:
    """A process that writes ``lines`` to its stderr, as a server would."""
    code = "import sys\nfor line in sys.argv[1:]: print(line, file=sys.stderr)"
    return subprocess.Popen([sys.executable, "-c", code, *lines], stderr=subprocess.PIPE)


def test_a_servers_colour_codes_are_dropped_and_its_other_control_characters_escaped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """gymnasium's yellow warnings, forwarded as they came, spilled their colour into the next records of a log
    file or a pager; an env's escape sequences (clearing the screen) acted on the user's terminal."""
    proc = _printing(
        "2026-12-01 03:00:00,000 WARNING py.warnings: \x1b[33mWARN: odd\x1b[0m",
        "\x1b[2Jcleared \x9b2J\x07\tkept tab",
        " 10%|#  |\r100%|###|",  # (an env's own bar: what a terminal shows of it)
        json.dumps({"level": "INFO", "logger": "env_server.x", "message": "del \x7f and \x1b[2J"}, ensure_ascii=False),
    )
    with caplog.at_level(logging.DEBUG, logger="env_server[local-0]"):
        _forward_stderr(proc, 0, collections.deque(maxlen=10))
    proc.wait(timeout=30)
    assert [r.getMessage() for r in caplog.records] == [
        "py.warnings: WARN: odd",
        "\\x1b[2Jcleared \\x9b2J\\x07\tkept tab",
        "100%|###|",
        "del \\x7f and \\x1b[2J",  # (a JSON record's: escaped after it is read, not lost as a line)
    ]


def test_a_servers_json_records_are_logged_as_it_logged_them(caplog: pytest.LogCaptureFixture) -> None:
    """env-server --log-format json (the learner logs JSON: see below): each record under its own logger's
    name with the server's label, at its level, its traceback the record's (was: a record per line, all
    WARNING records of env_server[0], the logger's name in the message); what is no record (an env's print,
    a crash) as from a text server."""
    traceback = 'Traceback (most recent call last):\n  File "env.py", line 1, in step\nRuntimeError: blew up'
    records = [
        {"level": "WARNING", "logger": "env_server.isolation", "message": "env 0 raised", "exception": traceback},
        {"level": "INFO", "logger": "env_server.service", "message": "claimed by 'x' (100% sure)"},
        {"level": "ERROR", "logger": "env_server", "message": "cannot bind"},
    ]
    stamped = [{"time": "2026-12-01T03:00:00.000Z", **record} for record in records]
    odd = '{"level": ["INFO"], "message": "an env printing JSON"}'  # (was: the reader thread died, unhashable)
    proc = _printing(*map(json.dumps, stamped), "an env's print", '{"not": "a record"}', odd)
    tail: collections.deque[tuple[int, str]] = collections.deque(maxlen=20)
    with caplog.at_level(logging.DEBUG, logger="env_server[local-1]"):
        _forward_stderr(proc, 1, tail)
    proc.wait(timeout=30)
    assert [(r.name, r.levelname, r.getMessage(), r.exc_text) for r in caplog.records] == [
        ("env_server.isolation[local-1]", "WARNING", "env 0 raised", traceback),
        ("env_server.service[local-1]", "INFO", "claimed by 'x' (100% sure)", None),
        ("env_server[local-1]", "DEBUG", "cannot bind", None),  # (env-server's own error: the error raised quotes it)
        ("env_server[local-1]", "WARNING", "an env's print", None),
        ("env_server[local-1]", "WARNING", '{"not": "a record"}', None),
        ("env_server[local-1]", "WARNING", odd, None),
    ]
    # A text formatter writes the traceback after the line, as the server's own would.
    text = logging.Formatter("%(name)s: %(message)s").format(caplog.records[0])
    assert text == f"env_server.isolation[local-1]: env 0 raised\n{traceback}"
    children = _Children("x", None)
    children.tails.append(tail)
    assert children.tail(0) == "env-server: error: cannot bind"  # (as a text server's error line)


def test_the_servers_log_json_where_this_process_logs_their_lines_as_json(caplog: pytest.LogCaptureFixture) -> None:
    """learner --log-format json: the local servers log JSON too, and their records come as they logged them."""
    assert _forwarded_format() == "text"
    json_handler = logging.NullHandler()
    json_handler.setFormatter(JsonLogFormatter())
    root = logging.getLogger()
    root.addHandler(json_handler)
    try:
        assert _forwarded_format() == "json"
        with (
            caplog.at_level(logging.INFO),
            LocalServers("CartPole-v1", 1, 1) as servers,
            RemoteVectorEnv(servers.addresses) as envs,
        ):
            cmd = servers._children.cmds[0]
            assert cmd[cmd.index("--log-format") + 1] == "json"
            envs.reset(seed=0)
            deadline = time.monotonic() + 30
            while not any(
                r.name == "env_server.service[local-0]" and r.getMessage().startswith("claimed by")
                for r in caplog.records
            ):
                assert time.monotonic() < deadline, [(r.name, r.getMessage()) for r in caplog.records]
                time.sleep(0.05)
    finally:
        root.removeHandler(json_handler)
    with pytest.raises(ValueError, match=r"log_format: expected 'text' or 'json' \(or None\), got 'xml'"):
        LocalServers("CartPole-v1", 1, 1, log_format="xml")


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"num_servers": 0}, r"^num_servers: expected an int >= 1, got 0$"),
        ({"num_servers": "2"}, r"^num_servers: expected an int >= 1, got '2'$"),
        ({"envs_per_server": 1.5}, r"^envs_per_server: expected an int >= 1, got 1.5$"),
        ({"restarts": -1}, r"^restarts: expected an int >= 0, got -1$"),
        ({"transport": "udp"}, r"^transport: expected 'tcp' or 'unix', got 'udp'$"),
        ({"log_level": "loud"}, r"^log_level: expected 'debug' or 'info' or 'warning' or 'error' \(or None\), got"),
        ({"startup_timeout": -1}, r"^startup_timeout: expected finite seconds > 0, got -1$"),
        ({"hang_timeout": "5"}, r"^hang_timeout: expected finite seconds >= 0, got '5'$"),
        ({"spin_wait_ms": math.nan}, r"^spin_wait_ms: expected finite milliseconds >= 0, got nan$"),
        # (a string is a sequence of strings: it was split into characters, "unrecognized arguments: - - a u t o")
        ({"server_args": "--autoreset-mode SameStep"}, r"got the string '--autoreset-mode SameStep' \(split it"),
        ({"env": None}, r"^env: expected a gymnasium id or 'module:Factory', got None$"),
        ({"env_kwargs": [1]}, r"^env_kwargs: expected a dict or None, got \[1\]$"),
        ({"auth_token": 123}, r"^auth_token: expected a string or None, got int$"),  # (its value not shown)
        ({"server_args": None}, r"^server_args: expected a list of strings, got None$"),
        # (it names loggers, env_server[eval-0]: a dot would make one the child of another)
        ({"label_prefix": "ev.al"}, r"^label_prefix: expected letters, digits, '_' or '-' .*, got 'ev.al'$"),
        ({"label_prefix": ""}, r"^label_prefix: expected letters, digits, '_' or '-' .*, got ''$"),
    ],
)
def test_bad_arguments_are_refused_naming_them_before_any_server_starts(given: dict[str, Any], message: str) -> None:
    """As RemoteVectorEnv's: an InvalidArgumentError, which `except EnvFleetError` catches (a plain ValueError,
    or Python's own TypeError, before)."""
    from learner import EnvFleetError

    with pytest.raises(EnvFleetError, match=message) as info:
        LocalServers(**({"env": "CartPole-v1", "num_servers": 1, "envs_per_server": 1} | given))  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)


def test_a_dead_servers_last_output_is_said_only_where_it_may_explain_its_death() -> None:
    """The restart warning quoted a SIGKILLed server's last three lines, routine INFO ones ("claimed by
    ..."), ~700 characters a line: only a warning or error, a traceback, or what is no log record (a C
    library's abort message) may explain a death. (Its error line, and all else, as before for the errors
    of a server that did not start.)"""

    def tails(*lines: str) -> tuple[str, str]:
        proc = _printing(*lines)
        tail: collections.deque[tuple[int, str]] = collections.deque(maxlen=20)
        _forward_stderr(proc, 0, tail)
        proc.wait(timeout=30)
        children = _Children("x", None)
        children.tails.append(tail)
        return children.tail(0, explaining=True), children.tail(0)

    info = [f"2026-12-01 03:00:0{i},000+0000 INFO env_server.service: claimed by 'vm:{i}'" for i in range(4)]
    assert tails(*info) == ("", " | ".join(info[-3:]))
    assert tails() == ("", "(nothing)")
    assert tails(info[0], "A.L.E: Arcade Learning Environment (version 0.12.1)")[0] == ""  # (an env's banner)
    for cause in (
        "2026-12-01 03:00:05,000+0000 ERROR env_server.server: the envs' step has run for 10.0 s: exiting",
        "Fatal Python error: Aborted",  # (no log record)
        json.dumps({"time": "2026-12-01T03:00:05.000Z", "level": "WARNING", "logger": "env_server", "message": "x"}),
    ):
        shown = tails(info[0], cause, info[1])[0]
        assert shown.startswith(info[0]) and shown.endswith(info[1]) and len(shown.split(" | ")) == 3, shown
    shown = tails(info[0], "Traceback (most recent call last):", '  File "env.py", line 1', "ValueError: bad")[0]
    assert shown.endswith("ValueError: bad"), shown
    quiet = json.dumps({"time": "2026-12-01T03:00:05.000Z", "level": "INFO", "logger": "env_server", "message": "x"})
    assert tails(quiet) == ("", "2026-12-01T03:00:05.000Z INFO env_server: x")


def test_servers_log_at_the_level_this_process_shows_their_lines_at(caplog: pytest.LogCaptureFixture) -> None:
    """`learner train --log-level info` shows the session lines of the servers it starts (they logged at
    warning whatever the learner's level); a level given still wins."""

    def level_of(servers: LocalServers) -> str:
        cmd = servers._children.cmds[0]
        return cmd[cmd.index("--log-level") + 1]

    with caplog.at_level(logging.INFO):
        with LocalServers("CartPole-v1", 1, 1) as servers, RemoteVectorEnv(servers.addresses) as envs:
            envs.reset(seed=0)
            assert level_of(servers) == "info"
            deadline = time.monotonic() + 10
            while not any("claimed by" in r.getMessage() for r in caplog.records if r.name == "env_server[local-0]"):
                assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
                time.sleep(0.05)
        with LocalServers("CartPole-v1", 1, 1, log_level="error", restarts=0) as servers:
            assert level_of(servers) == "error"
    with LocalServers("CartPole-v1", 1, 1, restarts=0) as servers:  # (the root logger's default: warning)
        assert level_of(servers) == "warning"


def test_an_empty_token_variable_means_no_token_for_the_servers_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """`export ENVFLEET_AUTH_TOKEN=$TOKEN` with TOKEN unset: the learner takes it for no token, and the
    servers it starts must not refuse to start over it (env-server refuses an empty token given to it)."""
    monkeypatch.setenv("ENVFLEET_AUTH_TOKEN", "")
    with local_servers("CartPole-v1", 1, 1) as addresses, RemoteVectorEnv(addresses) as envs:
        envs.reset(seed=0)


def test_servers_take_their_options_from_their_arguments_not_from_envfleet_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Variables exported for servers elsewhere (a compose file's token file, TLS files, wrappers)
    neither break nor change the servers started here (a token file beside the token the learner read
    from it made every server exit: "give one of them, not both"); auth_token is their token."""
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    monkeypatch.setenv("ENVFLEET_AUTH_TOKEN_FILE", str(secret))
    monkeypatch.setenv("ENVFLEET_TLS_CERT", "/certs/server.crt")
    monkeypatch.setenv("ENVFLEET_TLS_KEY", "/certs/server.key")
    monkeypatch.setenv("ENVFLEET_WRAPPERS", "atari")
    with local_servers("CartPole-v1", 1, 1) as addresses, RemoteVectorEnv(addresses) as envs:
        assert envs.single_observation_space.shape == (4,)
    with local_servers("CartPole-v1", 1, 1, auth_token="s3cret") as addresses:
        with pytest.raises(AuthenticationError):
            RemoteVectorEnv(addresses)
        with RemoteVectorEnv(addresses, auth_token="s3cret") as envs:
            envs.reset(seed=0)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
@pytest.mark.slow
def test_a_server_that_dies_is_started_again_on_its_address_and_its_envs_rejoin(
    transport: str, caplog: pytest.LogCaptureFixture
) -> None:
    """kill -9 of one server `learner train` started: it comes back where it was, and a fault-tolerant
    fleet gets its envs back (was: the run went on with the other servers' envs to its end)."""
    with (
        caplog.at_level(logging.INFO, logger="learner.local"),
        LocalServers("tests.envs:IndexEnv", 2, 2, transport=transport) as servers,
        RemoteVectorEnv(servers.addresses, fault_tolerant=True, timeout=2.0, backoff=(0.05, 0.5)) as envs,
    ):
        addresses, pids = list(servers.addresses), servers.pids
        envs.reset(seed=0)
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        seen_down = False
        while True:
            infos = envs.step(np.zeros(4, dtype=np.int64))[4]
            down = infos.get("env_unavailable", np.zeros(4, dtype=bool))
            seen_down |= bool(down[2:].all())
            if seen_down and not down.any():
                break
            assert time.monotonic() < deadline, "the killed server's envs did not rejoin within 30 s"
            time.sleep(0.05)
        assert servers.addresses == addresses and servers.pids[0] == pids[0]
        assert servers.pids[1] != pids[1] and alive(servers.pids[1])
        assert envs.fault_stats().reconnects == 1
        [warning] = [r for r in caplog.records if r.name == "learner.local" and r.levelno == logging.WARNING]
        assert f"env server local-1 ({addresses[1]}) was killed by SIGKILL; starting it again on the same address" in (
            warning.getMessage()
        )
        # Nothing it wrote explains a SIGKILL: no "its last output: (nothing)", nor routine lines.
        assert warning.getMessage().endswith("(restart 1 of at most 5 within 60 s)"), warning.getMessage()
        new_pids = servers.pids
    wait_gone(new_pids, within=5)


@pytest.mark.slow
def test_a_server_that_keeps_dying_is_left_down_after_its_restarts(caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.INFO, logger="learner.local"),
        LocalServers("CartPole-v1", 1, 1, restarts=2) as servers,
    ):
        for _ in range(2):
            pid = servers.pids[0]
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 20
            while servers.pids[0] == pid:
                assert time.monotonic() < deadline, "not started again within 20 s"
                time.sleep(0.05)
        pid = servers.pids[0]
        os.kill(pid, signal.SIGKILL)  # the third death within a minute: left down
        time.sleep(2.5)  # (longer than the next restart's wait would be)
        assert servers.pids[0] == pid and not alive(pid)
        # (the error that ends a run on them says why, not only the learner's last error: a broken connection)
        said = left_down(servers.addresses[0])  # ("... by SIGKILL before listening" where it was still starting)
        assert said is not None and said.startswith("was killed by SIGKILL"), said
        assert said.endswith(", and was left down after 2 restarts within 60 s"), said
        assert _left_down(servers.addresses) == f"; local-0 {said}"
    assert left_down(servers.addresses[0]) is None  # (closed)
    assert "it was started again 2 times within 60 s: leaving it down" in caplog.text
    assert caplog.text.count("starting it again on the same address") == 2


def test_close_does_not_start_again_the_servers_it_stops() -> None:
    servers = LocalServers("CartPole-v1", 2, 1)
    pids = servers.pids
    servers.close()
    time.sleep(1.0)
    assert servers.pids == pids
    wait_gone(pids, within=5)


# -- stopping servers still building their envs ----------------------------------------------------------------


def _with_marker(marker: str) -> list[int]:
    """The processes whose command line holds ``marker`` (tests.envs:SimulatorBuildEnv's simulators)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and alive(int(entry)):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


@needs_proc
@pytest.mark.slow
def test_servers_still_building_their_envs_are_stopped_at_once_with_what_they_started() -> None:
    """A Ctrl-C (or a start-up timeout) while the servers build their envs: nothing to drain, so they are
    not given the 10 s a server that serves gets (was: 10 s of silence, then SIGKILL of the server alone,
    leaving the processes its env had started running)."""
    marker = f"envfleet-simulator-{os.getpid()}-{time.monotonic_ns()}"
    start = time.monotonic()
    try:
        with pytest.raises(ServerStartError) as info:
            LocalServers(
                "tests.envs:SimulatorBuildEnv", 2, 1, env_kwargs={"marker": marker, "build_s": 60}, startup_timeout=3
            )
        took = time.monotonic() - start
        assert len(_with_marker(marker)) <= 2  # (those that were started: gone by now, or a moment after)
        wait_gone(_with_marker(marker), within=2)
        assert took < 7, took
        # (and the error says what to raise: see test_learner_train_waits_connect_timeout_for_its_local_servers)
        assert "did not start listening within 3 s (envs that take long to build: raise startup_timeout" in str(
            info.value
        )
    finally:
        for pid in _with_marker(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_wait_for_servers_to_finish_is_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A server that serves gets up to 10 s to finish its calls and close its envs: a wait past a second is
    logged (was: nothing, as the learner seemed to hang after a Ctrl-C)."""
    servers = LocalServers("tests.envs:CloseGateEnv", 1, 1, env_kwargs={"gate": str(tmp_path / "gate"), "hold_s": 2.5})
    with caplog.at_level(logging.WARNING, logger="learner.local"):
        servers.close()
    [said] = [r.getMessage() for r in caplog.records if r.name == "learner.local"]
    assert re.fullmatch(
        r"stopping 1 env server: waiting up to \d s more for it to finish its calls and close its envs "
        r"\(then killing it\)",
        said,
    ), said
    with caplog.at_level(logging.WARNING, logger="learner.local"):  # (one that stops at once: nothing said)
        caplog.clear()
        LocalServers("CartPole-v1", 2, 1).close()
    assert not [r for r in caplog.records if r.name == "learner.local"]


@needs_proc
@pytest.mark.slow
def test_servers_of_a_learner_killed_while_they_build_their_envs_exit_at_once(tmp_path: Path) -> None:
    """The docstring's "within a second of its death" while the servers build their envs too (was: 15 s,
    the server's grace period and exit margin, then an exit that left its socket file), and with them
    the processes their envs had started (was: left running)."""
    root = Path(tempfile.mkdtemp(prefix="efl-"))  # (short: the sockets must fit)
    marker = f"envfleet-simulator-{os.getpid()}-{time.monotonic_ns()}"
    script = textwrap.dedent(
        f"""
        from learner import LocalServers
        LocalServers("tests.envs:SimulatorBuildEnv", 2, 1, env_kwargs={{"marker": {marker!r}, "build_s": 60}})
        """
    )
    environ = {**os.environ, "TMPDIR": str(root)}
    try:
        with subprocess.Popen([sys.executable, "-c", script], env=environ) as learner:
            try:
                deadline = time.monotonic() + 60
                while len(sockets := sorted(root.glob(f"envfleet-{learner.pid}-*/server-*.sock"))) < 2:
                    assert time.monotonic() < deadline and learner.poll() is None, "the servers did not listen"
                    time.sleep(0.1)
                folder = str(sockets[0].parent)
                pids = [
                    int(p) for p in os.listdir("/proc") if p.isdigit() and _is_server(int(p), [folder], learner.pid)
                ]
                assert len(pids) == 2, pids
                while len(simulators := _with_marker(marker)) < 2:
                    assert time.monotonic() < deadline, "the envs did not start their simulators"
                    time.sleep(0.1)
            finally:
                learner.kill()
        wait_gone(pids, within=4)
        assert not [p.name for p in Path(folder).iterdir() if ".sock" in p.name]  # (each removed its own)
        wait_gone(simulators, within=2)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for pid in _with_marker(marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# -- the start-up timeout, and a server that dies before it listens ---------------------------------------------


@pytest.mark.slow
def test_learner_train_waits_connect_timeout_for_its_local_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    """--connect-timeout ("raise it where servers take a while to come up") is the local servers' start-up
    limit too, where it is over the 60 s LocalServers wait by default (here that floor is 1 s)."""
    import learner.envs

    monkeypatch.setattr(learner.envs, "STARTUP_TIMEOUT_S", 1.0)
    spec = learner.envs.FleetSpec(
        "tests.envs:SlowToBuildEnv", num_servers=1, envs_per_server=1, env_kwargs={"build_s": 60}, connect_timeout=2.5
    )
    start = time.monotonic()
    with (
        pytest.raises(
            ServerStartError, match=r"did not start listening within 2\.5 s \(envs that take long to build: "
        ),
        learner.envs.open_fleet(spec),
    ):
        pass
    assert time.monotonic() - start < 8


def test_a_server_killed_by_a_signal_before_listening_says_by_which(monkeypatch: pytest.MonkeyPatch) -> None:
    """Was "exited with code -6", and "(nothing)" with no word of what would show more; env-server enables
    Python's fault handler itself now, so where it died shows without PYTHONFAULTHANDLER."""
    monkeypatch.delenv("PYTHONFAULTHANDLER", raising=False)
    with pytest.raises(ServerStartError) as info:
        LocalServers("tests.envs:AbortingEnv", 1, 1, log_level="warning")
    message = str(info.value)
    assert message.startswith(
        "env server local-0 for 'tests.envs:AbortingEnv' was killed by SIGABRT before listening: "
    ), message
    assert "(nothing)" not in message and " line " in message, message  # (the fault handler's frames)


# -- the socket folder's lock ---------------------------------------------------------------------------------


def test_a_socket_folder_whose_lock_is_held_is_left_alone(monkeypatch: Any) -> None:
    """A learner in another pid namespace whose servers do not listen yet (building their envs): its folder
    was taken for a killed learner's and removed under it. Its lock, held for its life, says it runs."""
    import fcntl

    folder, dead_pid = _temp_folder_and_a_dead_pid(monkeypatch)
    elsewhere = folder / f"envfleet-{dead_pid}-abc123"  # (its pid, as this namespace sees it, is no process)
    elsewhere.mkdir()
    (elsewhere / "server-0.sock").write_text("")  # (no server listens there yet)
    orphan = folder / f"envfleet-{dead_pid}-def456"  # (its lock file is left, and held by nobody)
    orphan.mkdir()
    (orphan / "owner.lock").write_text("")
    (orphan / "server-0.sock").write_text("")
    try:
        with open(elsewhere / "owner.lock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            with LocalServers("CartPole-v1", 1, 1, transport="unix") as servers:
                own = Path(servers.addresses[0].removeprefix("unix:")).parent
                # Its own folder is held as long as it runs.
                with open(own / "owner.lock") as probe, pytest.raises(BlockingIOError):
                    fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            assert sorted(os.listdir(elsewhere)) == ["owner.lock", "server-0.sock"]
            assert not orphan.exists() and not own.exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- supervision ----------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_failed_restarts_count_within_the_window_only(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A restart that cannot start the process (OSError: out of processes) counted every earlier restart,
    however old, toward leaving the server down (the window here 1.5 s, not a minute)."""
    import learner.local

    monkeypatch.setattr(learner.local, "RESTART_WINDOW_S", 1.5)
    real_popen = subprocess.Popen
    failures = [0]

    def popen(*args: Any, **kwargs: Any) -> Any:
        if failures[0]:
            failures[0] -= 1
            raise OSError(11, "Resource temporarily unavailable")
        return real_popen(*args, **kwargs)

    with (
        caplog.at_level(logging.INFO, logger="learner.local"),
        LocalServers("CartPole-v1", 1, 1, restarts=3) as servers,
    ):
        monkeypatch.setattr(subprocess, "Popen", popen)
        pid = servers.pids[0]
        failures[0] = 3  # (at 0.5 s, 1.5 s and 3.5 s after its death: no more than 2 within 1.5 s)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while "is back on" not in caplog.text:
            assert "leaving it down" not in caplog.text, caplog.text
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.1)
        assert failures == [0] and servers.pids[0] != pid
        monkeypatch.setattr(subprocess, "Popen", real_popen)


def _tree(root: Path, files: dict[str, str]) -> str:
    """A fake file system under ``root``: its files (relative paths) with their text; ``root`` as a str."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return str(root)


def _affinity() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.mark.parametrize("mount", ["cpu", "cpu,cpuacct"])
def test_usable_cpus_reads_a_cgroup_v1_quota(tmp_path: Path, mount: str) -> None:
    """``docker run --cpus 0.5`` on a cgroup v1 host: cfs_quota_us 50000 over cfs_period_us 100000 (was
    ignored: only cgroup v2's cpu.max was read, and usable_cpus() said the host's CPUs)."""
    from learner.cgroups import cgroup_cpu_quota
    from learner.local import usable_cpus

    files = {
        f"sys/fs/cgroup/{mount}/cpu.cfs_quota_us": "50000\n",
        f"sys/fs/cgroup/{mount}/cpu.cfs_period_us": "100000\n",
    }
    root = _tree(tmp_path, {**files, "proc/self/cgroup": f"4:{mount}:/docker/0123abcd\n1:name=systemd:/docker/0123\n"})
    assert cgroup_cpu_quota(root) == 0.5  # (its cgroup's folder, named as the host names it, is not in its mount)
    assert usable_cpus(root) == 1


def test_usable_cpus_reads_cgroup_v2_s_cpu_max_at_the_mount_s_root(tmp_path: Path) -> None:
    from learner.cgroups import cgroup_cpu_quota
    from learner.local import usable_cpus

    root = _tree(tmp_path, {"sys/fs/cgroup/cpu.max": "150000 100000\n", "proc/self/cgroup": "0::/\n"})
    assert cgroup_cpu_quota(root) == 1.5
    assert usable_cpus(root) == min(_affinity(), 2)


def test_usable_cpus_takes_the_smallest_quota_of_a_nested_cgroup_v2_and_its_parents(tmp_path: Path) -> None:
    """cgroup v2 without a cgroup namespace: /sys/fs/cgroup is the host's tree; the process's cgroup is
    the one /proc/self/cgroup names, and a parent's quota bounds it too."""
    from learner.cgroups import cgroup_cpu_quota
    from learner.local import usable_cpus

    scope = "sys/fs/cgroup/system.slice/docker-0123.scope"
    files = {
        "proc/self/cgroup": "0::/system.slice/docker-0123.scope\n",
        f"{scope}/cpu.max": "max 100000\n",
        "sys/fs/cgroup/system.slice/cpu.max": "100000 100000\n",  # (the parent's: 1 CPU)
        "sys/fs/cgroup/other.slice/cpu.max": "10000 100000\n",  # (another cgroup's: not this process's)
    }
    root = _tree(tmp_path, files)
    assert cgroup_cpu_quota(root) == 1.0
    assert usable_cpus(root) == 1
    (tmp_path / scope / "cpu.max").write_text("25000 100000\n")  # (its own, smaller: that one)
    assert cgroup_cpu_quota(root) == 0.25
    assert usable_cpus(root) == 1


@pytest.mark.parametrize(
    "files",
    [
        {},
        {"proc/self/cgroup": "0::/\n", "sys/fs/cgroup/cpu.max": "max 100000\n"},
        {"proc/self/cgroup": "1:cpu:/\n", "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n"},
        {"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n", "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n"},
        {
            "proc/self/cgroup": "0::/a/b\n",
            "sys/fs/cgroup/a/b/cpu.max": "max 100000\n",
            "sys/fs/cgroup/a/cpu.max": "max",
        },
    ],
    ids=["no-cgroups", "v2-max", "v1-minus-one", "v1-no-proc", "v2-nested-max"],
)
def test_usable_cpus_without_a_cpu_quota_is_the_affinity(tmp_path: Path, files: dict[str, str]) -> None:
    from learner.cgroups import cgroup_cpu_quota
    from learner.local import usable_cpus

    root = _tree(tmp_path, files)
    assert cgroup_cpu_quota(root) is None
    assert usable_cpus(root) == _affinity()


def test_a_server_process_that_cannot_be_started_is_a_server_start_error_naming_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An interpreter the user may not run, or no process left to fork (ulimit -u), or no thread left to read
    its output (the process started): was a raw traceback; the servers started before it are stopped, and one
    whose reader could not start is not left running."""
    from learner import local

    popen, failure = subprocess.Popen, list[OSError | RuntimeError | None]([None])
    started: list[subprocess.Popen[bytes]] = []

    def fails_second(cmd: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        if started and failure[0] is not None:
            raise failure[0]
        started.append(popen(cmd, **kwargs))
        return started[-1]

    class NoThreadForTheSecond(threading.Thread):
        def start(self) -> None:
            if self.name == "env-server-1-stderr" and failure[0] is None:
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(local.subprocess, "Popen", fails_second)
    monkeypatch.setattr(local.threading, "Thread", NoThreadForTheSecond)
    for failure[0], said in (
        (PermissionError(errno.EACCES, "Permission denied"), r"Permission denied$"),
        (BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable"), r"unavailable; the limit on processes"),
        (None, r"\): can't start new thread; the limit on processes"),
    ):
        started.clear()
        with pytest.raises(ServerStartError, match=r"^env server local-1 for 'CartPole-v1': cannot start it \("):
            try:
                LocalServers("CartPole-v1", 2, 1)
            except ServerStartError as err:
                assert re.search(said, str(err)), err
                raise
        wait_gone([p.pid for p in started], within=5)


def test_a_restart_whose_reader_cannot_start_leaves_no_server_running_untracked(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server started again whose output's reader thread could not start was left running, out of the list
    (the next try replaced it there), unread, and no Ctrl-C reached it; left down, why is on record."""
    from learner import local

    popen = subprocess.Popen
    restarted: list[subprocess.Popen[bytes]] = []

    def recorded(cmd: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        restarted.append(popen(cmd, **kwargs))
        return restarted[-1]

    class NoThread(threading.Thread):
        def start(self) -> None:
            raise RuntimeError("can't start new thread")

    with (
        caplog.at_level(logging.ERROR, logger="learner.local"),
        LocalServers("CartPole-v1", 1, 1, restarts=1) as servers,
    ):
        monkeypatch.setattr(local.subprocess, "Popen", recorded)
        monkeypatch.setattr(local.threading, "Thread", NoThread)
        os.kill(servers.pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not restarted or "cannot start it again" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.1)
        wait_gone([p.pid for p in restarted], within=5)
        assert "cannot start it again: can't start new thread; the limit on processes" in caplog.text
        monkeypatch.undo()


def test_servers_that_the_limit_on_open_files_cannot_hold_are_refused_before_any_starts() -> None:
    """Found after every server had started, the run died writing its files (16 s for 24 servers under
    `ulimit -n 100`), after one warning per server that its step socket could not be used."""
    import resource

    script = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))\n"  # (the hard limit too: a soft one is raised)
        "from learner import LocalServers, ServerStartError\n"
        "try:\n"
        "    LocalServers('CartPole-v1', 24, 1)\n"
        "except ServerStartError as err:\n"
        "    print(err)\n"
    )
    said = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert said.returncode == 0 and not said.stderr, said
    assert re.fullmatch(
        r"24 local env servers need about \d+ open files in this process \(about 5 each, and \d+ open already\), "
        r"over its limit of 100 \(ulimit -n\): raise the limit or start fewer servers \(more envs each: "
        r"envs_per_server, --envs-per-server\)\n",
        said.stdout,
    ), said.stdout
    # A soft limit short of them with a hard one that is not: raised (from Python, as the learner command does).
    script = (
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (30, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))\n"
        "from learner import LocalServers\n"
        "with LocalServers('CartPole-v1', 3, 1):\n"
        "    print(resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 30)\n"
    )
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard > 100:
        started = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert started.returncode == 0 and started.stdout == "True\n", started


def test_many_servers_stopping_on_few_cpus_get_longer_before_a_wait_is_said_or_they_are_killed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each server's stop costs ~0.25 s of CPU: 64 on 2 CPUs took 8 s, and every run's end said it as a wait
    ("stopping 64 env servers: waiting up to 9 s more ... then killing them"); beyond ~80 the fixed 10-s
    deadline would kill servers closing normally. The waits scale with the servers per CPU (past 4 each)."""
    from learner import local

    monkeypatch.setattr(local, "usable_cpus", lambda root="/": 1)
    slow_to_stop = ["sh", "-c", 'trap "sleep 1.5; exit 0" TERM; echo ready; while :; do sleep 0.05; done']

    def stop(count: int) -> list[int | None]:
        procs = [subprocess.Popen(slow_to_stop, stdout=subprocess.PIPE) for _ in range(count)]
        for proc in procs:  # (their traps set)
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
            proc.stdout.close()
        local._stop_all_procs(procs)
        return [proc.returncode for proc in procs]

    with caplog.at_level(logging.WARNING, logger="learner.local"):
        assert stop(16) == [0] * 16  # (4 per CPU at most: waits x4, no wait said in 1.5 s; the stop said at once)
        assert [r.getMessage() for r in caplog.records] == [
            "stopping 16 env servers on 1 CPU: they take a while (Ctrl-C kills them at once)"
        ]
        caplog.clear()
        assert stop(2) == [0] * 2
    assert [r.getMessage()[:46] for r in caplog.records] == ["stopping 2 env servers: waiting up to 9 s more"]


def test_the_start_of_many_servers_on_few_cpus_says_how_far_it_got(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """320 servers on 2 CPUs took 108 s to start, nothing said after the note that they take a while: how many
    listen is said every 10 s (here 0.5 s) while they are more than 4 on each CPU; none for fewer."""
    from learner import local

    monkeypatch.setattr(local, "_SAY_STARTING_S", 0.5)
    slow = {"build_s": 2.0}
    with caplog.at_level(logging.WARNING, logger="learner.local"):
        LocalServers("tests.envs:SlowToBuildEnv", 2, 1, env_kwargs=slow).close()
        assert not [r for r in caplog.records if "listening after" in r.getMessage()]
        monkeypatch.setattr(local, "usable_cpus", lambda root="/": 1)
        monkeypatch.setattr(local, "SERVERS_PER_CPU", 1)
        LocalServers("tests.envs:SlowToBuildEnv", 2, 1, env_kwargs=slow).close()
    said = [r.getMessage() for r in caplog.records if "listening after" in r.getMessage()]
    assert said and re.fullmatch(r"0 of 2 local env servers listening after \d s", said[0]), said


def test_a_ctrl_c_during_the_stops_wait_kills_the_servers_left(caplog: pytest.LogCaptureFixture) -> None:
    """close() interrupted while it waited for servers mid-step left them running (~15 s here) once it had
    returned, closed: asked not to wait, it kills them."""
    import _thread

    from learner import local

    deaf = ["sh", "-c", 'trap "" TERM; echo ready; while :; do sleep 0.05; done']  # (a server stuck in a step)
    procs = [subprocess.Popen(deaf, stdout=subprocess.PIPE, start_new_session=True) for _ in range(2)]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        proc.stdout.close()
    timer = threading.Timer(local._SAY_WAIT_S + 1.0, _thread.interrupt_main)  # (a Ctrl-C, once the wait is said)
    timer.start()
    started = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="learner.local"), pytest.raises(KeyboardInterrupt):
            local._stop_all_procs(procs)
    finally:
        timer.join()
        for proc in procs:  # (they ignore SIGTERM: left, they would run on)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert "stopping 2 env servers: waiting up to" in caplog.text
    assert [proc.returncode for proc in procs] == [-signal.SIGKILL] * 2 and time.monotonic() - started < 10


def test_local_servers_shows_and_types_the_arguments_of_local_servers() -> None:
    """As ``**kwargs: Any`` it hid LocalServers' options from help() and let type checkers take a misspelt one
    (``env_kwarg={...}``)."""
    import inspect
    import typing

    from learner import local_servers

    assert inspect.signature(local_servers).parameters == inspect.signature(LocalServers).parameters
    assert inspect.signature(local_servers).return_annotation == "Iterator[list[str]]"  # (not LocalServers' None)
    if typing.TYPE_CHECKING:  # (what mypy checks: a misspelt option is an error)
        local_servers("CartPole-v1", env_kwarg={})  # type: ignore[call-arg]


def test_a_log_level_in_capitals_and_server_args_from_a_generator_are_taken() -> None:
    """As env-server's --log-level takes INFO; a generator of server_args was read up by the check, the servers
    started without them."""
    args = (a for a in ["--max-episode-steps", "7"])
    with LocalServers("CartPole-v1", 1, 1, log_level="Info", log_format="JSON", server_args=args) as s:  # type: ignore[arg-type]
        assert s._children.cmds[0][-2:] == ["--max-episode-steps", "7"]


def test_local_servers_say_what_they_are_and_whether_closed(caplog: pytest.LogCaptureFixture) -> None:
    """Their repr was object's (``<learner.local.LocalServers object at 0x...>``); their start's line named each
    socket's path (64 servers: 4,000 characters), its folder once now."""
    from learner.local import _labels

    with caplog.at_level(logging.INFO, logger="learner.local"):
        servers = LocalServers("CartPole-v1", 3, 1)
    try:
        a, b, _ = servers.addresses
        assert repr(servers) == f"<LocalServers 'CartPole-v1': {a}, {b}, ... (3 servers)>"
        with RemoteVectorEnv([a]) as envs:  # (and a RemoteVectorEnv's: closed too)
            assert repr(envs) == f"RemoteVectorEnv(CartPole-v1, [{a!r}], num_envs=1)"
        assert repr(envs) == f"RemoteVectorEnv(CartPole-v1, [{a!r}], num_envs=1, closed)"
        folder = os.path.dirname(a.removeprefix("unix:"))
        assert (
            f"started 3 local env servers (1 x CartPole-v1 each): local-0 to local-2 in {folder} (server-N.sock)"
            in [r.getMessage() for r in caplog.records]
        )
    finally:
        servers.close()
    assert repr(servers) == "<LocalServers 'CartPole-v1': closed>"
    assert _labels([0, 1, 2, 3, 5, 7, 8]) == "local-0 to local-3, local-5, local-7, local-8"
    assert _labels([0, 1, 2, 4], "eval") == "eval-0 to eval-2, eval-4"  # (LocalServers(label_prefix="eval"))
