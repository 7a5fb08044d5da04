"""A fleet gives what gymnasium's SyncVectorEnv over the same envs gives, whatever its layout: infos
whose values are None in some envs and numbers or arrays in others (the first env's value makes the
array, the others' are cast into it: None is nan in a float array), reset options under a reset_mask,
and no false "more than one env server" warning from closing right after connecting."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import learner.client
from env_server.rpc import env_pb2 as pb
from learner import RemoteVectorEnv
from learner.client import EnvClient
from tests.conftest import SpawnServer, StartServers
from tests.parity_envs import OptionsEnv, PrevActionEnv, SeededInfoEnv


def assert_same(want: Any, got: Any, where: str = "infos") -> None:
    """``got`` is ``want``: the same dict keys, array dtypes and shapes, values (nan equal to nan), and
    for object arrays the same items, of the same types."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), f"{where}: {got!r} vs {want!r}"
        for key, value in want.items():
            assert_same(value, got[key], f"{where}[{key!r}]")
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{where}: {got!r} vs {want!r}"
        assert (got.dtype, got.shape) == (want.dtype, want.shape), f"{where}: {got!r} vs {want!r}"
        if want.dtype == object:
            for i, (w, g) in enumerate(zip(want.flat, got.flat, strict=True)):
                assert_same(w, g, f"{where}[{i}]")
        else:
            np.testing.assert_array_equal(got, want, err_msg=where)
    else:
        assert type(got) is type(want) and (got == want or (got != got and want != want)), (
            f"{where}: {got!r} vs {want!r}"
        )


@pytest.mark.parametrize("case", ["float_then_none", "none_then_npint", "none_among_arrays"])
def test_infos_with_none_in_some_envs_do_not_depend_on_the_layout(start_servers: StartServers, case: str) -> None:
    """Were, on 2 servers: an object array [1.5, nan, None, None] (Sync's: floats, nan where None);
    Python ints for the second server's numpy ints; or InvalidResponseError ("shapes per env differ
    between servers") for None beside arrays."""
    want = gym.vector.SyncVectorEnv([lambda: SeededInfoEnv(case)] * 4).reset(seed=0)[1]
    for num_servers, per in ((2, 2), (4, 1)):
        addresses = start_servers("tests.parity_envs:SeededInfoEnv", num_servers, per, env_kwargs={"case": case})
        with RemoteVectorEnv(addresses) as envs:
            assert_same(want, envs.reset(seed=0)[1], f"{num_servers}x{per} infos")


def test_an_info_none_after_a_reset_and_an_array_after_a_step_loses_no_server(start_servers: StartServers) -> None:
    """Were, once a server's first env had just reset (None) and another's had stepped (an array):
    InvalidResponseError every such step, and fault-tolerant, a healthy server declared lost."""
    ref = gym.vector.SyncVectorEnv([PrevActionEnv] * 4)
    addresses = start_servers("tests.parity_envs:PrevActionEnv", 2, 2)
    with RemoteVectorEnv(addresses, fault_tolerant=True) as envs:
        assert_same(ref.reset(seed=0)[1], envs.reset(seed=0)[1])
        ref.action_space.seed(0)
        for t in range(12):
            actions = ref.action_space.sample()
            want, got = ref.step(actions)[4], envs.step(actions)[4]
            assert_same(want, got, f"step {t} infos")
        assert envs.fault_stats().failures == 0
    ref.close()


def test_envs_reset_by_a_reset_mask_see_the_options_sync_gives_them(start_servers: StartServers) -> None:
    """Were None on a server all of whose envs the mask has (a full reset, sent no options), {} on one
    reset in part (gymnasium pops the mask): SyncVectorEnv's envs see {} (what is left of the options)."""
    disabled = gym.vector.AutoresetMode.DISABLED
    ref = gym.vector.SyncVectorEnv([OptionsEnv] * 4, autoreset_mode=disabled)
    addresses = start_servers("tests.parity_envs:OptionsEnv", 2, 2, server_args=["--autoreset-mode", "Disabled"])
    with RemoteVectorEnv(addresses) as envs:
        for mask in ([True] * 4, [True, True, False, False], [True, False, True, False]):
            for options in ({}, {"x": 1}):
                ref.reset(seed=0)
                envs.reset(seed=0)
                ref.step(np.zeros(4, dtype=np.int64))
                envs.step(np.zeros(4, dtype=np.int64))
                want = ref.reset(options={**options, "reset_mask": np.array(mask)})[1]
                got = envs.reset(options={**options, "reset_mask": np.array(mask)})[1]
                assert_same(want, got, f"mask {mask}, options {options}: infos")
                assert list(got["options"][np.array(mask)]) == [repr(options)] * sum(mask)
    ref.close()


@pytest.fixture
def _fresh_other_server_warning(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(learner.client, "_OTHER_SERVER_WARNED", set())
    yield


@pytest.mark.usefixtures("_fresh_other_server_warning")
def test_closing_right_after_connecting_warns_of_no_other_server(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The Hold stream opened by a Handshake may reach the server only after the Release that closing
    sends: the server then refuses it, the session not its own. Within OTHER_SERVER_S of the Handshake,
    that was taken for calls spreading over several servers (a proxy or load balancer), and warned of
    (1 close in ~115 right after connecting). Made certain here: the Hold stream is opened only once
    the Release has ended the session, and read before the Release returns."""
    server = spawn_server("tests.parity_envs:OptionsEnv", 1)

    async def session() -> EnvClient:
        client = EnvClient(server.address, timeout=10)
        response = await client.handshake()
        released = asyncio.Event()
        real_hold, real_release = client.stub.Hold, client.stub.Release

        class LateHold:
            """The Hold call, as if it reached the server only once the Release had."""

            def __init__(self, request: pb.HoldRequest, **kwargs: Any) -> None:
                self.request, self.kwargs = request, kwargs
                self.call: Any = None

            async def read(self) -> Any:
                await released.wait()
                self.call = real_hold(self.request, **self.kwargs)
                return await self.call.read()

            def cancel(self) -> None:
                if self.call is not None:
                    self.call.cancel()

        async def release(request: pb.ReleaseRequest, **kwargs: Any) -> pb.ReleaseResponse:
            answer = await real_release(request, **kwargs)
            released.set()
            assert client._hold_watch is not None
            await asyncio.wait([client._hold_watch], timeout=5)  # (the watch reads the refusal meanwhile)
            return answer

        client.stub.Hold, client.stub.Release = LateHold, release
        client.start_session(response)
        await client.close()
        return client

    with caplog.at_level(logging.WARNING, logger="learner.client"):
        client = asyncio.run(session())
    assert client._hold_ended  # (the server refused the Hold stream: the case the test is about)
    assert not [r.getMessage() for r in caplog.records if "more than one env server" in r.getMessage()]
