"""``swarm:`` addresses: every running task of a Docker Swarm service, at the port it publishes on its node.

    swarm:envfleet_env           service ``envfleet_env`` (``docker stack deploy ... envfleet``, service ``env``)
    swarm:envfleet_env:50051     ... the tasks' container port 50051 (needed only if they publish several)

The tasks are looked up through the Docker SDK on a swarm manager (the engine this host talks to).
Swarm reports a task whose image has a health check as ``starting`` until it is healthy, so only
``running`` tasks count and a task still building its envs joins at the next look-up. Resolving again
(the learner does so between rollouts) finds tasks added or removed by ``docker service scale``, and
the replacement of a task that died.

Each task must publish its port in *host* mode (``ports: [{target: 50051, mode: host}]``, as the
repo's docker-compose.yml does): then every task has a port of its own on its node, and the learner
holds one connection per task. Swarm's default, the ingress routing mesh, balances one published
port over all tasks, so the learner could neither tell them apart nor reach each one; such a service
is refused with an error saying so. A task on the engine's own node is reached on loopback (at the
engine's host when ``DOCKER_HOST`` names another host's engine), a task on another node at that
node's address. From inside the stack's network use ``dns:///tasks.env:50051`` instead.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from learner.discovery import AddressError, note_not_used, register_resolver
from learner.engine import ask_engine, engine_host

__all__ = ["Task", "node_address", "parse_target", "resolve_swarm", "task_addresses", "task_from_record"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Task:
    """What the resolver needs to know about one task of a swarm service."""

    id: str
    slot: int
    """The replica's number (1, 2, ...; a task that replaces a dead one gets its slot); 0 in global services."""
    node_id: str
    state: str
    """Swarm's task state: ``running``, ``starting`` (health check not passed yet), ``pending``, ..."""
    ports: tuple[tuple[int, int], ...]
    """(container port, published port) of each TCP port the task publishes in host mode."""


def parse_target(target: str) -> tuple[str, int | None]:
    """``SERVICE[:PORT]`` -> (service name, container port or None)."""
    service, sep, port_text = target.rpartition(":")
    if not sep:
        service, port_text = target, ""
    elif not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise AddressError(f"address 'swarm:{target}': expected swarm:SERVICE[:PORT], port {port_text!r}")
    if not service or "/" in service:
        raise AddressError(
            f"address 'swarm:{target}': expected swarm:SERVICE, the service's name as `docker service ls` shows it "
            "(e.g. swarm:envfleet_env for service env of stack envfleet)"
        )
    return service, int(port_text) if port_text else None


def task_from_record(record: Mapping[str, Any]) -> Task:
    """A ``Task`` from a record of Docker's task list (``GET /tasks``)."""
    status = record.get("Status") or {}
    ports = ((status.get("PortStatus") or {}).get("Ports")) or []
    published = sorted(
        {
            (int(p["TargetPort"]), int(p["PublishedPort"]))
            for p in ports
            if p.get("PublishMode") == "host" and p.get("Protocol", "tcp") == "tcp" and p.get("PublishedPort")
        }
    )  # one entry per address family, hence the set
    return Task(
        id=str(record.get("ID", "?")),
        slot=int(record.get("Slot") or 0),
        node_id=str(record.get("NodeID") or ""),
        state=str(status.get("State", "")),
        ports=tuple(published),
    )


def node_address(record: Mapping[str, Any]) -> str | None:
    """The address other hosts reach a node at (``GET /nodes`` record), or None if it reports none."""
    addr = str((record.get("Status") or {}).get("Addr") or "")
    if addr in ("", "0.0.0.0"):  # a manager may report this; its ManagerStatus has the address
        addr = str((record.get("ManagerStatus") or {}).get("Addr") or "").rpartition(":")[0]
    return addr.strip("[]") or None


def task_addresses(
    tasks: Iterable[Task],
    target: str,
    *,
    nodes: Mapping[str, str | None],
    local_node: str | None,
    ingress_ports: Collection[int] = (),
    engine_host: str | None = None,
) -> list[str]:
    """The ``host:port`` of each running task, in slot order.

    Args:
        tasks: the service's tasks whose desired state is running.
        target: ``SERVICE[:PORT]``, as in the address.
        nodes: node id -> its address, for tasks on other nodes.
        local_node: this engine's node id: its tasks are reached on loopback, or at ``engine_host``.
        ingress_ports: container ports the service publishes through the routing mesh (for the error).
        engine_host: the host of an engine on another host (see :func:`learner.engine.engine_host`);
            None for this host's engine.

    Raises:
        AddressError: no task is running, or a running task publishes no port in host mode.
    """
    service, container_port = parse_target(target)
    address = f"swarm:{target}"
    ready: list[Task] = []
    waiting: list[Task] = []
    for task in sorted(tasks, key=lambda t: (t.slot, t.node_id, t.id)):
        (ready if task.state == "running" else waiting).append(task)
    note_not_used(log, address, "task", [f"{service}.{t.slot or t.node_id} ({t.state})" for t in waiting])
    if not ready:
        why = (
            f"; not ready: {', '.join(f'{service}.{t.slot or t.node_id} ({t.state})' for t in waiting)}"
            if waiting
            else ""
        )
        raise AddressError(
            f"address {address!r}: no running task of swarm service {service!r}{why} "
            f"(start some with `docker service scale {service}=N`)"
        )
    return [
        _task_address(task, service, address, container_port, nodes, local_node, ingress_ports, engine_host)
        for task in ready
    ]


def _task_address(
    task: Task,
    service: str,
    address: str,
    container_port: int | None,
    nodes: Mapping[str, str | None],
    local_node: str | None,
    ingress_ports: Collection[int],
    engine_host: str | None,
) -> str:
    name = f"{service}.{task.slot or task.node_id}"
    targets = sorted({target for target, _ in task.ports})
    if container_port is None and len(targets) != 1:
        if not targets:
            raise AddressError(_not_host_mode(address, name, service, ingress_ports))
        raise AddressError(
            f"address {address!r}: task {name} publishes several ports ({', '.join(map(str, targets))}); "
            f"name the container port: swarm:{service}:PORT"
        )
    wanted = targets[0] if container_port is None else container_port
    published = [port for target, port in task.ports if target == wanted]
    if not published:
        if wanted in ingress_ports or not targets:
            raise AddressError(_not_host_mode(address, name, service, ingress_ports))
        raise AddressError(
            f"address {address!r}: task {name} does not publish container port {wanted} "
            f"(it publishes {', '.join(map(str, targets))})"
        )
    if task.node_id == local_node:
        # Host-mode ports listen on every interface of the node: loopback when that is this host; an
        # engine on another host (DOCKER_HOST) at the host we reach it at, not our own loopback.
        node = engine_host or "127.0.0.1"
    else:
        node = nodes.get(task.node_id) or ""
        if not node:
            raise AddressError(
                f"address {address!r}: task {name} runs on node {task.node_id}, which reports no address"
            )
    host = f"[{node}]" if ":" in node else node
    return f"{host}:{published[0]}"


def _not_host_mode(address: str, name: str, service: str, ingress_ports: Collection[int]) -> str:
    how = (
        f"it publishes {', '.join(map(str, sorted(ingress_ports)))} through the ingress routing mesh, which "
        "balances one port over all tasks"
        if ingress_ports
        else "it publishes no port"
    )
    return (
        f"address {address!r}: task {name} cannot be reached on a port of its own: {how}. Publish the port in "
        "host mode (ports: [{target: 50051, mode: host}], as envfleet's docker-compose.yml does), or run the "
        f"learner inside the stack's network with dns:///tasks.<service>:50051 (service {service})"
    )


def resolve_swarm(target: str) -> list[str]:
    """``swarm:`` resolver: ask the swarm manager for the service's tasks (see the module doc)."""
    service, _ = parse_target(target)
    address = f"swarm:{target}"

    def query(client: Any) -> list[str]:
        # The name filter matches prefixes: keep the service of exactly this name.
        services = [s for s in client.api.services(filters={"name": service}) if s["Spec"]["Name"] == service]
        if not services:
            names = sorted(s["Spec"]["Name"] for s in client.api.services())
            raise AddressError(
                f"address {address!r}: no swarm service named {service!r} (services: {', '.join(names) or 'none'}; "
                "a stack's services are named STACK_SERVICE)"
            )
        spec = services[0]
        ingress = {
            int(p["TargetPort"])
            for p in ((spec.get("Endpoint") or {}).get("Ports") or [])
            if p.get("PublishMode", "ingress") == "ingress"
        }
        records = client.api.tasks(filters={"service": spec["ID"], "desired-state": "running"})
        tasks = [task_from_record(r) for r in records]
        local_node = (client.info().get("Swarm") or {}).get("NodeID")
        nodes: dict[str, str | None] = {}
        if any(t.node_id != local_node for t in tasks):
            nodes = {str(n["ID"]): node_address(n) for n in client.api.nodes()}
        return task_addresses(
            tasks,
            target,
            nodes=nodes,
            local_node=local_node,
            ingress_ports=ingress,
            engine_host=engine_host(client, address),
        )

    return ask_engine(address, "look up the service's tasks (swarm: needs a swarm manager's engine)", query)


register_resolver("swarm", resolve_swarm)
