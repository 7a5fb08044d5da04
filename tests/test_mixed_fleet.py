"""A fleet of servers that serve different envs whose spaces fit (variants of a task): which serves which."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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


@pytest.mark.needs_torch
@pytest.mark.slow
def test_a_mixed_fleet_trains_as_its_first_server_s_env_and_resumes_so(
    start_servers: StartServers, tmp_path: Path
) -> None:
    """Its env is the first server's, as config.json records it: --env of that env trains (the others warned
    of), and so does --resume on the same servers (the review found a draft that refused it); --env of
    another server's env is refused naming which serves what, and a --resume on them listed in another order
    says that the order is what differs."""
    from learner.train import Args, resume_args, train

    [v0] = start_servers("CartPole-v0")
    [v1] = start_servers("CartPole-v1")
    servers = f"{v0},{v1}"
    quiet = {"progress": False, "tensorboard": False, "plot": False, "num_steps": 8}
    run = tmp_path / "run"
    train(Args(env="CartPole-v0", servers=servers, total_timesteps=16, run_dir=str(run), **quiet))  # type: ignore[arg-type]
    train(resume_args(str(run), total_timesteps=32))
    with pytest.raises(ValueError, match=re.escape(f"list one of CartPole-v0 first, {v0} say, as the run did)")):
        train(resume_args(str(run), total_timesteps=48, servers=f"{v1},{v0}"))  # (the order alone differs)
    with pytest.raises(ValueError, match=re.escape(f"--env: expected servers of CartPole-v1, but the server at {v0}")):
        train(Args(env="CartPole-v1", servers=servers, total_timesteps=16, run_dir=str(tmp_path / "b"), **quiet))  # type: ignore[arg-type]
