"""Across hosts, for real: env servers in network namespaces of their own (tests/netns.py), each with
its own address on a switched link, and a learner in another: train across them, follow a name whose
addresses change (what `kubectl scale` does to a headless Service), lose a host's link for 5 s and get it back.

Needs root and iproute2; without them these tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from learner import rundir
from tests.netns import PORT, Lab, netns_problem
from tests.prerequisites import require
from tests.training import BackgroundTraining

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.timeout(600)]

HOSTS = ["h0", "h1", "h2", "h3"]
ENVS_PER_SERVER = 4
TRAIN = ["--num-steps", "32", "--no-plot", "--no-progress", "--checkpoint-every", "0", "--no-tensorboard"]


@pytest.fixture
def lab() -> Iterator[Lab]:
    """A learner host and four env-server hosts on one switch."""
    require(netns_problem(), "network namespaces cannot be made")
    with Lab(["learner", *HOSTS]) as lab:
        yield lab


def learner_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "learner", "--log-level", "info", "train", *args]


def test_training_across_four_hosts(lab: Lab, tmp_path: Path) -> None:
    """Four servers on four hosts, all on port 50051 of their own address; PPO on all 16 envs."""
    servers = lab.start_servers(HOSTS, "CartPole-v1", ENVS_PER_SERVER)
    addresses = [s.address for s in servers]
    assert addresses == [f"{lab.addresses[h]}:{PORT}" for h in HOSTS]
    run_dir = tmp_path / "run"
    result = lab.run(
        "learner",
        learner_command(
            "--servers", ",".join(addresses), "--total-timesteps", "4096", *TRAIN, "--run-dir", str(run_dir)
        ),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert rundir.read_json(run_dir / rundir.SUMMARY)["total_steps"] == 4096
    assert rundir.read_json(run_dir / rundir.CONFIG)["envs"]["addresses"] == addresses
    assert {row["num_envs"] for row in rundir.read_jsonl(run_dir / rundir.METRICS)} == {len(HOSTS) * ENVS_PER_SERVER}
    for host in HOSTS:  # every host's link carried its share of the steps
        sent, received = lab.link_bytes(host)
        assert sent > 50_000 and received > 20_000, (host, sent, received)


def test_a_name_resolving_to_more_hosts_grows_the_fleet(lab: Lab, tmp_path: Path) -> None:
    """dns:///env.lab:50051 resolves to 2 hosts, then 4, then 3 (the learner host's /etc/hosts, read at
    every look-up): the learner follows between rollouts, as with a headless Service being scaled."""
    servers = lab.start_servers(HOSTS, "CartPole-v1", ENVS_PER_SERVER)
    names = [(s.address.rpartition(":")[0], "env.lab") for s in servers]
    lab.set_hosts_file("learner", names[:2])
    run_dir = tmp_path / "run"
    options = [
        "--servers",
        f"dns:///env.lab:{PORT}",
        *TRAIN,
        "--total-timesteps",
        "100000000",
        "--run-dir",
        str(run_dir),
    ]
    training = BackgroundTraining(lab.command("learner", learner_command(*options)), run_dir)
    try:
        training.wait(lambda sizes: 8 in sizes, "an update with 8 envs")
        lab.set_hosts_file("learner", names)
        training.wait(lambda sizes: 16 in sizes, "an update with 16 envs")
        lab.set_hosts_file("learner", [names[0], names[2], names[3]])
        training.wait(lambda sizes: sizes[-1] == 12, "an update with 12 envs")
    finally:
        out, err = training.interrupt()
    training.check_interrupted(out, err)
    sizes = training.sizes()
    assert sizes[0] == 8 and max(sizes) == 16 and sizes[-1] == 12, sizes


def test_a_host_cut_off_for_5_s_rejoins(lab: Lab, tmp_path: Path) -> None:
    """One host's link goes down mid-rollout for 5 s and comes back: the learner (step deadline 2 s,
    shorter than the cut) goes on with the other hosts' envs, counts the failure, reconnects, and
    the host's envs rejoin: later updates have every env available again."""
    servers = lab.start_servers(HOSTS, "CartPole-v1", ENVS_PER_SERVER)
    run_dir = tmp_path / "run"
    options = ["--servers", ",".join(s.address for s in servers), "--timeout", "2", *TRAIN]
    options += ["--total-timesteps", "100000000", "--run-dir", str(run_dir)]
    training = BackgroundTraining(lab.command("learner", learner_command(*options)), run_dir)
    try:
        training.wait(lambda sizes: len(sizes) >= 2, "two updates")
        lab.cut("h1")
        time.sleep(5)
        lab.restore("h1")
        rows_at_restore = len(training.rows())

        def failed(rows: list[dict[str, Any]]) -> bool:
            return sum(row.get("faults/failures", 0) for row in rows) >= 1

        training.wait_rows(failed, "a failure counted")
        training.wait_rows(lambda rows: sum(row.get("faults/reconnects", 0) for row in rows) >= 1, "a reconnect")
        # Then updates with every env back (ended by at least one step with nothing unavailable).
        training.wait_rows(
            lambda rows: any(row["envs_unavailable"] == 0 for row in rows[rows_at_restore + 1 :]) and len(rows) > 4,
            "an update after the cut with every env available",
        )
    finally:
        out, err = training.interrupt()
    training.check_interrupted(out, err)
    rows = training.rows()
    assert {row["num_envs"] for row in rows} == {len(HOSTS) * ENVS_PER_SERVER}
    assert sum(row["env_steps_lost"] for row in rows) > 0
    summary = rundir.read_json(run_dir / rundir.SUMMARY)
    assert summary["failures"] >= 1 and summary["reconnects"] >= 1, summary
    assert "lost" in err and "is back" in err, err[-3000:]
