"""compose: addresses: parsing, choosing each replica's published port, which replicas count.

These run without Docker on the records the engine returns; tests/test_docker.py resolves real replicas.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from learner import AddressError, expand_addresses
from learner.compose import Replica, choose_host_port, parse_target, replica_addresses, replica_from_record
from learner.discovery import NotReadyYet, expand_when_ready, register_resolver


def replica(
    number: int,
    *,
    project: str = "envfleet",
    status: str = "running",
    health: str | None = "healthy",
    ports: Mapping[str, Sequence[Mapping[str, str]] | None] | None = None,
) -> Replica:
    if ports is None:
        ports = {"50051/tcp": [{"HostIp": "127.0.0.1", "HostPort": str(32000 + number)}]}
    return Replica(f"{project}-env-{number}", project, number, status, health, ports)


@pytest.mark.parametrize(
    ("target", "parsed"),
    [
        ("env", (None, "env", None)),
        ("envfleet/env", ("envfleet", "env", None)),
        ("env:6000", (None, "env", 6000)),
        ("my-proj/env-2:50051", ("my-proj", "env-2", 50051)),
    ],
)
def test_parse_target(target: str, parsed: tuple[str | None, str, int | None]) -> None:
    assert parse_target(target) == parsed


@pytest.mark.parametrize(
    ("target", "fragment"),
    [("", "compose:SERVICE"), ("/env", "compose:SERVICE"), ("a/b/c", "compose:PROJECT/SERVICE"), ("env:x", "'x'")],
)
def test_bad_targets_name_the_address(target: str, fragment: str) -> None:
    with pytest.raises(AddressError, match=f"compose:{target}") as info:
        parse_target(target)
    assert fragment in str(info.value)


def test_loopback_binding_is_preferred_and_wildcards_are_reached_on_loopback() -> None:
    both = {"50051/tcp": [{"HostIp": "::", "HostPort": "7001"}, {"HostIp": "0.0.0.0", "HostPort": "7000"}]}
    assert choose_host_port(replica(1, ports=both), None) == "127.0.0.1:7000"
    lan = {"50051/tcp": [{"HostIp": "192.168.1.5", "HostPort": "7002"}, {"HostIp": "127.0.0.1", "HostPort": "7003"}]}
    assert choose_host_port(replica(1, ports=lan), None) == "127.0.0.1:7003"
    v6 = {"50051/tcp": [{"HostIp": "::1", "HostPort": "7004"}]}
    assert choose_host_port(replica(1, ports=v6), None) == "[::1]:7004"
    only_lan = {"50051/tcp": [{"HostIp": "192.168.1.5", "HostPort": "7005"}]}
    assert choose_host_port(replica(1, ports=only_lan), None) == "192.168.1.5:7005"


def test_container_port_is_needed_only_when_several_are_published() -> None:
    two = {
        "50051/tcp": [{"HostIp": "127.0.0.1", "HostPort": "7000"}],
        "6006/tcp": [{"HostIp": "127.0.0.1", "HostPort": "7001"}],
        "9999/tcp": None,  # exposed, not published
    }
    with pytest.raises(AddressError, match=r"exactly one published TCP port, found 50051/tcp, 6006/tcp"):
        choose_host_port(replica(1, ports=two), None)
    assert choose_host_port(replica(1, ports=two), 6006) == "127.0.0.1:7001"
    with pytest.raises(AddressError, match="container port 9999 is not published"):
        choose_host_port(replica(1, ports=two), 9999)
    with pytest.raises(AddressError, match="found none"):
        choose_host_port(replica(1, ports={"50051/tcp": None}), None)


def test_only_running_healthy_replicas_count_in_replica_order() -> None:
    replicas = [
        replica(3),
        replica(1),
        replica(2, health="starting"),
        replica(4, health=None),  # no health check: running is enough
        replica(5, status="exited"),
        replica(6, health="unhealthy"),
        replica(10),
    ]
    assert replica_addresses(replicas, "env") == [
        "127.0.0.1:32001",
        "127.0.0.1:32003",
        "127.0.0.1:32004",
        "127.0.0.1:32010",
    ]


def test_no_ready_replica_says_why_and_what_to_run() -> None:
    with pytest.raises(AddressError) as info:
        replica_addresses([replica(1, health="starting"), replica(2, status="exited")], "envfleet/env")
    message = str(info.value)
    assert "no running, healthy replica of compose service 'env' of project 'envfleet'" in message
    assert "envfleet-env-1 (starting), envfleet-env-2 (exited)" in message
    assert "docker compose up -d --wait --scale env=N" in message
    with pytest.raises(AddressError, match="no running, healthy replica"):
        replica_addresses([], "env")
    # Still starting: worth a wait (a learner run right after `docker compose up -d`).
    with pytest.raises(NotReadyYet):
        replica_addresses([replica(1, health="starting")], "env")
    # A crash loop or failed health checks: no wait mends them; the logs say why.
    for failing in (replica(1, status="restarting", health=None), replica(1, health="unhealthy")):
        with pytest.raises(AddressError, match=r"\(`docker compose logs env` says why they fail\)") as info:
            replica_addresses([failing], "env")
        assert not isinstance(info.value, NotReadyYet)
        # (beside one that is starting, which may yet be healthy: waited for, with the same hint)
        with pytest.raises(NotReadyYet, match=r"\(`docker compose logs env` says why they fail\)"):
            replica_addresses([failing, replica(2, health="starting")], "env")


def test_addresses_of_servers_still_starting_are_waited_for() -> None:
    answers: list[list[str] | None] = [None, None, ["127.0.0.1:5"]]

    def resolve(rest: str) -> list[str]:
        answer = answers.pop(0)
        if answer is None:
            raise NotReadyYet(f"address 'waiting:{rest}': starting")
        return answer

    register_resolver("waiting", resolve)
    assert expand_when_ready("waiting:x", wait=30) == ["127.0.0.1:5"]
    answers[:] = [None] * 10
    with pytest.raises(NotReadyYet):
        expand_when_ready("waiting:x", wait=0.1)


def test_several_projects_need_the_project_named() -> None:
    replicas = [replica(1, project="a"), replica(1, project="b")]
    with pytest.raises(AddressError, match="several compose projects; use one of compose:a/env, compose:b/env"):
        replica_addresses(replicas, "env")
    # Only projects with a running replica count: another project's stopped containers do not.
    stopped = [replica(1, project="a", status="exited"), replica(2, project="a", status="exited")]
    assert replica_addresses([*stopped, replica(1, project="b")], "env") == ["127.0.0.1:32001"]
    with pytest.raises(AddressError, match=r"not ready: a-env-1 \(exited\), a-env-2 \(exited\)"):
        replica_addresses(stopped, "env")


@pytest.mark.parametrize(
    ("target", "projects", "pinned"),
    [
        ("env", ["a"], "a/env"),
        ("env:6000", ["a", "a"], "a/env:6000"),
        ("env", ["a", "b"], "env"),  # several: left as given (resolving says which to name)
        ("env", [], "env"),  # none running yet
        ("b/env", ["a"], "b/env"),  # named: kept
    ],
)
def test_compose_addresses_are_pinned_to_the_one_project_that_runs_the_service(
    target: str, projects: list[str], pinned: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the engine lists (running containers of the service, by label) decides; no engine: as given."""
    from learner import compose
    from learner.compose import PROJECT_LABEL, pin_compose
    from learner.discovery import pin_addresses

    records = [{"Labels": {PROJECT_LABEL: p, "com.docker.compose.service": "env"}} for p in projects]
    monkeypatch.setattr(compose, "ask_engine", lambda address, what, query: records)
    assert pin_compose(target) == pinned
    assert pin_addresses(f"127.0.0.1:1,compose:{target}") == f"127.0.0.1:1,compose:{pinned}"
    assert pin_addresses(["unix:/x.sock", f"compose:{target}"]) == ["unix:/x.sock", f"compose:{pinned}"]

    def no_engine(address: str, what: str, query: object) -> None:
        raise AddressError(f"address {address!r}: cannot reach the Docker engine")

    monkeypatch.setattr(compose, "ask_engine", no_engine)
    assert pin_compose(target) == target


def test_compose_scheme_is_registered() -> None:
    """expand_addresses hands compose: to the resolver (which then fails to find anything)."""
    with pytest.raises(AddressError, match="compose:no-such-project-zz9/env"):
        expand_addresses("compose:no-such-project-zz9/env")


def test_replica_from_a_docker_container_list_record() -> None:
    record = {
        "Id": "0123456789abcdef",
        "Names": ["/envfleet-env-3"],
        "State": "running",
        "Status": "Up 2 seconds (health: starting)",
        "Labels": {"com.docker.compose.project": "envfleet", "com.docker.compose.container-number": "3"},
        "Ports": [
            {"IP": "0.0.0.0", "PrivatePort": 50051, "PublicPort": 32768, "Type": "tcp"},
            {"IP": "::", "PrivatePort": 50051, "PublicPort": 32768, "Type": "tcp"},
            {"PrivatePort": 6006, "Type": "tcp"},
        ],
    }
    replica = replica_from_record(record)
    assert (replica.name, replica.project, replica.number) == ("envfleet-env-3", "envfleet", 3)
    assert (replica.status, replica.health) == ("running", "starting")
    assert replica.ports["6006/tcp"] is None
    assert choose_host_port(replica, None) == "127.0.0.1:32768"
    healthy = replica_from_record({**record, "Status": "Up 1 minute (healthy)"})
    assert healthy.health == "healthy"
    assert replica_from_record({**record, "Status": "Up 1 minute"}).health is None
    assert replica_from_record({**record, "State": "exited", "Status": "Exited (0) 3 seconds ago"}).status == "exited"


REMOTE = "198.18.1.1"  # a Docker engine on another host: DOCKER_HOST=tcp://198.18.1.1:2375


def test_a_remote_engine_s_wildcard_bindings_are_reached_at_its_host() -> None:
    """With DOCKER_HOST naming another host's engine, 0.0.0.0 and :: are that host's addresses, not ours
    (they were turned into 127.0.0.1: the learner's own loopback, where no replica listens)."""
    both = {"50051/tcp": [{"HostIp": "::", "HostPort": "7001"}, {"HostIp": "0.0.0.0", "HostPort": "7000"}]}
    assert choose_host_port(replica(1, ports=both), None, REMOTE) == f"{REMOTE}:7000"
    assert choose_host_port(replica(1, ports=both), None, "docker-box") == "docker-box:7000"
    assert choose_host_port(replica(1, ports=both), None, "2001:db8::7") == "[2001:db8::7]:7000"
    # A binding on the engine host's loopback as well as a wildcard one: the wildcard (at its host).
    mixed = {"50051/tcp": [{"HostIp": "127.0.0.1", "HostPort": "7002"}, {"HostIp": "0.0.0.0", "HostPort": "7003"}]}
    assert choose_host_port(replica(1, ports=mixed), None, REMOTE) == f"{REMOTE}:7003"
    # One on a given address of the engine's host: that address.
    lan = {"50051/tcp": [{"HostIp": "127.0.0.1", "HostPort": "7004"}, {"HostIp": "192.168.1.5", "HostPort": "7005"}]}
    assert choose_host_port(replica(1, ports=lan), None, REMOTE) == "192.168.1.5:7005"
    assert replica_addresses([replica(2, ports=both)], "env", REMOTE) == [f"{REMOTE}:7000"]
    # This host's engine (None): as before, on loopback.
    assert choose_host_port(replica(1, ports=both), None, None) == "127.0.0.1:7000"


def test_a_remote_engine_s_loopback_only_port_is_refused_saying_how_to_publish_it() -> None:
    """The compose file's default (ENVFLEET_BIND=127.0.0.1) on another host: no address reaches it from here."""
    for host_ip in ("127.0.0.1", "::1"):
        only_loopback = {"50051/tcp": [{"HostIp": host_ip, "HostPort": "7006"}]}
        with pytest.raises(AddressError) as info:
            replica_addresses([replica(1, ports=only_loopback)], "env", REMOTE)
        message = str(info.value)
        assert (
            "compose replica envfleet-env-1: its port 50051/tcp is published on the Docker host's loopback only"
            in message
        )
        assert f"cannot be reached from here: the Docker engine (DOCKER_HOST) is on {REMOTE}" in message
        assert ("loopback only ([::1]:7006)" if ":" in host_ip else "loopback only (127.0.0.1:7006)") in message
        assert "ENVFLEET_BIND=0.0.0.0" in message and "run the learner on the Docker host" in message


def test_resolving_through_a_remote_engine_reaches_the_replicas_at_its_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve_compose asks the engine it lists the containers of where that engine is (its client's base URL)."""
    from learner import compose

    record = {
        "Names": ["/envfleet-env-1"],
        "State": "running",
        "Status": "Up 1 minute (healthy)",
        "Labels": {"com.docker.compose.project": "envfleet", "com.docker.compose.service": "env"},
        "Ports": [
            {"IP": "0.0.0.0", "PrivatePort": 50051, "PublicPort": 32768, "Type": "tcp"},
            {"IP": "::", "PrivatePort": 50051, "PublicPort": 32768, "Type": "tcp"},
        ],
    }
    for base_url, expected in [
        ("http://198.18.1.1:2375", f"{REMOTE}:32768"),  # (the SDK's tcp://)
        ("https://docker-box.example:2376", "docker-box.example:32768"),
        ("http+docker://localhost", "127.0.0.1:32768"),  # (the SDK's unix://)
    ]:
        engine = _engine(base_url, containers=[record])
        monkeypatch.setattr(compose, "ask_engine", lambda address, what, query, engine=engine: query(engine))
        assert compose.resolve_compose("env") == [expected]


def test_podman_s_replicas_count_once_its_health_filter_says_healthy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Podman's container list says "Up 5 seconds", no health: the engine's health filter tells a replica still
    starting or failing its check from a healthy one (each counted as ready before); Docker's records, which
    say it, cost no second call."""
    from learner import compose

    def podman_s(number: int, status: str = "Up 5 seconds") -> dict[str, Any]:
        return {
            "Names": [f"envfleet_env_{number}"],
            "State": "running",
            "Status": status,
            "Labels": {"com.docker.compose.project": "envfleet", "com.docker.compose.service": "env"}
            | {"com.docker.compose.container-number": str(number)},
            "Ports": [{"IP": "0.0.0.0", "PrivatePort": 50051, "PublicPort": 32760 + number, "Type": "tcp"}],
        }

    calls: list[str] = []

    def ask(address: str, what: str, query: Any, engine: SimpleNamespace) -> Any:
        calls.append(what)
        return query(engine)

    def resolve(records: list[dict[str, Any]], health: dict[str, str]) -> list[str]:
        engine = _engine("http+docker://localhost", containers=records, health=health)
        calls.clear()
        monkeypatch.setattr(compose, "ask_engine", lambda address, what, query: ask(address, what, query, engine))
        return compose.resolve_compose("env")

    health = {"envfleet_env_1": "healthy", "envfleet_env_2": "starting", "envfleet_env_3": "unhealthy"}
    assert resolve([podman_s(1), podman_s(2), podman_s(3)], health) == ["127.0.0.1:32761"]
    assert len(calls) == 3  # the list, then not ready (starting or unhealthy), then unhealthy
    with pytest.raises(AddressError, match=r"not ready: envfleet_env_2 \(starting\), envfleet_env_3 \(unhealthy\)"):
        resolve([podman_s(2), podman_s(3)], health)
    with pytest.raises(NotReadyYet, match="envfleet_env_2 \\(starting\\)"):  # (waited for)
        resolve([podman_s(2)], health)
    # All healthy (or no health check): one call more; Docker's status text: none.
    assert resolve([podman_s(1), podman_s(4)], health) == ["127.0.0.1:32761", "127.0.0.1:32764"]
    assert len(calls) == 2
    assert resolve([podman_s(1, "Up 5 seconds (healthy)")], {}) == ["127.0.0.1:32761"]
    assert len(calls) == 1


def _engine(
    base_url: str, *, containers: Sequence[Mapping[str, Any]] = (), health: Mapping[str, str] | None = None
) -> SimpleNamespace:
    """What the resolvers use of a ``docker.DockerClient``: its low-level client's base URL and container list,
    which applies the label filters as an engine does (``key=value``: the label has that value; ``key``: it has
    the label), ``status``, and ``health`` (a container's: ``health`` by name, as Podman's list does not say it,
    else what its status text says)."""

    def listed(all: bool = False, filters: Mapping[str, Any] | None = None) -> list[Mapping[str, Any]]:
        def kept(record: Mapping[str, Any]) -> bool:
            labels = record.get("Labels") or {}
            name = replica_from_record(record).name
            its_health = (health or {}).get(name) or replica_from_record(record).health or "none"
            if its_health not in (filters or {}).get("health", [its_health]):
                return False
            for wanted in (filters or {}).get("label", []):
                key, _, value = wanted.partition("=")
                if key not in labels or ("=" in wanted and labels[key] != value):
                    return False
            return (filters or {}).get("status") in (None, record.get("State"))

        return [record for record in containers if kept(record)]

    return SimpleNamespace(api=SimpleNamespace(base_url=base_url, containers=listed))


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("tcp://198.18.1.1:2375", "198.18.1.1"),
        ("http://198.18.1.1:2375", "198.18.1.1"),
        ("https://docker-box.example:2376", "docker-box.example"),
        ("tcp://[2001:db8::7]:2375", "2001:db8::7"),
        ("ssh://me@docker-box:2222", "docker-box"),
        ("ssh://docker-box", "docker-box"),
        # This host's engine: its ports are reached on loopback.
        ("unix:///var/run/docker.sock", None),
        ("http+unix://%2Fvar%2Frun%2Fdocker.sock", None),
        ("npipe:////./pipe/docker_engine", None),
        ("http+docker://localhost", None),
        ("http+docker://localnpipe", None),
        ("tcp://127.0.0.1:2375", None),
        ("tcp://localhost:2375", None),
        ("tcp://[::1]:2375", None),
    ],
)
def test_the_engine_s_host_comes_from_its_url(url: str, host: str | None) -> None:
    from learner.engine import url_host

    assert url_host(url, "compose:env") == host


def test_the_engine_s_host_from_a_docker_sdk_client() -> None:
    """The SDK's own clients, made without asking an engine (a version given); ssh:// as the SDK keeps it."""
    docker = pytest.importorskip("docker")
    from learner.engine import engine_host

    client = docker.DockerClient(base_url="tcp://198.18.1.1:2375", version="1.41")
    assert engine_host(client, "compose:env") == REMOTE
    client = docker.DockerClient(base_url="unix:///var/run/docker.sock", version="1.41")
    assert engine_host(client, "compose:env") is None
    ssh = _engine("http+docker://ssh")
    ssh.api._custom_adapter = SimpleNamespace(ssh_host="me@docker-box:2222")  # (ssh run as a program)
    assert engine_host(ssh, "compose:env") == "docker-box"
    # (paramiko's connection, an ~/.ssh/config alias resolved to its HostName)
    ssh.api._custom_adapter = SimpleNamespace(ssh_host="me@box-alias", ssh_params={"hostname": "198.18.1.1"})
    assert engine_host(ssh, "compose:env") == REMOTE
    ssh.api._custom_adapter = SimpleNamespace(ssh_host="me@box-alias", ssh_params={"hostname": "2001:db8::7"})
    assert engine_host(ssh, "compose:env") == "2001:db8::7"
    with pytest.raises(AddressError, match=r"address 'compose:env': expected the Docker engine's URL to name its host"):
        engine_host(_engine("http+docker://ssh"), "compose:env")


def test_the_engine_client_is_kept_between_look_ups_and_dropped_when_it_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Making a client asks the engine its API version (9 ms of a 10 ms look-up): the learner's look-up before
    each rollout reuses one; one that failed is closed and the next look-up makes a new one."""
    pytest.importorskip("docker")
    import docker
    import docker.errors

    from learner import engine

    made: list[SimpleNamespace] = []

    def from_env() -> SimpleNamespace:
        made.append(SimpleNamespace(closed=False))
        made[-1].close = lambda client=made[-1]: setattr(client, "closed", True)
        return made[-1]

    monkeypatch.setattr(docker, "from_env", from_env)
    monkeypatch.setattr(engine, "_clients", {})
    monkeypatch.setenv("DOCKER_HOST", "unix:///nowhere-a.sock")
    assert engine.ask_engine("compose:env", "list containers", lambda client: id(client)) == id(made[0])
    assert engine.ask_engine("compose:env", "list containers", lambda client: id(client)) == id(made[0])
    assert len(made) == 1 and not made[0].closed

    def refused(client: object) -> None:
        raise docker.errors.APIError("refused", explanation="the engine said no")

    with pytest.raises(AddressError, match="the Docker engine failed to list containers: the engine said no"):
        engine.ask_engine("compose:env", "list containers", refused)
    # (the kept one, then a new one, asked again: both refused, both closed)
    assert len(made) == 2 and made[0].closed and made[1].closed
    engine.ask_engine("compose:env", "list containers", lambda client: None)
    assert len(made) == 3  # a new one after the failure
    monkeypatch.setenv("DOCKER_HOST", "unix:///nowhere-b.sock")  # another engine: a client of its own
    engine.ask_engine("compose:env", "list containers", lambda client: None)
    assert len(made) == 4 and not made[2].closed

    # A kept client whose engine went away (restarted): its lost connection is no DockerException, and
    # ended the look-up raw (and refresh(), and the run); the look-up asks again with a new client.
    import requests.exceptions

    def gone_for(client: SimpleNamespace) -> str:
        if client is made[3]:
            raise requests.exceptions.ConnectionError("Connection aborted")
        return "answered"

    assert engine.ask_engine("compose:env", "list containers", gone_for) == "answered"
    assert made[3].closed and len(made) == 5
    with pytest.raises(AddressError, match=r"cannot reach the Docker engine \(refused\); is it running"):
        engine.ask_engine("compose:env", "list containers", lambda client: (_ for _ in ()).throw(OSError("refused")))
    assert len(made) == 6  # (the kept one, then a new one, which failed too: said as the engine unreachable)


def test_a_service_with_only_one_off_containers_is_said_to_have_no_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    """`docker compose run env` alone: no replica (its one-off container publishes no port), said so, and the
    services listed are those with replicas."""
    from learner import compose
    from learner.compose import ONEOFF_LABEL, PROJECT_LABEL, SERVICE_LABEL, resolve_compose

    one_off = {"Labels": {PROJECT_LABEL: "p", SERVICE_LABEL: "env", ONEOFF_LABEL: "True"}}
    replica_of_other = {"Labels": {PROJECT_LABEL: "p", SERVICE_LABEL: "web", ONEOFF_LABEL: "False"}}
    answers: Iterator[object] = iter(
        [([], None), [one_off, replica_of_other]]
    )  # (the service's replicas; every compose container)
    monkeypatch.setattr(compose, "ask_engine", lambda address, what, query: next(answers))
    with pytest.raises(AddressError) as info:
        resolve_compose("p/env")
    assert "no container of a compose service 'env' in project 'p' (only `docker compose run` containers" in str(
        info.value
    )
    assert str(info.value).endswith("(project/service): p/web")


def test_replicas_podman_compose_started_are_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """podman-compose sets no com.docker.compose.oneoff label: a filter on its "False" found none of its replicas
    ("no container of a compose service 'env'; compose services with containers here: envfleet/env")."""
    from learner import compose
    from learner.compose import ONEOFF_LABEL, PROJECT_LABEL, SERVICE_LABEL, pin_compose, resolve_compose

    def record(number: int, **labels: str) -> dict[str, Any]:
        return {
            "Names": [f"/envfleet_env_{number}"],
            "State": "running",
            "Status": "Up 1 minute (healthy)",
            "Labels": {PROJECT_LABEL: "envfleet", SERVICE_LABEL: "env", **labels},
            "Ports": [{"IP": "127.0.0.1", "PrivatePort": 50051, "PublicPort": 32000 + number, "Type": "tcp"}],
        }

    engine = _engine("http+docker://localhost", containers=[record(1), record(2), record(3, **{ONEOFF_LABEL: "True"})])
    monkeypatch.setattr(compose, "ask_engine", lambda address, what, query: query(engine))
    assert resolve_compose("env") == ["127.0.0.1:32001", "127.0.0.1:32002"]  # (not the one-off container)
    assert pin_compose("env") == "envfleet/env"
