"""What differs between platforms, simulated on Linux: no fcntl (Windows), an event loop without signal
handlers (Windows') or a server in a thread other than the main one, local servers on Windows, MuJoCo's
renderer off Linux, Unix socket path limits; and how async vectorization's workers are started and
stopped (forked before any other thread runs; a SIGTERM to the whole process group)."""

from __future__ import annotations

import asyncio
import errno
import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from env_server.config import ServerConfig
from env_server.envs import WideInfoSyncVectorEnv
from env_server.protocol import _max_unix_path
from env_server.server import EXIT_MARGIN_S, HARD_EXIT_STATUS, _check_socket_path, serve
from learner import RemoteVectorEnv, ServerStartError, local, rundir, video
from tests.test_readme_claims_server import SHORT_EXIT_MARGIN_S, env_server_argv

ROOT = Path(__file__).resolve().parent.parent


def _python(script: str, *, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a new interpreter (the checkout importable: see conftest); its result, stdout and stderr
    as text."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --- the run dir's lock without fcntl ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.needs_torch
def test_the_learner_imports_without_fcntl_and_uses_its_run_dir_unlocked_saying_so(tmp_path: Path) -> None:
    """As on Windows where msvcrt is missing too: the commands' modules import, and the lock is a warning."""
    result = _python(
        f"""
        import logging, sys
        sys.modules["fcntl"] = None  # (import fcntl: ImportError, as on Windows)
        logging.basicConfig(level=logging.WARNING)
        import learner.cli, learner.train, learner.checkpoint, learner.plot, learner.evaluate
        from learner import rundir
        assert rundir.fcntl is None and rundir.msvcrt is None
        with rundir.lock({str(tmp_path)!r}):
            print(open({str(tmp_path / rundir.LOCK)!r}).read().strip())
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("pid "), result.stdout
    assert "cannot lock it" in result.stderr and "nothing keeps another learner from writing it too" in result.stderr


class _FakeMsvcrt:
    """msvcrt's locking, as Windows' C runtime behaves for one file: a second lock of a locked byte is EACCES."""

    LK_NBLCK = 2
    LK_UNLCK = 0

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []  # (mode, bytes, the file's position)
        self.held = False

    def locking(self, fd: int, mode: int, nbytes: int) -> None:
        self.calls.append((mode, nbytes, os.lseek(fd, 0, os.SEEK_CUR)))
        if mode == self.LK_UNLCK:
            self.held = False
        elif self.held:
            raise PermissionError(errno.EACCES, "Permission denied")
        else:
            self.held = True


def test_without_fcntl_the_run_dir_is_locked_with_msvcrt_past_the_holders_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = _FakeMsvcrt()
    monkeypatch.setattr(rundir, "fcntl", None)
    monkeypatch.setattr(rundir, "msvcrt", fake)
    in_use = pytest.raises(FileExistsError, match=rf"in use by another learner \(pid {os.getpid()} on ")
    with rundir.lock(tmp_path), in_use, rundir.lock(tmp_path):
        pass
    with rundir.lock(tmp_path):  # (unlocked at the end of the block: the next learner takes it at once)
        pass
    # (a byte far past the holder's text, which a second learner reads to name it: Windows' locks are mandatory)
    lock, unlock = (fake.LK_NBLCK, 1, rundir._MSVCRT_LOCK_OFFSET), (fake.LK_UNLCK, 1, rundir._MSVCRT_LOCK_OFFSET)
    assert fake.calls == [lock, lock, unlock, lock, unlock]


def test_a_run_dir_msvcrt_cannot_lock_is_used_unlocked_saying_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class NoLocks(_FakeMsvcrt):
        def locking(self, fd: int, mode: int, nbytes: int) -> None:
            raise OSError(errno.EINVAL, "Invalid argument")  # (a file system without locks)

    monkeypatch.setattr(rundir, "fcntl", None)
    monkeypatch.setattr(rundir, "msvcrt", NoLocks())
    with rundir.lock(tmp_path):
        pass
    assert "cannot lock it (Invalid argument)" in caplog.text


# --- the server's signals ----------------------------------------------------------------------------


def test_serve_runs_in_a_thread_other_than_the_main_one_and_stops_on_its_stop_event() -> None:
    """Python takes signals in the main thread only (add_signal_handler: RuntimeError elsewhere): such a
    server takes none, leaves the process's handlers as they were, and stops when its ``stop`` is set."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    ready = threading.Event()
    got: dict[str, Any] = {}

    async def main() -> int:
        got["loop"], got["stop"] = asyncio.get_running_loop(), asyncio.Event()

        def on_ready(address: str) -> None:
            got["address"] = address
            got["handlers"] = {sig: signal.getsignal(sig) for sig in before}
            ready.set()

        config = ServerConfig(env="CartPole-v1", num_envs=2, host="127.0.0.1", port=0, grace_s=1.0)
        return await serve(config, on_ready, stop=got["stop"])

    def run() -> None:
        try:
            got["status"] = asyncio.run(main())
        except BaseException as err:  # (said by the test, not lost in the thread)
            got["error"] = err
        finally:
            ready.set()

    thread = threading.Thread(target=run, name="serve-in-a-thread")
    thread.start()
    try:
        assert ready.wait(60) and "error" not in got, got.get("error")
        assert got["handlers"] == before
        with RemoteVectorEnv(got["address"], timeout=30) as envs:
            obs, _ = envs.reset(seed=0)
            assert obs.shape == (2, 4)
            _, rewards, *_ = envs.step(np.zeros(2, dtype=np.int64))
            assert rewards.tolist() == [1.0, 1.0]
        # (the client's own: its first call in the main thread takes Ctrl-C, for the process's life; see
        # learner.loop.take_ctrl_c, which an earlier test in this process may have done already)
        before = {sig: signal.getsignal(sig) for sig in before}
    finally:
        if "loop" in got:
            got["loop"].call_soon_threadsafe(got["stop"].set)
        thread.join(60)
    assert not thread.is_alive()
    assert "error" not in got, got.get("error")
    assert got["status"] == 0
    assert {sig: signal.getsignal(sig) for sig in before} == before
    deadline = time.monotonic() + 5  # (the watchdog ends at its next look)
    while any(t.name == "env-server-watchdog" for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the watchdog thread still runs"
        time.sleep(0.05)


def test_a_server_whose_event_loop_has_no_signal_handlers_still_stops_on_sigterm() -> None:
    """As on Windows, whose event loops raise NotImplementedError for add_signal_handler: the Python-level
    handler alone stops the server, cleanly."""
    result = _python(
        """
        import asyncio, os, signal
        from env_server.config import ServerConfig
        from env_server.server import serve

        refused = []
        def refuse(*args, **kwargs):
            refused.append(args[1:2])
            raise NotImplementedError
        loop_class = type(asyncio.new_event_loop())  # (the class asyncio.run makes: its own methods win)
        loop_class.add_signal_handler = refuse
        loop_class.remove_signal_handler = refuse
        config = ServerConfig(env="CartPole-v1", num_envs=1, host="127.0.0.1", port=0, grace_s=1.0)
        status = asyncio.run(serve(config, lambda address: os.kill(os.getpid(), signal.SIGTERM)))
        print("status", status, signal.getsignal(signal.SIGTERM) is signal.SIG_DFL, len(refused) >= 2)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["status", "0", "True", "True"], (result.stdout, result.stderr)


# --- async vectorization's workers --------------------------------------------------------------------


def test_async_workers_are_forked_while_the_server_runs_one_thread_and_the_watchdog_starts_after() -> None:
    """Forked from a process of several threads, a child may inherit a lock another thread held, for good
    (Python 3.12 warns of it): the watchdog thread starts once the workers exist."""
    result = _python(
        """
        import asyncio, json, multiprocessing.process, os, signal, threading
        from env_server.config import ServerConfig
        from env_server.server import serve

        at_starts = []
        start = multiprocessing.process.BaseProcess.start
        def counting_start(self):
            at_starts.append(sorted(t.name for t in threading.enumerate()))
            start(self)
        multiprocessing.process.BaseProcess.start = counting_start

        at_ready = []
        def on_ready(address):
            at_ready.extend(sorted(t.name for t in threading.enumerate()))
            os.kill(os.getpid(), signal.SIGTERM)

        config = ServerConfig(env="CartPole-v1", num_envs=2, vectorization="async", host="127.0.0.1", port=0)
        status = asyncio.run(serve(config, on_ready))
        print(json.dumps({"status": status, "at_starts": at_starts, "at_ready": at_ready}))
        """
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    assert found["status"] == 0, result.stderr
    assert len(found["at_starts"]) >= 2 and all(names == ["MainThread"] for names in found["at_starts"]), found
    assert "env-server-watchdog" in found["at_ready"], found


# An env whose construction hangs after the first (the server's own check that it can be made): in the
# async build, as a simulator that never answers would.
_HANGS_IN_BUILD = """
import os, time
import gymnasium as gym
import numpy as np

class HangsInBuild(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, made):
        if os.path.exists(made):
            while True:
                time.sleep(0.05)
        open(made, "w").close()
"""


@pytest.mark.slow
def test_sigterm_while_the_async_build_hangs_still_ends_the_server_in_time(tmp_path: Path) -> None:
    """The watchdog, not started while the workers are made, starts at the signal: the exit comes within the
    grace period and the exit margin (EXIT_MARGIN_S; here SHORT_EXIT_MARGIN_S), as it does once the envs are
    served."""
    (tmp_path / "hangs_in_build.py").write_text(_HANGS_IN_BUILD)
    kwargs = json.dumps({"made": str(tmp_path / "made")})
    argv = env_server_argv(
        *["--env", "hangs_in_build:HangsInBuild", "--env-kwargs", kwargs, "--num-envs", "2"],
        *["--vectorization", "async", "--port", "0", "--grace", "0.5"],
        exit_margin_s=SHORT_EXIT_MARGIN_S,
    )
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "made").exists():  # (the first env made: the build hangs next)
            assert time.monotonic() < deadline and proc.poll() is None, "the server made no env"
            time.sleep(0.05)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=0.5 + SHORT_EXIT_MARGIN_S + 20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == HARD_EXIT_STATUS, stderr
    assert "asked to shut down" in stderr and "an env call or the envs' build" in stderr, stderr


def test_sigterm_to_the_servers_whole_process_group_is_a_clean_shutdown(tmp_path: Path) -> None:
    """GNU timeout, ``kill -- -PGID`` and systemd (KillMode=control-group) send SIGTERM to the workers too:
    they leave it to the server, which drains, closes them and exits 0, with no error."""
    argv = [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--num-envs", "2"]
    argv += ["--vectorization", "async", "--port", "0", "--log-level", "info"]
    log = tmp_path / "server.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on "), log.read_text()
        with RemoteVectorEnv(line.removeprefix("listening on "), timeout=30) as envs:
            envs.reset(seed=0)
            envs.step(np.zeros(2, dtype=np.int64))
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()
    text = log.read_text()
    assert code == 0, text
    assert "ERROR" not in text and "stopped after 1 steps" in text, text


def test_a_process_that_leaves_its_async_workers_running_still_exits() -> None:
    """Workers ignore SIGTERM; multiprocessing's exit ends daemonic children with SIGTERM (its Popen's
    terminate, not the Process's) and then joins them without a timeout: that terminate is their kill too,
    or a script that never closes its env (an exception, a leak) would hang at exit."""
    result = _python(
        """
        from env_server.config import ServerConfig
        from env_server.envs import build_vector_env
        env = build_vector_env(ServerConfig(env="CartPole-v1", num_envs=2, vectorization="async"))
        env.reset(seed=0)
        print("left open")
        """,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["left", "open"]


def test_async_workers_that_a_failed_build_leaves_running_are_killed_not_waited_for(tmp_path: Path) -> None:
    """The workers ignore SIGTERM, which is how gymnasium and multiprocessing end them (Process.terminate):
    one env's failed construction in its worker must not leave the others running, nor the exit waiting."""
    (tmp_path / "fails_in_one_worker.py").write_text(
        textwrap.dedent(
            """
            import multiprocessing, os, time
            import gymnasium as gym
            import numpy as np

            class FailsInOneWorker(gym.Env):
                observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
                action_space = gym.spaces.Discrete(2)

                def __init__(self, folder):
                    if multiprocessing.parent_process() is None:
                        return  # (the server's own: made in the server's process)
                    try:
                        os.close(os.open(os.path.join(folder, "failed"), os.O_CREAT | os.O_EXCL))
                    except FileExistsError:  # (another worker's failed: this one runs on)
                        open(os.path.join(folder, str(os.getpid())), "w").close()
                        return
                    deadline = time.monotonic() + 30  # (fails once another has run on: else none may have)
                    while time.monotonic() < deadline and len(os.listdir(folder)) < 2:
                        time.sleep(0.01)
                    os.utime(os.path.join(folder, "failed"))  # (when it failed: the exit is timed from here)
                    raise RuntimeError("the simulator's licence server is down")
            """
        )
    )
    folder = tmp_path / "made"
    folder.mkdir()
    kwargs = json.dumps({"folder": str(folder)})
    argv = [sys.executable, "-m", "env_server", "--env", "fails_in_one_worker:FailsInOneWorker", "--env-kwargs"]
    argv += [kwargs, "--num-envs", "3", "--vectorization", "async", "--port", "0"]
    result = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=90)
    assert time.time() - (folder / "failed").stat().st_mtime < EXIT_MARGIN_S, result.stderr
    assert result.returncode != 0 and "the simulator's licence server is down" in result.stderr, result.stderr
    pids = [int(name) for name in os.listdir(folder) if name != "failed"]
    assert pids, "no worker ran on"  # (one at least: the failing one waits for it; others may be killed first)
    for pid in pids:  # (gone)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# --- gymnasium's private hook --------------------------------------------------------------------------


def test_gymnasiums_add_info_that_the_wide_infos_extend_is_still_there_with_its_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """_WideInfos overrides gymnasium's private VectorEnv._add_info: renamed, the override would silently
    never run; its arguments renamed, calls by keyword would miss it. Any further ones pass through."""
    add_info = getattr(gym.vector.VectorEnv, "_add_info", None)
    assert add_info is not None, "gymnasium's VectorEnv has no _add_info any more: see env_server.envs._WideInfos"
    assert list(inspect.signature(add_info).parameters)[:4] == ["self", "vector_infos", "env_info", "env_num"]

    passed: dict[str, Any] = {}

    def add_info_of_later_gymnasium(
        self: Any, vector_infos: dict[str, Any], env_info: dict[str, Any], env_num: int, *, new: int = 0
    ) -> dict[str, Any]:
        passed["new"] = new
        return add_info(self, vector_infos, env_info, env_num)

    monkeypatch.setattr(gym.vector.VectorEnv, "_add_info", add_info_of_later_gymnasium)
    envs = WideInfoSyncVectorEnv([lambda: gym.make("CartPole-v1")] * 2)
    try:
        infos = envs._add_info({}, {"x": 1}, 0, new=7)
    finally:
        envs.close()
    assert passed == {"new": 7} and infos["x"].tolist() == [1, 0]


# --- local servers, rendering, socket paths ----------------------------------------------------------


def test_local_servers_on_windows_say_what_to_do_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    assert (os.name == "nt") == local._ON_WINDOWS
    monkeypatch.setattr(local, "_ON_WINDOWS", True)
    with pytest.raises(ServerStartError) as err:
        local.LocalServers("CartPole-v1", 1, 1)
    message = str(err.value)
    assert message.startswith("local env servers need Linux or macOS"), message
    assert all(part in message for part in ("WSL2", "Docker", "env-server", "--servers", "--backend gym")), message


@pytest.mark.parametrize(("platform", "mujoco_gl"), [("linux", "egl"), ("darwin", None), ("win32", None)])
def test_headless_rendering_chooses_egl_for_mujoco_on_linux_only(
    monkeypatch: pytest.MonkeyPatch, platform: str, mujoco_gl: str | None
) -> None:
    """macOS and Windows have no DISPLAY whatever their screens, and MuJoCo refuses MUJOCO_GL=egl there."""
    for name in ("DISPLAY", "WAYLAND_DISPLAY", "MUJOCO_GL", "SDL_VIDEODRIVER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "platform", platform)
    video.headless_rendering()
    assert os.environ.get("MUJOCO_GL") == mujoco_gl
    assert os.environ.get("SDL_VIDEODRIVER") == "dummy"


def test_unix_socket_paths_are_held_to_linux_s_limit_on_linux_only() -> None:
    """sun_path: 108 bytes on Linux, 104 on macOS and the BSDs (NUL included); the shorter elsewhere."""
    assert _max_unix_path("linux") == 107
    assert [_max_unix_path(p) for p in ("darwin", "freebsd14", "openbsd7", "netbsd10", "sunos5")] == [103] * 5


def test_process_metrics_are_empty_without_proc(tmp_path: Path) -> None:
    """prometheus_client's ProcessCollector (the servers' process_* metrics) reads /proc: elsewhere it
    exports nothing (so the README says "Linux" of them)."""
    from prometheus_client import ProcessCollector

    assert list(ProcessCollector(proc=str(tmp_path / "no-proc"), registry=None).collect()) == []


def test_a_unix_socket_where_python_has_none_is_refused_saying_to_listen_on_tcp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(socket, "AF_UNIX")  # (as on Windows)
    with pytest.raises(OSError, match=r"this platform has no Unix sockets; listen on TCP \(--host, --port\)"):
        _check_socket_path(str(tmp_path / "env.sock"))


@pytest.mark.slow
def test_every_test_module_collects_without_torch(tmp_path: Path) -> None:
    """An env-server-only install has no torch (nor SB3): every test module still collects there, those that
    import the learner's torch code skipping as one, so that the server's tests run (conftest imported torch,
    and no test could). torch is hidden from the collecting process by a finder that refuses it."""
    collect = textwrap.dedent(
        """
        import sys

        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] in ("torch", "stable_baselines3"):
                    raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
                return None

        sys.meta_path.insert(0, NoTorch())
        import pytest

        sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "tests"]))
        """
    )
    root = Path(__file__).resolve().parent.parent
    env = {key: value for key, value in os.environ.items() if key != "PYTEST_ADDOPTS"}  # (-n, say: no xdist here)
    collected = subprocess.run(
        [sys.executable, "-c", collect], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    assert "hidden by the test" not in collected.stdout + collected.stderr  # (no module failed for want of torch)
    assert "tests/test_codec.py::" in collected.stdout and "tests/test_train.py::" not in collected.stdout


def test_a_run_dir_on_a_full_disk_is_refused_in_one_line_naming_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder's line left in the lock file's buffer by a full disk failed again as the file closed: an
    OSError traceback in place of the one line; the line is written unbuffered now, and a normal run's reads
    as before."""
    from learner import rundir

    with rundir.lock(tmp_path):
        assert (tmp_path / rundir.LOCK).read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with (
        pytest.raises(ValueError, match=r"^run dir .*: cannot write there \(No space left on device\)$"),
        rundir.lock(tmp_path),
    ):
        pass
