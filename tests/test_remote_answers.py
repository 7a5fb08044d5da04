"""A server whose answer cannot be read, or whose infos do not fit the fleet's batch, is an
InvalidResponseError naming it: raised by a plain fleet (the fleet then needs a reset, as after any
failed step), and a lost server for a fault-tolerant one (was: a raw CodecError or ValueError, with
no address, that ended a fault-tolerant run)."""

from __future__ import annotations

import re
import time
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

from env_server import codec
from env_server.rpc import env_pb2 as pb
from learner import InvalidResponseError, RemoteEnvError, RemoteVectorEnv, SessionError, remote
from learner.errors import RemoteTimeoutError
from learner.faults import Replica, is_outage
from learner.local import label_of
from tests.conftest import FAST, SpawnServer, StartServers

K = 2  # envs per server


def _unavailable(infos: dict[str, Any], n: int) -> list[bool]:
    return np.asarray(infos.get("_env_unavailable", np.zeros(n, dtype=bool))).tolist()


def test_an_unreadable_answer_is_an_outage_once_in_a_row() -> None:
    assert is_outage(InvalidResponseError("env server a:1: Step: its answer could not be read", address="a:1"))
    replica = Replica(client=None, spec=pb.EnvSpec())  # type: ignore[arg-type]  # (its counts alone)
    unreadable = InvalidResponseError("env server a:1: Step: its answer could not be read", address="a:1")
    assert not replica.broken_by(unreadable)
    assert not replica.broken_by(RemoteTimeoutError("env server a:1: Step: no answer", address="a:1"))
    assert replica.broken_by(unreadable)  # (no step answered since the first: the timeout between is none)
    replica.note_answer()
    assert not replica.broken_by(unreadable)  # a step answered between: a one-off again


@pytest.mark.slow
def test_infos_that_do_not_fit_name_the_server(spawn_server: SpawnServer) -> None:
    a = spawn_server("tests.envs:InfoWidthEnv", K, "--env-kwargs", '{"width": 2}')
    b = spawn_server("tests.envs:InfoWidthEnv", K, "--env-kwargs", '{"width": 3}')
    with RemoteVectorEnv([a.address, b.address], timeout=5.0) as envs:
        envs.reset(seed=0)
        with pytest.raises(InvalidResponseError, match=rf"^env server {b.address}: Step: its infos do not fit") as info:
            envs.step(np.zeros(2 * K, dtype=np.int64))
        assert info.value.address == b.address and "infos['v']: shapes per env differ" in str(info.value)
        with pytest.raises(SessionError, match="call reset"):  # (A's envs stepped, unseen)
            envs.step(np.zeros(2 * K, dtype=np.int64))

    # Fault-tolerant: B is lost on that step (its episodes cut), A steps on.
    with RemoteVectorEnv([a.address, b.address], fault_tolerant=True, **FAST) as envs:
        envs.reset(seed=0)
        obs, rewards, terms, truncs, infos = envs.step(np.zeros(2 * K, dtype=np.int64))
        assert _unavailable(infos, 2 * K) == [False] * K + [True] * K
        assert truncs.tolist() == [False] * K + [True] * K and not terms.any()
        assert rewards.tolist() == [1.0] * K + [0.0] * K
        assert obs[:, 0].tolist() == [1.0] * K + [0.0] * K  # B's envs: their last observations
        assert infos["v"].shape == (2 * K, 2) and infos["_v"].tolist() == [True] * K + [False] * K
        stats = envs.fault_stats()
        assert (stats.failures, stats.servers_down) == (1, 1)
        obs, *_ = envs.step(np.zeros(2 * K, dtype=np.int64))
        assert obs[:K, 0].tolist() == [2.0] * K


@pytest.mark.parametrize("transport", ["tcp", "unix"])  # (StepStream; the step socket)
@pytest.mark.slow
def test_an_answer_that_cannot_be_decoded_names_the_server(
    start_servers: StartServers, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    addresses = [start_servers("tests.envs:IndexEnv", envs_per_server=K, transport=transport)[0] for _ in range(2)]
    decode, corrupt = codec.decode_value, {"token": -1.0}

    def decode_value(value: Any, where: str = "value") -> Any:
        """B's observations (found by its token) come out as what a server of another version might send."""
        out = decode(value, where)
        if where == "observations" and np.asarray(out)[0, 0] == corrupt["token"]:
            raise codec.CodecError("observations: a dtype this learner does not know (a test's)")
        return out

    monkeypatch.setattr(codec, "decode_value", decode_value)
    with RemoteVectorEnv(addresses, timeout=5.0) as envs:
        assert all(bool(c.step_socket) == (transport == "unix") for c in envs._clients)
        obs, _ = envs.reset(seed=0)
        corrupt["token"] = obs[K, 0]
        with pytest.raises(
            InvalidResponseError, match=rf"^env server {re.escape(label_of(addresses[1]))}: Step: its answer could not"
        ) as info:
            envs.step(np.arange(2 * K))
        assert isinstance(info.value, RemoteEnvError) and info.value.address == addresses[1]
        assert isinstance(info.value.__cause__, codec.CodecError)
        corrupt["token"] = -1.0

    with RemoteVectorEnv(addresses, fault_tolerant=True, **FAST) as envs:
        obs, _ = envs.reset(seed=0)
        before, corrupt["token"] = obs.copy(), obs[K, 0]
        sent = np.arange(2 * K) + 10
        obs, rewards, _, truncs, infos = envs.step(sent)
        assert _unavailable(infos, 2 * K) == [False] * K + [True] * K
        assert truncs.tolist() == [False] * K + [True] * K and rewards[K:].tolist() == [0.0] * K
        assert obs[:K, 3].tolist() == sent[:K].tolist()  # A's envs got their actions
        assert np.array_equal(obs[K:], before[K:])  # B's keep their last observations
        # One answer that cannot be read is an outage: readable again, B's envs rejoin. (Unreadable again
        # right after it came back, B would be broken: tests/test_wire_faults.py.)
        corrupt["token"] = -1.0
        deadline = time.monotonic() + 15
        while "env_unavailable" in infos:
            assert time.monotonic() < deadline, "B's envs did not rejoin"
            _, _, _, _, infos = envs.step(np.zeros(2 * K, dtype=np.int64))
            time.sleep(0.02)
        assert envs.fault_stats().failures == 1 and envs.fault_stats().reconnects == 1


def test_a_fault_of_the_learners_own_while_taking_an_answer_in_is_no_servers(
    start_servers: StartServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only an answer that cannot be read costs its server: an error of the learner's own code as it takes a
    readable answer in is raised as it is, fault-tolerant too (no server counted lost, no bug hidden)."""
    addresses = start_servers("CartPole-v1", 2, K)

    def broken(*args: Any) -> None:
        raise ZeroDivisionError("a bug of the learner's (a test's)")

    with RemoteVectorEnv(addresses, fault_tolerant=True, **FAST) as envs:
        envs.reset(seed=0)
        monkeypatch.setattr(envs._timers[1], "record", broken)
        with pytest.raises(ZeroDivisionError, match="a bug of the learner's"):
            envs.step(np.zeros(2 * K, dtype=np.int64))
        assert envs.fault_stats().failures == 0


def test_a_server_down_already_is_not_lost_again_for_its_placeholder_infos(
    start_servers: StartServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same-step autoreset: B's answer cannot be read (lost, its episodes cut: their infos made up
    here, object ``final_obs``), while A's ``final_obs`` infos come as stacked arrays. The made-up
    infos do not fit A's: left out, B is not lost a second time (was: two failures counted, a second
    reconnect started)."""
    addresses = [
        start_servers("tests.envs:IndexEnv", envs_per_server=K, server_args=("--autoreset-mode", "SameStep"))[0]
        for _ in range(2)
    ]
    decode, corrupt = codec.decode_value, {"token": -1.0}

    def decode_value(value: Any, where: str = "value") -> Any:
        out = decode(value, where)
        if where == "observations" and np.asarray(out)[0, 0] == corrupt["token"]:
            raise codec.CodecError("observations: a dtype this learner does not know (a test's)")
        return out

    infos_of = remote.response_infos

    def stacked_final_obs(response: Any) -> dict[str, Any]:
        infos = infos_of(response)
        infos["final_obs"], infos["_final_obs"] = np.zeros((K, 3)), np.ones(K, dtype=bool)
        return infos

    monkeypatch.setattr(codec, "decode_value", decode_value)
    monkeypatch.setattr(remote, "response_infos", stacked_final_obs)
    with RemoteVectorEnv(addresses, fault_tolerant=True, **FAST) as envs:
        assert envs.metadata["autoreset_mode"] is gym.vector.AutoresetMode.SAME_STEP
        obs, _ = envs.reset(seed=0)
        corrupt["token"] = obs[K, 0]
        _, _, _, truncs, infos = envs.step(np.zeros(2 * K, dtype=np.int64))
        assert truncs.tolist() == [False] * K + [True] * K
        assert _unavailable(infos, 2 * K) == [False] * K + [True] * K
        assert infos["final_obs"].shape == (2 * K, 3) and infos["_final_obs"].tolist() == [True] * K + [False] * K
        stats = envs.fault_stats()
        assert (stats.failures, stats.servers_down) == (1, 1)
        assert envs._replicas[1].failures == 1


def test_an_answer_with_flags_for_another_number_of_envs_names_the_flag(
    start_servers: StartServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rewards, terminations and truncations are checked together (one comparison per step); one of the
    wrong shape is named, whichever it is."""
    address = start_servers("tests.envs:IndexEnv", envs_per_server=K)[0]
    decode, wrong = codec.decode_tensor, {"name": ""}

    def decode_tensor(tensor: Any, where: str = "tensor", **kwargs: Any) -> np.ndarray:
        out = decode(tensor, where, **kwargs)
        return np.concatenate([out, out[:1]]) if where == wrong["name"] else out

    monkeypatch.setattr(codec, "decode_tensor", decode_tensor)
    with RemoteVectorEnv([address], timeout=5.0) as envs:
        for name in ("truncations", "rewards"):
            envs.reset(seed=0)
            wrong["name"] = name
            message = (
                rf"^env server {re.escape(label_of(address))}: Step: its answer could not be read.*{name}: expected "
                rf"shape \({K},\)"
            )
            with pytest.raises(InvalidResponseError, match=message):
                envs.step(np.zeros(K, dtype=np.int64))
            wrong["name"] = ""
