"""A port that is no env server's gRPC port is named for what it is: an HTTP/1 port (an env server's
own --metrics-port, say), an SSH server, a gRPC server without envfleet's EnvService."""

from __future__ import annotations

import contextlib
import re
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health, health_pb2_grpc

from learner import RemoteVectorEnv
from learner.discovery import TLS_CAUSE, diagnose, no_wait_mends, probe
from learner.errors import RemoteEnvError, ServerUnavailableError
from tests.certs import make_server_certs
from tests.conftest import SpawnServer

HTTP_PORT = (
    "it is an HTTP/1 port (an env server's --metrics-port? or an HTTP proxy whose listener takes no HTTP/2 without "
    "TLS, h2c, as gRPC speaks it: Caddy needs protocols h1 h2 h2c in its servers options), not an env server's "
    "gRPC port"
)
SSH_PORT = "it is an SSH server's port, not an env server's gRPC port"


@pytest.fixture
def metrics_and_grpc(spawn_server: SpawnServer) -> tuple[str, str]:
    """A real env server's Prometheus port (127.0.0.1:PORT) and its gRPC port."""
    server = spawn_server("CartPole-v1", 1, "--metrics-port", "0", "--log-level", "info")
    match = re.search(r"Prometheus metrics on http://(\S+)/metrics", server.logs())
    assert match, server.logs()
    return match.group(1), server.address


@contextlib.contextmanager
def _serving(handle: Callable[[socket.socket], None]) -> Iterator[str]:
    """A TCP server on 127.0.0.1, in a thread, that calls ``handle`` on each connection (then closes it;
    an OSError, a timeout after 2 s say, ends it quietly): its address."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)
    stopped = threading.Event()

    def serve() -> None:
        while not stopped.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2)
                with contextlib.suppress(OSError):
                    handle(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stopped.set()
        thread.join(timeout=10)
        listener.close()


def _ssh_banner(conn: socket.socket) -> None:
    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
    while conn.recv(4096):
        pass


@pytest.fixture
def ssh_like() -> Iterator[str]:
    """A port whose server speaks first, as SSH servers do (their version banner), then reads on."""
    with _serving(_ssh_banner) as address:
        yield address


def test_probe_names_an_http1_port_an_ssh_server_and_nothing_for_an_env_server(
    metrics_and_grpc: tuple[str, str], ssh_like: str
) -> None:
    metrics, env_server = metrics_and_grpc
    assert probe(metrics) == HTTP_PORT
    assert probe(ssh_like) == SSH_PORT
    assert probe(env_server) is None  # a gRPC server: it answers gRPC's opening with HTTP/2
    with socket.socket() as listening:  # one that says nothing: told within the probe's time, not after it
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert probe(f"127.0.0.1:{listening.getsockname()[1]}", timeout=0.3) is None
    assert no_wait_mends(HTTP_PORT) and no_wait_mends(SSH_PORT) and no_wait_mends(f"{TLS_CAUSE}the handshake failed")
    assert not no_wait_mends("connection refused") and not no_wait_mends("") and not no_wait_mends(None)


@pytest.mark.slow
def test_a_learner_pointed_at_a_metrics_port_is_told_it_is_one(metrics_and_grpc: tuple[str, str]) -> None:
    metrics, env_server = metrics_and_grpc
    start = time.monotonic()
    with pytest.raises(ServerUnavailableError, match=re.escape(HTTP_PORT)):
        RemoteVectorEnv([metrics], connect_timeout=60)
    assert time.monotonic() - start < 30  # said once probed (~2 s), not after connect_timeout: no wait mends it
    # Fault-tolerant, with a server in and a host down before it in the list: a wrong port is still an error
    # (each address that did not answer is probed, not the first only).
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        down = f"127.0.0.1:{closed.getsockname()[1]}"
    with pytest.raises(ServerUnavailableError, match=rf"env server {re.escape(metrics)}: {re.escape(HTTP_PORT)}"):
        RemoteVectorEnv([env_server, down, metrics], fault_tolerant=True, connect_timeout=2)


@pytest.fixture
def grpc_without_env_service() -> Iterator[str]:
    """A real gRPC server on port 0 with the standard health service only."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_a_grpc_port_without_env_service_is_said_to_serve_none(grpc_without_env_service: str) -> None:
    """gRPC's own "Method not found!" named neither the service nor what to check."""
    address = grpc_without_env_service
    with pytest.raises(RemoteEnvError) as info:
        RemoteVectorEnv([address], connect_timeout=5)
    assert str(info.value) == (
        f"env server {address}: Handshake failed [UNIMPLEMENTED]: it answers gRPC but serves no "
        "envfleet.v1.EnvService: the wrong port, or a server of another envfleet protocol version "
        "(Method not found!)"
    )
    assert info.value.address == address and info.value.code == grpc.StatusCode.UNIMPLEMENTED


def test_a_server_older_than_step_stream_is_named_so_at_its_first_step() -> None:
    """envfleet's first servers stepped by unary calls: one answers Handshake and Reset, then gRPC's bare
    "Method not found!" for every step, which named neither the method nor what to do."""
    argv = [sys.executable, "-m", "tests.old_server", "--env", "CartPole-v1", "--num-envs", "1", "--port", "0"]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        try:
            assert proc.stdout is not None
            address = proc.stdout.readline().strip().removeprefix("listening on ")
            with RemoteVectorEnv([address], connect_timeout=30) as envs:
                envs.reset(seed=0)
                with pytest.raises(RemoteEnvError) as info:
                    envs.step(np.zeros(1, dtype=np.int64))
            assert str(info.value) == (
                f"env server {address}: Step failed [UNIMPLEMENTED]: it serves no StepStream, which this learner "
                "steps on: an envfleet.v1 server must serve it for the Python learner (envfleet's own first "
                "versions did not: upgrade those) (Method not found!)"
            )
        finally:
            proc.kill()


def test_a_tls_port_that_answers_plain_grpc_in_http1_is_not_called_an_http1_port(
    tmp_path: Path, metrics_and_grpc: tuple[str, str], ssh_like: str
) -> None:
    """An nginx TLS proxy in front of env servers answers a plain gRPC opening with HTTP/1's 400 ("The plain
    HTTP request was sent to HTTPS port"): `learner servers --tls-ca` called it "an HTTP/1 port" and gave up,
    while the learner itself trained through it. Under TLS the probe is a TLS handshake."""
    certs = make_server_certs(tmp_path / "certs")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certs.cert, certs.key)

    def tls_or_http1(conn: socket.socket) -> None:
        if conn.recv(1, socket.MSG_PEEK) == b"\x16":  # a TLS ClientHello
            with context.wrap_socket(conn, server_side=True) as tls:
                tls.recv(1)
        else:
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\nServer: nginx\r\n\r\n")

    with _serving(tls_or_http1) as address:
        assert probe(address) == HTTP_PORT  # (what the plain opening got)
        assert diagnose(address, 1.0, tls=True, roots=certs.ca.read_bytes()) == ""  # (TLS is fine: not the cause)
        # TLS mistakes there were all called "an HTTP/1 port" (the plain answer won): no CA, another CA, another
        # name, as they are said without the proxy.
        assert diagnose(address, 1.0, tls=False) == (
            "TLS: the server speaks TLS, this client does not: pass its CA (tls=..., learner train --tls-ca)"
        )
        other_ca = make_server_certs(tmp_path / "other").ca.read_bytes()
        for roots, name in ((other_ca, None), (certs.ca.read_bytes(), "other.test")):
            said = diagnose(address, 1.0, tls=True, roots=roots, server_name=name)
            assert said is not None and said.startswith("TLS: ") and "HTTP/1" not in said, said
    # Ports without TLS are still named for what they are under TLS (the diff's review).
    assert diagnose(metrics_and_grpc[0], 1.0, tls=True) == HTTP_PORT
    assert diagnose(ssh_like, 1.0, tls=True) == SSH_PORT
