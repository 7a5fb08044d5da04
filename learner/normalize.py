"""Running observation normalisation and reward scaling, on the learner's device (needs torch).

The learner-side counterparts of gymnasium's NormalizeObservation and NormalizeReward wrappers,
which CleanRL's ``ppo_continuous_action.py`` applies: envs run elsewhere, so their statistics live
with the agent and are saved in its checkpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from learner.fleet import FleetChange, carry_over

__all__ = ["DictRunningMeanStd", "RewardScaler", "RunningMeanStd", "obs_normalizer"]


class RunningMeanStd:
    """Mean and variance of a stream of batches (Chan et al.'s parallel algorithm), in float64."""

    def __init__(self, shape: Sequence[int] = (), device: torch.device | str = "cpu", epsilon: float = 1e-4) -> None:
        self.mean = torch.zeros(tuple(shape), dtype=torch.float64, device=device)
        self.var = torch.ones(tuple(shape), dtype=torch.float64, device=device)
        self.count = torch.tensor(epsilon, dtype=torch.float64, device=device)

    def update(self, batch: Tensor) -> None:
        """Add a batch of samples (leading dimension: the samples)."""
        if batch.shape[0] == 0:
            return
        batch = batch.to(torch.float64)
        b_mean, b_var, b_count = batch.mean(0), batch.var(0, unbiased=False), batch.shape[0]
        delta = b_mean - self.mean
        total = self.count + b_count
        self.mean = self.mean + delta * b_count / total
        m2 = self.var * self.count + b_var * b_count + delta**2 * self.count * b_count / total
        self.var = m2 / total
        self.count = total

    def normalize(self, x: Tensor, clip: float = 10.0) -> Tensor:
        """(x - mean) / std, clipped to [-clip, clip], as float32."""
        y = (x.to(torch.float64) - self.mean) / torch.sqrt(self.var + 1e-8)
        return torch.clamp(y, -clip, clip).to(torch.float32)

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        device = self.mean.device
        self.mean, self.var, self.count = (state[k].to(device) for k in ("mean", "var", "count"))


class DictRunningMeanStd:
    """--norm-obs for Dict observations: a :class:`RunningMeanStd` per vector key (``shapes``: each key's
    observation shape), the others (images, which the Nature CNN scales to [0, 1] itself, and Discrete values,
    one-hot) left as they are, as SB3's VecNormalize is told with ``norm_obs_keys``. Its state dict is flat
    (``"<key>/mean"`` and so on), a tensor a value, as :class:`RunningMeanStd`'s is."""

    NAMES = ("mean", "var", "count")

    def __init__(self, shapes: dict[str, Sequence[int]], device: torch.device | str = "cpu") -> None:
        self.stats = {key: RunningMeanStd(shape, device) for key, shape in shapes.items()}

    def state_dict(self) -> dict[str, Any]:
        return {f"{key}/{name}": value for key, rms in self.stats.items() for name, value in rms.state_dict().items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, rms in self.stats.items():
            rms.load_state_dict({name: state[f"{key}/{name}"] for name in self.NAMES})


def obs_normalizer(
    space: Any, vector_keys: Sequence[str], device: torch.device | str = "cpu"
) -> RunningMeanStd | DictRunningMeanStd:
    """--norm-obs's statistics for observations of ``space``: a Box's, or a Dict's per key of ``vector_keys``."""
    if vector_keys:
        return DictRunningMeanStd({key: space[key].shape for key in vector_keys}, device)
    return RunningMeanStd(space.shape or (), device)


class RewardScaler:
    """Divides rewards by the running std of each env's discounted return, which starts again at 0 after every
    episode's end, terminated or truncated: SB3's VecNormalize rule. gymnasium's per-env NormalizeReward (which
    CleanRL's ppo_continuous_action.py wraps each env in) carries the return over a truncation and drops it at a
    termination before adding that step's reward: its scale differs by ~2 % on episodes that terminate and by up
    to ~2x on envs that only truncate (Pendulum, HalfCheetah), where its return runs on across episodes.

    Engstrom et al., 2020, "Implementation Matters in Deep RL": reward scaling, not reward
    normalisation (the mean is not subtracted).
    """

    def __init__(self, gamma: float, device: torch.device | str = "cpu", clip: float = 10.0) -> None:
        self.gamma = gamma
        self.clip = clip
        self.returns: Tensor | None = None
        self.rms = RunningMeanStd((), device)

    def __call__(self, rewards: Tensor, dones: Tensor, valid: Tensor) -> Tensor:
        """Scaled rewards, as float32; updates the statistics with the envs whose step was a transition
        (``valid``). ``rewards``: float32, or float64 (values beyond float32's range, scaled into it)."""
        if self.returns is None or self.returns.shape != rewards.shape:
            self.returns = torch.zeros_like(rewards, dtype=torch.float64)
        self.returns = torch.where(valid, self.returns * self.gamma + rewards, self.returns)
        self.rms.update(self.returns[valid])
        # Divided in float64, clipped, then cast (as gymnasium's NormalizeReward divides in float64): a std
        # beyond float32's range (returns of rewards near its max) would be inf as float32, and every reward
        # scaled to 0. The std within that range is rounded to float32 first, so that the quotient of float32
        # rewards is the float32 division's, bit for bit, as before (a float64 quotient of float32 operands,
        # rounded to float32, is the float32 quotient).
        std = torch.sqrt(self.rms.var + 1e-8)
        std32 = std.to(torch.float32)
        std = torch.where(torch.isfinite(std32), std32.to(torch.float64), std)
        scaled = torch.clamp(rewards.to(torch.float64) / std, -self.clip, self.clip).to(torch.float32)
        self.returns = torch.where(dones, torch.zeros_like(self.returns), self.returns)
        return scaled

    def follow(self, change: FleetChange) -> None:
        """The fleet changed (servers joined or left): the discounted returns of episodes that go on go
        on; new envs' start at 0."""
        if self.returns is not None:
            kept = carry_over(self.returns.cpu().numpy(), change, 0.0)
            self.returns = torch.from_numpy(kept).to(self.returns.device)

    def state_dict(self) -> dict[str, Any]:
        return {"rms": self.rms.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rms.load_state_dict(state["rms"])
