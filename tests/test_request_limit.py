"""The server's limit on requests (env-server --max-request-bytes): told in the Handshake, refused
unread by the server (gRPC and step socket) and before sending by the learner, with errors that name
the server, the size, the limit and the option; the server serves on."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import grpc
import numpy as np
import pytest

from env_server import codec
from env_server.config import DEFAULT_MAX_REQUEST_BYTES
from env_server.health import check
from env_server.protocol import MAX_MESSAGE_BYTES
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from learner import InvalidRequestError, InvalidResponseError, RemoteVectorEnv, ServerBusyError
from learner.client import EnvClient, SocketStep, request_too_large, status_error
from learner.local import label_of
from tests.conftest import SpawnServer, StartServers
from tests.measure_request_memory import worst_step

LIMIT = 4096
RAISE_IT = "(the server's env-server --max-request-bytes, or ENVFLEET_MAX_REQUEST_BYTES, raises the limit)"


def _refused_unsent(method: str, address: str, size: int, limit: int = LIMIT) -> str:
    return (  # (the server at ``address`` as the learner names it: local-0 for one LocalServers started)
        f"env server {label_of(address)}: {method} failed [RESOURCE_EXHAUSTED]: the request is {size} bytes, over the "
        f"server's limit of {limit} bytes on requests; nothing was sent {RAISE_IT}"
    )


def _actions(width: int, num_envs: int = 1) -> pb.Value:
    return codec.encode_value(np.zeros((num_envs, width)), pb.Value(), "actions")


def test_the_handshake_tells_the_limit_and_whether_a_token_is_checked(spawn_server: SpawnServer) -> None:
    plain = spawn_server("CartPole-v1", 1)
    limited = spawn_server(
        "CartPole-v1", 1, environ={"ENVFLEET_MAX_REQUEST_BYTES": "65536", "ENVFLEET_AUTH_TOKEN": "tok"}
    )
    flag = spawn_server("CartPole-v1", 1, "--max-request-bytes", str(MAX_MESSAGE_BYTES))
    for server, metadata, limit, checks in (
        (plain, (), DEFAULT_MAX_REQUEST_BYTES, False),
        (limited, (("authorization", "Bearer tok"),), 65536, True),
        (flag, (), MAX_MESSAGE_BYTES, False),
    ):
        with grpc.insecure_channel(server.address) as channel:
            response = pb_grpc.EnvServiceStub(channel).Handshake(pb.HandshakeRequest(), timeout=10, metadata=metadata)
        assert response.max_request_bytes == limit
        assert response.HasField("checks_token") and response.checks_token is checks


def test_a_request_over_the_limit_is_refused_unread_and_the_learner_steps_on(spawn_server: SpawnServer) -> None:
    """Another client's requests over the limit (any method, a stream too) are refused by gRPC before
    they are read; the learner that holds the server steps on, and so does its next session."""
    server = spawn_server("CartPole-v1", 2, "--max-request-bytes", str(LIMIT))
    with RemoteVectorEnv([server.address]) as envs:
        envs.reset(seed=0)
        with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", -1)]) as channel:
            over = bytes(LIMIT + 1)
            for method in ("Handshake", "Reset", "Step", "GetSpec"):
                with pytest.raises(grpc.RpcError) as info:
                    channel.unary_unary(f"/envfleet.v1.EnvService/{method}")(over, timeout=10)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert info.value.details() == f"SERVER: Received message larger than max ({LIMIT + 1} vs. {LIMIT})"
            with pytest.raises(grpc.RpcError) as info:
                list(channel.stream_stream("/envfleet.v1.EnvService/StepStream")(iter([over]), timeout=10))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # As large as the limit: read (and refused as not this session's).
            at_limit = worst_step("not-the-session", LIMIT)
            assert len(at_limit) > LIMIT - 32
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary("/envfleet.v1.EnvService/Step")(at_limit, timeout=10)
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
        for _ in range(3):
            _, rewards, *_ = envs.step(np.zeros(2, dtype=np.int64))
            assert rewards.tolist() == [1.0, 1.0]
    assert check(server.address) == "SERVING"
    with RemoteVectorEnv([server.address]) as envs:
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_learner_refuses_a_request_over_a_servers_limit_before_sending(
    start_servers: StartServers, transport: str
) -> None:
    """A reset whose options, or a step whose actions, are over one server's limit reaches none of
    it; the error names the server, the size, the limit and the option. The fleet goes on."""
    args: dict[str, Any] = {"transport": transport, "env_kwargs": {"width": 256}}  # 2 KB actions
    (roomy,) = start_servers("tests.envs:WideActionEnv", **args)
    (tight,) = start_servers("tests.envs:WideActionEnv", **args, server_args=["--max-request-bytes", str(LIMIT)])
    with RemoteVectorEnv([roomy, tight]) as envs:
        envs.reset(seed=0)
        options = {"goal": np.zeros(1000)}
        with pytest.raises(InvalidRequestError) as info:
            envs.reset(options=options)
        envs.step(np.zeros((2, 256)))  # (no server was reset: the roomy one's episode goes on, no SessionError)
        err = info.value
        assert err.address == tight and err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        size = pb.ResetRequest(session_id="0" * 32, options=codec.encode_value(options, pb.Value())).ByteSize()
        assert str(err) == _refused_unsent("Reset", tight, size)
        envs.reset(seed=0, options={"goal": np.zeros(100)})
        envs.step(np.zeros((2, 256)))
    (wide,) = start_servers(
        "tests.envs:WideActionEnv",
        1,
        2,
        transport=transport,
        env_kwargs={"width": 300},
        server_args=["--max-request-bytes", str(LIMIT)],
    )
    with RemoteVectorEnv([wide]) as envs:
        envs.reset(seed=0)
        with pytest.raises(InvalidRequestError) as info:
            envs.step(np.zeros((2, 300)))  # 4.8 KB
        size = pb.StepRequest(session_id="0" * 32, actions=_actions(300, 2), step_id=1).ByteSize()  # (its first)
        assert str(info.value) == _refused_unsent("Step", wide, size)
        # Refused before any server was sent its part: the fleet is not left mid-step (a SessionError
        # until reset()), and the same step is refused the same way.
        with pytest.raises(InvalidRequestError):
            envs.step(np.zeros((2, 300)))
    assert check(wide) == "SERVING"


@pytest.mark.parametrize(
    ("flags", "environ", "probing"),
    [
        ([], {}, False),
        (["--http2-bdp-probe"], {}, True),
        ([], {"ENVFLEET_HTTP2_BDP_PROBE": "on"}, True),
        (["--no-http2-bdp-probe"], {"ENVFLEET_HTTP2_BDP_PROBE": "on"}, False),
    ],
)
def test_bdp_probing_is_off_unless_asked_for_and_large_actions_step_either_way(
    start_servers: StartServers,
    monkeypatch: pytest.MonkeyPatch,
    flags: list[str],
    environ: dict[str, str],
    probing: bool,
) -> None:
    """Each call's receive window stays at 64 KiB (what a flood of calls can make the server hold)
    unless --http2-bdp-probe (ENVFLEET_HTTP2_BDP_PROBE) lets gRPC grow it; a step whose actions are
    over 64 KiB goes through either way."""
    from env_server.__main__ import parse_args
    from env_server.server import serve

    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    config, _ = parse_args(["--env", "CartPole-v1", *flags])
    assert config.http2_bdp_probe is probing
    # What the server hands gRPC, as it starts.
    given: list[dict[str, Any]] = []
    make_server = grpc.aio.server

    def recording(*args: Any, **kwargs: Any) -> Any:
        given.append(dict(kwargs["options"]))
        return make_server(*args, **kwargs)

    monkeypatch.setattr(grpc.aio, "server", recording)

    async def serve_until_ready() -> int:
        stop = asyncio.Event()
        return await serve(dataclasses.replace(config, port=0, host="127.0.0.1"), lambda _: stop.set(), stop=stop)

    assert asyncio.run(serve_until_ready()) == 0
    assert [options["grpc.http2.bdp_probe"] for options in given] == [int(probing)]
    (server,) = start_servers(
        "tests.envs:WideActionEnv", 1, 2, transport="tcp", env_kwargs={"width": 8192}, server_args=flags
    )
    with RemoteVectorEnv([server]) as envs:
        envs.reset(seed=0)
        for _ in range(3):
            envs.step(np.zeros((2, 8192)))  # (128 KiB of actions)


def _client(address: str) -> EnvClient:
    return EnvClient(address, timeout=10)


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_a_refused_step_leaves_the_stream_or_the_step_socket_as_it_was(
    start_servers: StartServers, transport: str
) -> None:
    (address,) = start_servers(
        "tests.envs:WideActionEnv",
        transport=transport,
        env_kwargs={"width": 4},
        server_args=["--max-request-bytes", str(LIMIT)],
    )

    async def session() -> None:
        client = _client(address)
        client.start_session(await client.handshake())
        assert client.max_request_bytes == LIMIT
        await client.reset(None, None, None)
        good, big = client.step_request(), client.step_request()
        good.actions.CopyFrom(_actions(4))
        big.actions.CopyFrom(_actions(1000))
        if transport == "tcp":
            await client.step(good)
            stream = client._steps
            with pytest.raises(InvalidRequestError, match=r"nothing was sent"):
                await client.step(big)
            assert client._steps is stream  # (not ended: nothing went on it)
            assert (await client.step(good)).rewards.data
        else:
            first = client.send_on_socket(good)
            assert isinstance(first, SocketStep)
            first.wait(time.monotonic() + 10)
            connection = client._socket
            refused = client.send_on_socket(big)
            assert refused is not None and isinstance(refused.exception(), InvalidRequestError)
            assert client._socket is connection and client.step_socket  # (kept, and still used)
            again = client.send_on_socket(good)
            assert again is not None and not again.first
            again.wait(time.monotonic() + 10)
            assert again.result()[0].rewards.data
        await client.close()

    asyncio.run(session())


def test_a_server_that_does_not_tell_its_limit_refuses_clearly_and_the_session_goes_on(
    spawn_server: SpawnServer,
) -> None:
    """A server whose Handshake does not say its limit (an older one) refuses with gRPC's own
    RESOURCE_EXHAUSTED: the learner reports it as clearly, and the session goes on."""
    server = spawn_server("tests.envs:WideActionEnv", 1, "--max-request-bytes", str(LIMIT))

    async def session() -> None:
        client = _client(server.address)
        client.start_session(await client.handshake())
        client.max_request_bytes = MAX_MESSAGE_BYTES  # (as for a Handshake without max_request_bytes)
        options = codec.encode_value({"goal": np.zeros(1000)}, pb.Value(), "options")
        with pytest.raises(InvalidRequestError) as info:
            await client.reset(None, options, None)
        size = pb.ResetRequest(session_id=client.session_id, options=options).ByteSize()
        assert str(info.value) == (
            f"env server {server.address}: Reset failed [RESOURCE_EXHAUSTED]: the request is {size} bytes, over "
            f"the server's limit of {LIMIT} bytes on requests; the server read none of it {RAISE_IT}"
        )
        await client.reset(None, None, None)
        big = client.step_request()
        big.actions.CopyFrom(_actions(1000))
        with pytest.raises(InvalidRequestError, match=r"Step failed \[RESOURCE_EXHAUSTED\]: the request is \d+ bytes"):
            await client.step(big)
        good = client.step_request()
        good.actions.CopyFrom(_actions(64))
        assert (await client.step(good)).rewards.data  # (a new stream, the same session)
        await client.close()

    asyncio.run(session())


@pytest.mark.parametrize(
    ("details", "expected"),
    [
        (
            "SERVER: Received message larger than max (5000 vs. 4096)",
            "env server a:1: Step failed [RESOURCE_EXHAUSTED]: the request is 5000 bytes, over the server's limit of "
            f"4096 bytes on requests; the server read none of it {RAISE_IT}",
        ),
        (  # (a server whose gRPC is older says it without the prefix)
            "Received message larger than max (5000 vs. 4096)",
            "env server a:1: Step failed [RESOURCE_EXHAUSTED]: the request is 5000 bytes, over the server's limit of "
            f"4096 bytes on requests; the server read none of it {RAISE_IT}",
        ),
        (
            "CLIENT: Sent message larger than max (70000000 vs. 67108864)",
            "env server a:1: Step failed [RESOURCE_EXHAUSTED]: the request is 70000000 bytes, over this client's "
            "limit of 67108864 bytes on messages; nothing was sent",
        ),
    ],
)
def test_grpcs_own_refusals_of_a_large_request_are_invalid_requests(details: str, expected: str) -> None:
    err = status_error(grpc.StatusCode.RESOURCE_EXHAUSTED, details, address="a:1", method="Step", from_server=False)
    assert isinstance(err, InvalidRequestError) and err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(err) == expected
    # Over 64 MiB (a server that does not say its limit: an older one), no option helps.
    assert str(request_too_large("a:1", "Reset", 70_000_000, MAX_MESSAGE_BYTES)).endswith(
        "over the server's limit of 67108864 bytes on requests; nothing was sent (no env server reads more: pass "
        "smaller reset options (every server is sent them whole))"
    )
    # A step's request grows with the server's envs (9 envs of Box(2_000_000) float32 actions: 72 MB): fewer
    # per server is what helps (was: "send less per request", for a step whose actions are as the env has them).
    assert str(request_too_large("a:1", "Step", 72_000_059, MAX_MESSAGE_BYTES)).endswith(
        "over the server's limit of 67108864 bytes on requests; nothing was sent (no env server reads more: a Step "
        "carries the actions of every env of the server; serve fewer envs per server (env-server --num-envs), on "
        "more servers)"
    )
    # An answer over the limit on messages: no busy server either, and no option of the server's helps.
    for side in ("SERVER: Sent", "CLIENT: Received"):
        answer = status_error(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{side} message larger than max (70000000 vs. 67108864)",
            address="a:1",
            method="Step",
            from_server=False,
        )
        assert isinstance(answer, InvalidResponseError) and str(answer) == (
            "env server a:1: Step failed [RESOURCE_EXHAUSTED]: its answer is 70000000 bytes, over the limit of "
            "67108864 bytes on messages; serve fewer envs per server (env-server --num-envs) or smaller observations"
        )
    # The server's own RESOURCE_EXHAUSTED (its envs are claimed) is what it was.
    busy = status_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "claimed by 'x'", address="a:1", method="Handshake")
    assert isinstance(busy, ServerBusyError)
