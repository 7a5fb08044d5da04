"""The step socket: steps on a plain Unix socket beside a Unix-socket server's gRPC one (see the proto).

Same results, checks and errors as StepStream; bad frames get a StepError and lose nothing; a
client falls back to gRPC where the socket is out of reach.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import grpc
import numpy as np
import pytest

import learner.client
from env_server import codec
from env_server.config import DEFAULT_MAX_REQUEST_BYTES
from env_server.protocol import FRAME_ERROR, FRAME_HEADER, FRAME_STEP, STEP_SOCKET_SUFFIX
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from env_server.step_socket import MAX_CONNECTIONS, StepSocketServer, _Connection, file_identity, remove_own_file
from learner import LocalServers, RemoteVectorEnv
from learner.errors import (
    EnvCrashedError,
    InvalidRequestError,
    RemoteTimeoutError,
    ServerUnavailableError,
    SessionError,
)
from learner.local import label_of
from tests.compare import assert_same


def _frame(kind: int, payload: bytes) -> bytes:
    return FRAME_HEADER.pack(len(payload), kind) + payload


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError(f"connection closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def _answer(sock: socket.socket) -> tuple[int, bytes]:
    length, kind = FRAME_HEADER.unpack(_read_exactly(sock, FRAME_HEADER.size))
    return kind, _read_exactly(sock, length)


def _error(sock: socket.socket) -> pb.StepError:
    kind, payload = _answer(sock)
    assert kind == FRAME_ERROR, kind
    error = pb.StepError.FromString(payload)
    assert sock.recv(1) == b"", "the server closes the connection after an error"
    return error


def _step_request(session_id: str, actions: list[int]) -> pb.StepRequest:
    request = pb.StepRequest(session_id=session_id)
    codec.encode_value(np.array(actions, dtype=np.int64), request.actions, "actions")
    return request


class Session:
    """A claimed, reset session on a Unix-socket server, and ways to reach its step socket."""

    def __init__(self, address: str, num_envs: int = 3, *, hold: bool = True) -> None:
        self.address = address
        self.socks: list[socket.socket] = []  # (those connect() opened: closed in close())
        self.hold: grpc.Future | None = None
        self.closed = False
        self.channel = grpc.insecure_channel(address)
        _SESSIONS.append(self)
        self.stub = pb_grpc.EnvServiceStub(self.channel)
        handshake = self.stub.Handshake(pb.HandshakeRequest(client_name="test"), timeout=10)
        self.id = handshake.session_id
        self.step_socket = handshake.step_socket
        # (without a Hold stream the claim lasts while calls come within the server's claim timeout)
        self.hold = self.stub.Hold(pb.HoldRequest(session_id=self.id)) if hold else None
        seeds = [pb.Seed(value=i) for i in range(num_envs)]
        self.stub.Reset(pb.ResetRequest(session_id=self.id, seeds=seeds), timeout=10)

    def connect(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.socks.append(sock)
        sock.settimeout(10)
        sock.connect(self.step_socket)
        return sock

    def step(self, sock: socket.socket, actions: list[int]) -> pb.StepResponse:
        sock.sendall(_frame(FRAME_STEP, _step_request(self.id, actions).SerializeToString()))
        kind, payload = _answer(sock)
        assert kind == FRAME_STEP, pb.StepError.FromString(payload)
        return pb.StepResponse.FromString(payload)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for sock in self.socks:
            sock.close()
        if self.hold is not None:
            self.hold.cancel()
        self.channel.close()


_SESSIONS: list[Session] = []


@pytest.fixture(autouse=True)
def _close_sessions() -> Iterator[None]:
    """Every Session a test made is closed after it, passed or failed, with the sockets it opened."""
    yield
    while _SESSIONS:
        _SESSIONS.pop().close()


@pytest.fixture
def session(start_servers: Any) -> Iterator[Session]:
    (address,) = start_servers("CartPole-v1", num_servers=1, envs_per_server=3, transport="unix")
    claimed = Session(address)
    yield claimed
    claimed.close()


def test_a_unix_socket_server_offers_its_step_socket_and_a_tcp_one_none(start_servers: Any) -> None:
    (unix,) = start_servers("CartPole-v1", transport="unix")
    (tcp,) = start_servers("CartPole-v1", transport="tcp")
    (off,) = start_servers("CartPole-v1", transport="unix", server_args=["--no-step-socket"])
    offered = {}
    for address in (unix, tcp, off):
        with grpc.insecure_channel(address) as channel:
            response = pb_grpc.EnvServiceStub(channel).Handshake(pb.HandshakeRequest(), timeout=10)
            offered[address] = response.step_socket
    assert offered[unix] == unix.removeprefix("unix:") + STEP_SOCKET_SUFFIX
    assert os.path.exists(offered[unix])
    assert offered[tcp] == ""
    assert offered[off] == "" and not os.path.exists(off.removeprefix("unix:") + STEP_SOCKET_SUFFIX)


def test_steps_on_the_socket_are_those_of_the_step_stream(start_servers: Any) -> None:
    addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=3, transport="unix")
    rng = np.random.default_rng(0)
    actions = [rng.integers(0, 2, size=6) for _ in range(300)]  # episodes end and autoreset on the way
    runs = []
    for step_socket in (True, False):
        with RemoteVectorEnv(addresses, step_socket=step_socket) as envs:
            assert all(bool(c.step_socket) is step_socket for c in envs._clients)
            run: list[tuple[Any, ...]] = [envs.reset(seed=3)]
            run += [envs.step(a) for a in actions]
            runs.append(run)
    assert_same(runs[0], runs[1])


def test_every_step_path_returns_the_requests_step_id(session: Session) -> None:
    """StepResponse.step_id is the StepRequest's, on the step socket, StepStream and unary Step alike
    (0 for a request without one), so a client sees an answer that is not to its request."""
    requests = [_step_request(session.id, [0, 1, 0]) for _ in range(3)]
    for step_id, request in zip((7, 2**64 - 1, 0), requests, strict=True):
        request.step_id = step_id
    sock = session.connect()
    try:
        sock.sendall(b"".join(_frame(FRAME_STEP, r.SerializeToString()) for r in requests))  # (pipelined)
        answers = [_answer(sock) for _ in requests]
    finally:
        sock.close()
    assert [(kind, pb.StepResponse.FromString(payload).step_id) for kind, payload in answers] == [
        (FRAME_STEP, 7),
        (FRAME_STEP, 2**64 - 1),
        (FRAME_STEP, 0),
    ]
    assert [answer.step_id for answer in session.stub.StepStream(iter(requests), timeout=10)] == [7, 2**64 - 1, 0]
    assert session.stub.Step(requests[0], timeout=10).step_id == 7


def test_frame_stacks_of_several_reads_arrive_whole(start_servers: Any) -> None:
    # 3 x 4x84x84 uint8 Pong frame stacks: ~85 KB per answer, more than one read of the socket.
    pytest.importorskip("ale_py")
    (address,) = start_servers(
        "ALE/Pong-v5", num_servers=1, envs_per_server=3, transport="unix", server_args=["--wrappers", "atari"]
    )
    actions = [np.array([t % 6, (t + 1) % 6, (t + 2) % 6]) for t in range(12)]
    runs = []
    for step_socket in (True, False):
        with RemoteVectorEnv(address, step_socket=step_socket) as envs:
            assert bool(envs._clients[0].step_socket) is step_socket
            obs, _ = envs.reset(seed=7)
            assert obs.shape == (3, 4, 84, 84) and obs.dtype == np.uint8
            runs.append([obs] + [envs.step(a)[0] for a in actions])
    assert_same(runs[0], runs[1])


def test_pipelined_groups_and_a_fleet_of_socket_and_tcp_servers_step_like_one_step(start_servers: Any) -> None:
    unix = start_servers("CartPole-v1", num_servers=2, envs_per_server=2, transport="unix")
    tcp = start_servers("CartPole-v1", num_servers=1, envs_per_server=2, transport="tcp")
    rng = np.random.default_rng(1)
    actions = [rng.integers(0, 2, size=6) for _ in range(60)]
    with RemoteVectorEnv([*unix, *tcp], num_groups=3) as envs:
        obs, _ = envs.reset(seed=5)
        expected = [obs]
        for a in actions:
            for g, sl in enumerate(envs.group_slices):
                envs.send(a[sl], g)
            parts = sorted(envs.recv() for _ in envs.group_slices)  # whichever group is done first
            expected.append(np.concatenate([p[1] for p in parts]))
    with RemoteVectorEnv([*unix, *tcp], step_socket=False) as envs:
        plain = [envs.reset(seed=5)[0]] + [envs.step(a)[0] for a in actions]
    assert_same(expected, plain)


def test_a_bad_action_on_the_socket_gets_invalid_argument_naming_the_env_and_changes_nothing(
    start_servers: Any,
) -> None:
    a, b = start_servers("CartPole-v1", num_servers=2, envs_per_server=3, transport="unix")
    refused, reference = Session(a), Session(b)  # the same seeds
    sock = refused.connect()
    refused.step(sock, [0, 1, 0])
    sock.sendall(_frame(FRAME_STEP, _step_request(refused.id, [0, 0, 7]).SerializeToString()))
    error = _error(sock)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert error.env_index == 2 and "env 2" in error.message and "Discrete(2)" in error.message
    # Nothing stepped: on a new connection the envs go on as if the bad request had never come.
    after = refused.step(refused.connect(), [1, 1, 1])
    sock = reference.connect()
    reference.step(sock, [0, 1, 0])
    expected = reference.step(sock, [1, 1, 1])
    assert_same(codec.decode_value(after.observations), codec.decode_value(expected.observations))
    refused.close()
    reference.close()


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        (_frame(FRAME_STEP, b"\xff\xff\xff"), "not a valid StepRequest"),
        (_frame(7, b""), "expected a frame of kind 0 (a StepRequest), got kind 7"),
        (
            FRAME_HEADER.pack(2**31, FRAME_STEP),
            f"a frame of {2**31} bytes, over this server's limit of {DEFAULT_MAX_REQUEST_BYTES} bytes on requests "
            "(env-server --max-request-bytes raises it)",
        ),
        (_frame(FRAME_STEP, pb.StepRequest(session_id="not-mine").SerializeToString()), "does not own this server"),
    ],
    ids=["garbage", "unknown-kind", "too-long", "unknown-session"],
)
def test_bad_frames_get_a_step_error_and_the_server_serves_on(session: Session, frame: bytes, expected: str) -> None:
    sock = session.connect()
    sock.sendall(frame)
    error = _error(sock)
    assert expected in error.message
    code = grpc.StatusCode.FAILED_PRECONDITION if "own" in expected else grpc.StatusCode.INVALID_ARGUMENT
    assert error.code == code.value[0]
    sock = session.connect()
    assert session.step(sock, [0, 1, 0]).rewards.data  # the session steps on


def test_strings_that_would_take_gbs_as_a_numpy_array_are_invalid_argument(session: Session) -> None:
    # 400 KB on the wire; 373 GiB as a numpy array (every string as wide as the longest): not
    # numpy's MemoryError as INTERNAL, but refused before it is built, as over gRPC.
    actions = pb.Value(strings=pb.StringArray(shape=[100_001], values=["a" * 1_000_000] + [""] * 100_000))
    sock = session.connect()
    sock.sendall(_frame(FRAME_STEP, pb.StepRequest(session_id=session.id, actions=actions).SerializeToString()))
    error = _error(sock)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], error.message
    assert error.message.startswith(
        "actions: a string array of 100001 strings of up to 1000000 characters would take 400004000000 bytes"
    ), error.message
    assert session.step(session.connect(), [0, 1, 0]).rewards.data


def test_a_client_that_vanishes_mid_frame_costs_nothing(session: Session) -> None:
    sock = session.connect()
    payload = _step_request(session.id, [0, 1, 0]).SerializeToString()
    sock.sendall(_frame(FRAME_STEP, payload)[:-3])
    sock.close()
    assert session.step(session.connect(), [0, 1, 0]).rewards.data


def test_connections_beyond_the_limit_are_refused_with_resource_exhausted(session: Session) -> None:
    socks = [session.connect() for _ in range(MAX_CONNECTIONS)]
    for sock in socks:
        session.step(sock, [0, 0, 0])  # each has stepped: none is closed to make room
    error = _error(session.connect())
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "connections are open" in error.message
    socks[0].close()
    assert session.step(socks[1], [1, 1, 1]).rewards.data


def test_connections_that_never_stepped_make_room_for_the_learner(session: Session) -> None:
    squatters = [session.connect() for _ in range(MAX_CONNECTIONS)]  # anyone on the host may connect
    learner = session.connect()
    assert session.step(learner, [0, 1, 0]).rewards.data
    error = _error(squatters[0])  # the oldest was closed to make room, and told so
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "closed to make room for a new connection" in error.message


@pytest.mark.parametrize("end", ["released", "hold stream gone", "timed out"])
def test_the_connections_of_a_session_that_ends_are_told_and_closed_and_make_room(start_servers: Any, end: str) -> None:
    """A learner stopped (Ctrl-Z) or hung keeps its connections open while its process lives; once its
    session ends, however it ends, they are told so and closed, so that they do not hold the step
    socket's places for good: the next learner steps there, on as many connections as it likes."""
    (address,) = start_servers("CartPole-v1", envs_per_server=3, transport="unix", server_args=["--claim-timeout", "1"])
    old = Session(address, hold=end != "timed out")
    socks = [old.connect() for _ in range(MAX_CONNECTIONS)]
    for sock in socks:
        old.step(sock, [0, 0, 0])
    if end == "released":
        old.stub.Release(pb.ReleaseRequest(session_id=old.id), timeout=10)
    elif end == "hold stream gone":
        assert old.hold is not None
        old.hold.cancel()
    # (timed out: no call for the claim timeout, 1 s)
    reason = {
        "released": "released",
        "hold stream gone": "its Hold stream ended",
        "timed out": "no Hold stream and no calls for 1 s",
    }[end]
    for sock in socks:
        error = _error(sock)
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0], error
        assert error.message.startswith(f"session {old.id[:8]!r} does not own this server any more ({reason}"), error
    old.close()
    new = Session(address)
    mine = [new.connect() for _ in range(MAX_CONNECTIONS)]
    for sock in mine:
        assert new.step(sock, [1, 1, 1]).rewards.data
    new.close()


def test_a_new_connection_evicts_those_of_a_session_that_is_over() -> None:
    """Should connections of a session that is over be left (session_ended closes them), a new
    connection at the limit closes them rather than being refused."""
    service = _Service(live="live")
    server = StepSocketServer(service, path="")  # type: ignore[arg-type]
    old = [_connection(server, stepped_in="gone") for _ in range(MAX_CONNECTIONS - 1)]
    current = _connection(server, stepped_in="live")
    newcomer = _connection(server, stepped_in="", admit=False)
    assert server.admit(newcomer)
    assert server.connections == [current, newcomer]
    for connection in old:
        assert connection.closed and isinstance(connection.transport, _Recorder) and connection.transport.closed
        kind, payload = _frames(connection.transport.written)[0]
        error = pb.StepError.FromString(payload)
        assert kind == FRAME_ERROR and error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0], error
        assert error.message == "session 'gone' does not own this server any more (it is over); call Handshake again"
    assert not current.closed


def test_refused_connections_are_logged_at_most_once_in_a_while(
    start_servers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A learner that opens connection after connection beyond the limit (each refused) fills no log."""
    caplog.set_level(logging.WARNING)
    (address,) = start_servers("CartPole-v1", envs_per_server=3, transport="unix")
    claimed = Session(address)
    socks = [claimed.connect() for _ in range(MAX_CONNECTIONS)]
    for sock in socks:
        claimed.step(sock, [0, 0, 0])
    for _ in range(20):
        assert _error(claimed.connect()).code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    deadline = time.monotonic() + 10
    while "RESOURCE_EXHAUSTED" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)  # (the server's log lines come through a thread that forwards them)
    time.sleep(0.5)
    lines = [r.getMessage() for r in caplog.records if "step socket" in r.getMessage()]
    assert len(lines) == 1 and "refused StepStream" in lines[0] and "RESOURCE_EXHAUSTED" in lines[0], lines
    claimed.close()


@pytest.mark.slow
def test_an_answer_that_came_in_time_is_no_timeout_when_another_server_is_late(start_servers: Any) -> None:
    slow = start_servers("CartPole-v1", envs_per_server=2, transport="unix", server_args=["--step-delay-ms", "3000"])
    fast = start_servers("CartPole-v1", envs_per_server=2, transport="unix")
    # (the fast server's first step, its step socket connected: 1 s even on a loaded host)
    with RemoteVectorEnv([*slow, *fast], timeout=1.0, fault_tolerant=True) as envs:
        envs.reset(seed=0)
        _, rewards, _, truncations, infos = envs.step(np.zeros(4, dtype=np.int64))
        # The slow server ran out of time and counts as lost; the fast one answered (read after the
        # deadline the slow one used up) and stepped.
        assert infos["env_unavailable"].tolist() == [True, True, False, False]
        assert rewards.tolist() == [0.0, 0.0, 1.0, 1.0] and truncations.tolist() == [True, True, False, False]


def test_a_file_in_the_step_socket_s_place_is_left_alone_and_steps_go_over_grpc(tmp_path: Path) -> None:
    path = tmp_path / "env.sock"
    squatter = Path(f"{path}{STEP_SOCKET_SUFFIX}")
    squatter.write_text("mine")
    proc = subprocess.Popen(
        [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--unix-socket", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == f"listening on unix:{path}"
        with RemoteVectorEnv(f"unix:{path}") as envs:
            envs.reset(seed=0)
            envs.step(np.zeros(1, dtype=np.int64))
            assert envs._clients[0].step_socket == ""
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=20)
    assert "no step socket" in stderr and "steps go over gRPC" in stderr
    assert squatter.read_text() == "mine"


def test_a_slow_env_steps_on_the_loop_s_terms(start_servers: Any) -> None:
    # Steps of 20 ms run off the event loop (the inline limit is 10 ms): the task path.
    addresses = start_servers(
        "CartPole-v1", num_servers=1, envs_per_server=2, transport="unix", server_args=["--step-delay-ms", "20"]
    )
    with RemoteVectorEnv(addresses) as envs:
        envs.reset(seed=0)
        for _ in range(8):
            _, rewards, *_ = envs.step(np.zeros(2, dtype=np.int64))
            assert rewards.tolist() == [1.0, 1.0]
        assert envs._clients[0].step_socket


@pytest.fixture
def cpus_to_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    """Enough CPUs, as the learner sees it, that it waits awake for quick servers."""
    monkeypatch.setattr("learner.remote.usable_cpus", lambda: 8)


@pytest.mark.usefixtures("cpus_to_spare")
def test_waiting_for_a_slow_env_sleeps_rather_than_spins(start_servers: Any) -> None:
    # Answers of ~30 ms are waited for asleep: spin_wait (1 ms) is only for servers answering sooner.
    addresses = start_servers(
        "CartPole-v1", num_servers=1, envs_per_server=2, transport="unix", server_args=["--step-delay-ms", "30"]
    )
    with RemoteVectorEnv(addresses, spin_wait=0.001) as envs:
        assert envs._clients[0].spin_wait == 0.001
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(10):
            envs.step(np.zeros(2, dtype=np.int64))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        assert envs._clients[0].recent_rtt > 0.001
    assert cpu < 0.5 * wall, f"{cpu:.3f} s of CPU in {wall:.3f} s of stepping: the learner spun"


@pytest.mark.usefixtures("cpus_to_spare")
def test_spinning_or_not_the_steps_are_the_same(start_servers: Any) -> None:
    addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=2, transport="unix")
    actions = [np.random.default_rng(t).integers(0, 2, size=4) for t in range(100)]
    runs = []
    for spin_wait in (0.0, 0.01):
        with RemoteVectorEnv(addresses, spin_wait=spin_wait, num_groups=2) as envs:
            assert [c.spin_wait for c in envs._clients] == [spin_wait, spin_wait]
            run: list[tuple[Any, ...]] = [envs.reset(seed=1), *(envs.step(a) for a in actions[:50])]
            for a in actions[50:]:  # pipelined: recv() waits too (for either group: sorted after)
                envs.send(a[:2], 0)
                envs.send(a[2:], 1)
                run += sorted([envs.recv(), envs.recv()], key=lambda result: result[0])
            runs.append(run)
    assert_same(runs[0], runs[1])


@pytest.mark.parametrize("hung_first", [True, False])
def test_a_server_that_stops_answering_is_a_timeout_on_the_step_socket(
    unix_server: tuple[subprocess.Popen[str], str], start_servers: Any, hung_first: bool
) -> None:
    proc, hung = unix_server
    fine = start_servers("CartPole-v1", envs_per_server=2, transport="unix")
    with RemoteVectorEnv([hung, *fine] if hung_first else [*fine, hung], timeout=1.0) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))
        assert all(c.step_socket for c in envs._clients)
        proc.send_signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(RemoteTimeoutError, match=f"env server {hung}: Step failed .DEADLINE_EXCEEDED."):
                envs.step(np.zeros(4, dtype=np.int64))
            assert time.monotonic() - start < 10, "a timeout, not a wait for ever"
        finally:
            proc.send_signal(signal.SIGCONT)


def test_an_answer_that_cannot_be_joined_is_reported_and_the_others_are_still_read(
    start_servers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=2, transport="unix")
    with RemoteVectorEnv(addresses) as envs:
        envs.reset(seed=0)
        take, taken = RemoteVectorEnv._take, []

        def take_or_fail_once(self: RemoteVectorEnv, server: int, *args: Any) -> None:
            taken.append(server)
            if len(taken) == 1:  # the first server's answer, while the second still steps
                raise ValueError("observations: cannot be joined")
            take(self, server, *args)

        monkeypatch.setattr(RemoteVectorEnv, "_take", take_or_fail_once)
        with pytest.raises(ValueError, match="cannot be joined"):
            envs.step(np.zeros(4, dtype=np.int64))
        assert taken == [0, 1], "the second server's answer was read all the same"
        envs.reset(seed=1)
        _, rewards, *_ = envs.step(np.zeros(4, dtype=np.int64))  # both connections in step
        assert rewards.tolist() == [1.0] * 4


@pytest.mark.parametrize(("cpus", "expected"), [(2, 0.0), (3, 0.002)])
def test_the_learner_waits_awake_only_if_every_local_server_keeps_a_cpu(
    start_servers: Any, monkeypatch: pytest.MonkeyPatch, cpus: int, expected: float
) -> None:
    # 2 step-socket servers + the learner: 3 processes, spinning only with 3 CPUs or more.
    monkeypatch.setattr("learner.remote.usable_cpus", lambda: cpus)
    addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=1, transport="unix")
    with RemoteVectorEnv(addresses, spin_wait=0.002) as envs:
        assert [c.spin_wait for c in envs._clients] == [expected, expected]


@pytest.mark.parametrize(
    ("transport", "num_servers", "cpus", "expected"),
    [("unix", 2, 2, ["--spin-wait-ms", "0.5"]), ("unix", 3, 2, []), ("tcp", 1, 8, [])],
)
def test_local_servers_wait_awake_for_steps_only_on_step_sockets_with_a_cpu_each(
    monkeypatch: pytest.MonkeyPatch, transport: str, num_servers: int, cpus: int, expected: list[str]
) -> None:
    monkeypatch.setattr("learner.local.usable_cpus", lambda: cpus)
    with LocalServers("CartPole-v1", num_servers, 1, transport=transport) as servers:
        for proc in servers._procs:
            args = list(cast(Sequence[str], proc.args))  # (Popen.args: the list LocalServers gave)
            assert args[args.index("--spin-wait-ms") :][:2] == expected if expected else "--spin-wait-ms" not in args


@pytest.mark.slow
def test_servers_waiting_awake_or_asleep_step_the_same(start_servers: Any) -> None:
    actions = [np.random.default_rng(t).integers(0, 2, size=4) for t in range(100)]
    runs = []
    for spin_wait_ms in (0.0, 2.0):
        addresses = start_servers("CartPole-v1", 2, 2, transport="unix", spin_wait_ms=spin_wait_ms)
        with RemoteVectorEnv(addresses) as envs:
            runs.append([envs.reset(seed=1), *(envs.step(a) for a in actions)])
    assert_same(runs[0], runs[1])


class _Transport:
    """What a step-socket connection asks of its asyncio transport while it lingers."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.unsent = 0

    def get_extra_info(self, name: str) -> socket.socket:
        assert name == "socket"
        return self.sock

    def get_write_buffer_size(self) -> int:
        return self.unsent


class _Recorder:
    """An asyncio transport that keeps what is written to it."""

    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True


class _Service:
    """What the step socket asks of the service to admit a connection: whose session is live."""

    def __init__(self, live: str) -> None:
        self.live = live
        self.on_session_end = None

    def owns(self, session_id: str) -> bool:
        return session_id == self.live


def _connection(server: StepSocketServer, stepped_in: str, *, admit: bool = True) -> _Connection:
    connection = _Connection(server)
    connection.transport = _Recorder()  # type: ignore[assignment]
    connection.stepped_in = stepped_in
    if admit:
        assert server.admit(connection)
    return connection


def _frames(data: bytes) -> list[tuple[int, bytes]]:
    frames = []
    while data:
        length, kind = FRAME_HEADER.unpack_from(data)
        frames.append((kind, data[FRAME_HEADER.size : FRAME_HEADER.size + length]))
        data = data[FRAME_HEADER.size + length :]
    return frames


@pytest.fixture
def lingering() -> Iterator[tuple[_Connection, socket.socket]]:
    """A step-socket connection (spin wait 0.3 s) that has just answered a step, and the learner's end."""
    server_end, learner_end = socket.socketpair()
    connection = _Connection(StepSocketServer(service=None, path="", spin_wait_s=0.3))  # type: ignore[arg-type]
    connection.transport = _Transport(server_end)  # type: ignore[assignment]
    connection.answered_at = time.perf_counter()
    yield connection, learner_end
    server_end.close()
    learner_end.close()


def _linger_seconds(connection: _Connection) -> float:
    start = time.monotonic()
    connection.linger()
    return time.monotonic() - start


def test_a_server_that_answered_a_quick_learner_looks_for_its_next_step_awake(
    lingering: tuple[_Connection, socket.socket],
) -> None:
    connection, learner_end = lingering
    assert _linger_seconds(connection) >= 0.3, "nothing came: it waited the whole spin wait"
    learner_end.send(b"\0")  # the next frame's first byte
    assert _linger_seconds(connection) < 0.2, "it returned to the loop as soon as the frame came"


def test_a_server_sleeps_at_once_for_a_learner_that_pauses_or_an_answer_not_all_sent(
    lingering: tuple[_Connection, socket.socket],
) -> None:
    connection, _ = lingering
    assert isinstance(connection.transport, _Transport)
    connection.transport.unsent = 100  # the rest of the answer is sent by the loop: let it
    assert _linger_seconds(connection) < 0.2
    connection.transport.unsent = 0
    gaps = []
    for _ in range(3):  # the learner came back 1 s after each answer (counted as 2 x 0.3 s)
        connection.answered_at = time.perf_counter() - 1.0
        connection.note_gap()
        gaps.append(connection.recent_gap)
    assert gaps == pytest.approx([0.15, 0.2625, 0.346875])
    connection.answered_at = time.perf_counter()
    assert _linger_seconds(connection) < 0.2, "its recent gaps are over the spin wait: no waiting awake"


def test_servers_given_envfleet_spin_wait_ms_keep_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENVFLEET_SPIN_WAIT_MS", "0")
    monkeypatch.setattr("learner.local.usable_cpus", lambda: 8)
    with LocalServers("CartPole-v1", 1, 1, transport="unix") as servers:
        assert "--spin-wait-ms" not in list(cast(Sequence[str], servers._procs[0].args))


@pytest.mark.parametrize("spin_wait", [-0.001, 2.0, "1ms", None, True])
def test_a_bad_spin_wait_is_refused_by_name(spin_wait: Any) -> None:
    with pytest.raises(ValueError, match=r"spin_wait: expected seconds in \[0, 1\], got"):
        RemoteVectorEnv("unix:/nonexistent", spin_wait=spin_wait)


def test_a_bad_action_is_refused_before_it_is_sent(start_servers: Any) -> None:
    addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=2, transport="unix")
    with RemoteVectorEnv(addresses) as envs:
        envs.reset(seed=0)
        with pytest.raises(InvalidRequestError, match="env 3"):
            envs.step(np.array([0, 1, 0, 5]))
        envs.step(np.array([0, 1, 0, 1]))


def test_an_unreachable_step_socket_means_grpc_and_a_log_line(
    start_servers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    (address,) = start_servers("CartPole-v1", num_servers=1, envs_per_server=2, transport="unix")
    os.unlink(address.removeprefix("unix:") + STEP_SOCKET_SUFFIX)  # as if in another mount namespace
    with caplog.at_level(logging.INFO, logger="learner.client"), RemoteVectorEnv(address) as envs:
        envs.reset(seed=0)
        for _ in range(5):
            envs.step(np.zeros(2, dtype=np.int64))
        assert envs._clients[0].step_socket == ""
    assert "step socket" in caplog.text and "stepping over gRPC" in caplog.text


class _OutOfFileDescriptors(types.ModuleType):
    """learner.client's socket module, whose socket() fails as with every file descriptor in use (EMFILE)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(socket, name)

    @staticmethod
    def socket(*args: Any, **kwargs: Any) -> socket.socket:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))


def test_no_file_descriptor_left_for_the_step_socket_means_grpc_and_a_line_saying_so(
    start_servers: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of file descriptors as it makes the step socket's connection (socket() itself fails), a learner
    steps over gRPC, on the channel it holds already, as where the socket is out of reach, and says why
    (was: the step's OSError, a raw traceback out of ``learner train``)."""
    (address,) = start_servers("CartPole-v1", num_servers=1, envs_per_server=2, transport="unix")
    rng = np.random.default_rng(5)
    actions = [rng.integers(0, 2, size=2) for _ in range(10)]
    with RemoteVectorEnv(address, step_socket=False) as envs:
        expected = [envs.reset(seed=1)] + [envs.step(a) for a in actions]
    monkeypatch.setattr(learner.client, "socket", _OutOfFileDescriptors("socket"))
    with caplog.at_level(logging.WARNING, logger="learner.client"), RemoteVectorEnv(address) as envs:
        got = [envs.reset(seed=1)] + [envs.step(a) for a in actions]
        assert envs._clients[0].step_socket == ""
    assert_same(got, expected)
    lines = [r.getMessage() for r in caplog.records if "stepping over gRPC" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert "cannot be used: out of file descriptors (ulimit -n is " in lines[0] and "raise ulimit -n" in lines[0]


@pytest.fixture
def unix_server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    path = tmp_path / "env.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--num-envs", "2", "--unix-socket", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line == f"listening on unix:{path}", line
    yield proc, f"unix:{path}"
    proc.kill()
    proc.wait(timeout=10)
    proc.stdout.close()


def test_a_killed_server_is_a_lost_server_and_a_fault_tolerant_fleet_steps_on(
    unix_server: tuple[subprocess.Popen[str], str], start_servers: Any
) -> None:
    proc, address = unix_server
    other = start_servers("CartPole-v1", num_servers=1, envs_per_server=2, transport="unix")
    with RemoteVectorEnv([address, *other], fault_tolerant=True, timeout=5) as tolerant:
        assert all(c.step_socket for c in tolerant._clients)
        tolerant.reset(seed=0)
        tolerant.step(np.zeros(4, dtype=np.int64))
        proc.kill()
        proc.wait(timeout=10)
        _, _, _, truncations, infos = tolerant.step(np.zeros(4, dtype=np.int64))
        assert truncations[:2].all() and infos["env_unavailable"][:2].all()
        _, rewards, *_ = tolerant.step(np.zeros(4, dtype=np.int64))
        assert rewards[2:].tolist() == [1.0, 1.0]  # the other server's envs step on


def test_a_plain_fleet_reports_the_killed_server(unix_server: tuple[subprocess.Popen[str], str]) -> None:
    proc, address = unix_server
    with RemoteVectorEnv(address, timeout=5) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))
        proc.kill()
        proc.wait(timeout=10)
        with pytest.raises(ServerUnavailableError, match="step socket broke"):
            envs.step(np.zeros(2, dtype=np.int64))


def test_a_learner_hears_that_its_server_shut_down(unix_server: tuple[subprocess.Popen[str], str]) -> None:
    proc, address = unix_server
    with RemoteVectorEnv(address, timeout=5) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        with pytest.raises(ServerUnavailableError, match="shutting down"):
            envs.step(np.zeros(2, dtype=np.int64))


def test_sigterm_tells_an_idle_connection_the_server_is_shutting_down(
    unix_server: tuple[subprocess.Popen[str], str],
) -> None:
    proc, address = unix_server
    claimed = Session(address, num_envs=2)
    sock = claimed.connect()
    session_step = claimed.step(sock, [0, 1])
    assert session_step.rewards.data
    proc.send_signal(signal.SIGTERM)
    error = _error(sock)
    assert error.code == grpc.StatusCode.UNAVAILABLE.value[0] and "shutting down" in error.message
    assert proc.wait(timeout=20) == 0
    assert not os.path.exists(claimed.step_socket)
    claimed.close()


class _FullStepSocket:
    """Squats on a step socket's path and refuses every connection as a step socket whose places are
    all taken does (a RESOURCE_EXHAUSTED StepError, then close): ``when="connecting"`` as it accepts
    the connection, ``"first step"`` once the first frame is in (the refusal a learner meets when its
    frame went out before the server's refusal came in)."""

    def __init__(self, path: str, when: str) -> None:
        os.unlink(path)  # (the server's own: gone, as if full)
        self.when = when
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen()
        self.listener.settimeout(0.1)
        self.connections = 0
        self.frames = 0  # read before refusing ("first step")
        self.sent_after = 0  # bytes that came after the refusal was sent (a step sent all the same)
        self.refusing = threading.Event()  # set once a refusal is sent
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._refuse, daemon=True)
        self.thread.start()

    def _refuse(self) -> None:
        refusal = pb.StepError(
            code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
            message=f"step socket: {MAX_CONNECTIONS} connections are open already; close one, or step over gRPC",
        )
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            with conn:
                self.connections += 1
                conn.settimeout(10)
                if self.when == "first step":
                    _answer(conn)  # (a frame read as an answer is read: header and payload)
                    self.frames += 1
                conn.sendall(_frame(FRAME_ERROR, refusal.SerializeToString()))
                self.refusing.set()
                while chunk := conn.recv(65536):  # (until the learner closes the connection)
                    self.sent_after += len(chunk)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)
        self.listener.close()


@pytest.mark.parametrize("when", ["connecting", "first step"])
def test_a_step_socket_that_refuses_the_connection_means_grpc_and_a_log_line(
    start_servers: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """A server's step socket with every place taken (by others' connections) refuses a learner's
    connection before reading a frame of it: the learner steps over gRPC instead, says so once,
    and its results are those of stepping over gRPC all along, fault-tolerant or not."""
    (address,) = start_servers("CartPole-v1", num_servers=1, envs_per_server=3, transport="unix")
    rng = np.random.default_rng(2)
    actions = [rng.integers(0, 2, size=3) for _ in range(30)]
    with RemoteVectorEnv(address, step_socket=False) as envs:
        expected = [envs.reset(seed=4)] + [envs.step(a) for a in actions]
    path = address.removeprefix("unix:") + STEP_SOCKET_SUFFIX
    connect = socket.socket.connect
    for fault_tolerant in (False, True):
        full = _FullStepSocket(path, when)

        def connect_then_wait(sock: socket.socket, to: Any, full: _FullStepSocket = full) -> None:
            connect(sock, to)
            if to == path:
                assert full.refusing.wait(10)  # (the refusal is in before the step would go out)

        if when == "connecting":
            monkeypatch.setattr(socket.socket, "connect", connect_then_wait)
        try:
            with caplog.at_level(logging.WARNING, logger="learner.client"):
                caplog.clear()
                with RemoteVectorEnv(address, fault_tolerant=fault_tolerant) as envs:
                    assert envs._clients[0].step_socket == path
                    got = [envs.reset(seed=4)] + [envs.step(a) for a in actions]
                    assert envs._clients[0].step_socket == ""
                    assert envs.fault_stats().failures == 0
        finally:
            full.close()
        assert_same(got, expected)
        # One connection; "connecting": no step went out on it; "first step": one, answered with the refusal.
        assert (full.connections, full.frames, full.sent_after) == (1, 1 if when == "first step" else 0, 0)
        lines = [r.getMessage() for r in caplog.records if "refused the connection" in r.getMessage()]
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"env server {label_of(address)}: its step socket {path} refused"), lines[0]
        assert "connections are open already" in lines[0] and "over gRPC" in lines[0]


def _stepped_on_the_socket(address: str, caplog: pytest.LogCaptureFixture) -> str:
    """Reset and step a RemoteVectorEnv on ``address``; the step socket it stepped on (its connection
    open after the steps, no line saying it went over gRPC)."""
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="learner.client"), RemoteVectorEnv(address) as envs:
        envs.reset(seed=0)
        for _ in range(3):
            envs.step(np.zeros(envs.num_envs, dtype=np.int64))
        client = envs._clients[0]
        assert client.step_socket and client._socket is not None, caplog.text
        assert envs.fault_stats().failures == 0
    assert "stepping over gRPC" not in caplog.text
    return client.step_socket


def test_the_step_socket_is_found_beside_the_socket_the_learner_reached_through_a_symlink(
    spawn_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The server names its step socket by its own path; a learner reaching it by another path (a
    symlinked folder) steps on the one beside its own, and says the two differ at DEBUG only."""
    with tempfile.TemporaryDirectory(prefix="ef-") as folder:  # (short: Unix socket paths are)
        os.mkdir(f"{folder}/real")
        os.symlink(f"{folder}/real", f"{folder}/link")
        spawn_server("CartPole-v1", 2, "--unix-socket", f"{folder}/real/env.sock")
        assert _stepped_on_the_socket(f"unix:{folder}/link/env.sock", caplog) == f"{folder}/link/env.sock.steps"
        said = [r for r in caplog.records if "names its step socket" in r.getMessage()]
        assert (
            len(said) == 1
            and said[0].levelno == logging.DEBUG
            and f"{folder}/real/env.sock.steps" in said[0].getMessage()
        )
        # (reached by its own path: the same path, nothing said)
        assert _stepped_on_the_socket(f"unix:{folder}/real/env.sock", caplog) == f"{folder}/real/env.sock.steps"
        assert "names its step socket" not in caplog.text


def test_a_step_socket_path_named_in_the_server_s_file_system_only_is_not_followed(
    spawn_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """As a server in a container whose socket folder is mounted elsewhere on the learner's host: the
    path it names does not exist here, or (worse) is another server's step socket here. The learner
    steps on its own server's, beside the Unix socket it reached (the one it named was followed: the
    first, out of reach, meant gRPC; the second meant every step refused and the server lost)."""
    with tempfile.TemporaryDirectory(prefix="ef-") as folder:
        os.mkdir(f"{folder}/srv")
        spawn_server("CartPole-v1", 2, "--unix-socket", f"{folder}/srv/env.sock")
        os.rename(f"{folder}/srv", f"{folder}/mnt")  # it names {folder}/srv/env.sock.steps, now nowhere
        ours = f"unix:{folder}/mnt/env.sock"
        assert _stepped_on_the_socket(ours, caplog) == f"{folder}/mnt/env.sock.steps"
        os.mkdir(f"{folder}/srv")
        other = spawn_server("CartPole-v1", 3, "--unix-socket", f"{folder}/srv/env.sock")  # ... now another's
        assert _stepped_on_the_socket(ours, caplog) == f"{folder}/mnt/env.sock.steps"
        assert _stepped_on_the_socket(other.address, caplog) == f"{folder}/srv/env.sock.steps"


@pytest.mark.parametrize("fault_tolerant", [False, True])
def test_another_server_s_step_socket_beside_ours_means_grpc_not_a_lost_server(
    spawn_server: Any, caplog: pytest.LogCaptureFixture, fault_tolerant: bool
) -> None:
    """A step socket at the path beside the server's Unix socket that is another server's: the first step
    on it is answered FAILED_PRECONDITION ("does not own this server"), untaken. The learner steps over
    gRPC instead, says so once, and its results are those of stepping over gRPC all along."""
    with tempfile.TemporaryDirectory(prefix="ef-") as folder:
        server = spawn_server("CartPole-v1", 3, "--unix-socket", f"{folder}/a.sock")
        spawn_server("CartPole-v1", 3, "--unix-socket", f"{folder}/b.sock")
        rng = np.random.default_rng(3)
        actions = [rng.integers(0, 2, size=3) for _ in range(20)]
        with RemoteVectorEnv(server.address, step_socket=False) as envs:
            expected = [envs.reset(seed=5)] + [envs.step(a) for a in actions]
        os.unlink(f"{folder}/a.sock.steps")  # (its server still listens there, out of reach)
        os.symlink(f"{folder}/b.sock.steps", f"{folder}/a.sock.steps")
        caplog.clear()
        with caplog.at_level(logging.DEBUG, logger="learner.client"):
            for _ in range(2):  # (said once per server: the second learner's line is at DEBUG)
                with RemoteVectorEnv(server.address, fault_tolerant=fault_tolerant) as envs:
                    assert envs._clients[0].step_socket == f"{folder}/a.sock.steps"
                    got = [envs.reset(seed=5)] + [envs.step(a) for a in actions]
                    assert envs._clients[0].step_socket == ""
                    assert envs.fault_stats().failures == 0
                assert_same(got, expected)
        said = [r for r in caplog.records if "does not know this session" in r.getMessage()]
        assert [r.levelno for r in said] == [logging.WARNING, logging.DEBUG], caplog.text
        message = said[0].getMessage()
        assert server.address in message and "another server's step socket at that path?" in message
        assert "stepping over gRPC, without the step socket's fast path" in message


def test_a_server_leaves_the_socket_of_a_server_that_took_its_path_during_its_teardown(spawn_server: Any) -> None:
    """A server whose teardown (its envs' close) outlasts its listening: another server started at its
    path meanwhile keeps its socket, and its step socket, when the first one exits (was: the first one's
    teardown removed the gRPC socket file, leaving the new server unreachable)."""
    with tempfile.TemporaryDirectory(prefix="ef-") as folder:
        path, gate = f"{folder}/env.sock", Path(folder) / "gate"
        first = spawn_server(
            "tests.envs:CloseGateEnv", 1, "--env-kwargs", f'{{"gate": "{gate}"}}', "--unix-socket", path
        )
        assert first.proc is not None
        first.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not gate.exists():  # (its teardown closes its envs, held there: it listens no more)
            assert time.monotonic() < deadline, "the first server did not close its envs within 30 s of SIGTERM"
            time.sleep(0.01)
        second = spawn_server("CartPole-v1", 1, "--unix-socket", path)
        gate.unlink()
        assert first.proc.wait(timeout=30) == 0
        assert os.path.exists(path) and os.path.exists(path + STEP_SOCKET_SUFFIX)
        with RemoteVectorEnv(second.address, timeout=10) as envs:
            envs.reset(seed=0)
            envs.step(np.zeros(1, dtype=np.int64))
            assert envs._clients[0].step_socket == path + STEP_SOCKET_SUFFIX


def test_a_socket_made_at_the_path_since_is_not_removed_even_with_the_inode_number_of_the_old_one() -> None:
    """ext4 gives a removed file's inode number to the next file made (a server started at the path
    during another's teardown unlinks the old socket and binds anew): the file is told by its change
    time too (was: by its inode number alone, so the first server's teardown removed the second's
    socket, now and then, in CI)."""
    with tempfile.TemporaryDirectory(prefix="ef-") as folder:
        path = f"{folder}/env.sock"
        with socket.socket(socket.AF_UNIX) as first:
            first.bind(path)
            made = file_identity(path)
        assert made is not None
        os.unlink(path)  # (as the second server's bind does)
        time.sleep(0.01)  # (a server's start takes longer: coarse clocks tick every 1-4 ms)
        with socket.socket(socket.AF_UNIX) as second:
            second.bind(path)
            remove_own_file(path, made)
            assert os.path.exists(path)
            remove_own_file(path, file_identity(path))
            assert not os.path.exists(path)


@pytest.mark.parametrize("transport", ["Step", "StepStream", "step socket"])
def test_an_answer_larger_than_a_message_fails_the_step_internal_naming_its_size(
    start_servers: Any, transport: str
) -> None:
    """An env whose step info takes 70 MB: every way to step says so (INTERNAL, the answer's size and
    the limit), and the next step asks for a reset (was: gRPC's own RESOURCE_EXHAUSTED, a traceback in
    the server's log; on the step socket, a 70 MB frame the learner refuses)."""
    (address,) = start_servers(
        "tests.envs:BigInfoEnv", num_servers=1, envs_per_server=1, transport="unix", env_kwargs={"after": 0}
    )
    session = Session(address, num_envs=1)
    try:
        request = _step_request(session.id, [0])
        if transport == "step socket":
            with session.connect() as sock:
                sock.sendall(_frame(FRAME_STEP, request.SerializeToString()))
                error = _error(sock)
            code, details = grpc.StatusCode.INTERNAL.value[0], error.message
            assert error.code == code, error
        else:
            with pytest.raises(grpc.RpcError) as info:
                if transport == "Step":
                    session.stub.Step(request, timeout=60)
                else:
                    next(iter(session.stub.StepStream(iter([request]), timeout=60)))
            assert info.value.code() == grpc.StatusCode.INTERNAL, info.value.details()
            details = str(info.value.details())
        assert re.fullmatch(
            r"the Step answer would take 70,000,\d{3} bytes, over the 67,108,864 bytes \(64 MiB\) a message may take: "
            r"its infos take 70,000,\d{3}; reset before stepping again, and have the env put less in its infos "
            r"\(a large array: send it in parts, or on request\)",
            details,
        ), details
        with pytest.raises(grpc.RpcError, match="whose answer was too large to send"):
            session.stub.Step(request, timeout=60)
    finally:
        session.close()


def test_a_reset_answer_larger_than_a_message_fails_the_reset_naming_its_size_and_the_server_serves_on(
    start_servers: Any,
) -> None:
    """An env whose reset info takes 70 MB: the reset fails saying so, with advice for a Reset (was: "reset
    before stepping again", which gives the same infos again), and the server serves on."""
    (address,) = start_servers(
        "tests.envs:BigInfoEnv", num_servers=1, envs_per_server=1, transport="unix", env_kwargs={"reset_mb": 70.0}
    )
    with RemoteVectorEnv(address) as envs:
        for _ in range(2):
            with pytest.raises(EnvCrashedError) as info:
                envs.reset(seed=0)
            assert re.fullmatch(
                r"env server local-0: Reset failed \[INTERNAL\]: the Reset answer would take 70,000,\d{3} bytes, over "
                r"the 67,108,864 bytes \(64 MiB\) a message may take: its infos take 70,000,\d{3}; have the env put "
                r"less in the infos its reset returns \(resetting again gives them again\) \(a large array: send it "
                r"in parts, or on request\)",
                str(info.value),
            ), str(info.value)
    with RemoteVectorEnv(address) as envs:  # (the server took the next session)
        assert envs.num_envs == 1


@pytest.mark.parametrize("method", ["step", "reset"])
def test_a_fault_tolerant_fleet_raises_an_answer_too_large_at_once(start_servers: Any, method: str) -> None:
    """The env's infos, which every reconnect's reset or step gives again: raised as the env's error, as an
    observation that does not fit is (was: the server taken for lost, then back, then lost again at every
    other step, its envs' steps cut; `learner train` went on for its whole --total-timesteps, learning nothing)."""
    kwargs = {"after": 1} if method == "step" else {"reset_mb": 70.0}
    (address,) = start_servers("tests.envs:BigInfoEnv", 1, 1, transport="unix", env_kwargs=kwargs)
    with RemoteVectorEnv(address, fault_tolerant=True) as envs:
        with pytest.raises(
            EnvCrashedError,
            match=f"{method.capitalize()} failed \\[INTERNAL\\]: the {method.capitalize()} answer would take 70,000,",
        ):
            envs.reset(seed=0)
            envs.step(np.zeros(1, dtype=np.int64))  # (its first step's infos are small)
            envs.step(np.zeros(1, dtype=np.int64))
        assert envs.fault_stats().failures == envs.fault_stats().reconnects == 0


def _wmem_max() -> int:
    """The largest send buffer a socket may ask for on this host (net.core.wmem_max), or 0 if unknown."""
    try:
        return int(Path("/proc/sys/net/core/wmem_max").read_text())
    except (OSError, ValueError):
        return 0


def _queued(sock: socket.socket) -> int:
    """Bytes that have arrived on ``sock`` and are not read yet."""
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0])


def test_a_large_answer_leaves_in_one_write(start_servers: Any) -> None:
    """An answer larger than a socket's default send buffer (~1 MB here, Atari-sized observations say)
    is in the learner's socket whole, at once, where the host lets the server grow its send buffer
    (was: a fraction of it, the rest copied and sent over several turns of the server's loop as the
    learner read it; with the copies of the answer made for each step, 1.5-3x gRPC's time a step)."""
    if _wmem_max() < 3_000_000:
        pytest.skip(f"net.core.wmem_max is {_wmem_max()} bytes here: a socket may not hold a ~1 MB answer")
    (address,) = start_servers(
        "tests.envs:BigInfoEnv", envs_per_server=1, transport="unix", env_kwargs={"mb": 1.0, "after": 0}
    )
    session = Session(address, num_envs=1)
    try:
        with session.connect() as sock:
            for t in (1, 2):
                sock.sendall(_frame(FRAME_STEP, _step_request(session.id, [0]).SerializeToString()))
                length, kind = FRAME_HEADER.unpack(_read_exactly(sock, FRAME_HEADER.size))
                assert kind == FRAME_STEP and length > 1_000_000
                deadline = time.monotonic() + 1.0
                while _queued(sock) < length and time.monotonic() < deadline:
                    time.sleep(0.001)  # (the payload's bytes are on their way: the server wrote it after the header)
                assert _queued(sock) == length, f"{_queued(sock)} bytes of the {length}-byte answer were sent"
                answer = pb.StepResponse.FromString(_read_exactly(sock, length))
                assert codec.decode_value(answer.observations, "observations").tolist() == [[t]]
    finally:
        session.close()


def test_a_connection_reads_its_answers_into_one_buffer_that_no_answer_shares(start_servers: Any) -> None:
    """The learner reads a connection's answers into one buffer, sized to each (a new one per answer
    took ~200 fresh pages a step for an 800 KB answer); what it hands out is the answers' own: an
    answer read earlier keeps its values while later ones are read into the buffer."""
    (address,) = start_servers(
        "tests.envs:BigInfoEnv", envs_per_server=1, transport="unix", env_kwargs={"mb": 0.5, "after": 0}
    )
    with RemoteVectorEnv(address) as envs:
        envs.reset(seed=0)
        client = envs._clients[0]
        steps = []
        for _ in range(3):
            request = client.step_request()
            codec.encode_value(np.zeros(1, dtype=np.int64), request.actions, "actions")
            step = client.send_on_socket(request)
            assert step is not None
            step.wait(time.monotonic() + 10)
            steps.append(step)
        answers = [step.result()[0] for step in steps]
        assert all(step._payload is client._socket_buffer for step in steps)
        assert len(client._socket_buffer) == answers[-1].ByteSize()
        assert [codec.decode_value(a.observations, "observations").tolist() for a in answers] == [[[1]], [[2]], [[3]]]
        assert all(codec.decode_value(a.infos, "infos")["big"].shape == (1, 62_500) for a in answers)


@pytest.mark.parametrize("left", ["during the step", "with part of the answer unsent"])
def test_a_step_whose_learner_left_before_its_answer_asks_for_a_reset(
    start_servers: Any, tmp_path: Path, left: str
) -> None:
    """A learner that closes its connection while its step runs (a slow env's, whose step the server
    runs off its loop, reading nothing meanwhile), or before the whole of a large answer is sent, never
    sees where the envs went: the session's next step is refused until a reset, as after a StepStream
    cancelled during its step (was: the answer dropped unnoticed, and the next step taken as usual)."""
    gate = tmp_path / "gate"
    kwargs: dict[str, Any]
    if left == "during the step":
        env, kwargs = "tests.envs:GateEnv", {"gate": str(gate)}
    else:  # (an answer larger than the socket can hold, however far the server grows its send buffer)
        mb = max(1.0, 3 * _wmem_max() / 1e6)
        if mb > 60:
            pytest.skip(f"net.core.wmem_max is {_wmem_max()} bytes here: a socket holds any answer whole")
        env, kwargs = "tests.envs:BigInfoEnv", {"mb": mb, "after": 0}
    (address,) = start_servers(env, envs_per_server=1, transport="unix", env_kwargs=kwargs)
    session = Session(address, num_envs=1)
    try:
        sock = session.connect()
        sock.sendall(_frame(FRAME_STEP, _step_request(session.id, [0]).SerializeToString()))
        if left == "during the step":
            deadline = time.monotonic() + 10
            while not gate.exists():  # (the step is in progress, held at the gate)
                assert time.monotonic() < deadline, "the step did not start within 10 s"
                time.sleep(0.01)
            sock.close()
            gate.unlink()  # (the step ends)
        else:
            _read_exactly(sock, FRAME_HEADER.size)  # (the answer is being sent)
            sock.close()
            time.sleep(0.3)  # (for the server to find that it cannot send the rest)
        with session.connect() as sock:  # (the next step: one sent while the last still runs waits for it)
            sock.sendall(_frame(FRAME_STEP, _step_request(session.id, [0]).SerializeToString()))
            kind, payload = _answer(sock)
        assert kind == FRAME_ERROR, "the next step was taken"
        error = pb.StepError.FromString(payload)
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0], error
        assert "the envs stepped for an earlier Step whose caller gave up on it" in error.message, error
    finally:
        session.close()


def test_a_session_that_ended_before_a_connection_s_first_step_is_a_session_error_and_the_socket_stays(
    start_servers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A session released (or timed out) before the first step on a new connection: the step socket
    refuses that step as it would another server's session, and gRPC, asked next, refuses it too. The
    step is that session error, and nothing else (was: a warning that the step socket was another
    server's, and the step socket turned off)."""
    (address,) = start_servers("CartPole-v1", envs_per_server=2, transport="unix")
    with caplog.at_level(logging.DEBUG, logger="learner.client"), RemoteVectorEnv(address) as envs:
        envs.reset(seed=0)
        client = envs._clients[0]
        assert client.step_socket and client._socket is None  # (no step yet: the first connects)
        with grpc.insecure_channel(address) as channel:
            pb_grpc.EnvServiceStub(channel).Release(pb.ReleaseRequest(session_id=client.session_id), timeout=10)
        with pytest.raises(SessionError, match=r"Step failed \[FAILED_PRECONDITION\]: session '\w+' does not own"):
            envs.step(np.zeros(2, dtype=np.int64))
        assert client.step_socket, "the step socket stays: it is the server's own"
    assert "does not know this session" not in caplog.text and "stepping over gRPC" not in caplog.text
