"""Args and the command-line types: what `learner train` takes, as documented (compose passes these)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import pytest

from learner import rundir
from learner.argtypes import int_list, integer, number, parse_int
from learner.cli import _given, build_parser
from learner.config import Args


@pytest.mark.parametrize(("text", "value"), [("1000000", 1_000_000), ("1e6", 1_000_000), ("2.5e5", 250_000), ("8", 8)])
def test_integers_may_be_written_in_float_notation_when_whole(text: str, value: int) -> None:
    assert parse_int(text) == value and isinstance(parse_int(text), int)
    assert integer(text) == value and number(1, integer=True)(text) == value
    assert int_list()(f"{text},{text}") == (value, value)


@pytest.mark.parametrize("text", ["1.5", "2.5e0", "inf", "nan", "x", ""])
def test_integers_that_are_not_whole_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_int(text)
    with pytest.raises(argparse.ArgumentTypeError, match=f"expected an integer, got {text!r}"):
        integer(text)


def _train_args(*argv: str) -> Args:
    namespace = build_parser().parse_args(["train", *argv])
    return Args(**_given(namespace, Args))


def test_train_takes_the_budget_compose_documents() -> None:
    """docker-compose.yml passes --stop-at-return ${ENVFLEET_STOP_AT_RETURN:-475}, whose `inf` means never
    stop early, and suggests --total-timesteps 1e6."""
    args = _train_args("--total-timesteps", "1e6", "--stop-at-return", "inf")
    assert args.total_timesteps == 1_000_000 and args.stop_at_return is None  # (as --no-stop-at-return)
    assert _train_args("--total-timesteps", "2.5e5", "--stop-at-return", "475").stop_at_return == 475.0
    assert _train_args("--num-envs", "8", "--num-servers", "2").num_envs == 8


def test_infinity_means_never_stop_early_for_stop_at_return_and_is_refused_elsewhere() -> None:
    assert Args(stop_at_return=math.inf).stop_at_return is None
    names = ("timeout", "connect_timeout", "give_up_after", "step_delay_ms", "learning_rate", "max_grad_norm")
    for name in (*names, "target_kl", "ent_coef"):
        flag = name.replace("_", "-")
        for value in (math.inf, math.nan):
            with pytest.raises(ValueError, match=f"^--{flag}: expected a "):
                Args(**{name: value})  # type: ignore[arg-type]
    # (RemoteVectorEnv refuses an infinite give_up_after too; a large number waits as long as needed)
    with pytest.raises(ValueError, match=r"^--give-up-after: expected a finite number, got inf"):
        Args(give_up_after=math.inf)
    for value in (math.nan, -math.inf):
        with pytest.raises(
            ValueError, match=rf"^--stop-at-return: expected a finite number, or inf \(never\), got {value}"
        ):
            Args(stop_at_return=value)


@pytest.mark.needs_torch
def test_stop_at_return_inf_trains_to_the_budget(tmp_path: Path) -> None:
    from learner.train import train

    run = tmp_path / "run"
    clock: dict[str, Any] = {"env": "tests.envs:ClockEnv", "env_kwargs": {"length": 3}, "backend": "gym", "num_envs": 2}
    quiet: dict[str, Any] = {"progress": False, "plot": False, "tensorboard": False}
    args = Args(**clock, **quiet, num_steps=8, total_timesteps=32, stop_at_return=math.inf, run_dir=str(run))
    summary = train(args)
    assert summary["stop_reason"] == "total_timesteps" and summary["total_steps"] == 32
    assert rundir.read_json(run / rundir.CONFIG)["args"]["stop_at_return"] is None


@pytest.mark.parametrize(
    ("env", "wrappers", "expected"),
    [
        ("ALE/Pong-v5", "auto", ("atari",)),
        ("ale_py:ALE/Pong-v5", "auto", ("atari",)),
        ("ale_py:PongNoFrameskip-v4", "auto", ("atari",)),
        ("ale_py:Pong-v4", "auto", ("atari",)),
        ("CartPole-v1", "auto", ()),
        ("ALE/Pong-v5", "none", ()),
        ("ALE/Pong-v5", "", ()),
        ("HalfCheetah-v5", "clip-action", ("clip-action",)),
    ],
)
def test_wrapper_names_auto_none_and_listed(env: str, wrappers: str, expected: tuple[str, ...]) -> None:
    from learner.config import wrapper_names

    assert wrapper_names(wrappers, env) == expected


def test_auto_gives_atari_s_ram_observations_no_wrapper() -> None:
    """(Was the atari wrapper, the Atari preset and the CNN: every env then failed at its first reset, "Expected
    a numpy array with two dimensions", from deep in the wrapper.)"""
    from learner.config import Args, wrapper_names

    assert wrapper_names("auto", "ALE/Pong-v5", {"obs_type": "ram"}) == ()
    assert wrapper_names("auto", "ALE/Pong-v5", {"obs_type": "grayscale"}) == ("atari",)
    assert Args(env="ALE/Pong-v5", env_kwargs={"obs_type": "ram"}).server_wrappers() == ()


def test_an_atari_game_without_the_atari_wrapper_is_warned_of() -> None:
    import gymnasium as gym
    import numpy as np

    from learner.envs import raw_atari_frames

    raw = gym.spaces.Box(0, 255, (210, 160, 3), np.uint8)
    stacked = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    warning = raw_atari_frames("ALE/Pong-v5", [], raw)
    assert warning.startswith("ALE/Pong-v5 without the env server's atari wrapper: its envs serve raw frames")
    assert warning.endswith("(env-server --wrappers atari; learner train's own servers: --wrappers auto or atari)")
    assert raw_atari_frames("ale_py:ALE/Pong-v5", ["clip-action"], raw)
    assert "(a raw frame is 3.6x the bytes of a stack)" in warning
    grayscale = raw_atari_frames("ALE/Pong-v5", [], gym.spaces.Box(0, 255, (210, 160), np.uint8))  # (obs_type)
    assert "(a raw frame is 1.2x the bytes of a stack)" in grayscale  # (was "about 1/3.6 of the bytes" for any)
    assert not raw_atari_frames("ALE/Pong-v5", ["atari"], stacked)
    assert not raw_atari_frames("CarRacing-v3", [], gym.spaces.Box(0, 255, (96, 96, 3), np.uint8))
    assert not raw_atari_frames("ALE/Pong-v5", [], gym.spaces.Box(0, 255, (128,), np.uint8))  # (RAM)


def test_servers_may_be_given_as_a_list_of_addresses_from_python() -> None:
    """As RemoteVectorEnv takes them, and LocalServers(...).addresses is (it failed deep inside: no .strip)."""
    assert Args(servers=["unix:/tmp/a.sock", "b:2"]).servers == "unix:/tmp/a.sock,b:2"  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^servers: expected addresses, as 'host:port,host:port' or a list"):
        Args(servers=50051)  # type: ignore[arg-type]
