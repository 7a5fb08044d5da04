"""TLS and the shared token, accepted and refused, on real servers; the health service stays open."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import env_server.health
import learner.client
from env_server.health import check
from env_server.protocol import bearer_metadata
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from learner import AuthenticationError, RemoteVectorEnv, ServerUnavailableError
from learner.cli import main
from learner.client import EnvClient
from learner.discovery import CLIENT_CERT_REQUIRED, TLS_CAUSE, tls_probe
from tests.certs import ServerFiles, make_client_certs, make_self_signed_cert, make_server_certs
from tests.conftest import SpawnServer, started_logs

TOKEN = "s3cret-token_for.tests"


def step_once(envs: RemoteVectorEnv) -> None:
    envs.reset(seed=0)
    _, rewards, *_ = envs.step(np.zeros(envs.num_envs, dtype=np.int64))
    assert rewards.tolist() == [1.0] * envs.num_envs


def test_the_right_token_is_accepted_a_wrong_or_missing_one_refused(spawn_server: SpawnServer) -> None:
    server = spawn_server("CartPole-v1", 2, environ={"ENVFLEET_AUTH_TOKEN": TOKEN})
    with RemoteVectorEnv([server.address], auth_token=TOKEN) as envs:
        step_once(envs)
    for token in (None, "wrong-token", TOKEN + "x", TOKEN[:-1]):
        with pytest.raises(AuthenticationError) as info:
            RemoteVectorEnv([server.address], auth_token=token)
        err = info.value
        assert err.code == grpc.StatusCode.UNAUTHENTICATED and err.address == server.address
        assert ("no token was sent" if token is None else "the token is wrong") in str(err)
        assert TOKEN not in str(err)
    # Every method of EnvService needs it, GetSpec and the streams included; the health service does not.
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        calls = [
            lambda: stub.GetSpec(pb.GetSpecRequest(), timeout=5),
            lambda: stub.Handshake(pb.HandshakeRequest(), timeout=5),
            lambda: stub.Reset(pb.ResetRequest(), timeout=5),
            lambda: stub.Release(pb.ReleaseRequest(), timeout=5),
            lambda: list(stub.Hold(pb.HoldRequest(), timeout=5)),
            lambda: list(stub.StepStream(iter([pb.StepRequest()]), timeout=5)),
            lambda: stub.GetSpec(pb.GetSpecRequest(), timeout=5, metadata=(("authorization", TOKEN),)),  # no "Bearer"
        ]
        for call in calls:
            with pytest.raises(grpc.RpcError) as rpc_info:
                call()
            assert rpc_info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        stub.GetSpec(pb.GetSpecRequest(), timeout=5, metadata=(("authorization", f"Bearer {TOKEN}"),))
    assert check(server.address) == "SERVING"
    assert "refused /envfleet.v1.EnvService/" in server.logs() and TOKEN not in server.logs()


def test_every_server_that_refuses_the_handshake_is_named(spawn_server: SpawnServer) -> None:
    """The first refusal is the error, the others its notes (they were dropped: the user mended one server's
    token and found the next one's at the next try)."""
    a, b = (spawn_server("CartPole-v1", 1, environ={"ENVFLEET_AUTH_TOKEN": TOKEN}) for _ in range(2))
    with pytest.raises(AuthenticationError) as info:
        RemoteVectorEnv([a.address, b.address], auth_token="wrong-token")
    assert info.value.address == a.address
    [note] = info.value.__notes__
    assert note == f"also: env server {b.address}: the same", note  # (not the long hint again)


def test_token_from_a_file_and_bad_tokens_are_refused_at_start(spawn_server: SpawnServer, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    server = spawn_server("CartPole-v1", 1, "--auth-token-file", str(token_file))
    with RemoteVectorEnv([server.address], auth_token=TOKEN) as envs:
        step_once(envs)
    for args, message in (
        (["--auth-token", "has space"], "--auth-token: expected printable ASCII without spaces"),
        (["--auth-token-file", str(tmp_path / "missing")], "cannot read it"),
        (["--auth-token", "a", "--auth-token-file", str(token_file)], "give one of them, not both"),
        (["--tls-cert", str(token_file)], "--tls-cert and --tls-key: give both"),
        # Set, but to nothing (`--auth-token "$TOKEN"` with TOKEN unset): not a server open to all
        (["--auth-token", ""], "--auth-token (or ENVFLEET_AUTH_TOKEN): the token is empty"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--port", "0", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2 and message in result.stderr, result.stderr
    with pytest.raises(ValueError, match="printable ASCII"):
        RemoteVectorEnv([server.address], auth_token="bad token")


@pytest.fixture
def certs(tmp_path: Path) -> ServerFiles:
    return make_server_certs(tmp_path / "certs", names=("localhost", "127.0.0.1", "envfleet.test"))


@pytest.mark.slow
def test_tls_verified_with_the_ca_and_refused_otherwise(
    spawn_server: SpawnServer, certs: ServerFiles, tmp_path: Path
) -> None:
    server = spawn_server("CartPole-v1", 2, "--tls-cert", str(certs.cert), "--tls-key", str(certs.key))
    with RemoteVectorEnv([server.address], tls=certs.ca) as envs:
        step_once(envs)
    # The name in the certificate, when the address has another (here: a name the certificate holds).
    with RemoteVectorEnv([server.address], tls=str(certs.ca), tls_server_name="envfleet.test") as envs:
        step_once(envs)
    other = make_server_certs(tmp_path / "other", ca_name="another CA")
    # Told within the first seconds, with the reason (not after the whole connect timeout).
    refusals: list[tuple[dict[str, Any], str]] = [
        # a CA that did not sign the server's certificate
        ({"tls": other.ca}, "unable to get local issuer certificate (it is not signed by the CA given)"),
        # a name the certificate lacks
        ({"tls": certs.ca, "tls_server_name": "elsewhere.test"}, "not valid for 'elsewhere.test'"),
        # plaintext to a TLS server
        ({}, "TLS: the server speaks TLS, this client does not: pass its CA (tls=..., learner train --tls-ca)"),
    ]
    for options, reason in refusals:
        with pytest.raises(ServerUnavailableError, match=re.escape(reason)):
            RemoteVectorEnv([server.address], connect_timeout=60, **options)
    plain = spawn_server("CartPole-v1", 1)
    with pytest.raises(ServerUnavailableError, match="TLS: the server does not speak TLS"):
        RemoteVectorEnv([plain.address], connect_timeout=60, tls=certs.ca)
    # The health probe, over TLS as the container's HEALTHCHECK runs it.
    assert check(server.address, tls_ca=str(certs.ca)) == "SERVING"
    environ = {**os.environ, "ENVFLEET_TLS_CERT": str(certs.cert), "ENVFLEET_TLS_CA": str(certs.ca)}
    probe = subprocess.run(
        [sys.executable, "-I", env_server.health.__file__, "--address", server.address],
        capture_output=True,
        text=True,
        timeout=30,
        env=environ,
    )
    assert probe.returncode == 0, probe.stderr


def test_a_listener_that_closes_at_once_is_not_taken_for_a_tls_failure(certs: ServerFiles) -> None:
    """A proxy whose backend is not up yet accepts and closes: a wait may mend that, so the TLS
    probe must not call it final (RemoteVectorEnv would give up at once)."""
    from learner.discovery import speaks_tls, tls_probe

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        address = f"127.0.0.1:{listener.getsockname()[1]}"

        def close_each() -> None:
            for _ in range(2):
                conn, _ = listener.accept()
                conn.close()

        closer = threading.Thread(target=close_each, daemon=True)
        closer.start()
        assert tls_probe(address, certs.ca.read_bytes(), None, timeout=5) is None
        assert not speaks_tls(address, timeout=5)
        closer.join(timeout=10)


@contextlib.contextmanager
def ends_after_handshake(
    certs: ServerFiles, client_ca: Path | None = None, *, names_only: bool = False
) -> Iterator[str]:
    """The address of a TLS listener on loopback that completes each handshake and then closes the
    connection, as a TLS proxy whose backend is down does; with ``client_ca``, one that requires a client
    certificate that CA signed and says so by an alert (as gRPC's servers do not); ``names_only``, one that
    refuses a handshake that asks no name with an internal_error alert (as Caddy does: its certificates are
    by name)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.cert, certs.key)
    context.set_alpn_protocols(["h2"])
    if names_only:
        context.sni_callback = lambda sock, name, ctx: ssl.ALERT_DESCRIPTION_INTERNAL_ERROR if name is None else None
    if client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(client_ca)
    stop = threading.Event()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.settimeout(0.1)

        def serve() -> None:
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                with conn, contextlib.suppress(OSError):  # (ssl.SSLError too: a handshake refused)
                    conn.settimeout(5)
                    context.wrap_socket(conn, server_side=True).close()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            yield f"127.0.0.1:{listener.getsockname()[1]}"
        finally:
            stop.set()
            thread.join(timeout=10)


@pytest.mark.slow
def test_a_close_right_after_the_handshake_is_not_called_a_client_certificate_refusal(
    certs: ServerFiles, tmp_path: Path
) -> None:
    """A TLS proxy whose backend is down closes the connection right after the handshake, as a gRPC server
    does to a client certificate it refuses: the reason names both, and what to do about each. A server
    that says why (an alert about the certificate) is named as refusing it."""
    with ends_after_handshake(certs) as address:
        assert tls_probe(address, certs.ca.read_bytes(), timeout=5) == TLS_CAUSE + CLIENT_CERT_REQUIRED
        with pytest.raises(ServerUnavailableError) as info:
            RemoteVectorEnv([address], tls=certs.ca, connect_timeout=60)
    assert str(info.value) == f"env server {address}: {TLS_CAUSE}{CLIENT_CERT_REQUIRED}"
    assert "so does a TLS proxy whose backend is down" in str(info.value)
    assert "behind a proxy, see that the server it forwards to is up" in str(info.value)
    client = make_client_certs(tmp_path / "client")
    with ends_after_handshake(certs, client_ca=client.ca) as address:
        reason = tls_probe(address, certs.ca.read_bytes(), timeout=5)
    assert reason is not None
    assert reason.startswith(
        f"{TLS_CAUSE}the server requires a client certificate (env-server --tls-client-ca) and this client presents "
        "none (alert: TLSV13_ALERT_CERTIFICATE_REQUIRED): pass a client certificate its CA signed and its key"
    ), reason
    assert "proxy" not in reason


def test_a_tls_proxy_without_a_certificate_for_an_ip_address_is_said_so(certs: ServerFiles) -> None:
    """Caddy has certificates by name: called at its IP address (no name asked), it sends internal_error,
    which was said as such, nothing more ("TLS: the handshake failed: TLSV1_ALERT_INTERNAL_ERROR")."""
    with ends_after_handshake(certs, names_only=True) as address:
        reason = tls_probe(address, certs.ca.read_bytes(), timeout=5)
    assert reason == (
        f"{TLS_CAUSE}the handshake failed: TLSV1_ALERT_INTERNAL_ERROR (the server, or a TLS proxy in front of it such "
        "as Caddy, may have no certificate for the name asked, and an IP address asks none: connect by a name its "
        "certificate holds, or give one: tls_server_name=NAME, learner train --tls-server-name)"
    ), reason


def test_the_tls_probe_verifies_as_grpc_does_whatever_pythons_default_context_adds(
    certs: ServerFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Python 3.13's default SSL context adds OpenSSL's strict X.509 checks, which gRPC's TLS does not make:
    the probe must not call a certificate gRPC accepts a failure (these certificates have no Authority Key
    Identifier, which the strict checks require)."""
    default_context = ssl.create_default_context

    def as_on_python_313(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        context = default_context(*args, **kwargs)
        context.verify_flags |= ssl.VERIFY_X509_STRICT | ssl.VERIFY_X509_PARTIAL_CHAIN
        return context

    monkeypatch.setattr(ssl, "create_default_context", as_on_python_313)
    with ends_after_handshake(certs) as address:  # (verified, then closed: the probe's "requires a client cert")
        assert tls_probe(address, certs.ca.read_bytes(), timeout=5) == TLS_CAUSE + CLIENT_CERT_REQUIRED


def test_a_certificate_and_key_that_do_not_belong_together_are_named(certs: ServerFiles, tmp_path: Path) -> None:
    other = make_server_certs(tmp_path / "other", ca_name="another CA")
    for cert, key, reason in (
        (certs.key, certs.cert, "one is not what it should be (swapped, or not a certificate and a key)"),
        (certs.cert, other.key, "the key is not the certificate's private key"),
    ):
        tls = ["--tls-cert", str(cert), "--tls-key", str(key)]
        result = subprocess.run(
            [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--port", "0", *tls],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2, result.stderr
        assert result.stderr.strip().splitlines()[-1] == (
            f"env-server: error: --tls-cert {cert} and --tls-key {key}: {reason}"
        ), result.stderr


def test_tls_and_token_together(spawn_server: SpawnServer, certs: ServerFiles) -> None:
    server = spawn_server(
        "CartPole-v1",
        1,
        "--tls-cert",
        str(certs.cert),
        "--tls-key",
        str(certs.key),
        environ={"ENVFLEET_AUTH_TOKEN": TOKEN},
    )
    with RemoteVectorEnv([server.address], tls=certs.ca, auth_token=TOKEN) as envs:
        step_once(envs)
    with pytest.raises(AuthenticationError):
        RemoteVectorEnv([server.address], tls=certs.ca, auth_token="nope")
    assert "(TLS, auth token)" in server.logs()


def test_a_bad_ca_file_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="tls: cannot read the CA certificate file"):
        RemoteVectorEnv(["127.0.0.1:1"], tls="/no/such/ca.crt")


def _localhost_is_loopback(port: str) -> None:
    from learner import expand_addresses

    if expand_addresses(f"dns:///localhost:{port}") != [f"127.0.0.1:{port}"]:
        pytest.skip("localhost does not resolve to 127.0.0.1 only here")


@pytest.mark.slow
def test_servers_found_by_a_dns_name_are_checked_against_that_name(
    spawn_server: SpawnServer, certs: ServerFiles, tmp_path: Path
) -> None:
    """dns:///tasks.env:50051 connects to IP addresses, but (as gRPC's own dns resolver) checks the name:
    was "IP address mismatch, certificate is not valid for '10.0.2.2'"."""
    named = make_server_certs(tmp_path / "named", names=("localhost", "envfleet.test"))  # no IP address
    server = spawn_server("CartPole-v1", 1, "--tls-cert", str(named.cert), "--tls-key", str(named.key))
    port = server.address.rpartition(":")[2]
    _localhost_is_loopback(port)
    with RemoteVectorEnv(f"dns:///localhost:{port}", tls=named.ca) as envs:
        assert envs.addresses == [f"127.0.0.1:{port}"]
        step_once(envs)
    with RemoteVectorEnv(f"dns:///localhost:{port}", tls=named.ca, tls_server_name="envfleet.test") as envs:
        step_once(envs)  # (the name given wins)
    # The certificate lacks the name checked: the error says how to give the one it holds.
    with pytest.raises(ServerUnavailableError) as info:
        RemoteVectorEnv([server.address], tls=named.ca, connect_timeout=60)
    assert "certificate is not valid for '127.0.0.1'" in str(info.value)
    assert "give that name: tls_server_name=NAME, learner train --tls-server-name" in str(info.value)


@pytest.mark.slow
def test_a_certificate_no_ca_of_this_machine_signed_says_to_give_the_ca(
    spawn_server: SpawnServer, certs: ServerFiles
) -> None:
    """tls=True (the system's CA roots): not "not signed by the CA given", which was none."""
    server = spawn_server("CartPole-v1", 1, "--tls-cert", str(certs.cert), "--tls-key", str(certs.key))
    with pytest.raises(ServerUnavailableError) as info:
        RemoteVectorEnv([server.address], tls=True, connect_timeout=60)
    assert "(it is not signed by any CA this machine trusts: give the servers' CA with tls=PATH" in str(info.value)
    assert "the CA given" not in str(info.value)


@pytest.mark.slow
def test_a_unix_socket_server_is_checked_for_localhost(
    spawn_server: SpawnServer, certs: ServerFiles, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """gRPC checks the certificate at a unix: address against the socket's path ("No match found for
    server name: tmp%2F...", which no certificate holds): the connection failed unseen until
    connect_timeout. The learner, `learner servers` and the health probe check localhost there; a
    certificate without it is said within seconds, with the option that gives the name it holds."""
    own = make_self_signed_cert(tmp_path / "self-signed", names=("localhost",))
    elsewhere = make_server_certs(tmp_path / "elsewhere", names=("envfleet.test",))  # (no localhost)
    with tempfile.TemporaryDirectory(prefix="ef-") as folder:  # (short: Unix socket paths are)
        server = spawn_server(
            "CartPole-v1",
            2,
            "--unix-socket",
            f"{folder}/env.sock",
            "--tls-cert",
            str(own.cert),
            "--tls-key",
            str(own.key),
        )
        assert server.address == f"unix:{folder}/env.sock"
        started = time.monotonic()
        with RemoteVectorEnv([server.address], tls=own.ca, connect_timeout=30) as envs:
            step_once(envs)
            assert envs._clients[0].step_socket  # (the step socket stays on under TLS)
        assert time.monotonic() - started < 15
        assert check(server.address, tls_ca=str(own.ca)) == "SERVING"
        assert main(["servers", server.address, "--tls-ca", str(own.ca), "--json"]) == 0
        (info,) = json.loads(capsys.readouterr().out)
        assert info["num_envs"] == 2 and not info["error"], info

        other = spawn_server(
            "CartPole-v1",
            1,
            "--unix-socket",
            f"{folder}/other.sock",
            "--tls-cert",
            str(elsewhere.cert),
            "--tls-key",
            str(elsewhere.key),
        )
        started = time.monotonic()
        with pytest.raises(ServerUnavailableError) as refused:
            RemoteVectorEnv([other.address], tls=elsewhere.ca, connect_timeout=60)
        assert time.monotonic() - started < 15
        assert str(refused.value) == (
            f"env server {other.address}: TLS: the server's certificate does not verify: Hostname mismatch, "
            "certificate is not valid for 'localhost' (at a unix: address the certificate is checked for the name "
            "localhost unless another is given: give a name it holds, tls_server_name=NAME, learner train "
            "--tls-server-name; or issue it for localhost too)"
        )
        with RemoteVectorEnv([other.address], tls=elsewhere.ca, tls_server_name="envfleet.test") as envs:
            step_once(envs)
        assert main(["servers", other.address, "--tls-ca", str(elsewhere.ca), "--json"]) == 1
        (info,) = json.loads(capsys.readouterr().out)
        assert "certificate is not valid for 'localhost'" in info["error"] and "--tls-server-name" in info["error"]
        environ = {**os.environ, "ENVFLEET_TLS_CERT": str(elsewhere.cert), "ENVFLEET_TLS_CA": str(elsewhere.ca)}
        probe = subprocess.run(
            [sys.executable, "-I", env_server.health.__file__, "--address", other.address, "--timeout", "2"],
            capture_output=True,
            text=True,
            timeout=30,
            env=environ,
        )
        assert probe.returncode == 1
        assert (
            "the server's certificate does not hold the name 'localhost' the probe checks (the name checked at a "
            "unix: address, as ENVFLEET_TLS_SERVER_NAME is not set)"
        ) in probe.stderr, probe.stderr
        probe = subprocess.run(
            [sys.executable, "-I", env_server.health.__file__, "--address", other.address, "--timeout", "10"],
            capture_output=True,
            text=True,
            timeout=30,
            env={**environ, "ENVFLEET_TLS_SERVER_NAME": "envfleet.test"},
        )
        assert probe.returncode == 0, probe.stderr


@pytest.mark.slow
def test_grpc_cores_own_log_lines_stay_out_of_a_tls_error(spawn_server: SpawnServer, certs: ServerFiles) -> None:
    """gRPC core logs every failed TLS handshake at INFO ("I... ssl_transport_security.cc ... Handshake
    failed") unless GRPC_VERBOSITY says otherwise: importing learner sets ERROR (a user's setting wins)."""
    server = spawn_server("CartPole-v1", 1, "--tls-cert", str(certs.cert), "--tls-key", str(certs.key))
    script = (
        "import sys; from learner import RemoteVectorEnv\n"
        f"try: RemoteVectorEnv([{server.address!r}], tls=True, connect_timeout=60)\n"
        "except Exception as err: print(type(err).__name__, err)\n"
    )
    environ = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    quiet = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=environ)
    assert "ServerUnavailableError" in quiet.stdout and "any CA this machine trusts" in quiet.stdout
    assert "ssl_transport_security" not in quiet.stderr, quiet.stderr
    loud = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environ, "GRPC_VERBOSITY": "INFO"},
    )
    assert "ssl_transport_security" in loud.stderr  # (what the default would print)


@pytest.fixture
def warned(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """The learner's warnings, none given yet in this process (each server is warned about once)."""
    monkeypatch.setattr(learner.client, "_UNCHECKED_TOKEN_WARNED", set())
    caplog.set_level(logging.WARNING, logger="learner.client")
    return caplog


def test_a_token_sent_to_a_server_that_checks_none_is_warned_on_both_sides(
    spawn_server: SpawnServer, warned: pytest.LogCaptureFixture
) -> None:
    """A user who sets a token may believe the server protected: the learner warns once per server,
    naming it, and the server logs (rate-limited) that it was sent a token it does not check."""
    caplog = warned
    server = spawn_server("CartPole-v1", 1)
    for _ in range(2):  # (a second session: no second warning on either side)
        with RemoteVectorEnv([server.address], auth_token=TOKEN, client_name="careful") as envs:
            step_once(envs)
    warnings = [r.getMessage() for r in caplog.records if r.name == "learner.client"]
    assert warnings == [
        f"env server {server.address} does not check tokens (started without --auth-token): the token sent to it "
        "protects nothing, and anyone who can reach it may use it"
    ]
    lines = [line for line in server.logs().splitlines() if "sent an auth token" in line]
    assert len(lines) == 1 and "WARNING" in lines[0], server.logs()
    assert re.search(
        r"'careful' from \S+ \(session \w{8}\) sent an auth token, but this server checks none \(started without "
        r"--auth-token\): anyone who can reach it may use it; start it with --auth-token or ENVFLEET_AUTH_TOKEN "
        r"\(1 handshakes with a token this server does not check so far\)$",
        lines[0],
    ), lines[0]
    assert TOKEN not in server.logs()


def test_no_warning_where_the_server_checks_the_token_or_none_is_sent(
    spawn_server: SpawnServer, warned: pytest.LogCaptureFixture
) -> None:
    caplog = warned
    checking = spawn_server("CartPole-v1", 1, environ={"ENVFLEET_AUTH_TOKEN": TOKEN})
    with RemoteVectorEnv([checking.address], auth_token=TOKEN) as envs:
        step_once(envs)
    plain = spawn_server("CartPole-v1", 1)
    with RemoteVectorEnv([plain.address]) as envs:
        step_once(envs)
    assert not [r for r in caplog.records if r.name == "learner.client"]
    assert "sent an auth token" not in checking.logs() + plain.logs()

    # A server that does not say whether it checks one (an older one): no warning either.
    async def adopt(*responses: pb.HandshakeResponse) -> list[str]:
        warnings = []
        for response in responses:
            client = EnvClient("127.0.0.1:1", timeout=1, metadata=bearer_metadata(TOKEN))
            client.start_session(response)
            await client.close()
            warnings.append(caplog.text)
        return warnings

    older, saying = asyncio.run(adopt(pb.HandshakeResponse(), pb.HandshakeResponse(checks_token=False)))
    assert "does not check tokens" not in older
    assert "env server 127.0.0.1:1 does not check tokens" in saying  # (one that says so is warned about)


# -- what a server open to anyone says as it starts ---------------------------------------------------


def test_tls_without_a_token_off_loopback_is_warned_as_open_to_anyone(certs: ServerFiles) -> None:
    """TLS encrypts the calls and proves the server to learners; it does not check who calls (no
    client certificates): off loopback without a token, anyone who reaches the port can claim the envs."""
    tls = ("--tls-cert", str(certs.cert), "--tls-key", str(certs.key))
    logs = started_logs(*tls, "--host", "0.0.0.0")
    assert "listening on 0.0.0.0 with TLS but no auth token: anyone who reaches it can claim and step its envs" in logs
    assert "see --auth-token" in logs
    assert "neither TLS nor an auth token" not in logs
    # With the token, or on loopback, nothing to warn of.
    for quiet in (started_logs(*tls, "--host", "0.0.0.0", "--auth-token", TOKEN), started_logs(*tls)):
        assert "no auth token" not in quiet and "anyone who reaches it" not in quiet, quiet
    # Plaintext without a token says so, as before.
    assert "with neither TLS nor an auth token: anyone who reaches it" in started_logs("--host", "0.0.0.0")
