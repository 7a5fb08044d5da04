"""Bad input gets a clear error naming what was wrong, and the server keeps serving."""

from __future__ import annotations

import os
import re
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import grpc
import gymnasium as gym
import numpy as np
import pytest
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError, ResetNeeded

from env_server.protocol import FRAME_ERROR, FRAME_HEADER, FRAME_STEP, STEP_SOCKET_SUFFIX
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from env_server.validation import InvalidActionError, check_actions
from learner import (
    EnvCrashedError,
    InvalidRequestError,
    LocalServers,
    RemoteVectorEnv,
    ServerUnavailableError,
    SessionError,
)
from learner.local import label_of
from tests.conftest import SpawnServer
from tests.envs import ClockEnv


@pytest.fixture(scope="module")
def cartpole_servers() -> Iterator[list[str]]:
    """2 CartPole servers of 3 envs each, for the module: each test's learner claims them afresh and resets them."""
    with LocalServers("CartPole-v1", num_servers=2, envs_per_server=3) as servers:
        yield servers.addresses


@pytest.fixture
def cartpole(cartpole_servers: list[str]) -> Iterator[RemoteVectorEnv]:
    with RemoteVectorEnv(cartpole_servers) as envs:
        envs.reset(seed=0)
        yield envs


def test_action_outside_space_names_the_env_and_space(cartpole: RemoteVectorEnv) -> None:
    actions = np.zeros(6, dtype=np.int64)
    actions[4] = 2  # env 4 lives on the second server, as its env 1
    with pytest.raises(InvalidRequestError) as info:
        cartpole.step(actions)
    err = info.value
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.env_index == 4
    assert "env 4 of the fleet" in str(err) and "action 2 is outside the action space Discrete(2)" in str(err), str(err)
    assert err.address == cartpole.addresses[1]
    # Nothing was lost: the whole batch was checked before sending, so no server stepped on it, and
    # the next step is the first one, as for local envs with the same seeds.
    obs, *_ = cartpole.step(np.ones(6, dtype=np.int64))
    local = gym.make_vec("CartPole-v1", num_envs=6, vectorization_mode="sync")
    local.reset(seed=0)
    np.testing.assert_array_equal(obs, local.step(np.ones(6, dtype=np.int64))[0])


def test_action_of_wrong_dtype(cartpole: RemoteVectorEnv) -> None:
    with pytest.raises(ValueError, match=r"actions: expected integers for Discrete\(2\), got dtype float32"):
        cartpole.step(np.zeros(6, dtype=np.float32))
    # Not bools either, as a local env's Discrete space (SyncVectorEnv's envs assert it)
    with pytest.raises(ValueError, match=r"actions: expected integers for Discrete\(2\), got dtype bool"):
        cartpole.step(np.zeros(6, dtype=np.bool_))
    cartpole.step(np.zeros(6, dtype=np.int32))


def test_batch_of_wrong_length_is_refused_before_sending(cartpole: RemoteVectorEnv) -> None:
    with pytest.raises(
        ValueError, match=r"actions: expected shape \(6,\) \(6 envs of Discrete\(2\)\), got shape \(5,\)"
    ):
        cartpole.step(np.zeros(5, dtype=np.int64))
    with pytest.raises(
        ValueError,
        match=r"actions: expected shape \(6,\) \(6 envs of Discrete\(2\)\), got shape \(6, 1\)",
    ):
        cartpole.step(np.zeros((6, 1), dtype=np.int64))
    cartpole.step(np.zeros(6, dtype=np.int64))


def test_seeds_of_the_wrong_kind_or_count(cartpole: RemoteVectorEnv) -> None:
    with pytest.raises(ValueError, match=r"seed: expected an int or 6 seeds \(one per env\), got 'a'"):
        cartpole.reset(seed="a")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"seed: expected an int or 6 seeds \(one per env\), got 2 seeds"):
        cartpole.reset(seed=[1, 2])
    # (env i gets seed + i, which must fit the wire's 64 bits: named, not protobuf's "Value out of range")
    with pytest.raises(ValueError, match=r"seed: expected an int in \[0, 2\*\*64 - 6\] .*got 18446744073709551614"):
        cartpole.reset(seed=2**64 - 2)
    cartpole.reset(seed=[None, 1, 2, 3, 4, 5])


def test_box_actions_of_wrong_shape_nan_or_out_of_bounds(start_servers: Any) -> None:
    with RemoteVectorEnv(start_servers("Pendulum-v1", num_servers=2, envs_per_server=2)) as envs:
        envs.reset(seed=0)
        with pytest.raises(
            ValueError, match=r"actions: expected shape \(4, 1\) \(4 envs of Box.*\), got shape \(4, 2\)"
        ):
            envs.step(np.zeros((4, 2), dtype=np.float32))  # the fleet's shape, checked before sending
        bad = np.zeros((4, 1), dtype=np.float32)
        bad[3] = np.nan
        with pytest.raises(InvalidRequestError, match=r"env 3 of the fleet.*NaN"):
            envs.step(bad)
        bad[3] = 2.5
        with pytest.raises(InvalidRequestError, match=r"env 3 of the fleet.*outside the action space Box\(-2.0, 2.0"):
            envs.step(bad)
        # float64 actions for a float32 Box are fine (as for a local env).
        envs.step(np.full((4, 1), 0.5, dtype=np.float64))
        # A bound missed by rounding (gymnasium's RescaleAction, float64 math on float32 bounds) is the bound.
        rounded = np.full((4, 1), 2.0 + 1e-7)
        rounded[1] = -2.0 - 1e-7
        local = gym.make_vec("Pendulum-v1", num_envs=4, vectorization_mode="sync")
        envs.step(rounded)  # not refused
        np.testing.assert_array_equal(envs.reset(seed=1)[0], local.reset(seed=1)[0])
        np.testing.assert_allclose(envs.step(rounded)[0], local.step(np.clip(rounded, -2, 2))[0], rtol=1e-6)
        local.close()
    # Integers do not round: an int Box's bound is exact.
    from env_server.validation import check_actions

    space = gym.spaces.Box(0, 1_000_000, (1,), dtype=np.int64)
    assert check_actions(space, np.array([[1_000_000]]), 1).tolist() == [[1_000_000]]
    with pytest.raises(ValueError, match="outside the action space"):
        check_actions(space, np.array([[1_000_001]]), 1)


def test_float16_box_actions_get_the_rounding_allowance_and_bool_boxes_refuse_floats() -> None:
    """Actions within 1e-6 of a bound are rounding, clipped, in a float16 Box too (the allowance is below
    float16's precision: computed in its dtype, it was none); a bool Box refuses floats, as gymnasium's
    Box.contains does and as an integer Box does (it took 0.5 as True)."""
    half = gym.spaces.Box(-1.0, 1.0, (1,), np.float16)
    assert check_actions(half, np.array([[1.0000001], [-1.0000001]]), 2).tolist() == [[1.0], [-1.0]]
    with pytest.raises(InvalidActionError, match=r"env 0: action \[1\.01\] is outside the action space"):
        check_actions(half, np.array([[1.01]]), 1)
    flags = gym.spaces.Box(0, 1, (2,), cast(Any, np.bool_))
    with pytest.raises(InvalidActionError, match=r"expected integers \(bool\) for Box\(.*\), got dtype float64"):
        check_actions(flags, np.array([[0.5, 0.1]]), 1)
    assert check_actions(flags, np.array([[0, 1]]), 1).tolist() == [[False, True]]


@pytest.mark.parametrize(
    ("space", "actions"),
    [
        (gym.spaces.MultiDiscrete(np.array([[2, 3], [4, 5]])), np.full((1, 2, 2), 9)),
        (gym.spaces.Box(-1, 1, (20,), np.float32), np.full((1, 20), 2.0, dtype=np.float32)),
    ],
    ids=["2-d space", "20 bounds"],
)
def test_a_refusal_is_one_line_however_numpy_prints_the_space(space: gym.Space[Any], actions: np.ndarray) -> None:
    """The server logs each refused call as one line: numpy prints a 2-d space, and bounds past 75
    characters, over several."""
    with pytest.raises(InvalidActionError, match="is outside the action space") as refused:
        check_actions(space, actions, 1)
    assert "\n" not in str(refused.value)


def test_step_before_reset_is_refused_before_sending_as_gymnasiums_vector_envs_do(start_servers: Any) -> None:
    """ResetNeededError: a SessionError (FAILED_PRECONDITION, what the servers would answer) and
    gymnasium's ResetNeeded (what SyncVectorEnv and AsyncVectorEnv raise), from every way to step."""
    addresses = start_servers("CartPole-v1", num_servers=2, envs_per_server=1)
    with RemoteVectorEnv(addresses, num_groups=2) as envs:
        steps = {
            "step": lambda: envs.step(np.zeros(2, dtype=np.int64)),
            "step_async": lambda: envs.step_async(np.zeros(2, dtype=np.int64)),
            "step_groups": lambda: envs.step_groups(lambda sl: np.zeros(sl.stop - sl.start, dtype=np.int64)),
            "send": lambda: envs.send(np.zeros(1, dtype=np.int64), 0),
        }
        for method, call in steps.items():
            with pytest.raises(
                ResetNeeded, match=rf"^{method}: called before reset\(\); call reset\(\) first$"
            ) as info:
                call()
            assert isinstance(info.value, SessionError) and info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        envs.reset()
        envs.step(np.zeros(2, dtype=np.int64))


def test_every_servers_error_reaches_the_caller_the_first_raised_the_others_as_its_notes(start_servers: Any) -> None:
    kwargs = {"bad_reward_at": 1, "fault_env": -1}  # (a reward that is no number fails each server's vector env)
    addresses = start_servers("tests.envs:FaultyEnv", num_servers=2, envs_per_server=1, env_kwargs=kwargs)
    with RemoteVectorEnv(addresses) as envs:
        envs.reset(seed=0)
        first, second = map(label_of, addresses)  # (local-0 and local-1, with their addresses beside another's)
        with pytest.raises(EnvCrashedError, match=f"env server {re.escape(first)}: Step failed") as info:
            envs.step(np.zeros(2, dtype=np.int64))
        assert len(info.value.__notes__) == 1
        assert info.value.__notes__[0].startswith(f"also: env server {second}: Step failed [INTERNAL]: ")


def test_a_reset_that_outlives_its_session_is_no_reset_for_the_next_session(start_servers: Any, tmp_path: Path) -> None:
    """A learner that goes away while its reset runs: the next learner's Handshake asks for a reset
    of its own, which the old reset, finishing under the new claim, must not stand in for."""
    gate = tmp_path / "gate"
    (address,) = start_servers("tests.envs:ResetGateEnv", 1, 1, env_kwargs={"gate": str(gate)})
    step = pb.StepRequest()
    step.actions.tensor.dtype = pb.DTYPE_INT64
    step.actions.tensor.shape[:] = [1]
    step.actions.tensor.data = np.zeros(1, dtype="<i8").tobytes()
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        first = stub.Handshake(pb.HandshakeRequest(client_name="A"), timeout=10).session_id
        hold = stub.Hold(pb.HoldRequest(session_id=first))
        reset = stub.Reset.future(pb.ResetRequest(session_id=first), timeout=60)
        _wait_until(gate.exists, "the first session's reset to reach the gate")
        hold.cancel()  # the first learner goes away: its session ends, its reset runs on
        second = ""

        def handshake() -> bool:
            nonlocal second
            try:
                second = stub.Handshake(pb.HandshakeRequest(client_name="B"), timeout=10).session_id
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
                return False
            return True

        _wait_until(handshake, "the first session to end")
        gate.unlink()
        reset.result()  # (it ran: its answer says what it did)
        step.session_id = second
        with pytest.raises(grpc.RpcError) as info:
            stub.Step(step, timeout=10)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "Step called before Reset" in str(info.value.details())
        stub.Reset(pb.ResetRequest(session_id=second), timeout=10)
        stub.Step(step, timeout=10)


def _wait_until(condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what}"
        time.sleep(0.02)


def test_stepping_an_ended_env_under_disabled_autoreset_is_refused_and_loses_nothing(start_servers: Any) -> None:
    """Not gymnasium's bare AssertionError, and no full reset needed: the server refuses the step
    before it reaches the envs, names those that wait for a reset, and a masked reset goes on."""
    disabled = ["--autoreset-mode", "Disabled"]
    addresses = start_servers("tests.envs:ClockEnv", 1, 3, env_kwargs={"length": 2}, server_args=disabled)
    local = gym.vector.SyncVectorEnv([lambda: ClockEnv(length=2)] * 3, autoreset_mode=gym.vector.AutoresetMode.DISABLED)
    act = np.zeros(3, dtype=np.int64)
    with RemoteVectorEnv(addresses) as envs:
        for vec in (envs, local):
            vec.reset(seed=0)
            vec.step(act)
            assert vec.step(act)[3].tolist() == [True, True, True]
        with pytest.raises(
            SessionError, match=r"step: autoreset is Disabled and envs 0, 1, 2 ended at their last step"
        ) as info:
            envs.step(act)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION and "nothing was sent" in str(info.value)
        mask = np.array([True, False, True])
        for vec in (envs, local):
            vec.reset(options={"reset_mask": mask})
        with pytest.raises(SessionError, match=r"and env 1 ended at its last step: reset it first"):
            envs.step(act)
        for vec in (envs, local):
            vec.reset(options={"reset_mask": ~mask})
        for _ in range(2):
            got, want = envs.step(act), local.step(act)
            for g, w in zip(got[:4], want[:4], strict=True):
                np.testing.assert_array_equal(g, w)
    local.close()
    # The server refuses such a step too (a client of its own), before it reaches gymnasium's assertion.
    with grpc.insecure_channel(addresses[0]) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        session = stub.Handshake(pb.HandshakeRequest(), timeout=5).session_id
        stub.Reset(pb.ResetRequest(session_id=session), timeout=5)
        step = pb.StepRequest(session_id=session)
        step.actions.tensor.dtype = pb.DTYPE_INT64
        step.actions.tensor.shape[:] = [3]
        step.actions.tensor.data = act.astype("<i8").tobytes()
        stub.Step(step, timeout=5)
        stub.Step(step, timeout=5)
        with pytest.raises(grpc.RpcError) as raw:
            stub.Step(step, timeout=5)
        assert raw.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "autoreset is Disabled on this server and envs 0, 1, 2 of it ended" in str(raw.value.details())
        stub.Reset(pb.ResetRequest(session_id=session, reset_mask=[True, True, True]), timeout=5)
        stub.Step(step, timeout=5)


def test_async_call_order_errors(cartpole: RemoteVectorEnv) -> None:
    with pytest.raises(NoAsyncCallError):
        cartpole.step_wait()
    cartpole.step_async(np.zeros(6, dtype=np.int64))
    with pytest.raises(AlreadyPendingCallError):
        cartpole.step_async(np.zeros(6, dtype=np.int64))
    with pytest.raises(AlreadyPendingCallError):
        cartpole.reset()
    cartpole.step_wait()
    cartpole.close()
    with pytest.raises(ClosedEnvironmentError):
        cartpole.step(np.zeros(6, dtype=np.int64))
    cartpole.close()  # closing twice is fine


@pytest.mark.slow
def test_nothing_listening_fails_within_the_default_bound() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(ServerUnavailableError) as info:
        RemoteVectorEnv([f"127.0.0.1:{port}"])
    elapsed = time.monotonic() - start
    assert f"127.0.0.1:{port}" in str(info.value)
    assert info.value.address == f"127.0.0.1:{port}"
    assert elapsed < 12, f"took {elapsed:.1f} s"


def test_malformed_raw_requests_are_invalid_argument(start_servers: Any) -> None:
    """Requests no well-behaved client sends still get INVALID_ARGUMENT, and the server lives on."""
    (address,) = start_servers("CartPole-v1", envs_per_server=2)
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        session = stub.Handshake(pb.HandshakeRequest(), timeout=5).session_id
        stub.Reset(pb.ResetRequest(session_id=session), timeout=5)
        bad_requests = [
            pb.StepRequest(session_id=session),  # no actions at all
            pb.StepRequest(
                session_id=session, actions=pb.Value(tensor=pb.Tensor(dtype=pb.DTYPE_INT64, shape=[2], data=b"\0"))
            ),
            pb.StepRequest(
                session_id=session,
                actions=pb.Value(tensor=pb.Tensor(dtype=cast(pb.DType, 99), shape=[2], data=b"\0" * 16)),
            ),
            pb.StepRequest(
                session_id=session, actions=pb.Value(tensor=pb.Tensor(dtype=pb.DTYPE_INT64, shape=[-2], data=b""))
            ),
            pb.StepRequest(session_id=session, actions=pb.Value(text="left")),
        ]
        for request in bad_requests:
            with pytest.raises(grpc.RpcError) as info:
                stub.Step(request, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.Reset(pb.ResetRequest(session_id=session, seeds=[pb.Seed(value=1)]), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "seeds: expected 2" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            stub.Step(pb.StepRequest(session_id="not-mine"), timeout=5)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        ok = pb.StepRequest(session_id=session)
        ok.actions.tensor.dtype = pb.DTYPE_INT64
        ok.actions.tensor.shape[:] = [2]
        ok.actions.tensor.data = np.zeros(2, dtype="<i8").tobytes()
        assert len(stub.Step(ok, timeout=5).rewards.data) == 16


# -- what the server logs of refused calls ------------------------------------------------------------


def _refusals(logs: str) -> list[str]:
    return [line.split(": ", 1)[1] for line in logs.splitlines() if " env_server.service: refused " in line]


def test_refused_calls_are_logged_per_kind_with_the_caller(spawn_server: SpawnServer) -> None:
    """One line per (method, status code) per 10 s: a flood of one kind hides no other kind. Each
    line names the peer and, where known, the client (its Handshake's name, or its session's)."""
    server = spawn_server("CartPole-v1", 2, "--log-level", "info")
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        session = stub.Handshake(pb.HandshakeRequest(client_name="first"), timeout=5).session_id
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as info:
                stub.Handshake(pb.HandshakeRequest(client_name="second"), timeout=5)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as info:
            stub.Step(pb.StepRequest(session_id=session), timeout=5)  # before any Reset
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    deadline = time.monotonic() + 5
    while len(lines := _refusals(server.logs())) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(lines) == 2, server.logs()
    busy, early = lines
    assert busy.startswith("refused Handshake from ipv4:127.0.0.1:") and "('second') [RESOURCE_EXHAUSTED]: " in busy
    assert "claimed by 'first'" in busy and busy.endswith("(1 refused calls so far)"), busy
    assert early.startswith("refused Step from ipv4:127.0.0.1:") and "('first') [FAILED_PRECONDITION]: " in early
    assert early.endswith("(4 refused calls so far)"), early


def test_a_refusal_line_says_how_many_of_its_kind_were_left_out(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from env_server import interceptors
    from env_server.config import ServerConfig
    from env_server.service import EnvService, ServiceError

    now = [1000.0]
    monkeypatch.setattr(interceptors, "time", SimpleNamespace(monotonic=lambda: now[0]))
    service = EnvService(ServerConfig(env="CartPole-v1"))
    busy = ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "claimed")
    try:
        for _ in range(3):
            service.status(busy, "Handshake", peer="ipv4:10.0.0.9:5000", client_name="b")
        now[0] += 10
        service.status(busy, "Handshake", peer="ipv4:10.0.0.9:5001")
    finally:
        service.close()
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused ")] == [
        "refused Handshake from ipv4:10.0.0.9:5000 ('b') [RESOURCE_EXHAUSTED]: claimed (1 refused calls so far)",
        "refused Handshake from ipv4:10.0.0.9:5001 [RESOURCE_EXHAUSTED]: claimed (4 refused calls so far, "
        "2 more like it not logged since the last such line)",
    ]


def test_a_step_socket_refusal_names_the_connected_process(spawn_server: SpawnServer) -> None:
    with tempfile.TemporaryDirectory(prefix="ef-") as folder:  # (short: Unix socket paths are)
        server = spawn_server("CartPole-v1", 1, "--unix-socket", f"{folder}/env.sock", "--log-level", "info")
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(10)
            sock.connect(f"{folder}/env.sock{STEP_SOCKET_SUFFIX}")
            payload = pb.StepRequest(session_id="not-a-session").SerializeToString()
            sock.sendall(FRAME_HEADER.pack(len(payload), FRAME_STEP) + payload)
            _, kind = FRAME_HEADER.unpack(sock.recv(FRAME_HEADER.size, socket.MSG_WAITALL))
        assert kind == FRAME_ERROR
        deadline = time.monotonic() + 5
        while not (lines := _refusals(server.logs())) and time.monotonic() < deadline:
            time.sleep(0.05)
        server.stop()
    assert len(lines) == 1 and lines[0].startswith(
        f"refused StepStream from pid {os.getpid()} on the step socket [FAILED_PRECONDITION]: "
    ), lines


def test_of_several_envs_with_bad_actions_the_first_is_named() -> None:
    """A batch with bad actions for envs 1 and 3 names env 1, the first (not the last)."""
    with pytest.raises(InvalidActionError, match=r"^actions: env 1: action 5 is outside") as info:
        check_actions(gym.spaces.Discrete(2), np.array([0, 5, 1, 7]), 4)
    assert info.value.env_index == 1


@pytest.mark.parametrize(
    ("space", "inside", "outside"),
    [
        (gym.spaces.Discrete(3, start=-1), [-1, 1], [-2, 2]),
        (gym.spaces.MultiDiscrete([3], start=[5]), [[5], [7]], [[4], [8]]),
    ],
    ids=["Discrete", "MultiDiscrete"],
)
def test_integer_actions_are_bounded_from_the_spaces_start(
    space: gym.Space[Any], inside: list[Any], outside: list[Any]
) -> None:
    """An integer space with a start takes start ... start + n - 1: a MultiDiscrete's upper bound taken
    as nvec - 1 refused every action of MultiDiscrete([3], start=[5])."""
    assert check_actions(space, np.array(inside), len(inside)).tolist() == inside
    for bad in outside:
        with pytest.raises(InvalidActionError, match="is outside the action space"):
            check_actions(space, np.array([bad]), 1)


def test_a_dict_action_with_a_key_its_space_lacks_is_refused() -> None:
    """A Dict action must have the space's keys exactly: one more is refused, not dropped."""
    space = gym.spaces.Dict({"a": gym.spaces.Discrete(2)})
    with pytest.raises(InvalidActionError, match=r"expected keys \['a'\], got"):
        check_actions(space, {"a": np.array([0]), "b": np.array([0])}, 1)


def test_a_seed_of_none_among_a_resets_seeds_leaves_that_env_unseeded(start_servers: Any) -> None:
    """``reset(seed=[None, 1])`` leaves env 0 unseeded, as gymnasium's vector envs do: the server took the
    None for 0, and env 0 started where a seed of 0 puts it."""
    with RemoteVectorEnv(start_servers("CartPole-v1", envs_per_server=2)) as envs:
        seeded, _ = envs.reset(seed=[0, 1])
        unseeded, _ = envs.reset(seed=[None, 1])
        assert not np.array_equal(unseeded[0], seeded[0])
        np.testing.assert_array_equal(unseeded[1], seeded[1])
