"""``compose:`` addresses: every replica of a Docker Compose service, at the host port it publishes.

    compose:env                  service ``env`` of the one compose project that runs it
    compose:envfleet/env         service ``env`` of project ``envfleet`` (when several projects run one)
    compose:env:50051            ... the replicas' container port 50051 (needed only if they publish several)

The replicas are found through the Docker SDK (the ``docker`` package, in the ``learner`` extra), by
the labels compose puts on its containers. Only running replicas that are healthy (or have no health
check) count, so a replica still building its envs joins at the next look-up. Resolving again (the
learner does so between rollouts) finds replicas added or removed by ``docker compose up --scale``.
This is for a learner on the Docker host, or one whose ``DOCKER_HOST`` names the engine of another
host: then the replicas are reached at that host, so they must publish their port on an address
other hosts reach, not on its loopback (``ENVFLEET_BIND``). Inside the compose network use
``dns:///env:50051``.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from env_server.protocol import host_port
from learner.discovery import AddressError, NotReadyYet, note_not_used, register_resolver
from learner.engine import ask_engine, engine_host

__all__ = [
    "Replica",
    "choose_host_port",
    "parse_target",
    "pin_compose",
    "replica_addresses",
    "replica_from_record",
    "resolve_compose",
]

log = logging.getLogger(__name__)

PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
NUMBER_LABEL = "com.docker.compose.container-number"
ONEOFF_LABEL = "com.docker.compose.oneoff"

# Where a published port is reached from the Docker host, best first: the loopback binding the
# compose file makes by default, then a wildcard binding (reached on loopback too), then IPv6.
_LOOPBACK = {"127.0.0.1": "127.0.0.1", "0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::1": "::1", "::": "::1"}
# Bindings on every address of the host.
_WILDCARDS = ("0.0.0.0", "", "::")


@dataclass(frozen=True)
class Replica:
    """What the resolver needs to know about one container of a compose service."""

    name: str
    project: str
    number: int
    status: str
    """Docker's container status: ``running``, ``exited``, ..."""
    health: str | None
    """``healthy``, ``starting``, ``unhealthy``, or None when the image has no health check."""
    ports: Mapping[str, Sequence[Mapping[str, str]] | None]
    """Docker's ``NetworkSettings.Ports``: ``{"50051/tcp": [{"HostIp": "127.0.0.1", "HostPort": "32768"}]}``."""


def parse_target(target: str) -> tuple[str | None, str, int | None]:
    """``[PROJECT/]SERVICE[:PORT]`` -> (project or None, service, container port or None)."""
    address = f"compose:{target}"
    rest, sep, port_text = target.rpartition(":")
    port: int | None = None
    if sep:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise AddressError(f"address {address!r}: expected compose:[PROJECT/]SERVICE[:PORT], port {port_text!r}")
        port, target = int(port_text), rest
    project, slash, service = target.rpartition("/")
    if not service or (slash and not project) or "/" in project:
        raise AddressError(
            f"address {address!r}: expected compose:SERVICE or compose:PROJECT/SERVICE (e.g. compose:env)"
        )
    return (project or None), service, port


def choose_host_port(replica: Replica, container_port: int | None, engine_host: str | None = None) -> str:
    """``host:port`` at which this host reaches ``replica``'s published (container) port.

    ``engine_host``: the host of a Docker engine on another host (see :func:`learner.engine.engine_host`),
    or None for this host's engine, whose published ports are reached on loopback. A remote engine's
    ports are reached at its host: a wildcard binding at ``engine_host``, one on a given address
    there; one on its loopback only cannot be reached (AddressError).
    """
    published = {key: bindings for key, bindings in replica.ports.items() if key.endswith("/tcp") and bindings}
    if container_port is None:
        if len(published) != 1:
            found = ", ".join(sorted(published)) or "none"
            raise AddressError(
                f"compose replica {replica.name}: expected exactly one published TCP port, found {found}; "
                "name the container port (compose:SERVICE:PORT), or publish it (ports: ['127.0.0.1::50051'])"
            )
        key, bindings = next(iter(published.items()))
    else:
        key = f"{container_port}/tcp"
        if key not in published:
            found = ", ".join(sorted(published)) or "none"
            raise AddressError(
                f"compose replica {replica.name}: container port {container_port} is not published (published: {found})"
            )
        bindings = published[key]
    assert bindings is not None
    candidates = []
    for binding in bindings:
        host_ip = binding.get("HostIp", "")
        if engine_host is None:
            host = _LOOPBACK.get(host_ip, host_ip)
            rank = (0 if host == "127.0.0.1" else 1 if host == "::1" else 2, host)
        elif host_ip in _WILDCARDS:
            host, rank = engine_host, (0, engine_host)  # (the address this host reaches the engine at)
        elif _is_loopback(host_ip):
            continue  # the engine host's own loopback: not this host's
        else:
            host, rank = host_ip, (1, host_ip)
        candidates.append((rank, host, binding["HostPort"]))
    if not candidates:
        on = ", ".join(host_port(b.get("HostIp", ""), b["HostPort"]) for b in bindings)
        raise AddressError(
            f"compose replica {replica.name}: its port {key} is published on the Docker host's loopback only ({on}), "
            f"which cannot be reached from here: the Docker engine (DOCKER_HOST) is on {engine_host}. Publish it on "
            "an address other hosts reach (envfleet's docker-compose.yml: `docker compose down`, then `up` with "
            "ENVFLEET_BIND=0.0.0.0 and a token, ENVFLEET_AUTH_TOKEN, as other hosts can reach it then; another "
            "compose file: ports: ['0.0.0.0::50051']), or run the learner on the Docker host"
        )
    _, host, port = min(candidates)
    return host_port(host, port)


def _is_loopback(host_ip: str) -> bool:
    try:
        return ipaddress.ip_address(host_ip).is_loopback
    except ValueError:
        return False


def replica_addresses(replicas: Iterable[Replica], target: str, engine_host: str | None = None) -> list[str]:
    """The addresses of the running, healthy replicas, in (project, replica number) order
    (``engine_host``: see :func:`choose_host_port`).

    Raises:
        AddressError: none is ready, or the service runs in several projects and none was named.
    """
    project, service, container_port = parse_target(target)
    address = f"compose:{target}"
    replicas = sorted(replicas, key=lambda r: (r.project, r.number))
    if project is None:
        # Projects with a running replica count (another project's stopped containers do not).
        running = sorted({r.project for r in replicas if r.status == "running"})
        if len(running) > 1:
            names = ", ".join(f"compose:{p}/{service}" for p in running)
            raise AddressError(
                f"address {address!r}: service {service!r} runs in several compose projects; use one of {names}"
            )
        if running:
            replicas = [r for r in replicas if r.project == running[0]]
    ready, waiting = [], []
    for replica in replicas:
        if replica.status == "running" and replica.health in (None, "healthy"):
            ready.append(replica)
        else:
            waiting.append(f"{replica.name} ({replica.health if replica.status == 'running' else replica.status})")
    note_not_used(log, address, "replica", waiting)
    if not ready:
        where = f" of project {project!r}" if project else ""
        why = f"; not ready: {', '.join(waiting)}" if waiting else ""
        starting = [r for r in replicas if r.status == "created" or (r.status == "running" and r.health == "starting")]
        # (a crash loop, or a server up but failing its health check)
        failing = any(r.status == "restarting" or r.health == "unhealthy" for r in replicas)
        hint = (
            f"`docker compose logs {service}` says why they fail"
            if failing
            else f"start them with `docker compose up -d --wait --scale {service}=N`"
        )
        error = NotReadyYet if starting else AddressError
        raise error(
            f"address {address!r}: no running, healthy replica of compose service {service!r}{where}{why} ({hint})"
        )
    return [choose_host_port(replica, container_port, engine_host) for replica in ready]


def _replica_labels(service: str) -> list[str]:
    """The label filter of the service's containers: replicas, and `docker compose run`'s one-off containers,
    which :func:`_is_one_off` leaves out (as a filter on the label's "False" would not: podman-compose sets
    none, so its replicas were not found)."""
    return [f"{SERVICE_LABEL}={service}"]


def _is_one_off(record: Mapping[str, Any]) -> bool:
    """Whether a container list record is a one-off container (`docker compose run`), which publishes no port
    (the network's DNS leaves them out of the service's name too): no replica."""
    return (record.get("Labels") or {}).get(ONEOFF_LABEL) == "True"


def resolve_compose(target: str) -> list[str]:
    """``compose:`` resolver: ask the Docker engine for the service's containers (see the module doc)."""
    project, service, _ = parse_target(target)
    labels = _replica_labels(service) + ([f"{PROJECT_LABEL}={project}"] if project else [])
    # One call for all replicas (the learner looks them up again between rollouts).
    containers, host = ask_engine(
        f"compose:{target}",
        "list containers",
        lambda client: (
            client.api.containers(all=True, filters={"label": labels}),
            engine_host(client, f"compose:{target}"),
        ),
    )
    containers = [c for c in containers if not _is_one_off(c)]
    if not containers:  # a service (or project) of that name has no container at all: say what there is
        others = ask_engine(
            f"compose:{target}",
            "list containers",
            lambda client: client.api.containers(all=True, filters={"label": [PROJECT_LABEL]}),
        )
        labels_of = [(c.get("Labels") or {}, _is_one_off(c)) for c in others]
        services = sorted(
            {f"{lb.get(PROJECT_LABEL, '')}/{lb.get(SERVICE_LABEL, '')}" for lb, one_off in labels_of if not one_off}
        )
        one_offs = [
            lb
            for lb, one_off in labels_of
            if one_off and lb.get(SERVICE_LABEL) == service and project in (None, lb.get(PROJECT_LABEL))
        ]
        where = f" in project {project!r}" if project else ""
        one_off = " (only `docker compose run` containers of it, which are no replicas)" if one_offs else ""
        raise AddressError(
            f"address 'compose:{target}': no container of a compose service {service!r}{where}{one_off}; compose "
            f"services with containers here (project/service): {', '.join(services) or 'none'}"
        )
    replicas = [replica_from_record(c) for c in containers]
    if any(r.status == "running" and r.health is None for r in replicas):
        replicas = _with_filtered_health(target, labels, replicas)
    return replica_addresses(replicas, target, host)


def _with_filtered_health(target: str, labels: list[str], replicas: list[Replica]) -> list[Replica]:
    """The replicas, with the health of those running with none in their status text found by the engine's
    ``health`` filter: Podman's container list says "Up 5 seconds" where Docker's says "Up 5 seconds (healthy)",
    so every replica counted as ready there. (One more call when none is starting or unhealthy, Docker's
    replicas without a health check included; two when some are.)"""

    def names(health: list[str]) -> set[str]:
        records = ask_engine(
            f"compose:{target}",
            "list containers",
            lambda client: client.api.containers(all=True, filters={"label": labels, "health": health}),
        )
        return {_record_name(record) for record in records}

    not_ready = names(["starting", "unhealthy"])
    unhealthy = names(["unhealthy"]) if not_ready else set()
    return [
        replace(r, health="unhealthy" if r.name in unhealthy else "starting")
        if r.status == "running" and r.health is None and r.name in not_ready
        else r
        for r in replicas
    ]


def _record_name(record: Mapping[str, Any]) -> str:
    """A container's name, as a record of Docker's container list gives it (its short id where it has none)."""
    names = record.get("Names") or [record.get("Id", "?")[:12]]
    return str(names[0]).lstrip("/")


def replica_from_record(record: Mapping[str, Any]) -> Replica:
    """A ``Replica`` from a record of Docker's container list (``GET /containers/json``)."""
    labels = record.get("Labels") or {}
    ports: dict[str, list[dict[str, str]] | None] = {}
    for port in record.get("Ports") or []:
        key = f"{port['PrivatePort']}/{port.get('Type', 'tcp')}"
        bindings = ports.setdefault(key, None)
        if port.get("PublicPort"):
            ports[key] = [*(bindings or []), {"HostIp": port.get("IP", ""), "HostPort": str(port["PublicPort"])}]
    status = str(record.get("Status", ""))  # "Up 12 seconds (healthy)", "Up 2 seconds (health: starting)", ...
    health = next((h for h, text in _HEALTH_TEXT.items() if text in status), None)
    return Replica(
        name=_record_name(record),
        project=labels.get(PROJECT_LABEL, ""),
        number=int(labels.get(NUMBER_LABEL, "0")),
        status=str(record.get("State", "")),
        health=health,
        ports=ports,
    )


_HEALTH_TEXT = {"healthy": "(healthy)", "starting": "(health: starting)", "unhealthy": "(unhealthy)"}


def pin_compose(target: str) -> str:
    """``[PROJECT/]SERVICE[:PORT]`` with the project filled in: the one project that runs the service
    now (a running replica); as given when it names one, or none or several run it (then resolving
    says so), or the engine cannot be asked."""
    project, service, port = parse_target(target)
    if project is not None:
        return target
    try:
        containers = ask_engine(
            f"compose:{target}",
            "list containers",
            lambda client: client.api.containers(filters={"label": _replica_labels(service), "status": "running"}),
        )
    except AddressError:
        return target
    projects = {(c.get("Labels") or {}).get(PROJECT_LABEL) for c in containers if not _is_one_off(c)}
    if len(projects) != 1 or None in projects:
        return target
    return f"{projects.pop()}/{service}" + (f":{port}" if port is not None else "")


register_resolver("compose", resolve_compose, pin_compose)
