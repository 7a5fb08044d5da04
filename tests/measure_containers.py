"""The container targets, measured: image sizes, time until N replicas are healthy, memory per replica.

    python -m tests.measure_containers [--replicas 8] [--steps 2000]

Builds the images (cached layers), starts a compose project of its own, and prints one table. The
targets (issue 4): env-server image <= 300 MB; 8 replicas healthy <= 20 s after `up` with the
images built; each CartPole replica (4 envs) <= 80 MB resident, as `docker stats` reports it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import numpy as np

from learner import RemoteVectorEnv
from tests.compose import ComposeProject, docker_problem

MIB = 1024 * 1024
UNITS = {"B": 1, "KiB": 1024, "MiB": MIB, "GiB": 1024 * MIB}


def image_mb(tag: str) -> float:
    out = subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", tag], capture_output=True, text=True)
    return int(out.stdout) / 1e6


def memory_mib(names: list[str]) -> list[float]:
    """``docker stats`` memory usage of each container, MiB."""
    out = subprocess.run(
        ["docker", "stats", "--no-stream", "--format", "{{json .}}", *names], capture_output=True, text=True, check=True
    ).stdout
    usage = []
    for line in out.splitlines():
        text = json.loads(line)["MemUsage"].split("/")[0].strip()
        number = text.rstrip("KMGiB")
        usage.append(float(number) * UNITS[text[len(number) :]] / MIB)
    return usage


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument(
        "--steps", type=int, default=2000, help="vector steps over all replicas before measuring memory"
    )
    args = parser.parse_args()
    problem = docker_problem()
    if problem:
        print(f"cannot measure: {problem}", file=sys.stderr)
        return 1
    project = ComposeProject(prefix="envfleet-measure")
    try:
        start = time.monotonic()
        project.build("env", "learner")
        build_s = time.monotonic() - start
        healthy_s = project.up(args.replicas)
        names = [c["Name"] for c in project.containers()]
        idle = memory_mib(names)
        with RemoteVectorEnv(f"compose:{project.name}/env") as envs:
            envs.reset(seed=0)
            start = time.monotonic()
            for t in range(args.steps):
                envs.step(np.full(envs.num_envs, t % 2))
            sps = args.steps * envs.num_envs / (time.monotonic() - start)
            busy = memory_mib(names)
        start = time.monotonic()
        project.run("stop", "--timeout", "15", "env")
        stop_s = time.monotonic() - start
        env_mb, learner_mb = image_mb(project.env_image), image_mb(project.learner_image)
    finally:
        project.down()
    print(f"{'measure':<58} {'value':>10}  target")
    print(f"{'env-server image':<58} {env_mb:>7.0f} MB  <= 300 MB")
    print(f"{'learner image':<58} {learner_mb:>7.0f} MB")
    print(f"{'build both images (layers cached unless changed)':<58} {build_s:>8.1f} s")
    print(f"{f'up -d --wait --scale env={args.replicas}: all healthy after':<58} {healthy_s:>8.1f} s  <= 20 s")
    print(f"{'memory per replica, idle (docker stats; max)':<58} {max(idle):>6.1f} MiB  <= 80 MB")
    print(f"{f'memory per replica after {args.steps} steps (docker stats; max)':<58} {max(busy):>6.1f} MiB  <= 80 MB")
    print(f"{'env-steps/s from the host (published ports, docker-proxy)':<58} {sps:>10,.0f}")
    print(f"{f'compose stop: {args.replicas} replicas drained and exited':<58} {stop_s:>8.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
