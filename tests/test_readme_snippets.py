"""The README's Quickstart snippets run as printed.

- ``myenvs.py`` (marked ``<!-- snippet: myenvs.py -->``): a real env server serves ``myenvs:GoRight``
  (and its ``goal`` kwarg) and ``myenvs:GoRight-v0`` (registered with a 200-step time limit), and
  they step as the README says.
- The training loop (marked ``<!-- snippet: training-loop -->``): self-contained (it starts its own
  local servers), it runs as printed, loop count and all.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from learner import RemoteVectorEnv
from tests.conftest import SpawnServer

README = Path(__file__).resolve().parent.parent / "README.md"


def snippet(name: str) -> str:
    """The fenced code block right after ``<!-- snippet: NAME -->`` in the README."""
    text = README.read_text()
    match = re.search(rf"<!-- snippet: {re.escape(name)} -->\s*```\w*\n(.*?)^```", text, re.S | re.M)
    assert match, f"README.md has no fenced block after <!-- snippet: {name} -->"
    return match.group(1)


@pytest.fixture
def myenvs(tmp_path: Path) -> dict[str, str]:
    """The README's myenvs.py in a folder of its own; the environment a server needs to import it."""
    (tmp_path / "myenvs.py").write_text(snippet("myenvs.py"))
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": pythonpath}


def test_myenvs_goright_serves_and_steps(spawn_server: SpawnServer, myenvs: dict[str, str]) -> None:
    """`env-server --env myenvs:GoRight`: right pays +1, left -1 (not below 0), the goal (10) terminates."""
    server = spawn_server("myenvs:GoRight", 4, environ=myenvs)
    with RemoteVectorEnv([server.address], timeout=10) as envs:
        assert envs.num_envs == 4
        assert envs.single_action_space.n == 2  # type: ignore[attr-defined]
        obs, _ = envs.reset(seed=0)
        np.testing.assert_array_equal(obs, np.zeros((4, 1), dtype=np.float32))
        # env 0 walks left (stays at 0, reward -1); the others walk right, to the goal in 10 steps
        actions = np.array([0, 1, 1, 1])
        for step in range(1, 11):
            obs, rewards, terminations, truncations, _ = envs.step(actions)
            np.testing.assert_array_equal(rewards, [-1.0, 1.0, 1.0, 1.0])
            np.testing.assert_allclose(obs[:, 0], [0.0, step / 10, step / 10, step / 10])
            assert not truncations.any()
            assert terminations.tolist() == [False, step == 10, step == 10, step == 10]


def test_myenvs_goal_kwarg_and_registered_time_limit(spawn_server: SpawnServer, myenvs: dict[str, str]) -> None:
    """`--env-kwargs '{"goal": 20}'` moves the goal; `myenvs:GoRight-v0` gets gymnasium's 200-step limit."""
    far = spawn_server("myenvs:GoRight", 1, "--env-kwargs", json.dumps({"goal": 20}), environ=myenvs)
    limited = spawn_server("myenvs:GoRight-v0", 1, environ=myenvs)
    with RemoteVectorEnv([far.address], timeout=10) as envs:
        envs.reset(seed=0)
        ends = [envs.step(np.array([1]))[2][0] for _ in range(20)]
        assert ends == [False] * 19 + [True]
    with RemoteVectorEnv([limited.address], timeout=10) as envs:
        assert envs.spec is not None and envs.spec.max_episode_steps == 200
        envs.reset(seed=0)
        for step in range(1, 201):  # always left: never at the goal, cut by the time limit
            _, _, terminations, truncations, _ = envs.step(np.array([0]))
            assert not terminations[0]
            assert truncations[0] == (step == 200)


@pytest.mark.slow
def test_training_loop_snippet_runs_as_printed() -> None:
    """The self-contained loop: 2 local servers x 4 CartPole envs, 1,000 random steps, servers gone after."""
    code = snippet("training-loop")
    assert "local_servers(" in code and "RemoteVectorEnv(addresses)" in code
    namespace: dict[str, object] = {"__name__": "readme_snippet"}
    exec(compile(code, f"{README}:training-loop", "exec"), namespace)
    obs = namespace["obs"]
    assert isinstance(obs, np.ndarray) and obs.shape == (8, 4)
    envs = namespace["envs"]
    assert isinstance(envs, RemoteVectorEnv) and envs.closed
    addresses = namespace["addresses"]
    assert isinstance(addresses, list) and len(addresses) == 2
    for address in addresses:  # unix:PATH, removed with the servers when the block ended
        assert not Path(str(address).removeprefix("unix:")).exists()
