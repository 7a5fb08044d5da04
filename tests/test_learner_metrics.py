"""learner train --metrics-port: the run's Prometheus metrics, served while it runs."""

from __future__ import annotations

import _thread
import argparse
import dataclasses
import json
import math
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
import learner.train
from env_server.protocol import package_version
from learner.cli import build_parser, main
from learner.config import Args
from learner.fleetwatch import FAULT_COUNTS
from learner.live_metrics import FAULT_COUNTERS, REPLICA_COUNTERS, REPLICA_GAUGES, ROW_GAUGES, LearnerMetrics
from learner.records import metrics_row
from learner.resume import like_args, resume_args
from learner.stats import ReplicaStats
from learner.train import train
from learner.update import UpdateResult
from tests.conftest import QUIET, promtool_check

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> tuple[Samples, dict[str, str]]:
    """/metrics' text as {(sample name, sorted labels): value} and {family: HELP}."""
    samples: Samples = {}
    helps = {}
    for family in text_string_to_metric_families(text):
        helps[family.name] = family.documentation
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, helps


def scrape(url: str) -> tuple[Samples, dict[str, str]]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return parse(response.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def replica_window(address: str, **fields: Any) -> ReplicaStats:
    values: dict[str, Any] = {f.name: 0 for f in dataclasses.fields(ReplicaStats)}
    values.update(address=address, num_envs=2, steps=8, available=True, env_busy=0.5)
    values.update(latency_p50_ms=2.0, latency_p99_ms=5.0, latency_max_ms=9.0, env_p50_ms=0.5, env_p99_ms=1.5)
    values.update(fields)
    return ReplicaStats(**values)


def row(update: int, episodes: int, replicas: list[ReplicaStats], **faults: int) -> dict[str, Any]:
    """A metrics.jsonl row as train() makes it (metrics_row), with a fleet of ``replicas``."""
    fleet: dict[str, float] = {f"faults/{key}": faults.get(key, 0) for key in FAULT_COUNTS}
    fleet.update({"faults/servers_down": faults.get("servers_down", 0), "faults/servers_not_joined": 0})
    for replica in replicas:
        fleet.update(replica.metrics(f"replicas/{replica.address}/"))
    result = UpdateResult(
        policy_loss=-0.01,
        value_loss=3.5,
        entropy=0.69,
        old_approx_kl=0.001,
        approx_kl=0.002,
        clipfrac=0.1,
        explained_variance=0.25,
        batch_size=64,
        seconds=0.05,
    )
    rollout_info = {
        "global_step": 64 * update,
        "episodic_return_mean": None if episodes == 0 else 21.5,
        "episodic_length_mean": None if episodes == 0 else 21.5,
        "episodes": episodes,
        "episodes_cut": 1,
        "num_envs": 4,
        "learning_rate": 1e-3,
        "clip_coef": 0.2,
        "rollout_seconds": 0.2,
        "env_steps_lost": 3,
        "env_errors": 2,
        "envs_unavailable": 2,
        "fleet": fleet,
    }
    timing = {"seconds": 1.0, "sps": 256.0, "sps_update": 250.0, "transitions_per_s": 240.0, "other_seconds": 0.01}
    return metrics_row(update, timing, result, rollout_info)


def test_the_collector_exports_each_update_row_and_drops_replicas_that_left() -> None:
    metrics = LearnerMetrics(env_id="CartPole-v1")
    samples, helps = parse(generate_latest(metrics.registry).decode())
    # Before any update, no gauge reads 0 (a "SPS too low" alert would fire at every start).
    for key in ("episodic_return_mean", "sps", "num_envs", "value_loss", "global_step", "total_timesteps"):
        assert math.isnan(value(samples, f"envfleet_learner_{key}")), key
    assert value(samples, "envfleet_learner_last_update_timestamp_seconds") == pytest.approx(time.time(), abs=60)
    # A resumed run: 10 episodes and 3 updates before this session.
    metrics.run_started(
        env_id="CartPole-v1",
        run_dir="runs/r",
        total_timesteps=1000,
        global_step=192,
        updates=3,
        episodes=10,
        solved=False,
    )
    unix = "unix:/tmp/envfleet-1/server-0.sock"  # (an address with slashes)
    first = [replica_window("local-0", failures=1), replica_window(unix)]
    ids = {"local-0": "aaaa", unix: "bbbb"}
    metrics.observe_update(row(4, 12, first, failures=1), solved=False, server_ids=ids)
    samples, _ = parse(generate_latest(metrics.registry).decode())
    assert value(samples, "envfleet_learner_replica_info", replica=unix, server_id="bbbb") == 1
    second = [replica_window("local-0", available=False, reconnects=1)]
    metrics.observe_update(row(5, 15, second, reconnects=2), solved=True, server_ids={"local-0": "cccc"})

    samples, helps = parse(generate_latest(metrics.registry).decode())
    info = {"env_id": "CartPole-v1", "run_dir": "runs/r", "version": package_version()}
    assert value(samples, "envfleet_learner_info", **info) == 1
    for name, expected in {
        "global_step": 320,
        "updates": 5,
        "sps": 256,
        "episodic_return_mean": 21.5,
        "value_loss": 3.5,
        "policy_loss": -0.01,
        "entropy": 0.69,
        "approx_kl": 0.002,
        "clipfrac": 0.1,
        "explained_variance": 0.25,
        "learning_rate": 1e-3,
        "num_envs": 4,
        "envs_unavailable": 2,
        "update_seconds": 0.05,
        "rollout_seconds": 0.2,
        "total_timesteps": 1000,
        "solved": 1,
        # Counters: this session's (5 episodes since the checkpoint's 10), from each row's counts.
        "episodes_total": 5,
        "env_steps_lost_total": 6,
        "env_errors_total": 4,
        "episodes_cut_total": 2,
        "server_failures_total": 1,
        "server_reconnects_total": 2,
        "servers_joined_total": 0,
        "env_steps_total": 320 - 192,  # (this session's: from the checkpoint's step)
        "ppo_updates_total": 2,
    }.items():
        assert value(samples, f"envfleet_learner_{name}") == pytest.approx(expected), name
    assert value(samples, "envfleet_learner_last_update_timestamp_seconds") == pytest.approx(time.time(), abs=60)
    # Per replica, in seconds; the one that left the fleet (no longer in the rows) is gone.
    assert value(samples, "envfleet_learner_replica_latency_p50_seconds", replica="local-0") == pytest.approx(0.002)
    assert value(samples, "envfleet_learner_replica_env_step_p99_seconds", replica="local-0") == pytest.approx(0.0015)
    assert value(samples, "envfleet_learner_replica_latency_max_seconds", replica="local-0") == pytest.approx(0.009)
    assert value(samples, "envfleet_learner_replica_env_busy", replica="local-0") == 0.5
    assert value(samples, "envfleet_learner_replica_available", replica="local-0") == 0
    assert value(samples, "envfleet_learner_replica_failures_total", replica="local-0") == 1
    assert value(samples, "envfleet_learner_replica_reconnects_total", replica="local-0") == 1
    # Its server restarted (a new server_id): the old id's series is gone, as is the replica that left.
    infos = [dict(labels) for name, labels in samples if name == "envfleet_learner_replica_info"]
    assert infos == [{"replica": "local-0", "server_id": "cccc"}]
    assert {dict(labels)["replica"] for name, labels in samples if "_replica_" in name} == {"local-0"}
    # Every family of ours says what it is; no _created series (as env-server's).
    ours = [name for name in helps if name.startswith("envfleet_learner_")]
    assert len(ours) == (
        1 + len(ROW_GAUGES) + 3 + len(FAULT_COUNTERS) + 3 + len(REPLICA_COUNTERS) + 1 + len(REPLICA_GAUGES) + 4
    )
    assert all(helps[name] for name in ours)
    assert not [name for name, _ in samples if name.endswith("_created")]
    assert set(FAULT_COUNTERS) == set(FAULT_COUNTS)
    # The run's end: a last rollout no update learned from still counts its steps, and a solve in it.
    metrics.observe_update(row(6, 15, []), solved=False)
    assert not [name for name, _ in samples if name == "envfleet_learner_run_ended_timestamp_seconds"]
    metrics.run_ended(global_step=6 * 64 + 32, solved=True, stop_reason="error: RemoteEnvError: lost")
    samples, _ = parse(generate_latest(metrics.registry).decode())
    assert value(samples, "envfleet_learner_global_step") == 6 * 64 + 32
    assert value(samples, "envfleet_learner_env_steps_total") == 6 * 64 + 32 - 192
    assert value(samples, "envfleet_learner_solved") == 1
    ended = value(samples, "envfleet_learner_run_ended_timestamp_seconds", reason="error")
    assert ended == pytest.approx(time.time(), abs=60)


def test_promtool_finds_nothing_to_fix_in_the_learner_s_metrics() -> None:
    """Prometheus' own linter, where it is installed: the learner's series after an update and the run's end."""
    metrics = LearnerMetrics(env_id="CartPole-v1", run_dir="runs/r")
    metrics.observe_update(row(1, 3, [replica_window("local-0", stalls=1)]), solved=False, server_ids={"local-0": "a"})
    metrics.run_ended(global_step=64, solved=True, stop_reason="total_timesteps")
    promtool_check(metrics.registry)


def test_a_listed_server_that_has_not_joined_is_available_0_until_it_does() -> None:
    """It had no series at all: an alert on envfleet_learner_replica_available == 0 missed it."""
    metrics = LearnerMetrics()

    def after(update: int, replicas: list[ReplicaStats], not_joined: list[str]) -> dict[str, float]:
        metrics.observe_update(row(update, 1, replicas), solved=False, not_joined=not_joined)
        samples, _ = parse(generate_latest(metrics.registry).decode())
        return {dict(labels)["replica"]: v for (name, labels), v in samples.items() if name.endswith("_available")}

    assert after(1, [replica_window("a:1")], ["b:1"]) == {"a:1": 1, "b:1": 0}
    samples, _ = parse(generate_latest(metrics.registry).decode())
    assert [dict(labels) for name, labels in samples if name == "envfleet_learner_replica_info"] == [
        {"replica": "a:1", "server_id": ""}  # (not of the fleet yet)
    ]
    assert after(2, [replica_window("a:1"), replica_window("b:1")], []) == {"a:1": 1, "b:1": 1}  # (joined)
    assert after(3, [replica_window("a:1")], ["c:1"]) == {"a:1": 1, "c:1": 0}
    assert after(4, [replica_window("a:1")], []) == {"a:1": 1}  # (no longer listed)


def test_while_every_server_is_down_the_gauges_say_so_until_one_is_back() -> None:
    """No update comes while the whole fleet is down, and the gauges an update sets said servers_down 0 and each
    replica available 1 for as long as the outage lasted: an alert on them never fired. The first server back
    says so at once, the others still down."""
    metrics = LearnerMetrics()

    def gauges() -> tuple[float, dict[str, float], float]:
        samples, _ = parse(generate_latest(metrics.registry).decode())
        available = {dict(labels)["replica"]: v for (name, labels), v in samples.items() if name.endswith("_available")}
        envs = value(samples, "envfleet_learner_envs_unavailable")
        return value(samples, "envfleet_learner_servers_down"), available, envs

    replicas = [replica_window("a:1"), replica_window("b:1")]
    metrics.observe_update({**row(1, 1, replicas), "envs_unavailable": 0}, solved=False)
    assert gauges() == (0, {"a:1": 1, "b:1": 1}, 0)
    metrics.observe_fleet_down(2, 8)
    assert gauges() == (2, {"a:1": 0, "b:1": 0}, 8)
    # (one back: said at once, not "every server down" until the next update, minutes away in a long rollout)
    metrics.observe_fleet_up(["a:1"], 1, 4)
    assert gauges() == (1, {"a:1": 1, "b:1": 0}, 4)
    # (both back: the next update's row says it)
    metrics.observe_update({**row(2, 1, replicas), "envs_unavailable": 0}, solved=False)
    assert gauges() == (0, {"a:1": 1, "b:1": 1}, 0)


def test_a_resumed_run_is_not_said_unsolved_while_it_starts() -> None:
    """envfleet_learner_solved read 0 while a resumed run that was solved started (NaN until known, as the
    other gauges)."""
    samples, _ = parse(generate_latest(LearnerMetrics().registry).decode())
    assert math.isnan(value(samples, "envfleet_learner_solved"))


def test_a_stall_shows_in_the_slowest_round_trip_for_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 3 s stall in one rollout of ~0.1 s was overwritten by the next rollout's, so no scrape (every 15-60 s)
    saw it: the slowest round trip is the last minute's rollouts'."""
    import learner.live_metrics

    now = [1000.0]
    monkeypatch.setattr(learner.live_metrics.time, "monotonic", lambda: now[0])
    metrics = LearnerMetrics()

    def slowest_after(update: int, latency_max_ms: float) -> float:
        metrics.observe_update(row(update, 1, [replica_window("a:1", latency_max_ms=latency_max_ms)]), solved=False)
        samples, _ = parse(generate_latest(metrics.registry).decode())
        return value(samples, "envfleet_learner_replica_latency_max_seconds", replica="a:1")

    assert slowest_after(1, 3000.0) == pytest.approx(3.0)
    now[0] += 30
    assert slowest_after(2, 9.0) == pytest.approx(3.0)
    now[0] += 31
    assert slowest_after(3, 9.0) == pytest.approx(0.009)  # (the stall's rollout is over a minute old)
    assert slowest_after(4, math.nan) == pytest.approx(0.009)  # (a rollout without steps: the minute's)


def test_metrics_linger_serves_the_run_s_last_values_after_its_end_but_not_after_a_ctrl_c(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The endpoint closed ~2 s after the last update: a scrape every 15 s rarely saw how a run ended."""
    from learner.live_metrics import lingering, wait_for_lingering

    metrics = LearnerMetrics()
    metrics.serve_http("127.0.0.1", 0)
    assert metrics.url is not None
    metrics.run_ended(global_step=64, solved=True, stop_reason="total_timesteps")
    metrics.close(linger=30)
    assert [url for url, _ in lingering()] == [metrics.url]
    samples, _ = scrape(metrics.url)  # (served on after close)
    assert value(samples, "envfleet_learner_run_ended_timestamp_seconds", reason="total_timesteps") > 0
    threading.Timer(0.5, _thread.interrupt_main).start()  # (a Ctrl-C during the wait: it closes at once)
    waited = time.monotonic()
    wait_for_lingering()
    assert time.monotonic() - waited < 10 and lingering() == []
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(metrics.url, timeout=5)
    # A run of the same process, on the same port, while an earlier one lingers: that one's linger ends.
    from learner.live_metrics import serve_metrics

    first = serve_metrics("127.0.0.1", 0)
    assert first.url is not None
    port = int(first.url.rsplit(":", 1)[1].split("/")[0])
    first.run_ended(global_step=64, solved=False, stop_reason="total_timesteps")
    first.close(linger=30)
    second = serve_metrics("127.0.0.1", port)  # (was: "Address already in use (another process has it ...)")
    assert lingering() == [] and second.url == first.url
    second.close()
    interrupted = LearnerMetrics()
    interrupted.serve_http("127.0.0.1", 0)
    interrupted.run_ended(global_step=64, solved=False, stop_reason="interrupted")
    interrupted.close(linger=30)  # (a Ctrl-C: closed at once)
    assert lingering() == []
    with pytest.raises(ValueError, match=r"^--metrics-linger: keeps --metrics-port serving after the run; give"):
        Args(metrics_linger=5)
    # The command says it serves on, after all else, and waits (here 1 s).
    run_dir = tmp_path / "run"
    argv = ["train", "--backend", "gym", "--num-envs", "2", "--num-steps", "8", "--total-timesteps", "16"]
    argv += ["--metrics-port", "0", "--metrics-linger", "1", "--run-dir", str(run_dir), "--no-progress", "--no-plot"]
    started = time.monotonic()
    assert main(argv) == 0
    assert time.monotonic() - started >= 1
    err = capsys.readouterr().err.splitlines()
    assert re.fullmatch(
        r"learner: serving the run's last metrics on http://127\.0\.0\.1:\d+/metrics for 1 s more "
        r"\(--metrics-linger; Ctrl-C stops it now\)",
        err[-1],
    ), err
    assert lingering() == [] and resume_args(run_dir, total_timesteps=32).metrics_linger == 0


def test_a_training_run_serves_its_metrics_from_before_its_servers_start_until_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real local env servers; /metrics scraped (over HTTP) as the servers start and right after update 2."""
    served: list[LearnerMetrics] = []
    scraped: dict[str, Samples] = {}
    rows: list[dict[str, Any]] = []
    serve_metrics, open_fleet = learner.train.serve_metrics, learner.train.open_fleet
    observe_update = LearnerMetrics.observe_update

    def serving(*args: Any, **kwargs: Any) -> LearnerMetrics:
        served.append(serve_metrics(*args, **kwargs))
        return served[-1]

    def opening(*args: Any, **kwargs: Any) -> Any:
        assert served[0].url is not None
        scraped["start"], _ = scrape(served[0].url)
        return open_fleet(*args, **kwargs)

    def observing(self: LearnerMetrics, row: dict[str, Any], **kwargs: Any) -> None:
        observe_update(self, row, **kwargs)
        if row["update"] == 2:
            assert self.url is not None
            scraped["update 2"], _ = scrape(self.url)
            rows.append(row)

    monkeypatch.setattr(learner.train, "serve_metrics", serving)
    monkeypatch.setattr(learner.train, "open_fleet", opening)
    monkeypatch.setattr(LearnerMetrics, "observe_update", observing)
    run_dir = tmp_path / "run"
    args = Args(
        env="CartPole-v1",
        num_servers=2,
        envs_per_server=2,
        num_steps=16,
        total_timesteps=3 * 64,
        run_dir=str(run_dir),
        metrics_port=0,
        **QUIET,
    )
    summary = train(args)
    assert summary["updates"] == 3

    start = scraped["start"]
    info = {"env_id": "CartPole-v1", "run_dir": str(run_dir), "version": package_version()}
    assert value(start, "envfleet_learner_info", **info) == 1
    assert math.isnan(value(start, "envfleet_learner_updates"))  # (not yet known: the run is yet to be set up)
    assert not [name for name, _ in start if "_replica_" in name]

    samples, [row] = scraped["update 2"], rows
    assert value(samples, "envfleet_learner_updates") == 2
    assert value(samples, "envfleet_learner_global_step") == row["global_step"] == 128
    assert value(samples, "envfleet_learner_total_timesteps") == 3 * 64
    assert value(samples, "envfleet_learner_num_envs") == 4
    assert value(samples, "envfleet_learner_sps") == row["sps"] > 0
    assert value(samples, "envfleet_learner_value_loss") == pytest.approx(row["value_loss"])
    assert value(samples, "envfleet_learner_episodes_total") == row["episodes"] > 0
    assert value(samples, "envfleet_learner_envs_unavailable") == 0
    assert value(samples, "envfleet_learner_server_failures_total") == 0
    assert value(samples, "envfleet_learner_solved") == 0
    assert value(samples, "envfleet_learner_last_update_timestamp_seconds") == pytest.approx(time.time(), abs=30)
    infos = [dict(labels) for name, labels in samples if name == "envfleet_learner_replica_info"]
    assert sorted(info["replica"] for info in infos) == ["local-0", "local-1"]
    assert all(len(info["server_id"]) == 16 for info in infos), infos  # (the servers' envfleet_server_info's)
    for replica in ("local-0", "local-1"):  # (as metrics.jsonl names them)
        latency = value(samples, "envfleet_learner_replica_latency_p50_seconds", replica=replica)
        assert latency == pytest.approx(row[f"replicas/{replica}/latency_p50_ms"] / 1000) and 0 < latency < 1
        assert value(samples, "envfleet_learner_replica_available", replica=replica) == 1
        assert 0 < value(samples, "envfleet_learner_replica_env_busy", replica=replica) <= 1
    assert value(samples, "process_resident_memory_bytes") > 0

    # Stopped serving with the run.
    with pytest.raises(urllib.error.URLError):
        assert served[0].url is not None
        urllib.request.urlopen(served[0].url, timeout=5)


def test_a_port_in_use_is_a_usage_error_naming_the_option_before_any_server_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def opening(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("env servers started before the metrics port was found taken")

    monkeypatch.setattr(learner.train, "open_fleet", opening)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            main(["train", "--metrics-port", str(port), "--run-dir", str(tmp_path / "r"), "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (
        f"learner train: error: cannot serve metrics on 127.0.0.1:{port}: Address already in use (another process "
        "has it; pick another --metrics-port, or 0 for a free one)"
    ) in err
    assert not (tmp_path / "r").exists()


def test_help_shows_the_metrics_options_and_bad_values_are_refused() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    train_parser = commands["train"]
    flat = " ".join(train_parser.format_help().split())
    assert "--metrics-port PORT serve Prometheus metrics" in flat
    assert "0 picks a free port (logged" in flat
    assert "--metrics-host HOST interface --metrics-port listens on" in flat and "(default: 127.0.0.1)" in flat
    with pytest.raises(ValueError, match=r"^--metrics-port: expected a port number 0-65535, got 65536$"):
        Args(metrics_port=65536)
    with pytest.raises(ValueError, match=r"^--metrics-host: sets where --metrics-port serves the metrics; give"):
        Args(metrics_host="0.0.0.0")
    assert Args(metrics_port=9100, metrics_host="0.0.0.0").metrics_host == "0.0.0.0"


def test_the_cli_prints_where_it_serves_and_resume_and_like_serve_only_when_told_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", "--backend", "gym", "--num-envs", "2", "--num-steps", "8", "--total-timesteps", "16"]
    argv += ["--metrics-port", "0", "--run-dir", str(run_dir), "--no-progress", "--no-plot", "--no-tensorboard"]
    assert main(argv) == 0
    (url,) = re.findall(r"Prometheus metrics: (http://127\.0\.0\.1:\d+/metrics)", capsys.readouterr().out)
    assert json.loads((run_dir / "config.json").read_text())["metrics_url"] == url  # (for a script to find)
    # The port is this session's, as the progress display is: not taken from config.json.
    assert resume_args(run_dir, total_timesteps=32).metrics_port is None
    assert like_args(run_dir).metrics_port is None
    resumed = resume_args(run_dir, total_timesteps=32, metrics_port=0, metrics_host="localhost")
    assert (resumed.metrics_port, resumed.metrics_host) == (0, "localhost")
