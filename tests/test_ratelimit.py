"""env_server.ratelimit.LogBudget: the first line at once, then at most one per interval, counting those left out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from env_server import ratelimit
from env_server.ratelimit import LogBudget


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The module's time.monotonic(), set by the test."""
    now = [1000.0]
    monkeypatch.setattr(ratelimit, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_the_first_line_is_due_at_once(clock: list[float]) -> None:
    assert LogBudget(10.0).due() == 0


def test_no_line_is_due_within_the_interval_and_the_next_says_how_many_were_left_out(clock: list[float]) -> None:
    budget = LogBudget(10.0)
    assert budget.due() == 0
    clock[0] += 4.0
    assert budget.due() is None
    clock[0] += 5.9
    assert budget.due() is None and budget.left_out == 2
    clock[0] += 0.1  # (10 s after the first line: due)
    assert budget.due() == 2 and budget.left_out == 0
    assert budget.due() is None  # (the interval starts again at that line)
    clock[0] += 10.0
    assert budget.due() == 1


def test_a_time_given_is_the_clock(clock: list[float]) -> None:
    budget = LogBudget(10.0)
    assert budget.due(now=5.0) == 0
    assert budget.due(now=14.9) is None
    assert budget.due(now=15.0) == 1
    assert budget.last == 15.0


def test_an_interval_of_zero_lets_every_line_through(clock: list[float]) -> None:
    budget = LogBudget(0.0)
    assert [budget.due() for _ in range(3)] == [0, 0, 0]
