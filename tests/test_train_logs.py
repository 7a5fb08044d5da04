"""What `learner train` logs of its fleet's faults, as an operator reads it: each line once (or once in a
while, with a count), naming the server, at a level that fits, and the cost counted where a user looks."""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
from learner import RemoteVectorEnv, ServerUnavailableError, faults, rundir
from learner.config import Args
from learner.fleet import FleetChange
from learner.train import train
from tests.conftest import QUIET as QUIET_RUN
from tests.conftest import SpawnServer, StartServers, fleet

QUIET: dict[str, Any] = {**QUIET_RUN, "checkpoint_every": 0}
K = 2  # envs per server


def said(caplog: pytest.LogCaptureFixture, text: str, level: int | None = None) -> list[str]:
    """The messages logged that hold ``text`` (at ``level`` only, if given)."""
    return [r.getMessage() for r in caplog.records if text in r.getMessage() and (level is None or r.levelno == level)]


@pytest.mark.slow
def test_rollouts_dropped_for_an_env_error_are_said_once_a_minute_and_their_env_steps_count_as_lost(
    start_servers: StartServers, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--no-fault-tolerant, env 0 raises in its steps 20, 21 and 40: the rollouts of those steps are dropped
    (every env starting over), three in all, two in a row. The first drop is a warning, and so is the second,
    the second in a row (a third would stop the run), the third is DEBUG (within a minute of the last line,
    after a rollout learned from); the fleet's changes (every env restarted) reach on_fleet_change, the CLI's
    stdout line, with those warnings only; and every env step of a dropped rollout counts as lost (summary.json's
    env_steps_lost, hence the closing faults line), each env's raise as an env error. (Each drop was a warning
    and a stdout line, and none counted: 40 % of a run's steps thrown away without a number saying so.)"""
    kwargs = {"raise_from": 20, "raise_until": 22, "raise_at": 40, "length": 100}
    (address,) = start_servers("tests.envs:FaultyEnv", 1, K, env_kwargs=kwargs)
    changes: list[FleetChange] = []
    args = Args(
        env="tests.envs:FaultyEnv",
        servers=address,
        num_steps=8,
        total_timesteps=90,
        fault_tolerant=False,
        run_dir=str(tmp_path / "run"),
        **QUIET,
    )
    with caplog.at_level(logging.DEBUG, logger="learner.train"):
        summary = train(args, on_fleet_change=changes.append)
    dropped = said(caplog, "dropping this rollout, every env starts over")
    warned = said(caplog, "dropping this rollout", logging.WARNING)
    assert len(dropped) == 3 and len(warned) == 2, dropped
    assert "step 20 failed on purpose (env 0)" in warned[0] and "step 21 failed on purpose" in warned[1], warned
    assert warned[0].endswith(
        "; 1 rollout dropped so far (one such line a minute at most), its env steps counted in env_steps_lost"
    ), warned
    assert warned[1].endswith(
        "; 2 in a row (3 in a row stop the run), 2 rollouts dropped so far (1 since the last such line; one a "
        "minute at most), their env steps counted in env_steps_lost"
    ), warned
    assert len(changes) == 2 and all(c.restarted == K and not c.added and not c.removed for c in changes)
    # Rollouts of 8 steps x 2 envs: 16, 32; the third dropped at its fourth step (life steps 17-20, 20 the
    # raise's, counted as a fault-tolerant run counts it), the fourth at its first (21); 22-29, 30-37; the
    # seventh at its third (38-40); 41-48. Every step of a dropped rollout is lost, the raise's too.
    rows = rundir.read_jsonl(tmp_path / "run" / rundir.METRICS)
    assert [r["global_step"] for r in rows] == [16, 32, 58, 74, 96]
    assert [r["env_steps_lost"] for r in rows] == [0, 0, 2 * 4 + 2 * 1, 0, 2 * 3]
    assert [r["env_errors"] for r in rows] == [0, 0, 2, 0, 1]
    assert (summary["env_steps_lost"], summary["env_errors"]) == (16, 3)
    assert summary["stop_reason"] == "total_timesteps"


@pytest.mark.slow
def test_an_env_error_names_the_server_and_its_own_index_there(
    spawn_server: SpawnServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Fault-tolerant, the env that raised is named by its index in the fleet, its server's address, and its
    index on that server, as that server's log knows it (env 3 of the fleet is env 1 of the second server)."""
    a = spawn_server("tests.envs:FaultyEnv", K, "--env-kwargs", '{"length": 100}')
    b = spawn_server("tests.envs:FaultyEnv", K, "--env-kwargs", '{"raise_at": 5, "fault_env": 1, "length": 100}')
    args = Args(
        env="tests.envs:FaultyEnv",
        servers=f"{a.address},{b.address}",
        num_steps=8,
        total_timesteps=2 * K * 8,
        run_dir=str(tmp_path / "run"),
        **QUIET,
    )
    with caplog.at_level(logging.WARNING, logger="learner.train"):
        summary = train(args)
    assert summary["env_errors"] == 1
    (line,) = said(caplog, "raised (its episode was cut short")
    assert line.startswith(
        f"env 3 (env server {b.address}, its env 1) raised (its episode was cut short, and the env reset): step: "
        "ValueError: step 5 failed on purpose"
    ), line


@pytest.mark.slow
def test_every_server_down_is_said_once_with_when_the_run_gives_up_and_why_reconnects_fail(
    spawn_server: SpawnServer, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both servers SIGKILLed after the first update: one warning says that every server is down and when
    the run gives up (--give-up-after, which then ends it), rather than only "the run stops after 3 such
    rollouts", which did not; and the lines that say a server is still down give the reconnects' cause,
    "connection refused", not "no connection within 1 s" alone."""
    monkeypatch.setattr(faults, "STILL_DOWN_LOG_S", 1.0)  # (20 s: too long to wait for here)
    a, b = spawn_server("CartPole-v1", K), spawn_server("CartPole-v1", K)

    def kill_both(row: dict[str, Any]) -> None:
        if row["update"] == 1:
            a.kill()
            b.kill()

    args = Args(
        env="CartPole-v1",
        servers=f"{a.address},{b.address}",
        num_steps=8,
        total_timesteps=10**6,
        give_up_after=4.0,
        connect_timeout=1.0,  # (a server killed: nothing to wait for, however loaded the machine)
        run_dir=str(tmp_path / "run"),
        **QUIET,
    )
    with caplog.at_level(logging.INFO, logger="learner"), pytest.raises(ServerUnavailableError, match="no env server"):
        train(args, on_update=kill_both)
    down = said(caplog, "every env server is down")
    assert len(down) == 1, down
    assert down[0].startswith(f"every env server is down ({a.address}, {b.address}): stepping waits for one to come")
    assert "the fleet gives up in 4 s (give_up_after 4 s; `learner train --give-up-after`)" in down[0], down[0]
    assert [r.levelno for r in caplog.records if "every env server is down" in r.getMessage()] == [logging.WARNING]
    empty = said(caplog, "no env gave a transition in this rollout")
    assert empty and all("the run stops after" not in line for line in empty), empty
    still = said(caplog, " still down after ", logging.WARNING)
    assert still, [r.getMessage() for r in caplog.records]
    assert all("the last: no connection: connection refused (tried for 1 s)" in line for line in still), still


@pytest.mark.slow
def test_a_server_back_as_the_same_process_is_info_and_one_restarted_a_warning(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Back after its env hung past the step deadline (the same process, its envs reset): INFO, as after a
    planned shutdown; its loss was the warning. Back as a new process (killed, started again on its port): a
    WARNING still, naming the restart (the one lost crashed or was killed: its operator should know). (Each
    server lost once: one lost again before it settled is flapping, its return DEBUG.)"""
    a = spawn_server("tests.envs:FaultyEnv", K, "--env-kwargs", '{"length": 1000}')
    b = spawn_server("tests.envs:FaultyEnv", K, "--env-kwargs", '{"hang_at": 3, "hang_s": 3, "length": 1000}')
    zeros = np.zeros(2 * K, dtype=np.int64)
    caplog.set_level(logging.DEBUG, logger="learner")

    def step_until_back(envs: RemoteVectorEnv, reconnects: int) -> None:
        deadline = time.monotonic() + 30.0
        while envs.fault_stats().reconnects < reconnects or not envs.available.all():
            assert time.monotonic() < deadline, "the server did not come back within 30 s"
            envs.step(zeros)

    with RemoteVectorEnv([a.address, b.address], fault_tolerant=True, timeout=2.0, backoff=(0.05, 0.5)) as envs:
        envs.reset(seed=0)
        step_until_back(envs, 1)  # (b's third step hangs 3 s: lost at the deadline, back once it answers)
        a.kill()
        envs.step(zeros)  # the loss
        a.start()
        step_until_back(envs, 2)
        assert envs.fault_stats().server_restarts == 1
    back = [r for r in caplog.records if " is back after " in r.getMessage()]
    assert [r.getMessage().split(" is back")[0] for r in back] == [f"env server {b.address}", f"env server {a.address}"]
    assert [(r.levelno, "(same process)" in r.getMessage()) for r in back] == [
        (logging.INFO, True),
        (logging.WARNING, False),
    ], [r.getMessage() for r in back]
    assert "(restarted: server id " in back[1].getMessage() and "a new process" in back[1].getMessage()


@pytest.mark.slow
def test_the_fleet_stepping_again_after_every_server_was_down_is_a_warning(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A lone server hung past the step deadline and back as the same process: "every env server is down" was
    a WARNING, its return INFO ("same process"), so at the default log level the alarm had no end."""
    server = spawn_server("tests.envs:FaultyEnv", K, "--env-kwargs", '{"hang_at": 3, "hang_s": 3, "length": 1000}')
    zeros = np.zeros(K, dtype=np.int64)
    caplog.set_level(logging.INFO, logger="learner")
    with RemoteVectorEnv([server.address], fault_tolerant=True, timeout=1.0, backoff=(0.05, 0.5)) as envs:
        envs.reset(seed=0)
        deadline = time.monotonic() + 30.0
        while envs.fault_stats().reconnects < 1 or not envs.available.all():
            assert time.monotonic() < deadline, "the server did not come back within 30 s"
            envs.step(zeros)
    assert said(caplog, "every env server is down", logging.WARNING)
    [back] = said(caplog, "the fleet steps again", logging.WARNING)
    assert re.fullmatch(
        rf"env server {re.escape(server.address)} is back: the fleet steps again \(every server was down for "
        r"\d+\.\d s\)",
        back,
    ), back
    assert said(caplog, " is back after ", logging.INFO)  # (its own line: the same process)


@pytest.mark.slow
def test_an_outage_that_servers_joining_ended_is_not_said_to_end_at_a_later_return(
    spawn_server: SpawnServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Every server down, then others joining by refresh() (compose down and up, new addresses): the outage
    is over. A later loss and return of one server while another steps said "the fleet steps again (every
    server was down for 24.1 s)"."""
    a, b, c = (spawn_server("CartPole-v1", K) for _ in range(3))
    name, listed = fleet(a.address)
    caplog.set_level(logging.INFO, logger="learner")
    with RemoteVectorEnv(name, fault_tolerant=True, timeout=1.0, backoff=(0.05, 0.5)) as envs:
        envs.reset(seed=0)
        a.kill()
        deadline = time.monotonic() + 30.0
        while not said(caplog, "every env server is down", logging.WARNING):
            assert time.monotonic() < deadline, "every server down was not said within 30 s"
            envs.step(np.zeros(K, dtype=np.int64))
        listed[:] = [b.address, c.address]
        envs.refresh(wait=30)
        assert envs.addresses == [b.address, c.address]
        c.kill()
        c.start()
        deadline = time.monotonic() + 30.0
        while envs.fault_stats().reconnects < 1 or not envs.available.all():
            assert time.monotonic() < deadline, "the server did not come back within 30 s"
            envs.step(np.zeros(envs.num_envs, dtype=np.int64))
    assert not said(caplog, "the fleet steps again"), said(caplog, "the fleet steps again")


@pytest.mark.slow
def test_a_new_best_is_said_at_info_once_a_minute_at_most(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Early in a run nearly every update is a new best (best.pt written each time): one INFO line each was most
    of a run's INFO log. The first is said at once, the others at DEBUG until a minute has passed."""
    args = Args(
        env="CartPole-v1",
        backend="gym",
        num_envs=4,
        num_steps=32,
        total_timesteps=4 * 32 * 25,
        seed=1,
        run_dir=str(tmp_path / "run"),
        **QUIET,
    )
    with caplog.at_level(logging.DEBUG, logger="learner.train"):
        summary = train(args)
    assert summary["best_step"] is not None
    info = said(caplog, "best so far", logging.INFO)
    quiet = said(caplog, "best so far", logging.DEBUG)
    assert len(info) == 1 and len(quiet) >= 2, (info, quiet)
    assert f" at step {summary['best_step']}): " in quiet[-1], quiet  # (every one said, at DEBUG)
