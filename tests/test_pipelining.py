"""send/recv pipelining gives each env exactly what plain stepping gives; replica statistics."""

from __future__ import annotations

import asyncio
import copy
import math
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import AlreadyPendingCallError, NoAsyncCallError

from learner import InvalidRequestError, RemoteVectorEnv, SessionError
from tests.compare import assert_same
from tests.envs import DictEnv

STEPS = 300


def _join(parts: dict[int, tuple[Any, ...]], slices: list[slice], num_envs: int) -> tuple[Any, ...]:
    """One fleet-wide step result from per-group ones (observations as arrays, infos per group)."""
    obs = np.concatenate([parts[g][0] for g in range(len(slices))])
    rewards, terms, truncs = (np.concatenate([parts[g][i] for g in range(len(slices))]) for i in (1, 2, 3))
    assert len(obs) == num_envs
    return obs, rewards, terms, truncs


def test_group_slices_cover_the_fleet(start_servers: Any) -> None:
    addresses = start_servers("CartPole-v1", num_servers=3, envs_per_server=2)
    with RemoteVectorEnv(addresses, num_groups=2) as envs:
        assert envs.num_groups == 2
        assert envs.group_slices == [slice(0, 4), slice(4, 6)]  # servers {0, 1} and {2}
    with pytest.raises(ValueError, match=r"num_groups: expected at most one group per server \(3 servers\), got 4"):
        RemoteVectorEnv(addresses, num_groups=4)
    with pytest.raises(ValueError, match="num_groups: expected an int >= 1, got 0"):
        RemoteVectorEnv(addresses, num_groups=0)


@pytest.mark.parametrize("order", ["fixed", "first-done"])
def test_pipelined_equals_plain_stepping(start_servers: Any, order: str) -> None:
    plain_addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=3)
    piped_addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=3)
    with RemoteVectorEnv(plain_addresses) as plain, RemoteVectorEnv(piped_addresses, num_groups=2) as piped:
        assert_same(plain.reset(seed=11), piped.reset(seed=11))
        slices = piped.group_slices
        rng = np.random.default_rng(0)
        episodes = 0
        for _ in range(STEPS):
            actions = rng.integers(0, 2, size=6)
            want = plain.step(actions)
            for g, sl in enumerate(slices):
                piped.send(actions[sl], g)
            parts: dict[int, tuple[Any, ...]] = {}
            for g in range(len(slices)):
                group, *result = piped.recv(g if order == "fixed" else None)
                assert group not in parts
                parts[group] = tuple(result)
                assert_same(result[4], _infos_slice(want[4], slices[group]), "infos of the group")
            assert_same(_join(parts, slices, 6), tuple(want[:4]))
            episodes += int(np.sum(want[2] | want[3]))
        assert episodes >= 10, "the test should cross episode boundaries"


def _infos_slice(infos: dict[str, Any], sl: slice) -> dict[str, Any]:
    return {k: (_infos_slice(v, sl) if isinstance(v, dict) else v[sl]) for k, v in infos.items()}


def test_groups_step_independently_and_match_sync_vector_env(start_servers: Any) -> None:
    """Each group advances at its own pace; every env still sees exactly SyncVectorEnv's results."""
    addresses = start_servers("tests.envs:DictEnv", num_servers=2, envs_per_server=2)
    reference = gym.vector.SyncVectorEnv([DictEnv] * 4)
    with RemoteVectorEnv(addresses, num_groups=2) as piped:
        got_obs, _ = piped.reset(seed=3)
        want_obs, _ = reference.reset(seed=3)
        assert_same(got_obs, want_obs)
        reference.action_space.seed(1)
        batches = [reference.action_space.sample() for _ in range(40)]
        wants = [reference.step(a) for a in batches]
        # Group 0 runs all 40 steps before group 1 starts: groups do not wait for each other.
        for g, sl in enumerate(piped.group_slices):
            for t, actions in enumerate(batches):
                piped.send(actions[sl], g)
                group, obs, rewards, terms, truncs, _ = piped.recv()
                assert group == g
                assert_same(obs, {k: _slice(v, sl) for k, v in wants[t][0].items()}, f"group {g} step {t} obs")
                assert_same((rewards, terms, truncs), tuple(w[sl] for w in wants[t][1:4]), f"group {g} step {t}")
    reference.close()


def _slice(value: Any, sl: slice) -> Any:
    if isinstance(value, dict):
        return {k: _slice(v, sl) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_slice(v, sl) for v in value)
    return value[sl]


def test_send_recv_call_order_errors(start_servers: Any) -> None:
    addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=2)
    with RemoteVectorEnv(addresses, num_groups=2) as envs:
        envs.reset(seed=0)
        ones = np.ones(2, dtype=np.int64)
        with pytest.raises(NoAsyncCallError, match="no group has a step in flight"):
            envs.recv()
        with pytest.raises(NoAsyncCallError, match="group 1 has no step in flight"):
            envs.recv(1)
        envs.send(ones, 1)
        with pytest.raises(AlreadyPendingCallError, match="group 1 already has a step in flight"):
            envs.send(ones, 1)
        with pytest.raises(AlreadyPendingCallError, match=r"group\(s\) \[1\] have a step in flight"):
            envs.step(np.ones(4, dtype=np.int64))
        with pytest.raises(AlreadyPendingCallError):
            envs.reset()
        with pytest.raises(ValueError, match=r"send: group must be an int in \[0, 2\), got 2"):
            envs.send(ones, 2)
        with pytest.raises(ValueError, match=r"actions \(group 0\): expected shape \(2,\) \(2 envs of Discrete\(2\)\)"):
            envs.send(np.ones(4, dtype=np.int64), 0)
        assert envs.recv()[0] == 1
        envs.step_async(np.ones(4, dtype=np.int64))
        with pytest.raises(AlreadyPendingCallError, match="step_wait"):
            envs.send(ones, 0)
        envs.step_wait()
        # Closing with a group in flight cancels it cleanly.
        envs.send(ones, 0)


def test_bad_action_in_a_group_names_the_fleet_env(start_servers: Any) -> None:
    addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=2)
    with RemoteVectorEnv(addresses, num_groups=2) as envs:
        envs.reset(seed=0)

        with pytest.raises(InvalidRequestError, match=r"actions \(group 1\): env 3 of the fleet") as info:
            envs.send(np.array([0, 5]), 1)  # refused before sending: no server stepped
        assert info.value.env_index == 3 and info.value.address == addresses[1]
        envs.send(np.array([0, 1]), 1)
        assert envs.recv(1)[0] == 1


def test_replica_stats(start_servers: Any) -> None:
    addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=3, server_args=["--step-delay-ms", "2"])
    with RemoteVectorEnv(addresses) as envs:
        envs.reset(seed=0)
        for _ in range(20):
            envs.step(np.zeros(6, dtype=np.int64))
        stats = envs.replica_stats(reset=True)
        assert [s.address for s in stats] == envs.addresses
        for s in stats:
            assert s.num_envs == 3 and s.steps == 20
            assert 2.0 <= s.env_p50_ms <= s.env_p99_ms, "the server's env step includes the 2 ms delay"
            assert s.env_p50_ms <= s.latency_p50_ms <= s.latency_p99_ms
            assert s.env_steps_per_s > 0
            metrics = s.metrics("replicas/0/")
            assert metrics["replicas/0/steps"] == 20.0 and "replicas/0/address" not in metrics
        after = envs.replica_stats()
        assert all(s.steps == 0 and math.isnan(s.latency_p50_ms) for s in after)
        assert all(s.available for s in after)
        envs.step(np.zeros(6, dtype=np.int64))
    closed = envs.replica_stats()  # (the last window's, readable once closed: no server is available then)
    assert [s.steps for s in closed] == [1, 1] and not any(s.available for s in closed)


def test_works_from_inside_a_running_event_loop(start_servers: Any) -> None:
    """As in Jupyter, where the calling thread already runs an event loop."""
    addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=2)
    reference = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 4)

    async def main() -> None:
        with RemoteVectorEnv(addresses, num_groups=2) as envs:
            assert_same(envs.reset(seed=5), reference.reset(seed=5))
            for _ in range(30):
                actions = np.array([0, 1, 1, 0])
                want = reference.step(actions)
                assert_same(envs.step(actions), want)
            envs.send(np.array([1, 1]), 0)
            group, obs, *_ = envs.recv()
            assert group == 0 and obs.shape == (2, 4)

    asyncio.run(main())
    reference.close()


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_made_outside_a_running_event_loop_works_and_closes_inside_one(start_servers: Any, transport: str) -> None:
    """A script that makes its envs, then enters asyncio.run: steps there work (its loop is not this
    thread's to run), and a close there releases the servers, so that another learner can claim them."""
    addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=2, transport=transport)
    reference = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 4)
    envs = RemoteVectorEnv(addresses)
    assert_same(envs.reset(seed=5), reference.reset(seed=5))

    async def main() -> None:
        for _ in range(30):
            actions = np.array([1, 0, 0, 1])
            assert_same(envs.step(actions), reference.step(actions))
        envs.close()

    asyncio.run(main())
    with RemoteVectorEnv(addresses, connect_timeout=5.0) as successor:  # not ServerBusyError: released
        assert_same(successor.reset(seed=5), reference.reset(seed=5))
    reference.close()


def test_step_groups_equals_step_and_calls_act_per_group(start_servers: Any) -> None:
    plain_addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=2)
    piped_addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=2)
    with RemoteVectorEnv(plain_addresses) as plain, RemoteVectorEnv(piped_addresses, num_groups=2) as piped:
        assert_same(plain.reset(seed=2), piped.reset(seed=2))
        rng = np.random.default_rng(3)
        for _ in range(100):
            actions = rng.integers(0, 2, size=4)
            seen: list[slice] = []

            def act(sl: slice, actions: np.ndarray = actions, seen: list[slice] = seen) -> np.ndarray:
                seen.append(sl)
                return actions[sl]

            assert_same(piped.step_groups(act), plain.step(actions))
            assert seen == [slice(0, 2), slice(2, 4)]

        def broken(sl: slice) -> np.ndarray:
            if sl.start:
                raise RuntimeError("policy failed")
            return np.zeros(2, dtype=np.int64)

        with pytest.raises(RuntimeError, match="policy failed"):
            piped.step_groups(broken)
        # Group 0 stepped, its results dropped: stepping on is refused until a reset.
        with pytest.raises(SessionError, match=r"\(act raised: RuntimeError: policy failed\).*call reset\(\)"):
            piped.step(np.zeros(4, dtype=np.int64))
        piped.reset(seed=0, options={"reset_mask": np.array([True, False, True, True])})
        with pytest.raises(SessionError):  # a partial reset leaves env 1 stale
            piped.step(np.zeros(4, dtype=np.int64))
        piped.reset(seed=0, options={"reset_mask": np.ones(4, dtype=bool)})  # every env: fresh again
        piped.step(np.zeros(4, dtype=np.int64))  # nothing is left in flight

        # A group whose actions are refused: the groups before it stepped; the error names the bad env.
        def bad_second_group(sl: slice) -> np.ndarray:
            return np.array([0, 7]) if sl.start else np.zeros(2, dtype=np.int64)

        with pytest.raises(InvalidRequestError, match=r"actions \(group 1\): env 3 of the fleet"):
            piped.step_groups(bad_second_group)
        with pytest.raises(SessionError, match=r"group 1's actions were refused") as info:
            piped.step(np.zeros(4, dtype=np.int64))
        assert info.value.address == piped.addresses[-1]


def test_actions_that_cannot_be_sent_leave_nothing_in_flight(start_servers: Any) -> None:
    addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=1)
    with RemoteVectorEnv(addresses) as envs:
        envs.reset(seed=0)
        with pytest.raises(ValueError, match=r"actions: expected integers for Discrete\(2\), got dtype complex128"):
            envs.step(np.array([1, 1j]))
        envs.step(np.zeros(2, dtype=np.int64))


@pytest.mark.parametrize("mode", ["NextStep", "SameStep"])
def test_a_dict_observation_recv_returned_is_not_changed_by_later_ones(start_servers: Any, mode: str) -> None:
    """With copy=True (the default) each key's array that recv returns is the group's own: the next recv of that
    group or of the other (both written in one fleet-wide buffer per key before the copy) changes none, a final
    observation under same-step autoreset included. A camera Dict: uint8 image, float32 state, Discrete,
    MultiBinary and MultiDiscrete keys."""
    addresses = start_servers(
        "tests.envs:CameraClockEnv",
        num_servers=2,
        envs_per_server=2,
        env_kwargs={"length": 2, "multi": True},
        server_args=["--autoreset-mode", mode],
    )
    with RemoteVectorEnv(addresses, num_groups=2) as envs:
        kept: list[tuple[Any, Any]] = []
        obs, _ = envs.reset(seed=0)
        kept.append((obs, {key: value.copy() for key, value in obs.items()}))
        for g, sl in enumerate(envs.group_slices):
            envs.send(np.ones(sl.stop - sl.start, dtype=np.int64), g)
        for _ in range(8):
            group, obs, _, _, _, infos = envs.recv()
            kept.append((obs, {key: value.copy() for key, value in obs.items()}))
            for final in infos.get("final_obs", []):
                if final is not None:
                    kept.append((final, copy.deepcopy(final)))
            envs.send(np.ones(2, dtype=np.int64), group)
        envs.recv()
        envs.recv()
        assert mode == "NextStep" or len(kept) > 9  # (final observations came, and were kept)
        for i, (held, copied) in enumerate(kept):
            assert_same(held, copied, f"observation {i} kept")
