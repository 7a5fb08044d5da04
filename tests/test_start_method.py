"""Async vectorization's workers are forked on Linux whatever multiprocessing's default start method (since Python
3.14 it is forkserver there): a worker inherits what the server's process set up (the ids it registered, such as
ale_py's ALE/..., its logging as --log-format configured it), which a worker started by a forkserver would lack
(see env_server.envs.worker_context)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from env_server import envs

# A server (env_server's CLI, as `python -m env_server` runs it) in a process whose multiprocessing default is
# forkserver (3.14's on Linux), serving an id registered in this process only (as the server registers ale_py's),
# whose env logs from its constructor in the workers.
SERVER = """
import multiprocessing, runpy, sys
import gymnasium as gym

multiprocessing.set_start_method("forkserver", force=True)
gym.register("RegisteredHere-v0", entry_point="logs_in_workers:LogsInWorkers")
sys.argv = ["env_server", *sys.argv[1:]]
runpy.run_module("env_server", run_name="__main__", alter_sys=True)
"""

ENV = """
import logging, multiprocessing
import gymnasium as gym
import numpy as np

class LogsInWorkers(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self):
        if multiprocessing.parent_process() is not None:
            logging.getLogger("logs_in_workers").warning("made in a worker")

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(1, np.float32), {}

    def step(self, action):
        return np.zeros(1, np.float32), 0.0, False, False, {}
"""


def test_workers_are_forked_on_linux_and_started_as_the_platform_does_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "platform", "linux")
    assert envs.worker_context() == "fork"
    for platform in ("darwin", "win32"):  # (fork unsafe, or none: the platform's default)
        monkeypatch.setattr(sys, "platform", platform)
        assert envs.worker_context() is None


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers are forked on Linux only")
def test_a_server_whose_multiprocessing_default_is_forkserver_forks_its_async_workers(tmp_path: Path) -> None:
    """Started by a forkserver, the workers would not know the id (gymnasium's NameNotFound, which the server said
    as the pipe's ConnectionResetError), nor log as JSON."""
    (tmp_path / "logs_in_workers.py").write_text(textwrap.dedent(ENV))
    argv = [sys.executable, "-c", SERVER, "--env", "RegisteredHere-v0", "--num-envs", "2"]
    argv += ["--vectorization", "async", "--log-format", "json", "--port", "0"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]])}  # (conftest's)
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        listening = proc.stdout.readline()
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert listening.startswith("listening on "), stderr
    assert proc.returncode == 0, stderr
    made = [line for line in stderr.splitlines() if "made in a worker" in line]
    assert len(made) == 2, stderr
    for line in made:  # (the worker's logging, as the server's --log-format json configured it)
        assert json.loads(line)["logger"] == "logs_in_workers", stderr
