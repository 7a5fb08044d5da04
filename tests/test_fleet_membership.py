"""A fleet whose membership changes while some of it is down or failing: give_up_after once the last
healthy server leaves, servers whose reset fails as they join, envs whose reset raises as they join."""

from __future__ import annotations

import itertools
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
from learner import EnvCrashedError, RemoteVectorEnv, ServerUnavailableError
from learner.config import Args
from learner.discovery import register_resolver
from learner.train import train
from tests.conftest import FAST, SpawnServer, fleet


@pytest.mark.slow
def test_give_up_after_counts_from_when_the_last_server_up_left_not_from_an_older_loss(
    spawn_server: SpawnServer,
) -> None:
    """A is lost for good while B carries the fleet for longer than give_up_after; then B leaves it
    (scaled down, replaced): every server has been down only since then (was: the next step raised at
    once, saying all had been unavailable for more than give_up_after, counted from A's loss)."""
    give_up = 3.0
    a = spawn_server("tests.envs:ClockEnv", 2)
    b = spawn_server("tests.envs:ClockEnv", 2)
    name, listed = fleet(a.address, b.address)
    with RemoteVectorEnv(name, fault_tolerant=True, give_up_after=give_up, **FAST) as envs:
        envs.reset(seed=0)
        a.kill()
        carried_until = time.monotonic() + give_up + 0.5
        while time.monotonic() < carried_until:
            envs.step(np.zeros(envs.num_envs, dtype=np.int64))
            time.sleep(0.05)
        assert envs.fault_stats().servers_down == 1
        listed.remove(b.address)
        change = envs.refresh()
        assert change is not None and change.removed == (b.address,) and envs.addresses == [a.address]
        left = time.monotonic()
        with pytest.raises(ServerUnavailableError, match=r"all unavailable .* for more than 3 s") as raised:
            for _ in range(20):  # (each step waits up to 1 s for a server to come back)
                envs.step(np.zeros(envs.num_envs, dtype=np.int64))
        waited = time.monotonic() - left
        assert give_up - 0.1 <= waited < give_up + 1.5, (waited, str(raised.value))  # (was: ~1 s)


@pytest.mark.slow
def test_a_server_whose_reset_fails_as_it_joins_is_tried_again_after_a_while_and_warned_of_once(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A listed server that takes its handshake but misses its reset deadline each time: refresh() is no
    change (None), and the server is tried again on the join backoff's schedule (1 s, doubling), not at
    every refresh (was: each refresh waited out the reset deadline and returned a FleetChange with nothing
    added or removed, warning twice each time)."""
    a = spawn_server("tests.envs:ClockEnv", 2)
    slow = spawn_server("tests.envs:SlowResetEnv", 2, "--env-kwargs", '{"slow_from": 1, "sleep_s": 2.0}')
    name, listed = fleet(a.address)
    with RemoteVectorEnv(name, fault_tolerant=True, reset_timeout=0.5, **FAST) as envs:
        envs.reset(seed=0)
        listed.append(slow.address)
        caplog.clear()
        changes = []
        until = time.monotonic() + 5.0
        with caplog.at_level(logging.DEBUG, logger="learner.remote"):
            while time.monotonic() < until:
                changes.append(envs.refresh())
                envs.step(np.zeros(envs.num_envs, dtype=np.int64))
                time.sleep(0.05)
        assert changes and all(change is None for change in changes), changes
        assert envs.num_envs == 2 and envs.addresses == [a.address]
        # Tried at 0 s, ~1.5 s (1 s after the first try ended) and ~4 s (2 s after the second), each said.
        warned = [r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("learner")]
        said = [r for r in caplog.records if "does not join: its reset failed" in r.getMessage()]
        tries = len(said)
        assert 2 <= tries <= 4, tries
        assert [r.levelno for r in said] == [logging.WARNING] + [logging.DEBUG] * (tries - 1)
        assert len(warned) == 2, [r.getMessage() for r in warned]  # that one, and its other env's, once
        assert "serves another env than the rest" in warned[0].getMessage()
        assert envs.fault_stats().servers_joined == 0


@pytest.mark.parametrize("fault_tolerant", [True, False])
def test_an_env_whose_reset_raises_as_its_server_joins_is_flagged_as_at_the_start(
    spawn_server: SpawnServer, fault_tolerant: bool
) -> None:
    """A joining server whose env 0 raises in its reset: refresh()'s infos mark that env unavailable and
    count its error, as reset() does at the start (was: env_error alone, uncounted)."""
    a = spawn_server("tests.envs:FaultyEnv", 2)
    b = spawn_server("tests.envs:FaultyEnv", 2, "--env-kwargs", '{"raise_in_reset": 0}')
    name, listed = fleet(a.address)
    with RemoteVectorEnv(name, fault_tolerant=fault_tolerant, **FAST) as envs:
        envs.reset(seed=0)
        listed.append(b.address)
        change = envs.refresh()
        assert change is not None and change.added == (b.address,)
        assert change.infos["_env_unavailable"].tolist() == [False, False, True, False]
        assert change.infos["env_unavailable"].tolist() == [False, False, True, False]
        assert "reset failed on purpose (env 0)" in change.infos["env_error"][2]
        assert envs.fault_stats().env_errors == 1
        if fault_tolerant:
            _, _, _, _, infos = envs.step(np.zeros(4, dtype=np.int64))
            assert infos["_env_unavailable"].tolist() == [False, False, True, False]
        else:  # (the change is handed over; the env's first step raises, as any env error does)
            with pytest.raises(EnvCrashedError, match=r"env 2 is out of order since reset"):
                envs.step(np.zeros(4, dtype=np.int64))


_LOOK_UPS: dict[str, Any] = {}


def _look_up(name: str) -> list[str]:
    schedule, calls = _LOOK_UPS[name]
    return list(schedule(next(calls)))


register_resolver("testfleet-membership", _look_up)


@pytest.mark.slow
def test_train_starts_an_env_whose_reset_raised_as_it_joined_with_no_episode_under_way(
    spawn_server: SpawnServer, tmp_path: Path
) -> None:
    """Training: an env out of order as its server joins (its reset raised) has no episode under way, as
    at the first reset, so its unavailable steps cut none (was: its first step counted as an episode cut)."""
    a = spawn_server("tests.envs:FaultyEnv", 2)
    b = spawn_server("tests.envs:FaultyEnv", 2, "--env-kwargs", '{"raise_in_reset": 0}')
    _LOOK_UPS["joins"] = (lambda k: [a.address] if k <= 2 else [a.address, b.address], itertools.count(1))
    summary = train(
        Args(
            env="tests.envs:FaultyEnv",
            servers="testfleet-membership:joins",
            num_steps=8,
            total_timesteps=8 * 2 + 8 * 4 * 2,
            run_dir=str(tmp_path / "run"),
            progress=False,
            plot=False,
            tensorboard=False,
            checkpoint_every=0,
        )
    )
    assert summary["stop_reason"] == "total_timesteps" and summary["servers_joined"] == 1
    assert summary["env_steps_lost"] == 16  # env 2's steps, every one of the two rollouts since it joined
    assert summary["episodes_cut"] == 0


@pytest.mark.slow
def test_train_counts_the_episodes_of_a_server_that_left_the_fleet_as_cut(
    spawn_server: SpawnServer, tmp_path: Path
) -> None:
    """A server taken off the list between rollouts takes its envs' episodes under way with it: cut short, as
    those of a server lost in a step are (they were counted nowhere)."""
    a = spawn_server("tests.envs:FaultyEnv", 2, "--env-kwargs", '{"length": 10000}')
    b = spawn_server("tests.envs:FaultyEnv", 2, "--env-kwargs", '{"length": 10000}')
    _LOOK_UPS["leaves"] = (lambda k: [a.address, b.address] if k <= 2 else [a.address], itertools.count(1))
    summary = train(
        Args(
            env="tests.envs:FaultyEnv",
            servers="testfleet-membership:leaves",
            num_steps=8,
            total_timesteps=8 * 4 * 2 + 8 * 2 * 2,
            run_dir=str(tmp_path / "run"),
            progress=False,
            plot=False,
            tensorboard=False,
            checkpoint_every=0,
        )
    )
    assert summary["stop_reason"] == "total_timesteps" and summary["servers_left"] == 1, summary
    assert summary["episodes_cut"] == 2 and summary["env_steps_lost"] == 0, summary
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(row["episodes_cut"] for row in rows)[-2:] == [0, 2], rows  # (in the row after it left)
