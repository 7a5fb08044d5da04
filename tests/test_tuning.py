"""Entry points tune gRPC's core before anything imports grpc; users' settings win."""

from __future__ import annotations

import subprocess
import sys

import pytest

from env_server.tuning import FAST_GRPC_EXPERIMENTS, prefer_fast_grpc_core


def test_sets_the_fast_experiments_unless_the_user_chose() -> None:
    environ: dict[str, str] = {}
    prefer_fast_grpc_core(environ)
    # (and gRPC core's own log from ERROR up: its INFO lines came before envfleet's TLS errors)
    assert environ == {"GRPC_EXPERIMENTS": FAST_GRPC_EXPERIMENTS, "GRPC_VERBOSITY": "ERROR"}
    mine = {"GRPC_EXPERIMENTS": "-event_engine_dns", "GRPC_VERBOSITY": "DEBUG"}
    assert prefer_fast_grpc_core(mine) is False
    assert mine == {"GRPC_EXPERIMENTS": "-event_engine_dns", "GRPC_VERBOSITY": "DEBUG"}


@pytest.mark.parametrize("module", ["learner.cli", "env_server.__main__"])
def test_entry_point_modules_do_not_import_grpc(module: str) -> None:
    """gRPC reads GRPC_EXPERIMENTS when first imported: the entry points' modules must leave that to main()."""
    code = f"import sys, {module}; print('grpc' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
