"""Both address families where one is missing: the health probe of a server on every interface tries both
loopbacks, the metrics endpoint binds the first of its host's addresses it can (a Unix-socket server's:
127.0.0.1, else ::1), keeps an IPv6 address's scope id, and takes IPv4 too on ``::``.

Most tests need no namespace (a server on one loopback, addresses this machine lacks); those that do run
in a network namespace of their own (``unshare -n``), skipped where one cannot be made."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import env_server.health
import env_server.server
from env_server.config import ServerConfig
from env_server.metrics import bind_error, serve_registry
from learner.discovery import AddressError, expand_addresses
from learner.live_metrics import serve_metrics
from tests.certs import make_server_certs
from tests.conftest import SpawnServer
from tests.servers import ServerSubprocess, bindable, needs_ipv6_loopback

HEALTH_FILE = Path(env_server.health.__file__)


# Two addresses of the documentation's ranges this machine lacks (EADDRNOTAVAIL to bind; a test machine
# may have one of them, as one here had 192.0.2.2).
ABSENT = [a for a in ("192.0.2.201", "198.51.100.201", "203.0.113.201", "192.0.2.202") if not bindable(a)][:2]
needs_absent = pytest.mark.skipif(len(ABSENT) < 2, reason="this machine has the addresses meant to be absent")


_no_namespaces = pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None,
    reason="needs Linux, root, unshare and ip (a network namespace of its own)",
)


def needs_namespaces(test: Any) -> Any:
    """A test run in network namespaces of its own (marker netns, as tests/test_netns.py's), with IPv6 there."""
    return pytest.mark.netns(needs_ipv6_loopback(_no_namespaces(test)))


def probe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The probe as the image runs it: by path, isolated (-I)."""
    return subprocess.run(
        [sys.executable, "-I", str(HEALTH_FILE), *args], capture_output=True, text=True, timeout=60, env=env
    )


class _Server(ServerSubprocess):
    """An ``env-server`` of CartPole-v1 on ``--host HOST --port 0``, ready once made."""

    def __init__(self, host: str, *args: str) -> None:
        super().__init__(
            [sys.executable, "-m", "env_server", "--env", "CartPole-v1", "--host", host, "--port", "0", *args]
        )
        self.port = int(self.ready().rpartition(":")[2])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _in_namespace(setup: str, code: str) -> subprocess.CompletedProcess[str]:
    """``code`` (Python) run in a new network namespace, its loopback up, after the shell commands ``setup``;
    skips the test where no namespace can be made."""
    script = f'ip link set lo up && {setup} && exec {sys.executable} -c "$0"'
    result = subprocess.run(
        ["unshare", "-n", "sh", "-c", script, textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.getcwd(),
    )
    if "Operation not permitted" in result.stderr or "unshare failed" in result.stderr:
        pytest.skip(f"cannot make a network namespace here: {result.stderr.strip()}")
    return result


# -- 1. the health probe ----------------------------------------------------------------------------


@needs_ipv6_loopback
@pytest.mark.slow
def test_the_probe_of_a_wildcard_server_asks_the_other_loopback_when_the_first_fails(
    spawn_server: SpawnServer,
) -> None:
    """ENVFLEET_HOST=0.0.0.0 asked 127.0.0.1 alone (a host without IPv4 loopback: "Network is unreachable",
    unhealthy, while gRPC served on ::1); ENVFLEET_HOST=:: asked ::1 alone (IPv6 disabled)."""
    on_ipv6 = _Server("::1")
    try:
        result = probe(env={**os.environ, "ENVFLEET_HOST": "0.0.0.0", "ENVFLEET_PORT": str(on_ipv6.port)})
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"[::1]:{on_ipv6.port}: SERVING"
    finally:
        on_ipv6.stop()
    on_ipv4 = spawn_server("CartPole-v1", 1)  # (127.0.0.1 alone)
    port = on_ipv4.address.rpartition(":")[2]
    result = probe(env={**os.environ, "ENVFLEET_HOST": "::", "ENVFLEET_PORT": port})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"127.0.0.1:{port}: SERVING"


def _probe_tls_server(tmp_path: Path, listen_on: str, cert_name: str) -> tuple[int, subprocess.CompletedProcess[str]]:
    """The probe (ENVFLEET_HOST=0.0.0.0, TLS) of a server on ``listen_on`` whose certificate names ``cert_name``:
    the server's port, and the probe's result."""
    certs = make_server_certs(tmp_path, names=(cert_name,))
    server = _Server(listen_on, "--tls-cert", str(certs.cert), "--tls-key", str(certs.key))
    try:
        environ = {
            **os.environ,
            "ENVFLEET_HOST": "0.0.0.0",
            "ENVFLEET_PORT": str(server.port),
            "ENVFLEET_TLS_CERT": str(certs.cert),
            "ENVFLEET_TLS_CA": str(certs.ca),
        }
        return server.port, probe(env=environ)
    finally:
        server.stop()


@needs_ipv6_loopback
@pytest.mark.slow
def test_the_probe_checks_the_documented_name_whichever_loopback_answers(tmp_path: Path) -> None:
    """A certificate for 127.0.0.1 (what the probe checks for ENVFLEET_HOST=0.0.0.0) still does when ::1 answers."""
    port, result = _probe_tls_server(tmp_path, "::1", "127.0.0.1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"[::1]:{port}: SERVING"


@pytest.mark.slow
def test_a_tls_failure_on_the_first_loopback_is_the_probes_answer(tmp_path: Path) -> None:
    """The server was reached: its certificate lacks the name checked. The other loopback was asked too, and its
    "Connection refused" was the last line of the probe's output, under the one that says what to set."""
    port, result = _probe_tls_server(tmp_path, "127.0.0.1", "env")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"127.0.0.1:{port}: unhealthy")
    assert "ENVFLEET_TLS_SERVER_NAME" in lines[0], lines


@needs_ipv6_loopback
def test_the_probe_says_each_loopback_it_tried_with_ipv6_addresses_as_written() -> None:
    """It said gRPC's ipv6:%5B::1%5D:PORT, and of one loopback only."""
    port = _free_port()
    result = probe(env={**os.environ, "ENVFLEET_HOST": "0.0.0.0", "ENVFLEET_PORT": str(port)})
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert [line.partition(": unhealthy: UNAVAILABLE")[0] for line in lines] == [f"127.0.0.1:{port}", f"[::1]:{port}"]
    assert f"ipv6:[::1]:{port}" in result.stderr and "%5B" not in result.stderr, result.stderr
    result = probe("--address", f"[::1]:{port}")
    assert result.returncode == 1 and "%5B" not in result.stderr and f"ipv6:[::1]:{port}" in result.stderr


def test_the_probe_asks_one_address_when_the_server_listens_on_one() -> None:
    health = env_server.health
    assert health.default_addresses({"ENVFLEET_HOST": "0.0.0.0", "ENVFLEET_PORT": "6"}) == ["127.0.0.1:6", "[::1]:6"]
    assert health.default_addresses({"ENVFLEET_HOST": "::", "ENVFLEET_PORT": "6"}) == ["[::1]:6", "127.0.0.1:6"]
    assert health.default_addresses({"ENVFLEET_HOST": "", "ENVFLEET_PORT": "6"}) == ["127.0.0.1:6", "[::1]:6"]
    assert health.default_addresses({"ENVFLEET_HOST": "::1", "ENVFLEET_PORT": "6"}) == ["[::1]:6"]
    assert health.default_addresses({"ENVFLEET_UNIX_SOCKET": "/tmp/e.sock"}) == ["unix:/tmp/e.sock"]


# -- 2. a Unix-socket server's metrics --------------------------------------------------------------


def _unix_config(tmp_path: Path) -> ServerConfig:
    return ServerConfig(env="CartPole-v1", unix_socket=str(tmp_path / "e.sock"), metrics_port=0)


def _absent_at(monkeypatch: pytest.MonkeyPatch, *hosts: str) -> None:
    """The metrics bind check says ``hosts`` are no addresses of this machine (EADDRNOTAVAIL)."""
    real = env_server.server.metrics_bind_error

    def bind_error(host: str, port: int) -> OSError | None:
        if host in hosts:
            return OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")
        return real(host, port)

    monkeypatch.setattr(env_server.server, "metrics_bind_error", bind_error)


@needs_ipv6_loopback
def test_a_unix_socket_servers_metrics_fall_back_to_ipv6_loopback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without IPv4 loopback it refused to start: "cannot serve metrics on 127.0.0.1:0 ... give --host ::1"."""
    _absent_at(monkeypatch, "127.0.0.1")
    env_server.server._check_bindable(_unix_config(tmp_path))  # (::1 binds)
    _absent_at(monkeypatch, "127.0.0.1", "::1")
    with pytest.raises(OSError) as info:  # (neither: said of the address that failed last, ::1)
        env_server.server._check_bindable(_unix_config(tmp_path))
    assert str(info.value).startswith("cannot serve metrics on [::1]:0: Cannot assign requested address (::1 is not")


def test_a_unix_socket_servers_metrics_port_taken_is_said_of_ipv4_loopback(tmp_path: Path) -> None:
    """A port taken is the error (not served on ::1 instead, where a scrape of 127.0.0.1 would reach the other
    process); the error names the address that failed, not --host's."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = ServerConfig(env="CartPole-v1", unix_socket=str(tmp_path / "e.sock"), host="::1", metrics_port=port)
        with pytest.raises(OSError, match=rf"^cannot serve metrics on 127\.0\.0\.1:{port}: Address already in use"):
            env_server.server._check_bindable(config)


@needs_ipv6_loopback
@pytest.mark.slow
def test_a_unix_socket_servers_metrics_stay_on_loopback_whatever_the_host(tmp_path: Path) -> None:
    """(The image's ENVFLEET_HOST=0.0.0.0 with ENVFLEET_UNIX_SOCKET: not on every interface, unauthenticated.)"""
    socket_path = str(tmp_path / "e.sock")
    env = [sys.executable, "-m", "env_server", "--env", "CartPole-v1"]
    server = ServerSubprocess([*env, "--unix-socket", socket_path, "--host", "0.0.0.0", "--metrics-port", "0"])
    try:
        server.ready()
        text = server.wait_for("Prometheus metrics on ")
        assert "Prometheus metrics on http://127.0.0.1:" in text, text
        url = text.partition("Prometheus metrics on ")[2].split()[0]
        with urllib.request.urlopen(url, timeout=30) as answer:
            assert answer.status == 200
    finally:
        server.stop()


# -- 3. each of a name's addresses ------------------------------------------------------------------


def _resolving_to(monkeypatch: pytest.MonkeyPatch, name: str, *addresses: str) -> None:
    real = socket.getaddrinfo

    def getaddrinfo(host: str, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == name:
            return [
                (socket.AF_INET6, socket.SOCK_STREAM, 6, "", (a, int(port), 0, 0))
                if ":" in a
                else (socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, int(port)))
                for a in addresses
            ]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@needs_absent
def test_metrics_bind_the_first_address_of_the_host_that_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    """--host localhost (learner: --metrics-host) took the first address alone: "localhost is not an address
    of this machine" where that was 127.0.0.1 and this machine had ::1 alone."""
    _resolving_to(monkeypatch, "two.test", ABSENT[0], "127.0.0.1")
    httpd = serve_registry(CollectorRegistry(), "two.test", 0)
    try:
        assert httpd.server_address[0] == "127.0.0.1"
    finally:
        httpd.shutdown()
        httpd.server_close()
    metrics = serve_metrics("two.test", 0)
    try:
        assert str(metrics.url).startswith("http://two.test:")
    finally:
        metrics.close()
    env_server.server._check_bindable(ServerConfig(env="CartPole-v1", host="two.test", port=0, metrics_port=0))


@needs_absent
def test_metrics_on_localhost_try_both_loopbacks_whatever_the_system_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    """gRPC listens on ::1 and 127.0.0.1 for localhost whatever /etc/hosts says; the metrics endpoint too."""
    _resolving_to(monkeypatch, "localhost", ABSENT[0])
    httpd = serve_registry(CollectorRegistry(), "localhost", 0)
    try:
        assert httpd.server_address[0] in ("::1", "127.0.0.1")
    finally:
        httpd.shutdown()
        httpd.server_close()


@needs_absent
@needs_ipv6_loopback
def test_metrics_on_a_name_whose_first_address_has_the_port_taken_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not served on the name's next address: a scrape of the first would reach the process that has it."""
    _resolving_to(monkeypatch, "two.test", "127.0.0.1", "::1")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as info:
            serve_registry(CollectorRegistry(), "two.test", port)
        assert info.value.errno == errno.EADDRINUSE
        assert bind_error("two.test", port) is not None


def test_metrics_on_a_host_none_of_whose_addresses_binds_name_each(monkeypatch: pytest.MonkeyPatch) -> None:
    _resolving_to(monkeypatch, "none.test", *ABSENT)
    with pytest.raises(OSError) as info:
        serve_registry(CollectorRegistry(), "none.test", 0)
    assert info.value.errno == errno.EADDRNOTAVAIL
    assert f"at each of its addresses ({ABSENT[0]}:0, {ABSENT[1]}:0)" in str(info.value), str(info.value)


# -- 6. texts ---------------------------------------------------------------------------------------


def test_the_learners_metrics_url_names_the_host_given() -> None:
    """--metrics-host 0.0.0.0 printed http://[::]:PORT/metrics (the address served on where it takes IPv4 too)."""
    metrics = serve_metrics("0.0.0.0", 0)
    try:
        assert str(metrics.url).startswith("http://0.0.0.0:"), metrics.url
    finally:
        metrics.close()


def test_an_ipv6_address_without_a_port_is_shown_one_in_brackets() -> None:
    with pytest.raises(AddressError) as info:
        expand_addresses("[::1]")
    assert "(e.g. [::1]:50051)" in str(info.value), str(info.value)


# -- in network namespaces: no IPv4 loopback, a link-local address, bindv6only --------------------

_WITHOUT_IPV4_LOOPBACK = "ip addr del 127.0.0.1/8 dev lo"


@needs_namespaces
@pytest.mark.slow
def test_without_ipv4_loopback_the_probe_and_metrics_go_onto_ipv6(tmp_path: Path) -> None:
    """The image's ENVFLEET_HOST=0.0.0.0 probed unhealthy; a Unix-socket server and one on localhost with
    --metrics-port would not start."""
    code = f"""
        import os, subprocess, sys
        sys.path.insert(0, {os.getcwd()!r})
        from tests.servers import ServerSubprocess
        env = [sys.executable, "-m", "env_server", "--env", "CartPole-v1"]
        for args in (["--unix-socket", {str(tmp_path / "e.sock")!r}], ["--host", "localhost", "--port", "0"]):
            server = ServerSubprocess([*env, *args, "--metrics-port", "0"])
            server.ready()
            print("metrics:", server.wait_for("Prometheus metrics on ").partition("Prometheus metrics on ")[2].split()[0])
            server.stop()
        server = ServerSubprocess([*env, "--host", "0.0.0.0", "--port", "0"])
        port = server.ready().rpartition(":")[2]
        environ = {{**os.environ, "ENVFLEET_HOST": "0.0.0.0", "ENVFLEET_PORT": port}}
        probe = [sys.executable, "-I", {str(HEALTH_FILE)!r}]
        result = subprocess.run(probe, capture_output=True, text=True, env=environ, timeout=60)
        print("probe:", result.returncode, result.stdout.strip(), result.stderr.strip())
        server.stop()
    """
    result = _in_namespace(_WITHOUT_IPV4_LOOPBACK, code)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.partition("]:")[0] for line in lines[:2]] == ["metrics: http://[::1"] * 2, result.stdout
    assert lines[2].startswith("probe: 0 [::1]:") and lines[2].strip().endswith(": SERVING"), result.stdout


@needs_namespaces
@pytest.mark.slow
def test_metrics_on_a_link_local_address_keep_its_zone() -> None:
    """--host fe80::...%IFACE --metrics-port 0 failed: EINVAL (the scope id was dropped)."""
    setup = "ip addr add fe80::e:f/64 dev lo nodad"  # (a link-local address, on the one link there is)
    code = """
        from prometheus_client import CollectorRegistry
        from env_server.metrics import bind_error, serve_registry
        assert bind_error("fe80::e:f%lo", 0) is None
        httpd = serve_registry(CollectorRegistry(), "fe80::e:f%lo", 0)
        print("bound", httpd.server_address[0], httpd.server_address[3] != 0)
    """
    result = _in_namespace(setup, code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in ("bound fe80::e:f%lo True", "bound fe80::e:f True"), result.stdout


@needs_namespaces
@pytest.mark.slow
def test_metrics_on_the_ipv6_wildcard_take_ipv4_where_ipv6_sockets_default_to_ipv6_only() -> None:
    """With net.ipv6.bindv6only=1, metrics on :: (and on 0.0.0.0, served on ::) answered IPv6 alone."""
    code = """
        import urllib.request
        from prometheus_client import CollectorRegistry
        from env_server.metrics import serve_registry
        from env_server.protocol import http_host
        for host in ("::", http_host("0.0.0.0")):
            httpd = serve_registry(CollectorRegistry(), host, 0)
            for loopback in ("127.0.0.1", "[::1]"):
                url = f"http://{loopback}:{httpd.server_port}/metrics"
                with urllib.request.urlopen(url, timeout=30) as answer:
                    print(host, loopback, answer.status)
            httpd.shutdown()
            httpd.server_close()
    """
    result = _in_namespace("sysctl -q -w net.ipv6.bindv6only=1", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [":: 127.0.0.1 200", ":: [::1] 200"] * 2, result.stdout
