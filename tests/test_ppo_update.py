"""The PPO update on hand-made rollouts and a tiny agent: make_batch (bootstrapping, the returns, reward
clipping and scaling) against numbers worked out by hand, and ppo_update's use of each hyperparameter."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("torch", reason="needs torch (pip install 'envfleet[learner]')")
import torch

from learner.config import PPOConfig
from learner.normalize import RewardScaler
from learner.ppo import Agent, normalize_advantages
from learner.update import Batch, Rollout, UpdateResult, make_batch, ppo_update

OBS = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
ACTIONS = gym.spaces.Discrete(2)


def hp(**overrides: Any) -> PPOConfig:
    """Hyperparameters whose numbers are easy to follow by hand (gamma 0.5, lambda 1, no normalisation or
    clipping of advantages and rewards, one epoch of one minibatch), with ``overrides``."""
    values: dict[str, Any] = {
        "preset": "classic",
        "total_timesteps": 100,
        "num_steps": 3,
        "num_minibatches": 1,
        "update_epochs": 1,
        "learning_rate": 1e-3,
        "anneal_lr": False,
        "gamma": 0.5,
        "gae_lambda": 1.0,
        "clip_coef": 0.2,
        "anneal_clip": False,
        "clip_vloss": False,
        "ent_coef": 0.0,
        "vf_coef": 0.5,
        "max_grad_norm": 0.5,
        "target_kl": 0.0,
        "norm_adv": False,
        "norm_obs": False,
        "norm_reward": False,
        "clip_reward": False,
        "hidden_sizes": (4,),
        "action_bounds": "clip",
    }
    values.update(overrides)
    return PPOConfig(**values)


def rollout(num_steps: int = 3) -> Rollout:
    """One env's rollout of zeros (rewards, values, observations), every step a transition."""
    made = Rollout.allocate(num_steps, 1, (2,), torch.float32, (), torch.int64, torch.device("cpu"))
    made.valid[:] = True
    return made


def acted(num_steps: int = 8) -> tuple[Agent, Rollout]:
    """A tiny agent (seeded) and one env's rollout it acted in: random observations, the agent's actions,
    log-probs and values, and reward t at step t."""
    torch.manual_seed(0)
    agent = Agent(OBS, ACTIONS, hidden_sizes=(4,))
    made = rollout(num_steps)
    assert isinstance(made.obs, torch.Tensor)  # (a Box's: one tensor)
    made.obs[:] = torch.randn(num_steps, 1, 2)
    with torch.no_grad():
        actions, logprobs, _, values = agent.get_action_and_value(made.obs.flatten(0, 1))
    made.actions[:, 0], made.logprobs[:, 0], made.values[:, 0] = actions, logprobs, values
    made.rewards[:, 0] = np.arange(num_steps, dtype=np.float64)
    return agent, made


def update(
    agent: Agent,
    made: Rollout,
    config: PPOConfig,
    optimizer: torch.optim.Optimizer,
    learning_rate: float,
    seed: int = 0,
) -> tuple[Batch, UpdateResult]:
    """``made``'s batch (next value 0) and one ppo_update of ``agent`` on it, shuffled by a generator of ``seed``."""
    batch = make_batch(made, torch.zeros(1), config, None, next_step_autoreset=True)
    result = ppo_update(
        agent,
        optimizer,
        batch,
        config,
        learning_rate=learning_rate,
        clip_coef=config.clip_coef,
        generator=torch.Generator().manual_seed(seed),
    )
    return batch, result


def test_a_truncation_under_same_step_autoreset_bootstraps_from_the_final_observations_value() -> None:
    """Under same-step autoreset the next step's value is of the next episode's first observation: a
    truncation must bootstrap from V(final observation) instead (had it not, the advantage was 1, not 6)."""
    made = rollout()
    made.rewards[:, 0] = [1.0, 1.0, 1.0]
    made.truncations[0, 0] = True
    made.final_values[0, 0] = 10.0
    batch = make_batch(made, torch.zeros(1), hp(), None, next_step_autoreset=False)
    assert batch.advantages[0].item() == pytest.approx(1.0 + 0.5 * 10.0)


def test_the_rollouts_last_step_bootstraps_from_the_next_value() -> None:
    """The rollout's last step bootstraps from V(the observation after it): dropped, every rollout's end
    looked like an episode's end worth nothing more."""
    made = rollout()
    made.rewards[:, 0] = [0.0, 0.0, 1.0]
    batch = make_batch(made, torch.tensor([4.0]), hp(), None, next_step_autoreset=True)
    assert batch.advantages[2].item() == pytest.approx(1.0 + 0.5 * 4.0)
    assert batch.returns[2].item() == pytest.approx(3.0)


def test_the_returns_are_the_advantages_plus_the_values_and_the_batch_keeps_the_old_values() -> None:
    """The value targets are advantages plus V(s_t) (taken alone, the value net learnt the advantages),
    and the batch's values are the ones the acting nets estimated (value clipping is around them)."""
    made = rollout()
    made.rewards[:, 0] = [1.0, 1.0, 1.0]
    old = torch.tensor([0.5, 0.25, 2.0])
    made.values[:, 0] = old
    batch = make_batch(made, torch.zeros(1), hp(), None, next_step_autoreset=True)
    torch.testing.assert_close(batch.returns, batch.advantages + old)
    torch.testing.assert_close(batch.values, old)


def test_clip_reward_clips_each_reward_to_its_sign() -> None:
    """--clip-reward gives each reward its sign: a negative reward -1, a zero 0 (not only a large one 1)."""
    made = rollout()
    made.rewards[:, 0] = [5.0, -3.0, 0.0]
    made.terminations[:, 0] = True
    batch = make_batch(made, torch.zeros(1), hp(clip_reward=True), None, next_step_autoreset=False)
    torch.testing.assert_close(batch.advantages, torch.tensor([1.0, -1.0, 0.0]))


def test_the_reward_scalers_return_starts_over_after_a_truncation() -> None:
    """--norm-reward's discounted return ends with the episode however it ended: kept on past a
    truncation, the next episode's return went on from the last one's (1.5 here, not 1)."""
    made = rollout(num_steps=2)
    made.rewards[:, 0] = [1.0, 1.0]
    made.truncations[0, 0] = True
    scaler = RewardScaler(gamma=0.5)
    make_batch(made, torch.zeros(1), hp(norm_reward=True), scaler, next_step_autoreset=False)
    assert scaler.returns is not None and scaler.returns.tolist() == [1.0]


def test_two_advantages_are_scaled_to_unit_std_not_only_centred() -> None:
    """A single advantage is only centred (it has no spread), but two are scaled to unit std too: only
    centred, advantages of 1 and 3 became -1 and 1."""
    torch.testing.assert_close(
        normalize_advantages(torch.tensor([1.0, 3.0])), torch.tensor([-0.70710677, 0.70710677]), rtol=1e-5, atol=1e-5
    )


def test_the_update_sets_the_optimizers_learning_rate_to_the_one_given() -> None:
    """The (annealed) learning rate is written into the optimizer: left out, every update ran at the
    rate the optimizer was made with, and --anneal-lr did nothing."""
    agent, made = acted()
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-3, eps=1e-5)
    update(agent, made, hp(num_steps=8), optimizer, learning_rate=0.123)
    assert [group["lr"] for group in optimizer.param_groups] == [0.123]


def test_the_gradient_is_clipped_to_max_grad_norm() -> None:
    """The global gradient norm is clipped to --max-grad-norm before the step (here far below the
    gradient's norm; a learning rate of 0 leaves the clipped gradients to look at)."""
    agent, made = acted()
    optimizer = torch.optim.SGD(agent.parameters(), lr=0.0)
    update(agent, made, hp(num_steps=8, max_grad_norm=1e-3, vf_coef=1.0), optimizer, learning_rate=0.0)
    grads = [p.grad for p in agent.parameters() if p.grad is not None]
    assert grads and torch.norm(torch.stack([g.norm() for g in grads])).item() <= 1e-3 * 1.0001


def test_the_entropy_bonus_raises_the_policys_entropy() -> None:
    """The entropy term is subtracted from the loss (a bonus): with its sign flipped, --ent-coef drove
    the policy towards determinism. Zero advantages and --vf-coef 0 leave the entropy term alone."""
    agent, made = acted()
    made.rewards[:] = 0.0
    made.values[:] = 0.0
    config = hp(num_steps=8, ent_coef=1.0, vf_coef=0.0, max_grad_norm=1e9)
    batch = make_batch(made, torch.zeros(1), config, None, next_step_autoreset=True)
    before = agent.get_action_and_value(batch.obs, batch.actions)[2].mean().item()
    optimizer = torch.optim.SGD(agent.parameters(), lr=0.5)
    ppo_update(agent, optimizer, batch, config, learning_rate=0.5, clip_coef=0.2)
    after = agent.get_action_and_value(batch.obs, batch.actions)[2].mean().item()
    assert after > before


def test_vf_coef_scales_the_value_losss_gradient() -> None:
    """--vf-coef weighs the value loss: the critic's gradient at 1.0 is twice that at 0.5 (no clipping
    of the gradient's norm; a learning rate of 0 leaves the gradients to look at)."""
    grads = []
    for vf_coef in (0.5, 1.0):
        agent, made = acted()
        optimizer = torch.optim.SGD(agent.parameters(), lr=0.0)
        update(agent, made, hp(num_steps=8, vf_coef=vf_coef, max_grad_norm=1e9), optimizer, learning_rate=0.0)
        grads.append(torch.cat([p.grad.flatten() for p in agent.critic.parameters() if p.grad is not None]))
    assert grads[0].abs().sum().item() > 0
    torch.testing.assert_close(grads[1], 2 * grads[0])


def test_minibatches_are_drawn_in_the_order_the_generator_shuffles() -> None:
    """The minibatches are a random permutation drawn from the run's generator: drawn in the batch's
    order, updates of differently seeded generators gave the same nets (and every epoch the same
    minibatches)."""
    params = []
    for seed in (0, 1):
        agent, made = acted()
        optimizer = torch.optim.Adam(agent.parameters(), lr=1e-2, eps=1e-5)
        update(agent, made, hp(num_steps=8, num_minibatches=4), optimizer, learning_rate=1e-2, seed=seed)
        params.append(torch.cat([p.detach().flatten() for p in agent.parameters()]))
    assert not torch.equal(params[0], params[1])


def test_explained_variance_is_of_the_old_values_against_the_returns() -> None:
    """explained_variance is 1 - Var(returns - values) / Var(returns): with its arguments swapped it was
    divided by the values' variance."""
    agent, made = acted()
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-3, eps=1e-5)
    batch, result = update(agent, made, hp(num_steps=8), optimizer, learning_rate=1e-3)
    expected = 1 - (batch.returns - batch.values).var(unbiased=False) / batch.returns.var(unbiased=False)
    assert result.explained_variance == pytest.approx(expected.item(), rel=1e-5)


def test_clip_vloss_clips_the_value_loss_once_the_values_have_moved() -> None:
    """--clip-vloss reaches the value loss: past the first epoch (whose values are the old ones) the
    clipped loss differs from the plain one; ignored, both were the same."""
    losses = []
    for clip_vloss in (False, True):
        agent, made = acted()
        config = hp(num_steps=8, update_epochs=3, clip_vloss=clip_vloss, clip_coef=0.01, max_grad_norm=1e9)
        optimizer = torch.optim.SGD(agent.parameters(), lr=0.1)
        losses.append(update(agent, made, config, optimizer, learning_rate=0.1)[1].value_loss)
    assert losses[0] != pytest.approx(losses[1])


def test_target_kl_stops_the_epochs_once_the_kl_is_past_it() -> None:
    """--target-kl stops the update after the first epoch whose KL is past it: the first epoch's (KL 0,
    the policy not yet moved) goes on, the second's (moved) stops: two optimizer steps of five epochs'
    (with the comparison turned around, the update stopped after the first)."""
    agent, made = acted()
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-2, eps=1e-5)
    update(agent, made, hp(num_steps=8, update_epochs=5, target_kl=1e-12), optimizer, learning_rate=1e-2)
    assert {int(state["step"]) for state in optimizer.state.values()} == {2}


@pytest.mark.parametrize("norm_adv", [False, True])
def test_norm_adv_decides_whether_the_advantages_are_normalised(norm_adv: bool) -> None:
    """The advantages are normalised with --norm-adv and only then: at the first step (ratio 1) the
    policy loss is -mean(advantages used), 0 when normalised."""
    agent, made = acted()
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-3, eps=1e-5)
    batch, result = update(agent, made, hp(num_steps=8, norm_adv=norm_adv), optimizer, learning_rate=1e-3)
    expected = 0.0 if norm_adv else -batch.advantages.mean().item()
    assert batch.advantages.mean().item() != pytest.approx(0.0, abs=1e-3)
    assert result.policy_loss == pytest.approx(expected, abs=1e-5)


def test_more_minibatches_than_transitions_still_update_the_nets_finitely() -> None:
    """More minibatches asked for than the batch has transitions: one transition each, never an empty
    minibatch (whose mean loss is NaN, which the update reported as diverged)."""
    agent, made = acted(num_steps=3)
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-3, eps=1e-5)
    _, result = update(agent, made, hp(num_steps=3, num_minibatches=4, update_epochs=2), optimizer, learning_rate=1e-3)
    assert all(bool(torch.isfinite(p).all()) for p in agent.parameters())
    assert result.batch_size == 3 and np.isfinite(result.policy_loss)
