"""Fuzzing a real server with malformed requests (hypothesis): never a crash, never INTERNAL, still serving.

Requests go through the raw generated stubs (no client-side checks): tensors of unknown dtypes,
negative, huge or very deep shapes, data of the wrong length, NaN and infinite actions, values
outside the space, empty oneofs, maps whose keys and values disagree, wrong counts of seeds and
masks, unknown session ids, protocol versions the server does not speak. A well-formed request
may come up too (then OK). Every other answer must be INVALID_ARGUMENT (a field is malformed) or
FAILED_PRECONDITION (out of order, or not this session's), and the server must stay healthy.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from typing import Any, cast

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from env_server import codec
from env_server.config import DEFAULT_MAX_REQUEST_BYTES
from env_server.health import check
from env_server.protocol import MAX_MESSAGE_BYTES
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from learner import RemoteVectorEnv
from tests.conftest import StartServers

NUM_ENVS = 2
EXAMPLES = 1200
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
# The server's envs are claimed by the fuzzer's own session, so a Handshake is refused as busy.
ALLOWED_HANDSHAKE = ALLOWED | {grpc.StatusCode.RESOURCE_EXHAUSTED}

STATUSES: Counter[grpc.StatusCode] = Counter()


class Target:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.EnvServiceStub(self.channel)
        self.session = self.stub.Handshake(pb.HandshakeRequest(client_name="fuzzer"), timeout=10).session_id
        self.stub.Reset(pb.ResetRequest(session_id=self.session), timeout=10)


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    from learner import LocalServers

    with LocalServers("tests.envs:FuzzEnv", 1, NUM_ENVS) as servers:
        t = Target(servers.addresses[0])
        yield t
        t.channel.close()


# -- strategies ---------------------------------------------------------------------------------------------

DTYPES = st.one_of(st.integers(0, 12), st.integers(-(2**31), 2**31 - 1))  # known codes, and anything else
DIMS = st.one_of(st.integers(-3, 4), st.sampled_from([2**31, 2**40, 2**62, 2**63 - 1, -(2**63)]))
SHAPES = st.one_of(
    st.lists(DIMS, max_size=5),
    st.integers(30, 200).map(lambda n: [1] * n),  # more dimensions than numpy has
)
FLOATS = st.floats(allow_nan=True, allow_infinity=True)


@st.composite
def raw_tensors(draw: st.DrawFn) -> pb.Tensor:
    """Anything at all: dtype, shape and data drawn independently."""
    return pb.Tensor(dtype=cast(pb.DType, draw(DTYPES)), shape=draw(SHAPES), data=draw(st.binary(max_size=64)))


@st.composite
def consistent_tensors(draw: st.DrawFn) -> pb.Tensor:
    """Decodable tensors (data of the right length) of any dtype and small shape: reach the action checks."""
    dtype = codec.np_dtype(draw(st.integers(1, 12)))
    shape = draw(st.one_of(st.lists(st.integers(0, 3), max_size=3), st.integers(30, 100).map(lambda n: [1] * n)))
    count = math.prod(shape)
    data = draw(st.binary(min_size=count * dtype.itemsize, max_size=count * dtype.itemsize))
    return pb.Tensor(dtype=pb.DType.Value(f"DTYPE_{dtype.name.upper()}"), shape=shape, data=data)


@st.composite
def plausible_actions(draw: st.DrawFn) -> pb.Value:
    """Actions of the right layout for FuzzEnv's Dict space, with values drawn from near and far outside it."""
    k = NUM_ENVS if draw(st.booleans()) else draw(st.integers(0, 4))
    move = draw(st.lists(st.floats(-2, 2) | st.floats(width=32), min_size=2 * k, max_size=2 * k))
    actions: dict[str, Any] = {
        "move": np.array(move, dtype=np.float32).reshape(k, 2),
        "pick": np.array(draw(st.lists(st.integers(-2, 4), min_size=k, max_size=k)), dtype=np.int64),
        "flags": np.array(draw(st.lists(st.integers(-1, 2), min_size=2 * k, max_size=2 * k)), dtype=np.int8).reshape(
            k, 2
        ),
        "pair": (
            np.array(draw(st.lists(st.integers(-1, 3), min_size=2 * k, max_size=2 * k)), dtype=np.int64).reshape(k, 2),
            np.array(draw(st.lists(st.integers(-2, 2), min_size=k, max_size=k)), dtype=np.int64),
        ),
    }
    for key in draw(st.lists(st.sampled_from(list(actions)), max_size=2)):
        actions.pop(key, None)  # a missing key
    if draw(st.booleans()):
        actions[draw(st.sampled_from(["extra", "move ", ""]))] = np.zeros(k)
    return codec.encode_value(actions, pb.Value(), "actions")


LEAVES = st.one_of(
    raw_tensors().map(lambda t: pb.Value(tensor=t)),
    consistent_tensors().map(lambda t: pb.Value(tensor=t)),
    consistent_tensors().map(lambda t: pb.Value(scalar=t)),
    st.text(max_size=8).map(lambda s: pb.Value(text=s)),
    FLOATS.map(lambda f: pb.Value(float64=f)),
    st.integers(-(2**63), 2**63 - 1).map(lambda i: pb.Value(int64=i)),
    st.booleans().map(lambda b: pb.Value(boolean=b)),
    st.just(pb.Value(none=pb.NoneValue())),
    st.binary(max_size=8).map(lambda b: pb.Value(raw=b)),
    st.just(pb.Value()),  # no field of the oneof set
    st.builds(
        lambda shape, values: pb.Value(strings=pb.StringArray(shape=shape, values=values)),
        SHAPES,
        st.lists(st.text(max_size=3), max_size=4),
    ),
)


def _containers(children: st.SearchStrategy[pb.Value]) -> st.SearchStrategy[pb.Value]:
    return st.one_of(
        st.builds(
            lambda keys, values: pb.Value(map=pb.ValueMap(keys=keys, values=values)),
            st.lists(st.sampled_from(["move", "pick", "flags", "pair", "x", "reset_mask", ""]), max_size=4),
            st.lists(children, max_size=4),
        ),
        st.lists(children, max_size=3).map(lambda vs: pb.Value(tuple=pb.ValueList(values=vs))),
        st.lists(children, max_size=3).map(lambda vs: pb.Value(list=pb.ValueList(values=vs))),
        st.builds(
            lambda shape, vs: pb.Value(objects=pb.ObjectArray(shape=shape, values=vs)),
            SHAPES,
            st.lists(children, max_size=3),
        ),
    )


VALUES = st.one_of(plausible_actions(), st.recursive(LEAVES, _containers, max_leaves=8))


@st.composite
def requests(draw: st.DrawFn, session: str) -> tuple[str, Any]:
    """(method, request) of any kind; mostly this session's, so that the checks behind the session's are reached."""
    sid = draw(st.one_of(st.just(session), st.just(session), st.just(session), st.text(max_size=40)))
    kind = draw(st.sampled_from(["Step", "Step", "Step", "Reset", "Reset", "Handshake", "Hold", "Release", "GetSpec"]))
    if kind == "Step":
        request = pb.StepRequest(session_id=sid)
        if draw(st.integers(0, 9)):
            request.actions.CopyFrom(draw(VALUES))
        return kind, request
    if kind == "Reset":
        seeds = draw(
            st.lists(
                st.one_of(st.just(pb.Seed()), st.integers(0, 2**64 - 1).map(lambda v: pb.Seed(value=v))), max_size=4
            )
        )
        request = pb.ResetRequest(session_id=sid, seeds=seeds, reset_mask=draw(st.lists(st.booleans(), max_size=4)))
        if draw(st.booleans()):
            request.options.CopyFrom(draw(VALUES))
        return kind, request
    if kind == "Handshake":
        version = draw(st.one_of(st.integers(0, 3), st.integers(0, 2**32 - 1)))
        return kind, pb.HandshakeRequest(protocol_version=version, client_name=draw(st.text(max_size=300)))
    # Hold and Release with the fuzzer's own session would block (Hold) or end it (Release).
    other = draw(st.text(max_size=40).filter(lambda s: s != session))
    if kind == "Hold":
        return kind, pb.HoldRequest(session_id=other)
    if kind == "Release":
        return kind, pb.ReleaseRequest(session_id=other)
    return kind, pb.GetSpecRequest()


def call(target: Target, method: str, request: Any) -> tuple[grpc.StatusCode, Any]:
    try:
        if method == "Hold":
            return grpc.StatusCode.OK, list(target.stub.Hold(request, timeout=5))
        return grpc.StatusCode.OK, getattr(target.stub, method)(request, timeout=5)
    except grpc.RpcError as err:
        return err.code(), None


# -- tests ----------------------------------------------------------------------------------------------------


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
@pytest.mark.slow
def test_malformed_requests_get_invalid_argument_or_failed_precondition(target: Target, data: st.DataObject) -> None:
    method, request = data.draw(requests(target.session), label="request")
    code, response = call(target, method, request)
    STATUSES[code] += 1
    allowed = ALLOWED_HANDSHAKE if method == "Handshake" else ALLOWED
    assert code in allowed, f"{method} got {code.name} for {request!r}"[:2000]
    if method in ("Step", "Reset") and code == grpc.StatusCode.OK:
        # FuzzEnv raises (isolated: an "env_error" info) for an action outside its space.
        infos = codec.decode_value(response.infos)
        assert "env_error" not in infos, f"an action the server should have refused reached the env: {infos}"


def test_bytes_that_are_no_message_are_invalid_argument(target: Target) -> None:
    """Bytes that do not parse as the method's message, on every method, the step stream too."""
    rng = np.random.default_rng(0)
    # A field number 0 or a truncated varint never parses, whatever follows.
    garbage = [b"\x00" + rng.bytes(int(rng.integers(0, 100))) for _ in range(30)] + [b"\x08\x80"] * 5
    for method in ("GetSpec", "Handshake", "Reset", "Step", "Release"):
        send = target.channel.unary_unary(f"/envfleet.v1.EnvService/{method}")
        for data in garbage:
            with pytest.raises(grpc.RpcError) as info:
                send(data, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert "not a valid protobuf message" in info.value.details()
            STATUSES[info.value.code()] += 1
    hold = target.channel.unary_stream("/envfleet.v1.EnvService/Hold")
    with pytest.raises(grpc.RpcError) as info:
        list(hold(garbage[0], timeout=5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    steps = target.channel.stream_stream("/envfleet.v1.EnvService/StepStream")
    with pytest.raises(grpc.RpcError) as info:
        list(steps(iter(garbage[:1]), timeout=5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_message_over_the_size_limit_is_refused(target: Target) -> None:
    """A request over the server's limit on requests (4 MiB by default), or over the 64 MiB of
    responses, is refused by gRPC before it is read."""
    with grpc.insecure_channel(target.address, options=[("grpc.max_send_message_length", -1)]) as channel:
        send = channel.unary_unary("/envfleet.v1.EnvService/Step")
        for size in (DEFAULT_MAX_REQUEST_BYTES + 1, MAX_MESSAGE_BYTES + 1):
            with pytest.raises(grpc.RpcError) as info:
                send(b"\x00" * size, timeout=30)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details()
    assert check(target.address) == "SERVING"


@pytest.mark.slow  # (as the fuzzing that sends most of the 1,000 requests it counts)
def test_the_server_is_healthy_and_serving_after_the_fuzzing(target: Target) -> None:
    """Runs last in this module: >= 1,000 requests were sent, and a learner steps as usual."""
    total = sum(STATUSES.values())
    if total == 0:
        pytest.skip("the fuzzing tests above did not run (selected alone)")
    assert total >= 1000, STATUSES
    assert set(STATUSES) <= ALLOWED_HANDSHAKE, STATUSES
    print(f"{total} requests: " + ", ".join(f"{code.name} {n}" for code, n in STATUSES.most_common()))
    assert check(target.address) == "SERVING"
    target.stub.Release(pb.ReleaseRequest(session_id=target.session), timeout=5)
    with RemoteVectorEnv([target.address]) as envs:
        envs.reset(seed=0)
        for _ in range(5):
            _, rewards, *_ = envs.step(envs.action_space.sample())
        assert rewards.tolist() == [1.0] * NUM_ENVS


def test_fuzz_target_env_checks_its_own_actions(start_servers: StartServers) -> None:
    """FuzzEnv asserts that every action it gets lies in its space, so a check the server missed would show."""
    (address,) = start_servers("tests.envs:FuzzEnv", 1, NUM_ENVS)
    with RemoteVectorEnv([address]) as envs:
        envs.reset(seed=0)
        envs.action_space.seed(0)
        for _ in range(20):
            _, _, _, _, infos = envs.step(envs.action_space.sample())
            assert "env_error" not in infos
