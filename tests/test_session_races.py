"""Calls that overlap (of one session, or of a session and its successor's), and answers that never reach
their client: what each call may still do once it has the envs, and what the next step is told.

Real servers on port 0, driven with raw gRPC stubs (a learner would not send such calls at once)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from env_server import codec
from env_server.protocol import ENV_INDEX_KEY, NOT_OWNED
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from tests.conftest import StartServers

ENV = "tests.session_envs:SessionEnv"


@contextlib.contextmanager
def _stub(address: str) -> Iterator[pb_grpc.EnvServiceStub]:
    with grpc.insecure_channel(address) as channel:
        yield pb_grpc.EnvServiceStub(channel)


def _claim(stub: pb_grpc.EnvServiceStub, name: str) -> str:
    return str(stub.Handshake(pb.HandshakeRequest(client_name=name), timeout=10).session_id)


def _reset(stub: pb_grpc.EnvServiceStub, session_id: str, *, timeout: float = 30, **fields: Any) -> pb.ResetResponse:
    return stub.Reset(pb.ResetRequest(session_id=session_id, **fields), timeout=timeout)


def _step(
    stub: pb_grpc.EnvServiceStub, session_id: str, num_envs: int = 1, *, step_id: int = 0, timeout: float = 30
) -> pb.StepResponse:
    actions = pb.Value()
    codec.encode_value(np.zeros(num_envs, dtype=np.int64), actions, "actions")
    return stub.Step(pb.StepRequest(session_id=session_id, actions=actions, step_id=step_id), timeout=timeout)


def _infos(response: pb.ResetResponse | pb.StepResponse) -> dict[str, Any]:
    infos = codec.decode_value(response.infos, "infos")
    assert isinstance(infos, dict)
    return infos


def _refusal(call: Callable[[], object]) -> grpc.RpcError:
    """The error ``call`` raises (a test failure if it succeeds)."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _failure(future: Future[Any]) -> grpc.RpcError:
    """The error the call of ``future`` raised (a test failure if it succeeded)."""
    return _refusal(future.result)


def _wait_for(gate: Path) -> None:
    """Until the env has come to ``gate`` (see tests.envs.GateEnv)."""
    deadline = time.monotonic() + 30
    while not gate.exists():
        assert time.monotonic() < deadline, "the env did not come to its gate within 30 s"
        time.sleep(0.01)


@contextlib.contextmanager
def _pool(gate: Path) -> Iterator[ThreadPoolExecutor]:
    """Threads for calls that wait (each test's calls end once ``gate`` is open: opened on leaving, before
    they are waited for, should a test fail with the gate closed)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        try:
            yield pool
        finally:
            gate.unlink(missing_ok=True)


def test_a_reset_that_waited_while_its_session_ended_does_not_reset_the_next_learner_s_envs(
    start_servers: StartServers, tmp_path: Path
) -> None:
    """A's Reset (a seed, an option that stays with the env) waits for the envs behind A's step; A
    releases, and B claims: A's Reset must not run on B's envs once it gets them, and A is told so
    (was: it ran, and A was answered OK; B's next reset, unseeded, came from A's seed and level)."""
    gate = tmp_path / "gate"
    (address,) = start_servers(ENV, env_kwargs={"gate": str(gate), "gate_at": 1}, transport="tcp")
    with _stub(address) as a, _stub(address) as b, _pool(gate) as pool:
        session_a = _claim(a, "A")
        _reset(a, session_a)
        step = pool.submit(_step, a, session_a)
        _wait_for(gate)  # (A's step holds the envs)
        options = pb.Value()
        codec.encode_value({"level": np.int64(7)}, options, "options")
        reset = pool.submit(_reset, a, session_a, seeds=[pb.Seed(value=42)], options=options)
        time.sleep(1.5)  # (A's Reset reaches the server, and waits for the envs: given time on a loaded machine)
        a.Release(pb.ReleaseRequest(session_id=session_a), timeout=5)
        session_b = _claim(b, "B")
        gate.unlink()
        step.exception()  # (A's step ran: it had the envs before A released them)
        error = _failure(reset)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
        assert NOT_OWNED in str(error.details()), error.details()
        assert "(it ended while this reset waited for the envs: released); nothing was reset" in str(error.details())
        assert _infos(_reset(b, session_b))["level"].tolist() == [0]  # (A's option never reached the env)


@pytest.mark.parametrize("method", ["Step", "Reset"])
def test_a_call_whose_answer_cannot_be_built_asks_for_a_reset(start_servers: StartServers, method: str) -> None:
    """The envs stepped (reset), but their infos are over what the codec takes: the call fails
    (INTERNAL), and the session's next step is refused until a full reset, as after an answer too
    large to send (was: taken, from where the learner never saw the envs)."""
    kwargs = {"big_info_step": 2} if method == "Step" else {"big_info_reset": 2}
    (address,) = start_servers(ENV, env_kwargs=kwargs, transport="tcp")
    with _stub(address) as stub:
        session = _claim(stub, "learner")
        _reset(stub, session)
        _step(stub, session)
        error = _refusal(lambda: _step(stub, session) if method == "Step" else _reset(stub, session))
        assert error.code() == grpc.StatusCode.INTERNAL, error.details()
        assert "the env returned an info value that cannot be sent" in str(error.details()), error.details()
        error = _refusal(lambda: _step(stub, session))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
        assert f"for an earlier {method} whose answer could not be built" in str(error.details()), error.details()
        _reset(stub, session)  # (a full reset, and the session steps again)
        _step(stub, session)


@pytest.mark.slow
def test_a_reset_whose_caller_gave_up_asks_for_a_reset(start_servers: StartServers) -> None:
    """A Reset (of env 0 alone) whose deadline passes while the env thread runs it: the env was reset,
    and the client never saw it, so the next step is refused until a full reset, as after a step whose
    caller gave up (was: taken, env 0 stepped from an observation the client never saw)."""
    (address,) = start_servers(
        ENV, envs_per_server=2, env_kwargs={"reset_s": 0.6, "slow_resets_from": 2}, transport="tcp"
    )
    with _stub(address) as stub:
        session = _claim(stub, "learner")
        _reset(stub, session)
        _step(stub, session, 2)
        error = _refusal(lambda: _reset(stub, session, reset_mask=[True, False], timeout=0.2))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error.details()
        error = _refusal(lambda: _step(stub, session, 2))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
        assert "for an earlier Reset whose caller gave up on it" in str(error.details()), error.details()
        _reset(stub, session)
        _step(stub, session, 2)


@pytest.mark.slow
def test_a_claim_does_not_time_out_while_its_call_runs(start_servers: StartServers, tmp_path: Path) -> None:
    """A client without a Hold stream whose reset takes longer than the claim timeout keeps its claim:
    a call under way is no silence, and silence counts from its end (was: the claim ended mid-call,
    "no calls for 1 s", and another learner was given the envs)."""
    gate = tmp_path / "gate"
    (address,) = start_servers(
        ENV,
        env_kwargs={"gate": str(gate), "gate_on": "reset", "gate_at": 1},
        server_args=["--claim-timeout", "1"],
        transport="tcp",
    )
    with _stub(address) as a, _stub(address) as b, _pool(gate) as pool:
        session = _claim(a, "A")
        reset = pool.submit(_reset, a, session)
        _wait_for(gate)
        time.sleep(1.8)  # (past the claim timeout, and the server's check of it, every 0.5 s)
        error = _refusal(lambda: _claim(b, "B"))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        assert "claimed by 'A'" in str(error.details()), error.details()
        assert "(a call of its is under way: silence counts from its end)" in str(error.details())
        gate.unlink()
        reset.result()
        _step(a, session)  # (at once: its silence counts from the reset's end)


def test_overlapping_steps_under_autoreset_disabled_are_refused_before_gymnasium(
    start_servers: StartServers, tmp_path: Path
) -> None:
    """Autoreset Disabled: a step sent while the last one (which ends the episode) runs is refused
    once it has the envs, FAILED_PRECONDITION naming the env, nothing stepped (was: gymnasium's
    AssertionError, INTERNAL, blamed on the env, and the session had to reset every env)."""
    gate = tmp_path / "gate"
    (address,) = start_servers(
        ENV,
        env_kwargs={"length": 3, "step_s": 0.02, "gate": str(gate), "gate_at": 3},
        server_args=["--autoreset-mode", "Disabled"],
        transport="tcp",
    )
    with _stub(address) as stub, _pool(gate) as pool:
        session = _claim(stub, "learner")
        _reset(stub, session)
        _step(stub, session)
        _step(stub, session)  # (each on the env thread: they take 20 ms)
        last = pool.submit(_step, stub, session, step_id=3)
        _wait_for(gate)
        overlapping = pool.submit(_step, stub, session, step_id=4)
        time.sleep(0.3)  # (it reaches the server, and waits for the envs)
        gate.unlink()
        truncations = codec.decode_value(pb.Value(tensor=last.result().truncations), "truncations")
        assert truncations.tolist() == [True]
        error = _failure(overlapping)
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
        assert "autoreset is Disabled on this server and env 0 of it ended" in str(error.details()), error.details()
        assert dict(error.trailing_metadata() or ()).get(ENV_INDEX_KEY) == "0"
        _reset(stub, session, reset_mask=[True])  # (that env's reset is enough: no full one asked for)
        _step(stub, session)


def test_the_step_after_one_that_failed_the_envs_says_why_they_need_a_reset(start_servers: StartServers) -> None:
    """A step that failed the whole vector env (an observation it cannot stack): the next step is told
    that, not "Step called before Reset" (the client did reset)."""
    (address,) = start_servers(ENV, envs_per_server=2, env_kwargs={"bad_obs_step": 2}, transport="tcp")
    with _stub(address) as stub:
        session = _claim(stub, "learner")
        _reset(stub, session)
        _step(stub, session, 2)
        error = _refusal(lambda: _step(stub, session, 2))
        assert error.code() == grpc.StatusCode.INTERNAL, error.details()
        error = _refusal(lambda: _step(stub, session, 2))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
        assert "the env raised in the last step (ObservationLayoutError)" in str(error.details()), error.details()
        _reset(stub, session)
        _step(stub, session, 2)


@pytest.mark.slow
def test_a_cancelled_step_of_an_ended_session_is_not_told_to_the_next(
    start_servers: StartServers, tmp_path: Path
) -> None:
    """A's step runs on the env thread; A releases, B claims, and A's step passes its deadline: B is
    told what its Handshake asked (a reset first), not of A's step (was: "the envs stepped for an
    earlier Step whose caller gave up on it", which B never sent)."""
    gate = tmp_path / "gate"
    (address,) = start_servers(ENV, env_kwargs={"gate": str(gate), "gate_at": 1}, transport="tcp")
    with _stub(address) as a, _stub(address) as b, _pool(gate) as pool:
        session_a = _claim(a, "A")
        _reset(a, session_a)
        step = pool.submit(_step, a, session_a, timeout=1.0)
        _wait_for(gate)
        a.Release(pb.ReleaseRequest(session_id=session_a), timeout=5)
        session_b = _claim(b, "B")
        assert _failure(step).code() == grpc.StatusCode.DEADLINE_EXCEEDED
        time.sleep(0.3)  # (the server ends that call too)
        gate.unlink()
        error = _refusal(lambda: _step(b, session_b))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
        assert error.details() == "Step called before Reset: reset the envs first"
        error = _refusal(lambda: _reset(b, session_b, reset_mask=[True]))
        assert error.details() == "reset_mask: reset every env once before resetting some", error.details()
