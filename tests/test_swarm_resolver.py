"""swarm: addresses: parsing, each task's host-mode port and node, which tasks count, refusing the routing mesh.

These run without Docker on the records a swarm manager returns; tests/test_swarm.py resolves real tasks.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from learner import AddressError, expand_addresses
from learner.swarm import Task, node_address, parse_target, task_addresses, task_from_record

HERE, THERE = "node-here", "node-there"


def task(
    slot: int, *, node: str = HERE, state: str = "running", ports: tuple[tuple[int, int], ...] | None = None
) -> Task:
    return Task(f"t{slot}", slot, node, state, ((50051, 30000 + slot),) if ports is None else ports)


def addresses(tasks: list[Task], target: str = "envfleet_env", **kwargs: Any) -> list[str]:
    kwargs.setdefault("nodes", {THERE: "192.0.2.7"})
    return task_addresses(tasks, target, local_node=HERE, **kwargs)


@pytest.mark.parametrize(
    ("target", "parsed"),
    [
        ("envfleet_env", ("envfleet_env", None)),
        ("env:6000", ("env", 6000)),
        ("my-stack_env-2:50051", ("my-stack_env-2", 50051)),
    ],
)
def test_parse_target(target: str, parsed: tuple[str, int | None]) -> None:
    assert parse_target(target) == parsed


@pytest.mark.parametrize(
    ("target", "fragment"), [("", "swarm:SERVICE"), ("envfleet/env", "swarm:envfleet_env"), ("env:x", "'x'")]
)
def test_bad_targets_name_the_address(target: str, fragment: str) -> None:
    with pytest.raises(AddressError, match=f"swarm:{target}") as info:
        parse_target(target)
    assert fragment in str(info.value)


def test_tasks_here_on_loopback_tasks_elsewhere_at_their_node_in_slot_order() -> None:
    tasks = [task(3), task(1, node=THERE), task(2, state="starting"), task(4, state="pending"), task(10)]
    assert addresses(tasks) == ["192.0.2.7:30001", "127.0.0.1:30003", "127.0.0.1:30010"]
    v6 = task(5, node="node-v6")
    assert addresses([v6], nodes={"node-v6": "2001:db8::5"}) == ["[2001:db8::5]:30005"]
    with pytest.raises(AddressError, match="runs on node node-lost, which reports no address"):
        addresses([task(6, node="node-lost")], nodes={"node-lost": None})


def test_no_running_task_says_why_and_what_to_run() -> None:
    with pytest.raises(AddressError) as info:
        addresses([task(1, state="starting"), task(2, state="pending")])
    message = str(info.value)
    assert "no running task of swarm service 'envfleet_env'" in message
    assert "envfleet_env.1 (starting), envfleet_env.2 (pending)" in message
    assert "docker service scale envfleet_env=N" in message
    with pytest.raises(AddressError, match="no running task"):
        addresses([])


def test_the_routing_mesh_is_refused_with_what_to_do_instead() -> None:
    """An ingress-published service: one port for all tasks, so no task can be reached on its own."""
    with pytest.raises(AddressError) as info:
        addresses([task(1, ports=())], ingress_ports=[50051])
    message = str(info.value)
    assert "ingress routing mesh" in message and "mode: host" in message and "dns:///tasks." in message
    with pytest.raises(AddressError, match="publishes no port"):
        addresses([task(1, ports=())])


def test_container_port_is_needed_only_when_several_are_published() -> None:
    two = ((50051, 31000), (9100, 31001))
    with pytest.raises(AddressError, match=r"publishes several ports \(9100, 50051\); name the container port"):
        addresses([task(1, ports=two)])
    assert addresses([task(1, ports=two)], "envfleet_env:9100") == ["127.0.0.1:31001"]
    with pytest.raises(AddressError, match="does not publish container port 6000"):
        addresses([task(1, ports=two)], "envfleet_env:6000")


def test_task_from_a_docker_task_list_record() -> None:
    """As a 20.10 engine answers: host-mode ports listed once per address family."""
    port = {"Protocol": "tcp", "TargetPort": 50051, "PublishedPort": 32769, "PublishMode": "host"}
    record = {
        "ID": "z0rnzwxh1r3g",
        "Slot": 1,
        "NodeID": "yjipew5g9qsf",
        "DesiredState": "running",
        "Status": {"State": "running", "Message": "started", "PortStatus": {"Ports": [port, dict(port)]}},
    }
    assert task_from_record(record) == Task("z0rnzwxh1r3g", 1, "yjipew5g9qsf", "running", ((50051, 32769),))
    starting = {**record, "Status": {"State": "starting", "PortStatus": {}}}
    assert task_from_record(starting).ports == () and task_from_record(starting).state == "starting"
    ingress = {**record, "Status": {"State": "running", "PortStatus": {"Ports": [{**port, "PublishMode": "ingress"}]}}}
    assert task_from_record(ingress).ports == ()
    global_task = {k: v for k, v in record.items() if k != "Slot"}
    assert task_from_record(global_task).slot == 0


def test_node_address_falls_back_to_the_manager_address() -> None:
    assert node_address({"Status": {"Addr": "192.0.2.7"}}) == "192.0.2.7"
    assert node_address({"Status": {"Addr": "0.0.0.0"}, "ManagerStatus": {"Addr": "192.0.2.8:2377"}}) == "192.0.2.8"
    assert node_address({"Status": {}, "ManagerStatus": {"Addr": "[2001:db8::1]:2377"}}) == "2001:db8::1"
    assert node_address({"Status": {"Addr": "0.0.0.0"}}) is None


def test_swarm_scheme_is_registered() -> None:
    """expand_addresses hands swarm: to the resolver, whose failure names the address."""
    with pytest.raises(AddressError, match="swarm:no-such-service-zz9"):
        expand_addresses("swarm:no-such-service-zz9")


def test_tasks_not_used_yet_are_said_once_per_set(caplog: pytest.LogCaptureFixture) -> None:
    """The fleet is looked up several times a second while it starts, and between rollouts: was one
    INFO line per look-up ("not using 1 task(s) yet: ...", 13 in 4 s while one task started)."""
    caplog.set_level(logging.DEBUG, logger="learner.swarm")
    starting = [task(1), task(2), task(3, state="starting")]
    for tasks in [starting] * 5 + [[task(1), task(2), task(3, state="pending")]] * 3 + [[task(1), task(2), task(3)]]:
        addresses(tasks, "said_once_env")
    for tasks in [starting] * 2:
        addresses(tasks, "said_once_env")
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno >= logging.INFO]
    assert said == [
        ("INFO", "swarm:said_once_env: not using 1 task(s) yet: said_once_env.3 (starting)"),
        ("INFO", "swarm:said_once_env: not using 1 task(s) yet: said_once_env.3 (pending)"),
        ("INFO", "swarm:said_once_env: not using 1 task(s) yet: said_once_env.3 (starting)"),  # (again, later)
    ]


def test_a_task_not_used_for_a_minute_is_warned_of_once_a_minute(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The INFO lines above are not shown at learner train's default log level: a task whose health check never
    passed stayed out of the fleet unsaid. Now a warning names it once it has not been used for NOT_USED_WARN_S
    (60 s; a clock of the test's here), by name whatever its state did meanwhile, then at most once per that long."""
    from learner import discovery

    clock = [1000.0]
    monkeypatch.setattr(discovery.time, "monotonic", lambda: clock[0])

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    for state, at in [("starting", 0), ("pending", 20), ("starting", 65), ("starting", 100), ("starting", 130)]:
        clock[0] = 1000.0 + at
        addresses([task(1), task(2, state=state), task(3, state="shutdown")], "warned_env")
    why = "their envs join once they are ready (`docker service ps --no-trunc SERVICE` says why not)"
    assert warnings() == [
        f"swarm:warned_env: 1 task(s) not used for 65 s: warned_env.2 (starting); {why}",
        f"swarm:warned_env: 1 task(s) not used for 130 s: warned_env.2 (starting); {why}",  # (not at 100 s)
    ]
    clock[0] += 100
    addresses([task(1), task(2)], "warned_env")  # (in use: its wait ends)
    clock[0] += 100
    addresses([task(1), task(2, state="starting")], "warned_env")  # (a new wait: not warned at once)
    assert len(warnings()) == 2


def test_a_remote_engine_s_tasks_on_its_own_node_are_reached_at_its_host() -> None:
    """With DOCKER_HOST naming another host's manager, a task on that node is at that host, not on our loopback."""
    tasks = [task(1), task(2, node=THERE)]
    assert addresses(tasks, engine_host="198.18.1.1") == ["198.18.1.1:30001", "192.0.2.7:30002"]
    assert addresses(tasks, engine_host="manager-1") == ["manager-1:30001", "192.0.2.7:30002"]
    assert addresses([task(3)], engine_host="2001:db8::7") == ["[2001:db8::7]:30003"]
    assert addresses(tasks, engine_host=None) == ["127.0.0.1:30001", "192.0.2.7:30002"]  # this host's engine


def test_resolving_through_a_remote_manager_reaches_its_tasks_at_its_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve_swarm asks the manager where it is (its client's base URL) along with its tasks."""
    from learner import swarm

    port = {"Protocol": "tcp", "TargetPort": 50051, "PublishedPort": 32769, "PublishMode": "host"}
    record = {"ID": "t1", "Slot": 1, "NodeID": HERE, "Status": {"State": "running", "PortStatus": {"Ports": [port]}}}
    service = {"ID": "s1", "Spec": {"Name": "envfleet_env"}, "Endpoint": {"Ports": [dict(port)]}}
    for base_url, expected in [
        ("http://198.18.1.1:2375", "198.18.1.1:32769"),
        ("http+docker://localhost", "127.0.0.1:32769"),
    ]:
        api = SimpleNamespace(
            base_url=base_url,
            services=lambda **filters: [service],
            tasks=lambda **filters: [record],
            nodes=lambda **filters: [],
        )
        engine = SimpleNamespace(api=api, info=lambda: {"Swarm": {"NodeID": HERE}})
        monkeypatch.setattr(swarm, "ask_engine", lambda address, what, query, engine=engine: query(engine))
        assert swarm.resolve_swarm("envfleet_env") == [expected]
