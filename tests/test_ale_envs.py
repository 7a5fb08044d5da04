"""ale-py's Atari envs on a server: the ids they go by, the atari wrapper's frame skip, a quiet exit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from env_server import ServerConfig
from env_server.envs import EnvBuildError, check_env, make_env

pytest.importorskip("ale_py")


@pytest.mark.parametrize("env", ["ALE/Pong-v5", "ale_py:ALE/Pong-v5", "ale_py:PongNoFrameskip-v4"])
def test_the_atari_wrapper_gets_an_env_that_skips_no_frames_whatever_the_id_s_form(env: str) -> None:
    """AtariPreprocessing skips 4 frames itself, and refuses an env that skips frames too (v5's
    default); the ``module:`` prefix gymnasium takes does not change what the id names."""
    one = make_env(ServerConfig(env=env, wrappers=("atari",)))
    try:
        assert one.observation_space.shape == (4, 84, 84)
        assert one.unwrapped._frameskip == 1  # type: ignore[attr-defined]
    finally:
        one.close()


@pytest.mark.parametrize(
    ("env", "frameskip", "shown"),
    [("ALE/Pong-v5", 4, "4"), ("ale_py:ALE/Pong-v5", [2, 5], "[2, 5]"), ("ale_py:PongNoFrameskip-v4", 2, "2")],
)
def test_a_frameskip_given_with_the_atari_wrapper_is_refused_before_anything_is_built(
    env: str, frameskip: object, shown: str
) -> None:
    config = ServerConfig(env=env, wrappers=("atari",), env_kwargs={"frameskip": frameskip})
    message = (
        f"--env-kwargs frameskip={shown} conflicts with --wrappers atari, which skips 4 frames itself "
        "(leave frameskip out, or set it to 1)"
    )
    for check in (check_env, make_env):
        with pytest.raises(EnvBuildError) as info:
            check(config)
        assert str(info.value) == message
    check_env(ServerConfig(env=env, wrappers=("atari",), env_kwargs={"frameskip": 1}))
    check_env(ServerConfig(env=env, env_kwargs={"frameskip": frameskip}))  # (no wrapper: ALE's own frame skip)


def test_ram_observations_with_the_atari_wrapper_are_refused_before_anything_is_built() -> None:
    """(Was: every env out of order at its first reset, "Expected a numpy array with two dimensions".)"""
    config = ServerConfig(env="ALE/Pong-v5", wrappers=("atari",), env_kwargs={"obs_type": "ram"})
    with pytest.raises(EnvBuildError, match=r'obs_type="ram" conflicts with --wrappers atari, which reads the screen'):
        check_env(config)
    check_env(ServerConfig(env="ALE/Pong-v5", env_kwargs={"obs_type": "ram"}))


def run_server(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "env_server", *args, "--port", "0"], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("env", ["PongNoFrameskip-v4", "Pong-v0"])
def test_an_ale_id_only_ale_py_registers_says_how_to_name_it(env: str) -> None:
    """(In a process of its own: once ale_py is imported, as by other tests here, these ids exist.)"""
    name, _, version = env.rpartition("-")
    result = run_server("--env", env)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        f"env-server: error: cannot make env {env!r}: Environment `{name}` doesn't exist; "
        f"ALE's {version} ids are registered by ale_py: use --env ale_py:{env}"
    ), result.stderr
    result = run_server("--env", "NoSuchGameNoFrameskip-v4")
    assert result.returncode == 2 and "ale_py" not in result.stderr, result.stderr
    # A misspelt ALE/ name gets gymnasium's "Did you mean" alone (was also told to use ale_py:ALE/Pongg-v5).
    result = run_server("--env", "ALE/Pongg-v5")
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == (
        "env-server: error: cannot make env 'ALE/Pongg-v5': Environment `Pongg` doesn't exist in namespace ALE. "
        "Did you mean: `Pong`?"
    ), result.stderr


def test_the_frameskip_conflict_is_the_server_s_one_line_error() -> None:
    result = run_server("--env", "ALE/Pong-v5", "--wrappers", "atari", "--env-kwargs", '{"frameskip": 4}')
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "env-server: error: --env-kwargs frameskip=4 conflicts with --wrappers atari, which skips 4 frames itself "
        "(leave frameskip out, or set it to 1)"
    ], result.stderr


@pytest.mark.parametrize("vectorization", ["sync", "async"])
def test_a_server_of_ale_envs_stopped_exits_0_without_nanobind_s_leak_report(vectorization: str) -> None:
    """ale-py's bindings (nanobind) report the envs still alive at the interpreter's shutdown, ~20
    lines; the server lets go of its envs once they are closed."""
    args = ["--env", "ALE/Pong-v5", "--wrappers", "atari", "--vectorization", vectorization, "--port", "0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "env_server", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().startswith("listening on ")
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        stderr = proc.stderr.read()
        assert "leaked" not in stderr and "stopped after 0 steps" in stderr, stderr
    finally:
        proc.kill()
