"""The PPO update apart from the rollout loop: a rollout's storage, the batch it becomes (GAE over
its transitions, flattened), and the update of the nets on that batch (epochs x minibatches of the
clipped objective).

``learner train`` runs :func:`ppo_update` after each rollout, or, with ``--overlap-update``, on a
background thread while the next rollout is collected by a copy of the nets from before the update
(a policy lag of one update, as in asynchronous PPO: the importance ratios and clipping are taken
against the policy that acted, whose log-probs the batch holds).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, optim

from learner.config import PPOConfig
from learner.errors import UpdateDivergedError
from learner.normalize import RewardScaler
from learner.ppo import (
    Agent,
    Obs,
    clipped_policy_loss,
    explained_variance,
    gae_advantages,
    normalize_advantages,
    obs_map,
    value_loss,
)

__all__ = ["Batch", "Rollout", "UpdateResult", "make_batch", "ppo_update"]


@dataclass
class Rollout:
    """One rollout's storage, (num_steps, num_envs, ...): what the networks need on the training
    device, the envs' per-step results in host arrays (moved to the device once per rollout).

    ``valid[t, n]`` says step t of env n was a transition to learn from: False for the reset step
    that follows an episode's end under next-step autoreset, and for steps in which the fleet
    reported env n unavailable. ``final_values`` holds V(final observation) for episodes truncated under same-step
    autoreset, where the final observation only comes in ``infos``. ``obs``: one tensor, or for a Dict observation
    space one per key, each in its own dtype (uint8 camera frames stay bytes on the device).
    """

    obs: Obs
    actions: Tensor
    logprobs: Tensor
    values: Tensor
    final_values: Tensor
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    valid: np.ndarray

    @classmethod
    def allocate(
        cls,
        num_steps: int,
        num_envs: int,
        obs_shape: tuple[int, ...] | dict[str, tuple[int, ...]],
        obs_dtype: torch.dtype | dict[str, torch.dtype],
        action_shape: tuple[int, ...],
        action_dtype: torch.dtype,
        device: torch.device,
    ) -> Rollout:
        def zeros(shape: tuple[int, ...] = (), dtype: torch.dtype = torch.float32) -> Tensor:
            return torch.zeros((num_steps, num_envs, *shape), dtype=dtype, device=device)

        obs: Obs
        if isinstance(obs_shape, dict):
            assert isinstance(obs_dtype, dict)
            obs = {key: zeros(shape, obs_dtype[key]) for key, shape in obs_shape.items()}
        else:
            assert not isinstance(obs_dtype, dict)
            obs = zeros(obs_shape, obs_dtype)
        return cls(
            obs=obs,
            actions=zeros(action_shape, action_dtype),
            logprobs=zeros(),
            values=zeros(),
            final_values=zeros(),
            # (float64, as the envs give them: with --norm-reward one beyond float32's range is scaled into it)
            rewards=np.zeros((num_steps, num_envs), dtype=np.float64),
            terminations=np.zeros((num_steps, num_envs), dtype=bool),
            truncations=np.zeros((num_steps, num_envs), dtype=bool),
            valid=np.zeros((num_steps, num_envs), dtype=bool),
        )

    @property
    def num_envs(self) -> int:
        return int(self.values.shape[1])


@dataclass
class Batch:
    """One rollout's real transitions, flattened (copies: the rollout's storage may be refilled at once)."""

    obs: Obs
    actions: Tensor
    logprobs: Tensor
    advantages: Tensor
    returns: Tensor
    values: Tensor

    @property
    def size(self) -> int:
        return int(self.returns.shape[0])


def make_batch(
    rollout: Rollout,
    next_value: Tensor,
    hp: PPOConfig,
    reward_scaler: RewardScaler | None,
    *,
    next_step_autoreset: bool,
) -> Batch:
    """GAE over the rollout's valid transitions (truncations bootstrapped), then the valid ones flattened.

    ``next_value`` is V(the observations after the rollout's last step), from the nets that acted.
    """
    device = rollout.values.device
    exact, terminations, truncations, valid = (
        torch.from_numpy(a).to(device)
        for a in (rollout.rewards, rollout.terminations, rollout.truncations, rollout.valid)
    )
    rewards = exact.to(torch.float32)  # (as the nets learn from them; one beyond float32's range is inf here)
    if hp.clip_reward:
        rewards = torch.sign(rewards)  # Atari's reward clipping (Mnih et al., 2015; Huang et al., 2022, Atari detail 6)
    elif reward_scaler is not None:
        # Scaled in float64: a reward beyond float32's range (only --norm-reward or --clip-reward lets one in)
        # as it came, the others as float32 (so that the statistics are what they were with float32 rewards).
        rewards = torch.where(torch.isfinite(rewards), rewards.to(torch.float64), exact.to(torch.float64))
    if reward_scaler is not None:
        dones = terminations | truncations
        rewards = torch.stack([reward_scaler(rewards[t], dones[t], valid[t]) for t in range(rewards.shape[0])])
    with torch.no_grad():
        # V(s_t+1): the next step's value estimate, which under next-step autoreset is the value of
        # the final observation when step t ended an episode.
        next_values = torch.cat([rollout.values[1:], next_value[None]])
        if not next_step_autoreset:
            next_values = torch.where(truncations, rollout.final_values, next_values)
        advantages = gae_advantages(
            rewards, rollout.values, next_values, terminations, truncations, valid, hp.gamma, hp.gae_lambda
        )
        returns = advantages + rollout.values
    mask = valid.reshape(-1)
    return Batch(
        obs=obs_map(lambda obs: obs.flatten(0, 1)[mask], rollout.obs),
        actions=rollout.actions.flatten(0, 1)[mask],
        logprobs=rollout.logprobs.reshape(-1)[mask],
        advantages=advantages.reshape(-1)[mask],
        returns=returns.reshape(-1)[mask],
        values=rollout.values.reshape(-1)[mask],
    )


@dataclass
class UpdateResult:
    """What one update reports (the losses and KL estimates of its last minibatch, CleanRL's way)."""

    policy_loss: float
    value_loss: float
    entropy: float
    old_approx_kl: float
    approx_kl: float
    clipfrac: float
    explained_variance: float
    batch_size: int
    seconds: float


def _check_finite(
    watched: Tensor, num_minibatches: int, epochs: int, returns: Tensor, hp: PPOConfig, learning_rate: float
) -> None:
    """Raise UpdateDivergedError where a minibatch's gradient norm (``watched``: a row per minibatch, its
    norm, policy loss and value loss) was NaN or infinite. (Read once, after the update: on CUDA a NaN
    net's next sampling is a device-side assert that names nothing and leaves the GPU unusable; on the
    CPU torch's "probability tensor contains either inf, nan".) ``returns``, the batch's, ``hp`` and
    ``learning_rate`` say what to change: an infinite value loss is the returns' (too large for float32's
    squares) only when they are large, else the value net's estimates blew up (a learning rate too high);
    --norm-reward is advised only when it is off."""
    bad = ~torch.isfinite(watched[:, 0])
    if not bool(bad.any()):
        return
    first = int(bad.nonzero()[0])
    norm, policy, value = watched[first].tolist()
    largest = float(returns.abs().max()) if returns.numel() else 0.0
    # (returns whose squared errors can overflow float32's sum, whatever the value net estimates)
    huge = not largest < math.sqrt(float(torch.finfo(torch.float32).max) / max(returns.numel(), 1))
    wrapper = "a reward wrapper on the env servers"
    if math.isinf(value) and huge:
        advice = (
            f"the value loss overflowed: returns too large for float32 (up to {largest:.4g}); scale the rewards "
            f"({wrapper if hp.norm_reward else '--norm-reward, or ' + wrapper})"
        )
    elif math.isinf(value):
        advice = (
            f"the value loss overflowed, though the returns are modest (up to {largest:.4g}): the value net's "
            f"estimates blew up; lower --learning-rate (now {learning_rate:g}) or --max-grad-norm"
        )
    else:
        advice = f"lower --learning-rate (now {learning_rate:g}) or --max-grad-norm" + (
            "" if hp.norm_reward else ", or scale the rewards (--norm-reward)"
        )
    raise UpdateDivergedError(
        f"PPO's update diverged: the gradient's norm was {norm} in epoch {first // num_minibatches + 1} of {epochs}, "
        f"minibatch {first % num_minibatches + 1} of {num_minibatches} (policy loss {policy:.4g}, value loss "
        f"{value:.4g}), which leaves the nets NaN: {advice}"
    )


def ppo_update(
    agent: Agent,
    optimizer: optim.Optimizer,
    batch: Batch,
    hp: PPOConfig,
    *,
    learning_rate: float,
    clip_coef: float,
    generator: torch.Generator | None = None,
) -> UpdateResult:
    """PPO's update on ``batch``: ``hp.update_epochs`` passes of ``hp.num_minibatches`` shuffled minibatches
    (early stop past ``hp.target_kl``), at ``learning_rate``. ``generator`` shuffles (default: torch's)."""
    start = time.perf_counter()
    for group in optimizer.param_groups:
        group["lr"] = learning_rate
    device = batch.returns.device
    batch_size = batch.size
    num_minibatches = min(hp.num_minibatches, batch_size)
    clipfracs: list[Tensor] = []
    watched: list[Tensor] = []  # (each minibatch's gradient norm and losses, read once at the end: no sync)
    stats: dict[str, Tensor] = {}
    pg_loss = v_loss = entropy_loss = torch.zeros((), device=device)
    for _epoch in range(hp.update_epochs if batch_size else 0):
        # One minibatch is the whole batch, whose order does not matter: no shuffled copies.
        minibatches: Sequence[Tensor | slice] = (
            [slice(None)]
            if num_minibatches == 1
            else torch.tensor_split(torch.randperm(batch_size, device=device, generator=generator), num_minibatches)
        )
        for mb_inds in minibatches:
            mb_obs = obs_map(lambda obs: obs[mb_inds], batch.obs)  # noqa: B023 (used at once, in this iteration)
            _, newlogprob, entropy, newvalue = agent.get_action_and_value(mb_obs, batch.actions[mb_inds])
            mb_advantages = batch.advantages[mb_inds]
            if hp.norm_adv:
                mb_advantages = normalize_advantages(mb_advantages)
            pg_loss, stats = clipped_policy_loss(newlogprob, batch.logprobs[mb_inds], mb_advantages, clip_coef)
            v_loss = value_loss(
                newvalue, batch.values[mb_inds], batch.returns[mb_inds], clip_coef if hp.clip_vloss else None
            )
            entropy_loss = entropy.mean()
            loss = pg_loss - hp.ent_coef * entropy_loss + hp.vf_coef * v_loss

            optimizer.zero_grad()
            loss.backward()
            # the global norm over all parameters (Huang et al., 2022, detail 11)
            grad_norm = torch.nn.utils.clip_grad_norm_(agent.parameters(), hp.max_grad_norm)
            optimizer.step()
            clipfracs.append(stats["clipfrac"])
            watched.append(torch.stack([grad_norm.detach(), pg_loss.detach(), v_loss.detach()]))
        if hp.target_kl and stats and stats["approx_kl"].item() > hp.target_kl:
            break  # early stopping (Huang et al., 2022, detail 12's target_kl)
    if watched:
        _check_finite(torch.stack(watched), num_minibatches, hp.update_epochs, batch.returns, hp, learning_rate)
    return UpdateResult(
        policy_loss=pg_loss.item(),
        value_loss=v_loss.item(),
        entropy=entropy_loss.item(),
        old_approx_kl=stats["old_approx_kl"].item() if stats else math.nan,
        approx_kl=stats["approx_kl"].item() if stats else math.nan,
        clipfrac=torch.stack(clipfracs).mean().item() if clipfracs else math.nan,
        explained_variance=explained_variance(batch.values, batch.returns) if batch_size > 1 else math.nan,
        batch_size=batch_size,
        seconds=time.perf_counter() - start,
    )
