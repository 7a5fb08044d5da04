"""The health probe the container image's HEALTHCHECK runs, against real servers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import env_server.health
from env_server.health import check, default_address, tls_hint
from env_server.server import HealthService
from tests.certs import make_client_certs, make_server_certs
from tests.conftest import SpawnServer, StartServers

HEALTH_FILE = Path(env_server.health.__file__)
SERVICES = ("", "envfleet.v1.EnvService")


def probe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The probe as the image runs it: by path, isolated (-I), so the package's imports are skipped."""
    return subprocess.run(
        [sys.executable, "-I", str(HEALTH_FILE), *args], capture_output=True, text=True, timeout=30, env=env
    )


def test_serving_server_is_healthy_for_the_server_and_the_env_service(start_servers: StartServers) -> None:
    (address,) = start_servers("CartPole-v1", 1, 2)
    assert check(address) == "SERVING"
    assert check(address, "envfleet.v1.EnvService") == "SERVING"
    result = probe("--address", address)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{address}: SERVING"


@pytest.mark.slow
@pytest.mark.skipif(
    not (HEALTH_FILE.parent.parent / ".git").exists() or shutil.which("git") is None, reason="needs a git checkout"
)
def test_a_slow_git_finding_the_commit_does_not_hold_health_checks_up(tmp_path: Path) -> None:
    """The commit (git, for the spec's versions) was found on the event loop as the envs were attached, after the
    server listened: a slow git left health checks unanswered meanwhile. It is found before the server listens."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "git").write_text(f'#!/bin/sh\nsleep 4\nexec {shutil.which("git")} "$@"\n')
    (fake / "git").chmod(0o755)
    environ = {**os.environ, "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    argv = [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--num-envs", "1", "--port", "0"]
    argv += ["--log-format", "text"]
    with subprocess.Popen(argv, env=environ, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stderr is not None
            # ("building 1 x CartPole-v1 (...), listening on port N", after any warning)
            building = next((line for line in proc.stderr if "listening on port" in line), "")
            assert building, "the server ended before it listened"
            address = f"127.0.0.1:{building.split()[-1]}"
            # (the envs are built in ms, then attached: within check's 3 s, where git's two calls take 8 s)
            assert check(address) in ("SERVING", "NOT_SERVING")
        finally:
            proc.kill()


def test_probe_reads_the_port_from_the_servers_environment_variables(start_servers: StartServers) -> None:
    (address,) = start_servers("CartPole-v1", 1, 1, transport="tcp")
    port = address.rpartition(":")[2]
    env = {**os.environ, "ENVFLEET_HOST": "0.0.0.0", "ENVFLEET_PORT": port}
    result = probe(env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"127.0.0.1:{port}: SERVING")


def test_unknown_service_and_nothing_listening_are_unhealthy(start_servers: StartServers) -> None:
    (address,) = start_servers("CartPole-v1", 1, 1)
    result = probe("--address", address, "--service", "no.such.Service")
    assert result.returncode == 1
    assert "no service 'no.such.Service'" in result.stderr
    result = probe("--address", "127.0.0.1:1", "--timeout", "2")
    assert result.returncode == 1
    assert "127.0.0.1:1: unhealthy: UNAVAILABLE" in result.stderr


def test_tls_files_that_cannot_be_used_are_named_as_given_in_one_line(tmp_path: Path) -> None:
    """A CA path from the server's variables was named as --tls-ca, which nobody gave; a file that is no PEM got
    gRPC's C core's log lines and a failed handshake."""
    (tmp_path / "plain.txt").write_text("not a certificate\n")
    environ = {**os.environ, "ENVFLEET_TLS_CERT": "/nope.crt"}
    cases = [
        ([], environ, "cannot read --tls-ca (from ENVFLEET_TLS_CERT) /nope.crt: No such file or directory"),
        (["--tls-ca", "/nope.crt"], None, "cannot read --tls-ca /nope.crt: No such file or directory"),
        (["--tls-ca", str(tmp_path / "plain.txt")], None, f"--tls-ca {tmp_path / 'plain.txt'}: expected a PEM file"),
    ]
    for args, env, said in cases:
        result = probe("--address", "127.0.0.1:1", *args, env=env)
        lines = result.stderr.splitlines()
        assert result.returncode == 1 and len(lines) == 1, result.stderr
        assert lines[0].startswith(f"127.0.0.1:1: unhealthy: {said}"), result.stderr


def test_tls_files_openssl_cannot_read_are_said_in_one_line(tmp_path: Path) -> None:
    """A CA file with a PEM header but broken contents got gRPC's C core's four log lines and a failed handshake
    ("Could not load any root certificate"), as did a client certificate with another's key, or one of the two
    files given as both; one file given for two options was named as the last of them."""
    server = make_server_certs(tmp_path / "server")
    client = make_client_certs(tmp_path / "client", others=("other",))
    broken = tmp_path / "broken.crt"
    broken.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    ca = ["--tls-ca", str(server.ca)]
    cases = [
        (["--tls-ca", str(broken)], f"--tls-ca {broken}: expected PEM CA certificate(s), got ones OpenSSL cannot read"),
        (
            [*ca, "--tls-client-cert", str(client.cert), "--tls-client-key", str(tmp_path / "client" / "other.key")],
            f"--tls-client-cert {client.cert} and --tls-client-key {tmp_path / 'client' / 'other.key'}: expected a "
            "client certificate and its private key",
        ),
        (
            [*ca, "--tls-client-cert", str(client.cert), "--tls-client-key", str(client.cert)],
            f"--tls-client-cert {client.cert} and --tls-client-key {client.cert}: expected",
        ),
        (
            ["--tls-ca", str(broken), "--tls-client-cert", str(broken), "--tls-client-key", str(client.key)],
            f"--tls-ca {broken}: expected PEM CA certificate(s)",
        ),
    ]
    for args, said in cases:
        result = probe("--address", "127.0.0.1:1", "--timeout", "2", *args)
        lines = result.stderr.splitlines()
        assert result.returncode == 1 and len(lines) == 1, result.stderr
        assert lines[0].startswith(f"127.0.0.1:1: unhealthy: {said}"), result.stderr


def test_probe_does_not_import_numpy_or_gymnasium() -> None:
    """Run by path it stays cheap: every replica runs it every few seconds."""
    code = (
        f"import runpy, sys; sys.argv = ['health', '--help']\n"
        f"try: runpy.run_path({str(HEALTH_FILE)!r}, run_name='__main__')\n"
        "except SystemExit: pass\n"
        "print(sorted(m for m in ('numpy', 'gymnasium', 'env_server') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=30, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_default_address() -> None:
    assert default_address({}) == "127.0.0.1:50051"
    assert default_address({"ENVFLEET_HOST": "0.0.0.0", "ENVFLEET_PORT": "6000"}) == "127.0.0.1:6000"
    assert default_address({"ENVFLEET_HOST": "::", "ENVFLEET_PORT": "6000"}) == "[::1]:6000"
    assert default_address({"ENVFLEET_HOST": "10.1.2.3"}) == "10.1.2.3:50051"
    assert default_address({"ENVFLEET_UNIX_SOCKET": "/tmp/env.sock"}) == "unix:/tmp/env.sock"


def test_a_certificate_without_the_probed_name_is_explained(spawn_server: SpawnServer, tmp_path: Path) -> None:
    """Not gRPC's bare "Hostname Verification Check failed": the name checked, and the variable that sets it."""
    certs = make_server_certs(tmp_path, names=("envfleet.test",))  # no 127.0.0.1, no localhost
    server = spawn_server("CartPole-v1", 1, "--tls-cert", str(certs.cert), "--tls-key", str(certs.key))
    environ = {**os.environ, "ENVFLEET_TLS_CERT": str(certs.cert), "ENVFLEET_TLS_CA": str(certs.ca)}
    result = probe("--address", server.address, env=environ)
    assert result.returncode == 1
    assert "Hostname Verification Check failed" in result.stderr
    assert result.stderr.strip().endswith(
        "(TLS: the server's certificate does not hold the name '127.0.0.1' the probe checks (the host of "
        "--address, as ENVFLEET_TLS_SERVER_NAME is not set): set ENVFLEET_TLS_SERVER_NAME (or --tls-server-name) "
        "to a DNS name or IP address the certificate holds, or issue the certificate for 127.0.0.1)"
    ), result.stderr
    result = probe("--address", server.address, env={**environ, "ENVFLEET_TLS_SERVER_NAME": "envfleet.test"})
    assert result.returncode == 0, result.stderr
    # A CA that did not sign the server's certificate: named too.
    other = make_server_certs(tmp_path / "other", ca_name="another CA")
    result = probe("--address", server.address, env={**environ, "ENVFLEET_TLS_CA": str(other.ca)})
    assert result.returncode == 1
    assert f"(TLS: the server's certificate is not signed by a CA in {other.ca}: set ENVFLEET_TLS_CA" in result.stderr


def test_tls_hints_name_the_host_the_probe_checks() -> None:
    mismatch = "failed to connect to all addresses; last error: UNKNOWN: Hostname Verification Check failed."
    assert "name '::1' the probe checks" in tls_hint(mismatch, "[::1]:50051", "ca.pem", None)
    assert "name 'localhost' the probe checks" in tls_hint(mismatch, "unix:/tmp/env.sock", "ca.pem", None)
    assert "name 'env.test' the probe checks (--tls-server-name or ENVFLEET_TLS_SERVER_NAME)" in tls_hint(
        mismatch, "10.0.0.5:50051", "ca.pem", "env.test"
    )
    assert tls_hint(mismatch, "127.0.0.1:50051", None, None) == ""  # (plaintext: no TLS to blame)
    assert tls_hint("failed to connect to all addresses", "127.0.0.1:50051", "ca.pem", None) == ""


def test_a_shutdown_while_watch_writes_is_still_told() -> None:
    """A shutdown that comes while Watch's write of SERVING is still in progress (its client has the
    message; the write's await has not returned: a busy server) is told as NOT_SERVING before the stream
    ends. Watch once read "shutting down" after that write and ended without it."""

    class SlowContext:
        def __init__(self) -> None:
            self.written: list[int] = []
            self.release = asyncio.Event()

        async def write(self, response: health_pb2.HealthCheckResponse) -> None:
            self.written.append(response.status)
            if len(self.written) == 1:
                await self.release.wait()

    async def scenario() -> list[int]:
        service = HealthService()
        context = SlowContext()
        watch = asyncio.create_task(service.Watch(health_pb2.HealthCheckRequest(service=""), context))
        while not context.written:
            await asyncio.sleep(0)
        await service.enter_graceful_shutdown()
        context.release.set()
        await asyncio.wait_for(watch, timeout=10)
        return context.written

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert asyncio.run(scenario()) == [serving, not_serving]


def test_watch_says_serving_then_not_serving_at_shutdown_and_ends(spawn_server: SpawnServer) -> None:
    """Health/Watch on the real server: SERVING as its first message (gRPC's Watch writes with
    context.write, which the server's interceptors once took for an async generator: UNKNOWN, and a
    traceback per call); at SIGTERM, NOT_SERVING, then the stream ends, and holds the server's stop up
    for none of its grace period."""
    server = spawn_server("CartPole-v1", 1, "--grace", "20")
    with grpc.insecure_channel(server.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        statuses = [stub.Watch(health_pb2.HealthCheckRequest(service=name), timeout=60) for name in SERVICES]
        for stream in statuses:
            assert next(stream).status == health_pb2.HealthCheckResponse.SERVING
        # (read while the server stops, as a watcher does: not only after its process has gone)
        with concurrent.futures.ThreadPoolExecutor(len(statuses)) as pool:
            rest = [pool.submit(lambda s: [r.status for r in s], stream) for stream in statuses]
            started = time.monotonic()
            assert server.kill(signal.SIGTERM) == 0
            elapsed = time.monotonic() - started
            for stream, read in zip(statuses, rest, strict=True):
                assert read.result(timeout=30) == [health_pb2.HealthCheckResponse.NOT_SERVING]  # then the end, OK
                assert stream.code() == grpc.StatusCode.OK
    assert elapsed < 10, f"stopped after {elapsed:.1f} s (--grace 20): the Watch streams held it up"
    assert "Traceback" not in server.logs() and "__aiter__" not in server.logs(), server.logs()


def test_the_probe_escapes_a_unix_path_for_grpc_as_the_server_does() -> None:
    """The probe runs by path, importing nothing of env_server: its escape is a copy of the server's."""
    from env_server import health
    from env_server.protocol import grpc_target

    for address in ("unix:/tmp/q%41 #b?c.sock", "unix:///tmp/a%b.sock", "127.0.0.1:50051", "dns:///env:50051"):
        assert health._grpc_target(address) == grpc_target(address), address
