"""``--log-format json``: env-server and learner log one JSON object per line, for log collectors."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from env_server.tuning import JsonLogFormatter, configure_logging
from learner import EnvCrashedError, RemoteVectorEnv
from learner.cli import build_parser
from tests.conftest import SpawnServer


def _records(text: str) -> list[dict[str, str]]:
    """The JSON records among ``text``'s lines (a learner prints its results as they are)."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_a_record_is_one_json_line_with_its_time_level_logger_message_and_traceback() -> None:
    try:
        raise ValueError("bad\nvalue")
    except ValueError:
        record = logging.getLogger("envfleet.test").makeRecord(
            "envfleet.test", logging.ERROR, __file__, 1, "step %d of %s: é", (3, "env"), sys.exc_info()
        )
    line = JsonLogFormatter().format(record)
    assert "\n" not in line
    entry = json.loads(line)
    assert (entry["level"], entry["logger"], entry["message"]) == ("ERROR", "envfleet.test", "step 3 of env: é")
    assert entry["time"].endswith("Z") and len(entry["time"]) == len("2026-12-02T15:14:50.966Z")
    assert entry["exception"].startswith("Traceback") and "ValueError: bad\nvalue" in entry["exception"]
    with pytest.raises(ValueError, match="log_format: expected one of text, json, got 'xml'"):
        configure_logging("info", "xml")
    # A traceback that came as text (a local server's, which the learner logs as the server logged it).
    forwarded = logging.getLogger("env_server.isolation[local-0]").makeRecord(
        "env_server.isolation[local-0]", logging.WARNING, __file__, 1, "env 0 raised", (), None
    )
    forwarded.exc_text = "Traceback (most recent call last):\nRuntimeError: blew up"
    assert json.loads(JsonLogFormatter().format(forwarded))["exception"] == forwarded.exc_text


def test_debug_lines_are_envfleets_not_plotting_libraries() -> None:
    """learner train --log-level debug printed ~220 of matplotlib's font-matching lines for the plot at its end."""
    code = (
        "import logging; from env_server.tuning import configure_logging; configure_logging('debug'); "
        "print([logging.getLogger(n).isEnabledFor(logging.DEBUG) for n in "
        "('learner.train', 'env_server.server', 'matplotlib.font_manager', 'PIL.PngImagePlugin', 'asyncio')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[True, True, False, False, False]"


def test_env_server_logs_json_lines_when_asked(spawn_server: SpawnServer) -> None:
    server = spawn_server("CartPole-v1", 2, "--log-format", "json")
    lines = [line for line in server.logs().splitlines() if line.strip()]
    assert lines and all(line.startswith("{") for line in lines), lines
    messages = [(r["level"], r["logger"], r["message"]) for r in map(json.loads, lines)]
    assert any(level == "INFO" and message.startswith("serving 2 x CartPole-v1") for level, _, message in messages)
    server.stop()
    variable = spawn_server("CartPole-v1", 1, environ={"ENVFLEET_LOG_FORMAT": "json"})
    assert variable.logs().lstrip().startswith("{")


def _all_json(text: str) -> list[dict[str, str]]:
    lines = [line for line in text.splitlines() if line.strip()]
    assert all(line.startswith("{") for line in lines), text
    return [json.loads(line) for line in lines]


@pytest.mark.slow
def test_warnings_are_json_records_and_an_async_workers_error_is_said_once(spawn_server: SpawnServer) -> None:
    """Warnings (gymnasium's, in colour) were printed as they are, and an async worker's error as gymnasium's
    three warnings per worker (raw lines, in red) beside the server's own record of it: the first and the last say
    nothing more."""
    old = spawn_server("CartPole-v0", 1, "--log-format", "json")  # (gymnasium warns that v0 is out of date)
    warned = [r for r in _all_json(old.logs()) if r["logger"] == "py.warnings"]
    assert warned and "out of date" in warned[0]["message"] and "\x1b" not in warned[0]["message"], warned
    kwargs = json.dumps({"wrong_shape_in": "step", "fault_env": -1})
    server = spawn_server(
        "tests.envs:FaultyEnv", 2, "--env-kwargs", kwargs, "--vectorization", "async", "--log-format", "json"
    )
    with RemoteVectorEnv([server.address], fault_tolerant=False) as envs:
        envs.reset(seed=0)
        with pytest.raises(EnvCrashedError, match="ObservationLayoutError"):
            envs.step(np.zeros(2, dtype=np.int64))
    records = _all_json(server.logs())
    assert [
        r["level"] for r in records if r["logger"] == "env_server.service" and "ObservationLayoutError" in r["message"]
    ] == ["ERROR"], records
    # (gymnasium's worker's traceback kept, as a warning's record; its two lines around it dropped)
    traces = [r["message"] for r in records if r["logger"] == "py.warnings"]
    assert traces and all("Traceback" in message for message in traces), traces


@pytest.mark.slow
@pytest.mark.needs_torch
def test_learner_logs_json_lines_and_prints_its_results_as_they_are(tmp_path: Path) -> None:
    argv = ["train", "--backend", "gym", "--num-envs", "2", "--num-steps", "32", "--total-timesteps", "64"]
    quiet = ["--no-progress", "--no-plot", "--no-tensorboard", "--run-dir", str(tmp_path / "run")]
    proc = subprocess.run(
        [sys.executable, "-m", "learner", "--log-level", "info", *argv, *quiet, "--log-format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    records = _records(proc.stderr)
    assert any(r["logger"] == "learner.train" and r["message"].startswith("PPO (classic preset") for r in records), (
        records
    )
    assert "run dir: " in proc.stdout + proc.stderr  # (what the command prints for its user: not a record)
    assert all(line.startswith("{") for line in proc.stderr.splitlines() if " INFO " in line)
    # After the command, as --log-level: it overrides one before.
    parser = build_parser()
    assert parser.parse_args(["plot", "r"]).log_format == "text"
    assert parser.parse_args(["--log-format", "json", "plot", "r"]).log_format == "json"
    assert parser.parse_args(["--log-format", "json", "plot", "r", "--log-format", "text"]).log_format == "text"
