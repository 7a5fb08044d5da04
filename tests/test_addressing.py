"""Addresses of both families: localhost's two loopbacks, the wildcard's, dns: names with IPv4 and IPv6
addresses, hosts written as addresses are not, and IPv6 peers in the logs.

Servers run for real on loopback; those on ``::1`` are skipped where it cannot be bound."""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from env_server.config import ServerConfig
from env_server.health import default_address
from env_server.protocol import bind_hint, dual_stack, host_problem, http_host, peer_text
from env_server.server import _check_bindable, _is_loopback, _metrics_hosts
from learner import RemoteVectorEnv
from learner.discovery import probe
from learner.errors import OptionError, ServerUnavailableError
from learner.live_metrics import serve_metrics
from learner.survey import survey
from tests.conftest import StartServers
from tests.servers import ServerSubprocess, bindable, needs_ipv6_loopback


def _listening(host: str) -> socket.socket:
    """A socket of another process's kind, listening on ``host`` at a free port (close it after)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.bind((host, 0))
    sock.listen()
    return sock


class _Server(ServerSubprocess):
    """An ``env-server`` of CartPole-v1 on ``--host HOST --port 0``, ready once made, its log in a temporary file."""

    def __init__(self, host: str, *args: str) -> None:
        super().__init__(
            [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--host", host, "--port", "0", *args]
        )
        self.port = int(self.ready().rpartition(":")[2])


@pytest.fixture(scope="module")
def ipv6_server() -> Iterator[_Server]:
    """One env server on ``::1`` alone, for the module's tests."""
    if not bindable("::1"):
        pytest.skip("needs IPv6's loopback, ::1, which is not here")
    server = _Server("::1")
    yield server
    server.stop()


# -- the server's bind check ------------------------------------------------------------------------


@needs_ipv6_loopback
def test_localhost_is_refused_where_another_process_has_its_ipv6_loopback() -> None:
    """gRPC listens on [::1] and 127.0.0.1 for localhost, and went on with 127.0.0.1 alone: its start line
    said localhost:PORT, which reached the other server."""
    with _listening("::1") as other:
        port = other.getsockname()[1]
        with pytest.raises(OSError, match=rf"Address already in use at \[::1\]:{port}") as info:
            _check_bindable(ServerConfig(env="CartPole-v1", host="localhost", port=port))
    assert str(info.value).startswith(f"cannot listen on localhost:{port}: "), str(info.value)


@needs_ipv6_loopback
def test_the_wildcard_is_refused_where_another_process_has_the_port_on_ipv6() -> None:
    """gRPC binds [::] (IPv4 too) for 0.0.0.0, and fell back to 0.0.0.0 alone: silently IPv4-only."""
    with _listening("::1") as other:
        port = other.getsockname()[1]
        with pytest.raises(
            OSError,
            match=rf"^cannot listen on 0.0.0.0:{port}: Address already in use on an IPv6 address of this machine "
            rf"\(tried \[::\]:{port}\)",
        ):
            _check_bindable(ServerConfig(env="CartPole-v1", host="0.0.0.0", port=port))
        with pytest.raises(OSError, match=rf"^cannot listen on \[::\]:{port}: Address already in use"):
            _check_bindable(ServerConfig(env="CartPole-v1", host="::", port=port))


def test_localhost_and_the_wildcard_pass_where_their_port_is_free() -> None:
    for host in ("localhost", "0.0.0.0", "::", "127.0.0.1"):
        _check_bindable(ServerConfig(env="CartPole-v1", host=host, port=0))


@pytest.mark.parametrize(
    ("host", "message"),
    [
        ("[::1]", "--host '[::1]': write IPv6 addresses without brackets here: --host ::1"),
        ("[::]", "--host '[::]': write IPv6 addresses without brackets here: --host ::"),
        (
            "127.0.0.1:5000",
            "--host '127.0.0.1:5000': expected a host alone, got a host and a port; give the port with --port: "
            "--host 127.0.0.1 --port 5000",
        ),
        ("[::1]:5000", "give the port with --port: --host ::1 --port 5000"),
    ],
)
def test_a_host_written_as_an_address_is_said_so(host: str, message: str) -> None:
    """They were "cannot resolve it: Name or service not known"."""
    with pytest.raises(OSError) as info:
        _check_bindable(ServerConfig(env="CartPole-v1", host=host, port=0))
    assert message in str(info.value), str(info.value)
    assert host_problem("::1") is None and host_problem("localhost") is None and host_problem("::ffff:1.2.3.4") is None
    assert host_problem(host, host_option="--metrics-host", port_option="--metrics-port") is not None


def test_the_health_probe_asks_where_the_server_listens() -> None:
    """The probe took ENVFLEET_HOST='[::]' for ::, a host the server refuses."""
    assert default_address({"ENVFLEET_HOST": "::", "ENVFLEET_PORT": "6000"}) == "[::1]:6000"
    assert default_address({"ENVFLEET_HOST": "[::]", "ENVFLEET_PORT": "6000"}) != "[::1]:6000"


def test_ipv4_mapped_loopback_is_loopback() -> None:
    assert _is_loopback("::ffff:127.0.0.1") and _is_loopback("LOCALHOST") and not _is_loopback("::ffff:10.0.0.1")


def test_a_host_without_ipv4_loopback_is_pointed_to_ipv6s() -> None:
    hint = bind_hint("127.0.0.1", errno.EADDRNOTAVAIL)
    assert "--host ::1" in hint, hint


# -- metrics ----------------------------------------------------------------------------------------


@pytest.mark.skipif(not dual_stack(), reason="needs IPv6 sockets that take IPv4 too (Linux's default)")
def test_metrics_on_the_wildcard_follow_grpc_onto_ipv6() -> None:
    config = ServerConfig(env="CartPole-v1", host="0.0.0.0", port=0, metrics_port=0)
    assert _metrics_hosts(config) == ["::"] and http_host("0.0.0.0") == "::" and http_host("::1") == "::1"
    assert _metrics_hosts(ServerConfig(env="CartPole-v1", host="10.0.0.1", port=0, metrics_port=0)) == ["10.0.0.1"]


@needs_ipv6_loopback
@pytest.mark.skipif(not dual_stack(), reason="needs IPv6 sockets that take IPv4 too (Linux's default)")
def test_metrics_on_the_wildcard_answer_on_both_families() -> None:
    """--host 0.0.0.0 (the image's): gRPC took IPv6 too, the metrics port IPv4 alone."""
    server = _Server("0.0.0.0", "--metrics-port", "0")
    try:
        match = re.search(r"Prometheus metrics on http://\S+:(\d+)/metrics", server.text())
        assert match is not None, server.text()
        assert match[0].startswith("Prometheus metrics on http://0.0.0.0:"), match[0]  # (as given: not [::])
        for host in ("127.0.0.1", "[::1]"):
            with urllib.request.urlopen(f"http://{host}:{match[1]}/metrics", timeout=10) as answer:
                assert answer.status == 200
        assert "IPv4 and IPv6 alike" in server.text()
    finally:
        server.stop()


@needs_ipv6_loopback
@pytest.mark.skipif(not dual_stack(), reason="needs IPv6 sockets that take IPv4 too (Linux's default)")
def test_the_learners_metrics_on_the_wildcard_answer_on_both_families() -> None:
    """learner train --metrics-host 0.0.0.0 (the k8s overlay's): IPv4 alone, where the env servers' took both."""
    metrics = serve_metrics("0.0.0.0", 0)
    try:
        port = str(metrics.url).rpartition(":")[2].partition("/")[0]
        for host in ("127.0.0.1", "[::1]"):
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as answer:
                assert answer.status == 200
    finally:
        metrics.close()


def test_the_learners_metrics_host_written_as_an_address_is_said_so() -> None:
    with pytest.raises(OptionError, match=r"^--metrics-host '\[::1\]': write IPv6 addresses without brackets here"):
        serve_metrics("[::1]", 0)


# -- the learner's side -----------------------------------------------------------------------------


def test_localhost_reaches_a_server_on_ipv6_loopback_as_grpc_does(ipv6_server: _Server) -> None:
    """`learner servers localhost:PORT` said "connection refused" (its plain check asked the system,
    which gives 127.0.0.1 alone for localhost here), where `learner train` connected."""
    assert probe(f"localhost:{ipv6_server.port}") is None
    [info] = survey(f"localhost:{ipv6_server.port}", timeout=5)
    assert info.error == "" and info.env_id == "CartPole-v1", info.error


def test_an_ipv6_peer_is_logged_as_written(ipv6_server: _Server) -> None:
    """It was ipv6:%5B::1%5D:PORT, in the server's log lines and in `learner servers`' "claimed by"."""
    assert peer_text("ipv6:%5B::1%5D:5000") == "ipv6:[::1]:5000"
    with RemoteVectorEnv(ipv6_server.address) as envs:
        envs.reset(seed=0)
        [info] = survey(ipv6_server.address, timeout=5)
        assert "ipv6:[::1]:" in info.claimed_by and "%5B" not in info.claimed_by, info.claimed_by
    assert "%5B" not in ipv6_server.text()


def _resolving_to_both(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """``name`` resolves to ::1 and 127.0.0.1, as localhost does on many systems."""
    real = socket.getaddrinfo

    def getaddrinfo(host: str, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == name:
            return [
                (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", int(port), 0, 0)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", int(port))),
            ]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.mark.slow
def test_an_address_of_a_dns_name_is_named_with_it(
    start_servers: StartServers, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A server on 127.0.0.1 alone, found by a name with IPv6 and IPv4 addresses: the error named
    [::1]:PORT, which the user never typed, and not why nothing answers there."""
    [address] = start_servers("CartPole-v1", 1, 1, transport="tcp")
    port = address.rpartition(":")[2]
    _resolving_to_both(monkeypatch, "both.test")
    with pytest.raises(ServerUnavailableError) as info:
        RemoteVectorEnv(f"dns:///both.test:{port}", connect_timeout=1)
    text = str(info.value)
    assert f"env server [::1]:{port}, an address of dns:///both.test:{port}: nothing answered" in text, text
    assert "listens on one family only (env-server --host :: listens on both" in text, text
    caplog.set_level(logging.WARNING, "learner.remote")
    with RemoteVectorEnv(f"dns:///both.test:{port}", connect_timeout=1, fault_tolerant=True) as envs:
        assert envs.addresses == [f"127.0.0.1:{port}"]
    assert f"[::1]:{port}, an address of dns:///both.test:{port}: nothing answered" in caplog.text, caplog.text


@pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None,
    reason="needs Linux, root, unshare and ip (a network namespace without 127.0.0.1)",
)
def test_local_tcp_servers_on_a_host_without_ipv4_loopback_say_what_to_do() -> None:
    """The learner passed on env-server's hint, "give --host one of its own", an option learner train has not."""
    code = (
        "from learner import LocalServers\n"
        "from learner.errors import ServerStartError\n"
        "try:\n"
        "    LocalServers('CartPole-v1', 1, 1, transport='tcp', startup_timeout=30)\n"
        "except ServerStartError as err:\n"
        "    print(err)\n"
    )
    script = f'ip link set lo up && ip addr del 127.0.0.1/8 dev lo && {sys.executable} -c "$0"'
    result = subprocess.run(
        ["unshare", "-n", "sh", "-c", script, code], capture_output=True, text=True, timeout=60, cwd=os.getcwd()
    )
    if "Operation not permitted" in result.stderr or "unshare failed" in result.stderr:
        pytest.skip(f"cannot make a network namespace here: {result.stderr.strip()}")
    assert "local TCP servers listen on 127.0.0.1, which this host lacks" in result.stdout, result
    assert "use --transport unix" in result.stdout and "--host" not in result.stdout, result


def test_an_address_written_wrong_is_a_usage_error_and_none_is_looked_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """learner train (eval, servers) --servers localhost:notaport was said once the command had started,
    exit status 1, no option named: refused with the options (config.check_addresses: a usage error, exit
    status 2), without a look-up (no name resolved, no file read, no Docker engine asked)."""
    from learner import discovery
    from learner.config import check_addresses

    with pytest.raises(ValueError, match=r"^--servers: server address 'localhost:notaport': port 'notaport' is not"):
        check_addresses("localhost:notaport")
    with pytest.raises(ValueError, match=r"^ADDRESSES: server address 'dns:///x:y': port 'y' is not a number$"):
        check_addresses("a:1 dns:///x:y", "ADDRESSES")

    def looked_up(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"looked up: {args}")

    monkeypatch.setattr(socket, "getaddrinfo", looked_up)
    monkeypatch.setitem(discovery._RESOLVERS, "compose", looked_up)
    check_addresses("dns:///nosuch.invalid:50051,compose:env,file:/nonexistent/list,unix:/tmp/x.sock,[::1]:5")
