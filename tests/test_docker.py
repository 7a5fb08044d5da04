"""The container workflow for real: build the images, `up --scale env=8`, use the replicas, stop them.

Needs a Docker engine with compose v2 (`.ci/run` runs ../shared/docker-setup.sh first). Without one
these tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from learner import AddressError, RemoteVectorEnv, expand_addresses, rundir
from tests.compose import (
    PROJECT_LABEL,
    REPO,
    ComposeProject,
    compose_environment,
    docker_problem,
    labelled,
    remove_stale_test_projects,
)
from tests.conftest import CTRL_C_EXIT

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1200)]

REPLICAS = 8
ENVS_PER_REPLICA = 4  # the compose file's default


@pytest.fixture(scope="module")
def docker_ready() -> None:
    problem = docker_problem()
    if problem is not None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true and Docker is not usable: {problem}", pytrace=False)
        pytest.skip(f"Docker is not usable: {problem}")


@pytest.fixture(scope="module")
def fleet(docker_ready: None) -> Iterator[ComposeProject]:
    """The images built, and 8 healthy CartPole replicas (4 envs each) of a project of its own."""
    remove_stale_test_projects()  # what killed runs of these tests left (hours old, ours only)
    project = ComposeProject()
    try:
        project.build("env", "learner")
        project.up(REPLICAS)
        yield project
    finally:
        project.down()


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=True)


def config(*args: str, **env: str) -> dict[str, Any]:
    """The compose file's merged configuration (with its override), with no ENVFLEET_* of the caller's
    shell, ``env`` set."""
    command = ["compose", "-f", "docker-compose.yml", "-f", "docker-compose.override.yml", *args]
    return json.loads(
        subprocess.run(
            ["docker", *command, "config", "--format", "json"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
            env=compose_environment(**env),
        ).stdout
    )


def test_compose_serves_envs_alone_and_keeps_the_learners_under_profiles() -> None:
    """With its override (read by `docker compose`, not by `docker stack deploy`): `up` alone starts only
    `env`; `learner` (profile learner) waits for healthy replicas; `learner-gpu` (profile gpu) asks for
    every GPU. The base file alone holds nothing Swarm refuses (tests/test_swarm.py deploys it)."""
    assert set(config()["services"]) == {"env"}
    services = config("--profile", "learner", "--profile", "gpu")["services"]
    assert set(services) == {"env", "learner", "learner-gpu"}
    for name in ("learner", "learner-gpu"):
        assert services[name]["depends_on"]["env"]["condition"] == "service_healthy"
        assert services[name]["deploy"]["replicas"] == 1
    assert services["learner"]["profiles"] == ["learner"] and services["learner-gpu"]["profiles"] == ["gpu"]
    for name in ("env", "learner", "learner-gpu"):  # (least privilege: tests below run them so)
        assert services[name]["read_only"] is True and services[name]["cap_drop"] == ["ALL"], name
        assert {"type": "tmpfs", "target": "/tmp"}.items() <= services[name]["volumes"][-1].items(), name
    devices = services["learner-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"] and not services["learner"]["deploy"].get("resources")
    assert services["learner-gpu"]["command"] == services["learner"]["command"]
    # The one-shot `--profile learner up` trains CartPole to solved, with a budget for 32+ envs (README).
    command = services["learner"]["command"]
    options = dict(zip(command[1::2], command[2::2], strict=False))
    assert options["--stop-at-return"] == "475" and int(options["--total-timesteps"]) >= 1_000_000, command
    # SIGTERM's grace: the learner finishes its update and checkpoints (not Docker's default 10 s), as the
    # image's user and group unless ENVFLEET_UID/GID say otherwise; a replica waits ENVFLEET_GRACE + 10 s.
    assert services["learner"]["stop_grace_period"] == "2m0s" and services["learner"]["user"] == "10001:10001"
    assert services["env"]["stop_grace_period"] == "20s"
    grace = {"ENVFLEET_UID": "1000", "ENVFLEET_GID": "1001", "ENVFLEET_STOP_GRACE_PERIOD": "70s"}
    services = config("--profile", "learner", **grace)["services"]
    assert (services["learner"]["user"], services["env"]["stop_grace_period"]) == ("1000:1001", "1m10s")
    swarm = subprocess.run(
        ["docker", "stack", "config", "-c", "docker-compose.yml"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert swarm.returncode == 0, swarm.stderr


def test_compose_builds_the_learner_with_wandb_and_passes_its_variables() -> None:
    """The learner image's extras (build argument EXTRAS): track (wandb) unless ENVFLEET_LEARNER_EXTRAS says
    otherwise, an empty one too (none); W&B's variables reach both learner services, as the token does, and
    ENVFLEET_TRACK (--track without changing the command)."""
    services = config("--profile", "learner", "--profile", "gpu", WANDB_MODE="offline", ENVFLEET_TRACK="on")["services"]
    for name in ("learner", "learner-gpu"):
        assert services[name]["build"]["args"]["EXTRAS"] == "track", name
        assert services[name]["environment"]["WANDB_MODE"] == "offline", name
        assert services[name]["environment"]["ENVFLEET_TRACK"] == "on", name
        assert {"WANDB_API_KEY", "WANDB_PROJECT", "WANDB_ENTITY"} <= set(services[name]["environment"]), name
    for extras in ("", "track video"):
        services = config("--profile", "learner", ENVFLEET_LEARNER_EXTRAS=extras)["services"]
        assert services["learner"]["build"]["args"]["EXTRAS"] == extras


def test_images_run_as_non_root_and_the_env_server_image_has_no_torch(fleet: ComposeProject) -> None:
    # (envfleet is installed, in place: its version is the package's, not "0.1.0 (not installed)")
    probe = (
        "import importlib.metadata, importlib.util, os;"
        "print(os.getuid(), os.getgid(), importlib.util.find_spec('torch') is not None,"
        "importlib.metadata.version('envfleet'))"
    )
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for image, has_torch in ((fleet.env_image, "False"), (fleet.learner_image, "True")):
        assert docker("run", "--rm", "--entrypoint", "python", image, "-c", probe).stdout.split() == [
            "10001",
            "10001",
            has_torch,
            version,
        ]


def test_scaled_replicas_are_healthy_and_published_on_loopback_only(fleet: ComposeProject) -> None:
    containers = fleet.containers()
    assert len(containers) == REPLICAS
    for container in containers:
        assert (container["State"], container["Health"]) == ("running", "healthy"), container
        published = [p for p in container["Publishers"] if p.get("PublishedPort")]
        assert published, container
        assert {p["URL"] for p in published} == {"127.0.0.1"}, published
        assert {p["TargetPort"] for p in published} == {50051}
    # Least privilege, as in k8s/base: read-only root filesystem (a tmpfs /tmp), no capabilities, no setuid gain.
    host = json.loads(docker("inspect", "--format", "{{json .HostConfig}}", containers[0]["ID"]).stdout)
    assert (host["ReadonlyRootfs"], host["CapDrop"]) == (True, ["ALL"]), host
    assert [(m["Type"], m["Target"]) for m in host["Mounts"]] == [("tmpfs", "/tmp")], host
    assert "no-new-privileges:true" in host["SecurityOpt"], host


def test_compose_addresses_reach_every_replica_from_the_host(fleet: ComposeProject) -> None:
    addresses = expand_addresses(f"compose:{fleet.name}/env")
    assert len(addresses) == REPLICAS and len(set(addresses)) == REPLICAS
    assert all(a.startswith("127.0.0.1:") for a in addresses)
    with RemoteVectorEnv(f"compose:{fleet.name}/env") as envs:
        assert envs.num_envs == REPLICAS * ENVS_PER_REPLICA
        obs, _ = envs.reset(seed=0)
        assert obs.shape == (envs.num_envs, 4)
        for t in range(20):  # left, right, left, ...: no pole falls this soon
            obs, rewards, terminations, _, _ = envs.step(np.full(envs.num_envs, t % 2))
            assert np.all(rewards == 1.0) and not terminations.any()
    # A service name with a typo: what services there are.
    with pytest.raises(AddressError) as info:
        expand_addresses(f"compose:{fleet.name}/envs")
    assert f"no container of a compose service 'envs' in project '{fleet.name}'" in str(info.value)
    assert f"{fleet.name}/env" in str(info.value)


def test_a_one_off_container_of_the_service_is_no_replica(fleet: ComposeProject) -> None:
    """`docker compose run env` makes a container of the service that publishes no port (and that the
    network's DNS leaves out of `env`): compose: looks past it, as DNS does (it failed the whole fleet:
    "expected exactly one published TCP port, found none")."""
    name = f"{fleet.name}-oneoff"
    try:
        fleet.run("run", "-d", "--no-deps", "--name", name, "env")
        addresses = expand_addresses(f"compose:{fleet.name}/env")
        assert len(addresses) == REPLICAS and all(a.startswith("127.0.0.1:") for a in addresses)
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)


def test_a_fleet_found_as_compose_env_is_kept_when_another_project_runs_env_too(
    fleet: ComposeProject, caplog: pytest.LogCaptureFixture
) -> None:
    """RemoteVectorEnv pins compose:env to the project it found: a second project's `env` replicas,
    started later, make compose:env ambiguous but do not stop this fleet's look-ups between rollouts."""
    try:
        expand_addresses("compose:env")
    except AddressError as err:  # another project on this engine runs `env` too (a concurrent run, a demo)
        pytest.skip(f"compose:env is ambiguous on this engine before the test starts: {err}")
    other = ComposeProject(prefix="envfleet-other", images_of=fleet)
    try:
        with RemoteVectorEnv("compose:env") as envs:
            assert envs._address_spec == f"compose:{fleet.name}/env"
            envs.reset(seed=0)
            other.up(1)
            with pytest.raises(AddressError, match="runs in several compose projects"):
                expand_addresses("compose:env")
            with caplog.at_level(logging.WARNING, logger="learner.remote"):
                assert envs.refresh() is None  # nothing changed in this fleet
            assert "several compose projects" not in caplog.text
            assert envs.num_envs == REPLICAS * ENVS_PER_REPLICA
    finally:
        other.down()


TRAIN = ["--total-timesteps", "4096", "--num-steps", "32", "--no-plot", "--no-progress", "--checkpoint-every", "0"]


def test_training_from_the_host_on_every_replica(fleet: ComposeProject, tmp_path: Path) -> None:
    """`learner train --servers compose:env`: the replicas' published ports, found through the Docker SDK."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "learner", "train", "--servers", f"compose:{fleet.name}/env", *TRAIN]
    result = subprocess.run(
        [*command, "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=600, cwd=REPO
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = rundir.read_json(run_dir / rundir.SUMMARY)
    assert summary["total_steps"] == 4096 and summary["updates"] == 4
    assert len(rundir.read_json(run_dir / rundir.CONFIG)["envs"]["addresses"]) == REPLICAS
    assert {row["num_envs"] for row in rundir.read_jsonl(run_dir / rundir.METRICS)} == {REPLICAS * ENVS_PER_REPLICA}


def test_training_in_the_learner_container_on_every_replica(fleet: ComposeProject) -> None:
    """`docker compose run learner`: every replica through the compose DNS name; the run lands in the volume."""
    train = ["train", "--servers", "dns:///env:50051", *TRAIN, "--run-dir", "runs/ci"]
    result = fleet.run("run", "--rm", "--no-deps", "learner", *train, timeout=600)
    assert "4,096 env steps" in result.stdout, result.stdout + result.stderr
    show = "import json; c = json.load(open('runs/ci/config.json')); print(len(c['envs']['addresses']), c['envs']['num_envs'])"
    result = fleet.run("run", "--rm", "--no-deps", "--entrypoint", "python", "learner", "-c", show, timeout=180)
    assert result.stdout.split()[-2:] == [str(REPLICAS), str(REPLICAS * ENVS_PER_REPLICA)]
    # Its root filesystem is read-only (compose's read_only): plotting (matplotlib's cache) and an eval on
    # local servers (their sockets) write only to the runs volume and the tmpfs on /tmp.
    result = fleet.run("run", "--rm", "--no-deps", "learner", "plot", "runs/ci", timeout=180)
    assert "runs/ci/returns.png" in result.stdout + result.stderr, result.stdout + result.stderr
    result = fleet.run("run", "--rm", "--no-deps", "learner", "eval", "runs/ci", "--episodes", "2", timeout=300)
    assert "return " in result.stdout, result.stdout + result.stderr
    probe = "open('/opt/envfleet/probe', 'w')"
    result = fleet.run("run", "--rm", "--no-deps", "--entrypoint", "python", "learner", "-c", probe, check=False)
    assert "Read-only file system" in result.stderr, result.stdout + result.stderr


def test_the_learner_container_tracks_a_run_with_wandb(fleet: ComposeProject) -> None:
    """`learner train --track` in the learner container (its image has the extra track by default): W&B's
    variables reach it through compose (WANDB_MODE=offline: nothing leaves the machine), and the offline
    run lands in its run dir in the runs volume, not on the read-only root filesystem or the /tmp
    tmpfs, so `wandb sync` finds it once the container is gone; wandb-core writes its logs to /tmp. (Turned on
    by ENVFLEET_TRACK, which compose passes: the command has no --track.)"""
    train = ["train", "--backend", "gym", "--env", "CartPole-v1", "--num-envs", "2", "--total-timesteps", "128"]
    train += ["--num-steps", "32", "--no-plot", "--no-progress", "--run-dir", "runs/tracked"]
    variables = {"WANDB_MODE": "offline", "ENVFLEET_TRACK": "on"}
    result = fleet.run("run", "--rm", "--no-deps", "learner", *train, timeout=300, env=variables)
    output = result.stdout + result.stderr
    assert ", offline (upload it with: wandb sync /workspace/runs/tracked/wandb/offline-run-" in output, output
    assert "read-only file system" not in output.lower(), output
    show = "import json, os; r = json.load(open('runs/tracked/wandb-run.json')); print(os.path.isdir(r['files']))"
    result = fleet.run("run", "--rm", "--no-deps", "--entrypoint", "python", "learner", "-c", show, timeout=180)
    assert result.stdout.split()[-1] == "True", result.stdout + result.stderr


def test_a_learner_image_built_without_extras_has_no_wandb(fleet: ComposeProject) -> None:
    """ENVFLEET_LEARNER_EXTRAS set and empty: an image without wandb (torch's layer is the fleet's, cached),
    whose --track says what is missing."""
    project = ComposeProject(ENVFLEET_LEARNER_EXTRAS="")
    try:
        project.build("learner", timeout=600)
        probe = "import importlib.util as u; print(u.find_spec('wandb') is None, u.find_spec('torch') is not None)"
        result = docker("run", "--rm", "--entrypoint", "python", project.learner_image, "-c", probe)
        assert result.stdout.split() == ["True", "True"]
        command = ["docker", "run", "--rm", project.learner_image, "train", "--backend", "gym", "--track"]
        result = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert result.returncode == 1 and "--track needs wandb" in result.stderr, result.stdout + result.stderr
    finally:
        project.down()


def fleet_sizes(run_dir: Path) -> list[int]:
    """``num_envs`` of each update so far (metrics.jsonl, which the run appends to as it goes)."""
    path = run_dir / rundir.METRICS
    if not path.exists():
        return []
    sizes = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line being written
            sizes.append(int(json.loads(line)["num_envs"]))
    return sizes


def wait_until(
    condition: Callable[[], bool], what: str, proc: subprocess.Popen[str], run_dir: Path, timeout: float = 180
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"training exited ({proc.returncode}) before {what}:\n{out[-4000:]}\n{(err or '')[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            sizes = fleet_sizes(run_dir)
            pytest.fail(
                f"no {what} within {timeout:g} s; num_envs so far: {sizes}\n{out[-3000:]}\n{(err or '')[-3000:]}"
            )
        time.sleep(0.5)


def scale_under(fleet: ComposeProject, proc: subprocess.Popen[str], run_dir: Path) -> None:
    """Scale 8 -> 12 -> 8 replicas under a running training; wait to see num_envs follow each time."""
    small, large = REPLICAS * ENVS_PER_REPLICA, 12 * ENVS_PER_REPLICA
    wait_until(lambda: small in fleet_sizes(run_dir), f"an update with {small} envs", proc, run_dir)
    fleet.up(12)
    wait_until(lambda: large in fleet_sizes(run_dir), f"an update with {large} envs", proc, run_dir)
    fleet.up(REPLICAS)
    wait_until(lambda: fleet_sizes(run_dir)[-1] == small, f"an update with {small} envs again", proc, run_dir)


def test_scaling_while_training_grows_and_shrinks_num_envs(fleet: ComposeProject, tmp_path: Path) -> None:
    """`up --scale env=12` mid-run: the learner finds the new replicas between rollouts (num_envs 32 -> 48),
    without a restart; scaling back to 8 stops 4 replicas under it (SIGTERM), and training goes on with 32."""
    run_dir = tmp_path / "run"
    options = [*TRAIN, "--total-timesteps", "100000000", "--no-tensorboard", "--run-dir", str(run_dir)]
    command = [
        sys.executable,
        "-m",
        "learner",
        "--log-level",
        "info",
        "train",
        "--servers",
        f"compose:{fleet.name}/env",
    ]
    command += options
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        scale_under(fleet, proc, run_dir)
    finally:
        proc.send_signal(signal.SIGINT)  # stop at the next step, with a checkpoint and summary
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == CTRL_C_EXIT, out + err
    assert "Traceback" not in err, err
    sizes = fleet_sizes(run_dir)
    small, large = REPLICAS * ENVS_PER_REPLICA, 12 * ENVS_PER_REPLICA
    grown = sizes.index(large)  # replicas join as each turns healthy: 32, 32, 36, ..., 48
    assert sizes[0] == small and sizes[:grown] == sorted(sizes[:grown]) and sizes[-1] == small, (sizes, err)
    summary = rundir.read_json(run_dir / rundir.SUMMARY)
    assert summary["stop_reason"] == "interrupted"
    # The 4 stopped replicas left saying so (SIGTERM): a scale-down is no failure.
    assert (summary["failures"], summary["servers_left"]) == (0, 4), summary
    assert len(fleet.containers()) == REPLICAS


def test_scaling_while_training_in_the_learner_container(fleet: ComposeProject, tmp_path: Path) -> None:
    """The same from the learner container, whose dns:///env:50051 is looked up again between rollouts;
    the run goes to a host folder (ENVFLEET_RUNS)."""
    runs = tmp_path / "runs"
    runs.mkdir()
    runs.chmod(0o777)  # the container's user (10001:10001) writes here
    name = f"{fleet.name}-learner-scaling"
    options = [*TRAIN, "--total-timesteps", "100000000", "--no-tensorboard", "--run-dir", "runs/scale"]
    train = ["run", "--rm", "--no-deps", "-T", "--name", name, "learner", "train", "--servers", "dns:///env:50051"]
    proc = fleet.popen(*train, *options, env={"ENVFLEET_RUNS": str(runs)})
    run_dir = runs / "scale"
    try:
        scale_under(fleet, proc, run_dir)
    finally:
        # SIGTERM: the learner stops at its next step, with a checkpoint and summary.
        subprocess.run(["docker", "stop", "--time", "60", name], capture_output=True, timeout=120)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "Traceback" not in out, out
    assert rundir.read_json(run_dir / rundir.SUMMARY)["stop_reason"] == "interrupted"


def test_killed_replicas_come_back_and_training_completes(fleet: ComposeProject) -> None:
    """The learner container trains on 8 replicas; mid-run 2 are `docker kill`ed (Docker counts that as a stop:
    compose brings them back with `up`) and a third's server process is SIGKILLed inside it (the restart
    policy brings it back). Training completes, and its metrics count the 3 failures, the 3 comebacks
    (reconnects, or joins when the DNS name dropped a replica while it was down) and the env steps lost."""
    # A project of its own (the images are the fleet's), its steps at least 20 ms long: the run lasts >= 20 s
    # whatever the machine, so the replicas are back before it ends.
    project = ComposeProject(prefix="envfleet-faults", images_of=fleet, ENVFLEET_STEP_DELAY_MS="20")
    total = 32 * 32 * 32  # 32 updates of 32 steps of 32 envs: >= 20 s
    proc: subprocess.Popen[str] | None = None
    try:
        project.up(REPLICAS)
        up_at = time.monotonic()
        # At INFO, the fleet's changes show: a replica killed between two rollouts leaves at the next
        # refresh (its name no longer resolves) without a step to lose it in.
        train = ["--log-level", "info", "train", "--servers", "dns:///env:50051", "--total-timesteps", str(total)]
        train += ["--num-steps", "32"]
        train += ["--no-plot", "--no-progress", "--checkpoint-every", "0", "--timeout", "5", "--run-dir", "runs/faults"]
        proc = project.popen("run", "--rm", "--no-deps", "learner", *train)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
        reader.start()
        deadline = time.monotonic() + 300
        while not any(line.startswith("run dir:") for line in lines):  # connected, training
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        # A few rollouts in, and the replicas up for > 10 s: Docker applies a restart policy only to a
        # container that ran that long.
        time.sleep(max(3.0, 12.0 - (time.monotonic() - up_at)))
        *killed, crashed = (c["Name"] for c in project.containers()[2:5])
        docker("kill", *killed)
        docker("exec", crashed, "sh", "-c", "kill -9 -1")  # the server dies; tini exits; the policy restarts it
        while len(_gone(lines)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        project.run("up", "-d", "--no-build", "--no-recreate", "--scale", f"env={REPLICAS}")  # the killed two
        assert proc.wait(timeout=600) == 0, "".join(lines)
        reader.join(timeout=30)
        output = "".join(lines)
        # The fleet's size changes while replicas are away, so the last rollout may overshoot the total.
        steps = re.search(r"^([\d,]+) env steps in", output, re.MULTILINE)
        assert steps is not None and int(steps[1].replace(",", "")) >= total, output
        show = (
            "import json; rows = [json.loads(l) for l in open('runs/faults/metrics.jsonl')];"
            "s = json.load(open('runs/faults/summary.json'));"
            "print(json.dumps([sum(r.get(k, 0) for r in rows) for k in "
            "('faults/failures', 'faults/reconnects', 'faults/servers_joined', 'env_steps_lost')]"
            " + [rows[-1]['envs_unavailable'], rows[-1]['num_envs'], s['failures'], s['stop_reason']]))"
        )
        result = project.run("run", "--rm", "--no-deps", "--entrypoint", "python", "learner", "-c", show, timeout=180)
        failures, reconnects, joined, lost, unavailable, num_envs, *summary = json.loads(
            result.stdout.strip().splitlines()[-1]
        )
        # Each came back either at its old address (a reconnect) or, if the DNS name dropped it while it was
        # down, as a replica joining the fleet (a restarted container may get another IP address).
        assert failures == 3 and reconnects + joined == 3, (failures, reconnects, joined, output)
        assert (unavailable, num_envs) == (0, REPLICAS * ENVS_PER_REPLICA)
        # A replica lost in a step loses env steps; one that died while the learner updated, its name gone by the
        # next rollout, leaves at that refresh and loses none (CI saw all three go so: 0 lost).
        lost_in_steps = re.findall(r"env server \S+ lost \(", output)
        assert lost > 0 or not lost_in_steps, (lost, output)
        assert summary == [3, "total_timesteps"]
        assert [c["State"] for c in project.containers()] == ["running"] * REPLICAS
    finally:
        if proc is not None and proc.poll() is None:  # the test failed under it
            proc.kill()
            proc.wait(timeout=30)
        project.down()


def _gone(lines: list[str]) -> set[str]:
    """The replicas a learner's log shows gone: lost in a step, or left the fleet at a refresh."""
    gone = set()
    for line in list(lines):
        if lost := re.search(r"env server (\S+) lost \(", line):
            gone.add(lost[1])
        elif left := re.search(r"fleet changed: .* (\d+) left \(([^)]*)\)", line):
            gone.update(a.strip() for a in left[2].split(",") if a.strip() != "-")
    return gone


def test_an_image_with_your_own_env_class(fleet: ComposeProject) -> None:
    """The README's recipe: a two-line Dockerfile FROM the env-server image adds your env's code."""
    env_code = (
        "import gymnasium as gym\nimport numpy as np\n\n\n"
        "class Coin(gym.Env):\n"
        "    observation_space = gym.spaces.Box(0.0, 1.0, (1,), np.float32)\n"
        "    action_space = gym.spaces.Discrete(2)\n\n"
        "    def reset(self, *, seed=None, options=None):\n"
        "        super().reset(seed=seed)\n"
        "        return np.zeros(1, np.float32), {}\n\n"
        "    def step(self, action):\n"
        "        return np.ones(1, np.float32), float(action), True, False, {}\n"
    )
    tag = f"{fleet.name}-coin"
    with tempfile.TemporaryDirectory() as context:
        (Path(context) / "coin_env.py").write_text(env_code)
        (Path(context) / "Dockerfile").write_text(f"FROM {fleet.env_image}\nCOPY coin_env.py /opt/envfleet/\n")
        docker("build", "-q", "-t", tag, context, timeout=300)
    name = f"{fleet.name}-coin"
    try:
        docker("run", "-d", "--name", name, "-p", "127.0.0.1::50051", "-e", "ENVFLEET_ENV=coin_env:Coin", tag)
        port = docker("port", name, "50051/tcp").stdout.split()[0].rpartition(":")[2]
        with RemoteVectorEnv(f"127.0.0.1:{port}", connect_timeout=60) as envs:
            envs.reset(seed=0)
            _, rewards, terminations, _, _ = envs.step(np.ones(envs.num_envs, dtype=np.int64))
        assert envs.num_envs == 4 and rewards.tolist() == [1.0] * 4 and terminations.all()
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=60)


def test_extra_pip_packages_build_argument_installs_an_env_package(fleet: ComposeProject) -> None:
    """The README's other recipe: --build-arg EXTRA_PIP_PACKAGES (here ALE's Atari envs, from PyPI)."""
    tag = f"{fleet.name}-atari"
    name = f"{fleet.name}-atari"
    extra = "EXTRA_PIP_PACKAGES=ale-py opencv-python-headless"
    try:
        docker("build", "-q", "--build-arg", extra, "-t", tag, str(REPO), timeout=600)
        env = ["-e", "ENVFLEET_ENV=ALE/Pong-v5", "-e", "ENVFLEET_WRAPPERS=atari", "-e", "ENVFLEET_NUM_ENVS=2"]
        docker("run", "-d", "--name", name, "-p", "127.0.0.1::50051", *env, tag)
        port = docker("port", name, "50051/tcp").stdout.split()[0].rpartition(":")[2]
        with RemoteVectorEnv(f"127.0.0.1:{port}", connect_timeout=60) as envs:
            obs, _ = envs.reset(seed=0)
        assert (obs.shape, obs.dtype) == ((2, 4, 84, 84), np.uint8)
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=60)


def test_down_leaves_no_container_volume_or_network(fleet: ComposeProject) -> None:
    """`down --volumes` of a project whose learner (a service under a profile) wrote to the volume `runs`:
    compose itself removes that volume too (ComposeProject.down gives it every profile; without, compose
    given its files by -f leaves it), and the project's network and containers."""
    project = ComposeProject(images_of=fleet)
    label = f"{PROJECT_LABEL}={project.name}"
    try:
        project.up(1)
        project.run("run", "--rm", "--no-deps", "--entrypoint", "touch", "learner", "runs/x", timeout=180)
        assert f"volume {project.name}_runs" in labelled(label) and f"network {project.name}_default" in labelled(label)
    finally:
        left_by_compose = project.down()
    assert left_by_compose == [] and labelled(label) == []


def test_replicas_stop_cleanly_on_sigterm(fleet: ComposeProject) -> None:
    """Last: `compose stop` sends SIGTERM; every server drains and exits 0 within the grace period."""
    fleet.run("stop", "--timeout", "15", "env", timeout=120)
    containers = fleet.containers()
    assert [c["State"] for c in containers] == ["exited"] * REPLICAS
    assert [c["ExitCode"] for c in containers] == [0] * REPLICAS
    logs = fleet.run("logs", "--no-color", "env").stdout
    assert logs.count("stopped after") == REPLICAS
