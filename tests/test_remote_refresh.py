"""refresh() of a fault-tolerant fleet whose last step failed part way: every env starts over, and
servers that are down or reconnecting are let go of, or taken back, cleanly."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from learner import RemoteVectorEnv
from learner.faults import ReplicaState
from tests.conftest import FAST, SpawnServer

K = 2  # envs per server


def _go_stale(envs: RemoteVectorEnv) -> None:
    """A step whose second group's actions could not be computed: the first group stepped unseen."""

    def act(envs_of_group: slice) -> Any:
        if envs_of_group.start:
            raise RuntimeError("the policy failed")
        return np.zeros(envs_of_group.stop - envs_of_group.start, dtype=np.int64)

    with pytest.raises(RuntimeError, match="the policy failed"):
        envs.step_groups(act)


@pytest.mark.slow
def test_a_server_down_whose_reset_fails_leaves_without_its_reconnect_task(spawn_server: SpawnServer) -> None:
    """Was: its reconnect task went on after refresh() closed its channel."""
    a = spawn_server("tests.envs:IndexEnv", K)
    b = spawn_server("tests.envs:IndexEnv", K)
    with RemoteVectorEnv([a.address, b.address], fault_tolerant=True, num_groups=2, **FAST) as envs:
        envs.reset(seed=0)
        b.kill()
        _, _, _, _, infos = envs.step(np.zeros(2 * K, dtype=np.int64))
        assert infos["_env_unavailable"].tolist() == [False] * K + [True] * K
        reconnecting = envs._replicas[1].reconnect_task
        assert reconnecting is not None and not reconnecting.done()
        _go_stale(envs)
        change = envs.refresh()  # every env starts over: B's reset fails, so B leaves
        assert change is not None and change.removed == (b.address,) and envs.addresses == [a.address]
        assert reconnecting.cancelled()
        envs.step(np.zeros(K, dtype=np.int64))
        assert envs.fault_stats().servers_left == 1


@pytest.mark.slow
def test_a_server_back_and_reset_by_refresh_steps_at_once(spawn_server: SpawnServer) -> None:
    """A server that reconnected (READY: its own reset's observations waiting to be handed over) and was
    reset again by refresh() steps from that reset (was: the next step handed over the older reset's
    observations, which its envs were no longer at)."""
    a = spawn_server("tests.envs:IndexEnv", K)
    b = spawn_server("tests.envs:IndexEnv", K)
    with RemoteVectorEnv([a.address, b.address], fault_tolerant=True, num_groups=2, **FAST) as envs:
        envs.reset(seed=0)
        b.kill()
        envs.step(np.zeros(2 * K, dtype=np.int64))  # lost
        b.start()
        deadline = time.monotonic() + 15
        while envs._replicas[1].state is not ReplicaState.READY:  # (the loop runs only within calls)
            assert time.monotonic() < deadline, "B did not reconnect"
            envs._runner.run(asyncio.sleep(0.05))
        _go_stale(envs)
        change = envs.refresh()
        assert change is not None and change.restarted == 2 * K and change.added == change.removed == ()
        assert change.observations[:, 2].tolist() == [0.0] * (2 * K)  # every env at its first step
        sent = np.arange(2 * K) + 1
        obs, _, _, _, infos = envs.step(sent)
        assert "env_unavailable" not in infos
        assert obs[:, 3].tolist() == sent.tolist() and obs[:, 2].tolist() == [1.0] * (2 * K)
