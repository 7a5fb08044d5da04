"""What a request can make the server hold in memory: string arrays bounded before numpy builds them,
and refused requests freed at once, not whenever Python's cyclic garbage collector runs."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from env_server import codec
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from tests.conftest import ServerProcess, SpawnServer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")

MB = 1 << 20


def _memory(pid: int, field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the peak so far) of process ``pid``, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


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
    session = Claimed(spawn_server("CartPole-v1", 2))
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
    with pytest.raises(codec.CodecError, match=r"infos\['label'\]: a string array of 30 strings .* takes 1200 bytes"):
        codec.encode_value({"label": np.array(["x" * 10] * 30)}, pb.Value(), "infos")


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
        grown = _memory(claimed.pid, "VmRSS") - before
        assert grown < 120 * MB, f"{grown / MB:.0f} MB more after 6 refused requests of 48 MB"
