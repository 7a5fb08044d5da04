"""What a caller, with the token or without, can make a server hold: calls in progress, the requests
they carry, health Watch streams, metrics connections, and what of its data errors and log lines copy."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
import time
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import gymnasium as gym
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import env_server.metrics
from env_server import codec
from env_server.config import DEFAULT_MAX_CONCURRENT_RPCS, MIN_MAX_CONCURRENT_RPCS, ServerConfig
from env_server.interceptors import MAX_WATCH_STREAMS
from env_server.metrics import ServerMetrics
from env_server.protocol import bearer_metadata
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from env_server.validation import InvalidActionError, check_actions
from learner import RemoteVectorEnv
from learner.errors import ServerBusyError, ServerFullError
from tests.conftest import SpawnServer, needs_proc

TOKEN = "s3cret-token_for.limits"
MB = 1024 * 1024
STEP = "/envfleet.v1.EnvService/Step"
WATCH = health_pb2.HealthCheckRequest(service="")
FULL = "Concurrent RPC limit exceeded!"  # (gRPC's own words, for a call past --max-concurrent-rpcs)


def _check(channel: grpc.Channel) -> health_pb2.HealthCheckResponse:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)


def _until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


# -- calls in progress: --max-concurrent-rpcs -----------------------------------------------------------


def test_max_concurrent_rpcs_is_checked_and_defaults_to_a_learners_needs_many_times_over() -> None:
    assert ServerConfig(env="CartPole-v1").max_concurrent_rpcs == DEFAULT_MAX_CONCURRENT_RPCS == 32
    for wrong in (3, 2**31):  # (gRPC's core counts them in a C int: more failed once the envs were built)
        with pytest.raises(
            ValueError,
            match=rf"max_concurrent_rpcs: expected an integer in \[{MIN_MAX_CONCURRENT_RPCS}, 2147483647\], got ",
        ):
            ServerConfig(env="CartPole-v1", max_concurrent_rpcs=wrong)


def test_calls_past_the_limit_are_refused_resource_exhausted_and_logged(spawn_server: SpawnServer) -> None:
    """Four calls in progress (GetSpec calls whose requests have not come, on a server without a token)
    on a server that serves four at once: the next call is refused at once, RESOURCE_EXHAUSTED, and
    the server says why in its log; once one ends, calls are served again."""
    server = spawn_server("CartPole-v1", 1, "--max-concurrent-rpcs", "4")
    never = threading.Event()

    def requests() -> Iterator[pb.GetSpecRequest]:
        never.wait()
        yield from ()

    with grpc.insecure_channel(server.address) as channel:
        get_spec = channel.stream_unary(
            "/envfleet.v1.EnvService/GetSpec",
            request_serializer=pb.GetSpecRequest.SerializeToString,
            response_deserializer=pb.GetSpecResponse.FromString,
        )
        streams = [get_spec.future(requests(), timeout=60) for _ in range(4)]

        def full() -> bool:
            for i, call in enumerate(streams):
                if call.done():  # (refused: a Check of this test's had a place when it came)
                    streams[i] = get_spec.future(requests(), timeout=60)
            try:
                _check(channel)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
                return True
            return False

        _until(full, "the four calls are in progress")  # (nothing answers them: no way to see them arrive)
        with pytest.raises(grpc.RpcError) as info:
            _check(channel)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.details() == FULL
        # A learner is told what is full and what to do.
        with pytest.raises(
            ServerBusyError, match=r"the server is serving as many calls as it takes at once \(env-"
        ) as busy:
            RemoteVectorEnv([server.address], connect_timeout=5).close()
        assert isinstance(busy.value, ServerFullError)  # (not this process's own claim, nor another learner's)
        streams[0].cancel()

        def served() -> bool:
            try:
                return _check(channel).status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # (until the cancel is through)
                return False

        _until(served, "a call is served once a call in progress ended")
        for stream in streams[1:]:
            stream.cancel()
        never.set()
    logs = server.logs()
    # (the first refused may be a GetSpec of this test's, refused while a Check had a place)
    assert re.search(
        r"refusing /(grpc\.health\.v1\.Health/Check|envfleet\.v1\.EnvService/GetSpec) and every new call with "
        r"RESOURCE_EXHAUSTED until some end: 4 calls are in progress, the most this server serves at once "
        r"\(--max-concurrent-rpcs\)",
        logs,
    ), logs


def test_watch_streams_past_their_limit_are_refused_and_their_places_come_back(spawn_server: SpawnServer) -> None:
    """Watch needs no token and stays open as long as its caller likes: a few at most, so that they
    cannot take every place --max-concurrent-rpcs allows."""
    server = spawn_server("CartPole-v1", 1)
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        streams = [stub.Watch(WATCH, timeout=60) for _ in range(MAX_WATCH_STREAMS)]
        for stream in streams:
            assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            next(stub.Watch(WATCH, timeout=10))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{MAX_WATCH_STREAMS} Watch streams are open on this server" in info.value.details()
        assert _check(channel).status == health_pb2.HealthCheckResponse.SERVING  # (other calls are served)
        streams[0].cancel()

        def watched() -> bool:
            stream = stub.Watch(WATCH, timeout=60)
            try:
                return next(stream).status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                return False
            finally:
                stream.cancel()

        _until(watched, "a Watch stream is served once one ended")
        for stream in streams[1:]:
            stream.cancel()
    assert "Watch streams are open, the most this server keeps" in server.logs()


# -- callers without the token ------------------------------------------------------------------------


def test_a_call_without_the_token_is_refused_before_its_request_is_sent(spawn_server: SpawnServer) -> None:
    """A unary call whose request never comes (its caller sends the headers only) is refused at once,
    UNAUTHENTICATED: it holds no place under --max-concurrent-rpcs, and none of its bytes, while it waits."""
    server = spawn_server("CartPole-v1", 1, "--auth-token", TOKEN)

    async def refused() -> tuple[grpc.StatusCode, float]:
        never = asyncio.Event()

        async def requests() -> AsyncIterator[bytes]:
            await never.wait()
            yield b""

        async with grpc.aio.insecure_channel(server.address) as channel:
            # (a Step as the wire carries it: a stream of one message, here none yet)
            call = channel.stream_unary(STEP, request_serializer=None, response_deserializer=None)(
                requests(), timeout=30
            )
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            return info.value.code(), time.monotonic() - started

    code, elapsed = asyncio.run(refused())
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert elapsed < 10, f"refused after {elapsed:.1f} s: the server waited for the request"


@needs_proc
def test_a_flood_of_large_calls_without_the_token_leaves_the_servers_memory_as_it_was(
    spawn_server: SpawnServer,
) -> None:
    """100 calls of 4 MB at once on one connection, none with the token (the reviewer's repro): a
    server that read each request before refusing it grew by ~400 MB (peak RSS); refused unread, by
    a few MB."""
    server = spawn_server("CartPole-v1", 1, "--auth-token", TOKEN)
    assert server.proc is not None
    before = _peak_rss(server.proc.pid)
    payload = b"\x0a" + bytes(4_000_000 - 1)

    async def flood() -> set[grpc.StatusCode]:
        options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", -1)]
        async with grpc.aio.insecure_channel(server.address, options=options) as channel:
            step = channel.unary_unary(STEP, request_serializer=None, response_deserializer=None)
            results = await asyncio.gather(*(step(payload, timeout=60) for _ in range(100)), return_exceptions=True)
        assert all(isinstance(r, grpc.aio.AioRpcError) for r in results), results
        return {r.code() for r in results if isinstance(r, grpc.aio.AioRpcError)}

    codes = asyncio.run(flood())
    # (UNAVAILABLE: streams past the connection's limit, sent before the client heard of it, are reset)
    assert codes <= {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE}, codes
    assert grpc.StatusCode.UNAUTHENTICATED in codes
    grown = _peak_rss(server.proc.pid) - before
    assert grown < 150 * MB, f"peak RSS grew by {grown / MB:.0f} MB"
    # It serves on, those with the token first of all.
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        assert stub.GetSpec(pb.GetSpecRequest(), timeout=10, metadata=bearer_metadata(TOKEN)).spec.num_envs == 1


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/PID/status")


# -- the metrics endpoint ------------------------------------------------------------------------------


@pytest.fixture
def metrics_port(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A metrics endpoint in this process that waits 0.5 s for a request's bytes, 1.5 s for a connection in
    all, and serves 2 connections at once."""
    monkeypatch.setattr(env_server.metrics, "HTTP_TIMEOUT_S", 0.5)
    monkeypatch.setattr(env_server.metrics, "HTTP_DEADLINE_S", 1.5)
    monkeypatch.setattr(env_server.metrics, "MAX_HTTP_CONNECTIONS", 2)
    metrics = ServerMetrics(env_id="CartPole-v1", num_envs=1, vectorization="sync")
    yield metrics.serve_http("127.0.0.1", 0)
    metrics.close()


def _scrape(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        return b"".join(iter(lambda: sock.recv(65536), b""))


def _closed_within(sock: socket.socket, timeout: float) -> float:
    """Seconds until the server closed ``sock`` (nothing sent back); fails if it did not within ``timeout``."""
    started = time.monotonic()
    sock.settimeout(timeout)
    with contextlib.suppress(ConnectionResetError):  # (closed with the request unread: a reset)
        assert sock.recv(1024) == b""
    return time.monotonic() - started


@pytest.mark.slow
def test_a_half_sent_request_to_the_metrics_endpoint_is_closed_after_the_timeout(metrics_port: int) -> None:
    for sent in (b"", b"GET /metrics HTTP/1.1\r\n", b"GET /metr"):
        with socket.create_connection(("127.0.0.1", metrics_port), timeout=10) as sock:
            sock.sendall(sent)
            assert 0.3 < _closed_within(sock, 5.0) < 3.0, sent
    assert b"envfleet_num_envs 1.0" in _scrape(metrics_port)


@pytest.mark.slow
def test_a_request_sent_a_byte_at_a_time_is_closed_at_the_deadline(metrics_port: int) -> None:
    """Each byte within the timeout, so only the deadline on the whole connection ends it."""
    with socket.create_connection(("127.0.0.1", metrics_port), timeout=10) as sock:
        started = time.monotonic()
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for byte in b"GET /metrics HTTP/1.1\r\nHost: x" * 10:
                sock.sendall(bytes([byte]))
                time.sleep(0.2)
                if time.monotonic() - started > 5:
                    break
        took = time.monotonic() - started
        assert 1.3 < took < 4.0, took
    assert b"envfleet_num_envs 1.0" in _scrape(metrics_port)


def test_the_metrics_endpoint_serves_a_few_connections_at_once_and_closes_more(
    metrics_port: int, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each connection has a thread: past the limit a new one is not given one more thread but takes
    the place of the oldest whose request has not come (and the log says so): connections held open
    without a request cannot keep scrapes out."""
    monkeypatch.setattr(env_server.metrics, "HTTP_TIMEOUT_S", 60.0)  # (the idle ones stay, unless closed for room)
    monkeypatch.setattr(env_server.metrics, "HTTP_DEADLINE_S", 60.0)
    idle = [socket.create_connection(("127.0.0.1", metrics_port), timeout=10) for _ in range(2)]
    try:
        time.sleep(0.1)  # (taken in: each holds its thread)
        assert b"envfleet_num_envs 1.0" in _scrape(metrics_port)
        assert _closed_within(idle[0], 5.0) < 5.0  # (the oldest, closed for the scrape)
        assert (
            "metrics endpoint: 2 connections open, the most it serves at once; closed the oldest whose request "
            "had not come (from 127.0.0.1), for one from 127.0.0.1"
        ) in caplog.text
    finally:
        for sock in idle:
            sock.close()
    _until(lambda: b"envfleet_num_envs" in _scrape(metrics_port), "a scrape is served again")


# -- what errors copy of the client's data -------------------------------------------------------------


def _nested(depth: int, key_chars: int, bottom: int | None = None) -> pb.Value:
    """A value of ``depth`` nested dicts, each of one key of ``key_chars`` characters, down to the int
    ``bottom`` (None: an empty value, which does not decode)."""
    root = value = pb.Value()
    for level in range(depth):
        value.map.keys.append(chr(ord("A") + level % 26) * key_chars)
        value = value.map.values.add()
    if bottom is not None:
        value.int64 = bottom
    return root


def test_decoding_deep_dicts_of_long_keys_takes_no_more_memory_than_the_keys() -> None:
    """The place each level names (for errors) is made only when an error needs it, and bounded: a
    3.6 MB value 45 dicts deep took 87 MB to decode when each level's was made as it went."""
    message = pb.Value.FromString(_nested(45, 80_000, bottom=1).SerializeToString())
    tracemalloc.start()
    try:
        decoded = codec.decode_value(message, "actions")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    for _ in range(45):
        (decoded,) = decoded.values()
    assert decoded == 1
    assert peak < 2 * message.ByteSize(), f"{peak / MB:.1f} MB to decode {message.ByteSize() / MB:.1f} MB"


def test_an_error_deep_in_a_value_names_the_place_in_a_few_hundred_characters() -> None:
    message = _nested(45, 80_000)  # (the bottom value is empty: an error)
    with pytest.raises(codec.CodecError) as info:
        codec.decode_value(message, "actions")
    text = str(info.value)
    assert len(text) < 700, len(text)
    assert text.startswith(f"actions[{'A' * 40!r}... (80000 characters)][{'B' * 40!r}... (80000 characters)]")
    assert "[... 37 levels ...]" in text
    empty = "not set (an empty Value: none of its kinds is set)"
    assert text.endswith(f"[{'S' * 40!r}... (80000 characters)]: {empty}")
    # Short keys and indexes, as before.
    value = pb.Value()
    value.map.keys.append("obs")
    value.map.values.add().list.values.add()
    with pytest.raises(codec.CodecError, match=r"^actions\['obs'\]\[0\]: not set \(an empty Value"):
        codec.decode_value(value, "actions")


def test_the_keys_a_client_sent_are_shown_in_a_few_hundred_characters() -> None:
    space = gym.spaces.Dict({"move": gym.spaces.Discrete(2), "pick": gym.spaces.Discrete(3)})
    sent = {f"{i:04d}" + "k" * 1000: np.zeros(1, dtype=np.int64) for i in range(2000)}
    with pytest.raises(InvalidActionError) as info:
        check_actions(space, sent, 1)
    text = str(info.value)
    assert text.startswith("actions: expected keys ['move', 'pick'], got ['0000kkkk")
    assert "... (1004 characters)" in text and text.endswith(", ...] (2000 keys)")
    assert len(text) < 400, len(text)
    # A few short ones are all shown, as before.
    with pytest.raises(InvalidActionError, match=r"expected keys \['move', 'pick'\], got \['move', 'jump'\]$"):
        check_actions(space, {"move": np.zeros(1, dtype=np.int64), "jump": np.zeros(1, dtype=np.int64)}, 1)


def test_a_large_bad_action_is_shown_by_its_ends() -> None:
    space = gym.spaces.Box(-1.0, 1.0, (100_000,), dtype=np.float32)
    actions = np.zeros((1, 100_000), dtype=np.float32)
    actions[0, -1] = np.nan
    with pytest.raises(InvalidActionError) as info:
        check_actions(space, actions, 1)
    assert str(info.value) == (
        "actions: env 0: action has NaN or infinite values: [ 0.,  0.,  0., ...,  0.,  0., nan] "
        "(100000 values, shape (100000,))"
    )


def test_a_server_refuses_many_long_keys_with_a_short_error_and_log_line(spawn_server: SpawnServer) -> None:
    """End to end: a Step whose actions are a dict of 2000 keys of 1000 characters (2 MB), to a server
    of a Dict action space: INVALID_ARGUMENT, whose message, and the server's log line of it, show a
    few keys and how many came."""
    server = spawn_server("tests.envs:FuzzEnv", 1)
    request = pb.StepRequest()
    for i in range(2000):
        request.actions.map.keys.append(f"{i:04d}" + "k" * 1000)
        codec.encode_value(np.zeros(1, dtype=np.int64), request.actions.map.values.add())
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        request.session_id = stub.Handshake(pb.HandshakeRequest(client_name="limits"), timeout=10).session_id
        stub.Reset(pb.ResetRequest(session_id=request.session_id), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            stub.Step(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details()
    assert details is not None and "(2000 keys)" in details and len(details) < 600, details
    lines = [line for line in server.logs().splitlines() if "refused Step" in line]
    assert len(lines) == 1 and "(2000 keys)" in lines[0] and len(lines[0]) < 1000, lines
