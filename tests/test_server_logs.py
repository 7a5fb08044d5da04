"""What an env server's log says, on real ``env-server`` subprocesses serving a user's env from a module of
its own: an env call that runs long (warned of once, saying where it is stuck, and its end; the exit of
--hang-timeout says where too), an env that raises at every step (the first few errors one by one, naming the
env, then a count), a start that fails under ``--log-format json`` (a JSON record), the text format's times
(with their UTC offset), and the step socket's spin wait (at debug)."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from env_server import codec
from env_server.config import ServerConfig
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from env_server.server import HUNG_EXIT_STATUS, SLOW_CALL_S, START_FAILED_STATUS, _slow_after
from env_server.tuning import TextLogFormatter
from tests.servers import ServerSubprocess

# A user's envs, in a module of their own (as `env-server --env userenvs:SlowStep` serves them).
USER_ENVS = '''
import time

import gymnasium as gym
import numpy as np


class SlowStep(gym.Env):
    """Quick steps, but for step 3 of the second env made in its process (env 1 of a sync server), which
    sleeps ``seconds``."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)
    made = 0

    def __init__(self, seconds=2.5):
        self.index, SlowStep.made = SlowStep.made, SlowStep.made + 1
        self.seconds, self.steps = seconds, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        self.steps += 1
        if self.index == 1 and self.steps == 3:
            time.sleep(self.seconds)
        return np.zeros(1, np.float32), 1.0, False, False, {}


class RaisingStep(SlowStep):
    """Every step raises."""

    def step(self, action):
        raise ValueError("the simulator lost its state")
'''

# env-server's main(), with module constants set first (the slow-call threshold, the summary interval): argv
# [1] is a JSON object {"module.NAME": value}.
_PATCHED_MAIN = """
import importlib, json, sys
from env_server.tuning import prefer_fast_grpc_core
prefer_fast_grpc_core()  # (before grpc is imported, as env_server.__main__.main does it)
for name, value in json.loads(sys.argv.pop(1)).items():
    module, _, attribute = name.rpartition(".")
    setattr(importlib.import_module(module), attribute, value)
from env_server.__main__ import main
sys.exit(main())
"""

# A log line of the text format: local time with its UTC offset, level, logger: message.
_TEXT_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}[+-]\d{4} (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: ")


@pytest.fixture
def folder() -> Iterator[Path]:
    """A folder holding the user's env module (``userenvs``) and the server's log."""
    with tempfile.TemporaryDirectory(prefix="ef-logs-") as path:
        (Path(path) / "userenvs.py").write_text(USER_ENVS)
        yield Path(path)


class _Server(ServerSubprocess):
    """An env-server subprocess serving ``userenvs`` from ``folder`` on a free loopback port, its log in
    ``folder``/server.log, ready once made; ``patches``: module constants set before its main() runs;
    ``environ``: added to its environment."""

    def __init__(
        self,
        folder: Path,
        *args: str,
        patches: dict[str, float] | None = None,
        environ: dict[str, str] | None = None,
    ) -> None:
        pythonpath = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": pythonpath, **(environ or {})}
        argv = [sys.executable, "-c", _PATCHED_MAIN, json.dumps(patches or {}), "--host", "127.0.0.1", "--port", "0"]
        super().__init__([*argv, *args], folder / "server.log", env=env)
        self.ready()


class _Learner:
    """A learner's calls, by hand: a session, a reset, and steps of ``num_envs`` envs."""

    def __init__(self, address: str, num_envs: int) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.EnvServiceStub(self.channel)
        self.session = self.stub.Handshake(pb.HandshakeRequest(client_name="logs"), timeout=30).session_id
        self.stub.Reset(pb.ResetRequest(session_id=self.session), timeout=30)
        self.request = pb.StepRequest(session_id=self.session)
        codec.encode_value(np.zeros(num_envs, dtype=np.int64), self.request.actions, "actions")

    def step(self, timeout: float = 30) -> pb.StepResponse:
        return self.stub.Step(self.request, timeout=timeout)

    def close(self) -> None:
        self.channel.close()


def _lines(text: str, fragment: str) -> list[str]:
    return [line for line in text.splitlines() if fragment in line]


# -- an env call that runs long ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_long_env_step_is_warned_of_once_saying_where_it_is_stuck_and_its_end_is_logged(folder: Path) -> None:
    """Without --hang-timeout, a step of 2.5 s (of a threshold of 0.5 s here: 10 s by default) is one warning
    naming the env and the line it is stuck at, not one per look of the watchdog; then an info line on its
    end. (The server said nothing for as long as a step ran.)"""
    server = _Server(
        folder, "--env", "userenvs:SlowStep", "--num-envs", "2", patches={"env_server.server.SLOW_CALL_S": 0.5}
    )
    learner = _Learner(server.address, 2)
    try:
        for _ in range(3):
            learner.step()
        text = server.wait_for("the envs' step returned after")
        slow = _lines(text, "the envs' step has run for")  # (the first reset, on a loaded machine, may be slow too)
        assert len(slow) == 1, slow
        assert re.search(
            r" WARNING env_server\.server: the envs' step has run for \d+\.\d s and not returned; it is stuck in env 1 "
            r"of 2, at userenvs\.py:\d+ in step \(time\.sleep\(self\.seconds\)\), from \S*env_server/isolation\.py:\d+ "
            r"in step, from ",
            slow[0],
        ), slow[0]
        assert "with --hang-timeout S, it would exit after S s" in slow[0], slow[0]
        assert re.search(r" INFO env_server\.service: the envs' step returned after [2-9]\.\d s$", text, re.M), text
        learner.step()  # (quick again: nothing more said)
        assert len(_lines(server.text(), "the envs' step has run for")) == 1
    finally:
        learner.close()
        server.stop()


@pytest.mark.slow
def test_the_hang_timeouts_exit_says_where_the_env_call_is_stuck(folder: Path) -> None:
    server = _Server(
        folder,
        "--env",
        "userenvs:SlowStep",
        "--num-envs",
        "2",
        "--hang-timeout",
        "1",
        "--env-kwargs",
        '{"seconds": 60}',
    )
    learner = _Learner(server.address, 2)
    try:
        for _ in range(2):
            learner.step()
        with pytest.raises(grpc.RpcError):
            learner.step(timeout=30)
        assert server.proc.wait(timeout=30) == HUNG_EXIT_STATUS
        (exit_line,) = _lines(server.text(), "longer than --hang-timeout 1 s: exiting (status 3)")
        assert re.search(
            r"neither stopped nor waited out\); it is stuck in env 1 of 2, at userenvs\.py:\d+ in step "
            r"\(time\.sleep\(self\.seconds\)\), from \S*env_server/isolation\.py:\d+ in step",
            exit_line,
        ), exit_line
    finally:
        learner.close()
        server.stop()


# -- an env that raises at every step ---------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("vectorization", ["sync", "async"])
def test_env_errors_name_their_env_and_only_the_first_few_are_logged_one_by_one(
    folder: Path, vectorization: str
) -> None:
    """4 envs raising at every step: 3 errors with their tracebacks per process (a sync server's; under async
    each worker's, of its one env), each naming its env, then a line now and then (every 3 s here, a minute
    by default) counting those left out. (It was 3 per env, ~100 lines in under a second, naming no env.)"""
    server = _Server(
        folder,
        "--env",
        "userenvs:RaisingStep",
        "--num-envs",
        "4",
        "--vectorization",
        vectorization,
        patches={"env_server.isolation._SUMMARY_EVERY_S": 3.0},  # (far more than 10 steps take, loaded too)
    )
    learner = _Learner(server.address, 4)
    try:
        # (an env that raised is reset at its next step, under next-step autoreset: each env raises at steps
        # 1, 3, ..., 9, 5 times, then at step 11, past the interval, once more: a count is due)
        for _ in range(10):
            learner.step()
        time.sleep(3.2)
        learner.step()
        text = server.wait_for("env errors in the last")
        one_by_one = _lines(text, "raised in step; its episode ends and it is reset")
        tracebacks = [line for line in text.splitlines() if line == "ValueError: the simulator lost its state"]
        if vectorization == "sync":
            assert [line.split(": ", 1)[1] for line in one_by_one] == [
                f"env {i} of 4 raised in step; its episode ends and it is reset" for i in range(3)
            ], one_by_one
            assert len(tracebacks) == 3, text
            envs, left_out, errors = "0", 5 * 4 + 1 - 3, 5 * 4 + 1
        else:
            named = sorted(line.split(": ", 1)[1].split(" raised")[0] for line in one_by_one)
            assert named == sorted(f"env {i} of 4" for i in range(4) for _ in range(3)), one_by_one
            assert len(tracebacks) == 4 * 3, text
            envs, left_out, errors = "[0-3]", 5 + 1 - 3, 5 + 1
        summaries = _lines(text, "env errors in the last")
        assert summaries, text
        for summary in summaries:
            assert re.search(
                rf"WARNING env_server\.isolation: {left_out} env errors in the last \d+ s not logged one by one \(only "
                rf"the first 3 are, with their tracebacks; {errors} in all so far\); the last: env {envs} of 4: step: "
                r"ValueError: the simulator lost its state$",
                summary,
            ), summary
    finally:
        learner.close()
        server.stop()


# -- a start that fails, and the log's format -------------------------------------------------------------------


@pytest.mark.slow
def test_a_failed_start_under_log_format_json_is_a_json_record(folder: Path) -> None:
    argv = [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--env-kwargs", '{"nosuch": 1}', "--port", "0"]
    result = subprocess.run([*argv, "--log-format", "json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == START_FAILED_STATUS, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines and all(line.startswith("{") for line in lines), lines
    last = json.loads(lines[-1])
    assert (last["level"], last["logger"]) == ("ERROR", "env_server"), last
    assert last["message"].startswith("cannot make env 'CartPole-v1' with kwargs {'nosuch': 1}: "), last
    assert last["time"].endswith("Z"), last
    # (the text format's stays the line argparse's errors have, which learners look for)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.stderr.strip().splitlines()[-1] == f"env-server: error: {last['message']}"


@pytest.mark.slow
def test_text_log_lines_carry_their_utc_offset_and_the_spin_wait_is_said_at_debug(folder: Path) -> None:
    """TZ JST-9 (Japan's time, +0900 all year; a POSIX rule, which needs no time zone database): a learner
    and a server in other time zones (a container's UTC, a host's) can line up their lines."""
    socket_path = folder / "env.sock"
    server = _Server(
        folder,
        "--env",
        "userenvs:SlowStep",
        "--unix-socket",
        str(socket_path),
        "--spin-wait-ms",
        "0.5",
        "--log-level",
        "debug",
        environ={"TZ": "JST-9"},
    )
    try:
        text = server.wait_for("serving 1 x userenvs:SlowStep")
        starts = [line for line in text.splitlines() if line[:4].isdigit()]
        assert starts and all(_TEXT_LINE.match(line) and line[23:28] == "+0900" for line in starts), starts
        (spin,) = _lines(text, "waiting for a learner's next step awake")
        assert " DEBUG env_server.server: step socket: waiting for a learner's next step awake, up to 0.5 ms" in spin
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("tz", "created", "expected"),
    [
        ("JST-9", 1796493121.25, "2026-12-06 02:52:01,250+0900"),
        ("UTC0", 1796493121.9996, "2026-12-05 17:52:01,999+0000"),  # (not rounded up to the next second)
        # New York's rule: daylight saving time in July (-0400), not in December (-0500)
        ("EST5EDT,M3.2.0,M11.1.0", 1783086721.0, "2026-07-03 09:52:01,000-0400"),
        ("EST5EDT,M3.2.0,M11.1.0", 1796493121.0, "2026-12-05 12:52:01,000-0500"),
    ],
)
def test_the_text_formats_time_is_local_with_the_offset_of_its_moment(
    monkeypatch: pytest.MonkeyPatch, tz: str, created: float, expected: str
) -> None:
    monkeypatch.setenv("TZ", tz)
    time.tzset()
    try:
        record = logging.LogRecord("envfleet.test", logging.INFO, __file__, 1, "serving %d", (2,), None)
        record.created, record.msecs = created, int((created - int(created)) * 1000) + 0.0  # (as logging makes them)
        assert TextLogFormatter().format(record) == f"{expected} INFO envfleet.test: serving 2"
    finally:
        monkeypatch.undo()
        time.tzset()


def test_an_env_whose_calls_all_take_long_is_warned_of_only_past_ten_times_their_usual_time() -> None:
    """(Else an env whose every step takes 12 s, its learner given a longer --timeout, was warned of at each.)"""
    for usual, after in ((0.0, SLOW_CALL_S), (0.5, SLOW_CALL_S), (12.0, 120.0)):
        service = SimpleNamespace(call_kind="step", usual_seconds={"step": usual}.__getitem__)
        assert _slow_after(service) == pytest.approx(after)  # type: ignore[arg-type]


def test_the_watchdog_goes_on_where_it_cannot_tell_where_an_env_call_is_stuck(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its log lines' decoration must never end the watchdog thread (which exits a hung server)."""
    import asyncio
    from types import SimpleNamespace

    from env_server import server as server_module

    def unreadable(thread_id: int) -> str:
        raise FileNotFoundError("the working directory was removed")

    monkeypatch.setattr(server_module, "_stuck_at", unreadable)
    loop = asyncio.new_event_loop()
    try:
        watchdog = server_module._Watchdog(ServerConfig(env="CartPole-v1"), loop, asyncio.Event())
        assert watchdog._stuck(SimpleNamespace(call_thread=1)) == ""  # type: ignore[arg-type]
    finally:
        loop.close()
