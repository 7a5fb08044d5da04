"""env-server --metrics-port, continued: malformed requests counted, metrics served while the envs are
built, envfleet_ready, and sessions counted by how they ended."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from env_server.metrics import SESSION_END_REASONS
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from learner import RemoteVectorEnv
from tests.conftest import ServerProcess, SpawnServer
from tests.test_metrics import scrape

GARBAGE = b"\xff\xff garbage"


def _metrics_url(server: ServerProcess) -> str:
    match = re.search(r"Prometheus metrics on (http://\S+/metrics)", server.logs())
    assert match is not None, server.logs()
    return match.group(1)


def _wait_until(condition: Callable[[], bool], what: str, within: float = 20.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {within:g} s"
        time.sleep(0.05)


def _raw(channel: grpc.Channel, method: str, *, streaming: bool = False) -> Callable[..., Any]:
    """A call of ``method`` that sends bytes as they are (no protobuf on the client's side)."""
    make = channel.unary_stream if streaming else channel.unary_unary
    return make(method, request_serializer=None, response_deserializer=None)


def _errors(samples: dict[str, float], code: str) -> dict[str, float]:
    """``envfleet_errors_total`` of ``code``, by method, where not 0."""
    prefix = f"envfleet_errors_total{{code={code},method="
    return {key[len(prefix) : -1]: n for key, n in samples.items() if key.startswith(prefix) and n}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- malformed and oversize requests ---------------------------------------------------------------


def test_malformed_requests_are_counted_and_logged(spawn_server: SpawnServer) -> None:
    server = spawn_server("CartPole-v1", 1, "--metrics-port", "0", "--log-level", "info")
    url = _metrics_url(server)
    methods = ("GetSpec", "Handshake", "Reset", "Step", "Release", "Hold")
    with grpc.insecure_channel(server.address) as channel:
        for method in methods:
            call = _raw(channel, f"/envfleet.v1.EnvService/{method}", streaming=method == "Hold")
            with pytest.raises(grpc.RpcError) as info:
                result = call(GARBAGE, timeout=10)
                if method == "Hold":
                    list(result)  # (a response stream: the status comes as it ends)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, info.value.details())
            assert "not a valid protobuf message" in (info.value.details() or ""), info.value.details()
        for _ in range(3):  # (more of one kind: counted each, logged once per 10 s)
            with pytest.raises(grpc.RpcError):
                _raw(channel, "/envfleet.v1.EnvService/Step")(GARBAGE, timeout=10)
        # The health service's are refused and logged too, but are no EnvService error.
        with pytest.raises(grpc.RpcError) as info:
            _raw(channel, "/grpc.health.v1.Health/Check")(GARBAGE, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    counted = _errors(scrape(url), "INVALID_ARGUMENT")
    assert counted == {"GetSpec": 1, "Handshake": 1, "Reset": 1, "Step": 4, "Release": 1, "Hold": 1}, counted
    logs = server.logs()
    for method in methods:
        lines = [line for line in logs.splitlines() if f"refused {method} from " in line]
        assert len(lines) == 1, (method, lines)
        assert "[INVALID_ARGUMENT]" in lines[0] and "not a valid protobuf message" in lines[0], lines[0]
    assert re.search(r"refused Check from \S+ \[INVALID_ARGUMENT\]", logs), logs
    assert not any(key.startswith("envfleet_errors_total") and "method=Check" in key for key in scrape(url))


def test_malformed_requests_without_the_token_count_as_unauthenticated(spawn_server: SpawnServer) -> None:
    """The token check comes first: a caller without it is told UNAUTHENTICATED, counted so, only."""
    server = spawn_server(
        "CartPole-v1", 1, "--metrics-port", "0", "--log-level", "info", environ={"ENVFLEET_AUTH_TOKEN": "t0ken"}
    )
    url = _metrics_url(server)
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            _raw(channel, "/envfleet.v1.EnvService/Step")(GARBAGE, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as info:
            _raw(channel, "/envfleet.v1.EnvService/Step")(
                GARBAGE, timeout=10, metadata=(("authorization", "Bearer t0ken"),)
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = scrape(url)
    assert _errors(after, "UNAUTHENTICATED") == {"Step": 1}
    assert _errors(after, "INVALID_ARGUMENT") == {"Step": 1}


def test_oversize_requests_are_refused_by_grpc_before_they_can_be_counted(spawn_server: SpawnServer) -> None:
    """gRPC core refuses a request over --max-request-bytes before any of the server's Python code
    sees it: nothing counts it (the README says so)."""
    server = spawn_server("CartPole-v1", 1, "--metrics-port", "0", "--max-request-bytes", "4096")
    url = _metrics_url(server)
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as info:
        _raw(channel, "/envfleet.v1.EnvService/Step")(b"\x00" * 10_000, timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in (info.value.details() or ""), info.value.details()
    after = scrape(url)
    assert {key: n for key, n in after.items() if key.startswith("envfleet_errors_total") and n} == {}


# -- serving metrics while the envs are built --------------------------------------------------------


@pytest.fixture
def slow_build() -> Iterator[tuple[subprocess.Popen[str], Callable[[], str]]]:
    """A server whose one env takes 5 s to build, with metrics: (process, what it logged so far)."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "env_server",
                "--env",
                "tests.envs:SlowToBuildEnv",
                "--env-kwargs",
                json.dumps({"build_s": 5.0}),
                "--num-envs",
                "1",
                "--port",
                "0",
                "--metrics-port",
                "0",
                "--log-level",
                "info",
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )

        def logs() -> str:
            log.seek(0)
            return log.read()

        try:
            yield proc, logs
        finally:
            proc.kill()
            proc.wait(timeout=30)
            assert proc.stdout is not None
            proc.stdout.close()


@pytest.mark.slow
def test_metrics_are_served_while_the_envs_are_built(
    slow_build: tuple[subprocess.Popen[str], Callable[[], str]],
) -> None:
    proc, logs = slow_build
    _wait_until(lambda: "Prometheus metrics on" in logs() or proc.poll() is not None, "the metrics line")
    match = re.search(r"Prometheus metrics on (http://\S+/metrics)", logs())
    assert match is not None, logs()
    url = match.group(1)
    building = scrape(url)
    assert "serving 1 x" not in logs(), "the envs were built before the first scrape: the test needs a slower build"
    assert building["envfleet_ready"] == 0 and building["envfleet_env_build_seconds"] == 0
    assert building["envfleet_num_envs"] == 1 and building["envfleet_steps_total"] == 0
    assert any(key.startswith("envfleet_server_info{env_id=tests.envs:SlowToBuildEnv,") for key in building)
    assert proc.stdout is not None
    ready = proc.stdout.readline()
    assert ready.startswith("listening on "), (ready, logs())
    built = scrape(url)
    assert built["envfleet_ready"] == 1
    assert 5.0 <= built["envfleet_env_build_seconds"] < 60, built["envfleet_env_build_seconds"]


@pytest.mark.parametrize("vectorization", ["sync", "async"])
def test_a_metrics_port_in_use_is_found_before_the_envs_are_built(vectorization: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "env_server",
                "--env",
                "tests.envs:SlowToBuildEnv",
                "--env-kwargs",
                json.dumps({"build_s": 60.0}),
                "--vectorization",
                vectorization,
                "--port",
                "0",
                "--metrics-port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"env-server: error: cannot serve metrics on 127.0.0.1:{port}: Address already in use "
        "(another process has it; pick another --metrics-port, or 0 for a free one)"
    )
    assert elapsed < 50, f"the clash was found after {elapsed:.0f} s: after the 60 s build?"


def test_the_metrics_port_must_differ_from_the_grpc_port() -> None:
    port = _free_port()
    result = subprocess.run(
        [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--port", str(port), "--metrics-port", str(port)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"env-server: error: --metrics-port {port}: expected a port other than --port's (gRPC listens there), "
        "got the same; pick another, or 0 for a free one"
    )


# -- sessions ---------------------------------------------------------------------------------------


def _sessions(samples: dict[str, float]) -> dict[str, float]:
    """``envfleet_sessions_ended_total`` by reason, and ``started``."""
    prefix = "envfleet_sessions_ended_total{reason="
    ended = {key[len(prefix) : -1]: n for key, n in samples.items() if key.startswith(prefix)}
    return {"started": samples["envfleet_sessions_started_total"], **ended}


@pytest.mark.slow
def test_sessions_are_counted_by_how_they_ended(spawn_server: SpawnServer) -> None:
    server = spawn_server("CartPole-v1", 1, "--claim-timeout", "1", "--metrics-port", "0", "--log-level", "info")
    url = _metrics_url(server)
    zero = dict.fromkeys(SESSION_END_REASONS, 0.0)
    assert _sessions(scrape(url)) == {"started": 0, **zero}  # (every reason's series there at 0)

    def ended(expected: dict[str, float]) -> Callable[[], bool]:
        return lambda: _sessions(scrape(url)) == {**zero, **expected}

    with RemoteVectorEnv([server.address]) as envs:  # closed: released
        envs.reset(seed=0)
    _wait_until(ended({"started": 1, "released": 1}), "released")
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        session = stub.Handshake(pb.HandshakeRequest(client_name="gone"), timeout=10).session_id
        hold = stub.Hold(pb.HoldRequest(session_id=session))
        # Past the 1 s claim timeout the claim stands: the server holds the stream (so its end, not
        # the timeout, ends the session).
        time.sleep(2.0)
        assert scrape(url)["envfleet_session_active"] == 1
        hold.cancel()  # the learner goes away without a Release
        _wait_until(ended({"started": 2, "released": 1, "hold_ended": 1}), "hold_ended")
        stub.Handshake(pb.HandshakeRequest(client_name="silent"), timeout=10)  # no Hold stream, no calls
        _wait_until(ended({"started": 3, "released": 1, "hold_ended": 1, "claim_timeout": 1}), "claim_timeout")
    after = scrape(url)
    assert after["envfleet_session_active"] == 0
    series = [key for key in after if key.startswith("envfleet_sessions_ended_total")]
    assert len(series) == len(SESSION_END_REASONS), series  # (no session ids, no other labels)


def test_a_shutdown_ends_the_session_and_readiness_while_a_step_is_in_flight(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    kwargs = {"gate": str(gate), "at": 1, "hold_s": 30.0}
    argv = ["--env", "tests.envs:GateEnv", "--env-kwargs", json.dumps(kwargs), "--num-envs", "1", "--port", "0"]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "env_server", *argv, "--metrics-port", "0", "--grace", "20", "--log-level", "info"],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        try:
            assert proc.stdout is not None
            address = proc.stdout.readline().strip().removeprefix("listening on ")
            log.seek(0)
            match = re.search(r"Prometheus metrics on (http://\S+/metrics)", log.read())
            assert match is not None
            url = match.group(1)
            with grpc.insecure_channel(address) as channel:
                stub = pb_grpc.EnvServiceStub(channel)
                session = stub.Handshake(pb.HandshakeRequest(client_name="learner"), timeout=10).session_id
                stub.Reset(pb.ResetRequest(session_id=session), timeout=30)
                step = pb.StepRequest(session_id=session)
                step.actions.tensor.dtype = pb.DTYPE_INT64
                step.actions.tensor.shape[:] = [1]
                step.actions.tensor.data = np.zeros(1, dtype="<i8").tobytes()
                in_flight = stub.Step.future(step, timeout=60)
                _wait_until(gate.exists, "the step to reach the gate")
                serving = scrape(url)
                assert serving["envfleet_ready"] == 1 and serving["envfleet_session_active"] == 1
                proc.send_signal(signal.SIGTERM)
                # Draining: the step is held in the env, the metrics still served.
                _wait_until(lambda: scrape(url)["envfleet_ready"] == 0, "envfleet_ready 0 while draining")
                _wait_until(lambda: _sessions(scrape(url))["shutdown"] == 1, "the session ended by the shutdown")
                draining = scrape(url)
                assert draining["envfleet_session_active"] == 0
                assert _sessions(draining) == {"started": 1, **dict.fromkeys(SESSION_END_REASONS, 0.0), "shutdown": 1}
                gate.unlink()  # the step ends; so does the server
                in_flight.result()
            assert proc.wait(timeout=60) == 0
        finally:
            gate.unlink(missing_ok=True)
            proc.kill()
            proc.wait(timeout=30)
            assert proc.stdout is not None
            proc.stdout.close()
