"""``import learner`` quiets gRPC core's log only where that can still work, and never over the user's choice."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SHOW = "import os; print(os.environ.get('GRPC_VERBOSITY'))"


@pytest.mark.parametrize(
    ("code", "verbosity", "expected"),
    [
        (f"import learner; {SHOW}", None, "ERROR"),  # grpc not started yet: the quiet default
        (f"import grpc, learner; {SHOW}", None, "None"),  # too late to matter: left alone (was: set anyway)
        (f"import learner; {SHOW}", "DEBUG", "DEBUG"),  # the user's choice wins
    ],
)
def test_import_learner_sets_grpc_verbosity_only_before_grpc(code: str, verbosity: str | None, expected: str) -> None:
    environ = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    if verbosity is not None:
        environ["GRPC_VERBOSITY"] = verbosity
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environ)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == expected
