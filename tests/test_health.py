"""The health probe the container image's HEALTHCHECK runs, against real servers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import env_server.health
from env_server.health import check, default_address
from tests.conftest import StartServers

HEALTH_FILE = Path(env_server.health.__file__)


def probe(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The probe as the image runs it: by path, isolated (-I), so the package's imports are skipped."""
    return subprocess.run(
        [sys.executable, "-I", str(HEALTH_FILE), *args], capture_output=True, text=True, timeout=30, env=env
    )


def test_serving_server_is_healthy_for_the_server_and_the_env_service(start_servers: StartServers) -> None:
    (address,) = start_servers("CartPole-v1", 1, 2)
    assert check(address) == "SERVING"
    assert check(address, "envfleet.v1.EnvService") == "SERVING"
    result = probe("--address", address)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{address}: SERVING"


def test_probe_reads_the_port_from_the_servers_environment_variables(start_servers: StartServers) -> None:
    (address,) = start_servers("CartPole-v1", 1, 1)
    port = address.rpartition(":")[2]
    env = {**os.environ, "ENVFLEET_HOST": "0.0.0.0", "ENVFLEET_PORT": port}
    result = probe(env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"127.0.0.1:{port}: SERVING")


def test_unknown_service_and_nothing_listening_are_unhealthy(start_servers: StartServers) -> None:
    (address,) = start_servers("CartPole-v1", 1, 1)
    result = probe("--address", address, "--service", "no.such.Service")
    assert result.returncode == 1
    assert "no service 'no.such.Service'" in result.stderr
    result = probe("--address", "127.0.0.1:1", "--timeout", "2")
    assert result.returncode == 1
    assert "127.0.0.1:1: unhealthy: UNAVAILABLE" in result.stderr


def test_probe_does_not_import_numpy_or_gymnasium() -> None:
    """Run by path it stays cheap: every replica runs it every few seconds."""
    code = (
        f"import runpy, sys; sys.argv = ['health', '--help']\n"
        f"try: runpy.run_path({str(HEALTH_FILE)!r}, run_name='__main__')\n"
        "except SystemExit: pass\n"
        "print(sorted(m for m in ('numpy', 'gymnasium', 'env_server') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=30, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_default_address() -> None:
    assert default_address({}) == "127.0.0.1:50051"
    assert default_address({"ENVFLEET_HOST": "0.0.0.0", "ENVFLEET_PORT": "6000"}) == "127.0.0.1:6000"
    assert default_address({"ENVFLEET_HOST": "::", "ENVFLEET_PORT": "6000"}) == "[::1]:6000"
    assert default_address({"ENVFLEET_HOST": "10.1.2.3"}) == "10.1.2.3:50051"
    assert default_address({"ENVFLEET_UNIX_SOCKET": "/tmp/env.sock"}) == "unix:/tmp/env.sock"
