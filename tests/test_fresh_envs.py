"""env-server --fresh-envs: a new learner's session starts from envs built anew, as the server's first
session did (what the envs' wrappers keep, NormalizeObservation's statistics, does not carry over);
without it the envs go on from one session to the next, and the server says so once."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import gymnasium as gym
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from env_server.__main__ import build_parser, parse_args
from env_server.config import ServerConfig
from env_server.protocol import MAX_MESSAGE_BYTES
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from env_server.server import HUNG_EXIT_STATUS
from learner import RemoteVectorEnv
from learner.client import EnvClient
from learner.errors import EnvCrashedError
from learner.faults import Replica, reconnect
from learner.survey import describe, survey
from tests.conftest import ServerProcess, SpawnServer
from tests.fresh_envs import CLOSED, WAITING, make_normalized

FACTORY = "tests.fresh_envs:make_normalized"
REBUILT = "rebuilt in"
GO_ON = "the envs go on from the last session"
NOT_REBUILT = "not rebuilt for session"


def _session(address: str, steps: int = 30) -> np.ndarray:
    """One learner's session (a RemoteVectorEnv, closed at the end): its first reset's observations."""
    with RemoteVectorEnv([address]) as envs:
        obs, _ = envs.reset(seed=0)
        envs.action_space.seed(0)
        for _ in range(steps):
            envs.step(envs.action_space.sample())
    return np.asarray(obs)


def _fresh_sync(num_envs: int) -> np.ndarray:
    """What a fresh local SyncVectorEnv of the same factory answers to its first reset(seed=0)."""
    envs = gym.vector.SyncVectorEnv([make_normalized for _ in range(num_envs)])
    try:
        obs, _ = envs.reset(seed=0)
        return np.asarray(obs)
    finally:
        envs.close()


def test_the_flag_and_its_variable_set_fresh_envs(monkeypatch: pytest.MonkeyPatch) -> None:
    text = " ".join(build_parser().format_help().split())
    assert "--fresh-envs, --no-fresh-envs" in text and "ENVFLEET_FRESH_ENVS: on or off" in text
    assert "build them again before answering its Handshake" in text
    monkeypatch.delenv("ENVFLEET_FRESH_ENVS", raising=False)
    assert parse_args(["--env", "CartPole-v1"])[0].fresh_envs is False
    assert parse_args(["--env", "CartPole-v1", "--fresh-envs"])[0].fresh_envs is True
    monkeypatch.setenv("ENVFLEET_FRESH_ENVS", "on")
    assert parse_args(["--env", "CartPole-v1"])[0].fresh_envs is True
    assert parse_args(["--env", "CartPole-v1", "--no-fresh-envs"])[0].fresh_envs is False
    with pytest.raises(ValueError, match="fresh_envs: expected True or False, got 1"):
        ServerConfig(env="CartPole-v1", fresh_envs=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("vectorization", ["sync", pytest.param("async", marks=pytest.mark.slow)])
def test_each_new_learner_starts_from_envs_as_fresh_as_the_first(spawn_server: SpawnServer, vectorization: str) -> None:
    server = spawn_server(FACTORY, 2, "--fresh-envs", "--vectorization", vectorization)
    first = _session(server.address)
    np.testing.assert_array_equal(first, _fresh_sync(2))  # (as a fresh SyncVectorEnv of the factory starts)
    for _ in range(2):  # (a re-run notebook cell, an eval after training: the same process, a new session)
        np.testing.assert_array_equal(_session(server.address), first)
    logs = server.logs()
    assert logs.count(REBUILT) == 2 and "fresh envs for session " in logs, logs
    assert GO_ON not in logs
    # The envs built last are the ones the server closes as it stops (async: their workers too).
    assert server.kill(signal.SIGTERM) == 0
    logs = server.logs()
    assert "stopped after" in logs and "raised" not in logs
    if vectorization == "sync":  # (2 envs per build, each closed: 2 by each rebuild, 2 as the server stops)
        assert logs.partition("stopped after")[0].count(CLOSED) == 6, logs


def test_without_the_flag_the_envs_go_on_and_the_server_says_so_once(spawn_server: SpawnServer) -> None:
    server = spawn_server(FACTORY, 2)
    first = _session(server.address)
    second = _session(server.address)
    assert not np.array_equal(first, second)  # (the wrappers' statistics went on from the first session)
    _session(server.address)
    logs = server.logs()
    assert logs.count(GO_ON) == 1 and "(--fresh-envs rebuilds them for each new learner)" in logs, logs
    assert REBUILT not in logs


@pytest.mark.parametrize(
    ("kwarg", "error"),
    [
        ("fail_file", "cannot make env 'tests.fresh_envs:make_normalized': RuntimeError: simulator unavailable"),
        ("other_file", "ValueError: the envs built anew differ from those the server started with"),
    ],
    ids=["build-raises", "other-spaces"],
)
def test_a_rebuild_that_fails_fails_the_handshake_and_the_next_one_builds_again(
    spawn_server: SpawnServer, tmp_path: Path, kwarg: str, error: str
) -> None:
    broken = tmp_path / "broken"
    server = spawn_server(
        FACTORY, 2, "--fresh-envs", "--env-kwargs", f'{{"{kwarg}": "{broken}"}}', "--metrics-port", "0"
    )
    first = _session(server.address)
    broken.touch()  # (the simulator cannot start now; or the factory makes another env)
    with pytest.raises(Exception, match=r"Handshake failed \[INTERNAL\]") as info:
        _session(server.address)
    message = str(info.value)
    assert "could not build its envs anew for a new session (--fresh-envs)" in message
    assert error in message and "try again" in message
    assert server.proc is not None and server.proc.poll() is None  # (it serves on)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        assert stub.GetSpec(pb.GetSpecRequest(), timeout=30).spec.num_envs == 2
        with pytest.raises(grpc.RpcError) as again:  # (each Handshake tries the build again)
            stub.Handshake(pb.HandshakeRequest(client_name="other"), timeout=30)
        assert again.value.code() == grpc.StatusCode.INTERNAL and error in str(again.value.details())
        # No envs serve: not ready, and the survey says why, not "free"; health stays SERVING (the
        # Handshake that builds them again must reach it).
        note = stub.GetSpec(pb.GetSpecRequest(), timeout=30).note
        assert note.startswith("no envs: the server could not build its envs anew") and error in note, note
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    text = describe(survey(server.address, timeout=30))
    assert "free (no learner holds it)" not in text and "    no envs: the server could not build" in text, text
    samples = _scrape(server.logs())
    assert samples["envfleet_ready"] == 0, samples
    assert samples["envfleet_env_rebuilds_total{outcome=failed}"] == 2, samples
    broken.unlink()
    np.testing.assert_array_equal(_session(server.address), first)  # (built, fresh)
    logs = server.logs()
    assert logs.count("rebuild failed after") == 2 and logs.count(REBUILT) == 1, logs
    samples = _scrape(logs)
    assert samples["envfleet_ready"] == 1 and samples["envfleet_env_rebuilds_total{outcome=ok}"] == 1, samples
    assert "free (no learner holds it)" in describe(survey(server.address, timeout=30))
    assert server.kill(signal.SIGTERM) == 0


def _scrape(logs: str) -> dict[str, float]:
    """The server's metrics now (its log says where), by name and labels ("name{label=value}")."""
    match = re.search(r"Prometheus metrics on (http://\S+/metrics)", logs)
    assert match is not None, logs
    with urllib.request.urlopen(match.group(1), timeout=30) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


def _wait_unclaimed(stub: pb_grpc.EnvServiceStub) -> None:
    """Until the server's claim has ended (its learner's Hold stream gone: at once; else its claim timeout)."""
    deadline = time.monotonic() + 90
    while stub.GetSpec(pb.GetSpecRequest(), timeout=30).claimed_by:
        assert time.monotonic() < deadline, "the claim did not end"
        time.sleep(0.05)


def _lose_session(stub: pb_grpc.EnvServiceStub, client_name: str, rejoins: str = "") -> str:
    """A session of ``client_name`` (that says it ``rejoins`` that session) that runs the envs (a reset), then is
    lost (its Hold stream ends, no Release): its id."""
    request = pb.HandshakeRequest(client_name=client_name, rejoins_session_id=rejoins)
    session: str = stub.Handshake(request, timeout=60).session_id
    hold = stub.Hold(pb.HoldRequest(session_id=session))
    stub.Reset(pb.ResetRequest(session_id=session), timeout=30)
    hold.cancel()
    _wait_unclaimed(stub)
    return session


def test_a_learner_rejoining_its_last_session_keeps_its_envs(spawn_server: SpawnServer) -> None:
    server: ServerProcess = spawn_server(FACTORY, 1, "--fresh-envs")
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        first = _lose_session(stub, "learner-A")
        second = _lose_session(stub, "learner-A", rejoins=first)  # (a learner back after a network cut)
        assert NOT_REBUILT in server.logs() and REBUILT not in server.logs()
        assert f"rejoins its last session {first[:8]} (ended: hold_ended)" in server.logs()
        _lose_session(stub, "learner-A")  # (its name alone says nothing: a new learner of the same process)
        assert server.logs().count(REBUILT) == 1
        _lose_session(stub, "learner-A", rejoins=second)  # (not the last session: others ran the envs since)
    logs = server.logs()
    assert logs.count(REBUILT) == 2 and logs.count(NOT_REBUILT) == 1, logs


@pytest.mark.slow
def test_a_rejoin_whose_handshake_answer_was_lost_can_rejoin_again(spawn_server: SpawnServer) -> None:
    """A rejoining learner's Handshake whose answer does not reach it (here: 32 MB, over its 4 MiB receive limit, so
    that the server is still sending it when the client gives up) ends that session "unanswered": no client knew
    it, so the session the learner's retry names is still the last one, and its envs go on."""
    server = spawn_server("tests.envs:WideActionEnv", 1, "--fresh-envs", "--env-kwargs", '{"width": 2000000}')
    large = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    with grpc.insecure_channel(server.address, options=large) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        lost = _lose_session(stub, "learner-A")
        with grpc.insecure_channel(server.address) as small:
            with pytest.raises(grpc.RpcError) as info:
                request = pb.HandshakeRequest(client_name="learner-A", rejoins_session_id=lost)
                pb_grpc.EnvServiceStub(small).Handshake(request, timeout=60)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        deadline = time.monotonic() + 90
        while "did not reach the client" not in server.logs():
            assert time.monotonic() < deadline, server.logs()
            time.sleep(0.05)
        _wait_unclaimed(stub)
        _lose_session(stub, "learner-A", rejoins=lost)
    logs = server.logs()
    assert logs.count(f"rejoins its last session {lost[:8]}") == 2 and REBUILT not in logs, logs


def test_a_reconnect_that_releases_its_old_session_keeps_the_envs(spawn_server: SpawnServer) -> None:
    """learner.faults.reconnect on the same server process releases the session it lost (after a network cut the
    server may still hold it: here its Hold stream is open on another connection), then claims the envs again:
    they go on, NormalizeObservation's statistics included, though that session ended "released"."""
    server = spawn_server(FACTORY, 1, "--fresh-envs")
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        lost = stub.Handshake(pb.HandshakeRequest(client_name="learner-A"), timeout=60)
        hold = stub.Hold(pb.HoldRequest(session_id=lost.session_id))
        stub.Reset(pb.ResetRequest(session_id=lost.session_id), timeout=30)

        async def rejoin() -> None:
            client = EnvClient(server.address, timeout=30, client_name="learner-A")
            replica = Replica(client=client, spec=lost.spec, sessions=[lost.session_id])
            try:
                await reconnect(replica, timeout=30, connect_timeout=60, backoff=(0.05, 1.0), on_ready=lambda: None)
                assert client.session_id and client.session_id != lost.session_id
                await client.release()
            finally:
                await client.close()

        asyncio.run(rejoin())
        hold.cancel()
    logs = server.logs()
    assert f"rejoins its last session {lost.session_id[:8]} (ended: released)" in logs, logs
    assert REBUILT not in logs


def test_a_new_remote_vector_env_of_the_same_process_gets_fresh_envs(spawn_server: SpawnServer) -> None:
    """A notebook's new RemoteVectorEnv (the same default client name, host:pid) after the one before it was lost
    unclosed (its Hold stream ended) is a new learner: its envs are built anew."""
    server = spawn_server(FACTORY, 1, "--fresh-envs")
    with grpc.insecure_channel(server.address) as channel:
        _lose_session(pb_grpc.EnvServiceStub(channel), f"{socket.gethostname()}:{os.getpid()}")
    np.testing.assert_array_equal(_session(server.address), _fresh_sync(1))
    logs = server.logs()
    assert logs.count(REBUILT) == 1 and NOT_REBUILT not in logs, logs


def test_a_server_whose_async_workers_ended_builds_nothing_anew(spawn_server: SpawnServer) -> None:
    """Its envs are gone for good (health NOT_SERVING: restart it): a new learner is told so, not handed envs
    built anew behind a health status that says the server cannot serve."""
    server = spawn_server("tests.misbehaving_envs:StepExits", 2, "--vectorization", "async", "--fresh-envs")
    with RemoteVectorEnv([server.address], fault_tolerant=False) as envs:
        envs.reset(seed=0)
        for _ in range(2):
            with contextlib.suppress(EnvCrashedError):
                envs.step(np.zeros(2, dtype=np.int64))
    with (
        RemoteVectorEnv([server.address], fault_tolerant=False) as envs,
        pytest.raises(EnvCrashedError, match=r"worker processes ended .*restart it"),
    ):
        envs.reset(seed=0)
    assert REBUILT not in server.logs(), server.logs()


@pytest.mark.slow
def test_hang_timeout_exits_a_server_whose_rebuild_hangs(spawn_server: SpawnServer, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    server = spawn_server(
        FACTORY, 1, "--fresh-envs", "--hang-timeout", "2", "--env-kwargs", f'{{"gate_file": "{gate}"}}'
    )
    _session(server.address)
    gate.touch()  # (the rebuild hangs: its build waits at the gate for good)
    try:
        with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError):
            pb_grpc.EnvServiceStub(channel).Handshake(pb.HandshakeRequest(client_name="learner-B"), timeout=90)
        assert server.proc is not None
        assert server.proc.wait(timeout=60) == HUNG_EXIT_STATUS, server.logs()
    finally:
        gate.unlink()
    logs = server.logs()
    assert WAITING in logs and "the envs' rebuild has run for" in logs and "longer than --hang-timeout 2 s" in logs, (
        logs
    )


def test_other_handshakes_are_told_to_try_again_while_the_envs_are_built_anew(
    spawn_server: SpawnServer, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"
    server = spawn_server(FACTORY, 2, "--fresh-envs", "--env-kwargs", f'{{"gate_file": "{gate}"}}')
    first = _session(server.address)
    gate.touch()  # (the next build waits until the test lets it go on)
    results: list[np.ndarray] = []
    learner = threading.Thread(target=lambda: results.append(_session(server.address)))
    learner.start()
    try:
        deadline = time.monotonic() + 60
        while WAITING not in server.logs():
            assert time.monotonic() < deadline and learner.is_alive(), server.logs()
            time.sleep(0.02)
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.EnvServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.Handshake(pb.HandshakeRequest(client_name="learner-B"), timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "envs are being built anew (--fresh-envs) for session " in str(info.value.details())
            assert stub.GetSpec(pb.GetSpecRequest(), timeout=30).spec.num_envs == 2  # (answered meanwhile)
    finally:
        gate.unlink()
        learner.join(timeout=60)
    assert len(results) == 1, server.logs()
    np.testing.assert_array_equal(results[0], first)
    assert server.logs().count(REBUILT) == 1
