"""`learner servers`: each server's env, round trip and holder, asked without a claim."""

from __future__ import annotations

import json

import pytest

from learner import RemoteVectorEnv
from learner.cli import main
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
