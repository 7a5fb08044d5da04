"""A `learner train` running in the background of a test, watched through its run dir's metrics."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from learner import rundir
from tests.conftest import CTRL_C_EXIT

__all__ = ["BackgroundTraining"]


class BackgroundTraining:
    """``command`` (a `learner train ... --run-dir run_dir`) started now; stop it with :meth:`interrupt`."""

    def __init__(self, command: Sequence[str], run_dir: Path, **popen: Any) -> None:
        self.run_dir = run_dir
        self.proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)

    def rows(self) -> list[dict[str, Any]]:
        """``metrics.jsonl`` so far: one row per update (the run appends to it as it goes)."""
        path = self.run_dir / rundir.METRICS
        rows = []
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                break
        return rows

    def sizes(self) -> list[int]:
        """``num_envs`` of each update so far."""
        return [int(row["num_envs"]) for row in self.rows()]

    def wait(
        self,
        condition: Callable[[list[int]], bool],
        what: str,
        timeout: float = 180,
        why: Callable[[], str] | None = None,
    ) -> None:
        """Wait until ``condition(sizes)`` holds; fail, with the run's output, if it exits or time runs out
        (with what ``why`` tells of the world around it then: the fleet's own state, say)."""
        self.wait_rows(lambda rows: condition([int(row["num_envs"]) for row in rows]), what, timeout, why)

    def wait_rows(
        self,
        condition: Callable[[list[dict[str, Any]]], bool],
        what: str,
        timeout: float = 180,
        why: Callable[[], str] | None = None,
    ) -> None:
        """Wait until ``condition(rows)`` holds (the metrics rows so far); fail as :meth:`wait` does."""
        deadline = time.monotonic() + timeout
        while not condition(self.rows()):
            if self.proc.poll() is not None:
                out, err = self.proc.communicate()
                raise AssertionError(
                    f"training exited ({self.proc.returncode}) before {what}:\n{out[-3000:]}\n{err[-3000:]}"
                )
            if time.monotonic() > deadline:
                around = why() if why else ""  # (before the kill: the learner's connections still open)
                self.proc.kill()
                out, err = self.proc.communicate()
                raise AssertionError(
                    f"no {what} within {timeout:g} s; num_envs so far: {self.sizes()}\n{out[-3000:]}\n{err[-3000:]}"
                    + (f"\n{around}" if around else "")
                )
            time.sleep(0.3)

    def interrupt(self, timeout: float = 120) -> tuple[str, str]:
        """SIGINT (it stops at the next step, with a checkpoint and summary); its stdout and stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.proc.communicate(timeout=timeout)

    def check_interrupted(self, out: str, err: str) -> None:
        """It stopped as interrupted (ended by the SIGINT, after its files: learner.cli.run), without a traceback."""
        assert self.proc.returncode == CTRL_C_EXIT, out + err
        assert "Traceback" not in err, err
        assert rundir.read_json(self.run_dir / rundir.SUMMARY)["stop_reason"] == "interrupted"
