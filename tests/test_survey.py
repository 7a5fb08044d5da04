"""`learner servers`: each server's env, round trip and holder, asked without a claim."""

from __future__ import annotations

import contextlib
import json
import time

import pytest

from learner import RemoteVectorEnv
from learner.cli import main
from tests.balancer import CallBalancer
from tests.conftest import StartServers


def test_learner_servers_shows_each_server_and_who_holds_it_without_claiming_it(
    start_servers: StartServers, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = start_servers("CartPole-v1", 2, 3, transport="tcp")
    with RemoteVectorEnv([a], client_name="trainer-1") as envs:
        envs.reset(seed=0)
        assert main(["servers", "--servers", f"{a},{b}"]) == 0
        text = capsys.readouterr().out
        envs.step(envs.action_space.sample())  # (the survey took nothing from it)
    assert f"{a}  CartPole-v1 x3 (sync, NextStep autoreset, 500-step limit)  round trip" in text
    assert "    claimed by 'trainer-1' from ipv4:127.0.0.1:" in text and "    free (no learner holds it)" in text
    assert "action Discrete(2)" in text and "runs envfleet " in text
    # (b's spaces and versions are a's: said once, as for 64 servers, where they were 128 lines the same)
    assert text.count("runs envfleet ") == 1 and text.count("\n    same spaces and versions as above\n") == 1
    assert text.rstrip().endswith("2 servers, 2 answering, 6 envs")
    assert main(["servers", f"{a},{b}", "--json"]) == 0  # (ADDRESSES, as --servers ADDRESSES)
    rows = json.loads(capsys.readouterr().out)
    assert [r["address"] for r in rows] == [a, b] and [r["claimed_by"] for r in rows] == ["", ""]  # (closed since)
    assert rows[0]["num_envs"] == 3 and rows[0]["versions"]["gymnasium"] and rows[0]["round_trip_ms"] > 0
    assert rows[0]["env_kwargs"] == ""  # (none; null from a server too old to say)


def test_learner_servers_shows_the_kwargs_a_servers_envs_are_made_with(
    start_servers: StartServers, capsys: pytest.CaptureFixture[str]
) -> None:
    [a] = start_servers("CartPole-v1", 1, 1, transport="tcp", env_kwargs={"sutton_barto_reward": True})
    assert main(["servers", "--servers", a]) == 0
    text = capsys.readouterr().out
    assert '500-step limit, env kwargs {"sutton_barto_reward": true})' in text
    assert text.rstrip().endswith("1 server, 1 answering, 1 env")  # (not "1 envs")


def test_a_box_of_differing_bounds_is_shown_on_one_line() -> None:
    """numpy broke the bounds over lines, flush left, which read as the next entries of the server's block."""
    import gymnasium as gym
    import numpy as np

    from env_server import codec
    from env_server.rpc import env_pb2 as pb
    from learner.survey import _space

    wire = pb.Space()
    bounds = np.arange(1, 21, dtype=np.float32) * 1.5
    codec.encode_space(gym.spaces.Box(-bounds, bounds, dtype=np.float32), wire, "observation_space")
    shown = _space(wire, "observation_space")
    assert "\n" not in shown and shown.startswith("Box([ -1.5 -3. -4.5") and shown.endswith("(20,), float32)")


@pytest.mark.slow
def test_learner_servers_says_which_do_not_answer_and_exits_1(
    start_servers: StartServers, capsys: pytest.CaptureFixture[str]
) -> None:
    [a] = start_servers("CartPole-v1", 1, 1, transport="tcp")
    [other] = start_servers("Acrobot-v1", 1, 1, transport="tcp")
    alias = f"localhost:{a.rpartition(':')[2]}"
    assert main(["servers", "--servers", f"{a},127.0.0.1:1,{other},{alias}"]) == 1
    text = capsys.readouterr().out
    assert "127.0.0.1:1  not answering: connection refused" in text
    assert text.rstrip().splitlines()[-1] == (
        "3 servers (4 addresses), 2 answering, 2 envs; their spaces or autoreset modes differ: they cannot step as one "
        "fleet; some are one server listed under two names"
    )


def test_servers_are_diagnosed_all_at_once_and_timed_a_few_at_a_time(
    start_servers: StartServers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Diagnoses ran on asyncio's executor (a few threads, each held up to 1 s by an address that does not
    answer: 64 such took 23 s of a 5-s survey); 64 servers' round trips timed at once measured the survey's
    own loop (78 ms where each took 1.6 ms). Each diagnosis has a thread now, and a few servers are timed at once."""
    import asyncio
    import threading
    import time

    from learner import survey as surveying
    from learner.client import EnvClient

    diagnosing, most_diagnosing, lock = [0], [0], threading.Lock()
    real_diagnose = surveying.diagnose

    def slow_diagnose(address: str, timeout: float, **kwargs: object) -> str | None:
        with lock:
            diagnosing[0] += 1
            most_diagnosing[0] = max(most_diagnosing[0], diagnosing[0])
        time.sleep(0.5)
        with lock:
            diagnosing[0] -= 1
        return real_diagnose(address, timeout, **kwargs)  # type: ignore[arg-type]

    calls: dict[int, int] = {}
    timed, most_timed = [0], [0]
    real_get_spec = EnvClient.get_spec_response

    async def counted_get_spec(self: EnvClient, *, server_id_only: bool = False) -> object:
        calls[id(self)] = calls.get(id(self), 0) + 1
        assert server_id_only == (calls[id(self)] > 1)  # (the spec once; the timed round trips ask for the id alone)
        if calls[id(self)] == 1:  # (each server's first: not timed)
            return await real_get_spec(self)
        timed[0] += 1
        most_timed[0] = max(most_timed[0], timed[0])
        # (where other servers' timed calls come in: long enough for them to, however far apart under load their
        # diagnoses end, which each take 0.5 s in a thread of their own: with 2 ms, 3 of 4 overlapped at load 12)
        await asyncio.sleep(0.1)
        try:
            return await real_get_spec(self, server_id_only=True)
        finally:
            timed[0] -= 1

    monkeypatch.setattr(surveying, "diagnose", slow_diagnose)
    monkeypatch.setattr(EnvClient, "get_spec_response", counted_get_spec)
    servers = start_servers("CartPole-v1", 6, 1, transport="tcp")
    nowhere = [f"127.0.0.1:{port}" for port in range(1, 11)]  # (nothing listens: said at once)
    infos = surveying.survey(",".join(servers + nowhere), timeout=5)
    assert most_diagnosing[0] == 16  # (a thread each; asyncio's executor ran min(32, CPUs + 4) at once)
    assert [i.error for i in infos[:6]] == [""] * 6 and all("connection refused" in i.error for i in infos[6:])
    assert most_timed[0] == surveying.TIMED_AT_ONCE and sum(calls.values()) == 6 * (1 + surveying.ROUND_TRIPS)


def test_an_address_whose_connections_get_no_answer_is_said_so_at_once() -> None:
    """Its diagnosis takes its whole second (a connect that times out): given no more than that to tell, it was
    lost, and the survey waited the whole timeout to say "nothing answered within 5 s"."""
    import socket

    from learner.survey import survey

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        queued = [socket.socket() for _ in range(4)]  # (its backlog full: the next connection's SYN is dropped)
        try:
            for waiting in queued:
                waiting.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    waiting.connect(("127.0.0.1", port))
            time.sleep(0.3)
            [info] = survey(f"127.0.0.1:{port}", timeout=5)
            [short] = survey(f"127.0.0.1:{port}", timeout=0.2)  # (its diagnosis given the survey's timeout)
        finally:
            for waiting in queued:
                waiting.close()
    assert info.error == "a plain connect gets no answer within 1 s", info.error
    assert short.error == "a plain connect gets no answer within 0.2 s", short.error


def test_an_address_whose_calls_reach_several_servers_is_not_usable(
    start_servers: StartServers, capsys: pytest.CaptureFixture[str]
) -> None:
    """Behind a proxy spreading calls over two servers, `learner servers` said "1 server, 1 answering, 4 envs" (the
    last answer's id kept), though a learner's session there fails at its first step."""
    backends = start_servers("CartPole-v1", 2, 2, transport="tcp")
    with CallBalancer(backends) as balancer:
        port = int(balancer.address.rpartition(":")[2])
        assert main(["servers", "--servers", f"127.0.0.1:{port}"]) == 1
        alone = capsys.readouterr().out
        # Listed with the servers it reaches: they are counted once (was "3 servers, 2 answering").
        assert main(["servers", "--servers", ",".join([*backends, f"127.0.0.1:{port}"])]) == 1
        together = capsys.readouterr().out
    text = alone
    assert text.startswith(f"127.0.0.1:{port}  not usable: its calls reached 2 different env servers (server ids "), (
        text
    )
    assert "give each server its own address (or balance connections, not calls)" in text
    assert text.rstrip().splitlines()[-1] == "1 server, 0 answering, 0 envs, 1 address not usable", text
    assert together.rstrip().splitlines()[-1] == (
        "2 servers (3 addresses), 2 answering, 4 envs, 1 address not usable; an address not usable reaches servers "
        "listed by their own"
    ), together
