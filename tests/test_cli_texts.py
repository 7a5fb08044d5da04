"""The command lines of env-server, its health probe and the benchmark scripts: what they take, what
they refuse (and how they say so), and what their --help shows."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence

import pytest

import env_server.health
from env_server.__main__ import build_parser, parse_args
from env_server.tuning import FAST_GRPC_EXPERIMENTS
from learner.benchmarks import capacity, cartpole_solve, gpu_check, soak


@pytest.fixture(autouse=True)
def no_envfleet_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The defaults, not whatever ENVFLEET_* the shell running the tests has set."""
    for name in list(os.environ):
        if name.startswith("ENVFLEET_"):
            monkeypatch.delenv(name)
    # (the benchmarks' mains set these for gRPC when unset: set here, they are left, and restored after)
    monkeypatch.setenv("GRPC_EXPERIMENTS", FAST_GRPC_EXPERIMENTS)
    monkeypatch.setenv("GRPC_VERBOSITY", "ERROR")
    monkeypatch.setenv("COLUMNS", "80")


def error_of(main: Callable[[Sequence[str]], object], argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The last line ``main(argv)`` writes to stderr as it exits with status 2."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def help_of(main: Callable[[Sequence[str]], object], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    too_long = [line for line in text.splitlines() if len(line) > 100]
    assert not too_long, too_long
    return text


def flat(text: str) -> str:
    """``text`` on one line, as argparse wrapped it (at spaces, and after hyphens: "--reset-" "timeout")."""
    return " ".join(re.sub(r"-\n\s+", "-", text).split())


# -- env-server ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "num_envs"), [("1e3", 1000), ("2.5e2", 250), ("1_000", 1000), ("4", 4)])
def test_env_server_takes_whole_numbers_in_float_notation(
    given: str, num_envs: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    config, _ = parse_args(["--env", "CartPole-v1", "--num-envs", given])
    assert config.num_envs == num_envs
    monkeypatch.setenv("ENVFLEET_NUM_ENVS", given)
    assert parse_args(["--env", "CartPole-v1"])[0].num_envs == num_envs
    assert parse_args(["--env", "CartPole-v1", "--max-request-bytes", "1e5"])[0].max_request_bytes == 100_000


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--num-envs", "1.5"], "argument --num-envs: expected a positive integer, got '1.5'"),
        (["--num-envs", "1e-3"], "argument --num-envs: expected a positive integer, got '1e-3'"),
        (["--num-envs", "0e3"], "argument --num-envs: expected a positive integer, got 0"),
        (["--port", "1e6"], "argument --port: expected a port number 0-65535, got 1000000"),
        (["--host", ""], "--host '': expected a host name or address (0.0.0.0 for all interfaces), got an empty one"),
        (
            ["--host", " "],
            "--host ' ': expected a host name or address (0.0.0.0 for all interfaces), got only whitespace",
        ),
        (["--claim-timeout", "0"], "argument --claim-timeout: expected a finite number of seconds > 0, got '0'"),
        (["--claim-timeout", "-1"], "argument --claim-timeout: expected a finite number of seconds > 0, got '-1'"),
    ],
)
def test_env_server_refusals_show_what_was_given(
    args: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert error_of(parse_args, ["--env", "CartPole-v1", *args], capsys) == f"env-server: error: {error}"


def test_an_empty_host_is_refused_from_its_variable_too(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ENVFLEET_HOST", "")
    said = error_of(parse_args, ["--env", "CartPole-v1"], capsys)
    assert "ENVFLEET_HOST '': expected a host name or address" in said  # (named as set: no --host was given)
    # (a server on a Unix socket does not listen on --host)
    assert parse_args(["--env", "CartPole-v1", "--unix-socket", "/tmp/x.sock"])[0].host == ""


def test_env_server_log_levels_are_listed_and_taken_in_any_case(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_args(["--env", "CartPole-v1", "--log-level", "INFO"])[1] == ("info", "text")
    assert parse_args(["--env", "CartPole-v1", "--log-level", "Warning", "--log-format", "JSON"])[1] == (
        "warning",
        "json",
    )
    monkeypatch.setenv("ENVFLEET_LOG_LEVEL", "DEBUG")
    assert parse_args(["--env", "CartPole-v1"])[1] == ("debug", "text")


def test_env_server_help(capsys: pytest.CaptureFixture[str]) -> None:
    text = flat(help_of(lambda argv: build_parser().parse_args(argv), capsys))
    assert "[--log-level LEVEL]" in text and "{debug" not in text
    assert "--log-level LEVEL what the server logs to stderr: debug, info, warning or error (default: info)" in text
    assert "--num-envs N envs hosted by this server (default: 1)" in text
    assert "(the server's envs wait concurrently; default: 0)" in text  # --step-delay-ms
    assert "as learner train does) (default: none)" in text  # --wrappers
    assert "end a learner's claim after S s (> 0) with no connection" in text
    assert "it passes 60, or twice its --timeout or --reset-timeout where more" in text


# -- the health probe ------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", ["0", "-1", "nan", "inf", "x"])
def test_the_probe_refuses_a_timeout_that_is_no_positive_number(
    timeout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    error = error_of(env_server.health.main, ["--timeout", timeout], capsys)
    assert error.endswith(f"argument --timeout: expected a positive number of seconds, got {timeout!r}")


def test_the_probe_s_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--timeout S " in help_of(env_server.health.main, capsys)


# -- benchmark scripts -----------------------------------------------------------------------------


def test_benchmark_help_is_plain_text_with_meaningful_metavars(capsys: pytest.CaptureFixture[str]) -> None:
    texts = {module.__name__: help_of(module.main, capsys) for module in (soak, cartpole_solve, capacity, gpu_check)}
    for name, text in texts.items():
        assert "``" not in text and "(default: None)" not in text, name
    text = flat(texts[soak.__name__])
    for usage in ("--minutes MIN", "--kill-every S", "--down S", "--servers N", "--control N", "--envs-per-server N"):
        assert f"[{usage}]" in text
    for usage in ("--timeout S", "--warmup S", "--out PATH", "--server-log PATH"):
        assert f"[{usage}]" in text
    assert "Time to solve CartPole-v1: learner train on remote envs" in flat(texts[cartpole_solve.__name__])
    assert "[--out DIR]" in texts[gpu_check.__name__]


def test_learner_train_help_puts_what_most_runs_set_first(capsys: pytest.CaptureFixture[str]) -> None:
    """The envs and the run before PPO's hyperparameters, connections and faults (token, TLS, timeouts)
    last; the examples before the presets table, whose rows where presets differ come first."""
    from learner.cli import main as learner_main

    with pytest.raises(SystemExit):
        learner_main(["train", "--help"])
    text = capsys.readouterr().out
    sections = ["\nthe envs:", "\nthe run:", "\nPPO hyperparameters", "\nconnections and faults:", "\nexamples:"]
    assert [text.index(s) for s in sections] == sorted(text.index(s) for s in sections)
    connections = text[text.index("\nconnections and faults:") : text.index("\nexamples:")]
    assert "--auth-token " in connections and "--give-up-after" in connections and "--seed" not in connections
    assert "--pipeline-groups" in text[text.index("\nthe envs:") : text.index("\nthe run:")]
    assert text.index("\nexamples:") < text.index("Hyperparameter presets")
    table = text[text.index("\npreset " + " " * 10) :].split("\n\n")[0]
    keys = [row.split()[0] for row in table.strip().splitlines()[1:]]
    assert keys[0] == "total_timesteps" and keys.index("anneal_lr") > keys.index("clip_reward")
