"""Shared fixtures: real env servers, started as subprocesses on port 0."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from learner import LocalServers

StartServers = Callable[..., list[str]]
Serve = Callable[..., tuple[subprocess.Popen[str], str]]


@pytest.fixture
def start_servers() -> Iterator[StartServers]:
    """``start_servers(env, num_servers, envs_per_server, **kwargs)`` -> addresses; stopped after the test."""
    started: list[LocalServers] = []

    def start(env: str, num_servers: int = 1, envs_per_server: int = 1, **kwargs: Any) -> list[str]:
        servers = LocalServers(env, num_servers, envs_per_server, **kwargs)
        started.append(servers)
        return servers.addresses

    yield start
    for servers in started:
        servers.close()


@pytest.fixture
def serve() -> Iterator[Serve]:
    """``serve(env, num_envs)`` -> (process, address): one env server of its own (to stop or kill), killed after."""
    procs: list[subprocess.Popen[str]] = []

    def start(env: str = "CartPole-v1", num_envs: int = 2) -> tuple[subprocess.Popen[str], str]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "env_server", "--env", env, "--num-envs", str(num_envs), "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on "), line
        return proc, line.removeprefix("listening on ")

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)
