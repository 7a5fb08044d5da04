"""Addresses: `dns:///name:port` means one connection to every address the name resolves to."""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import learner.discovery
from learner import RemoteVectorEnv, expand_addresses
from learner.discovery import AddressError, NotReadyYet, expand_named, expand_when_ready, probe
from learner.errors import ServerUnavailableError
from tests.conftest import StartServers, fleet, not_found_at_once


def test_a_dns_address_is_every_address_of_the_name(start_servers: StartServers) -> None:
    [address] = start_servers("CartPole-v1", 1, 2, transport="tcp")
    port = address.rpartition(":")[2]
    assert f"127.0.0.1:{port}" in expand_addresses(f"dns:///localhost:{port}")
    assert expand_addresses(f"dns:///127.0.0.1:{port}") == [f"127.0.0.1:{port}"]
    with RemoteVectorEnv(f"dns:///127.0.0.1:{port}") as envs:
        assert envs.num_envs == 2 and envs.addresses == [f"127.0.0.1:{port}"]
        envs.reset(seed=0)
        envs.step(envs.action_space.sample())


def test_a_dns_server_in_the_address_is_a_clear_error() -> None:
    with pytest.raises(AddressError, match="DNS server in the address is not supported"):
        expand_addresses("dns://192.0.2.1/env:50051")


def test_a_name_that_does_not_resolve_says_where_servers_come_from() -> None:
    with pytest.raises(AddressError, match=r"cannot resolve 'nosuch\.invalid': .*compose: `docker compose up -d"):
        expand_addresses("dns:///nosuch.invalid:50051")


def test_an_unknown_scheme_is_refused_at_once() -> None:
    with pytest.raises(
        AddressError, match=r"address 'http://127.0.0.1:5000': unknown scheme 'http'; expected host:port"
    ):
        expand_addresses("http://127.0.0.1:5000")


def test_an_address_given_twice_is_used_once_and_said_once(
    start_servers: StartServers, caplog: pytest.LogCaptureFixture
) -> None:
    (address,) = start_servers("CartPole-v1")
    assert expand_addresses(f"{address},{address}") == [address]
    with RemoteVectorEnv([address, address]) as envs:
        assert envs.num_envs == 1
        envs.refresh()  # looks the addresses up again: no second warning
    assert caplog.text.count(f"{address} given more than once") == 1


def test_probe_says_why_nothing_answers(tmp_path: Path) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, not listening: connecting is refused
        port = closed.getsockname()[1]
        assert probe(f"127.0.0.1:{port}") == "connection refused"
    missing = tmp_path / "nothing.sock"
    assert probe(f"unix:{missing}") == f"no socket file {missing}"
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert probe(f"127.0.0.1:{listening.getsockname()[1]}") is None  # something listens
    assert probe("dns:///env:50051") is None  # not a single endpoint: nothing to say


@pytest.mark.slow
def test_a_server_that_is_not_there_is_waited_for_aloud_then_named_with_the_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
        with pytest.raises(
            ServerUnavailableError, match=rf"{address}: nothing answered within 3 s \(connection refused: "
        ):
            RemoteVectorEnv([address], connect_timeout=3)
    assert f"env server {address} not answering yet ({address}: connection refused); waiting up to 3 s" in caplog.text


def test_a_probe_that_hangs_does_not_hold_up_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    # A name lookup can hang far beyond connect_timeout: the error must not wait for it.
    release = threading.Event()

    def hanging_probe(address: str, timeout: float = 1.0) -> str | None:
        release.wait()
        return "too late"

    monkeypatch.setattr(learner.discovery, "probe", hanging_probe)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
        try:
            with pytest.raises(
                ServerUnavailableError, match=rf"{address}: nothing answered within 1 s \(is the server"
            ):
                RemoteVectorEnv([address], connect_timeout=1)
        finally:
            release.set()


def test_probe_tells_a_file_in_the_sockets_place(tmp_path: Path) -> None:
    (tmp_path / "file").touch()
    (tmp_path / "folder").mkdir()
    assert probe(f"unix:{tmp_path / 'file'}") == f"{tmp_path / 'file'} is a file, not a socket"
    assert probe(f"unix:{tmp_path / 'folder'}") == f"{tmp_path / 'folder'} is a folder, not a socket"


def test_a_name_that_does_not_resolve_yet_is_waited_for_up_to_connect_timeout(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Kubernetes headless service has no address until a pod is ready (and `kubectl apply` starts the
    learner with the servers): waited for, said once, then the same clear error (was: at once)."""
    not_found_at_once(monkeypatch, "env-not-there.invalid")
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="learner.discovery"), pytest.raises(NotReadyYet) as info:
        RemoteVectorEnv("dns:///env-not-there.invalid:50051", connect_timeout=1.5)
    assert 1.0 < time.monotonic() - start < 5.0
    assert "cannot resolve 'env-not-there.invalid'" in str(info.value)
    assert "(still so after waiting 1.5 s)" in str(info.value)
    said = [r.getMessage() for r in caplog.records if "waiting up to" in r.getMessage()]
    assert said == [
        "waiting up to 1.5 s for the name 'env-not-there.invalid' to resolve (dns:///env-not-there.invalid:50051: a service with no replica ready has no address yet)"
    ]


def test_a_name_that_resolves_once_its_service_is_ready_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    real = socket.getaddrinfo
    answers = [socket.gaierror(socket.EAI_NONAME, "Name or service not known")] * 2

    def getaddrinfo(host: str, *args: Any, **kwargs: Any) -> Any:
        if host == "env.invalid":
            if answers:
                raise answers.pop()
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    assert expand_when_ready("dns:///env.invalid:50051", wait=30) == ["127.0.0.1:50051"]
    assert not answers
    # A host:port is taken as it is, resolved or not (gRPC resolves it when it connects).
    assert expand_when_ready("env-not-there.invalid:50051", wait=30) == ["env-not-there.invalid:50051"]
    # No name at all, or a name whose look-up fails otherwise: at once.
    with pytest.raises(AddressError, match=r"server address 'dns:///50051': expected host:port"):
        expand_when_ready("dns:///50051", wait=30)


def test_addresses_name_where_they_come_from() -> None:
    for address, message in [
        ("foo", "server address 'foo': expected host:port (e.g. 127.0.0.1:50051), unix:PATH or dns:///name:port"),
        ("foo:bar", "server address 'foo:bar': port 'bar' is not a number"),
        ("dns:///env:0", "server address 'dns:///env:0': port 0 is outside 1-65535"),
    ]:
        with pytest.raises(AddressError) as info:
            expand_addresses(address)
        assert str(info.value) == message
    # Servers found by a dns: name carry it (under TLS, their certificates are checked against it).
    named = expand_named("dns:///localhost:5,dns:///127.0.0.1:6,127.0.0.1:7")
    assert named["127.0.0.1:6"] is None and named["127.0.0.1:7"] is None
    assert [name for endpoint, name in named.items() if endpoint.endswith(":5")] in (["localhost"], ["localhost"] * 2)


def test_a_server_listed_under_two_names_is_used_once_and_said_so(
    start_servers: StartServers, caplog: pytest.LogCaptureFixture
) -> None:
    """A host name and its address (or a dns: name and an address it resolves to) are one server: its
    second handshake was refused as claimed, by this very learner ("claimed by 'vm:1234'")."""
    [address] = start_servers("CartPole-v1", 1, 2, transport="tcp")
    alias = f"localhost:{address.rpartition(':')[2]}"
    with RemoteVectorEnv([address, alias]) as envs:
        # (whichever name's handshake came first is the one used)
        assert envs.num_envs == 2 and envs.addresses in ([address], [alias])
        used, other = envs.addresses[0], ({address, alias} - set(envs.addresses)).pop()
        assert f"{used} and {other} are the same env server" in caplog.text
        envs.reset(seed=0)
        envs.step(envs.action_space.sample())
        caplog.clear()
        envs.refresh()  # the alias is not tried again
        assert envs.addresses == [used] and not caplog.text


def test_a_servers_other_name_stays_set_aside_at_every_refresh(
    start_servers: StartServers, caplog: pytest.LogCaptureFixture
) -> None:
    """The alias's record was forgotten at the first refresh (as an address listed no more), so the next
    tried it again: a new connection, a Handshake the server refused (claimed by this learner), and the
    warning said again, every other rollout."""
    [address] = start_servers("CartPole-v1", 1, 2, transport="tcp")
    alias = f"localhost:{address.rpartition(':')[2]}"
    with RemoteVectorEnv([address, alias]) as envs:
        used = envs.addresses[0]
        envs.reset(seed=0)
        caplog.clear()
        for _ in range(4):
            assert envs.refresh() is None and envs.addresses == [used]
        assert "same env server" not in caplog.text


def test_a_servers_other_name_is_used_once_the_first_is_out_of_the_fleet(start_servers: StartServers) -> None:
    """A name found to be another of a server in the fleet is set aside while that server is in under its
    first name: once it is out (that name listed no more; a server that left, dropped), the server joins
    under the other."""
    [address] = start_servers("CartPole-v1", 1, 2, transport="tcp")
    alias = f"localhost:{address.rpartition(':')[2]}"
    listed, servers = fleet(address, alias)
    with RemoteVectorEnv(listed) as envs:
        used, other = envs.addresses[0], ({address, alias} - set(envs.addresses)).pop()
        envs.reset(seed=0)
        servers.remove(used)
        change = envs.refresh()
        assert change is not None and (change.removed, change.added) == ((used,), (other,))
        assert envs.addresses == [other] and envs.num_envs == 2
        servers.append(used)  # (listed again: the first name is now the other's alias)
        assert envs.refresh() is None and envs.addresses == [other]


@pytest.mark.parametrize(
    ("address", "message"),
    [
        # (gRPC takes u.sock for an authority, and refuses it: the plain probe connected to ./u.sock all the same)
        ("unix://u.sock", "unix://PATH needs an absolute path (unix:///abs/path, or unix:relative/path)"),
        ("unix:", "no socket path; expected unix:PATH"),
        ("unix://", "no socket path; expected unix:PATH"),
        ("unix:/tmp/a,b.sock", "a comma in a Unix socket's path, where gRPC splits a unix: address"),
        # (int() took these; gRPC does not)
        ("127.0.0.1:3_5659", "port '3_5659' is not a number"),
        ("127.0.0.1: 123", "port ' 123' is not a number"),
        ("127.0.0.1:+123", "port '+123' is not a number"),
        ("127.0.0.1:\uff11\uff12\uff13", "port '\uff11\uff12\uff13' is not a number"),  # (fullwidth digits)
        ("::1:44445", "the host '::1' has a ':' in it; write IPv6 addresses as [::1]:PORT"),
        ("a:1:2", "the host 'a:1' has a ':' in it; write IPv6 addresses as [::1]:PORT"),
        ("dns:///::1:5000", "the host '::1' has a ':' in it; write IPv6 addresses as [::1]:PORT"),
        ("[::1:5000", "unbalanced brackets; write IPv6 addresses as [::1]:PORT"),
        ("::1]:5000", "unbalanced brackets; write IPv6 addresses as [::1]:PORT"),
        ("[[::1]]:5000", "unbalanced brackets; write IPv6 addresses as [::1]:PORT"),
        ("[::1]5000", "expected [IPV6]:PORT (e.g. [::1]:50051)"),
    ],
)
def test_an_address_grpc_would_not_take_is_refused_at_once(address: str, message: str) -> None:
    """Each of these passed the address check, then failed as a server that does not answer ("nothing
    answered ... if it uses TLS, pass its CA"), or hung `learner servers` (unix://u.sock)."""
    with pytest.raises(AddressError) as info:
        expand_addresses([address])  # (a list: a string is split at whitespace)
    assert str(info.value).startswith(f"server address {address!r}: {message}"), str(info.value)


@pytest.mark.parametrize(
    ("address", "message"),
    [
        # (gRPC takes the host for a name, which never resolves: the full connect timeout, then a TLS hint)
        (
            "[127.0.0.1]:5000",
            "expected an IPv6 address in the brackets, got '127.0.0.1'; brackets are for IPv6 "
            "addresses: write 127.0.0.1:PORT",
        ),
        ("[localhost]:5000", "expected an IPv6 address in the brackets, got 'localhost'"),
        ("dns:///[127.0.0.1]:5000", "expected an IPv6 address in the brackets, got '127.0.0.1'"),
        # (were "unbalanced brackets", "the host ... has a ':' in it", "port ... is not a number")
        ("ipv6:[::1]:5000", "unknown scheme 'ipv6'; expected host:port, unix:PATH, dns:///name:port"),
        ("ipv4:127.0.0.1:5000", "unknown scheme 'ipv4'"),
        ("tcp:127.0.0.1:5000", "unknown scheme 'tcp'"),
        ("vsock:2:5000", "unknown scheme 'vsock'"),
        ("unix-abstract:foo", "unknown scheme 'unix-abstract'"),
        ("Unix:/tmp/x.sock", "unknown scheme 'Unix'"),
    ],
)
def test_an_address_of_another_form_is_refused_as_such(address: str, message: str) -> None:
    with pytest.raises(AddressError) as info:
        expand_addresses([address])
    assert str(info.value).startswith(f"server address {address!r}: {message}"), str(info.value)
    if address.startswith("Unix:"):
        assert str(info.value).endswith("(schemes are lower case: unix:)")


def test_a_host_named_like_a_scheme_is_a_host_still() -> None:
    assert expand_addresses(["tcp:5000", "[fe80::1%eth0]:5000", "[::ffff:127.0.0.1]:5000"]) == [
        "tcp:5000",
        "[fe80::1%eth0]:5000",
        "[::ffff:127.0.0.1]:5000",
    ]


def test_the_addresses_grpc_takes_pass_as_they_are() -> None:
    given = ["unix:///tmp/x.sock", "unix:rel/x.sock", "unix:/tmp/y.sock", "[::1]:5000", "localhost:65535", "h:1"]
    assert expand_addresses(given) == given
    assert expand_addresses("dns:///[::1]:5000") == ["[::1]:5000"]


def test_learner_servers_counts_a_server_listed_under_several_names_once(
    start_servers: StartServers, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reviewer's `learner servers 127.0.0.1:P,localhost:P,unix:/x.sock,unix:///x.sock`: 2 servers of 2
    envs each, said as "4 servers, 4 answering, 8 envs"."""
    from learner.cli import main

    [tcp] = start_servers("CartPole-v1", 1, 2, transport="tcp")
    [unix] = start_servers("CartPole-v1", 1, 2, transport="unix")
    path = unix.removeprefix("unix:")
    assert path.startswith("/")
    addresses = [tcp, f"localhost:{tcp.rpartition(':')[2]}", unix, f"unix://{path}"]
    assert main(["servers", ",".join(addresses)]) == 0
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert sum(line.startswith(tuple(f"{a}  CartPole-v1 x2" for a in addresses)) for line in lines) == 4
    assert lines[-1] == "2 servers (4 addresses), 2 answering, 4 envs; some are one server listed under two names"


def test_a_file_address_is_every_address_the_file_lists(tmp_path: Path) -> None:
    listed = tmp_path / "servers.txt"
    listed.write_text("# the fleet\nh1:5000, h2:5000  # two here\n\nunix:/tmp/x.sock\nh1:5000\ndns:///[::1]:5001\n")
    assert expand_addresses(f"file:{listed}") == ["h1:5000", "h2:5000", "unix:/tmp/x.sock", "[::1]:5001"]
    assert expand_addresses([f"file://{listed}", "h3:1"]) == [
        "h1:5000",
        "h2:5000",
        "unix:/tmp/x.sock",
        "[::1]:5001",
        "h3:1",
    ]


def test_a_file_address_that_cannot_be_used_says_why_and_where(tmp_path: Path) -> None:
    listed = tmp_path / "servers.txt"
    with pytest.raises(AddressError, match=r"no such file \(.*servers\.txt\); it should list the env servers"):
        expand_addresses(f"file:{listed}")
    with pytest.raises(AddressError, match="is a folder, not a file"):
        expand_addresses(f"file:{tmp_path}")
    with pytest.raises(AddressError, match=r"expected file:PATH or file:///PATH .* got a host in it"):
        expand_addresses("file://otherhost/servers.txt")
    listed.write_text("h1:5000\nh2:port\n")
    with pytest.raises(AddressError, match=rf"^file:{listed} line 2: .*'h2:port'"):
        expand_addresses(f"file:{listed}")
    listed.write_text(f"h1:5000\nfile:{listed}\n")
    with pytest.raises(AddressError, match=r"line 2: 'file:.*' is a file: address; a file lists servers"):
        expand_addresses(f"file:{listed}")
    listed.write_bytes(b"\xff\xfe h1:5000\n")
    with pytest.raises(AddressError, match="is not UTF-8 text"):
        expand_addresses(f"file:{listed}")


def test_a_file_that_lists_no_server_yet_is_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    listed = tmp_path / "servers.txt"
    listed.write_text("# none yet\n")
    with pytest.raises(NotReadyYet, match="lists no server"):
        expand_addresses(f"file:{listed}")
    looks = []

    def sleep(seconds: float) -> None:  # (the wait's poll: the file gets its server meanwhile)
        looks.append(seconds)
        listed.write_text("h1:5000\n")

    monkeypatch.setattr(learner.discovery.time, "sleep", sleep)
    assert expand_when_ready(f"file:{listed}", wait=60) == ["h1:5000"] and len(looks) == 1


@pytest.mark.slow
def test_servers_added_to_and_taken_from_a_file_join_and_leave_at_refresh(
    start_servers: StartServers, tmp_path: Path
) -> None:
    """host:port servers cannot be added to a running fleet by name; listed in a file, they can."""
    a, b = start_servers("CartPole-v1", 2, 2, transport="tcp")
    listed = tmp_path / "servers.txt"
    listed.write_text(f"{a}\n")
    with RemoteVectorEnv(f"file:{listed}") as envs:
        envs.reset(seed=0)
        assert envs.addresses == [a] and envs.num_envs == 2
        assert envs.refresh() is None  # (read again: the same)
        tmp = tmp_path / "servers.tmp"
        tmp.write_text(f"{a}\n{b}  # added\n")
        tmp.replace(listed)
        change = envs.refresh()
        assert change is not None and change.added == (b,) and envs.addresses == [a, b] and envs.num_envs == 4
        envs.step(envs.action_space.sample())
        listed.write_text(f"{b}\n")
        change = envs.refresh()
        assert change is not None and change.removed == (a,) and envs.addresses == [b] and envs.num_envs == 2
        envs.step(envs.action_space.sample())
        listed.unlink()  # a failed look-up keeps the servers connected now (said once)
        assert envs.refresh() is None and envs.addresses == [b]
