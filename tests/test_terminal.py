"""What ``learner train`` shows on a terminal and in a log: log records above the progress bar, the bar's
last state, the progress lines without a terminal, the closing lines and the help of --log-format."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import time
import types
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tqdm import tqdm

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
from env_server.tuning import JsonLogFormatter
from learner.cli import build_parser, finished_line, main, slowest_line, tls_options
from learner.config import Args
from learner.progress import (
    _tqdm_class,
    bar_by_default,
    bar_postfix,
    close_bar,
    fleet_down_note,
    fleet_note,
    in_notebook,
    progress_bar,
    progress_line,
    waiting_line,
)
from learner.stats import format_return
from learner.train import train

CLOCK_BOX: dict[str, Any] = {
    "env": "tests.envs:ClockEnv",
    "env_kwargs": {"length": 3, "action": "box"},
    "backend": "gym",
    "num_envs": 2,
    "num_steps": 8,
    "num_minibatches": 2,
    "plot": False,
    "tensorboard": False,
}


@contextlib.contextmanager
def console(formatter: logging.Formatter | None = None) -> Iterator[logging.StreamHandler[Any]]:
    """A console handler on the root logger, as ``configure_logging`` makes (on stderr: in a test, the
    captured one of the moment); the root logger's handlers as they were after."""
    root = logging.getLogger()
    handlers = list(root.handlers)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter or logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.handlers = [*handlers, handler]
    try:
        yield handler
    finally:
        root.handlers = handlers


def screen_lines(err: str) -> list[str]:
    """The lines a terminal ends up showing of ``err``: of each line, what the last carriage return left."""
    return [line.rpartition("\r")[2] for line in err.split("\n")]


# -- 1. log records above the bar, not in its line ---------------------------------------------------------


def test_a_warning_logged_while_the_bar_is_up_gets_a_line_of_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    message = "Ctrl-C: stopping after this step (checkpoint and summary follow); Ctrl-C again to abort at once"
    with console() as handler:
        handlers = list(logging.getLogger().handlers)
        with progress_bar(True, 50_000) as bar:
            bar.update(512)
            bar.set_postfix_str("SPS 1,226, return 18.55")
            assert handler not in logging.getLogger().handlers  # (written through tqdm.write while the bar is up)
            logging.getLogger("learner.train").warning(message)
            logging.getLogger("learner.train").info("not shown: below the root logger's level")
        assert logging.getLogger().handlers == handlers  # restored
    lines = screen_lines(capsys.readouterr().err)
    assert f"WARNING learner.train: {message}" in lines, lines
    assert not [line for line in lines if "steps [" in line and "WARNING" in line], lines
    assert not [line for line in lines if "not shown" in line]


def test_json_log_records_stay_one_object_per_line_above_the_bar(capsys: pytest.CaptureFixture[str]) -> None:
    with console(JsonLogFormatter()), progress_bar(True, 100) as bar:
        bar.update(10)
        logging.getLogger("learner.train").warning("env server local-1 is back")
    records = [json.loads(line) for line in screen_lines(capsys.readouterr().err) if line.startswith("{")]
    assert [(r["level"], r["message"]) for r in records] == [("WARNING", "env server local-1 is back")]


def test_two_bars_up_at_once_leave_logging_as_it_was_whichever_ends_first(capsys: pytest.CaptureFixture[str]) -> None:
    """train() in a thread and evaluate() in the notebook: two bars, ending in either order."""
    last_resort = logging.lastResort
    with console() as handler:
        for first_ends_first in (True, False):
            first, second = progress_bar(True, 100), progress_bar(True, 100)
            first.__enter__()
            second.__enter__()
            for bar in (first, second) if first_ends_first else (second, first):
                bar.__exit__(None, None, None)
            assert logging.lastResort is last_resort and handler in logging.getLogger().handlers


def test_without_a_bar_the_handlers_are_left_as_they_are() -> None:
    with console() as handler, progress_bar(False, 100) as bar:
        assert bar is None and handler in logging.getLogger().handlers


# -- 2. the bar's last state -------------------------------------------------------------------------------


def _bar(total: int, n: int) -> Any:
    bar = tqdm(total=total, file=io.StringIO())
    bar.update(n)
    bar.set_postfix_str("SPS 1,699, return 474.2")
    return bar


def test_a_run_stopped_at_its_return_leaves_its_bar_full_with_the_final_figures(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bar = _bar(100_000, 30_000)
    summary = {"total_steps": 30_208, "sps": 1_699.0, "final_return_mean": 486.1}
    monkeypatch.setattr(time, "perf_counter", lambda: 1010.0)  # (10 s since the session's start)
    close_bar(bar, summary, "stop_at_return", since=(1000.0, 0))
    assert (bar.n, bar.total) == (30_208, 30_208)
    assert bar.postfix == "SPS 3,021, return 486.1", bar.postfix  # (30,208 steps in 10 s)
    bar.close()


def test_an_interrupted_run_keeps_its_bars_total_with_the_final_figures() -> None:
    bar = _bar(100_000, 30_000)
    summary = {"total_steps": 30_000, "sps": 1_701.0, "final_return_mean": 475.0}
    close_bar(bar, summary, "interrupted", since=(time.perf_counter() - 10.0, 0))
    assert (bar.n, bar.total, bar.postfix) == (30_000, 100_000, "SPS 1,701, return 475.0")
    bar.close()


def test_the_bar_s_last_state_keeps_what_the_fleet_was_missing_at_the_last_update() -> None:
    """The final SPS of a run that ended with a server down is that of a smaller fleet, as the bar said: said
    first, as the bar said it (after the figures, a narrow terminal's last frame cut it off), and so is the outage
    of a run stopped while every server was down."""
    bar = _bar(100_000, 30_000)
    summary = {"total_steps": 30_000, "sps": 1_701.0, "final_return_mean": 475.0}
    close_bar(bar, summary, "interrupted", since=(time.perf_counter() - 10.0, 0), fleet="1 of 3 servers down")
    assert bar.postfix == "1 of 3 servers down, SPS 1,701, return 475.0", bar.postfix
    outage = fleet_down_note(2, 60.0, waiting=False)
    close_bar(bar, summary, "interrupted", since=(time.perf_counter() - 10.0, 0), fleet=outage, evaluation=500.0)
    assert bar.postfix == "all 2 servers down for 60 s, SPS 1,701, return 475.0, eval 500.0", bar.postfix
    bar.close()


def test_a_training_run_stopped_at_its_return_ends_its_bar_at_100_percent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # (ClockEnv's Box returns are at most 0: every run reaches -100 once 20 episodes have ended)
    args = Args(**CLOCK_BOX, total_timesteps=10_000, stop_at_return=-100.0, progress=True, run_dir=str(tmp_path / "r"))
    summary = train(args)
    assert summary["stop_reason"] == "stop_at_return"
    step = summary["total_steps"]
    last = [line for line in screen_lines(capsys.readouterr().err) if "steps [" in line][-1]
    assert last.lstrip().startswith("100%") and re.search(rf"\| {step}(\.0)?/{step}(\.0)? steps \[", last), last
    assert last.endswith(f", return {format_return(summary['final_return_mean'])}]"), last


def test_the_training_bar_is_redrawn_at_tqdm_s_interval_not_at_every_update(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its figures set at every update redrew it at every update, whatever tqdm's mininterval: 7,840 redraws,
    604 KB of a log in 12 min of --progress to a file. (tqdm's mininterval an hour here: the bar is drawn as it
    opens and as it closes, with the run's final figures.)"""
    monkeypatch.setattr("learner.progress._tqdm_class", lambda: lambda **kwargs: tqdm(**kwargs, mininterval=3600.0))
    summary = train(Args(**CLOCK_BOX, total_timesteps=128, progress=True, run_dir=str(tmp_path / "r")))
    assert summary["updates"] == 8
    drawn = [line for line in capsys.readouterr().err.replace("\r", "\n").split("\n") if "steps [" in line]
    assert len(drawn) <= 3, drawn
    assert drawn[-1].rstrip().endswith(f", return {format_return(summary['final_return_mean'])}]"), drawn


def test_the_bar_s_time_left_is_at_the_session_s_rate_as_the_progress_lines_is(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """tqdm's default, a moving average of the rates between redraws, swung from 114 h to 736 h within 2 minutes
    of a run whose updates' rates were noisy, where the session's SPS said 168 h."""
    with progress_bar(True, 10_000, 4_000) as bar:
        now = [0.0]
        bar._time = lambda: now[0]
        bar.start_t = bar.last_print_t = 0.0
        for seconds, steps in ((1.0, 1_000), (1.0, 1_000), (10.0, 100)):  # (two fast updates, one slow)
            now[0] += seconds
            bar.update(steps)
        # 2,100 steps in this session's 12 s: 175 a second, so 3,900 steps take 22 s more.
        assert "00:12<00:22" in str(bar), str(bar)
        row = {"global_step": 6_100, "sps": 2_100 / 12, "episodic_return_mean": None, "seconds": 12.0}
        assert progress_line(row, 10_000).endswith(", ~22 s left")


# -- 3. --no-progress in the help only where it is taken --------------------------------------------------


def _log_format_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        build_parser().parse_args([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("command", ["plot", "bench", "demo", "servers", None])
def test_commands_without_a_bar_do_not_offer_no_progress(
    command: str | None, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    text = _log_format_help([command] if command else [], capsys)
    assert "for log collectors; results are printed as they are (default: text)" in text, text
    assert "--no-progress" not in text


@pytest.mark.parametrize("command", ["train", "eval"])
def test_commands_with_a_bar_say_no_progress_drops_it(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    assert "(--no-progress drops the bar) (default: text)" in _log_format_help([command], capsys)
    args = build_parser().parse_args([command, "--no-progress"])
    assert args.progress is False


# -- 4. the slowest server: not an ordering effect ----------------------------------------------------------


def test_identical_servers_of_unequal_round_trips_are_not_called_slow() -> None:
    """Two identical local servers, as measured on a 2-core machine: local-0, sent to first, measures
    the longer round trip while both servers' envs step alike."""
    for first, second in ((0.98, 0.85), (1.40, 0.98)):
        replicas = {
            "local-0": {"latency_p50_ms": first, "env_p50_ms": 0.04},
            "local-1": {"latency_p50_ms": second, "env_p50_ms": 0.04},
        }
        assert slowest_line({"replicas": replicas}) == ""
        without_env_times = {a: {"latency_p50_ms": r["latency_p50_ms"]} for a, r in replicas.items()}
        assert slowest_line({"replicas": without_env_times}) == ""


def test_many_identical_servers_round_trips_falling_in_the_order_of_the_sends_name_none() -> None:
    """256 local servers on 2 cores, as measured: the learner sends to local-0 first, so its round trip counts the
    sends to the 255 others (67.9 ms, falling to 15.3 ms for the last; median 42.6 ms), their envs stepping
    alike. local-0 was named the slowest from about 190 servers up; one far server among them still is."""
    gradient = {f"local-{i}": {"latency_p50_ms": 67.9 - 0.206 * i, "env_p50_ms": 0.12} for i in range(256)}
    assert slowest_line({"replicas": gradient}) == ""
    far = {**gradient, "far:1": {"latency_p50_ms": 150.0, "env_p50_ms": 0.12}}
    assert slowest_line({"replicas": far}).startswith("slowest env server: far:1 (median round trip 150.00 ms")


def test_a_server_whose_envs_are_slow_or_whose_round_trip_stands_far_out_is_named() -> None:
    delayed = {  # (--step-delay-ms 2 on local-1)
        "local-0": {"latency_p50_ms": 0.9, "env_p50_ms": 0.05},
        "local-1": {"latency_p50_ms": 3.1, "env_p50_ms": 2.1},
    }
    assert slowest_line({"replicas": delayed}) == (
        "slowest env server: local-1 (median round trip 3.10 ms, envs' step 2.10 ms; the other server: median "
        "round trip 0.90 ms, envs' step 0.05 ms)"
    )
    far = {"near:1": {"latency_p50_ms": 0.9, "env_p50_ms": 0.05}, "far:1": {"latency_p50_ms": 3.1, "env_p50_ms": 0.05}}
    assert slowest_line({"replicas": far}).startswith("slowest env server: far:1 (median round trip 3.10 ms")


# -- 5. a finished run's next step ------------------------------------------------------------------------


def test_a_finished_run_suggests_evaluating_it_and_plotting_it_unless_it_did(tmp_path: Path) -> None:
    run = tmp_path / "my run"
    assert finished_line(run, plot=False) == f"evaluate its policy with: learner eval '{run}'"
    assert finished_line(run, plot=True) == (
        f"evaluate its policy with: learner eval '{run}'; plot its returns with: learner plot '{run}'"
    )
    # (trained on running servers: on them, the envs it stepped, whatever the kwargs it did not record)
    assert finished_line(run, plot=False, servers="a:1,dns:///env:50051") == (
        f"evaluate its policy with: learner eval '{run}' --servers a:1,dns:///env:50051"
    )
    # Not on those down at its end (eval would fail on them); on all if all were.
    assert finished_line(run, plot=False, servers="a:1,b:1,c:1", down={"b:1", "c:1"}) == (
        f"evaluate its policy with: learner eval '{run}' --servers a:1 (without b:1, c:1: down at the run's end)"
    )
    assert finished_line(run, plot=False, servers="a:1", down={"a:1"}).endswith("--servers a:1")
    assert finished_line(run, plot=False, servers="a:1, b:1 c:1", down={"b:1"}).endswith(  # (as --servers takes)
        "--servers a:1,c:1 (without b:1: down at the run's end)"
    )
    # With the TLS options it reached them with (eval takes none from the run): paths, no token.
    config = Args(servers="proxy:443", tls_ca="/etc/ca dir/ca.pem", tls_server_name="env.test", auth_token="secret")
    assert finished_line(run, plot=False, servers=config.servers, tls=tls_options(config)) == (
        f"evaluate its policy with: learner eval '{run}' --servers proxy:443 --tls-ca '/etc/ca dir/ca.pem' "
        "--tls-server-name env.test"
    )
    assert tls_options(Args(servers="a:1", tls=True)) == ["--tls"] and tls_options(Args(servers="a:1")) == []
    mutual = Args(servers="a:1", tls=True, tls_ca="ca.pem", tls_client_cert="me.crt", tls_client_key="me.key")
    assert tls_options(mutual) == ["--tls-ca", "ca.pem", "--tls-client-cert", "me.crt", "--tls-client-key", "me.key"]


def test_learner_train_ends_with_the_next_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    argv = ["train", "--env", "tests.envs:ClockEnv", "--env-kwargs", '{"length": 3}', "--backend", "gym"]
    argv += ["--num-envs", "2", "--num-steps", "8", "--total-timesteps", "32", "--run-dir", str(run)]
    assert main([*argv, "--no-progress", "--no-plot", "--no-tensorboard"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"evaluate its policy with: learner eval {run}; plot its returns with: learner plot {run}"


# -- 6. progress lines without a terminal ------------------------------------------------------------------


def test_progress_lines_say_the_time_left_until_the_end() -> None:
    row = {"global_step": 99_072, "episodic_return_mean": 500.0, "sps": 1_648.0, "seconds": 60.2}
    assert progress_line(row, 120_000) == ("step 99,072/120,000 (83%), 1,648 SPS, mean return 500.0, 60 s, ~13 s left")
    assert progress_line({**row, "global_step": 20_000}, 10_000_000).endswith(", ~101 min left")
    assert progress_line({**row, "global_step": 0}, 100_000_000).endswith(", ~16.9 h left")
    assert progress_line({**row, "global_step": 120_000}, 120_000).endswith(", 60 s")  # (done: none left)
    from learner.progress import _duration

    assert [_duration(s) for s in (119.4, 119.6, 7_169.0, 7_171.0)] == ["119 s", "2 min", "119 min", "2.0 h"]


def test_the_bar_and_the_progress_lines_say_what_a_degraded_fleet_is_missing() -> None:
    """Servers down (lost and being reconnected, or back but not stepping yet) of those in the fleet, and servers
    the start went on without: a glance at the bar or at a log's lines showed a lower SPS and nothing of why.
    Nothing while every server is up, nor for in-process envs (--backend gym: no such keys in their rows). The
    lines end in it; the bar says it first, as it says every note (a narrow terminal cuts the figures, not it)."""
    row = {"global_step": 99_072, "episodic_return_mean": 500.0, "sps": 1_648.0, "seconds": 60.2}
    whole = {**row, "faults/servers_down": 0, "faults/servers_not_joined": 0, "fleet/servers": 3.0}
    assert fleet_note(row) == fleet_note(whole) == ""
    line = "step 99,072/120,000 (83%), 1,648 SPS, mean return 500.0, 60 s, ~13 s left"
    assert progress_line(row, 120_000) == progress_line(whole, 120_000) == line
    assert bar_postfix(1_648.0, 500.0, fleet_note(whole)) == "SPS 1,648, return 500.0"
    down = {**whole, "faults/servers_down": 1, "fleet/servers": 2.0}  # (down, and up: the fleet's 3)
    assert progress_line(down, 120_000) == f"{line}, 1 of 3 servers down"
    assert progress_line({**down, "global_step": 120_000}, 120_000).endswith(", 60 s, 1 of 3 servers down")
    assert bar_postfix(1_648.0, 500.0, fleet_note(down)) == "1 of 3 servers down, SPS 1,648, return 500.0"
    assert fleet_note({**down, "faults/servers_not_joined": 1}) == "1 of 3 servers down, 1 not joined"
    assert fleet_note({**whole, "faults/servers_not_joined": 1}) == "1 server not joined"
    assert fleet_note({**whole, "faults/servers_not_joined": 2}) == "2 servers not joined"
    assert fleet_note({**whole, "faults/servers_down": 2, "fleet/servers": 254.0}) == "2 of 256 servers down"
    assert fleet_note({**whole, "faults/servers_down": 1, "fleet/servers": 0.0}) == "1 of 1 server down"
    assert fleet_note({"faults/servers_down": 2}) == "2 servers down"  # (envs that do not count those up)


def test_while_every_server_is_down_the_bar_and_the_lines_say_how_long_the_fleet_has_waited() -> None:
    """Every server down: no update comes, so the bar and the lines said nothing new (the last update's figures,
    frozen) for as long as it lasted. What they say instead, and the line made of it (the last update's figures,
    the run's time as of now, no time left, then the outage), before any update too."""
    assert fleet_down_note(2, 0.4) == "all 2 servers down, waiting"
    assert fleet_down_note(2, 35.2) == "all 2 servers down for 35 s, waiting"
    assert fleet_down_note(1, 185.0) == "the only server down for 3 min, waiting"
    assert fleet_down_note(3, 35.2, 1) == "all 3 servers down for 35 s, 1 not joined, waiting"
    # (one joined of three listed: not "the only server", as if the fleet had one; as fleet_note says it)
    assert fleet_down_note(1, 35.2, 2) == "1 of 1 server down for 35 s, 2 not joined, waiting"
    assert fleet_note({"faults/servers_down": 1, "fleet/servers": 0, "faults/servers_not_joined": 2}) == (
        "1 of 1 server down, 2 not joined"
    )
    assert fleet_down_note(2, 60.0, waiting=False) == "all 2 servers down for 60 s"  # (the bar's last state)
    row = {"global_step": 8_960, "episodic_return_mean": 151.9, "sps": 1_041.0, "seconds": 8.6}
    note = fleet_down_note(2, 20.0)
    assert waiting_line(row, 200_000, step=0, seconds=29.4, note=note) == (
        "step 8,960/200,000 (4%), 1,041 SPS, mean return 151.9, 29 s, all 2 servers down for 20 s, waiting"
    )
    assert waiting_line({}, 200_000, step=128, seconds=5.0, note=note) == (
        "step 128/200,000 (0%), - SPS, mean return -, 5 s, all 2 servers down for 20 s, waiting"
    )
    assert bar_postfix(1_041.0, 151.9, note) == "all 2 servers down for 20 s, waiting, SPS 1,041, return 151.9"


def test_while_every_server_is_down_the_lines_say_the_last_evaluation_as_the_bar_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--eval-every and a total outage of the training fleet: the bar's outage state kept ", eval 500.0" (the last
    evaluation's mean return, said at every update until the next), but the lines without a terminal dropped it
    for as long as the outage lasted, and said it again at the first update after: a log read as if the
    evaluations had stopped with the fleet."""
    from learner.records import Recorder
    from learner.resume import Counters

    def recorder(bar: Any) -> Recorder:
        counters = Counters(global_step=8_960, update=35, eval_return_mean=500.0, best_eval_return=500.0)
        made = Recorder(
            tmp_path,
            counters=counters,
            total_timesteps=200_000,
            metrics_file=io.StringIO(),
            writer=None,
            faults_seen=set(),
            tracker=None,
            live=None,
            bar=bar,
            progress_lines=bar is None,
            line_every=0.0,
            start_time=time.perf_counter() - 29.4,
            session_start=time.perf_counter() - 29.4,
            session_start_step=0,
        )
        made.last_row = {"global_step": 8_960, "episodic_return_mean": 151.9, "sps": 1_041.0, "seconds": 8.6}
        return made

    recorder(None).fleet_down(2, 0)
    (line,) = capsys.readouterr().out.splitlines()
    assert re.fullmatch(
        r"step 8,960/200,000 \(4%\), 1,041 SPS, mean return 151.9, 29 s, all 2 servers down, "
        r"waiting, eval 500.0",
        line,
    ), line
    bar = tqdm(total=200_000, file=io.StringIO())
    recorder(bar).fleet_down(2, 0)
    # (the note first, then the last update's figures, as an evaluation's: a narrow terminal cuts the figures, not it)
    assert bar.postfix == "all 2 servers down, waiting, SPS 1,041, return 151.9, eval 500.0"
    bar.close()


def test_without_a_terminal_the_first_update_is_reported_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Then one a minute (PROGRESS_LINE_S): a run of seconds prints the first update's line only."""
    train(Args(**CLOCK_BOX, total_timesteps=48, progress=None, run_dir=str(tmp_path / "r")))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 1 and lines[0].startswith("step 16/48 (33%), "), lines
    assert re.search(r", \d+ s, ~\d+ s left$", lines[0]), lines


@pytest.mark.slow
def test_a_run_whose_stdout_reader_exits_goes_on_to_its_end(tmp_path: Path) -> None:
    """``learner train | head -1``, or a ``tee`` killed: the run goes on, saying so once, rather than ending
    mid-run with "error: BrokenPipeError" at its next progress line."""
    run, gate = tmp_path / "run", tmp_path / "gate"
    kwargs = json.dumps({"gate": str(gate), "at": 100})  # (mid-run: the reader exits while the run waits there)
    script = (
        "import learner.train, learner.cli; learner.train.PROGRESS_LINE_S = 0.0; import sys; "
        f"sys.argv = ['learner', 'train', '--env', 'tests.envs:GateEnv', '--env-kwargs', {kwargs!r}, '--backend', "
        f"'gym', '--num-envs', '1', '--num-steps', '8', '--total-timesteps', '400', '--no-plot', '--run-dir', "
        f"{str(run)!r}]; learner.cli.run()"
    )
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE) as p:
        assert p.stdout is not None and p.stderr is not None
        assert p.stdout.readline().startswith(b"learner train: PPO")
        deadline = time.monotonic() + 60
        while not gate.exists():
            assert time.monotonic() < deadline and p.poll() is None, "the run did not reach the gate"
            time.sleep(0.05)
        p.stdout.close()
        gate.unlink()
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 0, err
    assert err.count("stdout was closed (its reader exited): no more progress lines; the run goes on") == 1, err
    assert json.loads((run / "summary.json").read_text())["total_steps"] == 400


# -- 5. in a notebook -----------------------------------------------------------------------------------------


class ZMQInteractiveShell:
    """Stands in for ipykernel's shell: a Jupyter kernel's IPython."""


def _kernel(monkeypatch: pytest.MonkeyPatch, shell: object) -> None:
    """This process as a Jupyter kernel's, as ``in_notebook`` sees it: ``ipykernel.zmqshell`` and ``IPython``
    imported, ``get_ipython()`` the ``shell`` given (stand-ins, in sys.modules)."""
    zmqshell = types.ModuleType("ipykernel.zmqshell")
    zmqshell.ZMQInteractiveShell = ZMQInteractiveShell  # type: ignore[attr-defined]
    ipython = types.ModuleType("IPython")
    ipython.get_ipython = lambda: shell  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ipykernel.zmqshell", zmqshell)
    monkeypatch.setitem(sys.modules, "IPython", ipython)


def test_a_notebook_is_told_from_a_terminal_ipython_and_from_plain_python(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not in_notebook()  # (no kernel here: nor is one imported to find out)
    assert "ipykernel.zmqshell" not in sys.modules
    _kernel(monkeypatch, object())  # ipykernel imported, but the shell is a terminal's (or none: None)
    assert not in_notebook()
    _kernel(monkeypatch, ZMQInteractiveShell())
    assert in_notebook()


def test_in_a_notebook_training_shows_its_bar_unless_told_not_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A notebook's stderr is no terminal, yet shows a bar (its carriage returns) well: the bar then, not a
    line a minute; without ipywidgets tqdm's text bar, with no warning of the widget missing."""
    _kernel(monkeypatch, ZMQInteractiveShell())
    find_spec = importlib.util.find_spec
    # (no ipywidgets, whether installed here or not)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "ipywidgets" else find_spec(name, *a)
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*IProgress")  # (tqdm's "IProgress not found" would fail it)
        assert issubclass(_tqdm_class(), tqdm) and _tqdm_class().__module__ == "learner.progress"  # (text)
        train(Args(**CLOCK_BOX, total_timesteps=32, progress=None, run_dir=str(tmp_path / "bar")))
    out, err = capsys.readouterr()
    assert re.match(r"100%\|.*\| 32\.0/32\.0 steps ", screen_lines(err)[-2]), err
    assert not [line for line in out.splitlines() if line.startswith("step ")], out
    train(Args(**CLOCK_BOX, total_timesteps=32, progress=False, run_dir=str(tmp_path / "none")))
    out, err = capsys.readouterr()
    assert "steps" not in err and not [line for line in out.splitlines() if line.startswith("step ")], (out, err)


def test_a_terminal_of_no_size_gets_progress_lines_not_a_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tty whose size was never set (0 rows: `script -c`, `ssh -tt` or `docker exec -t` from a script): tqdm
    draws no bar on it, and training showed nothing at all until its summary."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    with open(follower, "w") as terminal, open(leader, "rb"):
        monkeypatch.setattr(sys, "stderr", terminal)
        for rows, columns, bar in [(0, 0, False), (0, 80, False), (24, 0, False), (24, 80, True)]:
            fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
            assert os.get_terminal_size(follower) == (columns, rows)
            assert bar_by_default() is bar, (rows, columns)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not bar_by_default()  # (no terminal)


def test_a_warning_printed_while_a_bar_is_up_is_written_above_it() -> None:
    """With text logs a warning is printed as Python prints it: an in-process env's (--backend gym) continued the
    bar's line, and left the bar's frame on the screen. One recorded (catch_warnings(record=True), pytest.warns) is
    recorded still; two bars up at once, ending in either order, keep it above until the last one ends. (In a
    process of its own: pytest records every test's warnings.)"""
    script = textwrap.dedent(
        """
        import warnings
        import tqdm
        from learner.progress import logging_above_bar

        written = []
        tqdm.tqdm.write = staticmethod(lambda text, file=None, **kwargs: written.append(text))
        python_s = warnings.showwarning
        warnings.simplefilter("always")
        first, second = logging_above_bar(), logging_above_bar()
        first.__enter__()
        warnings.warn_explicit("one", UserWarning, "env.py", 1)
        with warnings.catch_warnings(record=True) as recorded:
            warnings.warn_explicit("recorded", UserWarning, "env.py", 2)
        second.__enter__()
        first.__exit__(None, None, None)
        warnings.warn_explicit("two", UserWarning, "env.py", 3)  # (the second bar is still up)
        second.__exit__(None, None, None)
        print(written, [str(w.message) for w in recorded], warnings.showwarning is python_s)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == ("['env.py:1: UserWarning: one', 'env.py:3: UserWarning: two'] ['recorded'] True"), (
        done.stderr
    )
    assert "UserWarning" not in done.stderr, done.stderr


@pytest.mark.parametrize(("columns", "shown"), [(60, " 17% 10.2k/60.0k steps, SPS 2,180, return 187.9"), (100, None)])
def test_a_narrow_terminal_s_bar_shows_its_figures_whole(columns: int, shown: str | None) -> None:
    """Below 80 columns tqdm shrank the bar to one character, then cut the line: at 60 the return read "return 1"
    for 187.9. There the count and figures alone; wider, the whole bar."""
    screen = io.StringIO()
    with contextlib.closing(
        _tqdm_class()(
            total=60000,
            unit="step",
            unit_scale=True,
            ncols=columns,
            file=screen,
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} steps [{elapsed}<{remaining}{postfix}]",
        )
    ) as bar:
        bar.update(10240)
        bar.set_postfix_str("SPS 2,180, return 187.9")
        line = str(bar)
    assert (
        line == shown if shown else re.fullmatch(r" 17%\|[#0-9]+ +\| 10\.2k/60\.0k steps \[.*, return 187\.9\]", line)
    ), line


def test_training_on_a_terminal_of_no_size_prints_progress_lines(tmp_path: Path) -> None:
    """learner train on a 0-row tty (as `script -c` makes one): the progress lines a log gets (was: nothing until
    its summary, the bar being drawn nowhere)."""
    import fcntl
    import pty
    import struct
    import termios

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
    command = [sys.executable, "-m", "learner", "train", "--backend", "gym", "--env", "CartPole-v1", "--num-envs"]
    command += ["2", "--num-steps", "8", "--total-timesteps", "64", "--no-plot", "--run-dir", str(tmp_path / "run")]
    try:
        done = subprocess.run(command, stdout=subprocess.PIPE, stderr=follower, text=True, timeout=120)
    finally:
        os.close(follower)
        os.close(leader)
    assert done.returncode == 0 and re.search(r"^step 16/64 \(25%\)", done.stdout, re.MULTILINE), done.stdout


@pytest.mark.parametrize(("rows", "columns"), [(0, 0), (0, 80), (24, 0)])
def test_training_told_to_show_its_bar_on_a_terminal_of_no_size_shows_it(
    tmp_path: Path, rows: int, columns: int
) -> None:
    """learner train --progress on a tty whose size was never set, or whose rows or columns alone were not (as
    `script -c` run from a script makes one, some CI runners, `docker run -t` before a size is set): tqdm takes
    the size less one, and at -1 rows drew no bar at all (nothing but the summary: a silent run), at -1 columns it
    cut the line's last character off ("return 18.6" for 18.67). The bar, whole, as where no size is to be had."""
    import fcntl
    import pty
    import struct
    import termios
    import threading

    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    drawn = bytearray()

    def read() -> None:  # (read as it is written: a full pty would hold the run up)
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # (EIO: every writer closed)
                return
            if not chunk:
                return
            drawn.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    command = [sys.executable, "-m", "learner", "train", "--backend", "gym", "--env", "CartPole-v1", "--num-envs"]
    command += ["2", "--num-steps", "8", "--total-timesteps", "64", "--no-plot", "--run-dir", str(tmp_path / "run")]
    try:
        try:
            done = subprocess.run(
                [*command, "--progress"], stdout=subprocess.PIPE, stderr=follower, text=True, timeout=120
            )
        finally:
            os.close(follower)
        reader.join(timeout=30)
    finally:
        os.close(leader)
    said = re.search(r"mean return of the last \d+ episodes: (\S+)$", done.stdout, re.MULTILINE)
    assert done.returncode == 0 and said, done.stdout
    frames = [frame.strip() for frame in re.split(r"[\r\n]", drawn.decode(errors="replace")) if " steps" in frame]
    # (the last frame whole: its final return, as the summary says it, to its last digit)
    assert frames and re.search(rf"64\.0/64\.0 steps.*, return {re.escape(said[1])}\]?$", frames[-1]), frames
