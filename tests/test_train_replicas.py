"""Per-replica statistics of a training run: keyed by address, a replica that stays slow warned of, and
summary.json's figures per env server."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
from learner import RemoteVectorEnv, ServerUnavailableError, faults, rundir
from learner.cli import main, slowest_line
from learner.faults import FaultStats
from learner.fleetwatch import (
    FAULT_COUNTS,
    REPLICA_METRICS_ALL,
    SLOW_UPDATES,
    FleetWatch,
    ReplicaTotals,
    SlowReplicas,
    every_replica,
    fleet_figures,
    written_row,
)
from learner.resume import Counters
from learner.stats import ReplicaStats, StepTimer
from tests.conftest import SpawnServer, StartServers


def window(address: str, env_ms: float, latency_ms: float | None = None, steps: int = 8, **kw: Any) -> ReplicaStats:
    """A replica's statistics of one update (whatever fields ReplicaStats has beside these)."""
    values: dict[str, Any] = {f.name: 0 for f in dataclasses.fields(ReplicaStats)}
    values.update(address=address, num_envs=2, steps=steps, available=True, env_p50_ms=env_ms, env_p99_ms=env_ms)
    latency = env_ms + 0.1 if latency_ms is None else latency_ms
    values.update(latency_p50_ms=latency, latency_p99_ms=latency, latency_max_ms=latency, **kw)
    return ReplicaStats(**values)


def test_a_replica_slow_for_3_updates_in_a_row_is_warned_of_once_until_it_recovers() -> None:
    slow = SlowReplicas()
    fast = [window("a:1", 1.0), window("c:1", 1.2)]
    said = [slow.check([*fast, window("b:1", 4.0)]) for _ in range(SLOW_UPDATES - 1)]
    said.append(slow.check([*fast, window("b:1", 1.0)]))  # recovered: the streak starts over
    assert said == [[], [], []]
    said = [slow.check([*fast, window("b:1", 4.0)]) for _ in range(SLOW_UPDATES + 2)]
    assert said[: SLOW_UPDATES - 1] == [[], []] and said[SLOW_UPDATES:] == [[], []]  # once
    [(level, message)] = said[SLOW_UPDATES - 1]
    assert level == logging.WARNING
    assert message.startswith(
        "env server b:1 is slow: its envs' median step 4.00 ms, 3.6x the other servers' median (1.10 ms), for 3 "
        "updates in a row; the fleet waits for it on every step (see replicas/b:1/ in metrics.jsonl)"
    ), message
    [(level, message)] = slow.check([*fast, window("b:1", 1.0)])
    assert level == logging.INFO and message.startswith("env server b:1 is no longer slow")
    assert [slow.check([*fast, window("b:1", 4.0)]) for _ in range(SLOW_UPDATES)][-1] != []  # warned again


def test_a_slow_round_trip_counts_too_but_not_microseconds_or_what_was_not_measured() -> None:
    slow = SlowReplicas()
    # A slow network: its envs are as fast as the others', its round trip is not.
    for _ in range(SLOW_UPDATES):
        said = slow.check([window("a:1", 0.5, 1.0), window("b:1", 0.5, 6.0)])
    assert [m for _, m in said] == [
        "env server b:1 is slow: its median round trip 6.00 ms, 6.0x the other servers' median (1.00 ms), for 3 "
        "updates in a row; the fleet waits for it on every step (see replicas/b:1/ in metrics.jsonl)"
    ]
    quiet = SlowReplicas()
    for _ in range(2 * SLOW_UPDATES):
        # Fast envs: 5x, but 0.04 ms apart; a replica that did not step (down), or alone: nothing to judge.
        assert quiet.check([window("a:1", 0.01, 0.02), window("b:1", 0.05, 0.06)]) == []
        assert quiet.check([window("a:1", 1.0), window("b:1", math.nan, math.nan, steps=0)]) == []
        assert quiet.check([window("a:1", 1.0)]) == []


def test_a_server_is_not_slow_against_env_times_the_others_did_not_measure() -> None:
    """Servers that do not measure their envs' time send 0 (the proto): a healthy server of a mixed fleet is
    not "slow: its envs' median step 5.00 ms, infx the other servers' median (0.00 ms)"; round trips compare."""
    slow = SlowReplicas()
    for _ in range(SLOW_UPDATES + 1):
        said = slow.check([window("ours:1", 5.0, 6.0), window("foreign:1", 0.0, 6.5), window("old:1", 0.0, 5.5)])
        assert said == [], said
    # From the timers: NaN for what was not measured, and the foreign server's long round trip is what tells.
    foreign, ours = StepTimer("foreign:1", 4), StepTimer("ours:1", 4)
    for _ in range(128):
        foreign.record(0.030, 0.0)
        ours.record(0.006, 0.005)
    slow = SlowReplicas()
    for _ in range(SLOW_UPDATES):
        said = slow.check([foreign.stats(), ours.stats()])
    assert [m.split(", for ")[0] for _, m in said] == [
        "env server foreign:1 is slow: its median round trip 30.00 ms, 5.0x the other servers' median (6.00 ms)"
    ]
    assert not any("inf" in m for _, m in said)


@pytest.mark.parametrize(("load", "busy"), [(0.0, False), (10_000.0, True)])
def test_a_slow_local_server_on_a_busy_machine_says_the_machine_is_busy(
    monkeypatch: pytest.MonkeyPatch, load: float, busy: bool
) -> None:
    """Trainings side by side on one machine: the OS may give one local server less CPU than another,
    which is no fault of the server; a server elsewhere is not told about this machine's load."""
    import os

    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    local = {"unix:/tmp/s0": "local-0", "unix:/tmp/s1": "local-1"}
    for label, (a, b) in (
        (lambda address: local[address], ("unix:/tmp/s0", "unix:/tmp/s1")),
        (str, ("a:1", "b:1")),
    ):
        slow = SlowReplicas()
        for _ in range(SLOW_UPDATES):
            said = slow.check([window(a, 1.0), window(b, 4.0)], label)
        [(_, message)] = said
        here = "; this machine is busy (1-minute load average 10000.0 on" in message
        assert here is (busy and label is not str), message


def test_replica_totals_sum_counts_and_weigh_medians_by_steps() -> None:
    totals = ReplicaTotals()
    totals.add(window("a:1", 1.0, 2.0, steps=10, failures=1))
    totals.add(window("a:1", 4.0, 5.0, steps=30, reconnects=1))
    totals.add(window("a:1", math.nan, math.nan, steps=0))
    got = totals.as_dict()
    assert {k: got[k] for k in ("num_envs", "steps", "failures", "shutdowns", "reconnects")} == {
        "num_envs": 2,
        "steps": 40,
        "failures": 1,
        "shutdowns": 0,
        "reconnects": 1,
    }
    assert (got["env_p50_ms"], got["latency_p50_ms"]) == (3.25, 4.25)
    assert got["latency_max_ms"] == 5.0  # (the slowest round trip of any window)
    assert got["available"] is True
    totals.add(window("a:1", math.nan, math.nan, steps=0, available=False))
    assert totals.as_dict()["available"] is False  # (down as of the last window: the run's end)


def test_a_replica_that_never_stepped_has_null_means_env_busy_included() -> None:
    """(env_busy was left out, where the fleet reports it, of a replica with no steps: a KeyError for a
    reader of summary.json's replicas.)"""
    totals = ReplicaTotals()
    totals.add(window("a:1", math.nan, math.nan, steps=0, env_busy=math.nan))
    got = totals.as_dict()
    assert (got["steps"], got["env_p50_ms"], got["latency_p50_ms"], got["env_busy"]) == (0, None, None, None)
    assert got["latency_max_ms"] is None


def test_a_fleet_without_replica_statistics_gives_none() -> None:
    watch = FleetWatch(object(), carried=dict.fromkeys(FAULT_COUNTS, 0))  # (in-process envs, say)
    assert watch.rollout_metrics() == {} and watch.replicas == {} and watch.totals() is None
    carried = FleetWatch(object(), carried={**dict.fromkeys(FAULT_COUNTS, 0), "failures": 2})  # (resumed)
    assert carried.totals() == {**dict.fromkeys(FAULT_COUNTS, 0), "failures": 2}


def test_the_fault_counts_are_the_fleets_and_the_checkpoints() -> None:
    """FAULT_COUNTS name counters of FaultStats that Counters carries from session to session."""
    assert set(FAULT_COUNTS) <= {f.name for f in dataclasses.fields(FaultStats)}
    assert set(FAULT_COUNTS) <= {f.name for f in dataclasses.fields(Counters)}


def test_summary_names_the_slowest_server_in_one_line() -> None:
    assert slowest_line({}) == "" and slowest_line({"replicas": {"a:1": {"latency_p50_ms": 1.0}}}) == ""
    replicas = {
        "a:1": {"latency_p50_ms": 0.5, "env_p50_ms": 0.1},
        "b:1": {"latency_p50_ms": 6.0, "env_p50_ms": 5.2},
        "c:1": {"latency_p50_ms": 0.7, "env_p50_ms": 0.3},
    }
    assert slowest_line({"replicas": replicas}) == (
        "slowest env server: b:1 (median round trip 6.00 ms, envs' step 5.20 ms; the other 2 servers: median "
        "round trip 0.60 ms, envs' step 0.20 ms)"
    )
    # Servers alike (two local servers of one machine): none is named the slowest.
    alike = {"local-0": {"latency_p50_ms": 0.83, "env_p50_ms": 0.19}, "local-1": {"latency_p50_ms": 0.80}}
    assert slowest_line({"replicas": alike}) == ""


def test_a_slow_server_is_warned_of_and_named_at_the_end(
    tmp_path: Path,
    start_servers: StartServers,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two servers, one whose every step takes 5 ms longer: a warning names it (at the default log level),
    summary.json has each server's figures, and the closing lines name the slowest. Each rollout starts
    the servers' windows (not the update before it)."""
    started = []
    start_rollout = FleetWatch.start_rollout

    def spied(watch: FleetWatch) -> None:
        started.append(watch)
        start_rollout(watch)

    monkeypatch.setattr(FleetWatch, "start_rollout", spied)
    clock = {"env_kwargs": {"length": 3}}
    [fast] = start_servers("tests.envs:ClockEnv", 1, 2, **clock)
    [slow] = start_servers("tests.envs:ClockEnv", 1, 2, server_args=["--step-delay-ms", "5"], **clock)
    run = tmp_path / "run"
    argv = ["train", "--servers", f"{fast},{slow}", "--num-steps", "8", "--total-timesteps", str(8 * 4 * 4)]
    with caplog.at_level(logging.WARNING):
        assert main([*argv, "--run-dir", str(run), "--no-progress", "--no-plot", "--no-tensorboard"]) == 0
    warned = [r.getMessage() for r in caplog.records if "is slow" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"env server {slow} is slow: its envs' median step "), warned
    summary = rundir.read_json(run / rundir.SUMMARY)
    assert set(summary["replicas"]) == {fast, slow}
    assert summary["replicas"][slow]["env_p50_ms"] >= 5 > summary["replicas"][fast]["env_p50_ms"]
    assert summary["replicas"][slow]["steps"] == summary["replicas"][fast]["steps"] == 8 * 4
    assert f"slowest env server: {slow} (median round trip " in capsys.readouterr().out
    assert len(started) == 4  # (the updates: 8 x 4 steps each)


@pytest.mark.slow
def test_a_servers_window_is_the_rollout_not_the_update_after_it(start_servers: StartServers) -> None:
    """The server the fleet waits for is busy during rollouts, whatever the update between them takes
    (was: the window ran from one rollout's end to the next one's, update included: env_busy ~0.4 for
    ~0.8 over the rollout with an update as long as it; the first one held connecting and the first reset)."""
    (server,) = start_servers("CartPole-v1", envs_per_server=2, transport="unix", server_args=["--step-delay-ms", "5"])
    with RemoteVectorEnv([server]) as envs:
        watch = FleetWatch(envs, carried=dict.fromkeys(FAULT_COUNTS, 0))
        envs.reset(seed=0)
        busy = []
        for _ in range(2):
            time.sleep(0.3)  # (an update: its 0.3 s against the rollout's 20 steps of 5 ms, 0.1 s of env time)
            watch.start_rollout()
            for _ in range(20):
                envs.step(np.ones(2, dtype=np.int64))
            metrics = watch.rollout_metrics()
            assert metrics[f"replicas/{server}/steps"] == 20
            busy.append(metrics[f"replicas/{server}/env_busy"])
    assert min(busy) > 0.5, busy  # (with the update counted: under 0.25)


def _lose(envs: RemoteVectorEnv, server: Any) -> None:
    """Kill ``server``: the next step of ``envs`` (not fault-tolerant) fails on it."""
    server.kill()
    with pytest.raises(ServerUnavailableError):
        envs.step(np.zeros(envs.num_envs, dtype=np.int64))


@pytest.mark.slow
def test_servers_lost_or_back_between_rollouts_are_reported_with_the_next_rollout(spawn_server: SpawnServer) -> None:
    """What a refresh between rollouts counts (a server lost, one back at its address) and the steps taken
    then are in the next rollout's windows, the one that left given once, unavailable (not dropped as the
    rollout's window starts)."""
    a, b, c = (spawn_server("CartPole-v1", 2) for _ in range(3))
    with RemoteVectorEnv([a.address, b.address, c.address], fault_tolerant=False, timeout=5.0) as envs:
        watch = FleetWatch(envs, carried=dict.fromkeys(FAULT_COUNTS, 0))
        envs.reset(seed=0)
        watch.start_rollout()
        envs.step(np.zeros(6, dtype=np.int64))
        watch.rollout_metrics()
        # Between rollouts: b is lost and leaves; c is lost and comes back at its address.
        _lose(envs, b)
        envs.refresh()
        _lose(envs, c)
        c.start()
        envs.refresh(wait=30)
        assert envs.addresses == [a.address, c.address]
        watch.start_rollout()
        for _ in range(2):
            envs.step(np.zeros(4, dtype=np.int64))
        metrics = watch.rollout_metrics()
        assert (metrics[f"replicas/{b.address}/failures"], metrics[f"replicas/{b.address}/available"]) == (1, 0)
        assert (metrics[f"replicas/{c.address}/failures"], metrics[f"replicas/{c.address}/available"]) == (1, 1)
        # (the steps of the two failed fleet steps count where they were taken, as a dropped rollout's are: a's
        # two, c's one before it was lost)
        assert (metrics[f"replicas/{a.address}/failures"], metrics[f"replicas/{a.address}/steps"]) == (0, 4)
        assert metrics[f"replicas/{c.address}/steps"] == 3
        watch.start_rollout()
        envs.step(np.zeros(4, dtype=np.int64))
        again = watch.rollout_metrics()
        assert f"replicas/{b.address}/failures" not in again and again[f"replicas/{c.address}/failures"] == 0


@pytest.mark.slow
def test_what_the_first_reset_counted_is_in_the_first_rollout_s_row(spawn_server: SpawnServer) -> None:
    """A server lost in the first reset, before training watches the fleet, is counted in the first row, as
    in the run's totals (was: left out of every row and of the replica's totals, in the fleet's totals)."""
    a, b = (spawn_server("CartPole-v1", 2) for _ in range(2))
    with RemoteVectorEnv([a.address, b.address], fault_tolerant=True, timeout=5.0) as envs:
        b.kill()
        envs.reset(seed=0)  # (b's envs unavailable: lost)
        watch = FleetWatch(envs, carried=dict.fromkeys(FAULT_COUNTS, 0))
        watch.start_rollout()
        envs.step(np.zeros(4, dtype=np.int64))
        metrics = watch.rollout_metrics()
    assert (metrics["faults/failures"], metrics[f"replicas/{b.address}/failures"]) == (1, 1)
    assert watch.totals()["failures"] == 1 == watch.replicas[b.address].as_dict()["failures"]  # type: ignore[index]


def test_the_fleets_figures_are_the_medians_and_the_largest_of_its_servers() -> None:
    windows = [
        window("a:1", 1.0, 2.0, env_busy=0.2),
        window("b:1", 3.0, 5.0, env_busy=0.6, stalls=1),
        window("c:1", math.nan, 4.0, env_busy=math.nan),  # (a server that does not measure its envs' time)
        window("d:1", 9.0, 9.0, steps=0, available=False),  # (left before the rollout: no steps, not counted)
    ]
    figures = fleet_figures(windows)
    assert figures == {
        "fleet/servers": 3.0,
        "fleet/latency_p50_ms_median": 4.0,
        "fleet/latency_p50_ms_max": 5.0,
        "fleet/latency_p99_ms_max": 5.0,
        "fleet/latency_max_ms": 5.0,
        "fleet/env_p50_ms_median": 2.0,
        "fleet/env_p50_ms_max": 3.0,
        "fleet/env_p99_ms_max": 3.0,
        "fleet/env_busy_median": 0.4,
        "fleet/env_busy_max": 0.6,
        "fleet/stalls": 1.0,
    }
    nothing = fleet_figures([window("a:1", 1.0, steps=0)])
    assert nothing["fleet/servers"] == 1 and math.isnan(nothing["fleet/latency_p50_ms_median"])


class _Fleet:
    """Envs whose servers' windows are given: ``windows`` for the next replica_stats()."""

    def __init__(self, windows: list[ReplicaStats]) -> None:
        self.windows = windows

    def replica_stats(self, reset: bool = False) -> list[ReplicaStats]:
        return self.windows


def test_past_16_servers_the_rows_give_each_servers_figures_only_where_it_is_of_note() -> None:
    """--replica-metrics auto: a fleet of 17 servers writes the fleet's figures and those of the servers lost,
    back, stalled or slow in the update, not 17 x 14 (at 256 servers: 162 KB rows, 3,584 TensorBoard tags)."""
    fast = [window(f"s{i}:1", 1.0) for i in range(REPLICA_METRICS_ALL)]
    fleet = _Fleet([*fast, window("slow:1", 9.0)])
    assert every_replica("auto", REPLICA_METRICS_ALL) and every_replica("all", 256)
    assert not every_replica("auto", 17) and not every_replica("summary", 2)
    watch = FleetWatch(fleet, dict.fromkeys(FAULT_COUNTS, 0), every_replica=False)
    noted = []
    for update in range(SLOW_UPDATES + 1):
        fleet.windows = [*fast, window("slow:1", 9.0)]
        if update == 0:
            fleet.windows[3] = window("s3:1", 1.0, failures=1, available=False)
            fleet.windows[5] = window("s5:1", 1.0, stalls=2)
        metrics = watch.rollout_metrics()
        assert sum(k.startswith("replicas/") for k in metrics) == 17 * 14  # (every server's, for --metrics-port)
        noted.append(watch.of_note)
    # Lost and stalled in the first update; slow from its first slow update (warned of at the third), and
    # while it stays so.
    assert noted == [{"s3:1", "s5:1", "slow:1"}, {"slow:1"}, {"slow:1"}, {"slow:1"}]
    row = {"update": 1, **metrics}
    written = written_row(row, watch.of_note)
    assert {k.rpartition("/")[0] for k in written if k.startswith("replicas/")} == {"replicas/slow:1"}
    assert written["fleet/env_p50_ms_max"] == 9.0 and written["update"] == 1
    assert written_row(row, None) is row


def test_replica_metrics_summary_in_a_training_run(
    tmp_path: Path, start_servers: StartServers, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--replica-metrics summary: metrics.jsonl's rows have the fleet's figures and no server's (none of
    the two was lost, stalled or slow), TensorBoard the same; config.json records the choice; the command
    says so as it starts."""
    # (neither server slow nor stalled, whatever else loads the machine: in a CI run, beside the Docker tests, one
    # server's figures were written, as those of a server slow or stalled in an update are)
    monkeypatch.setattr("learner.fleetwatch.SLOW_RATIO", math.inf)
    monkeypatch.setattr("learner.faults.STALL", (math.inf, *faults.STALL[1:]))
    servers = start_servers("CartPole-v1", 2, 2)
    run = tmp_path / "run"
    argv = ["train", "--servers", ",".join(servers), "--num-steps", "8", "--total-timesteps", str(8 * 4 * 2)]
    assert main([*argv, "--run-dir", str(run), "--no-progress", "--no-plot", "--replica-metrics", "summary"]) == 0
    assert (
        "\nmetrics.jsonl and TensorBoard: the fleet's figures (fleet/...) every update, and each of the 2 servers' own "
        "(replicas/<server>/...) in the updates it was down, lost, back, stalled or slow in (--replica-metrics all: "
        "every server's, every update)\n"
    ) in capsys.readouterr().out
    rows = rundir.read_jsonl(run / rundir.METRICS)
    assert len(rows) == 2
    for row in rows:
        assert not [k for k in row if k.startswith("replicas/")], row
        assert row["fleet/servers"] == 2 and row["fleet/latency_p50_ms_median"] > 0
    assert rundir.read_json(run / rundir.CONFIG)["args"]["replica_metrics"] == "summary"
    summary = rundir.read_json(run / rundir.SUMMARY)
    assert set(summary["replicas"]) == set(servers)  # (the session's figures per server: as ever)
