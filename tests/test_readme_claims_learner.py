"""README claims about the learner side, checked on real servers and processes.

- gRPC keepalive notices a server that stops answering (SIGSTOP: its kernel still acks TCP) within its
  10 s + 5 s, long before the step's deadline ("Failures, recovery and security": every call has a
  deadline ... or by gRPC keepalive pings (every 10 s, 5 s to answer)).
- `learner train`'s local servers are started again when they die, at most 5 times a minute, then left
  down for the rest of the run with an error in the log, while training goes on.
- PPO's observation statistics (obs_rms) are updated by real observations only: not by the placeholders
  of an env whose reset raises, nor by the observations of a server that is down.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from learner import RemoteVectorEnv, ServerUnavailableError, rundir
from tests.conftest import CTRL_C_EXIT, QUIET, SpawnServer

# -- keepalive -------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_keepalive_notices_a_stopped_server_long_before_the_step_deadline(spawn_server: SpawnServer) -> None:
    """A server that stops (SIGSTOP) mid-run, with a step deadline of 120 s: the step fails as a lost server
    (ServerUnavailableError, a ping timeout) within keepalive's 10 s + 5 s (here: well under 60 s), not
    as a RemoteTimeoutError at the deadline."""
    server = spawn_server("CartPole-v1", 2)
    assert server.proc is not None
    envs = RemoteVectorEnv([server.address], timeout=120)
    try:
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))  # the step stream is open
        server.proc.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(ServerUnavailableError) as info:
            envs.step(np.zeros(2, dtype=np.int64))
        elapsed = time.monotonic() - start
        assert elapsed < 60, f"noticed after {elapsed:.1f} s: the deadline, not keepalive"
        assert "ping timeout" in str(info.value).lower(), info.value
        assert "did not answer a keepalive ping in time" in str(info.value), info.value
    finally:
        server.proc.send_signal(signal.SIGCONT)
        envs.close()


@pytest.mark.slow
def test_keepalive_notices_a_stopped_server_in_a_fault_tolerant_fleet(spawn_server: SpawnServer) -> None:
    """The same in a fault-tolerant fleet: its envs become unavailable (a failure, not a shutdown) while
    the other server's envs step on."""
    stopped, other = spawn_server("CartPole-v1", 2), spawn_server("CartPole-v1", 2)
    assert stopped.proc is not None
    envs = RemoteVectorEnv([stopped.address, other.address], timeout=120, fault_tolerant=True)
    try:
        envs.reset(seed=0)
        envs.step(np.zeros(4, dtype=np.int64))
        stopped.proc.send_signal(signal.SIGSTOP)
        start = time.monotonic()
        _, rewards, _, truncations, infos = envs.step(np.zeros(4, dtype=np.int64))
        elapsed = time.monotonic() - start
        assert elapsed < 60, f"noticed after {elapsed:.1f} s: the deadline, not keepalive"
        assert infos["env_unavailable"].tolist() == [True, True, False, False]
        assert truncations[:2].all() and rewards.tolist() == [0.0, 0.0, 1.0, 1.0]
        stats = envs.fault_stats()
        assert (stats.failures, stats.shutdowns, stats.servers_down) == (1, 0, 1)
    finally:
        stopped.proc.send_signal(signal.SIGCONT)
        envs.close()


# -- learner train's local servers: 5 restarts a minute --------------------------------------------------------


def _wait_for(proc: subprocess.Popen[str], log: Path, condition: Any, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"learner train exited ({proc.returncode}) before {what}:\n{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:g} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.needs_torch
def test_learner_train_starts_a_dying_local_server_again_5_times_a_minute_then_leaves_it_down(tmp_path: Path) -> None:
    """`learner train` with its own 2 local servers (the default options: 5 restarts a minute), of which
    server 0 kills itself at its first step, every time it is started. It is started again 5 times, then
    left down with an error in the log; the run trains on with the other server's envs."""
    run_dir = tmp_path / "run"
    kwargs = {"die_at": 1, "victim": "server-0.sock"}  # (LocalServers' socket names: server-<i>.sock)
    argv = [sys.executable, "-m", "learner", "train", "--env", "tests.claims_envs:ConstantEnv"]
    argv += ["--env-kwargs", json.dumps(kwargs), "--num-servers", "2", "--envs-per-server", "1"]
    argv += ["--transport", "unix", "--num-steps", "8", "--total-timesteps", "1e9", "--no-stop-at-return"]
    argv += ["--no-plot", "--no-progress", "--no-tensorboard", "--run-dir", str(run_dir)]
    log = tmp_path / "learner.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
    try:
        # 5 restarts, backing off 0.5, 1, 2, 4 and 8 s: ~16 s plus 6 starts of a server.
        _wait_for(proc, log, lambda: "leaving it down" in log.read_text(), "'leaving it down'", timeout=150)
        down_at = len(rundir.read_jsonl(run_dir / rundir.METRICS))
        _wait_for(
            proc,
            log,
            lambda: len(rundir.read_jsonl(run_dir / rundir.METRICS)) >= down_at + 3,
            "3 updates after server 0 was left down",
            timeout=60,
        )
        time.sleep(1.0)  # (longer than any restart's first wait: a 6th restart would be logged by now)
    finally:
        proc.send_signal(signal.SIGINT)  # stops at the next step, with a checkpoint and summary
        try:
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    text = log.read_text()
    assert proc.returncode == CTRL_C_EXIT, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    server_0 = r"env server local-0 \(\S+\) .*"  # (as metrics name it)
    restarts = re.findall(
        server_0 + r"starting it again on the same address in \S+ s \(restart (\d) of at most (\d)", text
    )
    assert restarts == [(str(k), "5") for k in range(1, 6)], text[-4000:]
    left_down = re.findall(server_0 + "it was started again 5 times within 60 s: leaving it down", text)
    assert len(left_down) == 1, text[-4000:]
    assert "env server local-1 " not in text, "the other server never died"
    summary = rundir.read_json(run_dir / rundir.SUMMARY)
    # Each of its 6 lives was seen by the learner (it died stepping): 6 failures, 5 of them restarts.
    assert (summary["failures"], summary["server_restarts"]) == (6, 5), summary
    last = rundir.read_jsonl(run_dir / rundir.METRICS)[-1]
    assert last["envs_unavailable"] == 1 and last["batch_size"] > 0, last  # trained on with server 1's env


# -- obs_rms: real observations only ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.needs_torch
def test_observation_statistics_leave_out_placeholders_and_a_down_server(
    spawn_server: SpawnServer, tmp_path: Path
) -> None:
    """Server a: 2 envs, env 0's every reset raises (out of order, a placeholder of zeros all run long).
    Server b: 2 envs, its process dies at its 20th env step and stays down (its envs keep their last
    observation). Every real observation is [4, 4]: the statistics' mean stays 4 and its count is the
    number of real observations (the first reset's 3, then each step's available envs)."""
    from learner.checkpoint import load_checkpoint
    from learner.config import Args
    from learner.train import train

    env = "tests.claims_envs:ConstantEnv"
    a = spawn_server(env, 2, "--env-kwargs", json.dumps({"broken_env": 0}))
    b = spawn_server(env, 2, "--env-kwargs", json.dumps({"die_at": 20}))
    run = tmp_path / "run"
    args = Args(
        servers=f"{a.address},{b.address}",
        norm_obs=True,
        num_steps=8,
        total_timesteps=4 * 8 * 6,
        timeout=10.0,
        run_dir=str(run),
        **QUIET,
    )
    summary = train(args)
    assert summary["stop_reason"] == "total_timesteps", summary
    assert b.proc is not None and b.proc.poll() == -signal.SIGKILL, "server b died as planned"
    checkpoint = load_checkpoint(rundir.list_checkpoints(run)[-1])
    counters, stats = checkpoint["counters"], checkpoint["obs_rms"]
    # Env a/0 gave no transition all run; b's two envs none after its death (9 vector steps and more).
    assert counters["env_steps_lost"] >= counters["global_step"] // 4 + 2 * 9, counters
    real = 3 + counters["global_step"] - counters["env_steps_lost"]
    assert float(stats["count"]) == pytest.approx(real + 1e-4, abs=1e-6), (float(stats["count"]), real, counters)
    # A placeholder (zeros) in the statistics would pull the mean down by 4/real or more.
    assert np.allclose(stats["mean"].numpy(), 4.0, rtol=0, atol=1e-3), stats["mean"]
    assert float(stats["var"].max()) < 1e-3, stats["var"]
