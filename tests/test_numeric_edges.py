"""Finite numbers at the edges of float32's and float64's ranges: an error naming the env, the step and the
value, never a run trained on zeros, NaN or inf without a word (--norm-obs statistics that overflowed, a
--norm-reward std beyond float32's range, rewards beyond it, episode returns that overflowed float64), and
an update's divergence blamed on what caused it."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any, cast

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
import torch

from learner import rundir
from learner.checkpoint import load_checkpoint
from learner.config import Args, resolve_ppo
from learner.errors import UnusableEnvOutputError, UpdateDivergedError
from learner.evaluate import evaluate
from learner.normalize import RewardScaler, RunningMeanStd
from learner.ppo import Agent, raise_unusable_rewards
from learner.resume import RECENT
from learner.stats import format_return, format_returns, mean_of, spread_of
from learner.train import Acting, check_reward_scaler, train
from learner.update import Batch, Rollout, _check_finite, make_batch, ppo_update
from tests.test_checkpointing import checkpointer, update

F32_MAX = float(np.finfo(np.float32).max)
OBS = gym.spaces.Box(-np.inf, np.inf, (2,), np.float64)
ACTIONS = gym.spaces.Discrete(2)


def _acting(obs_rms: RunningMeanStd | None) -> Acting:
    return Acting(
        agent=cast(Any, None),
        actor=cast(Any, None),
        obs_space=OBS,
        action_space=ACTIONS,
        obs_rms=obs_rms,
        obs_dtype=torch.float32,
        device=torch.device("cpu"),
        server_of=lambda env: f"env server s{env}: ",
    )


def _run(tmp_path: Path, **more: Any) -> Args:
    """A short, quiet run on ExtremeEnv (``env_kwargs`` in ``more``; env 1 the extreme one), in-process: 2 envs,
    8 steps a rollout, 32 steps, on the CPU."""
    options: dict[str, Any] = {"seed": 0, "num_envs": 2, "num_steps": 8, "total_timesteps": 32, "device": "cpu"}
    return Args(
        env="tests.numeric_envs:ExtremeEnv",
        backend="gym",
        run_dir=str(tmp_path / "run"),
        progress=False,
        plot=False,
        tensorboard=False,
        **{**options, **more},
    )


# -- --norm-obs: a feature whose running variance overflows float64 ----------------------------------------------


def test_norm_obs_statistics_that_would_overflow_are_an_error_naming_the_env_the_step_and_the_value() -> None:
    """|x| beyond about 1e154: the variance's squares overflow float64, and x / sqrt(inf) = 0 is finite, so
    that feature would be 0 to the nets for good without a word. Refused as it comes, the statistics as
    they were (a value whose squares fit is taken)."""
    rms = RunningMeanStd((2,))
    acting = _acting(rms)
    acting.prepare_obs(np.array([[1.0, 0.5], [1e150, 0.5]]), update_stats=True, returned_at=2)
    before = {k: v.clone() for k, v in rms.state_dict().items()}
    with pytest.raises(
        UnusableEnvOutputError,
        match=r"^env server s1: observation of env 1 has a value too large for --norm-obs \(-1e\+200 at index 0 of "
        r"the flattened observation; observation space Box\(-inf, inf, \(2,\), float64\)\), returned by its step at "
        r"the run's env step 4: the running variance of that feature overflowed float64 .*; the policy cannot act",
    ):
        acting.prepare_obs(np.array([[1.0, 0.5], [-1e200, 0.5]]), update_stats=True, returned_at=4)
    for key, value in rms.state_dict().items():
        assert torch.equal(value, before[key]), key
    # (an env left out of the statistics is not the one named)
    stale = np.array([False, True])
    acting.prepare_obs(np.array([[1.0, 0.5], [1e300, 0.5]]), update_stats=True, stale=stale, returned_at=6)
    with pytest.raises(UnusableEnvOutputError, match=r"^env server s0: observation of env 0 .*\(1e\+300 at index 0"):
        acting.prepare_obs(np.array([[1e300, 0.5], [1e301, 0.5]]), update_stats=True, stale=stale, returned_at=8)


def test_a_run_with_norm_obs_stops_on_an_observation_its_statistics_cannot_take(tmp_path: Path) -> None:
    """In training, as the observation comes: the run keeps its last update's checkpoint."""
    args = _run(tmp_path, norm_obs=True, env_kwargs={"obs": 1e200, "at": 10})
    with pytest.raises(
        UnusableEnvOutputError,
        match=r"^observation of env 1 has a value too large for --norm-obs \(1e\+200 at index 0 .*, returned by its "
        r"step at the run's env step 24: ",
    ):
        train(args)
    saved = rundir.list_checkpoints(tmp_path / "run")
    assert [p.name for p in saved] == ["step-0000000016.pt"]
    assert torch.isfinite(load_checkpoint(saved[0])["obs_rms"]["var"]).all()


# -- --norm-reward: a std beyond float32's range ----------------------------------------------------------------


def test_norm_reward_scales_rewards_whose_returns_std_is_beyond_float32_s_range() -> None:
    """Rewards near float32's max: the discounted returns' std passes it; as float32 it was inf, and every
    reward scaled to 0. Divided in float64, then clipped and cast."""
    scaler = RewardScaler(gamma=0.99)
    done, valid = torch.tensor([False, False]), torch.tensor([True, True])
    scaled = [scaler(torch.tensor([3e38, 0.0]), done, valid) for _ in range(8)][-1]
    std = float(torch.sqrt(scaler.rms.var + 1e-8))
    assert std > F32_MAX
    assert scaled.dtype == torch.float32
    assert scaled[0].item() == pytest.approx(3e38 / std, rel=1e-6) and scaled[0].item() > 0.01


def test_norm_reward_scales_rewards_of_ordinary_size_as_float32_division_did() -> None:
    """The float64 division of float32 rewards by the std rounded to float32, cast to float32, is the float32
    division's, bit for bit: runs scale their rewards as before."""
    gen = torch.Generator().manual_seed(0)
    scaler = RewardScaler(gamma=0.99)
    for scale in (1e-3, 1.0, 1e3, 1e20):
        for _ in range(50):
            rewards = (torch.randn(16, generator=gen) * scale).to(torch.float32)
            dones = torch.rand(16, generator=gen) < 0.1
            scaled = scaler(rewards, dones, torch.ones(16, dtype=torch.bool))
            std32 = torch.sqrt(scaler.rms.var + 1e-8).to(torch.float32)
            assert torch.equal(scaled, torch.clamp(rewards / std32, -10.0, 10.0))


# -- rewards beyond float32's range -----------------------------------------------------------------------------


def test_a_reward_beyond_float32_s_range_is_named_with_its_step_unless_clipped_or_scaled() -> None:
    rewards, valid = np.array([1.0, 1e39]), np.array([True, True])

    def where(env: int) -> str:
        return f"env server s{env}: "

    why, when = "PPO cannot learn from it", ", returned by its step at the run's env step 88"
    with pytest.raises(
        UnusableEnvOutputError,
        match=r"^env server s1: reward of env 1 is 1e\+39, returned by its step at the run's env step 88: beyond "
        r"float32's range .*\(pass --clip-reward or --norm-reward, or scale",
    ):
        raise_unusable_rewards(rewards, valid, where, why, when=when, float32="--clip-reward or --norm-reward")
    raise_unusable_rewards(rewards, valid, where, why, when=when)  # (clipped or scaled: taken)
    raise_unusable_rewards(rewards, np.array([True, False]), where, why, when=when, float32="-")  # (no transition)
    for bad, shown in ((np.nan, "nan"), (-np.inf, "-inf")):
        with pytest.raises(UnusableEnvOutputError, match=rf"^env server s0: reward of env 0 is {shown}{when}: PPO"):
            raise_unusable_rewards(np.array([bad, 1.0]), valid, where, why, when=when)


def test_norm_reward_scales_rewards_beyond_float32_s_range_and_clip_reward_clips_them() -> None:
    """Kept float64 until scaled (or clipped to their sign): the batch is finite, the reward not lost."""
    rollout = Rollout.allocate(4, 2, (2,), torch.float32, (), torch.int64, torch.device("cpu"))
    rollout.rewards[:] = [[1.0, 1e39], [0.0, 2e39], [1.0, 0.0], [0.0, 1e39]]
    rollout.valid[:] = True
    for flag in ("norm_reward", "clip_reward"):
        args = Args(env="CartPole-v1", norm_reward=flag == "norm_reward", clip_reward=flag == "clip_reward")
        hp = resolve_ppo(args, OBS, ACTIONS)
        scaler = RewardScaler(hp.gamma) if flag == "norm_reward" else None
        batch = make_batch(rollout, torch.zeros(2), hp, scaler, next_step_autoreset=True)
        assert torch.isfinite(batch.returns).all() and batch.returns.dtype == torch.float32, flag
        # (the last step's return is its reward, the next value 0: 1e39 scaled by its returns' std, or clipped)
        last = batch.returns.reshape(4, 2)[3, 1].item()
        assert (0.1 < last < 10.0) if scaler else last == 1.0, (flag, last)


@pytest.mark.parametrize("flag", ["", "clip_reward", "norm_reward"])
def test_training_on_rewards_beyond_float32_s_range(tmp_path: Path, flag: str) -> None:
    """Without --clip-reward or --norm-reward, an error at the step that gave it (not a cast's RuntimeWarning,
    then a diverged update advising --norm-reward); with either, the run trains."""
    args = _run(tmp_path, env_kwargs={"reward": 1e39, "at": 6}, **({flag: True} if flag else {}))
    if not flag:
        with pytest.raises(
            UnusableEnvOutputError,
            match=r"^reward of env 1 is 1e\+39, returned by its step at the run's env step 14: beyond float32's range",
        ):
            train(args)
        return
    summary = train(args)
    assert summary["total_steps"] == 32 and summary["stop_reason"] == "total_timesteps"


# -- episode returns that overflow float64 ----------------------------------------------------------------------


def test_an_episode_return_that_overflows_float64_is_named_in_training_and_evaluation(tmp_path: Path) -> None:
    """Rewards of 1e308, finite each (taken with --clip-reward), whose episode sums overflow to inf: no mean,
    best.pt, "solved" nor JSON to make of them; an error naming the env, in train as in eval."""
    args = _run(tmp_path, clip_reward=True, env_kwargs={"reward": 1e308})
    with pytest.raises(
        UnusableEnvOutputError,
        match=r"^return of env 1 is inf for the episode that ended at the run's env step 8: its rewards, "
        r"finite each, summed beyond float64's range",
    ):
        train(args)
    # Trained on ordinary rewards, evaluated on the extreme ones.
    run = tmp_path / "ordinary" / "run"
    train(_run(tmp_path / "ordinary", total_timesteps=16))
    with pytest.raises(
        UnusableEnvOutputError,
        match=r"^return of env 1 \(.*ExtremeEnv.*\) is (-?inf|nan) for the episode that ended: its rewards",
    ) as info:
        evaluate(
            run,
            2,
            backend="gym",
            num_envs=2,
            device="cpu",
            env_kwargs={"reward": 1e308, "signed": True, "at": 1},
            progress=False,
        )
    # (env 0's episode, which ended at the same step, is one)
    assert info.value.partial_result is not None and info.value.partial_result["episodes"] == 1


def test_an_episode_return_that_overflows_is_named_in_training_with_no_numpy_warning_first(tmp_path: Path) -> None:
    """numpy's "RuntimeWarning: overflow encountered in add" (with its source line) came before the error; which
    advised a wrapper on the env servers, with --backend gym too."""
    with warnings.catch_warnings(record=True) as seen, pytest.raises(UnusableEnvOutputError) as raised:
        warnings.simplefilter("always")
        train(_run(tmp_path, clip_reward=True, env_kwargs={"reward": 1e308}))
    assert not [w for w in seen if "overflow" in str(w.message)], [str(w.message) for w in seen]
    assert str(raised.value).startswith("return of env"), raised.value
    assert str(raised.value).endswith("(scale the rewards in a wrapper of the env, which runs in this process)")


def test_a_mean_return_that_is_no_number_is_never_the_best(tmp_path: Path) -> None:
    """A mean of returns of a run checkpointed before they were looked at (inf among them) is none to judge:
    no best.pt of nets judged on inf, which no later mean could beat; a best that is NaN (such a run's) is
    beaten by any mean. Returns near float64's max, finite each, have a finite mean, though their sum overflows."""
    made = checkpointer(tmp_path, save_best=True)
    update(made, returns=(float("inf"),) + (1.0,) * (RECENT - 1))
    assert made.counters.best_return is None and not (tmp_path / "checkpoints" / "best.pt").exists()
    made.counters.best_return = float("nan")
    update(made, returns=(1.0,) * RECENT)
    assert made.counters.best_return == 1.0 and (tmp_path / "checkpoints" / "best.pt").is_file()
    update(made, returns=(1e308,) * RECENT)
    assert made.counters.best_return == pytest.approx(1e308)


def test_the_mean_and_spread_of_returns_near_float64_s_max_are_finite() -> None:
    values = [1e308, 1.5e308, -1e308]
    assert mean_of(values) == pytest.approx(np.mean(np.array(values) / 3) * 3)
    assert spread_of(values) == pytest.approx(np.std(np.array(values) / 1e308) * 1e308)
    ordinary = [0.1, 0.7, 3.0]
    assert (mean_of(ordinary), spread_of(ordinary)) == (float(np.mean(ordinary)), float(np.std(ordinary)))


def test_norm_reward_returns_whose_variance_overflows_float64_are_an_error_naming_the_env() -> None:
    """Rewards of 1e200 (--norm-reward takes them, beyond float32's range): the discounted returns' variance
    overflows float64, and every reward would be scaled to 0 from then on."""
    rollout = Rollout.allocate(2, 2, (2,), torch.float32, (), torch.int64, torch.device("cpu"))
    rollout.rewards[:] = [[1.0, 1e100], [0.0, 1e200]]
    rollout.valid[:] = True
    hp = resolve_ppo(Args(env="CartPole-v1", norm_reward=True), OBS, ACTIONS)
    scaler = RewardScaler(hp.gamma)
    make_batch(rollout, torch.zeros(2), hp, scaler, next_step_autoreset=True)
    with pytest.raises(
        UnusableEnvOutputError,
        match=r"^env server s1: reward of env 1 is 1e\+200 at step 2 of the rollout ending at env step 64: too large "
        r"for --norm-reward, .*; pass --clip-reward",
    ):
        check_reward_scaler(scaler, rollout, lambda env: f"env server s{env}: ", 64)
    rollout.rewards[1, 1] = 1e100
    scaler = RewardScaler(hp.gamma)
    make_batch(rollout, torch.zeros(2), hp, scaler, next_step_autoreset=True)
    check_reward_scaler(scaler, rollout, lambda env: f"env server s{env}: ", 64)


@pytest.mark.parametrize(("value", "text"), [(1.515e39, "1.515e+39"), (-2e9, "-2e+09"), (123456789.0, "123456789.0")])
def test_huge_returns_print_with_an_exponent(value: float, text: str) -> None:
    assert format_return(value) == text


@pytest.mark.parametrize(
    ("values", "texts"),
    [
        ((97.0, 12.3871, 81.0, 115.0), ("97.0", "12.4", "81.0", "115.0")),  # (each alone: 97, 12.39, 81, 115.0)
        ((2.0, 0.0, 2.0, 2.0), ("2", "0", "2", "2")),
        ((500.0, 0.0, 500.0, 500.0), ("500.0", "0.0", "500.0", "500.0")),  # (alone: 500.0 +- 0)
        ((0.9615, 0.05, 0.9, 1.0), ("0.9615", "0.05", "0.9", "1")),  # (below 100: 4 significant digits each)
        ((99.5, 150.25, -300.0, 1e3), ("99.5", "150.2", "-300.0", "1000.0")),
        ((1.515e39, 4e38, 0.0, 2e39), ("1.515e+39", "4e+38", "0", "2e+39")),
        ((float("nan"), float("inf"), 1.5, 3.0), ("nan", "inf", "1.5", "3")),
    ],
)
def test_the_returns_of_one_line_print_in_one_style(values: tuple[float, ...], texts: tuple[str, ...]) -> None:
    """learner eval's "return MEAN +- STD (min MIN, max MAX)": one decimal each where the largest has one, not
    each its own style ("97 +- 12.39 (min 81, max 115.0)"); one value as format_return gives it."""
    assert format_returns(*values) == texts
    for value in values:
        assert format_returns(value) == (format_return(value),)


# -- what a diverged update is blamed on -----------------------------------------------------------------------


def _diverging(returns: float, learning_rate: float, norm_reward: bool = False) -> str:
    """The UpdateDivergedError of an update at ``learning_rate`` on a batch of 64 transitions whose returns are
    up to ``returns``."""
    torch.manual_seed(0)
    obs_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    agent = Agent(obs_space, ACTIONS)
    hp = resolve_ppo(Args(env="CartPole-v1", learning_rate=learning_rate, norm_reward=norm_reward), obs_space, ACTIONS)
    obs = torch.rand(64, 2)
    with torch.no_grad():
        actions, logprobs, _, values = agent.get_action_and_value(obs)
    batch = Batch(obs, actions, logprobs, torch.randn(64), torch.linspace(0, returns, 64), values)
    optimizer = torch.optim.Adam(agent.parameters(), lr=learning_rate)
    with pytest.raises(UpdateDivergedError) as info:
        ppo_update(agent, optimizer, batch, hp, learning_rate=learning_rate, clip_coef=0.2)
    return str(info.value)


def test_a_value_loss_that_overflows_on_modest_returns_blames_the_learning_rate() -> None:
    message = _diverging(returns=3.0, learning_rate=1e30)
    assert re.search(
        r"value loss inf\), .*: the value loss overflowed, though the returns are modest \(up to 3\): ", message
    )
    assert "lower --learning-rate (now 1e+30)" in message and "--norm-reward" not in message, message


@pytest.mark.parametrize("norm_reward", [False, True])
def test_a_value_loss_that_overflows_on_huge_returns_blames_them(norm_reward: bool) -> None:
    """--norm-reward advised only where it is off."""
    message = _diverging(returns=1e30, learning_rate=1e-3, norm_reward=norm_reward)
    assert "the value loss overflowed: returns too large for float32 (up to 1e+30); scale the rewards (" in message
    assert ("--norm-reward" in message) is not norm_reward, message


def test_a_diverged_update_advises_norm_reward_only_where_it_is_off() -> None:
    watched = torch.tensor([[float("nan"), 0.1, 5.0]])  # (a NaN gradient, finite losses)
    for norm_reward in (False, True):
        hp = resolve_ppo(Args(env="CartPole-v1", norm_reward=norm_reward), OBS, ACTIONS)
        with pytest.raises(
            UpdateDivergedError, match=r"lower --learning-rate \(now 0\.001\) or --max-grad-norm"
        ) as info:
            _check_finite(watched, 1, 1, torch.ones(4), hp, 1e-3)
        assert ("--norm-reward" in str(info.value)) is not norm_reward
