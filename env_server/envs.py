"""Building the vector env the operator asked for: gymnasium ids or entry points, wrappers, vectorization."""

from __future__ import annotations

import contextlib
import errno
import functools
import gc
import importlib
import importlib.util
import io
import json
import logging
import os
import pickle
import re
import signal
import sys
import threading
import time
import traceback
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from copy import deepcopy
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from queue import Empty
from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np
from gymnasium.envs.registration import EnvSpec
from gymnasium.vector import async_vector_env

from env_server.config import ServerConfig
from env_server.isolation import IsolateErrors

__all__ = [
    "EnvBuildError",
    "CheckFirstObservations",
    "CheckWrittenObservations",
    "EnvStepDelay",
    "ObservationLayoutError",
    "StepDelay",
    "WideInfoAsyncVectorEnv",
    "WideInfoSyncVectorEnv",
    "WRAPPERS",
    "build_one_env",
    "build_vector_env",
    "check_env",
    "env_kwargs_json",
    "is_entry_point",
    "make_env",
    "max_episode_steps",
    "widened_dtype",
    "worker_context",
]

log = logging.getLogger(__name__)

# "package.module:Name" (dotted identifiers on both sides). A gymnasium id may also contain a colon
# ("module:Env-v0" imports module, then makes Env-v0), but its part after the colon is not an
# identifier (it has a "-v<N>" version), which tells the two apart. Python's identifiers, not ASCII's
# alone: each side starts with a letter (of any script: "ünï:Ënv", "mymod:日本Env") or "_".
_ENTRY_POINT = re.compile(r"^([^\W\d])[\w.]*:([^\W\d])[\w.]*$")


class EnvBuildError(Exception):
    """The env cannot be built as configured; the text is one line a person can act on."""


def is_entry_point(env: str) -> bool:
    """Whether ``env`` names a Python callable (``package.module:ClassOrFactory``), not a gymnasium id."""
    match = _ENTRY_POINT.match(env)
    # (\w takes characters no identifier starts with, as "²": each side's first as str.isidentifier says)
    return match is not None and all(first.isidentifier() for first in match.groups())


def _atari(env: gym.Env[Any, Any]) -> gym.Env[Any, Any]:
    # The standard DQN/PPO Atari preprocessing (Machado et al. 2018; CleanRL's ppo_atari): no-op
    # starts, 4-frame skip with max-pooling, 84x84 grayscale, and a stack of the last 4 frames, so
    # 4x84x84 uint8 observations cross the wire rather than 210x160x3 frames.
    if not hasattr(env.unwrapped, "ale"):  # AtariPreprocessing reads the screen through the ALE
        name = env.spec.id if env.spec is not None else type(env.unwrapped).__name__
        raise EnvBuildError(f"wrapper 'atari': expected an Atari env of ale-py (ALE/Pong-v5, ...), got {name}")
    env = gym.wrappers.AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84, grayscale_obs=True)
    return gym.wrappers.FrameStackObservation(env, 4)


def _clip_action(env: gym.Env[Any, Any]) -> gym.Env[Any, Any]:
    # CleanRL's make_env for continuous control: actions are clipped to the bounds where the env is,
    # so the served action space is unbounded and any finite action is accepted.
    if not isinstance(env.action_space, gym.spaces.Box):
        raise EnvBuildError(f"wrapper 'clip-action': expected Box actions, got {env.action_space}")
    return gym.wrappers.ClipAction(env)


def _flatten(env: gym.Env[Any, Any]) -> gym.Env[Any, Any]:
    # gymnasium's FlattenObservation: a Dict or Tuple observation (or a Box of several dimensions)
    # becomes one flat Box (Discrete parts one-hot), for learners that take Box observations only,
    # as envfleet's PPO does.
    space = env.observation_space
    try:
        flat = gym.spaces.flatten_space(space)
    except NotImplementedError:
        flat = None
    if not isinstance(flat, gym.spaces.Box):
        raise EnvBuildError(
            f"wrapper 'flatten': expected an observation space that flattens to a Box (Box, Discrete, "
            f"MultiDiscrete, MultiBinary, and Dict/Tuple of these), got {space}"
        )
    return gym.wrappers.FlattenObservation(env)


# Wrappers an operator may apply by name (`env-server --wrappers atari`; the names are
# config.WRAPPER_NAMES, which ServerConfig checks). Names map to code chosen here, never to anything
# a request could name.
WRAPPERS: dict[str, Callable[[gym.Env[Any, Any]], gym.Env[Any, Any]]] = {
    "atari": _atari,
    "clip-action": _clip_action,
    "flatten": _flatten,
}


# The end of a step delay is waited for awake (yielding the CPU between looks at the clock): a sleep
# overshoots its end by ~0.1 ms on a VM (timer slack and the wake-up; 5 % of a 2 ms step), and the
# delay stands for a step that takes that long, no longer. Measured here: ends 3 us late (median)
# against 124 us for a plain sleep, for 0.2 ms of a CPU per delayed step.
_DELAY_AWAKE_S = 0.0002


def _step_taking(step: Callable[[Any], Any], actions: Any, delay_s: float, awake_s: float = _DELAY_AWAKE_S) -> Any:
    """``step(actions)``, returning no sooner than ``delay_s`` after it started (its own work included);
    the last ``awake_s`` of the wait awake."""
    deadline = time.perf_counter() + delay_s
    result = step(actions)
    remaining = deadline - time.perf_counter()
    if remaining > awake_s:
        time.sleep(remaining - awake_s)
    while time.perf_counter() < deadline:
        os.sched_yield()
    return result


class StepDelay(gym.vector.VectorWrapper):
    """Makes every batched step take at least ``delay_s``, as a slow simulator or a robot would.

    The server's envs wait concurrently (one sleep per batched step), as K robots or K instances of
    a remote simulator stepped in parallel would. The envs' own work counts toward the delay.
    """

    def __init__(self, env: gym.vector.VectorEnv, delay_s: float) -> None:
        super().__init__(env)
        self.delay_s = delay_s

    def step(self, actions: Any) -> Any:
        return _step_taking(self.env.step, actions, self.delay_s)


class EnvStepDelay(gym.Wrapper[Any, Any, Any, Any]):
    """The single-env twin of :class:`StepDelay`: every step of this env takes at least ``delay_s``.

    For local baselines: in a subprocess vector env each env waits in its own process, so its envs
    wait concurrently, as the K envs of a server with ``--step-delay-ms`` do. ``awake``: the end of
    the wait is waited for awake, as there; not where there are more such processes than CPUs, whose
    waits awake (0.2 ms of a CPU per step each) would take the CPUs from the others' work.
    """

    def __init__(self, env: gym.Env[Any, Any], delay_s: float, *, awake: bool = True) -> None:
        super().__init__(env)
        self.delay_s = delay_s
        self.awake_s = _DELAY_AWAKE_S if awake else 0.0

    def step(self, action: Any) -> Any:
        return _step_taking(self.env.step, action, self.delay_s, self.awake_s)


def _load_entry_point(spec: str) -> Callable[..., Any]:
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise EnvBuildError(f"cannot import module {module_name!r} of entry point {spec!r}: {err}") from err
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise EnvBuildError(f"module {module_name!r} has no attribute {attr!r} (entry point {spec!r})") from None
    if not callable(obj):
        raise EnvBuildError(f"entry point {spec!r} is a {type(obj).__name__}, not a class or factory")
    return obj


# MuJoCo's warnings that the user can do nothing about, logged at DEBUG: recent MuJoCo (4.0, say) on gymnasium's
# own half_cheetah.xml, which sets settotalmass (HalfCheetah-v5), once per env built.
_MUJOCO_NOISE = ("compiler attribute 'settotalmass' is deprecated",)
_mujoco_said: set[str] = set()
_MUJOCO_SAID_MAX = 256


def quiet_env_libraries(env: str) -> None:
    """Where ``env`` (a gymnasium id, or a module:Class imported by now) uses MuJoCo: this process's MuJoCo
    warnings logged, each once, not printed to stdout and appended to MUJOCO_LOG.TXT in the working
    directory as MuJoCo's own handler does (``learner train --env HalfCheetah-v5`` left one in the user's
    folder, written by its servers, for a deprecation in gymnasium's model file). Where ale-py is imported:
    its warnings and errors only, not its banner (printed by every process that builds an Atari env:
    ``learner eval --video``, ``--backend gym``)."""
    ale = sys.modules.get("ale_py")
    if ale is not None:
        with contextlib.suppress(AttributeError):  # (ale-py before 0.9)
            ale.ALEInterface.setLoggerMode(ale.LoggerMode.Warning)
    if "mujoco" not in sys.modules and not is_entry_point(env):
        try:  # (as gymnasium.make will: MuJoCo is imported by the env's module)
            entry = gym.spec(env).entry_point
            if isinstance(entry, str) and "mujoco" in entry:
                importlib.import_module(entry.partition(":")[0])
        except Exception:  # (an id gymnasium.make will say is unknown, a module it cannot import: said there)
            return
    mujoco = sys.modules.get("mujoco")
    # (only over MuJoCo's own handler: not one the env's author set, one that raises on an unstable simulation say)
    if mujoco is not None and getattr(mujoco, "get_mju_user_warning", lambda: _mujoco_warning)() is None:
        mujoco.set_mju_user_warning(_mujoco_warning)


def _mujoco_warning(message: str) -> None:
    text = " ".join(message.split())
    if text not in _mujoco_said:
        # (warnings that name a time or a step differ each time: past so many, the rest at debug)
        many = len(_mujoco_said) >= _MUJOCO_SAID_MAX
        if not many:
            _mujoco_said.add(text)
        noise = many or any(known in text for known in _MUJOCO_NOISE)
        log.log(logging.DEBUG if noise else logging.WARNING, "MuJoCo: %s", text)


def _gym_id(env: str) -> str:
    """A gymnasium id without its ``module:`` prefix (``ale_py:ALE/Pong-v5``: ``ALE/Pong-v5``)."""
    return env.rpartition(":")[2]


def _is_ale(env: str) -> bool:
    """Whether gymnasium id ``env`` (``module:`` prefix or not) names one of ale-py's Atari envs:
    ``ALE/...``, or an id (``PongNoFrameskip-v4``) registered to ale-py's AtariEnv."""
    if is_entry_point(env):
        return False
    module, _, name = env.rpartition(":")
    if name.startswith("ALE/"):
        return True
    if module.partition(".")[0] == "ale_py":
        _register_optional_envs()  # (as gymnasium.make's import of the module would)
    spec = gym.registry.get(name)
    return spec is not None and isinstance(spec.entry_point, str) and spec.entry_point.startswith("ale_py")


def _env_kwargs(config: ServerConfig) -> dict[str, Any]:
    """The kwargs each env is made with: ``--env-kwargs``, and for the 'atari' wrapper on an ALE env
    ``frameskip=1`` (AtariPreprocessing skips frames itself, so the ALE env must not: v5 envs skip 4 by
    default). EnvBuildError for a frameskip other than 1 given with it (the wrapper's own error
    says to disable frame-skipping, not which option does), and for RAM observations."""
    kwargs = dict(config.env_kwargs)
    if "atari" not in config.wrappers or not _is_ale(config.env):
        return kwargs
    if kwargs.get("obs_type") == "ram":  # (the wrapper's own error comes at the first reset, from deep in it)
        raise EnvBuildError(
            '--env-kwargs obs_type="ram" conflicts with --wrappers atari, which reads the screen (leave atari '
            "out of --wrappers for RAM observations)"
        )
    frameskip = kwargs.setdefault("frameskip", 1)
    if frameskip != 1:
        raise EnvBuildError(
            f"--env-kwargs frameskip={json.dumps(frameskip, default=repr)} conflicts with --wrappers atari, which "
            "skips 4 frames itself (leave frameskip out, or set it to 1)"
        )
    return kwargs


def env_kwargs_json(config: ServerConfig) -> str:
    """EnvSpec.env_kwargs: the kwargs each env is made with (:func:`_env_kwargs`: ``--env-kwargs`` and
    what the server adds for them), as canonical JSON (``json.dumps(kwargs, sort_keys=True)``; a value
    JSON cannot hold, from a ServerConfig made in Python, as its repr); "" for none.

    Under vector_entry_point, ``--env-kwargs`` as given (no wrapper adds any there); the autoreset
    mode the server passes that vector env is EnvSpec.autoreset_mode, not a kwarg here."""
    kwargs = _env_kwargs(config)
    return json.dumps(kwargs, sort_keys=True, default=repr) if kwargs else ""


def _env_factory(config: ServerConfig) -> Callable[[], gym.Env[Any, Any]]:
    """A zero-argument function that builds one wrapped env."""
    kwargs = _env_kwargs(config)
    wrappers = [WRAPPERS[name] for name in config.wrappers]

    limit = config.max_episode_steps
    if is_entry_point(config.env):
        creator = _load_entry_point(config.env)

        def make_one() -> gym.Env[Any, Any]:
            env = creator(**kwargs)
            if not isinstance(env, gym.Env):
                raise EnvBuildError(
                    f"entry point {config.env!r} returned a {type(env).__name__}, expected a gymnasium.Env"
                )
            return env if limit is None else gym.wrappers.TimeLimit(env, limit)
    else:
        if limit is not None:
            kwargs["max_episode_steps"] = limit  # (gymnasium.make's own argument, over the registered limit)

        def make_one() -> gym.Env[Any, Any]:
            return gym.make(config.env, **kwargs)

    def make_wrapped() -> gym.Env[Any, Any]:
        quiet_env_libraries(config.env)  # (here: in the process that builds it, an async worker's too)
        env = make_one()
        quiet_env_libraries(config.env)  # (again: an env class that imports MuJoCo as it is built)
        for wrap in wrappers:
            env = wrap(env)
        return env

    return make_wrapped


class ObservationLayoutError(ValueError):
    """An env returned an observation whose layout (shape, keys, length) is not its observation space's.

    ``env_index``: the env (its index within the server's vector env), where known; kept when
    gymnasium's AsyncVectorEnv raises a worker's error again in the server's process (it calls the
    error's type with the error: ``ObservationLayoutError(err)``)."""

    env_index: int | None

    def __init__(self, message: object, env_index: int | None = None) -> None:
        if isinstance(message, ObservationLayoutError):
            env_index, message = message.env_index, str(message)
        super().__init__(message)
        self.env_index = env_index


def layout_mismatch(obs: Any, space: gym.Space[Any], where: str = "observation") -> str | None:
    """What makes ``obs`` unfit to be stacked as an observation of ``space`` (None when it fits).

    Only what gymnasium's vector envs need to stack K observations is checked (a wrong one fails
    there with numpy's "Output array is the wrong shape" or a KeyError): the shapes of the spaces
    they stack as arrays (Box, Discrete, MultiDiscrete, MultiBinary), a Dict's keys (extra ones are
    left out, as gymnasium does), a Tuple's length (any sequence). Dtypes are cast and bounds are
    not enforced, as in gymnasium's own vector envs; other spaces are stacked as objects."""
    return _mismatch(obs, space, where, _expected_shape)


def _expected_shape(obs: Any, space: gym.Space[Any], where: str) -> str | None:
    """:func:`layout_mismatch`'s text for an array of another shape than ``space``'s."""
    shape = np.shape(obs)
    if shape != space.shape:
        if obs is None or isinstance(obs, str | bytes | Mapping) or np.asarray(obs).dtype == object:
            # (no array at all: None, a dict, a str; "shape ()" would name none of it)
            received = _received(obs, space, where)
            if received is not None:
                return received
        return f"{where} has shape {shape}, expected {space.shape} (observation_space {space})"
    return None


def _mismatch(
    obs: Any, space: gym.Space[Any], where: str, leaf: Callable[[Any, gym.Space[Any], str], str | None]
) -> str | None:
    """:func:`layout_mismatch`'s walk over Dict and Tuple spaces, ``leaf`` saying what is wrong (None:
    nothing) with an observation of a space gymnasium stacks as an array."""
    if isinstance(space, gym.spaces.Dict):
        if not isinstance(obs, Mapping):
            return f"{where} is a {type(obs).__name__}, expected a dict with keys {sorted(space.spaces)}"
        missing = sorted(set(space.spaces) - set(obs))
        if missing:
            return f"{where} has keys {sorted(obs, key=str)}, missing {missing} of {sorted(space.spaces)}"
        return next(
            (m for k, sub in space.spaces.items() if (m := _mismatch(obs[k], sub, f"{where}[{k!r}]", leaf))), None
        )
    if isinstance(space, gym.spaces.Tuple):
        n = len(space.spaces)
        if not isinstance(obs, Sequence) or isinstance(obs, str) or len(obs) < n:
            length = f" of length {len(obs)}" if isinstance(obs, Sequence) else ""
            return f"{where} is a {type(obs).__name__}{length}, expected a tuple of length {n}"
        return next(
            (m for i, sub in enumerate(space.spaces) if (m := _mismatch(obs[i], sub, f"{where}[{i}]", leaf))), None
        )
    if not isinstance(space, _STACKED):
        return None
    return leaf(obs, space, where)


def _received(obs: Any, space: gym.Space[Any], where: str) -> str | None:
    """:func:`misfit_message`'s text for an observation (part ``where``) of a space gymnasium stacks as an
    array: None, its shape and dtype against the space's, or a dtype numpy cannot convert to the space's, or
    that gymnasium's stacking (a same-kind cast) refuses: a float into an integer space (Discrete), say."""
    part = "an observation" if where == "observation" else f"an observation whose {where.removeprefix('observation')}"
    verb = " of" if where == "observation" else " has"
    if obs is None:  # (an env's return that forgot its observation: not "shape () and dtype NoneType")
        what = "None, not an observation" if where == "observation" else f"{part} is None"
        return f"{what} (observation space {space})"
    if isinstance(obs, np.ndarray | np.generic) and obs.dtype == space.dtype and obs.shape == space.shape:
        return None  # (what envs return: at once)
    dtype = obs.dtype if isinstance(obs, np.ndarray | np.generic) else type(obs).__name__
    shape = np.shape(obs)
    if shape != space.shape:
        return f"{part}{verb} shape {shape} and dtype {dtype}, not the observation space's {space.shape} ({space})"
    try:
        with warnings.catch_warnings():  # (numpy's ComplexWarning, say: the check below names a complex one)
            warnings.simplefilter("ignore")
            np.asarray(obs, dtype=space.dtype)
    except (TypeError, ValueError):
        return f"{part}{verb} dtype {dtype}, which does not convert to the observation space's {space.dtype} ({space})"
    # gymnasium stacks observations with np.stack(..., casting="same_kind") (of each as np.asarray makes it:
    # a Python int is an int64, a float a float64), which refuses a float into an integer space (Discrete),
    # say, that the unsafe conversion above takes; float64 into float32, or an int into a float Box, it takes.
    if space.dtype is not None and not np.can_cast(np.asarray(obs).dtype, space.dtype, "same_kind"):
        return (
            f"{part}{verb} dtype {dtype}, which gymnasium's vector envs do not cast to the observation space's "
            f"{space.dtype} (they cast within a kind only: not float to int, say) ({space})"
        )
    return None


def misfit_message(
    obs: Any, space: gym.Space[Any], env_index: int, method: str, *, in_process: bool = False
) -> str | None:
    """Why env ``env_index``'s observation ``obs``, which its ``method`` ("reset" or "step") returned,
    cannot be stacked as one of ``space``, in words: "the server's env 2: its step returned an observation
    of shape (3,) and dtype float32, not the observation space's (2,) (Box(...))"; None when it can (as far as
    :func:`layout_mismatch` checks, the dtype converts, and gymnasium's same-kind cast takes it). Never raises
    (an observation too odd to describe is None): it runs when stacking has failed already, whose own error
    then stands. ``in_process``: the envs are a learner's own (``--backend gym``), no server's: "in-process
    env 2: ..."."""
    try:
        problem = _mismatch(obs, space, "observation", _received)
    except Exception:
        return None
    if problem is None:
        return None
    if not problem.startswith(("an observation", "None")):  # (a Dict's keys, a Tuple's length)
        problem = f"an observation that does not fit the observation space: {problem}"
    return f"{_env_words(env_index, in_process)}: its {method or 'reset or step'} returned {problem}"


def _env_words(env_index: int, in_process: bool) -> str:
    """Env ``env_index`` of a vector env build_vector_env made, as errors name it: a server's, or (``in_process``)
    one in a learner's own process (``--backend gym``), where no server runs."""
    return f"in-process env {env_index}" if in_process else f"the server's env {env_index}"


def _misfit_error(env: gym.Env[Any, Any], env_index: int, in_process: bool = False) -> ObservationLayoutError | None:
    """The ObservationLayoutError for env ``env_index`` (as the vector env holds it: wrapped by
    :func:`_guarded`), whose last observation does not fit its observation space; None when it fits
    (or the env has no IsolateErrors to say what it returned, or has returned none yet: a None the env
    returned is a misfit). ``in_process``: see :func:`misfit_message`."""
    while not isinstance(env, IsolateErrors):
        if not isinstance(env, gym.Wrapper):
            return None
        env = env.env
    obs, method = env.last_observation
    # (method "": no observation yet, not even a None)
    message = misfit_message(obs, env.observation_space, env_index, method, in_process=in_process) if method else None
    return None if message is None else ObservationLayoutError(message, env_index)


# The spaces gymnasium's vector envs stack into arrays (np.stack), whose shapes must agree.
_STACKED = (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)


class _ObservationCheck(gym.Wrapper[Any, Any, Any, Any]):
    """A wrapper that hands each observation of ``reset`` and ``step`` to its ``_check`` (which may raise)."""

    def _check(self, obs: Any, method: str) -> None:
        raise NotImplementedError

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        obs, info = self.env.reset(seed=seed, options=options)
        self._check(obs, "reset")
        return obs, info

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        result = self.env.step(action)
        self._check(result[0], "step")
        return result


class CheckFirstObservations(_ObservationCheck):
    """Raises ObservationLayoutError, naming the env, the shape that came and the one expected, when
    the first observation of ``reset`` or of ``step`` does not fit the observation space.

    Only the first of each is checked (an env that gets its layout wrong usually does so every
    time); after that the calls go straight to the wrapped env, at no cost per step. ``in_process``: the
    env is one of a learner's own (``--backend gym``), no server's (the words of the error)."""

    def __init__(
        self, env: gym.Env[Any, Any], name: str, index: int | None = None, *, in_process: bool = False
    ) -> None:
        super().__init__(env)
        self._name = name
        self._index = index
        self._in_process = in_process

    def _check(self, obs: Any, method: str) -> None:
        problem = layout_mismatch(obs, self.observation_space)
        if problem is not None:
            which = (
                ""
                if self._index is None
                else f" (in-process env {self._index})"
                if self._in_process
                else f" (env {self._index} of the server's)"
            )
            raise ObservationLayoutError(f"env {self._name!r}, {method}(): {problem}{which}", self._index)
        # The check done, this instance's calls of ``method`` skip this wrapper from now on.
        setattr(self, method, getattr(self.env, method))


class CheckWrittenObservations(_ObservationCheck):
    """In an async vectorization worker: raises ObservationLayoutError, as sync vectorization's stacking
    would, for any observation of a step or reset that the worker's write into the shared memory would
    take without a word though it does not fit the observation space: a float into an integer space
    (Discrete: cast), None (NaN in a float space), an array of another shape but as many values.

    An array (or numpy scalar) of the space's dtype and shape, or a Python int of an integer space, passes
    at once (a fraction of a microsecond a step); any other gets :func:`misfit_message`'s full look."""

    def __init__(self, env: gym.Env[Any, Any], index: int, *, in_process: bool = False) -> None:
        super().__init__(env)
        self._index = index
        self._in_process = in_process
        space = env.observation_space
        self._dtype = space.dtype if isinstance(space, _STACKED) else None
        self._shape = space.shape
        self._ints = self._dtype is not None and self._shape == () and np.issubdtype(self._dtype, np.integer)

    def _check(self, obs: Any, method: str) -> None:
        if isinstance(obs, np.ndarray | np.generic):
            if obs.dtype == self._dtype and obs.shape == self._shape:
                return
        elif type(obs) is int and self._ints:
            return
        message = misfit_message(obs, self.observation_space, self._index, method, in_process=self._in_process)
        if message is not None:
            raise ObservationLayoutError(message, self._index)


def _checked_for_writing(
    factory: Callable[[], gym.Env[Any, Any]], index: int, in_process: bool
) -> Callable[[], gym.Env[Any, Any]]:
    """``factory``'s env under :class:`CheckWrittenObservations` (async vectorization's workers)."""

    def make_checked() -> gym.Env[Any, Any]:
        return CheckWrittenObservations(factory(), index, in_process=in_process)

    return make_checked


def _guarded(
    env: gym.Env[Any, Any],
    name: str,
    index: int,
    *,
    repeat_on_reset: bool,
    ctrl_c: bool = False,
    in_process: bool = False,
) -> gym.Env[Any, Any]:
    """``env``, env ``index`` of the vector env, as the vector env holds it: its errors isolated
    (outside the check, which must fail the call: a layout error would fail the stacking anyway,
    less clearly)."""
    isolated = IsolateErrors(env, repeat_on_reset=repeat_on_reset, ctrl_c=ctrl_c)
    return CheckFirstObservations(isolated, name, index, in_process=in_process)


def _isolated(
    factory: Callable[[], gym.Env[Any, Any]],
    name: str,
    index: int,
    *,
    repeat_on_reset: bool,
    ctrl_c: bool = False,
    in_process: bool = False,
) -> Callable[[], gym.Env[Any, Any]]:
    def make_isolated() -> gym.Env[Any, Any]:
        return _guarded(factory(), name, index, repeat_on_reset=repeat_on_reset, ctrl_c=ctrl_c, in_process=in_process)

    return make_isolated


def worker_context() -> str | None:
    """The multiprocessing start method for async vectorization's workers (gymnasium's AsyncVectorEnv's
    ``context``): ``"fork"`` on Linux, where it was Python's default before 3.14 (3.14's is ``"forkserver"``),
    and what the server is built around: a worker inherits what the server's process set up before it (the ids
    that importing ale_py registers, an entry point's module, the logging that --log-format and --log-level
    configured) and the signal handling it then gives up (see :func:`_leave_the_servers_signals`), and a
    forkserver would start multiprocessing's resource tracker in the server's process group, which a SIGHUP
    (its terminal closed) ends with a traceback. Elsewhere None: the platform's default (macOS: spawn, as fork
    is unsafe there)."""
    return "fork" if sys.platform.startswith("linux") else None


def _in_worker(factory: Callable[[], gym.Env[Any, Any]]) -> Callable[[], gym.Env[Any, Any]]:
    """``factory`` for an async-vectorization worker: the worker first gives up the signal handling it
    inherits from the server (see :func:`_leave_the_servers_signals`). Not in this process, where
    gymnasium calls it once too (for the spaces)."""
    server_pid = os.getpid()

    def make_in_worker() -> gym.Env[Any, Any]:
        if os.getpid() != server_pid:
            _leave_the_servers_signals()
        return factory()

    return make_in_worker


def _leave_the_servers_signals() -> None:
    """In a worker forked from a server, which had taken SIGINT/SIGTERM/SIGHUP over: those handlers and
    the wakeup fd of the server's event loop (shared by the fork) would have a signal sent to the worker
    alone shut the whole server down. Both are left to the server, whose drain closes its workers: Ctrl-C
    (SIGINT to the terminal's process group), SIGHUP (its terminal closed: likewise), and SIGTERM, which
    reaches every process of the group or cgroup where GNU ``timeout``, ``kill -- -PGID`` or systemd
    (KillMode=control-group) stops the server (a worker that ended then would fail the steps the drain is
    for, and the server's close of its workers). A worker ends when the server closes it, when the server
    is gone (its pipe closes), or by SIGKILL (the server's own, where it cannot wait: see
    WideInfoAsyncVectorEnv).

    Ignored (SIG_IGN), not caught by a handler that does nothing: a handler would interrupt the env's
    blocking system calls in C (a simulator client's poll returns EINTR), and a program the env starts
    would get the signals at their defaults, so a stop of the whole group would end a simulator before
    the drain's steps. Such a program inherits SIG_IGN: its ``terminate()`` does not end it (``kill()``
    does; or it may set SIGTERM back to its default, in a ``preexec_fn``, say)."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if hasattr(signal, "SIGHUP"):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)


def _register_optional_envs() -> None:
    # ALE's envs (ALE/Pong-v5, ...) register themselves only once ale_py is imported.
    try:
        import ale_py

        gym.register_envs(ale_py)
    except ImportError:
        pass


def make_env(config: ServerConfig) -> gym.Env[Any, Any]:
    """One env exactly as the server builds each of its K (kwargs and wrappers included).

    For comparisons against local vector envs (benchmarks, tests); ``step_delay_ms`` and the
    vectorization do not apply to a single env.
    """
    if _gym_id(config.env).startswith("ALE/"):
        _register_optional_envs()
    return _env_factory(config)()


def build_one_env(config: ServerConfig) -> gym.Env[Any, Any]:
    """One env as :func:`make_env` makes it, refused as :func:`build_vector_env` refuses it: EnvBuildError
    with the server's one-line reason (for ``learner check``, which must fail as the server would)."""
    check_env(config)
    with _as_build_error(config, ctrl_c=True):  # (the caller's Ctrl-C: build_one_env runs in a learner's process)
        env = make_env(config)
    _check_spaces(env, config.env)
    return env


def check_env(config: ServerConfig) -> None:
    """Raise EnvBuildError, as :func:`build_vector_env` would, where ``config`` names an env that does
    not exist (or one vector_entry_point cannot build); cheap (no env is built), so the server checks
    before it listens. (Unknown or repeated wrappers: ServerConfig refuses them.)

    A gymnasium id is looked up in gymnasium's registry (``module:Env-v0`` imports ``module``, as
    ``gymnasium.make`` does); for an entry point, only its module is looked for, not imported (a
    user's module may take long to import: that waits until the server listens, as building does).
    """
    if config.vectorization == "vector_entry_point" and (is_entry_point(config.env) or config.wrappers):
        raise EnvBuildError("--vectorization vector_entry_point needs a gymnasium id and no --wrappers")
    if is_entry_point(config.env):
        module_name = config.env.partition(":")[0]
        try:
            found = importlib.util.find_spec(module_name) is not None
        except ImportError as err:  # (a parent package is missing)
            raise EnvBuildError(f"cannot import module {module_name!r} of entry point {config.env!r}: {err}") from err
        except ValueError:  # (a module already imported without a spec, like __main__: building tells)
            return
        if not found:
            raise EnvBuildError(
                f"cannot import module {module_name!r} of entry point {config.env!r}: No module named {module_name!r}"
            )
        return
    if _gym_id(config.env).startswith("ALE/"):
        _register_optional_envs()
    # gymnasium.make's own lookup (private; where a gymnasium version lacks it, building tells).
    find_spec = getattr(gym.envs.registration, "_find_spec", None)
    if find_spec is not None:
        try:
            with warnings.catch_warnings():  # (gymnasium.make warns of old versions again when it builds)
                warnings.simplefilter("ignore")
                find_spec(config.env)
        except Exception as err:
            hint = _ale_hint(config.env) if isinstance(err, gym.error.NameNotFound) else _extra_hint(config.env, err)
            if hint is not None:
                raise EnvBuildError(f"cannot make env {config.env!r}: {_one_line(err).rstrip('.')}; {hint}") from err
            raise _build_error(config, err) from err
    _env_kwargs(config)  # (a frameskip the atari wrapper conflicts with)


def _ale_hint(env: str) -> str | None:
    """What to do about gymnasium id ``env`` (``PongNoFrameskip-v4``), unknown to gymnasium's registry,
    where it is one of those ale-py registers only when imported (its v0 and v4 ids; its ALE/ ids are
    registered here for the server); None for any other."""
    if ":" in env:
        return None
    _register_optional_envs()  # (what importing ale_py does anyway: registers its ids)
    if not _is_ale(env) or gym.registry.get(_gym_id(env)) is None:  # (not a misspelt name: ALE/Pongg-v5)
        return None
    version = env.rpartition("-")[2]
    return f"ALE's {version} ids are registered by ale_py: use --env ale_py:{env}"


def _extra_hint(env: str, err: BaseException) -> str | None:
    """envfleet's extra to install where gymnasium's error for ``env`` says ALE's or MuJoCo's package is
    missing (gymnasium's own hint names gymnasium's extra, or none); None for any other error."""
    if _gym_id(env).startswith("ALE/") and importlib.util.find_spec("ale_py") is None:
        extra, packages = "atari", "ale-py opencv-python-headless"
    elif isinstance(err, gym.error.DependencyNotInstalled) and "mujoco" in str(err).lower():
        extra, packages = "mujoco", "mujoco imageio packaging"
    else:
        return None
    return (
        f"install it where the server runs: pip install 'envfleet[{extra}]' (from a clone: pip install -e "
        f"'.[{extra}]'; the env-server image: EXTRA_PIP_PACKAGES=\"{packages}\" docker compose build env)"
    )


_PROCESS_LIMITS = "a pids limit (docker --pids-limit, ulimit -u) or memory may be too low"


def _original(err: BaseException) -> BaseException:
    """``err``, or the TypeError it is gymnasium's copy of ("... was raised from the environment creator for <id>
    with kwargs (...)"): the one whose traceback goes into the env's code."""
    if "was raised from the environment creator" in str(err):
        return err.__cause__ or err.__context__ or err
    return err


def _calling_the_env(err: BaseException) -> bool:
    """Whether ``err`` (a TypeError, or gymnasium's copy of one) was raised by the call that makes the env itself,
    as Python binds its arguments (the innermost frame the caller's: gymnasium's, or this package's), not by a
    call inside the env's constructor (the innermost frame the constructor's own)."""
    tb = _original(err).__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    where = Path(tb.tb_frame.f_code.co_filename).resolve()
    return any(
        where.is_relative_to(Path(str(module.__file__)).resolve().parent) for module in (gym, sys.modules[__name__])
    )


def _where_raised(err: BaseException, env: str) -> str:
    """`` (at FILE:LINE in NAME)``: where in the env's code making env ``env`` raised ``err``: the innermost frame of
    its traceback in the env's own package (its entry point's), else the innermost outside gymnasium, envfleet and
    the standard library (by module name: wherever the env and its libraries are installed); "" where there is
    none. One line, not a traceback: many local servers fail alike at once."""
    own = _entry_package(env)
    ours = {"gymnasium", __name__.partition(".")[0], *sys.stdlib_module_names}
    own_frame = other_frame = ""
    tb = _original(err).__traceback__
    while tb is not None:
        code, package = tb.tb_frame.f_code, str(tb.tb_frame.f_globals.get("__name__", "")).partition(".")[0]
        where = f" (at {code.co_filename}:{tb.tb_lineno} in {code.co_name})"
        if package == own:
            own_frame = where
        elif package not in ours and not code.co_filename.startswith("<"):
            other_frame = where
        tb = tb.tb_next
    return own_frame or other_frame


def _entry_package(env: str) -> str | None:
    """The top-level package of ``env``'s code: its entry point's (``module:Class``, or the one a gymnasium id is
    registered with); None where it cannot be told."""
    entry: Any = env
    if ":" not in env:
        try:
            entry = gym.spec(env).entry_point
        except Exception:  # (an id gymnasium does not know: no frame of it to find)
            return None
    if callable(entry):
        entry = getattr(entry, "__module__", None) or ""
    return str(entry).partition(":")[0].partition(".")[0] or None


def _build_error(config: ServerConfig, err: BaseException) -> EnvBuildError:
    """The one-line EnvBuildError for an exception that making ``config.env`` raised."""
    # (fork's EAGAIN where a pids limit is reached, ENOMEM where memory is)
    short = (errno.EAGAIN, errno.ENOMEM)
    if isinstance(err, WorkerStartError):  # (WideInfoAsyncVectorEnv's, as it comes: nothing wraps it)
        why = err.strerror or _one_line(err.error)
        text = f"cannot start worker process {err.index} of {err.count} for --vectorization async ({why})"
        if err.errno in short:
            text += f": each env is a process; {_PROCESS_LIMITS} (or use fewer --num-envs, or --vectorization sync)"
        return EnvBuildError(f"cannot make env {config.env!r}: {text}")
    if isinstance(err, WorkerEndedError):
        return EnvBuildError(f"cannot make env {config.env!r}: {err}")
    if isinstance(err, OSError) and err.errno in short:  # (the env's constructor starting a process of its own, say)
        text = " ".join(str(err).split()) or type(err).__name__
        return EnvBuildError(
            f"cannot make env {config.env!r}: {type(err).__name__}: {text}; "
            f"if that was starting a process: {_PROCESS_LIMITS}"
        )
    if isinstance(err, gym.error.Error):
        hint = _extra_hint(config.env, err)
        return EnvBuildError(f"cannot make env {config.env!r}: {_one_line(err)}" + (f"; {hint}" if hint else ""))
    if isinstance(err, TypeError):
        text = _one_line(err).split(" was raised from the environment creator")[0]
        # (a constructor's "__init__() missing 1 required positional argument: 'size'")
        missing = re.search(r"missing \d+ required (?:positional|keyword-only) arguments?: (.+)$", text)
        if missing is not None and _calling_the_env(err):
            names = re.findall(r"'([^']+)'", missing.group(1))
            example = json.dumps({name: "..." for name in names}).replace('"..."', "...")
            text += f"; pass constructor arguments with --env-kwargs '{example}'"
        else:
            text += _where_raised(err, config.env)
        return EnvBuildError(
            # (gymnasium appends "was raised from the environment creator for <id> with kwargs (...)")
            f"cannot make env {config.env!r} with kwargs {config.env_kwargs}: {text}"
        )
    text = " ".join(str(err).split())  # (none: a bare KeyboardInterrupt, say)
    # (a Ctrl-C's line is no error's)
    where = "" if isinstance(err, KeyboardInterrupt) else _where_raised(err, config.env)
    return EnvBuildError(
        f"cannot make env {config.env!r}: {type(err).__name__}" + (f": {text}" if text else "") + where
    )


def _widen_infos(vector_infos: dict[str, Any], env_info: dict[str, Any]) -> None:
    """Widen the arrays of ``vector_infos`` that ``env_info``'s values would not fit (floats after
    ints, say) to a dtype that holds both (``np.result_type``), before gymnasium writes them in.

    gymnasium's ``VectorEnv._add_info`` makes a key's array of the first env's value's type and
    casts the others' into it: FrozenLake's ``prob`` (1 after a reset, 0.333 after a step) became 0
    on an autoreset step. The learner joins servers' infos widening them the same way, so that a
    fleet's infos do not depend on how its envs are split between servers, and no value is cut.

    Except for a key whose values have no common numpy type: a number in one env and a str (or
    any other object) in another. Nothing widens then, and the result follows the layout, as it
    follows the envs' order in gymnasium's own vector envs: on one server, an int after a str goes
    into the str's object array, but a str after an int fails the step as it fails
    SyncVectorEnv's (gymnasium casts it into the ints' array); on servers of their own, each env's
    value comes in an array of its own type, and the learner joins a number array with an object
    array into an object array.
    """
    for key, value in env_info.items():
        array = vector_infos.get(key)
        if key == "final_obs" or not isinstance(array, np.ndarray) or array.dtype == object:
            continue  # (a dict recurses through _add_info; object arrays hold anything)
        if isinstance(value, np.ndarray):
            if value.shape != array.shape[1:]:
                continue  # (gymnasium's own error then)
            here = value.dtype
        elif isinstance(value, bool | int | float | np.number | np.bool_):
            here = np.asarray(value).dtype
        else:
            continue
        if here == array.dtype:
            continue
        try:
            wide = widened_dtype(array.dtype, here)
        except TypeError:
            continue  # (gymnasium's own error then, as locally)
        if wide != array.dtype:
            vector_infos[key] = array.astype(wide)


def widened_dtype(before: np.dtype[Any], here: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype that holds both ``before``'s and ``here``'s values (``np.result_type``): how servers
    widen an info key's array across their envs and the learner across servers (one rule, so a
    fleet's infos do not depend on its layout, but for values of no common type: see
    :func:`_widen_infos`). TypeError if none does: they cannot be promoted, or strings meet numbers
    (which numpy would turn into strings)."""
    if (before.kind in "US") != (here.kind in "US") and object not in (before, here):
        raise TypeError("strings and numbers do not mix")
    return np.result_type(before, here)


class _WideInfos(gym.vector.VectorEnv):
    """An info key whose values' types differ between envs widened to hold them all, instead of
    cast to the first env's (see :func:`_widen_infos`): mixed in before gymnasium's vector env."""

    # (gymnasium's private method, which every step calls: whatever else a later gymnasium passes it
    # goes through; tests/test_portability.py fails should it be renamed, or its arguments.)
    def _add_info(
        self, vector_infos: dict[str, Any], env_info: dict[str, Any], env_num: int, *args: Any, **kwargs: Any
    ) -> dict[str, Any]:
        if not env_info:  # (most steps of most envs: nothing to add, as gymnasium's adds nothing)
            return vector_infos
        _widen_infos(vector_infos, env_info)
        return super()._add_info(vector_infos, env_info, env_num, *args, **kwargs)


class WideInfoSyncVectorEnv(_WideInfos, gym.vector.SyncVectorEnv):
    """gymnasium's SyncVectorEnv, with infos widened (see :func:`_widen_infos`), and an observation it
    cannot stack named (ObservationLayoutError: the env, the call, the shape and dtype that came, the
    space's), not numpy's "all input arrays must have the same shape".

    The envs' observations are looked at only once stacking them has failed (no cost per step
    otherwise); the envs must be held as :func:`_guarded` makes them."""

    in_process: bool = False
    """The envs are a learner's own (``--backend gym``), no server's: the words of ObservationLayoutError."""

    def reset(self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None) -> Any:
        with self._naming_misfits():
            return super().reset(seed=seed, options=options)

    def step(self, actions: Any) -> Any:
        with self._naming_misfits():
            return super().step(actions)

    @contextlib.contextmanager
    def _naming_misfits(self) -> Iterator[None]:
        """An error of the block (stacking the envs' observations) whose cause is an observation that
        does not fit: the ObservationLayoutError naming it instead; any other error as it is."""
        try:
            yield
        except ObservationLayoutError:
            raise
        except Exception as err:
            misfit = self._misfit()
            if misfit is None:
                raise
            raise misfit from err

    def _misfit(self) -> ObservationLayoutError | None:
        """The error naming the first env whose last observation does not fit; None if none."""
        return next(
            (e for i, env in enumerate(self.envs) if (e := _misfit_error(env, i, self.in_process)) is not None), None
        )


class WideInfoAsyncVectorEnv(_WideInfos, gym.vector.AsyncVectorEnv):
    """gymnasium's AsyncVectorEnv, with infos widened (see :func:`_widen_infos`). Made with
    ``worker=_naming_worker``, an observation a worker cannot write for the server's process is named
    as WideInfoSyncVectorEnv names it."""

    first_spec: EnvSpec | None = None
    """The spec of an env made as the workers' are, in the server's process (see build_vector_env)."""

    recover_timeout_s: float = 30.0
    """How long a recovery (see :meth:`_recover`) waits, all told, for the replies still due after an error: a worker
    whose env's call has not returned by then (it hangs without dying, or takes that long) is killed, and its pipe
    taken for broken, as a worker that died (the server cannot go on: it says so, and is restarted)."""

    close_failed_start_s: float = 30.0
    """How long a start that failed (an env's constructor raised in its worker, say) waits, all told, for the other
    workers to close their envs (see :meth:`_close_workers`) before it kills those still running."""

    # The workers ignore SIGTERM (see _leave_the_servers_signals), which is how gymnasium's close(terminate=True)
    # and its close's timeout (Process.terminate), and multiprocessing's exit (Process._popen.terminate,
    # then a join without a timeout: a process that leaves a worker running would never exit) end a
    # worker: here each worker's terminate is its kill (SIGKILL), at both levels, and workers that a
    # failed start or close leaves running are killed, so that none outlives the server, nor holds its
    # exit up waiting to join it.
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        try:
            with _garbage_frozen():  # (the workers fork in there: see _garbage_frozen)
                super().__init__(*args, **kwargs)
        except BaseException as err:  # (an env's constructor raised in its worker, say: the others still run)
            started = all(_started(process) for process in getattr(self, "processes", ()))
            told = self._constructor_error() if isinstance(err, (EOFError, OSError)) and started else None
            if isinstance(err, Exception):  # (not on a Ctrl-C's way out: killed at once)
                self._close_workers()
            self._kill_workers()
            processes = getattr(self, "processes", [])
            if processes and not _started(processes[-1]) and isinstance(err, OSError):
                # (gymnasium starts each worker as it appends it: the last one's start raised, fork's
                # EAGAIN under a pids limit, say)
                raise WorkerStartError(len(processes), len(getattr(self, "env_fns", ())), err) from err
            if told is not None:
                raise told from err
            raise
        for process in self.processes:
            process.terminate = process.kill  # type: ignore[method-assign]
            popen = getattr(process, "_popen", None)  # (multiprocessing's own; its exit calls it directly)
            if popen is not None and hasattr(popen, "kill"):
                popen.terminate = popen.kill
        self.parent_pipes = [_tracked(pipe) for pipe in self.parent_pipes]

    def _check_spaces(self) -> None:
        """gymnasium's, the last step of its ``__init__`` (each worker asked whether its env's spaces are the first
        env's): the first commands sent to the workers, sent through :class:`_TrackedPipe` too, which pickles them to
        bytes. Sent as gymnasium sends them (``Connection.send``: a view of ForkingPickler.dumps' BytesIO), one sent
        to a worker that had ended already (its constructor exited, or was killed: the pipe's BrokenPipeError, as
        the start fails) left that view in the traceback of the build's error, which a reference cycle keeps; the
        next garbage collection crashed the process on Python 3.12.1 (SIGSEGV: CPython's gh-111049, a server whose
        --fresh-envs rebuild failed so, a test process) and printed "Exception ignored ... BufferError" on 3.13.0
        (3.11 collected it in silence)."""
        self.parent_pipes = [_tracked(pipe) for pipe in self.parent_pipes]
        super()._check_spaces()

    def _constructor_error(self) -> Exception | None:
        """The error an env's constructor raised in its worker, which the worker put on the error queue before it
        ended (see :func:`_naming_worker`), where the start failed as the worker's pipe closed (an EOFError,
        BrokenPipeError or ConnectionResetError, which say nothing of why); a WorkerEndedError where a worker
        ended without one (os._exit, a crash in native code: a SIGSEGV); None where neither shows within 1 s."""
        processes = getattr(self, "processes", [])
        if not processes:  # (no workers, nor their queue, yet)
            return None
        deadline = time.monotonic() + 1.0
        while True:
            # (a worker's error is flushed to the queue before the worker ends: one that had ended before the get
            # has its error there, so an empty queue then means it had none)
            ended = [(index, process.exitcode) for index, process in enumerate(processes, 1)]
            try:
                _, _, error, _ = self.error_queue.get(timeout=0.05)
            except Empty:
                if any(code is not None for _, code in ended) or time.monotonic() >= deadline:
                    break
                continue
            except Exception as err:  # (one that does not unpickle, put there by another worker than _report)
                return RuntimeError(f"a worker's error could not be read: {type(err).__name__}: {_one_line(err)}")
            return error if isinstance(error, Exception) else None
        # (of those that had ended before the queue was found empty: a later one's error may be on its way)
        index, code = next(((index, code) for index, code in ended if code is not None), (0, None))
        return WorkerEndedError(index, len(processes), code) if code is not None else None

    # gymnasium's calls, recovered from where they raise (see _recover).
    def reset_async(self, *args: Any, **kwargs: Any) -> None:
        with self._recovering():
            super().reset_async(*args, **kwargs)

    def reset_wait(self, *args: Any, **kwargs: Any) -> Any:
        with self._recovering():
            return super().reset_wait(*args, **kwargs)

    def step_async(self, actions: Any) -> None:
        with self._recovering():
            super().step_async(actions)

    def step_wait(self, *args: Any, **kwargs: Any) -> Any:
        with self._recovering():
            return super().step_wait(*args, **kwargs)

    def call_async(self, name: str, /, *args: Any, **kwargs: Any) -> None:
        with self._recovering():
            super().call_async(name, *args, **kwargs)

    def call_wait(self, *args: Any, **kwargs: Any) -> Any:
        with self._recovering():
            return super().call_wait(*args, **kwargs)

    def set_attr(self, name: str, values: Any) -> None:  # (sends to the workers and waits, as call does)
        with self._recovering():
            super().set_attr(name, values)

    @contextlib.contextmanager
    def _recovering(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            if not self.closed:
                self._recover()
            raise

    def _recover(self) -> None:
        """After a call raised (gymnasium's ``*_wait`` left ``_state`` WAITING_*, so that every later call raised
        AlreadyPendingCallError, and maybe replies unread in workers' pipes, which the next call would have taken
        for its own): each reply still due is read and dropped (a worker that failed is shut down, as gymnasium
        does), a worker that is gone (its pipe closed: killed, exited) has its pipe set to None, as gymnasium's own
        for a worker it shut down (which the server takes for its workers having ended: it cannot run on), and
        the state is back to DEFAULT, so the next call (a reset) runs. The replies due are waited for
        :attr:`recover_timeout_s` at most, all together; a worker still busy then is killed. The workers' reports of
        their failures are taken off the error queue and logged, each naming its env (the server's env index, as
        its envs' log lines and the learner's messages of this server's envs name them), so that none is left there
        for gymnasium to take for a later failure's. Raises nothing: it runs on another error's way out."""
        deadline = time.monotonic() + self.recover_timeout_s
        failed: set[int] = set()
        try:
            for index, pipe in enumerate(self.parent_pipes):
                if not isinstance(pipe, _TrackedPipe):
                    continue
                killed = False
                if pipe.due and not pipe.broken and not pipe.closed:
                    killed = self._drop_reply(index, pipe, deadline)
                if pipe.failed:  # (its reply said its worker failed: gymnasium's worker then ends)
                    failed.add(index)
                    pipe.broken = True
                    with contextlib.suppress(Exception):
                        self.processes[index].join(timeout=5.0)
                if pipe.broken or pipe.closed or not self.processes[index].is_alive():
                    if not killed:
                        log.error("async vectorization: the worker of env %d ended (its pipe closed)", index)
                    with contextlib.suppress(Exception):
                        pipe.close()
                    self.parent_pipes[index] = None  # type: ignore[call-overload]
            self._log_failures(failed)
            self._state = async_vector_env.AsyncState.DEFAULT
        except Exception:
            log.exception("async vectorization: could not recover the workers after an error")

    def _drop_reply(self, index: int, pipe: _TrackedPipe, deadline: float) -> bool:
        """Read worker ``index``'s reply still due (it comes once its env is done), dropping it (a failure's marks the
        pipe: :attr:`_TrackedPipe.failed`). A worker with no reply by ``deadline`` (``time.monotonic()``) is killed and
        its pipe taken for broken: whether it was (logged, saying why)."""
        process = self.processes[index]
        try:
            while not pipe.poll(min(1.0, max(0.0, deadline - time.monotonic()))):
                if not process.is_alive():
                    pipe.broken = True
                    return False
                if time.monotonic() >= deadline:
                    log.error(
                        "async vectorization: the worker of env %d had not answered %g s after an error (its env's "
                        "call still runs: it hangs, or takes longer than a recovery waits); killed it",
                        index,
                        self.recover_timeout_s,
                    )
                    pipe.broken = True
                    with contextlib.suppress(Exception):
                        process.kill()
                        process.join(timeout=5.0)
                    return True
            pipe.recv()
        except (EOFError, OSError):
            pass  # (broken: see _TrackedPipe.recv)
        return False

    def _log_failures(self, failed: set[int]) -> None:
        """Take the workers' reports of their failures (``(index, type, error, traceback)``) off the error queue, and
        log each naming the env its own index says: the queue holds them in the order the workers failed, which
        need not be the order of their pipes, and may hold the report of a worker whose failed reply gymnasium read
        before the error. The reports of the envs ``failed`` (whose pipes said so) are waited for, 5 s at most (a
        worker puts its report on the queue before it replies, but the queue's thread may send it after); then
        those already there."""
        owed = set(failed)
        wait_until = time.monotonic() + 5.0
        while True:
            try:
                if owed:
                    item = self.error_queue.get(timeout=max(0.0, wait_until - time.monotonic()))
                else:
                    item = self.error_queue.get_nowait()
            except Exception:  # (queue.Empty: none (more) came)
                if owed:
                    log.error(
                        "async vectorization: the worker of env %s failed, and sent no report of it",
                        ", ".join(map(str, sorted(owed))),
                    )
                return
            index, _, error, trace = item
            owed.discard(index)
            log.error("async vectorization: the worker of env %d failed: %s\n%s", index, error, trace)

    def close_extras(self, timeout: float | None = None, terminate: bool = False) -> None:
        try:
            super().close_extras(timeout=timeout, terminate=terminate)
        except BaseException:  # (a worker gone already: BrokenPipeError; the others still run)
            self._kill_workers()
            raise

    def _close_workers(self) -> None:
        """After the start failed: ask the workers still running to close their envs (those made already, or
        being made: a worker closes its env once made), as gymnasium's close does, and wait for them to end,
        :attr:`close_failed_start_s` at most, all together (those still running then are killed, by
        :meth:`_kill_workers`: said here). A worker's error closing its env is its traceback on stderr.
        Raises nothing: it runs on another error's way out."""
        deadline = time.monotonic() + self.close_failed_start_s
        asked: list[tuple[int, Any]] = []
        pipes, processes = getattr(self, "parent_pipes", ()), getattr(self, "processes", ())
        for index, (pipe, process) in enumerate(zip(pipes, processes, strict=False)):  # (gymnasium appends both)
            with contextlib.suppress(Exception):  # (a worker gone, its pipe closed: nothing to ask)
                if _started(process) and process.is_alive():
                    pipe.send(("close", None))
                    asked.append((index, process))
        for index, process in asked:
            with contextlib.suppress(Exception):
                process.join(timeout=max(0.0, deadline - time.monotonic()))
                if process.is_alive():
                    log.error(
                        "async vectorization: the worker of env %d had not closed its env %g s after the build of "
                        "the envs failed; killed it",
                        index,
                        self.close_failed_start_s,
                    )

    def _kill_workers(self) -> None:
        """Kill the workers that were started (a failed start leaves the later ones unstarted, which
        cannot be joined) and join them. Raises nothing: it runs on another error's way out."""
        started = [process for process in getattr(self, "processes", ()) if _started(process)]
        for process in started:
            with contextlib.suppress(Exception):
                if process.is_alive():
                    process.kill()
        for process in started:
            with contextlib.suppress(Exception):
                process.join(timeout=5.0)


# (see _garbage_frozen: how many vector envs are starting their workers now, in this process's threads)
_freezes = 0
_freezes_lock = threading.Lock()


@contextlib.contextmanager
def _garbage_frozen() -> Iterator[None]:
    """A context in which processes forked (async vectorization's workers) never collect the garbage this process
    holds: it is collected here first, and what is left (live objects, and garbage that another thread makes
    meanwhile) moved out of the collector's reach (``gc.freeze()``, as CPython's docs advise before a fork), for
    the block; the workers keep it so, this process gets it back after (``gc.unfreeze()``, once every such block
    of its threads has ended). A worker that collected garbage of this process's gRPC objects (a RemoteVectorEnv's
    channels, a server's: a notebook that used a RemoteVectorEnv, then built an in-process async fleet; a server's
    --fresh-envs rebuild, forked while gRPC runs) ran their finalizers in the fork, where gRPC's threads are not:
    it hung, spinning, or crashed, in its first garbage collection."""
    global _freezes
    gc.collect()
    with _freezes_lock:
        gc.freeze()
        _freezes += 1
    try:
        yield
    finally:
        with _freezes_lock:
            _freezes -= 1
            if _freezes == 0:
                gc.unfreeze()


def _tracked(pipe: Any) -> Any:
    """``pipe`` (a worker's, as gymnasium holds it) as a :class:`_TrackedPipe`, once."""
    return pipe if isinstance(pipe, _TrackedPipe) else _TrackedPipe(pipe)


class _TrackedPipe:
    """A parent's end of a worker's pipe that knows whether a reply is due (a command was sent, its reply not yet
    read) and whether it broke (the worker's end closed): what :meth:`WideInfoAsyncVectorEnv._recover` needs.
    Else the pipe it holds, as gymnasium uses it."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self.due = False
        self.broken = False
        self.failed = False
        """The last reply read said the worker failed (``(None, False)``): gymnasium's worker ends then."""

    def send(self, obj: Any) -> None:
        # As Connection.send, pickling first: what cannot be pickled is sent not at all, and no reply is due. Due
        # before it is sent: an exception raised as the send returns (a signal handler's: a Ctrl-C) leaves the reply
        # due that the worker sends all the same. Pickled to bytes, not to ForkingPickler.dumps' view of its BytesIO:
        # a send that raises leaves that view in its traceback's frames, and where the error is then kept in a
        # reference cycle (re-raised from a variable, as EnvThread.call does), collecting it printed "Exception
        # ignored in: <_io.BytesIO ...> BufferError" (Python 3.13.0), or crashed the server (3.12.1: CPython's gh-111049).
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump(obj)
        data = buffer.getvalue()  # (the BytesIO's own bytes: no copy)
        self.due = True
        try:
            self._pipe.send_bytes(data)
        except OSError:  # (BrokenPipeError: the worker is gone)
            self.broken = True
            raise

    def recv(self) -> Any:
        try:
            reply = self._pipe.recv()
        except (EOFError, OSError):  # (the worker's end closed: it is gone)
            self.broken = True
            raise
        self.due = False
        if isinstance(reply, tuple) and len(reply) == 2 and reply[1] is False:
            self.failed = True
        return reply

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)


def _started(process: Any) -> bool:
    """Whether ``process`` (a multiprocessing Process) was started: it has a pid."""
    try:
        return process.pid is not None
    except ValueError:  # (closed: it was started, and is gone)
        return False


class WorkerStartError(OSError):
    """A worker process of async vectorization could not be started (its fork failed)."""

    def __init__(self, index: int, count: int, err: OSError) -> None:
        super().__init__(err.errno, err.strerror)
        self.index = index  # (1-based)
        self.count = count
        self.error = err


class WorkerEndedError(Exception):
    """A worker process of async vectorization ended as it made its env, without an error to report (os._exit, a
    crash in native code, the OOM killer)."""

    def __init__(self, index: int, count: int, exitcode: int) -> None:
        if exitcode >= 0:
            how = f"exit code {exitcode}: os._exit or sys.exit in the env's constructor, say"
        elif -exitcode == signal.SIGKILL:
            how = "killed by SIGKILL: by the kernel's OOM killer, out of memory, say"
        else:
            how = f"killed by {_signal_name(-exitcode)}: a crash in native code, say"
        super().__init__(f"worker process {index} of {count} ended ({how}) as it made its env, with no error to report")
        self.index = index  # (1-based)
        self.count = count
        self.exitcode = exitcode


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# gymnasium's worker of AsyncVectorEnv, which _naming_worker extends: a private function (were it renamed
# in some later gymnasium, its own worker runs, and a misfit is numpy's error again).
_ASYNC_WORKER: Callable[..., None] | None = getattr(async_vector_env, "_async_worker", None)


def _naming_worker(
    index: int,
    env_fn: Callable[[], gym.Env[Any, Any]],
    pipe: Any,
    parent_pipe: Any,
    shared_memory: Any,
    error_queue: Any,
    *rest: Any,
    in_process: bool = False,
) -> None:
    """gymnasium's worker of AsyncVectorEnv (``_async_worker``, its arguments passed through), whose error
    for an observation its env returned that does not fit the observation space is an
    ObservationLayoutError naming it, not numpy's "could not broadcast input array from shape (3,) into
    shape (2,)" from writing it into the shared memory (which flattens it first, so even its shapes
    mislead). As there, the worker then ends (gymnasium shuts down a worker whose env raised).

    The observation is looked at only once writing it has failed, in the worker (its env's
    IsolateErrors keeps the last one): no cost per step."""
    made: list[gym.Env[Any, Any]] = []

    def make() -> gym.Env[Any, Any]:
        try:
            env = env_fn()
        except Exception as err:  # (the server would see only the pipe close: see WideInfoAsyncVectorEnv)
            _report(error_queue, index, err)
            raise  # (its traceback on stderr, as gymnasium's worker leaves it)
        made.append(env)
        return env

    errors: Any = _NamingErrors(error_queue, index, made, in_process)  # (its put is all the worker uses of its queue)
    assert _ASYNC_WORKER is not None  # (used only then)
    try:
        _ASYNC_WORKER(index, make, pipe, parent_pipe, shared_memory, errors, *rest)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        # The server's end of the pipe closed (the server is gone: killed, say): there is nobody to tell
        # of it, and the worker ends (its env closed) without a traceback on the server's stderr. (Not an
        # env constructor's own error of these kinds, a simulator's connection reset: its traceback says why.)
        if not made:
            raise
        return


def _report(queue: Any, index: int, err: Exception) -> None:
    """Put ``err`` (raised as worker ``index`` made its env) on the error queue, as gymnasium's worker reports an
    env's error: one that does not pickle, or not back (an exception whose ``__init__`` takes other arguments than
    its ``args``), as its text."""
    with contextlib.suppress(Exception):
        try:
            pickle.loads(ForkingPickler.dumps(err))
        except Exception:
            err = RuntimeError(f"{type(err).__name__}: {_one_line(err)}")
        queue.put((index, type(err), err, traceback.format_exc()))


class _NamingErrors:
    """A worker's error queue that, for an error writing an observation into the shared memory where the
    env's last observation does not fit the observation space, puts the ObservationLayoutError naming it
    instead (see :func:`_naming_worker`)."""

    def __init__(self, queue: Any, index: int, made: list[gym.Env[Any, Any]], in_process: bool = False) -> None:
        self._queue = queue
        self._index = index
        self._made = made
        self._in_process = in_process

    def put(self, item: tuple[int, type[BaseException], BaseException, str]) -> None:
        index, _, error, trace = item
        # (only an error from writing the observation into the shared memory: others are what they are)
        if self._made and not isinstance(error, ObservationLayoutError) and "write_to_shared_memory" in trace:
            misfit = _misfit_error(self._made[0], self._index, self._in_process)
            if misfit is not None:
                trace += f"\n(the error above, in the worker of env {self._index}: {misfit})\n"
                item = (index, ObservationLayoutError, misfit, trace)
        self._queue.put(item)


def build_vector_env(
    config: ServerConfig,
    *,
    copy: bool = True,
    ctrl_c: bool = False,
    in_process: bool = False,
    workers_starting: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
    first_building: Callable[[], contextlib.AbstractContextManager[None]] | None = None,
) -> gym.vector.VectorEnv:
    """The K-env vector env ``config`` describes; raises EnvBuildError with a one-line reason.

    ``copy=False``: with sync or async vectorization, ``reset``/``step`` return the vector env's own buffers
    (gymnasium's ``copy``), overwritten by the next call; for callers that are done with each result
    by then, as the server is once it has encoded it. ``ctrl_c``: a KeyboardInterrupt raised in the
    env's step or reset in this process is a Ctrl-C, raised, not the env's error (a learner's
    in-process envs, where a second Ctrl-C aborts; async workers' stay the env's: a Ctrl-C reaches
    them too, and is the parent's to act on). ``in_process``: the envs are a learner's own (``--backend gym``),
    no server's: an observation that does not fit is ObservationLayoutError "in-process env 2: ...", not "the
    server's env 2: ...". ``workers_starting``: under async vectorization, a context the workers' start (and
    this process's wait for their envs) runs in, the env built here first not in it (the server's look for its
    parent, see env_server.server._parent_watched); ``first_building``: a context that env's build runs in
    (the server's look for its parent by a thread, which ends before anything is forked).
    """
    check_env(config)
    mode = gym.vector.AutoresetMode(config.autoreset_mode)
    with _as_build_error(config, ctrl_c=ctrl_c):
        if config.vectorization == "vector_entry_point":
            kwargs = dict(config.env_kwargs)
            if mode is not gym.vector.AutoresetMode.NEXT_STEP:
                kwargs["autoreset_mode"] = mode
            vec = gym.make_vec(config.env, num_envs=config.num_envs, vectorization_mode="vector_entry_point", **kwargs)
        else:
            factory = _env_factory(config)
            # Build one env here first: a bad id or bad kwargs then fails in this process with its
            # own message, not inside a subprocess of AsyncVectorEnv.
            with first_building() if first_building is not None else contextlib.nullcontext():
                first = factory()
            _check_spaces(first, config.env)
            # Each env isolated, so that one env's exception costs its own episode only (see
            # env_server.isolation); under async vectorization the wrapper lives in the worker.
            same_step = mode is gym.vector.AutoresetMode.SAME_STEP
            in_workers = config.vectorization == "async"
            isolated = [
                _isolated(
                    factory,
                    config.env,
                    i,
                    repeat_on_reset=same_step,
                    ctrl_c=ctrl_c and not in_workers,
                    in_process=in_process,
                )
                for i in range(config.num_envs)
            ]
            if config.vectorization == "async":
                first_spec = first.spec  # (the workers' envs are made alike; asking them would pickle theirs)
                first.close()
                workers = [_in_worker(_checked_for_writing(make, i, in_process)) for i, make in enumerate(isolated)]
                worker = functools.partial(_naming_worker, in_process=in_process) if _ASYNC_WORKER is not None else None
                with workers_starting() if workers_starting is not None else contextlib.nullcontext():
                    vec = WideInfoAsyncVectorEnv(
                        workers, autoreset_mode=mode, copy=copy, worker=worker, context=worker_context()
                    )
                vec.first_spec = first_spec
            else:
                made: list[gym.Env[Any, Any]] = []  # (as SyncVectorEnv makes them: closed if the build fails)
                fns: list[Callable[[], gym.Env[Any, Any]]] = [
                    _kept(
                        lambda: _guarded(
                            first, config.env, 0, repeat_on_reset=same_step, ctrl_c=ctrl_c, in_process=in_process
                        ),
                        made,
                    )
                ]
                fns += [_kept(make, made) for make in isolated[1:]]
                try:
                    # Built and their spaces checked here, not by SyncVectorEnv: see _observation_mode.
                    built = [make() for make in fns]
                    vec = WideInfoSyncVectorEnv(
                        [functools.partial(_given, env) for env in built],
                        autoreset_mode=mode,
                        copy=copy,
                        observation_mode=_observation_mode(built),
                    )
                except BaseException:
                    # (env 0 holds ``first``: closed with it, or alone where it was not made yet)
                    _close_built(made or [first], config.env)
                    raise
                vec.in_process = in_process
    if config.step_delay_ms > 0:
        vec = StepDelay(vec, config.step_delay_ms / 1000.0)
    return vec


@contextlib.contextmanager
def _as_build_error(config: ServerConfig, *, ctrl_c: bool) -> Iterator[None]:
    """What the block raises, as the EnvBuildError of ``config``'s env (:func:`_build_error`): anything gymnasium
    or an env's constructor raises (CancelledError too); with ``ctrl_c`` (a learner's process) a KeyboardInterrupt
    is raised on, not the env's."""
    try:
        yield
    except EnvBuildError:
        raise
    except BaseException as err:
        if ctrl_c and isinstance(err, KeyboardInterrupt):  # (a Ctrl-C in a learner's process: not the env's)
            raise
        # (a SystemExit or KeyboardInterrupt too: raised on, it would skip the server's teardown)
        raise _build_error(config, err) from err


def _kept(factory: Callable[[], gym.Env[Any, Any]], made: list[gym.Env[Any, Any]]) -> Callable[[], gym.Env[Any, Any]]:
    """``factory``, each env it makes appended to ``made``."""

    def make_kept() -> gym.Env[Any, Any]:
        env = factory()
        made.append(env)
        return env

    return make_kept


def _given(env: gym.Env[Any, Any]) -> gym.Env[Any, Any]:
    """``env``, built already (an env function of SyncVectorEnv's)."""
    return env


# Elements of Box bounds compared at a time (see _same_space): numpy's allclose makes float64 arrays of its
# operands (a few at once), 2 MiB each so.
_COMPARED_AT_ONCE = 1 << 18


def _observation_mode(envs: Sequence[gym.Env[Any, Any]]) -> Any:
    """SyncVectorEnv's ``observation_mode`` for ``envs``, their spaces checked as its default mode ("same") checks
    them, with its errors (RuntimeError), in its order: each env's observation space equal to env 0's (its ``!=``,
    :func:`_space_differs`), then its action space; the spaces (the batched one first, as SyncVectorEnv makes it,
    and env 0's) where every env's observation space has env 0's type, shape and dtype too (what SyncVectorEnv then
    checks instead), so that it does not compare them again; "same" otherwise (as before), and where gymnasium
    cannot tell their type, shape and dtype (is_space_dtype_shape_equiv raises NotImplementedError for a space of
    its generic kind, a Space subclass of an env's own, which "same" batches and compares with its ``==``).

    SyncVectorEnv compares them with their ``==``, whose np.allclose of a Box's bounds makes float64 arrays of
    them: ~25 times a uint8 observation for a moment, for each env, the first's with itself included (a 16 MiB
    observation: 628 MiB of peak at the start for 1 env); here they are compared a part at a time
    (:func:`_same_space`, which says what their ``==`` says)."""
    single, single_action = envs[0].observation_space, envs[0].action_space
    batched = _batched(single, len(envs))
    for env in envs:
        if _space_differs(env.observation_space, single):
            raise RuntimeError(  # (SyncVectorEnv's words)
                f"SyncVectorEnv(..., observation_mode='same') however the sub-environments observation spaces are "
                f"not equivalent. single_observation_space={single}, sub-environment observation_space="
                f"{env.observation_space}. If this is intentional, use `observation_mode='different'` instead."
            )
        if env.action_space != single_action:
            raise RuntimeError(
                f"Sub-environment action space doesn't make the `single_action_space`, action_space="
                f"{env.action_space}, single_action_space={single_action}"
            )
    alike = all(_dtype_shape_alike(env.observation_space, single) for env in envs)
    return (batched, single) if alike else "same"


def _dtype_shape_alike(space: gym.Space[Any], single: gym.Space[Any]) -> bool:
    """gymnasium's ``is_space_dtype_shape_equiv(space, single)``, what SyncVectorEnv checks of each env's
    observation space where it is given the spaces; False where it raises (NotImplementedError for a space of
    gymnasium's generic kind, anything a function registered for a space of an env's own may raise): such envs
    are built in the "same" mode, as before, which never asks it."""
    try:
        return bool(gym.spaces.utils.is_space_dtype_shape_equiv(space, single))
    except Exception:
        return False


def _space_differs(space: gym.Space[Any], single: gym.Space[Any]) -> bool:
    """``space != single``, SyncVectorEnv's test of each env's observation space (``single``: env 0's), as
    :func:`_same_space` says it where it can (``!=`` being ``not ==`` there), by ``!=`` itself otherwise."""
    same = _compared_in_parts(space, single)
    return bool(space != single) if same is None else not same


def _batched(space: gym.Space[Any], n: int) -> gym.Space[Any]:
    """gymnasium's ``batch_space(space, n)``. A Box (of gymnasium's own class, of integers or floats) whose low
    bound is one value in every element, and its high bound too (a camera's 0 and 255), is made from those two
    values, as a Box made with them makes its arrays (np.full): the same Box, without batch_space's np.tile of the
    bounds and the arrays the Box makes of them before copying them (~3 x K observations for a moment, over the 4
    of each env's Box and the 4 x K the batch's Box keeps: a server's start peak at 8 envs of 1080x1920x3 uint8
    frames 644 -> 501 MiB). Other spaces (per-element bounds, bool, subclasses, Dict, ...): batch_space's, and a
    Box of elements of another size than 1, 2, 4 or 8 bytes (np.longdouble: 16 on x86-64 Linux, which no unsigned
    integer views bit for bit, see :func:`_one_value`; the wire cannot carry it, and the server says so)."""
    if type(space) is gym.spaces.Box and space.dtype.kind in "iuf" and space.dtype.itemsize in (1, 2, 4, 8):
        low, high = _one_value(space.low), _one_value(space.high)
        if low is not None and high is not None:
            return gym.spaces.Box(low, high, (n, *space.shape), space.dtype, seed=deepcopy(space.np_random))
    return gym.vector.utils.batch_space(space, n)


def _one_value(array: np.ndarray) -> Any:
    """The one value (a numpy scalar) every element of ``array`` has, bit for bit; None otherwise, or where
    ``array`` is empty (compared a part at a time, see _COMPARED_AT_ONCE)."""
    flat = array.reshape(-1)
    if not flat.size:
        return None
    bits = flat.view(f"u{flat.dtype.itemsize}")
    for i in range(0, bits.size, _COMPARED_AT_ONCE):
        if not (bits[i : i + _COMPARED_AT_ONCE] == bits[0]).all():
            return None
    return flat[0]


def _same_space(space: gym.Space[Any], other: gym.Space[Any]) -> bool:
    """``space == other``, as gymnasium's Box, Dict and Tuple say it, a Box's bounds compared a part at a time
    (:func:`_compared_in_parts`); other spaces, and subclasses with their own ``==`` or ``!=``, by ``==``."""
    same = _compared_in_parts(space, other)
    return bool(space == other) if same is None else same


def _compared_in_parts(space: gym.Space[Any], other: gym.Space[Any]) -> bool | None:
    """What ``space == other`` says where gymnasium's Box, Dict or Tuple ``__eq__`` says it (and ``!=`` is its
    negation: no ``__ne__`` of a subclass's own), a Box's bounds compared a part at a time; None where another
    ``==`` would answer (then asked by the callers: a Discrete's, a subclass's own).

    As Python's ``==`` and ``!=`` do: where ``other``'s class is a strict subclass of ``space``'s, ``other``
    answers (a Box subclass's own ``==`` on env 0's space, say, or Box's with the operands swapped: np.allclose
    is not symmetric, its tolerance relative to its second operand); a Dict's and a Tuple's parts are compared
    as a dict's and a tuple's ``==`` compare them (the same object equal at once, then their ``==``)."""
    if type(other) is not type(space) and type(space) in type(other).__mro__:
        space, other = other, space
    kind = type(space)
    if kind.__ne__ is not object.__ne__:
        return None
    if kind.__eq__ is gym.spaces.Box.__eq__:
        assert isinstance(space, gym.spaces.Box)
        return (
            isinstance(other, gym.spaces.Box)
            and space.shape == other.shape
            and space.dtype == other.dtype
            and _allclose(space.low, other.low)
            and _allclose(space.high, other.high)
        )
    if kind.__eq__ is gym.spaces.Dict.__eq__:
        assert isinstance(space, gym.spaces.Dict)
        if not isinstance(other, gym.spaces.Dict) or space.spaces.keys() != other.spaces.keys():
            return False
        ordered = isinstance(space.spaces, OrderedDict) and isinstance(other.spaces, OrderedDict)
        if ordered and list(space.spaces) != list(other.spaces):
            return False  # (two OrderedDicts' == minds their order)
        return all(s is other.spaces[k] or _same_space(s, other.spaces[k]) for k, s in space.spaces.items())
    if kind.__eq__ is gym.spaces.Tuple.__eq__:
        assert isinstance(space, gym.spaces.Tuple)
        return (
            isinstance(other, gym.spaces.Tuple)
            and len(space.spaces) == len(other.spaces)
            and all(s is o or _same_space(s, o) for s, o in zip(space.spaces, other.spaces, strict=True))
        )
    return None


def _allclose(a: np.ndarray, b: np.ndarray) -> bool:
    """np.allclose of two arrays of one shape, a part at a time (see _COMPARED_AT_ONCE)."""
    flat_a, flat_b = a.reshape(-1), b.reshape(-1)
    return all(
        np.allclose(flat_a[i : i + _COMPARED_AT_ONCE], flat_b[i : i + _COMPARED_AT_ONCE])
        for i in range(0, flat_a.size, _COMPARED_AT_ONCE)
    )


def _close_built(envs: Sequence[gym.Env[Any, Any]], name: str) -> None:
    """Close ``envs``, those a build that failed had made (a simulator's window, process or GPU context each, which a
    server that serves on after a failed rebuild, --fresh-envs, would keep until garbage collection): an error of a
    close is logged, not raised over the build's own error."""
    for index, env in enumerate(envs):
        try:
            env.close()
        except Exception as err:
            log.warning(
                "env %d of %r, made before the build of the envs failed, could not be closed: %s: %s",
                index,
                name,
                type(err).__name__,
                _one_line(err),
            )


def _check_spaces(env: gym.Env[Any, Any], name: str) -> None:
    """EnvBuildError (``env`` closed) where ``env`` (one env as built) has no observation_space or action_space
    that is a gymnasium Space: gymnasium's own error ("The space provided to batch_space is not a gymnasium Space
    instance") names neither the space nor the env."""
    for which in ("observation_space", "action_space"):
        try:
            space = getattr(env, which)
        except AttributeError:
            space = None
        if not isinstance(space, gym.spaces.Space):
            with contextlib.suppress(Exception):
                env.close()
            what = "is None" if space is None else f"is a {type(space).__name__}"
            raise EnvBuildError(
                f"cannot make env {name!r}: its {which} {what}: expected a gymnasium.spaces.Space set in __init__"
            )


def max_episode_steps(vec: gym.vector.VectorEnv, config: ServerConfig) -> int:
    """The time limit, in steps, that the envs of ``vec`` (built from ``config``) are made with; 0 when
    they have none or it is unknown.

    ``--max-episode-steps`` when given (a TimeLimit around each env, or ``gymnasium.make``'s own
    argument). Else, for sync and async vectorization, the spec of an env as built: what
    ``gymnasium.make`` gave it (the registered limit, or a ``max_episode_steps`` in ``--env-kwargs``),
    or an entry point's env's own spec (none: 0); under async, that of the env build_vector_env made
    in this process first, as the workers make theirs (asking a worker would pickle its env's spec,
    which an id registered with a lambda cannot, and wait for every worker). For vector_entry_point, the
    limit ``gymnasium.make_vec`` passed the env's vectorized implementation: a ``max_episode_steps`` in
    ``--env-kwargs``, else the registered one (the vector env's spec keeps the registered one even
    where the kwarg overrode it).
    """
    if config.max_episode_steps is not None:
        return config.max_episode_steps
    base = vec.unwrapped
    if isinstance(base, gym.vector.SyncVectorEnv):
        spec = base.envs[0].spec  # (the first env stands for all K: one factory makes them)
    elif isinstance(base, gym.vector.AsyncVectorEnv):
        spec = getattr(base, "first_spec", None)
    else:
        spec = base.spec
        if spec is not None and "max_episode_steps" in spec.kwargs:
            return _steps(spec.kwargs["max_episode_steps"])
    return 0 if spec is None else _steps(spec.max_episode_steps)


def _steps(limit: Any) -> int:
    """A time limit as EnvSpec.max_episode_steps holds it: a positive int, or 0 for none (None, or
    gymnasium's -1, "no TimeLimit")."""
    return int(limit) if isinstance(limit, int | np.integer) and limit > 0 else 0


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if text else type(err).__name__
