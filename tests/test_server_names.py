"""The learner's fleet lines and errors name the servers it started itself ``local-0``, ``local-1``, as their
forwarded log lines (``env_server[local-0]``), metrics.jsonl (``replicas/local-0/...``) and Prometheus do, not
by their socket's path in a temporary folder, new each session; servers started elsewhere (``--servers``) keep
their addresses."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from learner import LocalServers, RemoteVectorEnv, ServerUnavailableError
from learner.local import label_of
from tests.conftest import SpawnServer

K = 2  # envs per server
FLEET_LOGGERS = ("learner.outages", "learner.faults", "learner.remote", "learner.membership", "learner.connecting")


def fleet_lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    """The fleet's own lines (not learner.local's, which say label and address) that hold ``text``."""
    return [r.getMessage() for r in caplog.records if r.name in FLEET_LOGGERS and text in r.getMessage()]


def step_until_back(envs: RemoteVectorEnv, within: float = 30.0) -> None:
    """Step (random actions: CartPole's episodes end, and reset by themselves) until every env is available."""
    deadline = time.monotonic() + within
    seen_down = False
    while True:
        infos = envs.step(envs.action_space.sample())[4]
        down = infos.get("env_unavailable", np.zeros(envs.num_envs, dtype=bool))
        seen_down |= bool(down.any())
        if seen_down and not down.any() and envs.fault_stats().reconnects:
            return
        assert time.monotonic() < deadline, "the killed server's envs did not rejoin in time"
        time.sleep(0.05)


def test_label_of_names_a_running_local_server_by_its_label_and_any_other_by_its_address() -> None:
    """Until close(); two LocalServers at once each have a local-0: then with its address, not to be taken for the
    other's."""
    with LocalServers("CartPole-v1", 2, 1) as servers:
        addresses = list(servers.addresses)
        assert [label_of(a) for a in addresses] == ["local-0", "local-1"]
        assert label_of("localhost:50051") == "localhost:50051"
        with LocalServers("CartPole-v1", 1, 1) as other:
            (theirs,) = other.addresses
            assert label_of(theirs) == f"local-0 ({theirs})"
            assert label_of(addresses[0]) == f"local-0 ({addresses[0]})"
            assert label_of(addresses[1]) == "local-1"
        assert label_of(theirs) == theirs  # (stopped: its address may go to another server)
        assert label_of(addresses[0]) == "local-0"
    assert [label_of(a) for a in addresses] == addresses


@pytest.mark.slow
def test_a_local_server_killed_is_said_lost_and_back_by_its_label(caplog: pytest.LogCaptureFixture) -> None:
    """kill -9 of local-1 (LocalServers starts it again on its address): the fleet's lost and back lines name
    local-1, as learner.local's restart line and the server's forwarded lines do, not its socket's path."""
    caplog.set_level(logging.DEBUG, logger="learner")
    with (
        LocalServers("CartPole-v1", 2, K, transport="unix") as servers,
        RemoteVectorEnv(servers.addresses, fault_tolerant=True, timeout=10.0, backoff=(0.05, 0.5)) as envs,
    ):
        address = servers.addresses[1]
        assert address.startswith("unix:")
        envs.reset(seed=0)
        os.kill(servers.pids[1], signal.SIGKILL)
        step_until_back(envs)
    lost = fleet_lines(caplog, " lost (")
    assert lost and lost[0].startswith("env server local-1 lost ("), lost
    back = fleet_lines(caplog, " is back after ")
    assert back and back[0].startswith("env server local-1 is back after "), back
    # The learner's own lines name it so throughout (gRPC's own texts within an error may quote the path).
    named = [line for line in fleet_lines(caplog, "env server ") if line.startswith("env server ")]
    assert named and not [line for line in named if line.startswith(f"env server {address}")], named
    # ... and learner.local's restart line ties the label to the address, at WARNING as the loss is.
    restarted = [r.getMessage() for r in caplog.records if r.name == "learner.local" and r.levelno == logging.WARNING]
    assert any(line.startswith(f"env server local-1 ({address}) was killed by SIGKILL") for line in restarted)


@pytest.mark.slow
def test_servers_given_by_address_keep_their_addresses_beside_running_local_servers(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Servers this process did not start (``--servers``) are named by their addresses, as before, even
    while LocalServers of this process run."""
    caplog.set_level(logging.DEBUG, logger="learner")
    a = spawn_server("CartPole-v1", K)
    b = spawn_server("CartPole-v1", K)
    with (
        LocalServers("CartPole-v1", 1, 1),
        RemoteVectorEnv([a.address, b.address], fault_tolerant=True, timeout=10.0, backoff=(0.05, 0.5)) as envs,
    ):
        envs.reset(seed=0)
        b.kill()
        envs.step(envs.action_space.sample())  # the loss
        b.start()
        step_until_back(envs)
    lost = fleet_lines(caplog, " lost (")
    assert lost and lost[0].startswith(f"env server {b.address} lost (env server {b.address}: "), lost
    back = fleet_lines(caplog, " is back after ")
    assert back and back[0].startswith(f"env server {b.address} is back after "), back
    assert not fleet_lines(caplog, "local-"), fleet_lines(caplog, "local-")


def test_errors_name_a_local_server_by_its_label_and_keep_its_address() -> None:
    """An error about a local server says local-0 in its text; its ``address`` stays the server's address (code
    looks servers up by it)."""
    with LocalServers("CartPole-v1", 1, 1) as servers:
        (address,) = servers.addresses
        os.kill(servers.pids[0], signal.SIGSTOP)  # (listening, answering nothing)
        try:
            with pytest.raises(ServerUnavailableError) as caught:
                RemoteVectorEnv(servers.addresses, connect_timeout=1.0)
        finally:
            os.kill(servers.pids[0], signal.SIGCONT)
    assert str(caught.value).startswith("env server local-0: "), str(caught.value)
    assert caught.value.address == address


def test_the_learner_s_env_and_dropped_rollout_lines_name_a_local_server_by_its_label(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """learner.train's " (env server local-0, its env 1)" after an env's error, and "going on without env server
    local-0" for a rollout dropped (--no-fault-tolerant); an address of no local server as it is."""
    pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
    from learner.train import _env_on_server, _say_dropped

    with LocalServers("CartPole-v1", 2, 1) as servers:
        fleet = SimpleNamespace(addresses=servers.addresses, env_slices=[slice(0, 2), slice(2, 4)])
        assert _env_on_server(fleet, 3) == " (env server local-1, its env 1)"
        other = SimpleNamespace(addresses=["10.0.0.1:50051"], env_slices=[slice(0, 2)])
        assert _env_on_server(other, 1) == " (env server 10.0.0.1:50051, its env 1)"
        err = ServerUnavailableError("env server local-0: Step failed [UNAVAILABLE]", address=servers.addresses[0])
        with caplog.at_level(logging.WARNING, logger="learner.train"):
            assert _say_dropped([0.0, 0], 1, 1, err)
    assert "dropping this rollout, going on without env server local-0: env server local-0: Step failed" in (
        caplog.text
    )


@pytest.mark.slow
def test_a_learner_train_run_names_its_killed_local_server_by_its_label(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`learner train --env CartPole-v1` (no --servers: it starts its own servers on Unix sockets), one of them
    killed after the first update: the lines that say it lost and back name local-1, as the run's metrics do."""
    pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
    import learner.envs
    from learner import rundir
    from learner.config import Args
    from learner.train import train

    started: list[LocalServers] = []

    class Kept(LocalServers):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(learner.envs, "LocalServers", Kept)
    stop = threading.Event()
    deadline = time.monotonic() + 60.0
    killed: list[str] = []

    def on_update(row: dict[str, Any]) -> None:
        if not killed:
            (servers,) = started
            killed.append(servers.addresses[1])
            os.kill(servers.pids[1], signal.SIGKILL)
        elif fleet_lines(caplog, " is back after ") or time.monotonic() > deadline:
            stop.set()

    caplog.set_level(logging.DEBUG, logger="learner")
    args = Args(
        env="CartPole-v1",
        num_servers=2,
        envs_per_server=K,
        num_steps=16,
        total_timesteps=10**8,
        timeout=10.0,
        run_dir=str(tmp_path / "run"),
        progress=False,
        plot=False,
        tensorboard=False,
        checkpoint_every=0,
    )
    summary = train(args, on_update=on_update, stop=stop)
    assert summary["stop_reason"] == "stopped" and summary["failures"] >= 1, summary
    (address,) = killed
    assert address.startswith("unix:")
    lost = fleet_lines(caplog, " lost (")
    assert lost and lost[0].startswith("env server local-1 lost ("), lost
    back = fleet_lines(caplog, " is back after ")
    assert back and back[0].startswith("env server local-1 is back after "), back
    assert not [r.getMessage() for r in caplog.records if f"env server {address}" in r.getMessage()]
    rows = rundir.read_jsonl(tmp_path / "run" / rundir.METRICS)
    assert any(row.get("replicas/local-1/failures") for row in rows)  # (as metrics.jsonl names it)
