"""Async vectorization's workers, forked from a process that used gRPC (a RemoteVectorEnv dropped, left to the garbage
collector: a notebook that stepped remote envs, then builds an in-process async fleet), do not collect that garbage
in the fork (where gRPC's threads are not): a worker that did hung, spinning in its first garbage collection, or
crashed (see env_server.envs._garbage_frozen)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A process of its own (its garbage, its gc state): a RemoteVectorEnv over a local server, stepped, then dropped in a
# reference cycle (only the collector frees it: automatic collection is off meanwhile, so it is still there when the
# workers fork), then an async vector env built, whose envs' constructor collects garbage in the worker at once (a
# worker's first collection comes sooner or later: here, the test need not wait for it), reset and stepped; twice.
SCRIPT = """
import gc
import numpy as np
from env_server import ServerConfig, build_vector_env
from learner import RemoteVectorEnv
from learner.local import LocalServers

class Cycle:
    pass

with LocalServers("CartPole-v1", 1, 2) as servers:
    for attempt in range(2):
        gc.disable()
        remote = RemoteVectorEnv(servers.addresses)
        remote.reset(seed=0)
        remote.step(np.zeros(remote.num_envs, dtype=np.int64))
        remote.close()
        cycle = Cycle()
        cycle.me, cycle.remote = cycle, remote
        del cycle, remote
        config = ServerConfig(env="tests.collecting_envs:CollectingCartPole", num_envs=2, vectorization="async")
        envs = build_vector_env(config)
        gc.enable()
        envs.reset(seed=attempt)
        for _ in range(20):
            envs.step(np.zeros(2, dtype=np.int64))
        envs.close()
        print("built", attempt, flush=True)
"""

# (the script takes a few seconds; its workers hung for good without the fix)
LIMIT_S = 90


@pytest.mark.slow
@pytest.mark.timeout(LIMIT_S + 60)
def test_async_workers_forked_after_grpc_garbage_run() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # (its workers too, killed with it where they hang)
    )
    try:
        out, _ = proc.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"an async vector env built after gRPC's garbage was left hung (its workers, say):\n{out[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-3000:]
    assert [line for line in out.splitlines() if line.startswith("built ")] == ["built 0", "built 1"], out
