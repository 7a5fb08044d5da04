"""What callers without the token, or other users of a shared folder, cannot take from learners and
probes: the places of calls in progress (health calls that never send their request, Watch streams
under a small --max-concurrent-rpcs), the metrics endpoint's connections, and other files'
permissions (the step socket's chmod)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from env_server.interceptors import MAX_WATCH_STREAMS
from env_server.metrics import MAX_HTTP_CONNECTIONS
from env_server.service import EnvService
from env_server.step_socket import StepSocketServer
from learner import RemoteVectorEnv
from tests.conftest import SpawnServer

TOKEN = "s3cret-token_for.hostile"
CHECK = "/grpc.health.v1.Health/Check"
HEALTH_PROBE = str(Path(__file__).resolve().parents[1] / "env_server" / "health.py")


class HalfOpenChecks:
    """Health Check calls that send their headers and never their request (a caller without the
    token holding places), ``per_channel`` on each of its own connections, until closed."""

    def __init__(self, address: str, count: int, per_channel: int = 8) -> None:
        self._stop = threading.Event()
        self._channels: list[grpc.Channel] = []
        self.calls: list[Any] = []
        for i in range(count):
            if i % per_channel == 0:
                self._channels.append(grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]))
            check = self._channels[-1].stream_unary(
                CHECK,
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            self.calls.append(check.future(self._never(), timeout=120))

    def _never(self) -> Iterator[health_pb2.HealthCheckRequest]:
        self._stop.wait()
        yield from ()

    def close(self) -> None:
        self._stop.set()
        for call in self.calls:
            call.cancel()
        for channel in self._channels:
            channel.close()


def _learn(address: str) -> None:
    """What a learner does: connect, reset, step, reset again (a few calls at once: Hold, StepStream, Reset)."""
    with RemoteVectorEnv([address], auth_token=TOKEN, connect_timeout=10) as envs:
        envs.reset(seed=0)
        for _ in range(5):
            envs.step(np.zeros(envs.num_envs, dtype=np.int64))
        envs.reset(seed=1)


def _probe(address: str) -> subprocess.CompletedProcess[str]:
    """The image's health probe, as Docker and Kubernetes run it."""
    return subprocess.run(
        [sys.executable, "-I", HEALTH_PROBE, "--address", address], capture_output=True, text=True, timeout=60
    )


# -- health calls without the token ---------------------------------------------------------------------


@pytest.mark.slow
def test_health_checks_that_never_send_their_request_leave_learners_and_probes_their_places(
    spawn_server: SpawnServer,
) -> None:
    """4 connections x 8 health Checks that never send their request (the hunter's repro) took every
    place --max-concurrent-rpcs (32) allows: learners were refused RESOURCE_EXHAUSTED, and so was the
    probe, which would have had Kubernetes restart the server. The health calls keep to a few places,
    and a probe's Check takes that of one still waiting for its request."""
    server = spawn_server("CartPole-v1", 2, "--auth-token", TOKEN)
    attack = HalfOpenChecks(server.address, 32)
    try:
        time.sleep(1.0)  # (the calls are in, each where it will stay)
        _learn(server.address)
        probed = _probe(server.address)
        assert probed.returncode == 0, probed.stdout + probed.stderr
        assert "SERVING" in probed.stdout
    finally:
        attack.close()
    assert "health calls are in progress, the most this server serves at once" in server.logs()


def _h2_frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


class UnreadChecks:
    """A raw HTTP/2 connection that opens ``count`` health Checks, each with its request, and reads none of their
    answers: its flow-control window is 0 (SETTINGS_INITIAL_WINDOW_SIZE), so the server can send it no data, and
    each Check stays in progress (past its request: no wait for it ends the call) until the connection closes."""

    def __init__(self, address: str, count: int) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=30)
        settings = (4).to_bytes(2, "big") + (0).to_bytes(4, "big")  # (INITIAL_WINDOW_SIZE 0)
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _h2_frame(4, 0, 0, settings))
        headers = [(":method", "POST"), (":scheme", "http"), (":path", CHECK), (":authority", address)]
        headers += [("content-type", "application/grpc"), ("te", "trailers")]
        # (HPACK literals without indexing, names and values as they are: lengths below 127)
        block = b"".join(b"\x00" + bytes([len(n)]) + n.encode() + bytes([len(v)]) + v.encode() for n, v in headers)
        for i in range(count):  # (HEADERS with END_HEADERS; then the empty request, a 5-byte gRPC frame, END_STREAM)
            self.sock.sendall(_h2_frame(1, 4, 1 + 2 * i, block) + _h2_frame(0, 1, 1 + 2 * i, bytes(5)))
        self._reader = threading.Thread(target=self._answer_pings_and_settings, daemon=True)
        self._reader.start()

    def _answer_pings_and_settings(self) -> None:  # (what keeps a connection alive: acknowledged, nothing else)
        data = b""
        with contextlib.suppress(OSError):
            while chunk := self.sock.recv(65536):
                data += chunk
                while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
                    size, kind, flags = int.from_bytes(data[:3], "big"), data[3], data[4]
                    payload, data = data[9 : 9 + size], data[9 + size :]
                    if kind == 4 and not flags & 1:
                        self.sock.sendall(_h2_frame(4, 1, 0))
                    if kind == 6 and not flags & 1:
                        self.sock.sendall(_h2_frame(6, 1, 0, payload))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


@pytest.mark.slow
def test_health_checks_whose_answers_are_never_read_leave_probes_their_place(spawn_server: SpawnServer) -> None:
    """8 Checks on one connection that reads nothing (the review's repro) held the 8 health places for as long as
    it stayed open, no wait for a request ending them: every probe was refused. A new health call now takes the
    place of the oldest Check of 0.25 s or more, and a Check ends after HEALTH_CHECK_LIMIT_S in all."""
    server = spawn_server("CartPole-v1", 1, "--auth-token", TOKEN)
    attack = UnreadChecks(server.address, 8)
    try:
        time.sleep(1.0)  # (the calls are in, their answers stuck)
        for _ in range(2):
            probed = _probe(server.address)
            assert probed.returncode == 0, probed.stdout + probed.stderr
        _learn(server.address)
    finally:
        attack.close()


@pytest.mark.slow
def test_probes_that_arrive_together_do_not_end_each_other(spawn_server: SpawnServer) -> None:
    """A liveness and a readiness probe of the same period, under --max-concurrent-rpcs 5 (2 health places): a
    Check loses its place to another health call only from HEALTH_MAKE_ROOM_AFTER_S on, so the second does not
    end the first, whose request may be a moment behind its headers. (A guard: the review saw such ends with
    separate probe processes, at --max-concurrent-rpcs 4; these in-process calls send their requests too
    quickly to show them.)"""
    server = spawn_server("CartPole-v1", 1, "--max-concurrent-rpcs", "5")
    channels = [grpc.insecure_channel(server.address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in "ab"]
    failed: list[str] = []
    try:
        for channel in channels:  # (connected first: the rounds time the calls, not the connections)
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        for _ in range(30):
            together = threading.Barrier(2)

            def probe(channel: grpc.Channel, together: threading.Barrier = together) -> None:
                together.wait(timeout=30)
                try:
                    health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
                except grpc.RpcError as err:
                    failed.append(f"{err.code()}: {err.details()}")

            threads = [threading.Thread(target=probe, args=(channel,)) for channel in channels]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
    finally:
        for channel in channels:
            channel.close()
    assert not failed, failed


@pytest.mark.slow
def test_a_check_whose_request_does_not_come_is_ended_and_its_place_freed(spawn_server: SpawnServer) -> None:
    """A Check whose request never comes ends, DEADLINE_EXCEEDED, HEALTH_REQUEST_TIMEOUT_S after it
    began: the server does not wait for it as long as its caller likes."""
    server = spawn_server("CartPole-v1", 1, "--auth-token", TOKEN)
    attack = HalfOpenChecks(server.address, 1)
    try:
        with pytest.raises(grpc.RpcError) as info:
            attack.calls[0].result(timeout=60)
    finally:
        attack.close()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert re.fullmatch(
        rf"{CHECK}: the request did not come within [0-9.]+ s of the call; send it with the call", info.value.details()
    ), info.value.details()


@pytest.mark.slow
@pytest.mark.parametrize("max_calls", [4, 6, 7])
def test_watch_streams_and_checks_without_the_token_leave_a_learner_its_places(
    spawn_server: SpawnServer, max_calls: int
) -> None:
    """Under a small --max-concurrent-rpcs, the Watch streams anyone may keep open took the places a
    learner needs (4: its Handshake was refused; 6: its Reset). Now they, and Checks that never send
    their request, keep to their share, and a learner works beside them; so does a probe."""
    server = spawn_server("CartPole-v1", 2, "--auth-token", TOKEN, "--max-concurrent-rpcs", str(max_calls))
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        watches = []
        for _ in range(MAX_WATCH_STREAMS):
            stream = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
            try:
                assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
                watches.append(stream)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        attack = HalfOpenChecks(server.address, 8)
        try:
            time.sleep(1.0)
            _learn(server.address)
            probed = _probe(server.address)
            assert probed.returncode == 0, probed.stdout + probed.stderr
        finally:
            attack.close()
            for stream in watches:
                stream.cancel()


# -- the step socket's permissions ------------------------------------------------------------------------


def test_the_step_socket_s_chmod_never_follows_a_link_swapped_in_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a folder others can write to, the step socket can be replaced, between its bind and its chmod,
    by a link to another file: chmod(path) changed that file's permissions (a private key made
    world-readable), and the server then took the link for its own socket. It is refused instead."""
    grpc_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    grpc_socket.bind(str(tmp_path / "env.sock"))
    os.chmod(tmp_path / "env.sock", 0o777)
    key = tmp_path / "secret.key"
    key.write_text("PRIVATE KEY\n")
    key.chmod(0o600)
    path = str(tmp_path / "env.sock.steps")
    loop_class = type(asyncio.new_event_loop())
    real = loop_class.create_unix_server

    async def swapped(self: asyncio.AbstractEventLoop, *args: Any, **kwargs: Any) -> Any:
        server = await real(self, *args, **kwargs)
        os.symlink(key, f"{path}.evil")
        os.rename(f"{path}.evil", path)  # (as another user would, at the worst moment)
        return server

    monkeypatch.setattr(loop_class, "create_unix_server", swapped)
    step_server = StepSocketServer(cast(EnvService, SimpleNamespace(on_session_end=None)), path)

    async def start() -> None:
        try:
            await step_server.start(mode_of=str(tmp_path / "env.sock"))
        finally:
            step_server.close()

    try:
        with pytest.raises(OSError, match=r"expected the socket this server has just made, found a link"):
            asyncio.run(start())
    finally:
        grpc_socket.close()
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert os.path.islink(path)  # (not this server's to remove)


# -- the metrics endpoint ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_connections_to_the_metrics_endpoint_that_never_send_their_request_cannot_keep_scrapes_out(
    spawn_server: SpawnServer,
) -> None:
    """16 connections that sent a byte of a request (the hunter's repro sends one more every 5 s) kept
    every place of the metrics endpoint, each until its 30 s deadline: scrapes were closed unanswered.
    A scrape takes the place of the oldest of them."""
    server = spawn_server("CartPole-v1", 1, "--metrics-port", "0")
    _until(lambda: "Prometheus metrics on http://" in server.logs(), "the metrics endpoint is up")
    port = int(re.findall(r"Prometheus metrics on http://127\.0\.0\.1:(\d+)/metrics", server.logs())[0])
    held = []
    try:
        for _ in range(MAX_HTTP_CONNECTIONS):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"G")
            held.append(sock)
        time.sleep(0.5)  # (taken in: each holds its thread)
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as scrape:
                scrape.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
                answer = b"".join(iter(lambda: scrape.recv(65536), b""))
            assert b"envfleet_num_envs 1.0" in answer, answer[:200]
    finally:
        for sock in held:
            sock.close()
    assert "closed the oldest whose request had not come" in server.logs()


def _until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


@pytest.mark.slow
def test_a_check_whose_request_grpc_refused_is_not_logged_as_one_that_sent_none(spawn_server: SpawnServer) -> None:
    """A Check whose request is over --max-request-bytes (or compressed, and inflates past it) is refused by gRPC
    (RESOURCE_EXHAUSTED). Where gRPC did so before the Check's handler read it (a busy server: 2 of 80 calls sent
    8 at a time, unloaded), the handler read the end of the requests and logged "refused ... from : it sent no
    request" (no peer: the call was over), and set a status gRPC could not send (its traceback logged at times).
    A Check that does end its requests without one is still refused so."""
    server = spawn_server("CartPole-v1", 1, "--auth-token", TOKEN, "--max-request-bytes", "4096")
    too_large = health_pb2.HealthCheckRequest(service="a" * 8192).SerializeToString()
    with grpc.insecure_channel(server.address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        check = channel.unary_unary(CHECK, request_serializer=bytes, response_deserializer=bytes)
        for _ in range(30):  # (calls together, on one connection: some reach the handler after gRPC refused them)
            for call in [check.future(too_large, timeout=30) for _ in range(8)]:
                with pytest.raises(grpc.RpcError) as info:
                    call.result()
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
        none_sent = channel.stream_unary(CHECK, request_serializer=bytes, response_deserializer=bytes)
        with pytest.raises(grpc.RpcError) as info:
            none_sent(iter(()), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    logs = server.logs()
    assert "Traceback" not in logs and "ExecuteBatchError" not in logs, logs
    refusals = [line for line in logs.splitlines() if "it sent no request" in line]
    assert len(refusals) == 1 and re.search(r"from (ipv4|ipv6|unix):\S+: it sent no request", refusals[0]), refusals
