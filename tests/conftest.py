"""Shared fixtures: real env servers, started as subprocesses on port 0."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from learner import LocalServers

StartServers = Callable[..., list[str]]


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
