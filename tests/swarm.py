"""Driving the repo's docker-compose.yml as a Swarm stack from tests: this engine as a single-node swarm."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tests.compose import REPO, STACK_LABEL, ComposeProject, labelled, remove_labelled


def docker(*args: str, timeout: float = 120, check: bool = True, env: dict[str, str] | None = None) -> str:
    """``docker ARGS``: its stdout; a failure raises with docker's output."""
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if check and result.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)} exited {result.returncode}: {result.stderr[-2000:]}")
    return result.stdout


@contextmanager
def single_node_swarm() -> Iterator[None]:
    """This engine as a swarm manager: the swarm it is already in, or one initialised here and left afterwards.

    A swarm made here advertises and listens on loopback only, and leaves nothing behind (not even the
    docker_gwbridge network that joining creates).
    """
    state, manager = docker("info", "--format", "{{.Swarm.LocalNodeState}} {{.Swarm.ControlAvailable}}").split()
    if state == "active":
        if manager != "true":
            raise RuntimeError("this Docker engine is a swarm worker; the swarm tests need a manager (or no swarm)")
        yield
        return
    if state != "inactive":
        raise RuntimeError(f"this Docker engine's swarm state is {state!r}; expected active or inactive")
    had_gwbridge = bool(docker("network", "ls", "-q", "--filter", "name=^docker_gwbridge$").strip())
    try:  # (an init that was interrupted is left too)
        docker("swarm", "init", "--advertise-addr", "127.0.0.1", "--listen-addr", "127.0.0.1:2377", timeout=60)
        yield
    finally:
        docker("swarm", "leave", "--force", timeout=120, check=False)
        if not had_gwbridge:
            docker("network", "rm", "docker_gwbridge", check=False)


class Stack:
    """``docker stack deploy -c docker-compose.yml NAME`` with the images (and name) of a compose project."""

    def __init__(self, project: ComposeProject) -> None:
        self.name = project.name
        self.env = project.env

    def service(self, name: str) -> str:
        """A stack's service as Swarm names it: ``NAME_env``."""
        return f"{self.name}_{name}"

    def deploy(self, replicas: int) -> None:
        # The images exist only here: never ask a registry for their digests.
        env = {**self.env, "ENVFLEET_REPLICAS": str(replicas)}
        docker(
            "stack",
            "deploy",
            "--resolve-image",
            "never",
            "--detach=true",
            "-c",
            "docker-compose.yml",
            self.name,
            env=env,
        )

    def scale(self, service: str, replicas: int) -> None:
        docker("service", "scale", "--detach", f"{self.service(service)}={replicas}")

    def tasks(self, service: str) -> list[dict[str, Any]]:
        """The service's tasks that Swarm wants running (records of ``GET /tasks``), in slot order."""
        import docker as sdk

        client = sdk.from_env()
        try:
            tasks = client.api.tasks(filters={"service": self.service(service), "desired-state": "running"})
        finally:
            client.close()
        return sorted(tasks, key=lambda t: t.get("Slot") or 0)

    def running(self, service: str) -> list[dict[str, Any]]:
        return [t for t in self.tasks(service) if t["Status"]["State"] == "running"]

    def wait_running(self, service: str, replicas: int, timeout: float = 120) -> list[dict[str, Any]]:
        """Wait until exactly ``replicas`` tasks of the service run (healthy) and no other is wanted."""
        wait_for(
            lambda: len(self.tasks(service)) == len(self.running(service)) == replicas,
            f"{replicas} running task(s) of {self.service(service)}",
            timeout,
            lambda: docker("service", "ps", "--no-trunc", self.service(service), check=False),
        )
        return self.running(service)

    def describe(self, service: str) -> str:
        """What a failing test should show of the service: its tasks as Swarm has them, the addresses the
        learner's ``swarm:`` resolver gives now, and whether each takes a TCP connection."""
        from learner import expand_addresses

        lines = [docker("service", "ps", "--no-trunc", self.service(service), check=False)]
        try:
            addresses = expand_addresses(f"swarm:{self.service(service)}")
        except Exception as err:  # (a look-up that fails is what to show)
            return "\n".join([*lines, f"swarm: look-up failed: {err!r}"])
        for address in addresses:
            host, _, port = address.rpartition(":")
            try:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                    lines.append(f"{address}: takes connections")
            except OSError as err:
                lines.append(f"{address}: {err!r}")
        return "\n".join(lines)

    def remove(self) -> None:
        """``docker stack rm``, wait until its containers and network are gone, then remove its volumes
        (``stack rm`` never does: the learner's ``runs`` volume, made on the node where its task ran)."""
        docker("stack", "rm", self.name, check=False)
        label = f"label={STACK_LABEL}={self.name}"
        try:
            wait_for(
                lambda: (
                    not docker("ps", "-aq", "--filter", label).strip()
                    and not docker("network", "ls", "-q", "--filter", label).strip()
                ),
                f"stack {self.name} gone",
                120,
            )
        finally:
            remove_labelled(f"{STACK_LABEL}={self.name}")

    def leftovers(self) -> list[str]:
        """The stack's containers, volumes and networks still on this engine."""
        return labelled(f"{STACK_LABEL}={self.name}")


def wait_for(condition: Callable[[], bool], what: str, timeout: float, why: Callable[[], str] | None = None) -> None:
    """Poll ``condition`` every 0.5 s; after ``timeout`` s fail, saying ``what`` and what ``why`` tells."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout:g} s\n{why() if why else ''}")
        time.sleep(0.5)
