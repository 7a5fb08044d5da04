"""Box actions in training: the warning for clipped bounds that leave out 0, and observations a Gaussian
policy cannot act on (it samples NaN from NaN without an error), named as the env's before it acts."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal, cast

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
import torch

from learner.config import Args, resolve_ppo
from learner.errors import UnusableEnvOutputError
from learner.normalize import RunningMeanStd
from learner.train import Acting, clip_leaves_out_zero, train
from tests.conftest import QUIET, on_cuda


class BoundedBandit(gym.Env[np.ndarray, np.ndarray]):
    """Box actions within ``low`` and ``high`` (one bound per dimension); reward -|a - target| summed over
    the dimensions; a constant observation; 8-step episodes."""

    def __init__(self, low: list[float] | None = None, high: list[float] | None = None, target: float = 0.0) -> None:
        low, high = low or [-1.0], high or [1.0]
        self.action_space = gym.spaces.Box(np.array(low, np.float32), np.array(high, np.float32), dtype=np.float32)
        self.observation_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.target, self._t = target, 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        self._t = 0
        return np.zeros(1, np.float32), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        self._t += 1
        reward = -float(np.abs(np.asarray(action, np.float64) - self.target).sum())
        return np.zeros(1, np.float32), reward, False, self._t >= 8, {}


class NaNObservationEnv(gym.Env[np.ndarray, np.ndarray]):
    """Box(1,) actions; observations ``[t, 1]``, but ``[nan, 1]`` at step ``at`` in the env whose first reset
    had an odd seed (seeded ``s``, a vector env's env i gets ``s + i``: env 1 of two, seeded 0); 50-step
    episodes."""

    def __init__(self, at: int = 10) -> None:
        self.action_space = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (2,), np.float32)
        self.at, self._t = at, 0
        self.bad: bool | None = None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        super().reset(seed=seed)
        if self.bad is None:
            self.bad = seed is not None and seed % 2 == 1
        self._t = 0
        return np.array([0.0, 1.0], np.float32), {}

    def step(self, action: np.ndarray) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        assert np.isfinite(action).all(), f"the policy sent {action}"  # (what the Gaussian did with NaN)
        self._t += 1
        obs = np.array([np.nan if self.bad and self._t == self.at else self._t, 1.0], np.float32)
        return obs, 0.0, False, self._t >= 50, {}


def _acting(obs_rms: RunningMeanStd | None, action_space: gym.Space[Any]) -> Acting:
    return Acting(
        agent=cast(Any, None),
        actor=cast(Any, None),
        obs_space=gym.spaces.Box(-np.inf, np.inf, (2,), np.float32),
        action_space=action_space,
        obs_rms=obs_rms,
        obs_dtype=torch.float32,
        device=torch.device("cpu"),
        server_of=lambda env: f"env server s{env}: ",
    )


# ---------------------------------------------------------------------------------------------
# Clipped bounds that leave out 0


@pytest.mark.parametrize(
    ("low", "high", "bounds", "said"),
    [
        ([10.0], [12.0], "clip", "action dimension 0 [10, 12] leave out 0"),
        ([-1.0, -12.0, 0.5], [1.0, -10.0, 3.0], "clip", "action dimensions 1 [-12, -10], 2 [0.5, 3] leave out 0"),
        ([-1.0, 0.0], [1.0, 2.0], "clip", ""),  # (0 a bound: half the samples inside)
        ([-np.inf], [np.inf], "clip", ""),
        ([10.0], [12.0], "squash", ""),
    ],
)
def test_clipped_bounds_that_leave_out_zero_are_warned_of(
    low: list[float], high: list[float], bounds: Literal["clip", "squash"], said: str
) -> None:
    """Box(10, 12) under clip: the Gaussian starts at N(0, 1), every sample clips to 10, the same action,
    and the policy learns nothing without a word (its log std barely moves). Named, with what to do."""
    space = gym.spaces.Box(np.array(low, np.float32), np.array(high, np.float32), dtype=np.float32)
    hp = resolve_ppo(Args(action_bounds=bounds), gym.spaces.Box(-1.0, 1.0, (1,)), space)
    warning = clip_leaves_out_zero(hp, space)
    if not said:
        assert warning == ""
        return
    assert warning.startswith(f"--action-bounds clip: the bounds of {said}, where the policy's Gaussian starts"), (
        warning
    )
    assert warning.endswith(
        "pass --action-bounds squash (tanh onto the bounds), or rescale the actions around 0 in the env "
        "(gymnasium's RescaleAction)"
    )


def test_clip_leaves_discrete_actions_alone() -> None:
    hp = resolve_ppo(Args(), gym.spaces.Box(-1.0, 1.0, (1,)), gym.spaces.Discrete(2))
    assert clip_leaves_out_zero(hp, gym.spaces.Discrete(2)) == ""


def test_training_warns_once_of_clipped_bounds_that_leave_out_zero(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    args = Args(
        env=f"{__name__}:BoundedBandit",
        env_kwargs={"low": [10.0], "high": [12.0], "target": 11.0},
        backend="gym",
        num_envs=2,
        num_steps=8,
        num_minibatches=2,
        update_epochs=1,
        total_timesteps=32,
        device="cpu",
        run_dir=str(tmp_path / "run"),
        **QUIET,
    )
    with caplog.at_level(logging.WARNING, logger="learner.train"):
        train(args)
    said = [r.getMessage() for r in caplog.records if "leave out 0" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("--action-bounds clip: the bounds of action dimension 0 [10, 12]")


# ---------------------------------------------------------------------------------------------
# Observations a Gaussian policy cannot act on


def test_nan_observations_are_named_before_the_norm_obs_statistics_take_them() -> None:
    """One env's NaN would make the running mean NaN for good, and with it every env's normalised
    observations (the error then named env 0): looked at first, the statistics untouched."""
    obs_rms = RunningMeanStd((2,))
    acting = _acting(obs_rms, gym.spaces.Discrete(2))
    good = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    acting.prepare_obs(good, update_stats=True, returned_at=0, reset=True)
    mean, var, count = obs_rms.mean.clone(), obs_rms.var.clone(), obs_rms.count.clone()
    bad = np.array([[1.0, 2.0], [np.nan, 4.0]], np.float32)
    with pytest.raises(
        UnusableEnvOutputError,
        match=r"^env server s1: observation of env 1 has NaN or infinite values \(\[nan  4\.\]; observation space "
        r"Box\(-inf, inf, \(2,\), float32\)\), returned by its step at the run's env step 1,026; the policy cannot "
        r"act on it$",
    ):
        acting.prepare_obs(bad, update_stats=True, returned_at=1026)
    assert torch.equal(obs_rms.mean, mean) and torch.equal(obs_rms.var, var) and torch.equal(obs_rms.count, count)
    with pytest.raises(UnusableEnvOutputError, match=r", returned by its reset at the run's env step 0; "):
        acting.prepare_obs(bad, update_stats=False, returned_at=0, reset=True)


def test_a_gaussian_policy_s_observations_are_looked_at_before_it_acts_and_a_categorical_s_are_not() -> None:
    """Normal(NaN, std).sample() is NaN, without an error (Categorical's raises, which acting_on explains):
    for Box actions the observations are looked at as they come (float64 ones beyond float32's range too,
    as the nets take them), while a categorical policy without --norm-obs pays nothing for it."""
    box = gym.spaces.Box(-1.0, 1.0, (1,), np.float32)
    with pytest.raises(UnusableEnvOutputError, match=r"^env server s0: observation of env 0 has NaN or infinite"):
        _acting(None, box).prepare_obs(np.array([[np.inf, 0.0]], np.float32), update_stats=True, returned_at=4)
    with pytest.raises(UnusableEnvOutputError, match=r"^env server s1: observation of env 1 has values beyond float"):
        _acting(None, box).prepare_obs(np.array([[0.0, 0.0], [1e39, 0.0]]), update_stats=True, returned_at=4)
    # (--norm-obs scales float64 values in float64: 1e39 is no error there)
    _acting(RunningMeanStd((2,)), box).prepare_obs(np.array([[1e39, 0.0]]), update_stats=True, returned_at=4)
    discrete = _acting(None, gym.spaces.Discrete(2))
    assert not discrete.looks_first
    x = discrete.prepare_obs(np.array([[np.nan, 0.0]], np.float32), update_stats=True, returned_at=4)
    assert isinstance(x, torch.Tensor) and bool(
        x.isnan().any()
    )  # (left to the forward's error, explained by acting_on)


def test_the_rollout_s_check_with_norm_obs_blames_the_normalisation_not_the_env() -> None:
    """With --norm-obs every observation was looked at before the statistics took it: a non-finite
    normalised one is theirs (overflowed float64), and "pass --norm-obs" is no advice to a run that did."""
    obs = torch.zeros((4, 2, 2))
    obs[2, 1] = float("nan")
    with pytest.raises(
        UnusableEnvOutputError,
        match=r"^env server s1: observation of env 1 that the policy took at step 3 of the rollout ending at env "
        r"step 8 was infinite or NaN once normalised \(--norm-obs\), though the env gave a finite one: ",
    ) as info:
        _acting(RunningMeanStd((2,)), gym.spaces.Discrete(2)).check_taken(obs, 8)
    assert "pass --norm-obs" not in str(info.value)
    with pytest.raises(UnusableEnvOutputError, match=r"scale such values on the env servers, or pass --norm-obs"):
        _acting(None, gym.spaces.Discrete(2)).check_taken(obs, 8)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=on_cuda)])
@pytest.mark.parametrize("norm_obs", [True, False])
@pytest.mark.parametrize(
    "backend",
    ["gym", pytest.param("remote", marks=pytest.mark.slow), pytest.param("pipelined", marks=pytest.mark.slow)],
)
def test_a_nan_observation_is_named_as_its_env_s_before_a_gaussian_policy_acts_on_it(
    tmp_path: Path, backend: str, norm_obs: bool, device: str
) -> None:
    """Env 1's NaN at its 10th step (the run's env step 20, in the 2nd rollout): before, a Gaussian policy
    sampled NaN actions, which the env servers refused as env 0's or env 1's actions, and in-process envs
    took, the rollout's check then naming env 0 (--norm-obs: every env's observations NaN) and advising
    --norm-obs to a run that had it."""
    args = Args(
        env=f"{__name__}:NaNObservationEnv",
        env_kwargs={"at": 10},
        backend="gym" if backend == "gym" else "remote",
        pipeline_groups=2 if backend == "pipelined" else 1,
        num_envs=2,
        num_steps=8,
        total_timesteps=64,
        seed=0,
        norm_obs=norm_obs,
        device=device,
        run_dir=str(tmp_path / "run"),
        **QUIET,
    )
    where = r"^env server \S+: " if backend != "gym" else "^"
    with pytest.raises(
        UnusableEnvOutputError,
        match=where + r"observation of env 1 has NaN or infinite values \(\[nan  1\.\]; observation space "
        r"Box\(-inf, inf, \(2,\), float32\)\), returned by its step at the run's env step 20; the policy cannot act "
        r"on it$",
    ):
        train(args)
