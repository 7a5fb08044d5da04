"""PPO's pieces on their own: GAE against hand-computed numbers, the losses, the heads, the networks."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
import torch

from learner.config import PRESETS, PPOConfig
from learner.fleet import FleetChange
from learner.normalize import DictRunningMeanStd, RewardScaler, RunningMeanStd, obs_normalizer
from learner.ppo import (
    MAX_CNN_PARAMETERS,
    ActionHead,
    Agent,
    NatureCNN,
    check_cnn_size,
    check_observation_space,
    clipped_policy_loss,
    cnn_parameters,
    explained_variance,
    gae_advantages,
    image_layout,
    is_image_space,
    normalize_advantages,
    observations_usable,
    unusable_observation,
    value_loss,
    vector_keys,
)
from learner.update import Rollout, make_batch, ppo_update


def t(rows: list[list[float]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(T, N) from a list of per-env rows (easier to read: one env per line)."""
    return torch.tensor(rows, dtype=dtype).T


def test_gae_against_a_hand_computed_case_with_truncation_and_a_reset_step() -> None:
    # gamma 0.9, lambda 0.5, 4 steps, 2 envs, next-step autoreset.
    # Env 0: a transition; a transition that *truncates* (so step 2 is the reset step, and
    # V(final obs) = 0.8 is the value computed at that step); then a transition that terminates.
    # Env 1: no episode end; the rollout's last step bootstraps from V(next obs) = 5.
    rewards = t([[1, 2, 0, 1], [1, 1, 1, 1]])
    values = t([[0.5, 0.6, 0.8, 0.3], [1, 2, 3, 4]])
    next_values = t([[0.6, 0.8, 0.3, 0.7], [2, 3, 4, 5]])  # values[1:] and the bootstrap value
    terminations = t([[0, 0, 0, 1], [0, 0, 0, 0]], torch.bool)
    truncations = t([[0, 1, 0, 0], [0, 0, 0, 0]], torch.bool)
    valid = t([[1, 1, 0, 1], [1, 1, 1, 1]], torch.bool)

    adv = gae_advantages(rewards, values, next_values, terminations, truncations, valid, gamma=0.9, gae_lambda=0.5)

    # Env 0, by hand:
    #   t=3 terminates: delta = 1 - 0.3 = 0.7 (no bootstrap)                                  A = 0.7
    #   t=2 is the reset step: not a transition                                                 A = 0
    #   t=1 truncates: delta = 2 + 0.9 * 0.8 - 0.6 = 2.12, bootstrapped from V(final obs);
    #       the lambda-return stops at the episode's end                                        A = 2.12
    #   t=0: delta = 1 + 0.9 * 0.6 - 0.5 = 1.04;  A = 1.04 + 0.9 * 0.5 * 2.12                 A = 1.994
    # Env 1: deltas 1.8, 1.7, 1.6, 1.5 (1 + 0.9 V(t+1) - V(t)); A_t = delta_t + 0.45 A_t+1.
    expected = t([[1.994, 2.12, 0.0, 0.7], [3.0256875, 2.72375, 2.275, 1.5]])
    torch.testing.assert_close(adv, expected)
    # Returns (the value targets) are advantages plus values.
    torch.testing.assert_close((adv + values)[:, 0], torch.tensor([2.494, 2.72, 0.8, 1.0]))
    # Treating the truncation as a termination (as CleanRL does) would have given 2 - 0.6 = 1.4.
    assert adv[1, 0].item() != pytest.approx(1.4)


def test_gae_with_gamma_and_lambda_one_is_the_monte_carlo_return_minus_the_value() -> None:
    rewards = t([[1, 1, 1, 1, 1]])
    values = t([[0.0, 0.0, 0.0, 0.0, 0.0]])
    next_values = t([[0.0, 0.0, 0.0, 0.0, 10.0]])
    none = t([[0, 0, 0, 0, 0]], torch.bool)
    valid = t([[1, 1, 1, 1, 1]], torch.bool)
    adv = gae_advantages(rewards, values, next_values, none, none, valid, gamma=1.0, gae_lambda=1.0)
    torch.testing.assert_close(adv[:, 0], torch.tensor([15.0, 14.0, 13.0, 12.0, 11.0]))


def test_gae_does_not_chain_across_a_step_that_is_not_a_transition() -> None:
    # An env unavailable at step 1 (no episode end reported): step 0's lambda-return must not use it.
    rewards = t([[1, 100, 1]])
    values = t([[0.0, 0.0, 0.0]])
    next_values = t([[0.0, 0.0, 0.0]])
    none = t([[0, 0, 0]], torch.bool)
    valid = t([[1, 0, 1]], torch.bool)
    adv = gae_advantages(rewards, values, next_values, none, none, valid, gamma=1.0, gae_lambda=1.0)
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.0, 0.0, 1.0]))


def test_gae_leaves_out_nan_rewards_and_values_of_steps_that_are_not_transitions() -> None:
    """A step that is no transition (a reset step, an env unavailable) may hold a NaN reward or value: it
    is selected out, not multiplied by 0 (0 * NaN is NaN, which the lambda-return carried into the
    episode before it and from there into every advantage of the batch's normalisation)."""
    rewards = t([[1, 0, 1], [1, 0, 2]])
    values = t([[0.5, 0, 0.25], [1, 0, 3]])
    next_values = t([[0.0, 0.25, 0.5], [0, 3, 4]])
    terminations = t([[0, 0, 0], [0, 0, 0]], torch.bool)
    truncations = t([[1, 0, 0], [0, 0, 0]], torch.bool)  # env 0: step 1 is the reset step
    valid = t([[1, 0, 1], [1, 0, 1]], torch.bool)  # env 1: unavailable in step 1
    clean = gae_advantages(rewards, values, next_values, terminations, truncations, valid, 0.99, 0.95)
    rewards[1], values[1] = float("nan"), float("nan")
    adv = gae_advantages(rewards, values, next_values, terminations, truncations, valid, 0.99, 0.95)
    assert torch.equal(adv, clean), adv
    assert bool(torch.isfinite(adv).all()) and adv[1].tolist() == [0.0, 0.0]


def test_gae_gives_the_numbers_of_masking_by_multiplication_bit_for_bit_on_finite_inputs() -> None:
    """Selecting invalid steps out changes no run: on finite inputs the advantages are those of
    ``(...) * valid`` to the bit (runs and checkpoints made before give the same numbers)."""
    gen = torch.Generator().manual_seed(0)
    steps, envs, gamma, lam = 64, 8, 0.99, 0.95
    rewards, values, next_values = (torch.randn(steps, envs, generator=gen) for _ in range(3))
    terminations, truncations = (torch.rand(steps, envs, generator=gen) < 0.05 for _ in range(2))
    valid = torch.rand(steps, envs, generator=gen) > 0.1
    valid_f, not_terminated = valid.float(), 1.0 - terminations.float()
    continues = 1.0 - (terminations | truncations).float()
    expected, last = torch.zeros_like(rewards), torch.zeros(envs)
    for step in reversed(range(steps)):
        delta = rewards[step] + gamma * next_values[step] * not_terminated[step] - values[step]
        follows = continues[step] * (valid_f[step + 1] if step + 1 < steps else 1.0)
        last = (delta + gamma * lam * follows * last) * valid_f[step]
        expected[step] = last
    adv = gae_advantages(rewards, values, next_values, terminations, truncations, valid, gamma, lam)
    assert torch.equal(adv, expected)
    # (a 0/1 float mask as well: it raised "where expected condition to be a boolean tensor")
    adv = gae_advantages(rewards, values, next_values, terminations, truncations, valid_f, gamma, lam)
    assert torch.equal(adv, expected)


def test_clipped_policy_loss_clips_and_reports_kl_and_clipfrac() -> None:
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.0, 1.5, 0.5, 1.1])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0])
    loss, stats = clipped_policy_loss(new, old, adv, clip_coef=0.2)
    # Per sample: max(-A r, -A clip(r)) = -1, -1.2 (clipped), 0.8 (clipped), -1.1.
    assert loss.item() == pytest.approx((-1 - 1.2 + 0.8 - 1.1) / 4)
    loss.backward()
    assert new.grad is not None
    assert new.grad[1].item() == 0.0 and new.grad[2].item() == 0.0  # clipped samples pass no gradient
    assert stats["clipfrac"].item() == pytest.approx(0.5)
    ratio = torch.tensor([1.0, 1.5, 0.5, 1.1])
    assert stats["approx_kl"].item() == pytest.approx(((ratio - 1) - ratio.log()).mean().item())
    assert stats["old_approx_kl"].item() == pytest.approx((-ratio.log()).mean().item())


def test_value_loss_clipped_takes_the_larger_error() -> None:
    new, old, ret = torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([3.0])
    assert value_loss(new, old, ret, None).item() == pytest.approx(0.5 * 1.0)
    # Clipped prediction 0.5 is 2.5 from the return: the larger error wins.
    assert value_loss(new, old, ret, 0.5).item() == pytest.approx(0.5 * 2.5**2)


def test_normalize_advantages_and_explained_variance() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    y = normalize_advantages(x)
    assert y.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert y.std().item() == pytest.approx(1.0, abs=1e-4)
    assert explained_variance(x, x) == pytest.approx(1.0)
    assert explained_variance(torch.full((4,), 2.5), x) == pytest.approx(0.0)
    assert np.isnan(explained_variance(x, torch.ones(4)))


def test_heads_map_raw_actions_into_each_space() -> None:
    torch.manual_seed(0)
    discrete = ActionHead.for_space(gym.spaces.Discrete(3, start=-1))
    raw = discrete.distribution(torch.zeros(64, 3)).sample()
    assert set(discrete.to_env(raw).tolist()) <= {-1, 0, 1}

    multi = ActionHead.for_space(gym.spaces.MultiDiscrete([2, 5], start=[1, 10]))
    dist = multi.distribution(torch.zeros(16, 7))
    raw = dist.sample()
    assert raw.shape == (16, 2)
    assert dist.log_prob(raw).shape == (16,)
    torch.testing.assert_close(dist.log_prob(raw), torch.full((16,), float(np.log(1 / 2) + np.log(1 / 5))))
    env = multi.to_env(raw)
    assert ((env[:, 0] >= 1) & (env[:, 0] <= 2) & (env[:, 1] >= 10) & (env[:, 1] <= 14)).all()

    box = gym.spaces.Box(np.array([-1.0, 0.0], np.float32), np.array([1.0, 2.0], np.float32))
    big = torch.tensor([[-50.0, 50.0], [0.0, 0.0]])
    clip = ActionHead.for_space(box, "clip")
    torch.testing.assert_close(clip.to_env(big), torch.tensor([[-1.0, 2.0], [0.0, 0.0]]))
    squash = ActionHead.for_space(box, "squash")
    torch.testing.assert_close(squash.to_env(big), torch.tensor([[-1.0, 2.0], [0.0, 1.0]]))

    with pytest.raises(ValueError, match="action_space: expected Discrete"):
        ActionHead.for_space(gym.spaces.Dict({"a": gym.spaces.Discrete(2)}))
    with pytest.raises(ValueError, match="finite action bounds"):
        ActionHead.for_space(gym.spaces.Box(-np.inf, np.inf, (2,)), "squash")


def test_squash_maps_onto_bounds_further_apart_than_float32_holds() -> None:
    """+-3.4e38 (float32's range, as some envs declare "unbounded but finite"): high - low is inf in
    float32, and low + (tanh + 1) * 0.5 * (high - low) made every action inf (clipped to high on its way
    out). Mapped from the bounds' middle by half their span, each half taken before the sum."""
    top = float(np.finfo(np.float32).max)
    raw = torch.tensor([[-3.0], [-0.5], [0.0], [0.5], [3.0]])
    for wide in ((-top, top), (-1e38, 3e38), (-2e38, 2e38)):
        low, high = (float(np.float32(bound)) for bound in wide)  # (as the Box holds them)
        head = ActionHead.for_space(gym.spaces.Box(low, high, (1,), np.float32), "squash")
        env = head.to_env(raw)[:, 0]
        assert bool(torch.isfinite(env).all()), (low, high, env)
        assert bool((env[1:] > env[:-1]).all()), env  # (increasing, as tanh: none at a bound)
        assert float(env[0]) >= low and float(env[-1]) <= high
        assert float(env[2]) == pytest.approx(low / 2 + high / 2, rel=1e-6)
        mirrored = (low + high) - env.flip(0)  # (tanh's symmetry around the middle)
        torch.testing.assert_close(env, mirrored, rtol=1e-6, atol=0.0)
    # A dimension whose span fits keeps the formula runs were made with, to the bit, beside a wide one.
    box = gym.spaces.Box(np.array([-1.0, -top, 0.5], np.float32), np.array([2.0, top, 3.0], np.float32))
    head = ActionHead.for_space(box, "squash")
    raw = torch.randn(32, 3, generator=torch.Generator().manual_seed(0))
    lows, highs = torch.as_tensor(box.low), torch.as_tensor(box.high)
    fits = lows + (torch.tanh(raw) + 1.0) * 0.5 * (highs - lows)
    env = head.to_env(raw)
    assert torch.equal(env[:, [0, 2]], fits[:, [0, 2]])
    assert bool(torch.isfinite(env).all())


def test_agent_uses_the_nature_cnn_for_image_observations() -> None:
    obs_space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)
    agent = Agent(obs_space, gym.spaces.Discrete(6))
    assert agent.cnn is not None
    obs = torch.randint(0, 256, (3, 4, 84, 84), dtype=torch.uint8)
    action, logprob, entropy, value = agent.get_action_and_value(obs)
    assert action.shape == logprob.shape == entropy.shape == value.shape == (3,)
    assert agent.act(obs).shape == (3,)


def test_agent_state_dict_of_a_cnn_policy_keeps_its_keys() -> None:
    """Checkpoints of (C, H, W) policies written before channel-last images were taken still load."""
    agent = Agent(gym.spaces.Box(0, 255, (4, 84, 84), np.uint8), gym.spaces.Discrete(6))
    convs = [f"cnn.convs.{i}.{p}" for i in (0, 2, 4) for p in ("weight", "bias")]
    heads = [f"{net}.{p}" for net in ("actor", "critic") for p in ("weight", "bias")]
    assert sorted(agent.state_dict()) == sorted([*convs, "cnn.fc.0.weight", "cnn.fc.0.bias", *heads])
    assert agent.state_dict()["cnn.convs.0.weight"].shape == (32, 4, 8, 8)


@pytest.mark.parametrize(
    ("shape", "layout"),
    [
        ((4, 84, 84), "CHW"),
        ((1, 36, 36), "CHW"),
        ((84, 84, 4), "HWC"),
        ((210, 160, 3), "HWC"),  # a raw ALE frame
        ((36, 36, 1), "HWC"),
        ((32, 32, 3), None),  # too small either way
        ((3, 32, 32), None),
        ((84, 84, 5), None),  # 5 "channels" last: not a camera's
        ((40, 30, 3), None),
        ((84, 84), "HW"),  # AtariPreprocessing's grayscale frame, no frame stack
        ((36, 50), "HW"),
        ((8, 8), None),  # a board, not pixels: the MLP
        ((84,), None),
    ],
)
def test_image_layout_takes_channel_first_and_channel_last_frames(shape: tuple[int, ...], layout: str | None) -> None:
    space = gym.spaces.Box(0, 255, shape, np.uint8)
    assert image_layout(space) == layout and is_image_space(space) == (layout is not None)
    assert image_layout(gym.spaces.Box(0.0, 1.0, shape, np.float32)) is None  # only uint8 frames


def test_agent_takes_grayscale_frames_as_one_channel() -> None:
    """An (H, W) policy is the (1, H, W) one: same parameters, same outputs."""
    chw = Agent(gym.spaces.Box(0, 255, (1, 40, 48), np.uint8), gym.spaces.Discrete(4))
    hw = Agent(gym.spaces.Box(0, 255, (40, 48), np.uint8), gym.spaces.Discrete(4))
    hw.load_state_dict(chw.state_dict())
    frames = torch.randint(0, 256, (5, 40, 48), dtype=torch.uint8)
    torch.testing.assert_close(hw.get_value(frames), chw.get_value(frames.unsqueeze(1)))


def test_agent_permutes_channel_last_frames_into_the_same_cnn() -> None:
    """An (H, W, C) policy is the (C, H, W) one on permuted frames: same parameters, same outputs."""
    chw = Agent(gym.spaces.Box(0, 255, (3, 40, 48), np.uint8), gym.spaces.Discrete(4))
    hwc = Agent(gym.spaces.Box(0, 255, (40, 48, 3), np.uint8), gym.spaces.Discrete(4))
    hwc.load_state_dict(chw.state_dict())
    frames = torch.randint(0, 256, (5, 40, 48, 3), dtype=torch.uint8)
    torch.testing.assert_close(hwc.get_value(frames), chw.get_value(frames.permute(0, 3, 1, 2)))
    torch.testing.assert_close(hwc.act(frames), chw.act(frames.permute(0, 3, 1, 2)))


@pytest.mark.parametrize("shape", [(32, 32, 3), (3, 32, 32), (84, 84, 8)])
def test_agent_refuses_uint8_frames_the_cnn_cannot_take_rather_than_an_mlp_on_raw_pixels(
    shape: tuple[int, ...],
) -> None:
    with pytest.raises(
        ValueError, match=rf"observation_space: uint8 images of shape \({shape[0]}, .* do not fit"
    ) as info:
        Agent(gym.spaces.Box(0, 255, shape, np.uint8), gym.spaces.Discrete(3))
    assert "--wrappers atari" in str(info.value)
    # Other uint8 observations (vectors, grids of 2 dimensions) still get an MLP.
    assert Agent(gym.spaces.Box(0, 255, (7, 7), np.uint8), gym.spaces.Discrete(3)).cnn is None


def test_agent_mlp_for_vector_and_discrete_observations() -> None:
    agent = Agent(gym.spaces.Box(-1, 1, (2, 3)), gym.spaces.Box(-1, 1, (2,)))
    assert agent.cnn is None
    action, logprob, _, value = agent.get_action_and_value(torch.zeros(5, 2, 3))
    assert action.shape == (5, 2) and logprob.shape == value.shape == (5,)
    one_hot = Agent(gym.spaces.Discrete(4, start=1), gym.spaces.Discrete(2))
    assert one_hot.get_value(torch.tensor([1, 4])).shape == (2,)
    with pytest.raises(ValueError, match="observation_space: expected a Box"):
        Agent(gym.spaces.Tuple((gym.spaces.Discrete(2),)), gym.spaces.Discrete(2))


@pytest.mark.parametrize(
    ("space", "said"),
    [
        (
            gym.spaces.Dict(
                {"pos": gym.spaces.Box(-1, 1, (2,)), "nested": gym.spaces.Dict({"a": gym.spaces.Discrete(3)})}
            ),
            r"the Dict's key 'nested' holds Dict\('a': Discrete\(3\)\); the policy takes a Dict whose values are each a Box",
        ),
        (
            gym.spaces.Dict({"pair": gym.spaces.Tuple((gym.spaces.Discrete(2),)), "pos": gym.spaces.Box(-1, 1, (2,))}),
            r"the Dict's key 'pair' holds Tuple\(Discrete\(2\)\)",
        ),
        (gym.spaces.Tuple((gym.spaces.Discrete(2), gym.spaces.MultiBinary(3))), "expected a Box"),
    ],
    ids=["nested Dict", "Tuple in a Dict", "Tuple"],
)
def test_refused_dict_and_tuple_observations_point_at_the_flatten_wrapper(space: gym.Space[Any], said: str) -> None:
    with pytest.raises(ValueError, match=said) as info:
        check_observation_space(space)
    assert "env-server --wrappers flatten" in str(info.value)
    assert "learner train --wrappers flatten" in str(info.value)
    # ... which gives an observation the agent takes.
    check_observation_space(gym.spaces.flatten_space(space))


def test_observations_the_flatten_wrapper_cannot_take_get_no_hint_to_use_it() -> None:
    with pytest.raises(ValueError, match="expected a Box") as info:
        check_observation_space(gym.spaces.Graph(gym.spaces.Box(0, 1, (2,)), None))
    assert "flatten" not in str(info.value)


def test_running_mean_std_matches_numpy_over_batches() -> None:
    rng = np.random.default_rng(0)
    data = rng.normal(3.0, 2.0, size=(1000, 3))
    rms = RunningMeanStd((3,))
    for batch in np.array_split(data, 7):
        rms.update(torch.as_tensor(batch))
    np.testing.assert_allclose(rms.mean.numpy(), data.mean(0), rtol=1e-3)
    np.testing.assert_allclose(rms.var.numpy(), data.var(0), rtol=1e-3)


def test_reward_scaler_ignores_steps_that_are_not_transitions() -> None:
    scaler = RewardScaler(gamma=0.5)
    done = torch.tensor([False])
    scaler(torch.tensor([2.0]), done, torch.tensor([True]))
    count = scaler.rms.count.item()
    scaler(torch.tensor([100.0]), done, torch.tensor([False]))
    assert scaler.rms.count.item() == count
    assert scaler.returns is not None and scaler.returns.item() == 2.0


def test_reward_scaler_keeps_the_returns_of_episodes_that_go_on_when_the_fleet_changes() -> None:
    scaler = RewardScaler(gamma=0.5)
    scaler(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([False] * 3), torch.tensor([True] * 3))
    # The second server (env 1) left, a new one (two envs) joined: envs 0 and 2 go on, as envs 0 and 1.
    change = FleetChange(("c",), ("b",), 4, 3, np.array([0, 2, -1, -1]), np.zeros((4, 4)), {})
    scaler.follow(change)
    assert scaler.returns is not None and scaler.returns.tolist() == [1.0, 3.0, 0.0, 0.0]
    assert scaler.returns.dtype == torch.float64
    scaled = scaler(torch.tensor([1.0] * 4), torch.tensor([False] * 4), torch.tensor([True] * 4))
    assert scaled.shape == (4,) and scaler.returns.tolist() == [1.5, 2.5, 1.0, 1.0]


@pytest.mark.parametrize("shape", [(84, 84, 3), (4, 84, 84), (40, 50), (210, 160, 3), (37, 41, 2)])
def test_cnn_parameters_counts_those_of_the_nature_cnn_built(shape: tuple[int, ...]) -> None:
    space = gym.spaces.Box(0, 255, shape, np.uint8)
    layout = image_layout(space)
    assert layout is not None
    assert cnn_parameters(space) == sum(p.numel() for p in NatureCNN(shape, layout).parameters())
    check_cnn_size(space)


def test_check_cnn_size_refuses_a_cameras_frames() -> None:
    """(1080, 1920, 3): a billion parameters, counted without building them."""
    space = gym.spaces.Box(0, 255, (1080, 1920, 3), np.uint8)
    assert cnn_parameters(space) == 1_013_131_936 > MAX_CNN_PARAMETERS
    with pytest.raises(ValueError, match=r"images of shape \(1080, 1920, 3\) would give the Nature CNN 1,013,131,936"):
        check_cnn_size(space)
    assert cnn_parameters(gym.spaces.Box(-1.0, 1.0, (1080, 1920, 3))) == 0  # (float32: no CNN)


CAMERA_AND_STATE = gym.spaces.Dict(
    {
        "camera": gym.spaces.Box(0, 255, (40, 40, 3), np.uint8),
        "goal": gym.spaces.Box(-1, 1, (2, 2), np.float32),
        "mode": gym.spaces.Discrete(3, start=-1),
    }
)


def _camera_batch(n: int) -> dict[str, torch.Tensor]:
    return {
        "camera": torch.randint(0, 256, (n, 40, 40, 3), dtype=torch.uint8),
        "goal": torch.rand(n, 2, 2),
        "mode": torch.tensor([-1, 0, 1, -1, 0][:n]),
    }


def test_dict_observations_get_a_cnn_per_image_key_the_rest_flattened_or_one_hot_as_sb3s_combined_extractor() -> None:
    torch.manual_seed(0)
    agent = Agent(CAMERA_AND_STATE, gym.spaces.Box(-1, 1, (2,)), hidden_sizes=(16,))
    assert agent.combined is not None and agent.cnn is None
    assert list(agent.combined.cnns) == ["camera"]
    assert agent.combined.num_features == 512 + 4 + 3  # (the CNN's, the flattened goal's, the one-hot mode's)
    # Actor and critic each an MLP of the hidden sizes on the shared features.
    assert [m.out_features for m in agent.actor.modules() if isinstance(m, torch.nn.Linear)] == [16, 2]
    assert [m.out_features for m in agent.critic.modules() if isinstance(m, torch.nn.Linear)] == [16, 1]
    obs = _camera_batch(5)
    action, logprob, _, value = agent.get_action_and_value(obs)
    assert action.shape == (5, 2) and logprob.shape == value.shape == (5,)
    # The CNN is the one a Box of those frames gets (channel-last permuted): the same features.
    single = Agent(CAMERA_AND_STATE["camera"], gym.spaces.Discrete(2))
    assert single.cnn is not None
    single.cnn.load_state_dict(agent.combined.cnns["camera"].state_dict())
    torch.testing.assert_close(single.cnn(obs["camera"]), agent.combined(obs)[:, :512])
    # The one-hot takes the Discrete's start into account: -1 is the first class.
    assert agent.combined(obs)[0, 512 + 4 :].tolist() == [1.0, 0.0, 0.0]
    assert agent.act(obs).shape == (5, 2)


@pytest.mark.parametrize(
    "key",
    [
        "observation.images.top",  # (LeRobot's names: torch reads a dot in a module's name as a submodule's path)
        "",  # (torch names no module so)
        "keys",  # (a ModuleDict's own attribute)
        "%observation%2Eimage",  # (what an escaped name looks like: escaped too, not taken for the first key's)
    ],
)
def test_dict_image_keys_torch_cannot_name_a_module_by_get_their_cnn_under_an_escaped_name(key: str) -> None:
    # A camera under any str key trains: its CNN is named in the ModuleDict (and the checkpoints) by an escaped form
    # of the key, one per key, and a fresh Agent loads the weights back and acts the same.
    frame = gym.spaces.Box(0, 255, (36, 36, 3), np.uint8)
    space = gym.spaces.Dict({key: frame, "observation.image": frame, "state": gym.spaces.Box(-1, 1, (2,))})
    torch.manual_seed(0)
    agent = Agent(space, gym.spaces.Discrete(3), hidden_sizes=(8,))
    assert agent.combined is not None and agent.combined.num_features == 2 * 512 + 2
    assert len(set(agent.combined.cnn_names.values())) == 2 == len(agent.combined.cnns)
    assert all("." not in name and name for name in agent.combined.cnn_names.values())
    obs = {
        key: torch.randint(0, 256, (4, 36, 36, 3), dtype=torch.uint8),
        "observation.image": torch.randint(0, 256, (4, 36, 36, 3), dtype=torch.uint8),
        "state": torch.rand(4, 2),
    }
    again = Agent(space, gym.spaces.Discrete(3), hidden_sizes=(8,))
    again.load_state_dict(agent.state_dict())
    torch.testing.assert_close(again.get_value(obs), agent.get_value(obs))
    # (each key's frames go to its own CNN: 512 features in the sorted keys' order, "state" the last key)
    name, start = agent.combined.cnn_names[key], 512 * agent.combined.keys.index(key)
    torch.testing.assert_close(agent.combined(obs)[:, start : start + 512], agent.combined.cnns[name](obs[key]))
    assert agent.combined.cnn_names["observation.image"] != name


def test_a_dicts_multidiscrete_and_multibinary_values_go_one_hot_per_sub_space_and_as_0_1_as_sb3s_extractor() -> None:
    # SB3's CombinedExtractor (preprocess_obs): a MultiDiscrete's sub-spaces one-hot each, side by side (their start
    # honoured), a MultiBinary's values as floats; neither is a vector key for --norm-obs.
    space = gym.spaces.Dict(
        {
            "buttons": gym.spaces.MultiBinary((2, 2)),
            "gear": gym.spaces.MultiDiscrete([3, 2], start=[1, -1]),
            "state": gym.spaces.Box(-1, 1, (2,)),
        }
    )
    check_observation_space(space)
    assert vector_keys(space) == ["state"]
    agent = Agent(space, gym.spaces.Discrete(2), hidden_sizes=(8,))
    assert agent.combined is not None and agent.combined.num_features == 4 + (3 + 2) + 2
    obs = {
        "buttons": torch.tensor([[[1, 0], [0, 1]], [[0, 0], [1, 1]]], dtype=torch.uint8),
        "gear": torch.tensor([[1, 0], [3, -1]]),
        "state": torch.tensor([[0.5, -0.5], [0.0, 1.0]]),
    }
    assert agent.combined(obs).tolist() == [
        [1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.5, -0.5],
        [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0],
    ]
    assert agent.act(obs).shape == (2,)
    # Values outside the sub-spaces (a torch error naming nothing, in the one-hot) are found and named first.
    raw = {key: value.numpy().copy() for key, value in obs.items()}
    assert observations_usable(raw, space)
    raw["gear"][1, 0] = 4  # (the first sub-space holds 1 to 3)
    assert not observations_usable(raw, space)
    env, said = unusable_observation(raw, space, [0, 1]) or (None, "")
    assert env == 1 and said.startswith("observation['gear'] of env 1 is [4, -1], outside the observation space")
    raw["gear"][1, 0] = 3
    raw["buttons"][0, 1, 1] = 2
    env, said = unusable_observation(raw, space, [0, 1]) or (None, "")
    assert env == 0 and said.startswith("observation['buttons'] of env 0 is [[1, 0], [0, 2]], outside")


def test_dict_values_the_policy_cannot_take_are_refused_naming_their_key() -> None:
    small = gym.spaces.Dict({"camera": gym.spaces.Box(0, 255, (3, 8, 8), np.uint8), "v": gym.spaces.Box(0, 1, (2,))})
    with pytest.raises(
        ValueError, match=r"^observation_space\['camera'\]: uint8 images of shape \(3, 8, 8\) do not fit"
    ):
        check_observation_space(small)
    huge = gym.spaces.Dict({"wrist": gym.spaces.Box(0, 255, (720, 1280, 3), np.uint8)})
    with pytest.raises(ValueError, match=r"^observation_space\['wrist'\]: uint8 images of shape \(720, 1280, 3\)"):
        check_cnn_size(huge)
    assert cnn_parameters(CAMERA_AND_STATE) == cnn_parameters(CAMERA_AND_STATE["camera"])
    with pytest.raises(ValueError, match="an empty Dict"):
        check_observation_space(gym.spaces.Dict({}))
    with pytest.raises(ValueError, match=r"the Dict's key 'pair' holds Tuple"):
        Agent(
            gym.spaces.Dict({"pair": gym.spaces.Tuple((gym.spaces.Discrete(2),)), "v": gym.spaces.Box(0, 1, (2,))}),
            gym.spaces.Discrete(2),
        )


def test_a_dicts_cameras_are_held_to_the_cnn_size_limit_together_not_each_alone() -> None:
    # Two 480x640 RGB cameras (a robot's front and wrist): each CNN has 139.5 million parameters, under the limit,
    # but the Agent builds both, 279 million: as many as one camera over the limit would give, refused as such.
    camera = gym.spaces.Box(0, 255, (480, 640, 3), np.uint8)
    assert cnn_parameters(camera) == 139_537_056 <= MAX_CNN_PARAMETERS
    check_cnn_size(gym.spaces.Dict({"front": camera, "state": gym.spaces.Box(-1, 1, (3,))}))
    two = gym.spaces.Dict({"front": camera, "state": gym.spaces.Box(-1, 1, (3,)), "wrist": camera})
    assert cnn_parameters(two) == 279_074_112 > MAX_CNN_PARAMETERS
    with pytest.raises(
        ValueError,
        match=r"^observation_space: the Dict's images would give its Nature CNNs 279,074,112 parameters together "
        r"\('front': 139,537,056, 'wrist': 139,537,056; 1\.1 GB of float32 weights, 4\.5 GB with their gradients "
        r"and Adam's moments\), over the 268,435,456",
    ):
        check_cnn_size(two)


def test_unusable_dict_observations_are_found_per_key_and_named() -> None:
    obs = {k: v.numpy() for k, v in _camera_batch(3).items()}
    assert observations_usable(obs, CAMERA_AND_STATE)
    obs["goal"][2, 1, 0] = np.nan
    assert not observations_usable(obs, CAMERA_AND_STATE)
    env, said = unusable_observation(obs, CAMERA_AND_STATE, [4, 5, 6]) or (None, "")
    assert env == 6 and said.startswith("observation['goal'] of env 6 has NaN or infinite values")
    obs["goal"][2, 1, 0] = 0.0
    obs["mode"][1] = 2  # (outside Discrete(3, start=-1))
    env, said = unusable_observation(obs, CAMERA_AND_STATE, [0, 1, 2]) or (None, "")
    assert env == 1 and said.startswith("observation['mode'] of env 1 is 2, outside the observation space Discrete")


def test_norm_obs_of_dict_observations_keeps_statistics_for_their_vector_keys_alone() -> None:
    assert vector_keys(CAMERA_AND_STATE) == ["goal"]
    rms = obs_normalizer(CAMERA_AND_STATE, vector_keys(CAMERA_AND_STATE))
    assert isinstance(rms, DictRunningMeanStd) and list(rms.stats) == ["goal"]
    rms.stats["goal"].update(torch.rand(7, 2, 2, dtype=torch.float64))
    state = rms.state_dict()
    assert sorted(state) == ["goal/count", "goal/mean", "goal/var"]
    again = obs_normalizer(CAMERA_AND_STATE, ["goal"])
    assert isinstance(again, DictRunningMeanStd)
    again.load_state_dict(state)
    assert torch.equal(again.stats["goal"].mean, rms.stats["goal"].mean)


def test_a_rollout_of_dict_observations_stores_each_key_in_its_dtype_and_updates_on_minibatches_of_them() -> None:
    torch.manual_seed(0)
    agent = Agent(CAMERA_AND_STATE, gym.spaces.Discrete(2), hidden_sizes=(8,))
    shapes = {"camera": (40, 40, 3), "goal": (2, 2), "mode": ()}
    dtypes = {"camera": torch.uint8, "goal": torch.float32, "mode": torch.int64}
    rollout = Rollout.allocate(4, 2, shapes, dtypes, (), torch.int64, torch.device("cpu"))
    assert isinstance(rollout.obs, dict) and rollout.obs["camera"].dtype == torch.uint8  # (bytes, not float32)
    assert rollout.num_envs == 2
    for step in range(4):
        obs = _camera_batch(2)
        for key, value in obs.items():
            rollout.obs[key][step] = value
        with torch.no_grad():
            action, logprob, _, value = agent.get_action_and_value(obs)
        rollout.actions[step], rollout.logprobs[step], rollout.values[step] = action, logprob, value
    rollout.rewards[:] = 1.0
    rollout.valid[:] = True
    rollout.valid[1, 0] = False  # (a reset step: left out of the batch)
    hp = PPOConfig(**{**PRESETS["classic"], "preset": "classic", "num_minibatches": 2, "update_epochs": 2})
    batch = make_batch(rollout, torch.zeros(2), hp, None, next_step_autoreset=True)
    assert isinstance(batch.obs, dict) and batch.size == 7
    assert batch.obs["camera"].shape == (7, 40, 40, 3) and batch.obs["camera"].dtype == torch.uint8
    assert torch.equal(batch.obs["mode"][:2], rollout.obs["mode"][0])
    result = ppo_update(agent, torch.optim.Adam(agent.parameters()), batch, hp, learning_rate=1e-3, clip_coef=0.2)
    assert result.batch_size == 7 and np.isfinite(result.policy_loss)
