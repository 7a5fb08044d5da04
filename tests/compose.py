"""Driving the repo's docker-compose.yml from tests and measurements: one uniquely named project each."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WHEELHOUSE = REPO / ".ci" / "wheelhouse"


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
    """The environment compose runs with: ours, not whatever ENVFLEET_* the caller's shell has."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ENVFLEET_", "COMPOSE_", "EXTRA_PIP_PACKAGES"))}
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

    def __init__(self, prefix: str = "envfleet-test", **env: str) -> None:
        self.name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        # Image tags of the project's own: never a user's images, nor those of a run beside this one
        # (a rebuilt image under a shared tag makes `up` recreate every replica). Layers are cached.
        self.env_image = f"envfleet-env-server:{self.name}"
        self.learner_image = f"envfleet-learner:{self.name}"
        self.env = compose_environment(
            ENVFLEET_ENV_IMAGE=self.env_image, ENVFLEET_LEARNER_IMAGE=self.learner_image, **env
        )

    def command(self, *args: str) -> list[str]:
        files = ["-f", str(REPO / "docker-compose.yml"), "-f", str(REPO / "docker-compose.override.yml")]
        return ["docker", "compose", *files, "-p", self.name, *args]

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run ``docker compose ARGS`` to completion; a failure raises with compose's output."""
        result = subprocess.run(
            self.command(*args), capture_output=True, text=True, timeout=timeout, env=self.env, cwd=REPO
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

    def down(self) -> None:
        """Remove the project's containers, network, volumes and image tags."""
        self.run("down", "--volumes", "--remove-orphans", "--timeout", "15", timeout=180, check=False)
        subprocess.run(["docker", "rmi", self.env_image, self.learner_image], capture_output=True, timeout=120)
