"""Mutual TLS: servers that require client certificates (env-server --tls-client-ca), and learners that
present them (tls_client_cert/tls_client_key, --tls-client-cert/--tls-client-key), on real servers."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import env_server.health
import learner.client
from env_server.__main__ import parse_args
from env_server.config import ServerConfig
from env_server.health import check
from env_server.protocol import bearer_metadata
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from env_server.server import server_credentials
from learner import InvalidArgumentError, RemoteVectorEnv, ServerUnavailableError, rundir
from learner.cli import main
from learner.client import ca_roots
from learner.config import Args
from learner.discovery import CLIENT_CERT_REFUSED, CLIENT_CERT_REQUIRED, TLS_CAUSE
from tests.certs import ClientFiles, ServerFiles, make_client_certs, make_server_certs
from tests.conftest import ServerProcess, SpawnServer, started_logs

CLIENT_VARIABLES = (
    "ENVFLEET_TLS_CA",
    "ENVFLEET_TLS_SERVER_NAME",
    "ENVFLEET_TLS_CLIENT_CERT",
    "ENVFLEET_TLS_CLIENT_KEY",
)


@pytest.fixture
def certs(tmp_path: Path) -> ServerFiles:
    return make_server_certs(tmp_path / "certs", names=("localhost", "127.0.0.1", "envfleet.test"))


@pytest.fixture
def client(tmp_path: Path) -> ClientFiles:
    return make_client_certs(tmp_path / "client")


@pytest.fixture
def stranger(tmp_path: Path) -> ClientFiles:
    """A client certificate another CA signed (the server does not trust it)."""
    return make_client_certs(tmp_path / "stranger", ca_name="another client CA")


@pytest.fixture(autouse=True)
def no_client_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The learner's TLS variables unset: each test sets those it means."""
    for variable in CLIENT_VARIABLES:
        monkeypatch.delenv(variable, raising=False)


def mtls_server(spawn_server: SpawnServer, certs: ServerFiles, client: ClientFiles, *args: str) -> ServerProcess:
    tls = ["--tls-cert", str(certs.cert), "--tls-key", str(certs.key), "--tls-client-ca", str(client.ca)]
    return spawn_server("CartPole-v1", 2, *tls, *args)


def step_once(envs: RemoteVectorEnv) -> None:
    envs.reset(seed=0)
    _, rewards, *_ = envs.step(np.zeros(envs.num_envs, dtype=np.int64))
    assert rewards.tolist() == [1.0] * envs.num_envs


@pytest.mark.slow
def test_a_client_certificate_the_ca_signed_is_taken_none_or_a_strangers_refused_within_seconds(
    spawn_server: SpawnServer, certs: ServerFiles, client: ClientFiles, stranger: ClientFiles
) -> None:
    server = mtls_server(spawn_server, certs, client)
    assert "(TLS, client certificates required)" in server.logs()
    with RemoteVectorEnv(
        [server.address], tls=certs.ca, tls_client_cert=client.cert, tls_client_key=str(client.key)
    ) as envs:
        step_once(envs)
    # Without a certificate, or with one another CA signed: said within seconds (not after the whole
    # connect_timeout, nor as "nothing answered"), with what to pass.
    server_cert = ClientFiles(ca=certs.ca, cert=certs.cert, key=certs.key)  # (a server's: not for client auth)
    for presented, reason in (
        (None, TLS_CAUSE + CLIENT_CERT_REQUIRED),
        (stranger, TLS_CAUSE + CLIENT_CERT_REFUSED.format(cert=stranger.cert)),
        (server_cert, TLS_CAUSE + CLIENT_CERT_REFUSED.format(cert=certs.cert)),
    ):
        identity = {} if presented is None else {"tls_client_cert": presented.cert, "tls_client_key": presented.key}
        started = time.monotonic()
        with pytest.raises(ServerUnavailableError) as info:
            RemoteVectorEnv([server.address], tls=certs.ca, connect_timeout=60, **identity)  # type: ignore[arg-type]
        assert str(info.value) == f"env server {server.address}: {reason}"
        assert time.monotonic() - started < 15
    assert "tls_client_cert=PATH, tls_client_key=PATH; learner train --tls-client-cert PATH" in CLIENT_CERT_REQUIRED
    # A server that asks for none takes a learner that presents one (the certificate goes unchecked).
    plain_tls = spawn_server("CartPole-v1", 1, "--tls-cert", str(certs.cert), "--tls-key", str(certs.key))
    with RemoteVectorEnv(
        [plain_tls.address], tls=certs.ca, tls_client_cert=client.cert, tls_client_key=client.key
    ) as envs:
        step_once(envs)


def test_the_health_probe_presents_the_client_certificate_of_the_servers_variables(
    spawn_server: SpawnServer, certs: ServerFiles, client: ClientFiles
) -> None:
    """The health service cannot be left out of mutual TLS (the handshake comes before any call): the
    image's probe presents ENVFLEET_TLS_CLIENT_CERT/KEY, the variables a learner reads too."""
    server = mtls_server(spawn_server, certs, client)
    assert check(
        server.address, tls_ca=str(certs.ca), tls_client_cert=str(client.cert), tls_client_key=str(client.key)
    ) == ("SERVING")
    environ = {
        **os.environ,
        "ENVFLEET_TLS_CERT": str(certs.cert),
        "ENVFLEET_TLS_CA": str(certs.ca),
        "ENVFLEET_TLS_CLIENT_CA": str(client.ca),
    }

    def probe(**more: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-I", env_server.health.__file__, "--address", server.address, "--timeout", "2"],
            capture_output=True,
            text=True,
            timeout=30,
            env={**environ, **more},
        )

    result = probe(ENVFLEET_TLS_CLIENT_CERT=str(client.cert), ENVFLEET_TLS_CLIENT_KEY=str(client.key))
    assert result.returncode == 0, result.stderr
    result = probe()
    assert result.returncode == 1
    assert "the server requires a client certificate (ENVFLEET_TLS_CLIENT_CA is set) and the probe presents none" in (
        result.stderr
    )
    result = probe(ENVFLEET_TLS_CLIENT_CERT=str(client.cert))
    assert result.returncode == 1  # (not argparse's 2, which Docker reserves)
    assert f"{server.address}: unhealthy: --tls-client-cert and --tls-client-key (or ENVFLEET_TLS_CLIENT_CERT and " in (
        result.stderr
    )


@pytest.mark.needs_torch
def test_learner_servers_and_train_present_the_certificate_and_resume_keeps_its_paths(
    spawn_server: SpawnServer,
    certs: ServerFiles,
    client: ClientFiles,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = mtls_server(spawn_server, certs, client)
    identity = ["--tls-client-cert", str(client.cert), "--tls-client-key", str(client.key)]
    # learner servers: with the options; without them, the server's refusal as the server's error.
    assert main(["servers", server.address, "--tls-ca", str(certs.ca), *identity, "--json"]) == 0
    (info,) = json.loads(capsys.readouterr().out)
    assert info["num_envs"] == 2 and not info.get("error")
    assert main(["servers", server.address, "--tls-ca", str(certs.ca), "--json"]) == 1
    (info,) = json.loads(capsys.readouterr().out)
    assert info["error"].startswith(TLS_CAUSE), info  # (its advice naming the options, not survey()'s keywords)
    assert "(--tls-client-cert PATH --tls-client-key PATH, or $ENVFLEET_TLS_CLIENT_CERT and " in info["error"], info

    # learner train, its certificate from the variables a learner service (compose) reads.
    monkeypatch.setenv("ENVFLEET_TLS_CA", str(certs.ca))
    monkeypatch.setenv("ENVFLEET_TLS_CLIENT_CERT", str(client.cert))
    monkeypatch.setenv("ENVFLEET_TLS_CLIENT_KEY", str(client.key))
    run = tmp_path / "run"
    argv = ["--num-steps", "4", "--no-progress", "--no-plot", "--no-tensorboard"]
    assert main(["train", "--servers", server.address, *argv, "--total-timesteps", "8", "--run-dir", str(run)]) == 0, (
        capsys.readouterr().err
    )
    saved = rundir.read_json(run / rundir.CONFIG)["args"]
    assert (saved["tls_ca"], saved["tls_client_cert"], saved["tls_client_key"]) == (
        str(certs.ca),
        str(client.cert),
        str(client.key),
    )
    key_text = client.key.read_text().strip().splitlines()[1]  # (a line of the key itself)
    assert all(key_text not in path.read_text() for path in run.glob("*.json*"))
    # Resumed without the variables: config.json's paths.
    for variable in CLIENT_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert main(["train", "--resume", str(run), "--total-timesteps", "16", *argv]) == 0, capsys.readouterr().err
    assert Args.from_json(rundir.read_json(run / rundir.CONFIG)["args"]).tls_client_cert == str(client.cert)
    # eval, with the options.
    capsys.readouterr()
    eval_argv = ["eval", str(run), "--episodes", "2", "--servers", server.address, "--tls-ca", str(certs.ca), "--json"]
    assert main([*eval_argv, *identity]) == 0
    assert json.loads(capsys.readouterr().out)["episodes"] == 2


@pytest.mark.slow
def test_a_unix_socket_server_requiring_client_certificates_keeps_its_step_socket(
    certs: ServerFiles, client: ClientFiles, tmp_path: Path
) -> None:
    """Steps on the step socket need the session id that only a Handshake over gRPC (past the client
    certificate check) hands out; the socket gets the gRPC socket's file permissions."""
    path = tmp_path / "env.sock"
    tls = ["--tls-cert", str(certs.cert), "--tls-key", str(certs.key), "--tls-client-ca", str(client.ca)]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "env_server",
            "--env",
            "CartPole-v1",
            "--num-envs",
            "2",
            "--unix-socket",
            str(path),
            *tls,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == f"listening on unix:{path}"
        address = f"unix:{path}"
        ca: dict[str, Any] = {"tls": certs.ca}  # (checked for localhost at a unix: address, with no tls_server_name)
        with RemoteVectorEnv([address], **ca, tls_client_cert=client.cert, tls_client_key=client.key) as envs:
            step_once(envs)
            assert envs._clients[0].step_socket == f"{path}.steps"
        with pytest.raises(ServerUnavailableError, match=re.escape(CLIENT_CERT_REQUIRED)):
            RemoteVectorEnv([address], **ca, connect_timeout=60)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_client_certificates_required_off_loopback_without_a_token_is_not_warned_as_open(
    certs: ServerFiles, client: ClientFiles
) -> None:
    tls = ("--tls-cert", str(certs.cert), "--tls-key", str(certs.key), "--tls-client-ca", str(client.ca))
    logs = started_logs(*tls, "--host", "0.0.0.0")
    assert "(TLS, client certificates required)" in logs
    assert "anyone who reaches it" not in logs and "no auth token" not in logs, logs
    assert "(TLS, client certificates required, auth token)" in started_logs(*tls, "--auth-token", "s3cret")


def test_a_token_a_server_requiring_client_certificates_does_not_check_is_noted_not_warned_of(
    spawn_server: SpawnServer,
    certs: ServerFiles,
    client: ClientFiles,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Only holders of a certificate its client CA signed get past such a server's handshake, so "anyone
    who can reach it may use it" is untrue of it: its Handshake says it requires client certificates,
    and a token it does not check is noted (INFO) on both sides, not warned of. A server with TLS alone
    is warned of as before; one that does not say (older) reads as not requiring them."""
    monkeypatch.setattr(learner.client, "_UNCHECKED_TOKEN_WARNED", set())
    caplog.set_level(logging.INFO, logger="learner.client")
    token = "s3cret-token_for.tests"
    identity = {"tls_client_cert": client.cert, "tls_client_key": client.key}
    mutual = mtls_server(spawn_server, certs, client)
    with RemoteVectorEnv([mutual.address], tls=certs.ca, auth_token=token, **identity) as envs:  # type: ignore[arg-type]
        step_once(envs)
    tls_only = spawn_server("CartPole-v1", 2, "--tls-cert", str(certs.cert), "--tls-key", str(certs.key))
    with RemoteVectorEnv([tls_only.address], tls=certs.ca, auth_token=token, **identity) as envs:  # type: ignore[arg-type]
        step_once(envs)
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "learner.client"]
    assert said == [
        (
            "INFO",
            f"env server {mutual.address} does not check tokens (started without --auth-token), so the token sent "
            "to it adds nothing; it admits only clients with a certificate its client CA signed (env-server "
            "--tls-client-ca)",
        ),
        (
            "WARNING",
            f"env server {tls_only.address} does not check tokens (started without --auth-token): the token sent to "
            "it protects nothing, and anyone who can reach it may use it",
        ),
    ]
    (line,) = [line for line in mutual.logs().splitlines() if "sent an auth token" in line]
    assert " INFO " in line and "anyone" not in line, line
    assert "sent an auth token, which this server does not check (started without --auth-token); it admits only " in (
        line
    )
    (line,) = [line for line in tls_only.logs().splitlines() if "sent an auth token" in line]
    assert " WARNING " in line and "anyone who can reach it may use it" in line, line

    # The Handshake's own word, from each server (a raw channel; the sessions end with it).
    credentials = grpc.ssl_channel_credentials(
        certs.ca.read_bytes(), private_key=client.key.read_bytes(), certificate_chain=client.cert.read_bytes()
    )
    for server, required in ((mutual, True), (tls_only, False)):
        with grpc.secure_channel(server.address, credentials) as channel:
            response = pb_grpc.EnvServiceStub(channel).Handshake(pb.HandshakeRequest(), timeout=10)
        assert response.client_certificates_required is required
    # A server too old to say reads as one that does not require them (proto3's false): warned of.
    monkeypatch.setattr(learner.client, "_UNCHECKED_TOKEN_WARNED", set())
    caplog.clear()

    async def adopt(response: pb.HandshakeResponse) -> None:
        older = learner.client.EnvClient("127.0.0.1:1", timeout=1, metadata=bearer_metadata(token))
        older.start_session(response)
        await older.close()

    asyncio.run(adopt(pb.HandshakeResponse.FromString(pb.HandshakeResponse(checks_token=False).SerializeToString())))
    assert [r.levelname for r in caplog.records if r.name == "learner.client"] == ["WARNING"]


# -- the server's options and files ---------------------------------------------------------------------------


def test_the_servers_option_needs_tls_and_a_readable_ca(
    certs: ServerFiles,
    client: ClientFiles,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv in (["--tls-client-ca", str(client.ca)], []):
        if not argv:
            monkeypatch.setenv("ENVFLEET_TLS_CLIENT_CA", str(client.ca))
        with pytest.raises(SystemExit):
            parse_args(["--env", "CartPole-v1", *argv])
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            "env-server: error: --tls-client-ca (or ENVFLEET_TLS_CLIENT_CA): checks learners' client certificates "
            "in the TLS handshake, so the server must speak TLS: give --tls-cert and --tls-key too (its own "
            "certificate and key)"
        )
    tls = ["--tls-cert", str(certs.cert), "--tls-key", str(certs.key)]
    config, _ = parse_args(["--env", "CartPole-v1", *tls])
    assert config.tls_client_ca == str(client.ca)  # (from the variable)
    monkeypatch.setenv("ENVFLEET_TLS_CLIENT_CA", "")  # (set to nothing: unset, as for --tls-cert)
    assert parse_args(["--env", "CartPole-v1", *tls])[0].tls_client_ca is None
    with pytest.raises(ValueError, match="tls_client_ca: verifies the clients' certificates in the TLS handshake"):
        ServerConfig(env="CartPole-v1", tls_client_ca=str(client.ca))
    with pytest.raises(ValueError, match="tls_client_ca: expected the path of a PEM file, or None, got ''"):
        ServerConfig(env="CartPole-v1", tls_cert=str(certs.cert), tls_key=str(certs.key), tls_client_ca="")

    # The file, at start: named with what was expected and what came.
    text = tmp_path / "notes.txt"
    text.write_text("not a certificate\n")
    expected = "expected the PEM certificate(s) of the CA that signs the learners' client certificates"
    for path, reason in (
        (tmp_path / "missing.crt", "cannot read it: No such file or directory"),
        (text, "expected a PEM file (-----BEGIN ...), got something else"),
        (client.key, f"{expected} (-----BEGIN CERTIFICATE-----), got a private key"),
    ):
        config = ServerConfig(
            env="CartPole-v1", tls_cert=str(certs.cert), tls_key=str(certs.key), tls_client_ca=str(path)
        )
        with pytest.raises(OSError) as info:
            server_credentials(config)
        assert str(info.value) == f"--tls-client-ca {path}: {reason}"
    broken = tmp_path / "broken.crt"
    broken.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n")
    config = ServerConfig(
        env="CartPole-v1", tls_cert=str(certs.cert), tls_key=str(certs.key), tls_client_ca=str(broken)
    )
    with pytest.raises(OSError, match=re.escape(f"--tls-client-ca {broken}: {expected}, got one OpenSSL cannot read")):
        server_credentials(config)
    # A bundle whose comments are not ASCII (as the system's are: "# Issuer: ... Főtanúsítvány") is read as
    # OpenSSL reads it (was a TypeError's traceback).
    commented = tmp_path / "commented.crt"
    commented.write_bytes("# Issuer: CN=Főtanúsítvány\n".encode() + client.ca.read_bytes())
    server_credentials(dataclasses.replace(config, tls_client_ca=str(commented)))
    # As the command says it: before anything listens, exit status 2.
    result = subprocess.run(
        [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--port", "0", *tls, "--tls-client-ca", str(text)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"env-server: error: --tls-client-ca {text}: expected a PEM file (-----BEGIN ...), got something else"
    )


# -- the learner's options and files --------------------------------------------------------------------------


def test_remote_vector_env_checks_the_client_certificate_before_connecting(
    certs: ServerFiles, client: ClientFiles, stranger: ClientFiles, tmp_path: Path
) -> None:
    address = ["127.0.0.1:1"]
    broken = tmp_path / "broken.crt"  # (a PEM header, contents OpenSSL cannot read: was gRPC's C core's log lines)
    broken.write_text("-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n")
    commented = tmp_path / "commented.crt"  # (comments not ASCII, as a system bundle's: read, not a TypeError)
    commented.write_bytes("# Issuer: CN=Főtanúsítvány\n".encode() + certs.ca.read_bytes())
    assert ca_roots(commented) == commented.read_bytes()
    for options, message in (
        ({"tls": broken}, f"tls: expected PEM CA certificate(s) in {str(broken)!r}, got ones OpenSSL cannot read"),
        ({"tls_client_cert": client.cert}, "tls_client_cert and tls_client_key: give both (the client certificate and "
         "its private key) or neither, got tls_client_cert alone"),
        ({"tls_client_key": client.key}, "got tls_client_key alone"),
        ({"tls_client_cert": client.cert, "tls_client_key": client.key, "tls": False},
         "tls_client_cert: a client certificate is presented in a TLS handshake; connect with TLS too"),
        ({"tls_client_cert": tmp_path / "no.crt", "tls_client_key": client.key},
         f"tls_client_cert: cannot read the client certificate file {str(tmp_path / 'no.crt')!r}: No such file"),
        ({"tls_client_cert": client.key, "tls_client_key": client.key},
         f"tls_client_cert: expected a PEM client certificate (-----BEGIN CERTIFICATE-----) in {str(client.key)!r}"),
        ({"tls_client_cert": client.cert, "tls_client_key": client.cert},
         f"tls_client_key: expected a PEM private key (-----BEGIN ... PRIVATE KEY-----) in {str(client.cert)!r}"),
        ({"tls_client_cert": client.cert, "tls_client_key": stranger.key},
         f"tls_client_cert {client.cert} and tls_client_key {stranger.key}: the key is not the certificate's private key"),
    ):  # fmt: skip
        with pytest.raises(InvalidArgumentError) as info:
            RemoteVectorEnv(address, **{"tls": certs.ca, **options})  # type: ignore[arg-type]
        assert message in str(info.value)


def test_learner_options_for_the_client_certificate_are_checked_as_usage_errors(
    certs: ServerFiles,
    client: ClientFiles,
    stranger: ClientFiles,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    servers = ["--servers", "127.0.0.1:1"]
    ca = ["--tls-ca", str(certs.ca)]
    cert, key = ["--tls-client-cert", str(client.cert)], ["--tls-client-key", str(client.key)]

    def refused(*argv: str) -> str:
        with pytest.raises(SystemExit) as info:
            main(list(argv))
        assert info.value.code == 2
        return capsys.readouterr().err.strip().splitlines()[-1]

    for command in (["train", "--run-dir", str(tmp_path / "run")], ["servers"], ["eval", "run"]):
        assert refused(*command, *servers, *ca, *cert).endswith(
            "error: --tls-client-cert: goes with --tls-client-key (the client certificate and its private key): give "
            "both or neither"
        )
        assert refused(*command, *servers, *ca, *key).endswith("error: --tls-client-key: goes with --tls-client-cert "
                                                              "(the client certificate and its private key): give "
                                                              "both or neither")  # fmt: skip
        assert refused(*command, *servers, *cert, *key).endswith(
            "error: --tls-client-cert: a client certificate is presented in a TLS handshake; add --tls or --tls-ca"
        )
        assert refused(*command, *servers, *ca, "--tls-client-cert", str(tmp_path / "no.crt"), *key).endswith(
            f"error: --tls-client-cert {tmp_path / 'no.crt'}: cannot read it (No such file or directory)"
        )
        assert refused(*command, *servers, *ca, *cert, "--tls-client-key", str(stranger.key)).endswith(
            f"error: --tls-client-cert {client.cert} and --tls-client-key {stranger.key}: the key is not the "
            "certificate's private key"
        )
    assert refused("train", "--run-dir", str(tmp_path / "run"), *ca, *cert, *key).endswith(
        "error: --tls-ca: connects to running --servers with TLS; the env servers this command starts speak plaintext "
        "on loopback (or a Unix socket)"
    )
    assert refused("train", "--run-dir", str(tmp_path / "run"), *cert, *key).endswith(
        "error: --tls-client-cert: connects to running --servers with TLS; the env servers this command starts speak "
        "plaintext on loopback (or a Unix socket)"
    )
    # The variables: a pair, with TLS on, named as the variables where they name no file here.
    monkeypatch.setenv("ENVFLEET_TLS_CLIENT_CERT", str(client.cert))
    assert refused("servers", *servers, *ca).endswith(
        "error: $ENVFLEET_TLS_CLIENT_CERT and $ENVFLEET_TLS_CLIENT_KEY: set both (the client certificate and its "
        "private key) or neither, got $ENVFLEET_TLS_CLIENT_CERT alone (or give --tls-client-cert and --tls-client-key)"
    )
    monkeypatch.setenv("ENVFLEET_TLS_CLIENT_KEY", "/certs/client.key")
    assert refused("servers", *servers, *ca).endswith(
        "error: $ENVFLEET_TLS_CLIENT_KEY /certs/client.key: cannot read it (No such file or directory); it gives "
        "--tls-client-key for --servers: set it to the file on this machine, unset it, or give --tls-client-key"
    )
    # (without TLS the variables are not read: a plaintext learner, as for ENVFLEET_TLS_SERVER_NAME)
    assert main(["servers", *servers, "--timeout", "1", "--json"]) == 1
    assert "client" not in json.loads(capsys.readouterr().out)[0]["error"]


def test_config_json_keeps_the_paths_and_a_run_moved_off_its_servers_drops_them(
    certs: ServerFiles, client: ClientFiles
) -> None:
    args = Args(
        servers="127.0.0.1:1", tls_ca=str(certs.ca), tls_client_cert=str(client.cert), tls_client_key=str(client.key)
    )
    values = json.loads(json.dumps(args.to_json()))
    assert (values["tls_client_cert"], values["tls_client_key"]) == (str(client.cert), str(client.key))
    assert Args.from_json(values) == args
    local = Args.from_json({**values, "servers": None})  # (recorded for local servers, which ignore TLS)
    assert (local.tls_ca, local.tls_client_cert, local.tls_client_key) == (None, None, None)
