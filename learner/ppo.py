"""PPO's pieces: the agent's networks, its action distributions, GAE and the losses (needs torch)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor, nn
from torch.distributions import Categorical, Normal

from learner.errors import UnusableEnvOutputError

__all__ = [
    "ActionHead",
    "Agent",
    "CombinedExtractor",
    "Obs",
    "RawObs",
    "CategoricalHead",
    "GaussianHead",
    "MultiCategoricalHead",
    "NatureCNN",
    "clipped_policy_loss",
    "describe_policy",
    "explained_variance",
    "gae_advantages",
    "MAX_CNN_PARAMETERS",
    "check_cnn_size",
    "check_observation_space",
    "check_trainable",
    "cnn_parameters",
    "image_layout",
    "in_bounds",
    "is_image_space",
    "layer_init",
    "image_keys",
    "normalize_advantages",
    "obs_map",
    "obs_put",
    "observations_usable",
    "raise_unusable",
    "unusable_observation",
    "value_loss",
    "vector_keys",
]

ActionBounds = Literal["clip", "squash"]


def in_bounds(actions: np.ndarray, action_space: gym.Space[Any]) -> np.ndarray:
    """The policy's actions as the envs take them: Box actions in the space's dtype and within its bounds (float32
    rounding in tanh or a clamp must never step outside the bounds the servers check); others as they are."""
    if isinstance(action_space, gym.spaces.Box):
        return np.clip(actions.astype(action_space.dtype), action_space.low, action_space.high)
    return actions


def layer_init(layer: nn.Linear | nn.Conv2d, std: float = math.sqrt(2), bias: float = 0.0) -> Any:
    """Orthogonal weights with gain ``std`` and constant biases.

    From "The 37 Implementation Details of PPO" (Huang et al., 2022, detail 2;
    https://iclr-blog-track.github.io/2022/03/25/ppo-implementation-details/): policy output layers
    use std 0.01, value output layers 1, hidden layers sqrt(2).
    """
    nn.init.orthogonal_(layer.weight, std)
    if layer.bias is not None:
        nn.init.constant_(layer.bias, bias)
    return layer


NATURE_CONVS = ((32, 8, 4), (64, 4, 2), (64, 3, 1))
"""The Nature CNN's convolutions: (output channels, kernel size, stride) each, a ReLU after each
(:class:`NatureCNN` builds them, :func:`cnn_parameters` counts them)."""
MIN_IMAGE_SIZE = 36
"""The smallest height and width the Nature CNN takes (its three convolutions need 36 pixels)."""


ImageLayout = Literal["CHW", "HWC", "HW"]


def image_layout(space: gym.Space[Any]) -> ImageLayout | None:
    """How images for the Nature CNN are laid out in ``space``, or None when it holds none: a uint8 Box
    of shape (C, H, W), or channel-last (H, W, C) with C from 1 to 4 (an RGB camera's, gymnasium's
    pixel wrappers'), or one grayscale channel (H, W) (gymnasium's AtariPreprocessing without a frame
    stack); H and W >= 36. No two fit one shape (W would be both >= 36 and <= 4)."""
    if not (isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 and len(space.shape) in (2, 3)):
        return None
    if len(space.shape) == 2:
        return "HW" if min(space.shape) >= MIN_IMAGE_SIZE else None
    if min(space.shape[1:]) >= MIN_IMAGE_SIZE:
        return "CHW"
    if 1 <= space.shape[2] <= 4 and min(space.shape[:2]) >= MIN_IMAGE_SIZE:
        return "HWC"
    return None


def is_image_space(space: gym.Space[Any]) -> bool:
    """Whether observations are images for the Nature CNN (see :func:`image_layout`)."""
    return image_layout(space) is not None


def check_observation_space(space: gym.Space[Any]) -> None:
    """ValueError for observations the agent cannot take well: anything but a Box, a Discrete or a Dict of them,
    and a 3-d uint8 Box (pixels, as far as one can tell) too small for the Nature CNN, which an MLP would get as
    raw 0-255 values. (2-d uint8 too small for it go to the MLP: a board or a grid as often as pixels.) A Dict's
    values are checked as such, each error naming its key; a Dict's MultiDiscrete and MultiBinary values are taken
    too (as SB3's CombinedExtractor takes them: one-hot per sub-space, 0/1 as they are); a Dict in a Dict, a Tuple
    or any other value is refused (with the advice to flatten the whole space on the servers where gymnasium
    can)."""
    if isinstance(space, gym.spaces.Dict):
        if not space.spaces:
            raise ValueError("observation_space: an empty Dict holds nothing for the policy to act on")
        for key, value in space.spaces.items():
            if isinstance(value, gym.spaces.MultiDiscrete | gym.spaces.MultiBinary):
                continue  # (one-hot per sub-space, or 0/1 values: see CombinedExtractor)
            if not isinstance(value, gym.spaces.Box | gym.spaces.Discrete):
                raise ValueError(
                    f"observation_space: the Dict's key {key!r} holds {value}; the policy takes a Dict whose values "
                    "are each a Box (vector, or uint8 images (C, H, W), (H, W, C) or (H, W)), a Discrete, a "
                    "MultiDiscrete or a MultiBinary (nested Dicts and Tuples and others are not taken)"
                    + (
                        "; serve the observations flattened into one Box (Discrete parts one-hot) with "
                        "`env-server --wrappers flatten` (`learner train --wrappers flatten` for the envs it starts)"
                        if _flattens_to_box(space)
                        else ""
                    )
                )
            try:
                _check_single_space(value)
            except ValueError as err:
                raise _keyed(err, key) from None
        return
    _check_single_space(space)


def _check_single_space(space: gym.Space[Any]) -> None:
    """:func:`check_observation_space` for a space that is not a Dict (or one of a Dict's values)."""
    if isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 and len(space.shape) == 3:
        if image_layout(space) is None:
            raise ValueError(
                f"observation_space: uint8 images of shape {space.shape} do not fit the Nature CNN, which "
                f"takes (C, H, W), or (H, W, C) with C from 1 to 4, with H and W >= {MIN_IMAGE_SIZE}; resize or "
                "transpose them on the env server (for ALE ids: --wrappers atari, 4x84x84), or serve them as "
                "float32 vectors for an MLP"
            )
        return
    if not isinstance(space, gym.spaces.Box | gym.spaces.Discrete):
        raise ValueError(
            "observation_space: expected a Box (vector, or uint8 images (C, H, W), (H, W, C) or (H, W)), a Discrete, "
            f"or a Dict of them, got {space}"
            + (
                "; serve them flattened into one Box (Discrete parts one-hot) with `env-server --wrappers flatten` "
                "(`learner train --wrappers flatten` for the envs it starts)"
                if _flattens_to_box(space)
                else ""
            )
        )


def image_keys(space: gym.Space[Any]) -> list[str]:
    """The keys of a Dict ``space`` whose values are images for the Nature CNN (see :func:`image_layout`);
    [] for other spaces."""
    if not isinstance(space, gym.spaces.Dict):
        return []
    return [key for key, value in space.spaces.items() if image_layout(value) is not None]


def vector_keys(space: gym.Space[Any]) -> list[str]:
    """The keys of a Dict ``space`` whose values are vectors for an MLP (Boxes that are not images), what
    --norm-obs normalises; [] for other spaces."""
    if not isinstance(space, gym.spaces.Dict):
        return []
    return [
        key for key, value in space.spaces.items() if isinstance(value, gym.spaces.Box) and image_layout(value) is None
    ]


MAX_CNN_PARAMETERS = 2**28
"""The most parameters a Nature CNN is built with for training (268 million: 1 GiB of float32 weights, 4 GiB
with their gradients and Adam's two moments). Its dense layer takes every output of the last convolution, so
its size grows with the frame's area: 4x84x84 frames give 1.7 million parameters, (480, 640, 3) 140 million
(32 s and 2 GB to build on a 2-core machine), (720, 1280, 3) 440 million, a (1080, 1920, 3) camera's 1.0
billion (16 GB with Adam's moments; minutes of orthogonal initialisation before the first step)."""


def _chw(shape: Sequence[int], layout: ImageLayout) -> tuple[int, int, int]:
    """Frames of ``shape`` in ``layout`` as the Nature CNN's convolutions take them: (C, H, W)."""
    if layout == "HWC":
        return int(shape[2]), int(shape[0]), int(shape[1])
    if layout == "HW":
        return 1, int(shape[0]), int(shape[1])
    return int(shape[0]), int(shape[1]), int(shape[2])


def cnn_parameters(space: gym.Space[Any]) -> int:
    """How many parameters the Nature CNN has for images of ``space`` (see :func:`image_layout`; 0 for
    others; a Dict's: the sum of its images' CNNs), worked out from the convolutions' arithmetic rather than by
    building it."""
    if isinstance(space, gym.spaces.Dict):
        return sum(cnn_parameters(value) for value in space.spaces.values())
    layout = image_layout(space)
    if layout is None:
        return 0
    assert space.shape is not None  # (a Box: image_layout says so)
    channels, height, width = _chw(space.shape, layout)
    params = 0
    for out_channels, kernel, stride in NATURE_CONVS:
        params += channels * out_channels * kernel * kernel + out_channels
        channels = out_channels
        height, width = (height - kernel) // stride + 1, (width - kernel) // stride + 1
    return params + 64 * height * width * 512 + 512


def check_cnn_size(space: gym.Space[Any]) -> None:
    """ValueError for images whose Nature CNN would have more than :data:`MAX_CNN_PARAMETERS` parameters
    (large camera frames): building it would take minutes and gigabytes, without a word, before the first
    step, and its updates could not keep up. A Dict's images are checked each, the error naming the key, and
    then together: the Agent builds a CNN per image key, and two cameras each under the limit (two 480x640 RGB
    frames, 140 million parameters each) cost as much as one over it."""
    if isinstance(space, gym.spaces.Dict):
        for key, value in space.spaces.items():
            try:
                check_cnn_size(value)
            except ValueError as err:
                raise _keyed(err, key) from None
        each = {key: cnn_parameters(value) for key, value in space.spaces.items() if image_layout(value) is not None}
        params = sum(each.values())
        if params > MAX_CNN_PARAMETERS:
            weights = 4 * params
            raise ValueError(
                f"observation_space: the Dict's images would give its Nature CNNs {params:,} parameters together ("
                + ", ".join(f"{key!r}: {count:,}" for key, count in each.items())
                + f"; {weights / 1e9:,.1f} GB of float32 weights, {4 * weights / 1e9:,.1f} GB with their gradients "
                f"and Adam's moments), over the {MAX_CNN_PARAMETERS:,} the policy is built with (4x84x84 frames give "
                "a CNN 1.7 million): each CNN's dense layer takes every pixel the convolutions leave. Make the frames "
                "smaller in the env (gymnasium's ResizeObservation takes a Box, not a Dict: render each camera "
                "smaller, or resize its frames in the env's step)"
            )
        return
    params = cnn_parameters(space)
    if params <= MAX_CNN_PARAMETERS:
        return
    weights = 4 * params
    raise ValueError(
        f"observation_space: uint8 images of shape {space.shape} would give the Nature CNN {params:,} parameters "
        f"({weights / 1e9:,.1f} GB of float32 weights, {4 * weights / 1e9:,.1f} GB with their gradients and Adam's "
        f"moments), over the {MAX_CNN_PARAMETERS:,} it is built with (4x84x84 frames give it 1.7 million): its dense "
        "layer takes every pixel the convolutions leave. Make the frames smaller in the env, e.g. serve a factory "
        "returning gymnasium.wrappers.ResizeObservation(env, (84, 84))"
    )


def _keyed(err: ValueError, key: str) -> ValueError:
    """``err``, a check's refusal of one of a Dict's values, naming that value's key: ``observation_space['image']:
    ...``."""
    return ValueError(str(err).replace("observation_space: ", f"observation_space[{key!r}]: ", 1))


def check_trainable(observation_space: gym.Space[Any], action_space: gym.Space[Any], *, cnn_size: bool = True) -> None:
    """ValueError, naming the space, where the :class:`Agent` cannot take an env's spaces: the observations' kind
    (:func:`check_observation_space`), the Nature CNNs' size (:func:`check_cnn_size`; not with ``cnn_size=False``:
    a resumed run has its network, however large, as eval builds it too) and the action space. ``learner train``
    checks a fleet's spaces with it before it makes a run dir; ``learner check`` to say whether train takes
    them."""
    check_observation_space(observation_space)
    if cnn_size:
        check_cnn_size(observation_space)
    ActionHead.for_space(action_space)


def describe_policy(observation_space: gym.Space[Any]) -> str:
    """What the :class:`Agent` builds on ``observation_space`` (one :func:`check_observation_space` takes), in
    words: ``an MLP``, ``a Nature CNN``, or for a Dict ``a Nature CNN for 'image' and an MLP on the Dict's keys``."""
    if isinstance(observation_space, gym.spaces.Dict):
        cameras = image_keys(observation_space)
        policy = f"a Nature CNN for {', '.join(map(repr, cameras))} and an MLP" if cameras else "an MLP"
        return policy + " on the Dict's keys"
    return "a Nature CNN" if is_image_space(observation_space) else "an MLP"


def _flattens_to_box(space: gym.Space[Any]) -> bool:
    """Whether the env server's 'flatten' wrapper (gymnasium's FlattenObservation) takes ``space``, as
    its own check does: a space gymnasium flattens into one Box (Dict/Tuple of Box, Discrete,
    MultiDiscrete and MultiBinary parts; not of Graph or Sequence parts)."""
    try:
        return isinstance(gym.spaces.flatten_space(space), gym.spaces.Box)
    except NotImplementedError:  # (Text, Graph, Sequence, ... parts)
        return False


# -- action distributions ----------------------------------------------------------------------------


# The distributions below are built with validate_args=False: their argument checks cost about a
# quarter of a small policy's inference time, and the networks' outputs are valid by construction.


class MultiCategorical:
    """Independent categoricals, one per dimension of a MultiDiscrete space (log-probs and entropies sum)."""

    def __init__(self, logits: Tensor, nvec: Sequence[int]) -> None:
        self.dists = [Categorical(logits=part, validate_args=False) for part in torch.split(logits, list(nvec), dim=-1)]

    def sample(self) -> Tensor:
        return torch.stack([d.sample() for d in self.dists], dim=-1)

    def log_prob(self, action: Tensor) -> Tensor:
        return torch.stack([d.log_prob(a) for d, a in zip(self.dists, action.unbind(-1), strict=True)], -1).sum(-1)

    def entropy(self) -> Tensor:
        return torch.stack([d.entropy() for d in self.dists], dim=-1).sum(-1)

    @property
    def mode(self) -> Tensor:
        return torch.stack([d.mode for d in self.dists], dim=-1)


class DiagGaussian:
    """A Normal per action dimension; log-probs and entropies sum over the dimensions."""

    def __init__(self, mean: Tensor, log_std: Tensor) -> None:
        self.mean = mean
        self.normal = Normal(mean, log_std.expand_as(mean).exp(), validate_args=False)

    def sample(self) -> Tensor:
        return self.normal.sample()

    def log_prob(self, action: Tensor) -> Tensor:
        return self.normal.log_prob(action).sum(-1)

    def entropy(self) -> Tensor:
        return self.normal.entropy().sum(-1)

    @property
    def mode(self) -> Tensor:
        return self.mean


Distribution = Categorical | MultiCategorical | DiagGaussian


class ActionHead(nn.Module):
    """Turns the actor's outputs into a distribution over raw actions, and raw actions into env actions.

    The rollout stores *raw* actions (what the distribution sampled); :meth:`to_env` maps them to
    what the env accepts (adds a Discrete space's ``start``, clips or squashes to a Box's bounds).
    """

    num_outputs: int
    action_shape: tuple[int, ...]
    action_dtype: torch.dtype

    def distribution(self, outputs: Tensor) -> Distribution:
        raise NotImplementedError

    def to_env(self, raw: Tensor) -> Tensor:
        raise NotImplementedError

    @staticmethod
    def for_space(space: gym.Space[Any], bounds: ActionBounds = "clip") -> ActionHead:
        """The head for ``space``: Categorical, MultiCategorical or Gaussian; a clear error otherwise."""
        if isinstance(space, gym.spaces.Discrete):
            return CategoricalHead(int(space.n), int(space.start))
        if isinstance(space, gym.spaces.MultiDiscrete) and space.nvec.ndim == 1:
            return MultiCategoricalHead([int(n) for n in space.nvec], [int(s) for s in space.start])
        if isinstance(space, gym.spaces.MultiBinary) and len(space.shape) == 1:
            return MultiCategoricalHead([2] * space.shape[0], [0] * space.shape[0])
        if isinstance(space, gym.spaces.Box) and len(space.shape) == 1 and space.dtype.kind == "f":
            return GaussianHead(space.low, space.high, bounds)
        raise ValueError(f"action_space: expected Discrete, MultiDiscrete, MultiBinary or a 1-d float Box, got {space}")


class CategoricalHead(ActionHead):
    """Discrete(n, start): a Categorical over n logits; env action = index + start."""

    def __init__(self, n: int, start: int = 0) -> None:
        super().__init__()
        self.num_outputs, self.start = n, start
        self.action_shape, self.action_dtype = (), torch.int64

    def distribution(self, outputs: Tensor) -> Distribution:
        return Categorical(logits=outputs, validate_args=False)

    def to_env(self, raw: Tensor) -> Tensor:
        return raw + self.start if self.start else raw


class MultiCategoricalHead(ActionHead):
    """MultiDiscrete(nvec, start) (and MultiBinary): one Categorical per dimension."""

    def __init__(self, nvec: Sequence[int], start: Sequence[int]) -> None:
        super().__init__()
        self.nvec = list(nvec)
        self.start: Tensor
        self.num_outputs = sum(self.nvec)
        self.action_shape, self.action_dtype = (len(self.nvec),), torch.int64
        self.register_buffer("start", torch.as_tensor(list(start), dtype=torch.int64), persistent=False)

    def distribution(self, outputs: Tensor) -> Distribution:
        return MultiCategorical(outputs, self.nvec)

    def to_env(self, raw: Tensor) -> Tensor:
        return raw + self.start


class GaussianHead(ActionHead):
    """A 1-d float Box: a diagonal Gaussian with a state-independent, learned log std (CleanRL's).

    ``bounds="clip"`` clips samples to the bounds (the log-prob is that of the unclipped sample, as in
    CleanRL and SB3); ``"squash"`` maps them through tanh onto [low, high] (any finite float32 bounds,
    also those further apart than float32 holds, such as +-3.4e38). The log-Jacobian of the tanh and of
    the affine map onto the bounds does not depend on the policy's parameters, so PPO's probability ratio
    is the same computed on the raw sample, and the raw sample is what the rollout stores; the entropy
    reported is the Gaussian's.
    """

    def __init__(self, low: np.ndarray, high: np.ndarray, bounds: ActionBounds = "clip") -> None:
        super().__init__()
        if bounds not in ("clip", "squash"):
            raise ValueError(f"bounds: expected 'clip' or 'squash', got {bounds!r}")
        if bounds == "squash" and not (np.isfinite(low).all() and np.isfinite(high).all()):
            raise ValueError(f"bounds='squash' needs finite action bounds, got low={low}, high={high}")
        self.bounds = bounds
        self.num_outputs = int(low.shape[0])
        self.action_shape, self.action_dtype = (self.num_outputs,), torch.float32
        self.low: Tensor
        self.high: Tensor
        # A log std per action dimension, not an output of the net: state-independent, as in PPO's paper's
        # continuous control runs and CleanRL's ppo_continuous_action.py (Huang et al., 2022, continuous detail 2).
        self.log_std = nn.Parameter(torch.zeros(self.num_outputs))
        self.register_buffer("low", torch.as_tensor(low, dtype=torch.float32), persistent=False)
        self.register_buffer("high", torch.as_tensor(high, dtype=torch.float32), persistent=False)
        # Per dimension, whether high - low is finite in float32 (squash's formula takes the span);
        # None where every dimension's is.
        self.span_fits: Tensor | None
        span_fits = torch.isfinite(self.high - self.low)
        self.register_buffer("span_fits", None if bool(span_fits.all()) else span_fits, persistent=False)

    def distribution(self, outputs: Tensor) -> Distribution:
        return DiagGaussian(outputs, self.log_std)

    def to_env(self, raw: Tensor) -> Tensor:
        if self.bounds == "squash":
            squashed = torch.tanh(raw)
            onto = self.low + (squashed + 1.0) * 0.5 * (self.high - self.low)
            if self.span_fits is None:
                return onto
            # Bounds further apart than float32 holds (high - low is inf, as for +-3.4e38): from their middle
            # by half their span, each half taken before the sum. (Only for those dimensions: the others keep
            # the formula above, whose numbers runs and checkpoints were made with.)
            middle = 0.5 * self.high + 0.5 * self.low
            return torch.where(self.span_fits, onto, middle + squashed * (0.5 * self.high - 0.5 * self.low))
        return torch.clamp(raw, self.low, self.high)


# -- networks -------------------------------------------------------------------------------------------


class NatureCNN(nn.Module):
    """The DQN Nature CNN (Mnih et al., 2015) over uint8 frames scaled to [0, 1]; 512 features.

    ``layout`` "HWC": frames come channel-last, (H, W, C), and are permuted to (C, H, W) here, so the
    convolutions are those of the (C, H, W) case; "HW": one channel, (H, W), taken as (1, H, W). The
    layout follows from the observation space, which a checkpoint records and eval checks, so a policy
    is always rebuilt with the layout it trained with; it adds no parameters, and (C, H, W) policies'
    state dicts are unchanged.
    """

    def __init__(self, shape: Sequence[int], layout: ImageLayout = "CHW") -> None:
        super().__init__()
        self.layout = layout
        chw = _chw(shape, layout)
        layers: list[nn.Module] = []
        channels = chw[0]
        for out_channels, kernel, stride in NATURE_CONVS:
            layers += [layer_init(nn.Conv2d(channels, out_channels, kernel, stride=stride)), nn.ReLU()]
            channels = out_channels
        self.convs = nn.Sequential(*layers, nn.Flatten())
        with torch.no_grad():
            flat = int(self.convs(torch.zeros(1, *chw)).shape[1])
        self.fc = nn.Sequential(layer_init(nn.Linear(flat, 512)), nn.ReLU())
        self.num_features = 512

    def forward(self, obs: Tensor) -> Tensor:
        if self.layout == "HWC":
            obs = obs.permute(0, 3, 1, 2)
        elif self.layout == "HW":
            obs = obs.unsqueeze(1)
        return self.fc(self.convs(obs.float() / 255.0))


def _mlp(sizes: Sequence[int], out_std: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i in range(len(sizes) - 2):
        layers += [layer_init(nn.Linear(sizes[i], sizes[i + 1])), nn.Tanh()]
    layers.append(layer_init(nn.Linear(sizes[-2], sizes[-1]), std=out_std))
    return nn.Sequential(*layers)


class CombinedExtractor(nn.Module):
    """The features of Dict observations, as stable-baselines3's CombinedExtractor (MultiInputPolicy's) makes them:
    a Nature CNN per image key (see :func:`image_layout`; its 512 features, where SB3's gives 256), each other
    Box key flattened as float32, each Discrete key one-hot, each MultiDiscrete key one-hot per sub-space (their
    one-hots side by side, as SB3's preprocess_obs makes them), each MultiBinary key's 0/1 values flattened as
    float32, all concatenated in the Dict's key order (gymnasium
    sorts a Dict's keys unless told otherwise; the order is the space's, which a checkpoint records).
    ``num_features``: the concatenation's width. ``cnn_names``: the name of each image key's CNN in ``cnns`` (and
    in the checkpoints' ``combined.cnns.<name>.`` weights): the key itself, or where torch cannot name a module
    so (LeRobot's ``"observation.image"``: a dot; ``""``; ``"keys"``, a ModuleDict's attribute) its escaped form
    (see :func:`_module_name`)."""

    def __init__(self, space: gym.spaces.Dict) -> None:
        super().__init__()
        self.keys = list(space.spaces)
        self.cnns = nn.ModuleDict()
        self.cnn_names: dict[str, str] = {}
        # key -> (nvec, start) of a MultiDiscrete, or of a Discrete as one sub-space: one-hot each
        self.one_hot: dict[str, tuple[list[int], list[int]]] = {}
        self.num_features = 0
        for key, value in space.spaces.items():
            layout = image_layout(value)
            if layout is not None:
                cnn = NatureCNN(value.shape, layout)  # type: ignore[arg-type]
                self.cnn_names[key] = _module_name(key)
                self.cnns[self.cnn_names[key]] = cnn
                self.num_features += cnn.num_features
            elif isinstance(value, gym.spaces.Discrete):
                self.one_hot[key] = ([int(value.n)], [int(value.start)])
                self.num_features += int(value.n)
            elif isinstance(value, gym.spaces.MultiDiscrete):
                nvec = [int(n) for n in value.nvec.reshape(-1)]
                self.one_hot[key] = (nvec, [int(start) for start in value.start.reshape(-1)])
                self.num_features += sum(nvec)
            elif isinstance(value, gym.spaces.MultiBinary):
                self.num_features += math.prod(value.shape)
            else:
                assert isinstance(value, gym.spaces.Box)  # (check_observation_space refuses the rest)
                self.num_features += math.prod(value.shape)

    def forward(self, obs: dict[str, Tensor]) -> Tensor:
        parts = []
        for key in self.keys:
            x = obs[key]
            if key in self.cnn_names:
                parts.append(self.cnns[self.cnn_names[key]](x))
            elif key in self.one_hot:
                nvec, starts = self.one_hot[key]
                flat = x.reshape(x.shape[0], -1).long()  # (a Discrete's (batch,): one column)
                parts.extend(
                    nn.functional.one_hot(flat[:, i] - start, n).float()
                    for i, (n, start) in enumerate(zip(nvec, starts, strict=True))
                )
            else:
                parts.append(x.reshape(x.shape[0], -1).float())
        return torch.cat(parts, dim=1)


def _module_name(key: str) -> str:
    """The name under which a Dict observation's ``key`` can name a module in an ``nn.ModuleDict``: the key itself
    where torch takes it, else (a dot, as in LeRobot's ``"observation.image"``, which torch reads as a submodule's
    path; the empty string; the name of one of the ModuleDict's own attributes, ``"keys"`` or ``"training"``; and
    a key that begins with ``%``, so that no key is taken for another's escaped form) ``%`` followed by the key with
    its ``%`` and ``.`` percent-encoded (``"%observation%2Eimage"``): one name per key, never two keys' the same."""
    if key and "." not in key and not key.startswith("%") and not hasattr(nn.ModuleDict(), key):
        return key
    return "%" + key.replace("%", "%25").replace(".", "%2E")


Obs = Tensor | dict[str, Tensor]
"""A batch of observations as the nets take them: one tensor (leading dimension: the batch), or one per key of a
Dict observation space (each with that leading dimension)."""


def obs_map(fn: Callable[[Tensor], Tensor], obs: Obs) -> Obs:
    """``fn`` applied to the tensor of ``obs``, or to each of a Dict observation's tensors."""
    if isinstance(obs, dict):
        return {key: fn(value) for key, value in obs.items()}
    return fn(obs)


def obs_put(storage: Obs, index: Any, obs: Obs) -> None:
    """``storage[index] = obs``, for one tensor or a Dict observation's per key."""
    if isinstance(storage, dict):
        assert isinstance(obs, dict)
        for key, value in storage.items():
            value[index] = obs[key]
    else:
        assert not isinstance(obs, dict)
        storage[index] = obs


class Agent(nn.Module):
    """Actor and critic for one observation space and one action space.

    Vector observations (a Box of any shape, flattened, or a Discrete, one-hot) get separate actor
    and critic MLPs with tanh (CleanRL's ``ppo.py``); image observations (see :func:`image_layout`)
    get one Nature CNN shared by linear actor and critic heads (CleanRL's ``ppo_atari.py``). uint8
    images too small for the CNN are refused (see :func:`check_observation_space`), not fed raw to an MLP.
    Dict observations (camera and state, a goal env's vectors) get a :class:`CombinedExtractor` shared by
    actor and critic, each an MLP of ``hidden_sizes`` with tanh on its features (SB3's MultiInputPolicy: its
    default net_arch is 64, 64 for each).
    """

    def __init__(
        self,
        observation_space: gym.Space[Any],
        action_space: gym.Space[Any],
        *,
        hidden_sizes: Sequence[int] = (64, 64),
        action_bounds: ActionBounds = "clip",
    ) -> None:
        super().__init__()
        self.head = ActionHead.for_space(action_space, action_bounds)
        check_observation_space(observation_space)
        layout = image_layout(observation_space)
        self.image = layout is not None
        self.one_hot: int | None = None
        self.cnn: NatureCNN | None = None
        self.combined: CombinedExtractor | None = None
        if isinstance(observation_space, gym.spaces.Dict):
            self.combined = CombinedExtractor(observation_space)
            in_dim = self.combined.num_features
            self.actor: nn.Module = _mlp([in_dim, *hidden_sizes, self.head.num_outputs], out_std=0.01)
            self.critic: nn.Module = _mlp([in_dim, *hidden_sizes, 1], out_std=1.0)
            return
        if layout is not None:
            self.cnn = NatureCNN(observation_space.shape, layout)  # type: ignore[arg-type]
            self.actor = layer_init(nn.Linear(self.cnn.num_features, self.head.num_outputs), std=0.01)
            self.critic = layer_init(nn.Linear(self.cnn.num_features, 1), std=1.0)
            return
        if isinstance(observation_space, gym.spaces.Discrete):
            self.one_hot = int(observation_space.n)
            self.obs_start = int(observation_space.start)
            in_dim = self.one_hot
        else:
            assert isinstance(observation_space, gym.spaces.Box)  # (check_observation_space refuses the rest)
            in_dim = int(np.prod(observation_space.shape))
        self.actor = _mlp([in_dim, *hidden_sizes, self.head.num_outputs], out_std=0.01)
        self.critic = _mlp([in_dim, *hidden_sizes, 1], out_std=1.0)

    def features(self, obs: Obs) -> Tensor:
        if self.combined is not None:
            assert isinstance(obs, dict)
            return self.combined(obs)
        assert not isinstance(obs, dict)
        if self.cnn is not None:
            return self.cnn(obs)
        if self.one_hot is not None:
            return nn.functional.one_hot(obs.long() - self.obs_start, self.one_hot).float()
        return obs.reshape(obs.shape[0], -1).float()

    def get_value(self, obs: Obs) -> Tensor:
        """V(obs), shape (batch,)."""
        return self.critic(self.features(obs)).squeeze(-1)

    def get_action_and_value(self, obs: Obs, action: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """A sampled raw action (or the given one), its log-prob, the entropy, and V(obs)."""
        x = self.features(obs)
        dist = self.head.distribution(self.actor(x))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.critic(x).squeeze(-1)

    def sample(self, obs: Obs) -> tuple[Tensor, Callable[[], tuple[Tensor, Tensor]]]:
        """For collecting rollouts: a sampled raw action now, and a function that gives its log-prob
        and V(obs) (no entropy), so that the action can go to the envs before the rest is computed."""
        x = self.features(obs)
        dist = self.head.distribution(self.actor(x))
        action = dist.sample()
        return action, lambda: (dist.log_prob(action), self.critic(x).squeeze(-1))

    def act(self, obs: Obs, *, deterministic: bool = True) -> Tensor:
        """Env actions for ``obs``: the distribution's mode (deterministic) or a sample."""
        dist = self.head.distribution(self.actor(self.features(obs)))
        raw = dist.mode if deterministic else dist.sample()
        return self.head.to_env(raw)


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _beyond_float32(obs: np.ndarray) -> bool:
    """Whether the float64 ``obs`` (finite) holds a value whose float32 is infinite."""
    return obs.dtype.kind == "f" and obs.dtype.itemsize > 4 and obs.size > 0 and float(np.abs(obs).max()) > _FLOAT32_MAX


RawObs = np.ndarray | dict[str, np.ndarray]
"""A batch of observations as the envs give them: one array (leading dimension: the envs), or one per key of a
Dict observation space."""


def unusable_observation(
    obs: RawObs, space: gym.Space[Any], envs: Sequence[int], *, as_float32: bool = True, when: str = ""
) -> tuple[int, str] | None:
    """The first env whose observation the policy cannot act on, and why, in ``obs`` (a batch, row i the
    observation of env ``envs[i]``, as the envs gave it): NaN or infinite values, values beyond float32's
    range where the nets take them as they come (``as_float32``; not with --norm-obs, whose float64
    statistics scale them first), or outside a Discrete space (the one-hot fails); None where none is
    (what failed is something else). ``when``, where given, says where the observation came (", returned
    by its step at the run's env step 1,024"), before the message's end.

    In training on the CPU, called only after the policy's forward raised (torch's "Class values must be
    smaller than num_classes", "probability tensor contains either inf, nan"), so that it costs no step
    anything; elsewhere (CUDA, the bootstrap values, learner eval, and as the observations come for Box
    actions, whose Gaussian samples NaN without an error, or with --norm-obs, whose statistics one NaN
    would spoil) where :func:`observations_usable` found a problem before the forward.

    For a Dict space, ``obs`` holds a batch per key (as a vector env gives them), each looked at with its key's
    space; the message names the key (``observation['state'] of env 2 ...``).
    """
    if isinstance(obs, dict):
        assert isinstance(space, gym.spaces.Dict)
        for key, value in space.spaces.items():
            found = unusable_observation(obs[key], value, envs, as_float32=as_float32, when=when)
            if found is not None:
                return found[0], found[1].replace("observation of env", f"observation[{key!r}] of env", 1)
        return None
    for i, env in enumerate(envs):
        value = obs[i]
        if value.dtype.kind in "fc" and not np.isfinite(value).all():
            shown = np.array2string(value, threshold=16, edgeitems=3)
            return env, (
                f"observation of env {env} has NaN or infinite values ({shown}; observation space "
                f"{space}){when}; the policy cannot act on it"
            )
        if as_float32 and _beyond_float32(value):
            shown = np.array2string(value, threshold=16, edgeitems=3)
            return env, (
                f"observation of env {env} has values beyond float32's range ({shown}; observation space {space})"
                f"{when}, which the policy's float32 nets take as infinite; scale them on the env servers (a wrapper) "
                "or pass --norm-obs; the policy cannot act on it"
            )
        if isinstance(space, gym.spaces.Discrete) and not space.start <= value.item() < space.start + space.n:
            return env, (
                f"observation of env {env} is {value.item()!r}, outside the observation space {space}{when}; "
                "the policy cannot act on it"
            )
        if isinstance(space, gym.spaces.MultiDiscrete | gym.spaces.MultiBinary) and not _in_multi(value, space):
            return env, (
                f"observation of env {env} is {value.tolist()!r}, outside the observation space {space}{when}; "
                "the policy cannot act on it"
            )
    return None


def _in_multi(obs: np.ndarray, space: gym.spaces.MultiDiscrete | gym.spaces.MultiBinary) -> bool:
    """Whether every value of ``obs`` (one observation, or a batch of them) is within the MultiDiscrete's
    sub-spaces (from its start, nvec values) or 0 or 1 (a MultiBinary's)."""
    if isinstance(space, gym.spaces.MultiBinary):
        return bool(((obs == 0) | (obs == 1)).all())
    return bool(((obs >= space.start) & (obs < space.start + space.nvec)).all())


def raise_unusable(
    obs: RawObs,
    space: gym.Space[Any],
    envs: Sequence[int],
    where: Callable[[int], str],
    err: BaseException | None = None,
    *,
    as_float32: bool = True,
    when: str = "",
) -> None:
    """Raise an UnusableEnvOutputError for the first env of ``envs`` whose observation in ``obs`` the
    policy cannot act on (:func:`unusable_observation`, ``as_float32`` and ``when`` as there), its message
    begun with ``where(env)`` (what names its server), from ``err`` (the policy's error, where there was
    one); return where none is."""
    found = unusable_observation(obs, space, envs, as_float32=as_float32, when=when)
    if found is not None:
        env, problem = found
        raise UnusableEnvOutputError(where(env) + problem) from err


_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT64_MAX = float(np.finfo(np.float64).max)


def raise_unusable_rewards(
    rewards: np.ndarray,
    valid: np.ndarray,
    where: Callable[[int], str],
    why: str,
    *,
    named: str = "",
    when: str = "",
    float32: str = "",
) -> None:
    """Raise an UnusableEnvOutputError for the first env whose reward in ``rewards``, of a step that counts
    (``valid``: not a reset step's), is NaN or infinite, its message begun with ``where(env)`` (what names
    its server), the env then ``named`` (its fleet, say), ``when`` (where the reward came: ", returned by
    its step at the run's env step 1,024"), and ``why`` such a reward cannot be taken; with ``float32``
    (what would take one: "--clip-reward or --norm-reward"), also one beyond float32's range, in which PPO
    learns (its float32 cast is infinite). Return where none is. (One pass over the rewards either way.)"""
    bound = _FLOAT32_MAX if float32 else _FLOAT64_MAX
    kept = rewards[valid]
    if (np.abs(kept) <= bound).all():  # (False for NaN: a bound, not a range check, catches it too)
        return
    out = valid & ~(np.abs(rewards) <= bound)
    env = int(np.flatnonzero(out)[0])
    value = rewards[env]
    if np.isfinite(value):
        raise UnusableEnvOutputError(
            f"{where(env)}reward of env {env}{named} is {value:.6g}{when}: beyond float32's range (+-{_FLOAT32_MAX:.6g}), "
            f"in which PPO learns, it would be infinite (pass {float32}, or scale the rewards in a wrapper on the env "
            "servers)"
        )
    raise UnusableEnvOutputError(
        f"{where(env)}reward of env {env}{named} is {value}{when}: {why} (fix the env, or clip its rewards in a "
        "wrapper)"
    )


def raise_overflowed_return(
    returns: np.ndarray,
    env: int,
    where: Callable[[int], str],
    *,
    named: str = "",
    when: str = "",
    in_process: bool = False,
) -> None:
    """Raise an UnusableEnvOutputError where the return of env ``env``'s episode, which just ended
    (``returns[env]``, its rewards' sum), is not finite: rewards finite each (1e308, say) whose sum
    overflowed float64. Its message is begun with ``where(env)``, the env then ``named``, and ``when`` (where
    the episode ended). (No mean, best return nor "solved" can be judged from it, nor JSON written.)
    ``in_process``: the envs run in this process (``--backend gym``), wrapped by no env server."""
    value = float(returns[env])
    if math.isfinite(value):
        return
    wrapper = "of the env, which runs in this process" if in_process else "on the env servers"
    raise UnusableEnvOutputError(
        f"{where(env)}return of env {env}{named} is {value} for the episode that ended{when}: its rewards, finite "
        f"each, summed beyond float64's range (+-{_FLOAT64_MAX:.4g}); there is no return to report (scale the "
        f"rewards in a wrapper {wrapper})"
    )


def observations_usable(obs: RawObs, space: gym.Space[Any], *, as_float32: bool = True) -> bool:
    """Whether the policy can act on every row of the batch ``obs``: what :func:`unusable_observation`
    looks for (``as_float32`` as there), over the whole batch at once (finite values, float64 ones within
    float32's range; within a Discrete space).

    For devices whose kernels fail asynchronously (CUDA), checked before each forward: there a NaN
    probability or a one-hot index out of range is a device-side assert, raised at a later call with
    nothing to say which env, and it leaves the process unable to use the device (not even to save a
    checkpoint). One pass over the observations on the host per step: microseconds for vector
    observations (float64 ones two); integer ones (uint8 frames) cost only a Discrete space's min and max, or
    nothing. (A Dict space's: every key's batch in ``obs``.)"""
    if isinstance(obs, dict):
        assert isinstance(space, gym.spaces.Dict)
        return all(observations_usable(obs[key], value, as_float32=as_float32) for key, value in space.spaces.items())
    if obs.dtype.kind in "fc" and not np.isfinite(obs).all():
        return False
    if as_float32 and _beyond_float32(obs):
        return False
    if isinstance(space, gym.spaces.Discrete) and obs.size:
        return bool(space.start <= obs.min() and obs.max() < space.start + space.n)
    if isinstance(space, gym.spaces.MultiDiscrete | gym.spaces.MultiBinary):
        return _in_multi(obs, space)
    return True


# -- GAE and the losses ------------------------------------------------------------------------------------


def gae_advantages(
    rewards: Tensor,
    values: Tensor,
    next_values: Tensor,
    terminations: Tensor,
    truncations: Tensor,
    valid: Tensor,
    gamma: float,
    gae_lambda: float,
) -> Tensor:
    """Generalized advantage estimates (Schulman et al., 2016), shape (T, N), 0 where ``valid`` is False.

    All arguments are (T, N): step t of env n was the transition (s_t, a_t, r_t, s_t+1) when
    ``valid[t, n]``; ``values`` holds V(s_t) and ``next_values`` V(s_t+1), where s_t+1 is the
    observation the step returned, i.e. the *final* observation when the episode ended there.
    A terminated episode has no future (no bootstrap); a *truncated* one is bootstrapped from
    V(final observation) instead of being treated as terminated (CleanRL treats them alike; see
    Pardo et al., 2018, "Time Limits in Reinforcement Learning"). The lambda-return never crosses an
    episode's end, nor a step that is not a transition (a next-step autoreset's reset step, or an
    env that was unavailable).
    """
    steps = rewards.shape[0]
    not_terminated = 1.0 - terminations.float()
    continues = 1.0 - (terminations | truncations).float()
    valid_f = valid.float()
    valid_b = valid if valid.dtype == torch.bool else valid != 0  # (a float mask as well as a bool one)
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[0])
    for t in reversed(range(steps)):
        delta = rewards[t] + gamma * next_values[t] * not_terminated[t] - values[t]
        follows = continues[t] * (valid_f[t + 1] if t + 1 < steps else 1.0)
        # (selected, not multiplied by 0: a step that is no transition may hold a NaN reward or value, and
        # 0 * NaN is NaN, which the lambda-return would carry into the steps before it)
        last = torch.where(valid_b[t], delta + gamma * gae_lambda * follows * last, 0.0)
        advantages[t] = last
    return advantages


def normalize_advantages(advantages: Tensor) -> Tensor:
    """Zero mean, unit std within a minibatch (PPO implementation detail 7 in Huang et al., 2022)."""
    if advantages.numel() < 2:
        return advantages - advantages.mean()
    return (advantages - advantages.mean()) / (advantages.std() + 1e-8)


def clipped_policy_loss(
    new_logprob: Tensor, old_logprob: Tensor, advantages: Tensor, clip_coef: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate objective (Schulman et al., 2017, eq. 7), as a loss to minimise.

    Also returns, without gradients, the KL estimators ``old_approx_kl`` (-log r) and ``approx_kl``
    ((r - 1) - log r, from http://joschu.net/blog/kl-approx.html) and ``clipfrac``, the share of
    samples whose ratio r left [1 - clip, 1 + clip].
    """
    logratio = new_logprob - old_logprob
    ratio = logratio.exp()
    loss = torch.max(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)).mean()
    with torch.no_grad():
        stats = {
            "old_approx_kl": (-logratio).mean(),
            "approx_kl": ((ratio - 1) - logratio).mean(),
            "clipfrac": ((ratio - 1.0).abs() > clip_coef).float().mean(),
        }
    return loss, stats


def value_loss(new_values: Tensor, old_values: Tensor, returns: Tensor, clip_coef: float | None) -> Tensor:
    """0.5 * squared error of V against the returns; with ``clip_coef``, PPO's clipped version
    (the larger of the clipped and unclipped errors, as in baselines' ppo2 and CleanRL)."""
    unclipped = (new_values - returns) ** 2
    if clip_coef is None:
        return 0.5 * unclipped.mean()
    clipped = old_values + torch.clamp(new_values - old_values, -clip_coef, clip_coef)
    return 0.5 * torch.max(unclipped, (clipped - returns) ** 2).mean()


def explained_variance(predicted: Tensor, target: Tensor) -> float:
    """1 - Var[target - predicted] / Var[target]: 1 is perfect, 0 no better than a constant; NaN if Var[target] is 0."""
    var = target.var(unbiased=False)
    if var.item() == 0:
        return float("nan")
    return float(1.0 - (target - predicted).var(unbiased=False) / var)
