"""Driving the repo's docker-compose.yml from tests and measurements: one uniquely named project each."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WHEELHOUSE = REPO / ".ci" / "wheelhouse"

PROJECT_LABEL = "com.docker.compose.project"
STACK_LABEL = "com.docker.stack.namespace"
TEST_PREFIXES = ("envfleet-test", "envfleet-faults", "envfleet-swarm", "envfleet-measure")
"""Name prefixes of the compose projects and stacks that tests and measurements make (then -XXXXXXXX)."""
STALE_AFTER_S = 3 * 3600.0
"""A test project whose every container, volume and network is older than this is left over from a run
that never got to clean up (killed, cancelled): the Docker tests take minutes, not hours."""


def docker_problem() -> str | None:
    """Why Docker with compose v2 cannot be used here, or None when it can."""
    if shutil.which("docker") is None:
        return "no docker command (run ../shared/docker-setup.sh, or install Docker)"
    for args in (["docker", "info"], ["docker", "compose", "version"]):
        try:
            result = subprocess.run(args, capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(args)}` did not answer within 30 s"
        if result.returncode != 0:
            return f"`{' '.join(args)}` failed: {(result.stderr or result.stdout).strip()[-300:]}"
    return None


def compose_environment(**overrides: str) -> dict[str, str]:
    """The environment compose runs with: ours, not whatever ENVFLEET_* (or WANDB_*: the learner service
    passes them on) the caller's shell has."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ENVFLEET_", "COMPOSE_", "EXTRA_PIP_PACKAGES", "WANDB_"))
    }
    # The learner image's torch: the CPU wheel .ci/run put in the wheelhouse, else PyTorch's CPU index
    # (never the multi-GB CUDA build from PyPI).
    if any(WHEELHOUSE.glob("torch-*.whl")):
        env["ENVFLEET_TORCH_FROM"] = "wheelhouse"
    else:
        env["ENVFLEET_TORCH_INDEX_URL"] = "https://download.pytorch.org/whl/cpu"
    env.update(overrides)
    return env


class ComposeProject:
    """``docker compose -p envfleet-test-XXXX`` over the repo's compose file."""

    def __init__(self, prefix: str = "envfleet-test", images_of: ComposeProject | None = None, **env: str) -> None:
        """A project named PREFIX-XXXXXXXX; ``images_of``: use that project's images (and leave them to it)."""
        self.name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        # Image tags of the project's own: never a user's images, nor those of a run beside this one
        # (a rebuilt image under a shared tag makes `up` recreate every replica). Layers are cached.
        self.owns_images = images_of is None
        self.env_image: str = images_of.env_image if images_of else f"envfleet-env-server:{self.name}"
        self.learner_image: str = images_of.learner_image if images_of else f"envfleet-learner:{self.name}"
        self.env = compose_environment(
            ENVFLEET_ENV_IMAGE=self.env_image, ENVFLEET_LEARNER_IMAGE=self.learner_image, **env
        )

    def command(self, *args: str) -> list[str]:
        files = ["-f", str(REPO / "docker-compose.yml"), "-f", str(REPO / "docker-compose.override.yml")]
        return ["docker", "compose", *files, "-p", self.name, *args]

    def run(
        self, *args: str, timeout: float = 120, check: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``docker compose ARGS`` to completion, with ``env`` added to compose's environment; a failure
        raises with compose's output."""
        result = subprocess.run(
            self.command(*args),
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**self.env, **(env or {})},
            cwd=REPO,
        )
        if check and result.returncode != 0:
            raise RuntimeError(
                f"docker compose {' '.join(args)} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        return result

    def popen(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """Start ``docker compose ARGS`` (output joined on stdout), with ``env`` added to compose's environment."""
        return subprocess.Popen(
            self.command(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**self.env, **(env or {})},
            cwd=REPO,
        )

    def build(self, *services: str, timeout: float = 900) -> None:
        self.run("build", *services, timeout=timeout)

    def up(self, replicas: int, timeout: float = 120) -> float:
        """``up -d --wait --no-recreate --scale env=N``: seconds until every replica is healthy."""
        start = time.monotonic()
        self.run("up", "-d", "--wait", "--no-build", "--no-recreate", "--scale", f"env={replicas}", timeout=timeout)
        return time.monotonic() - start

    def containers(self, service: str = "env") -> list[dict[str, Any]]:
        """``docker compose ps`` records (Name, State, Health, Publishers, ...), in replica order."""
        out = self.run("ps", "--all", "--format", "json", service).stdout.strip()
        records: list[dict[str, Any]] = []
        if out.startswith("["):
            records = json.loads(out)
        else:
            records = [json.loads(line) for line in out.splitlines() if line.strip()]
        return sorted(records, key=lambda r: int(str(r["Name"]).rpartition("-")[2]))

    def down(self) -> list[str]:
        """Remove the project's containers, network, volumes and image tags (those it built).

        Returns what ``docker compose down`` left behind (and this then removed by the project's label):
        nothing, unless compose failed or timed out.
        """
        # --profile "*": with its files named by -f, compose's `down --volumes` leaves the volumes that only
        # services under a profile not given use (the learner's `runs`).
        with contextlib.suppress(subprocess.TimeoutExpired):  # then the label finds what it left
            self.run(
                "--profile", "*", "down", "--volumes", "--remove-orphans", "--timeout", "15", timeout=180, check=False
            )
        left = remove_labelled(f"{PROJECT_LABEL}={self.name}")
        if self.owns_images:
            subprocess.run(["docker", "rmi", self.env_image, self.learner_image], capture_output=True, timeout=120)
        return left


_LISTINGS = {
    "container": ["ps", "--all", "--format", "{{.Names}}"],
    "volume": ["volume", "ls", "--format", "{{.Name}}"],
    "network": ["network", "ls", "--format", "{{.Name}}"],
}


def labelled(label: str) -> list[str]:
    """The containers, volumes and networks with the Docker label ``label`` (KEY=VALUE): ``["volume NAME", ...]``."""
    found = []
    for kind, listing in _LISTINGS.items():
        result = subprocess.run(
            ["docker", *listing, "--filter", f"label={label}"], capture_output=True, text=True, timeout=60
        )
        found += [f"{kind} {name}" for name in result.stdout.split()] if result.returncode == 0 else []
    return found


def remove_labelled(label: str) -> list[str]:
    """Remove every container (forced), volume and network with the Docker label ``label`` (KEY=VALUE),
    in that order; returns what it found (a volume or network still in use by others stays)."""
    found = labelled(label)
    for kind in _LISTINGS:
        names = [entry.partition(" ")[2] for entry in found if entry.startswith(f"{kind} ")]
        if names:
            force = ["--force"] if kind == "container" else []
            subprocess.run(["docker", kind, "rm", *force, *names], capture_output=True, timeout=180)
    return found


def remove_stale_test_projects(older_than_s: float = STALE_AFTER_S) -> list[str]:
    """Remove what earlier runs of the tests left on this engine: the containers, volumes and networks of
    compose projects and stacks named ``envfleet-test-XXXXXXXX`` (and the other ``TEST_PREFIXES``) all of
    whose resources are older than ``older_than_s``; those of anyone else, or of a run going on beside
    this one, stay. Returns the names of what it removed.
    """
    import docker as sdk

    ours = re.compile(rf"(?:{'|'.join(map(re.escape, TEST_PREFIXES))})-[0-9a-f]{{8}}")
    newest: dict[tuple[str, str], float] = {}  # (label key, project) -> newest creation time
    client = sdk.from_env()
    try:
        records = [
            (c.attrs.get("Config", {}).get("Labels"), c.attrs.get("Created")) for c in client.containers.list(all=True)
        ]
        records += [(v.attrs.get("Labels"), v.attrs.get("CreatedAt")) for v in client.volumes.list()]
        records += [(n.attrs.get("Labels"), n.attrs.get("Created")) for n in client.networks.list()]
    finally:
        client.close()
    for labels, created in records:
        for key in (PROJECT_LABEL, STACK_LABEL):
            name = (labels or {}).get(key, "")
            if ours.fullmatch(name):
                when = _timestamp(created)
                newest[key, name] = max(newest.get((key, name), when), when)
    removed = []
    for (key, name), when in sorted(newest.items()):
        if time.time() - when > older_than_s:
            if key == STACK_LABEL:  # its services first, or Swarm starts their tasks again
                subprocess.run(["docker", "stack", "rm", name], capture_output=True, timeout=120)
            removed += remove_labelled(f"{key}={name}")
    return removed


def _timestamp(text: str | None) -> float:
    """Seconds since the epoch of Docker's ``2026-11-30T11:20:20.123456789Z``; now when it cannot be read."""
    try:
        text = re.sub(r"\.\d+", "", str(text)).replace("Z", "+00:00")
        when = datetime.fromisoformat(text)
        return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()
    except ValueError:
        return time.time()
