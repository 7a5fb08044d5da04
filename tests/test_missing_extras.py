"""An env whose package is not installed where the server runs: the server names envfleet's extra that
brings it (gymnasium's own hint names gymnasium's extra for MuJoCo, and none for ALE)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


@pytest.mark.parametrize(
    ("hidden", "env", "said", "extra", "packages"),
    [
        ("ale_py", "ALE/Pong-v5", "Namespace ALE not found", "atari", "ale-py opencv-python-headless"),
        (
            "mujoco",
            "HalfCheetah-v5",
            'MuJoCo is not installed, run `pip install "gymnasium[mujoco]"`',
            "mujoco",
            "mujoco imageio packaging",
        ),
    ],
)
def test_a_missing_env_package_is_named_with_envfleet_s_extra(
    hidden: str, env: str, said: str, extra: str, packages: str
) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules[{hidden!r}] = None  # (as if not installed)
        from env_server.__main__ import main
        sys.exit(main(["--env", {env!r}, "--num-envs", "1", "--port", "0", "--log-level", "error"]))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"env-server: error: cannot make env {env!r}: {said}"), line
    assert line.endswith(
        f"; install it where the server runs: pip install 'envfleet[{extra}]' (from a clone: pip install -e "
        f"'.[{extra}]'; the env-server image: EXTRA_PIP_PACKAGES=\"{packages}\" docker compose build env)"
    ), line
