"""A fleet of servers that serve different envs whose spaces fit (variants of a task): which serves which."""

from __future__ import annotations

from learner import RemoteVectorEnv
from learner.specs import other_env_servers
from tests.conftest import StartServers


def test_only_the_servers_of_another_env_are_named_and_a_mixed_fleet_is_said(start_servers: StartServers) -> None:
    """learner train --env of the second server's env was refused as "expected the env the servers at A,B
    serve, <the first server's env>", false for B: the fleet's env was the first server's."""
    [v0] = start_servers("CartPole-v0")
    [v1] = start_servers("CartPole-v1")
    with RemoteVectorEnv([v0, v1]) as envs:
        served = envs.served_envs
    assert served == {v0: "CartPole-v0", v1: "CartPole-v1"}
    assert other_env_servers("CartPole-v1", served) == (
        f"the server at {v0} serves CartPole-v0 (a mixed fleet: the server at {v1} serves CartPole-v1)"
    )
    assert other_env_servers("CartPole-v0", served) == (
        f"the server at {v1} serves CartPole-v1 (a mixed fleet: the server at {v0} serves CartPole-v0)"
    )
    assert other_env_servers("Acrobot-v1", served) == (
        f"the server at {v0} serves CartPole-v0; the server at {v1} serves CartPole-v1"
    )
    assert other_env_servers("CartPole-v1", {v1: "CartPole-v1"}) == ""
    assert other_env_servers("X", {"a:1": "Y", "b:2": "Y", "c:3": "X"}) == (
        "the servers at a:1, b:2 serve Y (a mixed fleet: the server at c:3 serves X)"
    )
