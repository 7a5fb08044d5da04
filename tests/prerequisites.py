"""Tests that need something of the machine (Docker, root, a tool) skip without it, except under CI=true."""

from __future__ import annotations

import os

import pytest


def require(problem: str | None, what: str) -> None:
    """Skip the test when ``problem`` (why ``what`` cannot be had) is set; under CI=true, fail instead."""
    if problem is None:
        return
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and {what}: {problem}", pytrace=False)
    pytest.skip(f"{what}: {problem}")
