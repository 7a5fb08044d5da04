"""One learner owns a server at a time; the claim ends when it closes, disconnects or goes silent."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import time
from typing import Any

import grpc
import pytest

from env_server.config import ServerConfig
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from env_server.service import EnvService, ServiceError
from learner import RemoteVectorEnv, ServerBusyError
from tests.conftest import SpawnServer
from tests.test_metrics import scrape


def test_second_learner_is_refused_until_the_first_closes(start_servers: Any) -> None:
    addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=2)
    first = RemoteVectorEnv(addresses, client_name="learner-A")
    first.reset(seed=0)
    with pytest.raises(ServerBusyError) as info:
        RemoteVectorEnv(addresses, client_name="learner-B")
    assert "learner-A" in str(info.value) and info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    first.step(first.action_space.sample())  # the first learner was not disturbed
    first.close()
    with RemoteVectorEnv(addresses, client_name="learner-B") as second:
        second.reset(seed=0)


def wait_for_claim(addresses: list[str], within: float) -> float:
    start = time.monotonic()
    while True:
        try:
            RemoteVectorEnv(addresses).close()
            return time.monotonic() - start
        except ServerBusyError:
            if time.monotonic() - start > within:
                raise
            time.sleep(0.1)


@pytest.mark.slow
def test_killed_learner_does_not_lock_the_server(start_servers: Any) -> None:
    addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=2)
    script = textwrap.dedent(
        f"""
        import sys, time
        from learner import RemoteVectorEnv
        envs = RemoteVectorEnv({addresses!r})
        envs.reset(seed=0)
        print("claimed", flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "claimed"
        with pytest.raises(ServerBusyError):
            RemoteVectorEnv(addresses)
        proc.kill()
        proc.wait()
        assert wait_for_claim(addresses, within=5) < 5
    finally:
        proc.kill()


@pytest.mark.slow
def test_silent_client_loses_its_claim_after_the_timeout(start_servers: Any) -> None:
    # (3 s: the refused RemoteVectorEnv is built within it even on a loaded machine)
    (address,) = start_servers("CartPole-v1", server_args=["--claim-timeout", "3"])
    with grpc.insecure_channel(address) as channel:
        # A bare client that claims and then says nothing (no Hold stream).
        pb_grpc.EnvServiceStub(channel).Handshake(pb.HandshakeRequest(client_name="silent"), timeout=5)
        with pytest.raises(ServerBusyError, match="silent"):
            RemoteVectorEnv([address])
        assert wait_for_claim([address], within=10) < 10


def test_get_spec_needs_no_claim(start_servers: Any) -> None:
    (address,) = start_servers("Pendulum-v1", envs_per_server=3)
    with RemoteVectorEnv([address]), grpc.insecure_channel(address) as channel:
        spec = pb_grpc.EnvServiceStub(channel).GetSpec(pb.GetSpecRequest(), timeout=5).spec
    assert spec.env_id == "Pendulum-v1" and spec.num_envs == 3 and spec.protocol_version == 1
    assert spec.max_episode_steps == 200 and spec.render_fps == 30 and "rgb_array" in spec.render_modes
    assert spec.autoreset_mode == pb.AUTORESET_MODE_NEXT_STEP and spec.vectorization == "sync"


def test_refused_calls_are_logged_at_most_every_ten_seconds(caplog: pytest.LogCaptureFixture) -> None:
    service = EnvService(ServerConfig(env="CartPole-v1"))
    try:
        for _ in range(3):
            service.status(ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "claimed by 'x'"), "Handshake")
    finally:
        service.close()
    refused = [r for r in caplog.records if r.getMessage().startswith("refused ")]
    assert [(r.levelname, r.getMessage()) for r in refused] == [
        ("WARNING", "refused Handshake [RESOURCE_EXHAUSTED]: claimed by 'x' (1 refused calls so far)")
    ]


@pytest.mark.slow
def test_a_silent_claim_ends_on_its_own_without_another_call(spawn_server: SpawnServer) -> None:
    """A learner that handshakes and goes away without a Hold stream: the server ends its claim after
    --claim-timeout by itself (metrics and log say so), not only when the next call arrives."""
    server = spawn_server("CartPole-v1", 1, "--claim-timeout", "1", "--metrics-port", "0", "--log-level", "info")
    match = re.search(r"Prometheus metrics on (http://\S+/metrics)", server.logs())
    assert match is not None, server.logs()
    url = match.group(1)
    with grpc.insecure_channel(server.address) as channel:
        session = pb_grpc.EnvServiceStub(channel).Handshake(pb.HandshakeRequest(client_name="silent"), timeout=10)
    assert session.session_id
    assert scrape(url)["envfleet_session_active"] == 1.0
    deadline = time.monotonic() + 20
    while scrape(url)["envfleet_session_active"] != 0.0:
        assert time.monotonic() < deadline, "the claim did not end within 20 s of silence"
        time.sleep(0.2)
    assert "ended: no Hold stream and no calls for 1 s" in server.logs()
    # (who, by name: over a Unix socket every peer's address is "unix:")
    assert f"session {session.session_id[:8]} of 'silent' from " in server.logs()
