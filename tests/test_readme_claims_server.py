"""README claims about the env server, checked on real servers (subprocesses, port 0 or Unix sockets).

- SIGTERM: steps in flight finish for up to ``--grace`` seconds, and the server exits 0 ("Server lifecycle").
- SIGTERM ends idle step streams (gRPC's StepStream, the step socket's connections) within a second.
- The token is compared in constant time (``hmac.compare_digest``; a structural check, not a timing one).
- A TLS mismatch (a TLS learner at a plaintext server, or the reverse) is named within ~2 s, not after
  ``connect_timeout``.
- The step socket serves a server started with a token: its learner steps there, and a client without
  the token gets no session, so it can step neither over gRPC nor over the step socket.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import json
import logging
import queue
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest

import env_server.interceptors
from env_server import codec
from env_server.interceptors import TokenAuthInterceptor
from env_server.protocol import AUTH_METADATA_KEY, FRAME_ERROR, FRAME_HEADER, FRAME_STEP
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from env_server.server import HARD_EXIT_STATUS
from learner import AuthenticationError, RemoteVectorEnv, ServerUnavailableError
from tests.certs import make_server_certs
from tests.conftest import SpawnServer, StartServers
from tests.test_step_socket import _answer

TOKEN = "readme-claims_token.42"


# -- helpers ---------------------------------------------------------------------------------------------------


# `python -m env_server ARGS` whose run() is given the exit margin sys.argv[1] (instead of EXIT_MARGIN_S, 10 s):
# the real command otherwise, for the tests of the watchdog's hard exit, which would each wait the 10 s out.
_WITH_EXIT_MARGIN = """
import functools, sys
from env_server.tuning import prefer_fast_grpc_core
prefer_fast_grpc_core()  # (before grpc is imported, as env_server.__main__.main does it)
import env_server.server
env_server.server.run = functools.partial(env_server.server.run, exit_margin_s=float(sys.argv.pop(1)))
from env_server.__main__ import main
sys.exit(main())
"""


def env_server_argv(*args: str, exit_margin_s: float | None = None) -> list[str]:
    """The command line of ``python -m env_server ARGS``; with ``exit_margin_s``, of the same server whose
    watchdog exits that many seconds (not EXIT_MARGIN_S) after the grace period or the teardown's start."""
    if exit_margin_s is None:
        return [sys.executable, "-m", "env_server", *args]
    return [sys.executable, "-c", _WITH_EXIT_MARGIN, str(exit_margin_s), *args]


def _server(
    tmp_path: Path, *args: str, unix: bool = False, exit_margin_s: float | None = None
) -> tuple[subprocess.Popen[str], str, Path]:
    """An env-server subprocess (its log in a file): (process, address, log file); ``exit_margin_s``: see
    :func:`env_server_argv`."""
    argv = [*env_server_argv(*args, exit_margin_s=exit_margin_s), "--log-level", "info"]
    argv += ["--unix-socket", str(tmp_path / "env.sock")] if unix else ["--host", "127.0.0.1", "--port", "0"]
    log = tmp_path / "server.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith("listening on "):
        proc.kill()
        proc.wait(timeout=30)
        raise RuntimeError(f"env-server did not start: {line!r} {log.read_text()[-2000:]}")
    return proc, line.removeprefix("listening on "), log


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)
    if proc.stdout is not None:
        proc.stdout.close()


def _wait_for_file(path: Path, within: float) -> None:
    deadline = time.monotonic() + within
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {within:g} s"
        time.sleep(0.01)


def _step_request(session_id: str, actions: list[int]) -> pb.StepRequest:
    request = pb.StepRequest(session_id=session_id)
    codec.encode_value(np.array(actions, dtype=np.int64), request.actions, "actions")
    return request


def _socket_step(sock: socket.socket, session_id: str, actions: list[int]) -> tuple[int, bytes]:
    """Send one step frame on a step-socket connection; the answer's (kind, payload)."""
    payload = _step_request(session_id, actions).SerializeToString()
    sock.sendall(FRAME_HEADER.pack(len(payload), FRAME_STEP) + payload)
    return _answer(sock)


def _collect_failed_fleets() -> None:
    """Collect, here in the test's thread, what a RemoteVectorEnv whose constructor raised leaves behind.

    Left to the cyclic garbage collector, its ``__del__`` (which closes it on this thread's event loop)
    may run on another thread (a LocalServers reader, say) and run this thread's loop there, while this
    thread wants it: "RuntimeError: This event loop is already running" (seen once on a busy machine)."""
    gc.collect()


def _connect_unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(path)
    return sock


# -- SIGTERM: the grace period ---------------------------------------------------------------------------------

GRACE_S = 1.0
SHORT_EXIT_MARGIN_S = 2.0
"""The exit margin of the servers whose hard exit a test waits for (EXIT_MARGIN_S, 10 s, by default)."""


def _hold_a_step_in_the_env(
    tmp_path: Path, exit_margin_s: float | None = None, close_log: Path | None = None
) -> tuple[subprocess.Popen[str], RemoteVectorEnv, Path]:
    """A server whose env holds its second step (tests.envs.GateEnv, up to 30 s) with ``--grace 1``; a
    learner whose step is in flight there. ``close_log``: where the env's close says whether a step ran."""
    gate = tmp_path / "gate"
    kwargs: dict[str, Any] = {"gate": str(gate), "at": 2, "hold_s": 30.0}
    if close_log is not None:
        kwargs["close_log"] = str(close_log)
    # (--step-delay-ms: slow enough that steps run on the env thread, not the event loop)
    args = ["--env", "tests.envs:GateEnv", "--num-envs", "1", "--env-kwargs", json.dumps(kwargs)]
    args += ["--grace", str(GRACE_S), "--step-delay-ms", "200"]
    proc, address, _ = _server(tmp_path, *args, exit_margin_s=exit_margin_s)
    try:
        envs = RemoteVectorEnv([address], timeout=60)
        envs.reset(seed=0)
        envs.step(np.zeros(1, dtype=np.int64))  # opens the step stream
        envs.step_async(np.zeros(1, dtype=np.int64))
        _wait_for_file(gate, within=30)  # the step is in the env, held there
    except BaseException:
        _stop(proc)
        raise
    return proc, envs, gate


def test_a_step_in_flight_past_the_grace_is_cut_off_at_the_grace(tmp_path: Path) -> None:
    """A step that outlasts ``--grace`` is not waited for: the learner hears of it about ``--grace``
    seconds after the SIGTERM (not at its 60 s deadline, nor when the env's step ends)."""
    proc, envs, gate = _hold_a_step_in_the_env(tmp_path)
    try:
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(ServerUnavailableError):  # (gRPC's own "Cancelling all calls")
            envs.step_wait()
        elapsed = time.monotonic() - start
        assert GRACE_S * 0.5 <= elapsed < GRACE_S + 14, f"the step in flight was cut off after {elapsed:.1f} s"
        assert gate.exists(), "the env's step was still held (so it was the grace that ended the call)"
        gate.unlink()  # let the env's step end
        assert proc.wait(timeout=60) == 0
    finally:
        envs.close()
        _stop(proc)


@pytest.mark.slow
def test_a_server_exits_within_its_grace_while_an_env_step_hangs(tmp_path: Path) -> None:
    """The env thread cannot be stopped: a stopped server whose env call still runs after the grace
    period (its teardown given the exit margin: EXIT_MARGIN_S, here SHORT_EXIT_MARGIN_S) exits without
    waiting for it, saying so, with status 1; its envs are not closed under that call (was: closed
    while the step ran, which a simulator may not survive)."""
    closes = tmp_path / "closes"
    proc, envs, gate = _hold_a_step_in_the_env(tmp_path, exit_margin_s=SHORT_EXIT_MARGIN_S, close_log=closes)
    try:
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        bound = GRACE_S + SHORT_EXIT_MARGIN_S + 10
        try:
            code = proc.wait(timeout=bound)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {bound:g} s after SIGTERM with --grace {GRACE_S:g} (the env's step is held)")
        assert code == HARD_EXIT_STATUS and time.monotonic() - start < bound  # (not a clean shutdown)
        assert not closes.exists(), closes.read_text()
        text = (tmp_path / "server.log").read_text()
        assert "the envs' step (running for " in text, text
        assert (
            "still runs on the env thread: the envs were not closed (closed under it, an env may crash or hang); "
            "exiting without waiting for it (status 1)"
        ) in text, text
    finally:
        gate.unlink(missing_ok=True)
        envs.close()
        _stop(proc)


@pytest.mark.slow
def test_a_step_that_outlasts_the_grace_has_the_envs_closed_after_it_not_under_it(tmp_path: Path) -> None:
    """The teardown waits (within the exit margin) for an env call still running on the env thread, then
    closes the envs and exits 0 (was: closed them while the step ran, a second after the grace)."""
    closes = tmp_path / "closes"
    proc, envs, gate = _hold_a_step_in_the_env(tmp_path, close_log=closes)
    try:
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(ServerUnavailableError):  # (cut off at the grace: the teardown begins)
            envs.step_wait()
        time.sleep(2.0)  # (the envs were closed within a second of that)
        assert proc.poll() is None and not closes.exists(), closes.read_text()
        gate.unlink()  # let the env's step end
        assert proc.wait(timeout=60) == 0
        assert closes.read_text() == "closed\n"
    finally:
        gate.unlink(missing_ok=True)
        envs.close()
        _stop(proc)


# -- SIGTERM: idle step streams end within a second ----------------------------------------------------------


@pytest.mark.parametrize("transport", ["StepStream", "step socket"])
def test_sigterm_ends_an_idle_step_stream_within_about_a_second(tmp_path: Path, transport: str) -> None:
    """A session that stepped and now waits (its stream open, nothing in flight), on a server with
    ``--grace 60``: on SIGTERM the stream ends UNAVAILABLE "shutting down" within about a second
    (here: well under the grace), and the server, with nothing else in flight, exits 0 long before
    the grace is up."""
    unix = transport == "step socket"
    proc, address, _ = _server(tmp_path, "--env", "CartPole-v1", "--num-envs", "2", "--grace", "60", unix=unix)
    channel = grpc.insecure_channel(address)
    requests: queue.Queue[pb.StepRequest | None] = queue.Queue()
    try:
        stub = pb_grpc.EnvServiceStub(channel)
        handshake = stub.Handshake(pb.HandshakeRequest(client_name="idle"), timeout=30)
        session_id = handshake.session_id
        stub.Reset(pb.ResetRequest(session_id=session_id), timeout=30)
        if unix:
            assert handshake.step_socket, "a Unix-socket server offers its step socket"
            sock = _connect_unix(handshake.step_socket)
            kind, _ = _socket_step(sock, session_id, [0, 1])
            assert kind == FRAME_STEP
        else:

            def stream() -> Iterator[pb.StepRequest]:
                while (request := requests.get()) is not None:
                    yield request

            answers = stub.StepStream(stream(), timeout=120)
            requests.put(_step_request(session_id, [0, 1]))
            assert list(next(answers).rewards.data)  # stepped; the stream stays open, idle

        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        if unix:
            kind, payload = _answer(sock)
            ended = time.monotonic() - start
            assert kind == FRAME_ERROR
            error = pb.StepError.FromString(payload)
            code, details = error.code, error.message
            assert sock.recv(1) == b"", "the connection is closed after the error"
            sock.close()
        else:
            with pytest.raises(grpc.RpcError) as info:
                next(answers)
            ended = time.monotonic() - start
            code, details = info.value.code().value[0], info.value.details()
        assert code == grpc.StatusCode.UNAVAILABLE.value[0] and "shutting down" in details, details
        assert ended < 10, f"the idle stream ended {ended:.1f} s after SIGTERM"
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - start < 30, "exited long before the 60 s grace"
    finally:
        requests.put(None)
        channel.close()
        _stop(proc)


# -- the token comparison is constant-time ---------------------------------------------------------------------


class _CompareSpy:
    """Stands in for ``compare_digest`` (hmac's, and secrets' alias of it): records its arguments and
    answers ``answer`` (None: what the real one says)."""

    def __init__(self) -> None:
        self.real = hmac.compare_digest
        self.calls: list[tuple[bytes, bytes]] = []
        self.answer: bool | None = None

    def __call__(self, a: Any, b: Any) -> bool:
        self.calls.append((bytes(a), bytes(b)))
        return self.real(a, b) if self.answer is None else self.answer


def _intercept(interceptor: TokenAuthInterceptor, metadata: tuple[tuple[str, str], ...]) -> tuple[Any, Any]:
    """(what the interceptor gives for a Step call carrying ``metadata``, the real handler)."""
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: None)

    async def continuation(details: Any) -> Any:
        return handler

    details = SimpleNamespace(method="/envfleet.v1.EnvService/Step", invocation_metadata=metadata)
    return asyncio.run(interceptor.intercept_service(continuation, details)), handler


def test_the_token_is_compared_with_compare_digest_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The token check calls ``compare_digest`` with the whole ``Bearer <token>`` for every call, whatever
    its token (missing, shorter, longer, the same length), and its answer alone decides: no ``==`` and
    no length check first, which would take less time for a token that differs sooner."""
    spy = _CompareSpy()
    monkeypatch.setattr(hmac, "compare_digest", spy)
    monkeypatch.setattr(secrets, "compare_digest", spy)
    if hasattr(env_server.interceptors, "compare_digest"):  # (imported by name: patched there too)
        monkeypatch.setattr(env_server.interceptors, "compare_digest", spy)
    interceptor = TokenAuthInterceptor(TOKEN)
    expected = f"Bearer {TOKEN}".encode()

    got, handler = _intercept(interceptor, ((AUTH_METADATA_KEY, f"Bearer {TOKEN}"),))
    assert got is handler
    assert spy.calls == [(expected, expected)]
    for given in ("", f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", f"Bearer {TOKEN[:-1]}X", TOKEN):
        spy.calls.clear()
        metadata = ((AUTH_METADATA_KEY, given),) if given else ()
        got, handler = _intercept(interceptor, metadata)
        assert got is not handler, f"{given!r} let through"
        assert len(spy.calls) == 1 and sorted(spy.calls[0]) == sorted([given.encode(), expected]), (given, spy.calls)
    # Its answer decides: a wrong token that compare_digest accepted would get through.
    spy.answer = True
    got, handler = _intercept(interceptor, ((AUTH_METADATA_KEY, "Bearer wrong"),))
    assert got is handler


# -- a TLS mismatch is named within ~2 s ---------------------------------------------------------------------


@pytest.mark.parametrize("mismatch", ["TLS learner, plaintext server", "plaintext learner, TLS server"])
@pytest.mark.slow
def test_a_tls_mismatch_is_named_within_seconds_not_after_connect_timeout(
    spawn_server: SpawnServer, tmp_path: Path, mismatch: str
) -> None:
    certs = make_server_certs(tmp_path / "certs")
    if mismatch.startswith("TLS learner"):
        server = spawn_server("CartPole-v1", 1)
        options: dict[str, Any] = {"tls": certs.ca}
        reason = "TLS: the server does not speak TLS"
    else:
        server = spawn_server("CartPole-v1", 1, "--tls-cert", str(certs.cert), "--tls-key", str(certs.key))
        options = {}
        reason = "TLS: the server speaks TLS, this client does not"
    start = time.monotonic()
    with pytest.raises(ServerUnavailableError) as info:
        RemoteVectorEnv([server.address], connect_timeout=120, **options)
    elapsed = time.monotonic() - start
    _collect_failed_fleets()
    assert reason in str(info.value) and server.address in str(info.value), info.value
    assert elapsed < 15, f"named after {elapsed:.1f} s (connect_timeout 120 s)"


# -- the step socket on a server with a token ------------------------------------------------------------------


def test_the_step_socket_works_on_a_server_with_a_token_and_serves_no_one_without_it(
    start_servers: StartServers, caplog: pytest.LogCaptureFixture
) -> None:
    """A learner with the token steps over the step socket (no fallback to gRPC); a client without it is
    refused its handshake, and with no session id the step socket, which checks no token, steps nothing
    for it: the learner's envs (ClockEnv: the observation tells the steps taken) go on undisturbed."""
    length = 100
    (address,) = start_servers(
        "tests.envs:ClockEnv", 1, 2, transport="unix", auth_token=TOKEN, env_kwargs={"length": length}
    )
    assert address.startswith("unix:")

    def step(envs: RemoteVectorEnv, t: int) -> None:
        obs, rewards, *_ = envs.step(np.full(2, t % 2, dtype=np.int64))
        assert rewards.tolist() == [1.0, 1.0]  # (the action that matches the time's parity)
        assert np.allclose(obs[:, 0], (t + 1) / length), (t, obs)

    with caplog.at_level(logging.INFO, logger="learner"), RemoteVectorEnv([address], auth_token=TOKEN) as envs:
        envs.reset(seed=0)
        for t in range(5):
            step(envs, t)
        step_socket = envs._clients[0].step_socket
        assert step_socket, "the learner steps over the step socket"

        # Without the token: no handshake, so no session id.
        with pytest.raises(AuthenticationError, match="no token was sent"):
            RemoteVectorEnv([address])
        _collect_failed_fleets()
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as info:
                pb_grpc.EnvServiceStub(channel).Handshake(pb.HandshakeRequest(), timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # The step socket itself: a step without the live session's id is refused, nothing stepped.
        for session_id in ("", "made-up-session-id", secrets.token_hex(16)):
            with _connect_unix(step_socket) as sock:
                kind, payload = _socket_step(sock, session_id, [0, 0])
                assert kind == FRAME_ERROR
                error = pb.StepError.FromString(payload)
                assert error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0], error
                assert "does not own this server" in error.message, error.message

        for t in range(5, 8):  # the envs took no step for those frames
            step(envs, t)
        assert envs._clients[0].step_socket == step_socket, "still on the step socket"
    assert "stepping over gRPC" not in caplog.text, caplog.text
