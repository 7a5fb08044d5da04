"""The server's watchdog: what happens while an env call hangs on the event loop (a quick env's steps
run there), where nothing the loop would do can run: --hang-timeout, SIGTERM, a learner's local
servers starting a hung one again; and, at the server's start and end, envs whose observations are
too large to send and an env whose close raises."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from env_server import codec
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from env_server.server import EXIT_MARGIN_S, HARD_EXIT_STATUS, HUNG_EXIT_STATUS, _let_calls_end
from learner import RemoteVectorEnv
from learner.config import Args
from learner.envs import FleetSpec, fleet_spec, open_fleet
from learner.local import LocalServers
from tests.conftest import needs_proc, parent_of
from tests.test_readme_claims_server import SHORT_EXIT_MARGIN_S
from tests.test_readme_claims_server import _server as serve_logged

HANG = "tests.hang_envs:HangLater"


def _server(tmp_path: Path, *args: str, exit_margin_s: float | None = None) -> tuple[subprocess.Popen[str], str, Path]:
    """An env-server subprocess of 1 env (unless ``args`` say otherwise) on a Unix socket; ``exit_margin_s``:
    its watchdog's, instead of EXIT_MARGIN_S."""
    return serve_logged(tmp_path, "--num-envs", "1", *args, unix=True, exit_margin_s=exit_margin_s)


def _hang_a_step_on_the_loop(address: str) -> tuple[grpc.Channel, grpc.Future]:
    """Two quick steps (the second runs on the server's loop: the first was timed), then a third that
    hangs there; the third's call, under way."""
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.EnvServiceStub(channel)
    session = stub.Handshake(pb.HandshakeRequest(client_name="watchdog"), timeout=30).session_id
    stub.Reset(pb.ResetRequest(session_id=session), timeout=30)
    request = pb.StepRequest(session_id=session)
    codec.encode_value(np.zeros(1, dtype=np.int64), request.actions, "actions")
    for _ in range(2):
        stub.Step(request, timeout=30)
    return channel, stub.Step.future(request, timeout=120)


def _hang_timeouts() -> list[str]:
    """The --hang-timeout of each env server this process started ("none" where not given)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().decode(errors="replace").split("\0")  # (another's may not be UTF-8)
        except OSError:
            continue
        ours = "--parent-pid" in argv and argv[argv.index("--parent-pid") + 1] == str(os.getpid())
        if "env_server" in argv and ours and parent_of(int(cmdline.parent.name)) == os.getpid():
            found.append(argv[argv.index("--hang-timeout") + 1] if "--hang-timeout" in argv else "none")
    return found


def _wait(proc: subprocess.Popen[str], within: float) -> tuple[int, float]:
    start = time.monotonic()
    try:
        code = proc.wait(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        pytest.fail(f"env-server still running {within:g} s later")
    return code, time.monotonic() - start


def test_a_server_whose_env_step_hangs_past_the_hang_timeout_exits_saying_so(tmp_path: Path) -> None:
    proc, address, log = _server(tmp_path, "--env", HANG, "--hang-timeout", "1")
    channel, call = _hang_a_step_on_the_loop(address)
    try:
        code, seconds = _wait(proc, 30)
        assert code == HUNG_EXIT_STATUS and seconds < 10, (code, seconds)
        text = log.read_text()
        assert "the envs' step has run for" in text and "longer than --hang-timeout 1 s: exiting (status 3)" in text
        with pytest.raises(grpc.RpcError) as err:
            call.result(timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.slow
def test_a_server_held_up_longer_than_its_hang_timeout_does_not_take_its_env_step_for_hung(tmp_path: Path) -> None:
    """SIGSTOP (as `docker pause`, a paused VM, a debugger) for 5 s during a step, with --hang-timeout 4: the
    time the whole process was held up is not the env's; the server logs it and serves on (it exited, status
    3, as hung)."""
    gate = tmp_path / "gate"
    kwargs = json.dumps({"gate": str(gate), "at": 3})
    proc, address, log = _server(tmp_path, "--env", "tests.envs:GateEnv", "--env-kwargs", kwargs, "--hang-timeout", "4")
    channel, call = _hang_a_step_on_the_loop(address)  # (its third step waits at the gate)
    try:
        deadline = time.monotonic() + 30
        while not gate.exists():
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.01)
        proc.send_signal(signal.SIGSTOP)
        time.sleep(5)  # (the step's own time, before and after, stays well under 4 s on a loaded machine)
        proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while "this server was held up for" not in log.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.01)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1)  # (four turns of the watchdog)
        gate.unlink()
        call.result(timeout=30)
        assert proc.poll() is None and "--hang-timeout" not in log.read_text(), log.read_text()
    finally:
        channel.close()
        proc.send_signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.slow
def test_a_step_hung_in_native_code_that_holds_the_gil_is_no_hold_up_of_the_server(tmp_path: Path) -> None:
    """The watchdog wakes late at each stretch the env's native code holds the GIL (2 s here), as it does when the
    process is stopped; but the process works meanwhile: that time is the step's (taken for hold-ups, a step so
    hung ran past --hang-timeout, and its warning, for as long as its stretches last)."""
    proc, address, log = _server(tmp_path, "--env", "tests.hang_envs:HangHoldingTheGil", "--hang-timeout", "0")
    channel, _ = _hang_a_step_on_the_loop(address)
    try:
        # (three stretches: each a watchdog turn 2 s late; a hold-up would be logged at the first)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=6)
        assert "held up" not in log.read_text(), log.read_text()
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.slow
def test_sigterm_ends_a_server_whose_env_step_hangs_on_its_event_loop(tmp_path: Path) -> None:
    """The loop cannot drain: the signal handler and the watchdog thread still run, and the process
    exits (status 1, not a clean shutdown) once the grace period and the exit margin are up (EXIT_MARGIN_S;
    here SHORT_EXIT_MARGIN_S)."""
    margin = SHORT_EXIT_MARGIN_S
    proc, address, log = _server(tmp_path, "--env", HANG, "--grace", "0.5", exit_margin_s=margin)
    channel, _ = _hang_a_step_on_the_loop(address)
    try:
        time.sleep(0.5)  # (the step is on the loop, hanging)
        proc.send_signal(signal.SIGTERM)
        code, seconds = _wait(proc, 0.5 + margin + 15)
        assert code == HARD_EXIT_STATUS and seconds >= 0.5 + margin - 1, (code, seconds)
        assert "asked to shut down" in log.read_text() and "(step, running for" in log.read_text()
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.slow
def test_a_second_ctrl_c_during_the_drain_exits_at_once_a_double_tap_does_not(tmp_path: Path) -> None:
    """A step hangs, so the drain would wait out its grace period and the exit margin (here 30 s and
    10 s): a Ctrl-C pressed twice in a hurry is one, and the drain goes on; a second one later exits at
    once (status 1), saying so."""
    proc, address, log = _server(tmp_path, "--env", HANG, "--grace", "30")
    channel, _ = _hang_a_step_on_the_loop(address)
    try:
        time.sleep(0.5)  # (the step is on the loop, hanging)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.03)  # (well within the 0.5 s window, stalls of a loaded machine included)
        proc.send_signal(signal.SIGINT)  # (the same press)
        time.sleep(1.0)
        assert proc.poll() is None, log.read_text()
        proc.send_signal(signal.SIGINT)
        code, seconds = _wait(proc, 10)
        assert code == 1 and seconds < 5, (code, seconds)
        assert "second Ctrl-C: exiting now, without waiting for the calls in flight" in log.read_text()
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.mark.slow
def test_local_servers_start_a_server_whose_env_hung_again_and_its_envs_rejoin(tmp_path: Path) -> None:
    flag = tmp_path / "hung-once"
    servers = LocalServers(HANG, 1, 1, env_kwargs={"hang_at": 3, "once": str(flag)}, hang_timeout=1)
    envs = RemoteVectorEnv(servers.addresses, timeout=20, fault_tolerant=True, give_up_after=60)
    try:
        envs.reset(seed=0)
        actions = np.zeros(1, dtype=np.int64)
        for _ in range(2):
            envs.step(actions)
        _, _, _, truncations, infos = envs.step(actions)  # hangs; the server exits after 1 s
        assert flag.exists() and infos["env_unavailable"].all() and truncations.all()  # (its episode cut)
        deadline = time.monotonic() + 60
        while not infos.get("env_rejoined", np.zeros(1, bool)).any():
            assert time.monotonic() < deadline, "the restarted server's env did not rejoin within 60 s"
            _, _, _, _, infos = envs.step(actions)
        assert envs.fault_stats().server_restarts == 1
        _, rewards, _, _, infos = envs.step(actions)
        assert rewards.tolist() == [1.0] and not infos.get("env_unavailable", np.zeros(1, bool)).any()
    finally:
        envs.close()
        servers.close()


def test_local_servers_pass_their_hang_timeout_unless_told_otherwise() -> None:
    cmds = []
    for kwargs in ({}, {"hang_timeout": 0}, {"server_args": ["--hang-timeout", "5"]}):
        servers = LocalServers("CartPole-v1", 1, 1, **kwargs)
        try:
            cmds.append(servers._children.cmds[0])
        finally:
            servers.close()
    default, off, given = cmds
    assert default[default.index("--hang-timeout") + 1] == "60" and "--hang-timeout" not in off
    assert given[len(given) - 1 - given[::-1].index("--hang-timeout") + 1] == "5"  # (the last one counts)


def test_an_env_whose_close_raises_still_has_the_server_clean_up_and_exit_1(tmp_path: Path) -> None:
    proc, _, log = _server(tmp_path, "--env", HANG, "--env-kwargs", '{"raise_in_close": true}')
    proc.send_signal(signal.SIGTERM)
    code, _ = _wait(proc, 30)
    text = log.read_text()
    assert code == HARD_EXIT_STATUS, text
    assert "the envs' close raised" in text and "RuntimeError: the simulator's connection could not be closed" in text
    assert "stopped after 0 steps (the envs' close raised: see above)" in text
    assert not (tmp_path / "env.sock").exists()  # (the rest of the teardown ran)


@pytest.mark.slow
def test_envs_whose_observations_make_answers_larger_than_a_message_are_refused_at_start(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "env_server", "--env", "tests.hang_envs:HugeObservations", "--port", "0"]
    for extra, message in (
        (["--num-envs", "4"], "each env's observation takes 16,777,216 bytes, so an answer would take 67,108,864"),
        (
            ["--num-envs", "2", "--autoreset-mode", "SameStep"],
            "each env's observation and final observation (same-step autoreset) take 33,554,432 bytes",
        ),
    ):
        done = subprocess.run([*argv, *extra], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and done.stdout == "", done
        assert "cannot serve" in done.stderr and message in done.stderr, done.stderr
        assert "over the 66,060,288 bytes a message leaves them (64 MiB less 1 MiB for the rest)" in done.stderr
        assert f"serve at most {3 if extra[1] == '4' else 1} envs per server (--num-envs)" in done.stderr
    # What it says fits, serves: 3 envs' observations (48 MiB) and the rest of the answer.
    proc, address, _ = _server(tmp_path, "--env", "tests.hang_envs:HugeObservations", "--num-envs", "3")
    try:
        envs = RemoteVectorEnv(address, timeout=60)
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (3, 16, 1024, 1024)
        envs.close()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@needs_proc
def test_learner_commands_local_servers_wait_for_an_env_call_as_long_as_the_learner_would() -> None:
    """learner train's --timeout/--reset-timeout: a reset the learner would wait 100 s for is no hang."""
    for reset_timeout, expected in ((None, "60"), (100.0, "200")):
        spec = FleetSpec(env="CartPole-v1", num_servers=1, envs_per_server=1, reset_timeout=reset_timeout)
        with open_fleet(spec):
            assert _hang_timeouts() == [expected]


@needs_proc
@pytest.mark.slow
def test_learner_train_hang_timeout_reaches_the_servers_it_starts(caplog: pytest.LogCaptureFixture) -> None:
    """--hang-timeout S as given (a warning where it is below the learner's own deadline); 0: none."""
    for given, timeout, passed, warned in (
        (90.0, 10.0, ["90"], False),
        (5.0, 10.0, ["5"], True),
        (0.0, 1.0, ["none"], False),
    ):
        caplog.clear()
        args = Args(num_servers=1, envs_per_server=1, hang_timeout=given, timeout=timeout)
        with open_fleet(fleet_spec(args)):
            assert _hang_timeouts() == passed
        assert ("below the learner's own deadline" in caplog.text) == warned, caplog.text
    with pytest.raises(ValueError, match=r"--hang-timeout: expected a value >= 0, got -1.0"):
        Args(hang_timeout=-1.0)
    with pytest.raises(ValueError, match="--hang-timeout: configures the env servers this command starts"):
        Args(servers="localhost:1", hang_timeout=5.0)


@needs_proc
@pytest.mark.slow
def test_a_signal_sent_to_an_async_worker_alone_leaves_its_server_serving(tmp_path: Path) -> None:
    """--vectorization async's workers are forked from the server after it took SIGINT/SIGTERM over: a
    SIGINT or SIGTERM to a worker (Ctrl-C reaches the whole process group; GNU timeout's and systemd's
    SIGTERM, the whole group or cgroup) is left to the server, which still serves and still stops on its
    own SIGTERM; a SIGKILL ends that worker only (its envs fail)."""
    proc, address, log = _server(tmp_path, "--env", "CartPole-v1", "--num-envs", "2", "--vectorization", "async")
    try:
        workers = [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
        assert len(workers) >= 2, workers  # (the envs' workers; a forkserver's helper too, where one runs)
        for worker in workers:
            os.kill(worker, signal.SIGINT)
            os.kill(worker, signal.SIGTERM)
        time.sleep(1.0)
        assert proc.poll() is None, log.read_text()
        envs = RemoteVectorEnv(address, timeout=30)
        envs.reset(seed=0)
        _, rewards, *_ = envs.step(np.zeros(2, dtype=np.int64))
        assert rewards.tolist() == [1.0, 1.0]
        envs.close()
        os.kill(workers[0], signal.SIGKILL)
        time.sleep(1.0)
        assert proc.poll() is None, log.read_text()
        proc.send_signal(signal.SIGTERM)
        code, seconds = _wait(proc, 30)
        # (closing the envs finds the worker gone: said, and status 1; the other worker killed, not waited for)
        assert seconds < EXIT_MARGIN_S, seconds
        assert code == HARD_EXIT_STATUS and "shutting down" in log.read_text(), log.read_text()
        assert "stopped after 1 steps (the envs' close raised: see above)" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_the_teardown_lets_grpcs_tasks_of_ended_calls_finish_and_leaves_other_tasks_alone() -> None:
    """A call the stopped gRPC server has just ended (a Hold stream, a Release sent as the server
    stopped) may still have its task waiting for a turn of the loop; asyncio.run would cancel it, and
    gRPC logs that as "Exception not handled by _handle_exceptions" with a traceback (seen once in CI,
    forwarded by a learner). The teardown waits for gRPC's call tasks (their coroutines' names) only."""

    async def _schedule_rpc_coro() -> None:  # (named as gRPC's own)
        for _ in range(5):
            await asyncio.sleep(0)

    async def callers_own() -> None:
        await asyncio.sleep(3600)

    async def main() -> tuple[bool, bool, float]:
        grpcs, others = asyncio.create_task(_schedule_rpc_coro()), asyncio.create_task(callers_own())
        start = time.monotonic()
        await _let_calls_end()
        waited = time.monotonic() - start
        done = grpcs.done(), others.done()
        others.cancel()
        return *done, waited

    grpcs_done, others_done, waited = asyncio.run(main())
    assert grpcs_done and not others_done
    assert waited < 0.5


def test_an_exit_margin_that_is_no_number_of_seconds_is_refused_before_anything_starts() -> None:
    from env_server.config import ServerConfig
    from env_server.server import serve

    for margin in (-1.0, "10", True):
        with pytest.raises(ValueError, match=r"exit_margin_s: expected a number of seconds >= 0, got "):
            asyncio.run(serve(ServerConfig(env="CartPole-v1", port=0), print, exit_margin_s=margin))  # type: ignore[arg-type]
