"""ServerConfig refuses, at construction, what no server can run: each error names the field, what
was expected and what came (the CLI checks its flags first, with messages naming them)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import pytest

from env_server import ServerConfig, build_vector_env
from env_server.config import WRAPPER_NAMES
from env_server.envs import WRAPPERS, make_env


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("env", "", "env: expected a gymnasium id or a package.module:Name entry point, got ''"),
        ("num_envs", 0, "num_envs: expected an integer >= 1, got 0"),
        ("num_envs", -2, "num_envs: expected an integer >= 1, got -2"),
        ("num_envs", 2.0, "num_envs: expected an integer >= 1, got 2.0"),
        ("num_envs", True, "num_envs: expected an integer >= 1, got True"),
        ("port", 70000, "port: expected a port number 0-65535 (0: any free one), got 70000"),
        ("metrics_port", -1, "metrics_port: expected a port number 0-65535 (0: any free one), got -1"),
        ("vectorization", "bogus", "vectorization: expected one of 'sync', 'async', 'vector_entry_point', got 'bogus'"),
        ("autoreset_mode", "nope", "autoreset_mode: expected one of 'NextStep', 'SameStep', 'Disabled', got 'nope'"),
        (
            "wrappers",
            ("nope",),
            "wrappers: expected names among atari, clip-action, flatten, got unknown wrapper 'nope'",
        ),
        ("wrappers", "atari", "wrappers: expected a tuple of wrapper names, got 'atari'"),
        (
            "wrappers",
            ("flatten", "clip-action", "flatten"),
            "wrappers: expected each wrapper at most once (each applies once), got 'flatten' twice in "
            "'flatten,clip-action,flatten'",
        ),
        ("step_delay_ms", math.inf, "step_delay_ms: expected a finite number >= 0, got inf"),
        ("step_delay_ms", -1.0, "step_delay_ms: expected a finite number >= 0, got -1.0"),
        ("step_delay_ms", "5", "step_delay_ms: expected a finite number >= 0, got '5'"),
        ("spin_wait_ms", 11.0, "spin_wait_ms: expected a number in [0, 10], got 11.0"),
        ("claim_timeout_s", math.inf, "claim_timeout_s: expected a finite number >= 0, got inf"),
        ("grace_s", math.nan, "grace_s: expected a finite number >= 0, got nan"),
        ("max_episode_steps", 0, "max_episode_steps: expected an integer >= 1, got 0"),
        ("max_request_bytes", 4095, "max_request_bytes: expected an integer in [4096, 67108864], got 4095"),
        ("max_request_bytes", 2**26 + 1, "max_request_bytes: expected an integer in [4096, 67108864], got 67108865"),
        ("max_request_bytes", 65536.0, "max_request_bytes: expected an integer in [4096, 67108864], got 65536.0"),
        ("step_socket", "off", "step_socket: expected True or False, got 'off'"),
        ("http2_bdp_probe", 1, "http2_bdp_probe: expected True or False, got 1"),
    ],
)
def test_a_bad_field_is_refused_naming_it_what_was_expected_and_what_came(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        ServerConfig(**{"env": "CartPole-v1", field: value})
    assert str(info.value) == message


def test_what_was_built_or_raised_raw_before_is_refused_as_the_config_is_made() -> None:
    # num_envs=0 built 1 env, "bogus" vectorization a sync one; autoreset "nope" and wrapper "nope"
    # raised gymnasium's ValueError and a KeyError from deep inside.
    with pytest.raises(ValueError, match=r"^num_envs: "):
        build_vector_env(ServerConfig(env="CartPole-v1", num_envs=0))
    with pytest.raises(ValueError, match=r"^vectorization: "):
        build_vector_env(ServerConfig(env="CartPole-v1", vectorization="bogus"))
    with pytest.raises(ValueError, match=r"^autoreset_mode: "):
        build_vector_env(ServerConfig(env="CartPole-v1", autoreset_mode="nope"))
    with pytest.raises(ValueError, match=r"^wrappers: "):
        make_env(ServerConfig(env="CartPole-v1", wrappers=("nope",)))


def test_a_time_limit_is_refused_inside_the_atari_wrapper_where_it_would_count_frames() -> None:
    with pytest.raises(ValueError, match=r"^max_episode_steps: the time limit wraps each env inside the atari"):
        ServerConfig(env="ALE/Pong-v5", wrappers=("atari",), max_episode_steps=100)


def test_good_configs_are_accepted() -> None:
    config = ServerConfig(
        env="CartPole-v1",
        num_envs=3,
        port=0,
        metrics_port=0,
        vectorization="async",
        wrappers=["flatten"],  # type: ignore[arg-type]  # (any sequence of names)
        autoreset_mode="SameStep",
        step_delay_ms=2,
        spin_wait_ms=10,
        claim_timeout_s=0,
        grace_s=0.5,
        max_request_bytes=4096,
    )
    assert config.num_envs == 3
    assert ServerConfig(env="CartPole-v1").max_request_bytes == 4 * 1024 * 1024
    assert ServerConfig(env="CartPole-v1", max_request_bytes=2**26).max_request_bytes == 2**26
    envs = build_vector_env(ServerConfig(env="CartPole-v1", num_envs=2))
    assert envs.num_envs == 2
    envs.close()


def test_the_names_the_config_accepts_are_the_wrappers_the_server_has() -> None:
    assert tuple(WRAPPERS) == WRAPPER_NAMES


def test_every_wrapper_is_named_in_env_server_help_and_in_the_readme() -> None:
    """A wrapper added to the server (and its config's names) is also told of where operators look."""
    from env_server.__main__ import build_parser

    (wrappers,) = [a for a in build_parser()._actions if "--wrappers" in a.option_strings]
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    for name in WRAPPER_NAMES:
        assert f"'{name}'" in (wrappers.help or ""), f"env-server --help says nothing of {name}"
        assert f"`{name}`" in readme, f"README.md says nothing of --wrappers {name}"


def test_a_long_json_option_is_shown_clipped_in_its_error() -> None:
    """A file's worth of JSON pasted into --env-kwargs: the error shows its start, end and length, not all of it."""
    from env_server.config import json_object_option

    with pytest.raises(argparse.ArgumentTypeError) as info:
        json_object_option("[" + "1," * 5000 + "1]")
    message = str(info.value)
    assert len(message) < 400 and message.endswith("(10,003 characters)"), message
