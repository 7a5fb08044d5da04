"""StepStream, the fast path: in-order answers, errors end the stream with Step's status; unary Step still works."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest

from env_server import codec
from env_server.protocol import ENV_INDEX_KEY, ERROR_ORIGIN_KEY, ERROR_ORIGIN_SERVER
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from learner import InvalidRequestError, RemoteVectorEnv
from learner.client import EnvClient
from learner.errors import RemoteEnvError
from tests.compare import assert_same


@pytest.fixture
def session(start_servers: Any) -> Any:
    (address,) = start_servers("CartPole-v1", num_servers=1, envs_per_server=3)
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        session_id = stub.Handshake(pb.HandshakeRequest(client_name="test"), timeout=10).session_id
        stub.Reset(pb.ResetRequest(session_id=session_id, seeds=[pb.Seed(value=i) for i in range(3)]), timeout=10)
        yield stub, session_id


def step_request(session_id: str, actions: list[int]) -> pb.StepRequest:
    request = pb.StepRequest(session_id=session_id)
    codec.encode_value(np.array(actions, dtype=np.int64), request.actions, "actions")
    return request


def test_stream_answers_each_request_in_order_like_unary_step(start_servers: Any) -> None:
    a, b = start_servers("CartPole-v1", num_servers=2, envs_per_server=3)
    results = []
    for address, streamed in ((a, True), (b, False)):
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.EnvServiceStub(channel)
            session_id = stub.Handshake(pb.HandshakeRequest(), timeout=10).session_id
            stub.Reset(pb.ResetRequest(session_id=session_id, seeds=[pb.Seed(value=i) for i in range(3)]), timeout=10)
            requests = [step_request(session_id, [t % 2, 1, 0]) for t in range(50)]
            if streamed:
                responses = list(stub.StepStream(iter(requests), timeout=30))
            else:
                responses = [stub.Step(r, timeout=10) for r in requests]
            assert len(responses) == 50
            assert all(r.env_seconds > 0 for r in responses)
            results.append([codec.decode_value(r.observations) for r in responses])
    assert_same(results[0], results[1])


def test_bad_action_ends_the_stream_with_invalid_argument_and_the_env_index(session: Any) -> None:
    stub, session_id = session
    requests = [
        step_request(session_id, [0, 1, 0]),
        step_request(session_id, [0, 0, 7]),
        step_request(session_id, [0] * 3),
    ]
    call = stub.StepStream(iter(requests), timeout=30)
    first = next(call)
    assert codec.decode_value(first.observations).shape == (3, 4)
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "env 2" in err.details() and "Discrete(2)" in err.details()
    assert (ENV_INDEX_KEY, "2") in tuple(err.trailing_metadata())
    # The server keeps serving: a new stream steps on.
    assert len(list(stub.StepStream(iter([step_request(session_id, [1, 1, 1])]), timeout=30))) == 1


def test_stream_without_a_session_is_refused(session: Any) -> None:
    stub, _ = session
    with pytest.raises(grpc.RpcError) as info:
        list(stub.StepStream(iter([step_request("not-a-session", [0, 0, 0])]), timeout=10))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.slow
def test_slow_env_steps_off_the_event_loop(start_servers: Any) -> None:
    """Steps slower than the inline limit run on the env thread: the server answers others meanwhile,
    the first step too (a call's duration is unknown until it ran once: it runs on the env thread)."""
    (address,) = start_servers("CartPole-v1", num_servers=1, envs_per_server=1, server_args=["--step-delay-ms", "1500"])
    with RemoteVectorEnv([address]) as envs, grpc.insecure_channel(address) as channel:
        stub = pb_grpc.EnvServiceStub(channel)
        stub.GetSpec(pb.GetSpecRequest(), timeout=5)
        envs.reset(seed=0)
        for _ in range(2):  # the first step, then one the server knows to be slow
            waited: list[float] = []

            def get_spec(waited: list[float] = waited) -> None:
                time.sleep(0.1)  # the step is in the env by now
                start = time.monotonic()
                stub.GetSpec(pb.GetSpecRequest(), timeout=5)
                waited.append(time.monotonic() - start)

            asker = threading.Thread(target=get_spec)
            asker.start()
            envs.step(np.zeros(1, dtype=np.int64))
            asker.join()
            # (behind the step it would wait ~1.4 s; the margin is for a loaded machine's stalls)
            assert waited[0] < 0.8, f"GetSpec waited {waited[0]:.2f} s for the step"


def test_vector_entry_point_server_takes_the_first_seed(start_servers: Any) -> None:
    addresses = start_servers(
        "CartPole-v1", num_servers=2, envs_per_server=4, server_args=["--vectorization", "vector_entry_point"]
    )
    with RemoteVectorEnv(addresses[:1]) as a, RemoteVectorEnv(addresses[1:]) as b:
        assert_same(a.reset(seed=7)[0], b.reset(seed=7)[0])
        for _ in range(20):
            assert_same(a.step(np.ones(4, dtype=np.int64))[0], b.step(np.ones(4, dtype=np.int64))[0])
        # Resetting some of its envs alone is refused: CartPole's vectorized implementation would reset all.
        with pytest.raises(InvalidRequestError, match=r"reset_mask: this server steps the env's own vectorized"):
            a.reset(options={"reset_mask": np.array([True, False, False, False])})
        a.reset(options={"reset_mask": np.ones(4, dtype=np.bool_)})  # (all of them: fine)


@pytest.mark.slow
def test_reset_timeout_gives_resets_longer_than_steps(start_servers: Any) -> None:
    """An env that takes 1.5 s to reset: with timeout=0.5 alone its reset misses the deadline, saying
    which option to raise; with reset_timeout=10 it resets, and so does the step of its autoreset,
    while other steps keep the 0.5 s deadline."""
    from learner import RemoteTimeoutError

    (slow,) = start_servers("tests.envs:SlowResetEnv", env_kwargs={"slow_from": 1, "sleep_s": 1.5})
    late = r"within the 0.5 s deadline .*raise `reset_timeout` if the env is slow to reset"
    with RemoteVectorEnv([slow], timeout=0.5) as envs, pytest.raises(RemoteTimeoutError, match=late):
        envs.reset(seed=0)
    with RemoteVectorEnv([slow], timeout=0.5, reset_timeout=10.0) as envs:
        assert envs.reset_timeout == 10.0
        envs.reset(seed=0)
        # Its 3-step episode ends at step 3; step 4 is its autoreset (next-step): that step, and only
        # that one, gets the reset deadline.
        truncated = [bool(envs.step(np.zeros(1, dtype=np.int64))[3][0]) for _ in range(4)]
        assert truncated == [False, False, True, False]
        assert envs._step_timeout(0, 1) == 0.5  # (the next step resets nothing: the step deadline)


@pytest.mark.slow
def test_a_step_past_the_timeout_raises_remote_timeout_error_naming_the_server(start_servers: Any) -> None:
    from learner import RemoteTimeoutError

    slow, fast = start_servers("CartPole-v1", num_servers=2, envs_per_server=1, server_args=["--step-delay-ms", "2500"])
    with RemoteVectorEnv([slow, fast], timeout=1.0) as envs:  # (the fast server's step: 1 s even on a loaded host)
        envs.reset(seed=0)
        with pytest.raises(RemoteTimeoutError, match=r"no answer within the 1 s deadline") as info:
            envs.step(np.zeros(2, dtype=np.int64))
        assert info.value.address == slow
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


class _CrashingStepStream(pb_grpc.EnvServiceServicer):
    """Every StepStream reads one step and ends with the INTERNAL an env server sends for a crashed env."""

    def __init__(self) -> None:
        self.opened = 0

    async def StepStream(self, requests: Any, context: grpc.aio.ServicerContext) -> None:
        self.opened += 1
        if await context.read() is grpc.aio.EOF:
            return
        context.set_code(grpc.StatusCode.INTERNAL)
        context.set_details("step failed: ValueError: env bug; reset before stepping again")
        context.set_trailing_metadata(((ERROR_ORIGIN_KEY, ERROR_ORIGIN_SERVER), (ENV_INDEX_KEY, "0")))


def test_an_env_error_on_a_new_stream_is_reported_at_once_without_probing_the_server() -> None:
    """The learner looks again at a server whose new StepStream failed with gRPC's own INTERNAL (a refusal
    that raced the first write); an INTERNAL the server sent (a crashed env: the stream ends, so each
    next step opens a new one) is the answer, and costs no probe."""

    async def steps() -> tuple[list[float], int, list[str]]:
        service = _CrashingStepStream()
        server = grpc.aio.server()
        pb_grpc.add_EnvServiceServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = EnvClient(f"127.0.0.1:{port}", timeout=5)
        took, errors = [], []
        for _ in range(3):
            start = time.monotonic()
            with pytest.raises(RemoteEnvError) as info:
                await client.step(pb.StepRequest(session_id="s"))
            took.append(time.monotonic() - start)
            errors.append(str(info.value))
        await client.close()
        await server.stop(0)
        return took, service.opened, errors

    took, opened, errors = asyncio.run(steps())
    # (a probe opens a StepStream of its own: none ran; nor a backoff, which would take seconds: the bound is
    # loose for a loaded machine)
    assert opened == 3 and max(took) < 2.0, (opened, took)
    assert all("[INTERNAL]: step failed: ValueError: env bug; reset before stepping again" in e for e in errors)
