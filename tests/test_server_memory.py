"""What a request can make the server hold in memory: string arrays bounded before numpy builds them,
values of too many values/arrays refused before any is decoded, and refused requests freed at once, not whenever Python's cyclic garbage collector runs."""

from __future__ import annotations

import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from env_server import codec
from env_server.config import DEFAULT_MAX_REQUEST_BYTES
from env_server.protocol import FRAME_ERROR, FRAME_HEADER, FRAME_STEP, MAX_MESSAGE_BYTES, STEP_SOCKET_SUFFIX
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from env_server.step_socket import MAX_CONNECTIONS
from learner import RemoteVectorEnv
from tests.conftest import ServerProcess, SpawnServer
from tests.measure_request_memory import memory as _memory
from tests.measure_request_memory import worst_step

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")

MB = 1 << 20


def _strings(values: list[str]) -> pb.Value:
    return pb.Value(strings=pb.StringArray(shape=[len(values)], values=values))


class Claimed:
    """A server subprocess (2 CartPole envs), and a session of its own, reset."""

    def __init__(self, server: ServerProcess) -> None:
        assert server.proc is not None
        self.pid = server.proc.pid
        self.channel = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 128 * MB)])
        self.stub = pb_grpc.EnvServiceStub(self.channel)
        self.id = self.stub.Handshake(pb.HandshakeRequest(client_name="memory test"), timeout=30).session_id
        self.stub.Reset(pb.ResetRequest(session_id=self.id), timeout=30)

    def refused(self, method: Any, request: Any) -> grpc.RpcError:
        with pytest.raises(grpc.RpcError) as info:
            method(request, timeout=60)
        return info.value


@pytest.fixture
def claimed(spawn_server: SpawnServer) -> Iterator[Claimed]:
    # (requests of up to 64 MiB, as a server whose operator allows them reads: what the codec makes
    # of them is what these tests are about)
    session = Claimed(spawn_server("CartPole-v1", 2, "--max-request-bytes", str(MAX_MESSAGE_BYTES)))
    yield session
    session.channel.close()


# -- string arrays ------------------------------------------------------------------------------------


def test_a_string_array_is_refused_before_numpy_makes_every_string_as_wide_as_the_longest() -> None:
    # 45 KB on the wire; as a numpy array, 10001 strings of 25000 characters of 4 bytes: 1 GB.
    value = _strings(["a" * 25_000] + [""] * 10_000)
    with pytest.raises(codec.CodecError) as info:
        codec.decode_value(value, "actions")
    assert str(info.value) == (
        "actions: a string array of 10001 strings of up to 25000 characters would take 1000100000 bytes "
        "decoded (numpy stores every string as wide as the longest, 4 bytes a character); at most "
        f"{codec.MAX_STRING_ARRAY_BYTES}"
    )

    # Those within the bound decode as before, empty strings and shapes included.
    decoded = codec.decode_value(pb.Value(strings=pb.StringArray(shape=[2, 2], values=["ab", "", "c", "é"])))
    assert decoded.dtype == np.dtype("<U2") and decoded.tolist() == [["ab", ""], ["c", "é"]]
    assert codec.decode_value(pb.Value(strings=pb.StringArray(shape=[0]))).dtype == np.dtype("<U1")


def test_the_bound_holds_for_all_the_string_arrays_of_a_value_together(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "MAX_STRING_ARRAY_BYTES", 1000)
    one = _strings(["x" * 10] * 10)  # 400 bytes decoded
    assert codec.decode_value(pb.Value(list=pb.ValueList(values=[one, one])), "options")[1].shape == (10,)
    with pytest.raises(codec.CodecError) as info:
        codec.decode_value(pb.Value(list=pb.ValueList(values=[one, one, one])), "options")
    assert str(info.value) == (
        "options[2]: a string array of 10 strings of up to 10 characters would take 400 bytes decoded (numpy "
        "stores every string as wide as the longest, 4 bytes a character); only 200 of the 1000 that the string "
        "arrays of one value may take are left"
    )
    # Too many for even 1 character each: refused before their lengths are looked at.
    with pytest.raises(codec.CodecError, match=r"^x: a string array of 300 strings would take at least 1200 bytes"):
        codec.decode_value(_strings([""] * 300), "x")
    # What cannot be decoded is not sent either, named where it is.
    with pytest.raises(codec.CodecError) as info:
        codec.encode_value({"label": np.array(["x" * 10] * 30)}, pb.Value(), "infos")
    assert str(info.value) == (
        "infos['label']: a string array of 30 strings of up to 10 characters would take 1200 bytes decoded (numpy "
        "stores every string as wide as the longest, 4 bytes a character); at most 1000; it cannot be sent"
    )


def test_what_encode_sends_decode_takes_all_the_strings_of_a_value_counted_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two string arrays of 40 MB each, in one dict (infos), used to be sent (each under the bound on
    its own) and then refused by the receiver, which counts all the strings of a value together."""
    monkeypatch.setattr(codec, "MAX_STRING_ARRAY_BYTES", 1000)
    one = np.array(["x" * 10] * 15)  # 600 bytes decoded
    with pytest.raises(codec.CodecError) as info:
        codec.encode_value({"a": one, "b": one}, pb.Value(), "infos")
    assert str(info.value) == (
        "infos['b']: a string array of 15 strings of up to 10 characters would take 600 bytes decoded (numpy "
        "stores every string as wide as the longest, 4 bytes a character); only 400 of the 1000 that the string "
        "arrays of one value may take are left; it cannot be sent"
    )
    # What the receiver decodes, not numpy's width here: an array made wider than its strings counts
    # as decode will make it (and an empty array as nothing).
    wide = np.array(["x"] * 250, dtype="<U50")
    value = codec.encode_value({"wide": wide, "none": np.array([], dtype="<U9")}, pb.Value(), "infos")
    assert codec.decode_value(value, "infos")["wide"].dtype == np.dtype("<U1")
    with pytest.raises(codec.CodecError, match=r"^infos\['more'\]: a string array of 1 strings would take at least"):
        codec.encode_value({"wide": wide, "more": np.array(["y"])}, pb.Value(), "infos")


@pytest.mark.slow
def test_the_bound_at_full_size_two_40_mb_string_arrays_in_one_dict() -> None:
    forty = np.full(10 * MB, "x")  # 10M strings of 1 character: 40 MiB decoded, 20 MiB on the wire
    assert forty.nbytes <= codec.MAX_STRING_ARRAY_BYTES
    with pytest.raises(codec.CodecError) as info:
        codec.encode_value({"a": forty, "b": forty}, pb.Value(), "infos")
    assert str(info.value).startswith(
        f"infos['b']: a string array of {10 * MB} strings would take at least {40 * MB} bytes decoded"
    ) and str(info.value).endswith(
        f"only {codec.MAX_STRING_ARRAY_BYTES - 40 * MB} of the {codec.MAX_STRING_ARRAY_BYTES} that the string "
        "arrays of one value may take are left; it cannot be sent"
    )


# -- values/arrays ------------------------------------------------------------------------------------


def _many(count: int, item: pb.Value) -> pb.Value:
    value = pb.Value()
    items = value.map.values.add().list.values
    value.map.keys.append("k")
    for _ in range(count):
        items.add().CopyFrom(item)
    return value


EMPTY_STRINGS = pb.Value(strings=pb.StringArray(shape=[0]))


def test_a_value_of_too_many_values_is_refused_before_any_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Empty string arrays take nothing of the bytes of strings, yet ~400 bytes each decoded (a numpy
    array and its Python objects), from 7 bytes on the wire: 3,000,000 of them in a 21 MB request
    grew a server by 670 MB."""
    fromiter = np.fromiter
    made = []

    def counted(*args: Any, **kwargs: Any) -> np.ndarray:
        made.append(1)
        return fromiter(*args, **kwargs)

    monkeypatch.setattr(np, "fromiter", counted)
    limit = codec.MAX_VALUE_NODES
    with pytest.raises(codec.CodecError) as info:
        codec.decode_value(_many(limit, EMPTY_STRINGS), "options")
    assert str(info.value) == (
        f"options['k']: more than {limit} values/arrays in one value (a list of {limit} items makes {limit + 2}; "
        "every dict entry, list or tuple item and object-array item counts one, nested ones too); send many "
        "numbers or strings as one numpy array"
    )
    assert not made  # refused as a whole, before its items
    # One fewer fits: the value, its dict entry and its list items make the limit.
    assert len(codec.decode_value(_many(limit - 2, EMPTY_STRINGS), "options")["k"]) == limit - 2
    assert len(made) == limit - 2

    # Nested ones count too, wherever they are: dicts, tuples, object arrays; and encode counts as decode does.
    monkeypatch.setattr(codec, "MAX_VALUE_NODES", 10)
    for obj, where, what in (
        ({"a": [0] * 5, "b": [0] * 5}, "infos['b']", "a list of 5 items makes 13"),
        ((None, {"x": 1, "y": (1, 2, 3, 4, 5, 6)}), "infos[1]['y']", "a tuple of 6 items makes 11"),
        ([np.array([{"x": 1}, None, None], dtype=object)] * 3, "infos[1]", "an object array of 3 items makes 11"),
    ):
        for step in ("encode", "decode"):
            with pytest.raises(codec.CodecError) as info:
                if step == "encode":
                    codec.encode_value(obj, pb.Value(), "infos")
                else:
                    with monkeypatch.context() as unbounded:
                        unbounded.setattr(codec, "MAX_VALUE_NODES", 1000)
                        value = codec.encode_value(obj, pb.Value(), "infos")
                    codec.decode_value(value, "infos")
            assert str(info.value).startswith(f"{where}: more than 10 values/arrays in one value ({what}; "), step


@pytest.mark.slow
def test_a_request_of_many_empty_arrays_makes_the_server_allocate_little(claimed: Claimed) -> None:
    start = _memory(claimed.pid, "VmRSS")
    options = _many(1_000_000, EMPTY_STRINGS)  # 7 MB on the wire; ~400 MB decoded, before
    err = claimed.refused(claimed.stub.Reset, pb.ResetRequest(session_id=claimed.id, options=options))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details().startswith(f"options['k']: more than {codec.MAX_VALUE_NODES} values/arrays in one value")
    # (what remains is protobuf's, parsing the request before the server sees it: ~140 bytes a value)
    grown = _memory(claimed.pid, "VmHWM") - start
    assert grown < 250 * MB, f"peak {grown / MB:.0f} MB more"
    claimed.stub.Reset(pb.ResetRequest(session_id=claimed.id), timeout=30)  # the session goes on


def test_a_memory_error_while_decoding_is_a_codec_error(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_memory(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("Unable to allocate 373. GiB")

    monkeypatch.setattr(np, "fromiter", no_memory)
    with pytest.raises(codec.CodecError, match=r"^options: too large to decode \(MemoryError: Unable"):
        codec.decode_value(pb.Value(map=pb.ValueMap(keys=["a"], values=[_strings(["b"])])), "options")


def test_a_tiny_request_of_strings_makes_the_server_allocate_nothing_large(claimed: Claimed) -> None:
    start = _memory(claimed.pid, "VmRSS")
    small = _strings(["a" * 25_000] + [""] * 10_000)  # 1 GB as a numpy array
    huge = _strings(["a" * 1_000_000] + [""] * 100_000)  # 373 GiB: numpy's MemoryError, before
    for value in (small, huge):
        err = claimed.refused(claimed.stub.Step, pb.StepRequest(session_id=claimed.id, actions=value))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert err.details().startswith("actions: a string array of ") and "would take" in err.details()
        options = pb.Value(map=pb.ValueMap(keys=["names"], values=[value]))
        err = claimed.refused(claimed.stub.Reset, pb.ResetRequest(session_id=claimed.id, options=options))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert err.details().startswith("options['names']: a string array of "), err.details()
    # (the peak: the array of the old code was freed again once refused)
    assert _memory(claimed.pid, "VmHWM") - start < 100 * MB
    # The session goes on.
    actions = pb.Value()
    codec.encode_value(np.zeros(2, dtype=np.int64), actions)
    claimed.stub.Step(pb.StepRequest(session_id=claimed.id, actions=actions), timeout=30)


# -- refused requests -------------------------------------------------------------------------------


@pytest.mark.slow
def test_refused_requests_are_freed_at_once(claimed: Claimed) -> None:
    """A refused call's request used to stay in memory, in a reference cycle through the AbortError
    that ``context.abort()`` leaves on the call, until the cyclic garbage collector ran: ~50 MB a
    refused call here, GBs over a few dozen."""
    options = pb.Value()
    codec.encode_value({"junk": np.zeros(6_000_000, dtype=np.int64)}, options, "options")  # 48 MB
    wrong_seeds = pb.ResetRequest(session_id=claimed.id, options=options, seeds=[pb.Seed()])  # 1 seed, 2 envs
    actions = pb.Value(tensor=pb.Tensor(dtype=pb.DTYPE_INT64, shape=[6_000_000], data=bytes(48_000_000)))
    wrong_shape = pb.StepRequest(session_id=claimed.id, actions=actions)
    for method, request, code in (
        (claimed.stub.Reset, wrong_seeds, grpc.StatusCode.INVALID_ARGUMENT),
        (claimed.stub.Step, wrong_shape, grpc.StatusCode.INVALID_ARGUMENT),
    ):
        assert claimed.refused(method, request).code() == code  # (the first: the baseline's buffers)
        before = _memory(claimed.pid, "VmRSS")
        for _ in range(6):
            assert claimed.refused(method, request).code() == code
        # (a moment to settle: on a loaded machine the server may still be freeing the last requests as
        # their answers arrive, 131 MB once in CI; a request kept in a cycle stays until the collector runs)
        deadline = time.monotonic() + 2.0
        while (grown := _memory(claimed.pid, "VmRSS") - before) >= 120 * MB and time.monotonic() < deadline:
            time.sleep(0.05)
        assert grown < 120 * MB, f"{grown / MB:.0f} MB more after 6 refused requests of 48 MB"


# -- the limit on requests --------------------------------------------------------------------------


def test_the_worst_request_the_default_limit_lets_in_grows_a_server_by_a_fraction_of_its_pod(
    spawn_server: SpawnServer,
) -> None:
    """A request of empty Values takes ~25x its size as protobuf parses it, before the server sees it:
    at the old limit, 64 MiB, one grew a server by 1.6 GB (its Kubernetes pod may take 512 MiB:
    k8s/base/env-deployment.yaml); at the default limit, ~100 MB. One byte more is refused unread."""
    server = spawn_server("CartPole-v1", 2)
    session = Claimed(server)
    step = session.channel.unary_unary("/envfleet.v1.EnvService/Step")
    start = _memory(session.pid, "VmRSS")
    worst = worst_step(session.id, DEFAULT_MAX_REQUEST_BYTES)
    assert len(worst) > DEFAULT_MAX_REQUEST_BYTES - 32
    err = session.refused(step, worst)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "values/arrays in one value" in err.details()
    grown = _memory(session.pid, "VmHWM") - start
    assert grown < 200 * MB, f"peak {grown / MB:.0f} MB more"
    over = worst + bytes(DEFAULT_MAX_REQUEST_BYTES + 1 - len(worst))
    assert session.refused(step, over).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    actions = codec.encode_value(np.zeros(2, dtype=np.int64), pb.Value())
    session.stub.Step(pb.StepRequest(session_id=session.id, actions=actions), timeout=30)  # the session goes on
    session.channel.close()


def test_step_socket_connections_that_never_finish_a_frame_hold_no_more_than_the_limit(
    spawn_server: SpawnServer,
) -> None:
    """Anyone who can open the step socket may open its 8 connections and send each all but the last
    byte of a frame: each holds at most the limit (at 64 MiB they grew a server by ~500 MB). A frame
    said to be longer is refused before its payload comes."""
    with tempfile.TemporaryDirectory(prefix="ef-") as folder:
        server = spawn_server("CartPole-v1", 2, "--unix-socket", f"{folder}/env.sock")
        assert server.proc is not None
        pid, limit = server.proc.pid, DEFAULT_MAX_REQUEST_BYTES
        start = _memory(pid, "VmRSS")
        squatters = []
        for _ in range(MAX_CONNECTIONS):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(30)
            sock.connect(f"{folder}/env.sock{STEP_SOCKET_SUFFIX}")
            sock.sendall(FRAME_HEADER.pack(limit, FRAME_STEP) + bytes(limit - 1))
            squatters.append(sock)
        time.sleep(0.5)
        grown = _memory(pid, "VmHWM") - start
        assert grown < MAX_CONNECTIONS * limit + 40 * MB, f"peak {grown / MB:.0f} MB more"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect(f"{folder}/env.sock{STEP_SOCKET_SUFFIX}")  # (closes the oldest squatter)
            sock.sendall(FRAME_HEADER.pack(limit + 1, FRAME_STEP))
            length, kind = FRAME_HEADER.unpack(sock.recv(FRAME_HEADER.size, socket.MSG_WAITALL))
            error = pb.StepError.FromString(sock.recv(length, socket.MSG_WAITALL))
        assert kind == FRAME_ERROR and error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert error.message == (
            f"step socket: a frame of {limit + 1} bytes, over this server's limit of {limit} bytes on requests "
            "(env-server --max-request-bytes raises it)"
        )
        for sock in squatters:
            sock.close()
        with RemoteVectorEnv([server.address]) as envs:
            envs.reset(seed=0)
            envs.step(np.zeros(2, dtype=np.int64))
