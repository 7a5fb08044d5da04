"""Every call on a server's envs runs on one thread, its env thread (building them, reset, quick and slow
steps, over gRPC and the step socket), as gymnasium's vector envs call theirs from one: envs whose state
is bound to a thread (an EGL context, an sqlite3 connection, an event loop of their own) work; and a
BaseException the envs raise (an asyncio.CancelledError of theirs, say) is the env's error, answered."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from learner import EnvCrashedError, RemoteVectorEnv
from tests.conftest import StartServers

pytestmark = pytest.mark.slow

# ThreadRecorder's steps 51-56 sleep 20 ms: past the 4th, the moving average of a step's time is over
# the server's INLINE_LIMIT_S (10 ms), and the server awaits them, the loop free.
_QUICK, _SLOW = 50, 6


@pytest.mark.parametrize("step_socket", [True, False], ids=["step-socket", "grpc"])
def test_building_resets_and_quick_and_slow_steps_run_on_one_thread(
    start_servers: StartServers, step_socket: bool
) -> None:
    (address,) = start_servers(
        "tests.thread_envs:ThreadRecorder",
        num_servers=1,
        envs_per_server=2,
        transport="unix",
        env_kwargs={"slow_from": _QUICK + 1, "slow_to": _QUICK + _SLOW},
    )
    threads: list[set[int]] = []

    def seen(infos: dict[str, Any]) -> None:
        threads.append({int(t) for key in ("made_on", "on") for t in infos[key]})

    with RemoteVectorEnv(address, step_socket=step_socket, timeout=60) as envs:
        assert bool(envs._clients[0].step_socket) is step_socket
        for _ in range(2):  # (the second reset is a quick one)
            seen(envs.reset(seed=0)[1])
        for _ in range(_QUICK + _SLOW + 5):
            seen(envs.step(np.zeros(2, dtype=np.int64))[4])
    assert all(len(t) == 1 for t in threads) and len(set().union(*threads)) == 1, threads


def _egl_renders() -> bool:
    """Whether MuJoCo renders with EGL here (a GPU's driver, or Mesa's)."""
    probe = "import tests.thread_envs as t; e = t.pixel_pendulum(); assert e.reset(seed=0)[0].mean() > 0"
    environ = {**os.environ, "MUJOCO_GL": "egl"}
    try:
        done = subprocess.run([sys.executable, "-c", probe], env=environ, capture_output=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def test_frames_rendered_with_egl_are_those_of_the_env(
    start_servers: StartServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pixel observations of a MuJoCo env under MUJOCO_GL=egl (the README's advice for headless rendering):
    the frames of every step, not only of the first reset and step, show the pendulum (a frame rendered
    where the EGL context is not current is all zeros, and raises nothing)."""
    pytest.importorskip("mujoco")
    if not _egl_renders():
        pytest.skip("MuJoCo cannot render with EGL here")
    monkeypatch.setenv("MUJOCO_GL", "egl")
    (address,) = start_servers("tests.thread_envs:pixel_pendulum", num_servers=1, envs_per_server=2, transport="unix")
    for step_socket in (True, False):
        with RemoteVectorEnv(address, step_socket=step_socket, timeout=60) as envs:
            obs, _ = envs.reset(seed=0)
            frames = [obs] + [envs.step(np.zeros((2, 1), np.float32))[0] for _ in range(20)]
        assert [bool(f[i].any()) for f in frames for i in range(2)] == [True] * 42, step_socket


@pytest.mark.parametrize("step_socket", [True, False], ids=["step-socket", "grpc"])
@pytest.mark.parametrize("env", ["SqliteEnv", "AsyncClientEnv"])
def test_envs_bound_to_their_thread_step_on_it(start_servers: StartServers, step_socket: bool, env: str) -> None:
    """An env with an sqlite3 connection made in reset, one that runs an event loop of its own in each
    step: neither works from the server's event loop (ProgrammingError "SQLite objects created in a thread
    can only be used in that same thread"; "asyncio.run() cannot be called from a running event loop")."""
    (address,) = start_servers(f"tests.thread_envs:{env}", num_servers=1, envs_per_server=2, transport="unix")
    with RemoteVectorEnv(address, step_socket=step_socket, timeout=60) as envs:
        for _ in range(2):
            envs.reset(seed=0)
            for t in range(1, 31):
                obs, _, _, _, infos = envs.step(np.zeros(2, dtype=np.int64))
                assert "env_error" not in infos, infos["env_error"]
                assert obs[:, 0].tolist() == [t, t]


@pytest.mark.parametrize("step_socket", [True, False], ids=["step-socket", "grpc"])
@pytest.mark.parametrize(
    ("error", "raise_at", "named"),
    [
        ("cancelled", 3, "CancelledError: the simulator's client was cancelled"),
        ("cancelled", 1, "CancelledError: the simulator's client was cancelled"),  # (a first step: awaited)
        ("own", 3, "EnvsOwnError: the simulator gave up"),
        ("exit", 3, "GeneratorExit: the simulator's stream ended"),
    ],
)
def test_a_base_exception_the_envs_raise_is_their_error_and_the_server_serves_on(
    start_servers: StartServers, step_socket: bool, error: str, raise_at: int, named: str
) -> None:
    """Raised by the vector env as a whole (no IsolateErrors catches it per env): the learner gets an
    EnvCrashedError that names it (not a timeout, nor a step socket that broke), and resets and steps on."""
    (address,) = start_servers(
        "tests.thread_envs:ThreadEnvsRaising-v0",
        num_servers=1,
        envs_per_server=2,
        transport="unix",
        env_kwargs={"raise_at": raise_at, "error": error},
        server_args=["--vectorization", "vector_entry_point"],
    )
    # (a long timeout: a server that does not answer shows as a timeout error, not a crash)
    with RemoteVectorEnv(address, step_socket=step_socket, timeout=60) as envs:
        for _ in range(2):
            envs.reset(seed=0)
            for _ in range(raise_at - 1):
                envs.step(np.zeros(2, dtype=np.int64))
            with pytest.raises(EnvCrashedError, match=f"the env raised in step: {named}"):
                envs.step(np.zeros(2, dtype=np.int64))
        obs, _ = envs.reset(seed=0)
        assert obs.tolist() == [[0.0], [0.0]]
        if raise_at > 1:
            assert envs.step(np.zeros(2, dtype=np.int64))[0].tolist() == [[1.0], [1.0]]


_SIGNAL_AFTER_THE_CALL = """
import faulthandler, signal
from env_server.service import EnvThread

signal.signal(signal.SIGINT, signal.default_int_handler)
thread = EnvThread("env")

def env_call():
    signal.raise_signal(signal.SIGINT)  # (its handler runs in the main thread, once the call is done)
    return "done"

faulthandler.dump_traceback_later(60, exit=True)
try:
    thread.call(env_call)
except KeyboardInterrupt:
    print("interrupted, not stuck")
thread.shutdown()
"""


def test_a_signal_handler_raising_as_a_call_returns_does_not_leave_the_loop_waiting_for_good() -> None:
    """A handler's exception raised just after the call's lock was taken: the wait for the call's end took the
    lock again, held by itself (the review's repro: the event loop's thread blocked for good)."""
    proc = subprocess.run([sys.executable, "-c", _SIGNAL_AFTER_THE_CALL], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "interrupted, not stuck", proc.stderr


def test_envs_not_bound_to_a_thread_step_quickly_on_the_loop_and_bound_ones_are_told_how_to_say_so(
    start_servers: StartServers,
) -> None:
    """The hand-over to the env thread and back cost 2x4 CartPole ~30 % of its steps/s: only envs that render or
    say so get it. One that needs it without saying so fails loudly, told how to say so."""
    (address,) = start_servers(
        "tests.thread_envs:ThreadRecorder", num_servers=1, envs_per_server=1, env_kwargs={"one_thread": False}
    )
    with RemoteVectorEnv(address, timeout=60) as envs:
        made_on = int(envs.reset(seed=0)[1]["made_on"][0])
        for _ in range(10):
            infos = envs.step(np.zeros(1, dtype=np.int64))[4]
    assert int(infos["on"][0]) != made_on  # (quick steps on the loop's thread, not the env thread that built it)
    (address,) = start_servers(
        "tests.thread_envs:SqliteEnv", num_servers=1, envs_per_server=1, env_kwargs={"one_thread": False}
    )
    with RemoteVectorEnv(address, timeout=60) as envs:
        envs.reset(seed=0)
        with pytest.raises(EnvCrashedError, match=r"set metadata\['envfleet_one_thread'\] = True in its class"):
            for _ in range(10):
                envs.step(np.zeros(1, dtype=np.int64))


def test_quick_steps_stay_off_the_loop_for_a_while_after_a_slow_one(start_servers: StartServers) -> None:
    """An env slow now and then (a level loaded at each episode's start) holds the loop up at its first slow step
    only: the steps after it run on the env thread, the loop free, though the moving average of a step's time
    is back under INLINE_LIMIT_S ~5 steps after a 0.15-s one."""
    (address,) = start_servers(
        "tests.thread_envs:ThreadRecorder",
        num_servers=1,
        envs_per_server=1,
        env_kwargs={"one_thread": False, "slow_from": 11, "slow_to": 11, "slow_s": 0.15},
    )
    with RemoteVectorEnv(address, timeout=60) as envs:
        made_on = int(envs.reset(seed=0)[1]["made_on"][0])
        on = [int(envs.step(np.zeros(1, dtype=np.int64))[4]["on"][0]) for _ in range(40)]
    assert on[9] != made_on, "quick steps before the slow one ran on the env thread"
    assert on[11:] == [made_on] * 29, [step for step, thread in enumerate(on, 1) if thread != made_on]
