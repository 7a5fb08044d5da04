"""The compose file as a Docker Swarm stack, for real, on a single-node swarm: deploy, find the tasks,
train while `docker service scale` grows and shrinks the fleet and a task is removed, `stack rm`.

Needs a Docker engine (`.ci/run` runs ../shared/docker-setup.sh first) that is a swarm manager or in no
swarm (the tests then make it a single-node swarm on loopback, and leave it afterwards). Without one
these tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from learner import RemoteVectorEnv, expand_addresses
from tests.compose import REPO, ComposeProject, docker_problem, remove_stale_test_projects
from tests.prerequisites import require
from tests.swarm import Stack, docker, single_node_swarm, wait_for
from tests.training import BackgroundTraining

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1200)]

REPLICAS = 3
ENVS_PER_REPLICA = 4  # the compose file's default
TRAIN = ["--num-steps", "32", "--no-plot", "--no-progress", "--checkpoint-every", "0", "--no-tensorboard"]


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    """The images built, and `docker stack deploy` of the compose file with 3 env tasks, on a swarm."""
    require(docker_problem(), "Docker is not usable")
    remove_stale_test_projects()  # what killed runs of these tests left (hours old, ours only)
    project = ComposeProject(prefix="envfleet-swarm")
    stack = Stack(project)
    try:
        project.build("env", "learner")
        with single_node_swarm():
            try:
                stack.deploy(REPLICAS)
                stack.wait_running("env", REPLICAS)
                yield stack
            finally:
                stack.remove()
    finally:
        project.down()  # the image tags


def test_stack_deploy_runs_the_compose_file(stack: Stack) -> None:
    """Replicas, restart policy, resources and DNS round robin from `deploy:`; host-mode ports, one per task."""
    spec = json.loads(docker("service", "inspect", stack.service("env")))[0]["Spec"]
    assert spec["Mode"]["Replicated"]["Replicas"] == REPLICAS
    assert spec["EndpointSpec"]["Mode"] == "dnsrr"
    assert [(p["TargetPort"], p["PublishMode"]) for p in spec["EndpointSpec"]["Ports"]] == [(50051, "host")]
    task_template = spec["TaskTemplate"]
    assert task_template["RestartPolicy"]["Condition"] == "any"
    assert task_template["Resources"]["Reservations"]["MemoryBytes"] == 96 * 2**20
    assert task_template["Resources"]["Limits"]["MemoryBytes"] == 2**30
    learner = json.loads(docker("service", "inspect", stack.service("learner")))[0]["Spec"]
    assert learner["Mode"]["Replicated"]["Replicas"] == 0  # it trains when scaled to 1
    assert learner["TaskTemplate"]["RestartPolicy"]["Condition"] == "none"  # (a restart would start over)


def test_swarm_addresses_reach_every_task_from_the_manager(stack: Stack) -> None:
    """`swarm:STACK_env`: each task's own published port (no routing mesh), found through the Docker SDK."""
    addresses = expand_addresses(f"swarm:{stack.service('env')}")
    ports = {t["Status"]["PortStatus"]["Ports"][0]["PublishedPort"] for t in stack.running("env")}
    assert sorted(addresses) == sorted(f"127.0.0.1:{port}" for port in ports) and len(ports) == REPLICAS
    with RemoteVectorEnv(f"swarm:{stack.service('env')}") as envs:
        assert envs.num_envs == REPLICAS * ENVS_PER_REPLICA
        envs.reset(seed=0)
        for t in range(20):  # left, right, left, ...: no pole falls this soon
            _, rewards, terminations, _, _ = envs.step(np.full(envs.num_envs, t % 2))
            assert np.all(rewards == 1.0) and not terminations.any()


def test_stack_network_resolves_every_task_for_containers_that_join_it(stack: Stack) -> None:
    """The stack's network is attachable: a container started by hand (a GPU learner, say) finds
    every task under tasks.env and, with dnsrr, under env, as the learner service does."""
    names = (
        "import socket; print(*[len({i[4][0] for i in socket.getaddrinfo(n, 50051)}) for n in ('tasks.env', 'env')])"
    )
    out = docker(
        "run",
        "--rm",
        "--network",
        f"{stack.name}_default",
        "--entrypoint",
        "python",
        stack.env["ENVFLEET_ENV_IMAGE"],
        "-c",
        names,
    )
    assert out.split() == [str(REPLICAS), str(REPLICAS)]


def test_the_learner_service_trains_inside_the_stack_network(stack: Stack) -> None:
    """`docker service scale STACK_learner=1`: a learner task finds the env tasks by DNS
    (dns:///tasks.env:50051), trains, and stays finished (never restarted)."""
    args = [
        "train",
        "--servers",
        "dns:///tasks.env:50051",
        "--total-timesteps",
        "1536",  # 4 updates of 3 x 4 envs x 32 steps
        *TRAIN,
        "--run-dir",
        "/tmp/run",
    ]
    docker("service", "update", "--detach", "--args", " ".join(args), "--replicas", "1", stack.service("learner"))

    def states() -> list[str]:
        all_tasks = docker("service", "ps", "--format", "{{.CurrentState}}", stack.service("learner"))
        return [line.split()[0] for line in all_tasks.splitlines() if line.strip()]

    wait_for(
        lambda: "Complete" in states(),
        "finished learner task",
        300,
        lambda: docker("service", "logs", stack.service("learner"), check=False),
    )
    logs = docker("service", "logs", "--raw", stack.service("learner"))
    assert f"{REPLICAS * ENVS_PER_REPLICA} envs" in logs and "1,536 env steps" in logs, logs
    assert states() == ["Complete"]  # not restarted after it finished


def test_training_follows_service_scale_and_a_removed_task(stack: Stack, tmp_path: Path) -> None:
    """`learner train --servers swarm:STACK_env` while the service is scaled 3 -> 5, one task's container
    is removed (Swarm replaces it), and it is scaled 5 -> 2: num_envs follows, training goes on."""
    run_dir = tmp_path / "run"
    service = stack.service("env")
    command = [sys.executable, "-m", "learner", "--log-level", "info", "train", "--servers", f"swarm:{service}"]
    command += [*TRAIN, "--total-timesteps", "100000000", "--run-dir", str(run_dir)]
    training = BackgroundTraining(command, run_dir, cwd=REPO)
    small, large, last = (n * ENVS_PER_REPLICA for n in (REPLICAS, 5, 2))

    def swarm() -> str:
        return stack.describe("env")

    try:
        training.wait(lambda sizes: small in sizes, f"an update with {small} envs", why=swarm)
        stack.scale("env", 5)
        # (Once, at 3971dd9 on a loaded machine, the fifth task never joined within 180 s, no log line saying why:
        # the failure shows the tasks and the addresses the resolver gives then.)
        training.wait(lambda sizes: large in sizes, f"an update with {large} envs", why=swarm)

        # Remove one task's container: Swarm starts a new task in its slot; the learner drops the lost
        # server, and the new one joins once healthy.
        victim = stack.running("env")[0]
        docker("rm", "--force", victim["Status"]["ContainerStatus"]["ContainerID"])
        wait_for(
            lambda: victim["ID"] not in {t["ID"] for t in stack.running("env")} and len(stack.running("env")) == 5,
            "replacement task running",
            120,
        )
        updates = len(training.sizes())
        training.wait(lambda sizes: len(sizes) > updates + 1 and sizes[-1] == large, f"{large} envs again", why=swarm)
        stack.scale("env", 2)
        training.wait(lambda sizes: sizes[-1] == last, f"an update with {last} envs", why=swarm)
    finally:
        out, err = training.interrupt()
    training.check_interrupted(out, err)
    sizes = training.sizes()
    assert sizes[0] == small and max(sizes) == large and sizes[-1] == last, sizes
    assert len(expand_addresses(f"swarm:{service}")) == 2


def test_stack_rm_removes_every_service_and_container(stack: Stack) -> None:
    """Last: `docker stack rm` (the fixture's teardown does it again, harmlessly), and the volume the
    learner task made (`stack rm` leaves volumes; Stack.remove removes them by the stack's label)."""
    assert f"volume {stack.name}_runs" in stack.leftovers()  # the learner service's task ran here
    stack.remove()
    assert not docker("service", "ls", "-q", "--filter", f"label=com.docker.stack.namespace={stack.name}").strip()
    assert stack.leftovers() == []
