"""IsolateErrors: one env's exception ends that env's episode instead of failing the whole batch.

A server steps K envs as one vector env. Without this wrapper, an exception in env j's ``step``
aborts the batch half done: envs before j have stepped, envs after j have not, and the vector env's
bookkeeping (autoreset flags, observation buffers) is left in between, so the only safe answer is an
``INTERNAL`` error for the whole batch, the other K-1 results lost, and a full reset.

Wrapped around every env instead (inside the vector env, so also in the worker processes of
``--vectorization async``), an exception becomes a *per-env error record*: the env's step returns
its last observation, reward 0 and ``truncated=True`` with ``info["env_error"]`` = the exception's
type and message, and the other envs' results go back as usual. ``truncated`` makes the vector env
reset that env by its own autoreset rule (at once under same-step autoreset, on the next step under
next-step autoreset), so the env starts a fresh episode. Under same-step autoreset the batch's
top-level infos of that step are the reset's, so the reset's info carries the same ``env_error``
(``repeat_on_reset``): under either mode the step the error happened in, and only that step, has
``env_error`` set in the batch's top-level infos (gymnasium's ``_env_error`` mask names the env), and
each exception is counted once. A reset that raises too leaves the env *out of order*: it returns a
placeholder observation (its last one, or else :func:`placeholder_observation`, a fixed member of
the observation space) with ``env_error`` set, and every later step of it is again reported as
truncated with ``env_error``, so each autoreset tries again until a reset works.

An env's own info may not use the keys envfleet reserves for these records (``env_error``, and the
learner's ``env_unavailable`` and ``env_rejoined``, each with its ``_`` mask): a learner would take
the env's value for envfleet's record (a float ``env_error`` of 0.0 for an exception). An info that
does is refused as the env's error, ReservedInfoKeyError, naming the key. So is a step's reward that is no
real number fitting a float64 (a 1-element array, None, a str, a complex, 10**400) and a flag that is no bool
(None, NaN, 2, a 1-element array; an int 0 or 1 is taken): a TypeError naming what came ("step() returned
reward of type ndarray, shape (1,), dtype float64: expected a number (a float)"), where a vector env would
fail the whole batch storing it, or store it without a word as something else (None as a NaN reward or a
False flag). NaN and infinite rewards are numbers: the learner names those.

Rule for learners: a step whose ``env_error`` is set for an env is not a transition of that env (its
action was not applied, or its result was lost); the observation is a placeholder or a new episode's
first observation. ``RemoteVectorEnv`` reports such envs in ``infos["env_unavailable"]`` too.
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import time
import traceback
import warnings
from collections.abc import Mapping
from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np

from env_server.protocol import escape_surrogates

__all__ = [
    "ENV_ERROR_KEY",
    "RESERVED_INFO_KEYS",
    "IsolateErrors",
    "ReservedInfoKeyError",
    "placeholder_observation",
    "tell_positions",
]

log = logging.getLogger(__name__)

ENV_ERROR_KEY = "env_error"
"""The info key of a per-env error record: text, ``"<where>: <ExceptionType>: <message>"``."""

RESERVED_INFO_KEYS = frozenset(
    key for name in (ENV_ERROR_KEY, "env_unavailable", "env_rejoined") for key in (name, "_" + name)
)
"""Info keys envfleet writes itself (this module, and ``learner.remote``): an env's info may not use them."""

NO_OPTIONS_KEY = ("envfleet", "no options")
"""The server's own mark, in the options of a ``reset_mask`` reset whose request carried no options:
gymnasium's vector envs pass each env what is left of ``{"reset_mask": mask}`` once they took the mask
out (``{}``), and :class:`IsolateErrors` turns options holding this key into None, as a request with
no options means (``ResetRequest.options``: unset for None). Not a string: no options that came over
the wire can hold it (their keys are strings), and it survives pickling to an async worker."""

# What an env's code may raise that must not end the server: anything, BaseExceptions too (SystemExit,
# KeyboardInterrupt, asyncio.CancelledError, GeneratorExit, an env's own subclass of BaseException): the server
# handles its own signals without them, and none of them is the server's own while an env's code runs (escaped,
# one would fail the whole batch, or end an async worker without a word). In a process where a
# KeyboardInterrupt is a Ctrl-C (a learner's in-process envs, ``ctrl_c``), that one is not the env's: raised on.
_CAUGHT = BaseException
# BaseExceptions whose record names them as they are ("step: SystemExit: 3"); others' say what they are
# ("step: CancelledError (a BaseException the env raised)").
_NAMED_AS_THEY_ARE = (Exception, SystemExit, KeyboardInterrupt)

# Longest error text sent to the learner (an exception's message may be huge).
_MAX_MESSAGE = 500
# Env errors logged one by one (with their tracebacks) per process, the envs of a server together, before
# the rest are only counted: an env may fail at every step, and 3 per env made a server of 4 such envs
# write ~100 lines in under a second. (Per process: under --vectorization async, each worker's, of its one env.)
_LOGGED_ERRORS = 3
# Then at most one line per this many seconds sums up the errors left out since.
_SUMMARY_EVERY_S = 60.0


def placeholder_observation(space: gym.Space[Any]) -> Any:
    """A fixed observation inside ``space``: zeros where zero is a member, else the nearest member
    (Discrete and MultiDiscrete: ``start``; Box: zero clipped into its bounds).

    A member, not merely zeros of the right shape: learners one-hot ``obs - start`` of Discrete
    observations, and zero is outside ``Discrete(n, start=5)``.
    """
    if isinstance(space, gym.spaces.Dict):
        return {key: placeholder_observation(sub) for key, sub in space.spaces.items()}
    if isinstance(space, gym.spaces.Tuple):
        return tuple(placeholder_observation(sub) for sub in space.spaces)
    if isinstance(space, gym.spaces.Discrete):
        return np.asarray(space.start, dtype=space.dtype)
    if isinstance(space, gym.spaces.MultiDiscrete):
        return np.array(space.start, dtype=space.dtype)
    if isinstance(space, gym.spaces.MultiBinary):
        return np.zeros(space.shape, dtype=space.dtype)
    if isinstance(space, gym.spaces.Box):
        return np.asarray(np.clip(np.zeros(space.shape, dtype=space.dtype), space.low, space.high), dtype=space.dtype)
    # (Text, Sequence, Graph, ...: no wire format carries them, but a local vector env may hold
    # them) a sample from a copy, so the env's own space keeps its random stream.
    return copy.deepcopy(space).sample()


class _ErrorLog:
    """How this process logs its envs' errors: the first :data:`_LOGGED_ERRORS` one by one, then at most one
    line per :data:`_SUMMARY_EVERY_S` counting those left out since (on the next error after that: errors that
    stop coming are not summed up, and their learner has been told of each one anyway)."""

    def __init__(self) -> None:
        self.errors = 0
        """Env errors so far, in this process."""
        self._logged = 0
        self._left_out = 0
        self._last_line = -math.inf  # (time.monotonic() of the last line about an env error)

    def one_by_one(self, env: str, message: str, *, new: bool = True) -> bool:
        """Count env ``env``'s error (its record ``message``; ``env`` as :meth:`IsolateErrors.name` says it);
        whether the caller is to log it, with its traceback: one of the first that are ``new`` (not an env out
        of order whose reset raised again). Else it is left out, and summed up once a line is due."""
        self.errors += 1
        now = time.monotonic()
        if new and self._logged < _LOGGED_ERRORS:
            self._logged += 1
            self._last_line = now
            return True
        self._left_out += 1
        if self._last_line == -math.inf:
            self._last_line = now  # (none logged one by one yet: the interval starts now)
        if now - self._last_line >= _SUMMARY_EVERY_S:
            log.warning(
                "%d env errors in the last %.0f s not logged one by one (only the first %d are, with their "
                "tracebacks; %d in all so far); the last: %s: %s",
                self._left_out,
                now - self._last_line,
                _LOGGED_ERRORS,
                self.errors,
                env,
                message,
            )
            self._left_out, self._last_line = 0, now
        return False


# (one per process: the envs of a server, or of a learner's in-process vector env, step one at a time)
_error_log = _ErrorLog()


class ReservedInfoKeyError(ValueError):
    """An env's info uses a key of RESERVED_INFO_KEYS."""


def _check_info(info: Any) -> None:
    """Raise ReservedInfoKeyError where the env's ``info`` uses a key envfleet reserves."""
    if info and isinstance(info, dict) and not RESERVED_INFO_KEYS.isdisjoint(info):
        key = min(RESERVED_INFO_KEYS.intersection(info))
        raise ReservedInfoKeyError(
            f"the env's info has the key {key!r}, which is reserved by envfleet (its per-env records "
            f"{', '.join(sorted(k for k in RESERVED_INFO_KEYS if not k.startswith('_')))} and their '_' masks); "
            "rename it in the env"
        )


# The largest float64: a long double beyond it is none gymnasium can store (it would store it as infinite).
_FLOAT64_MAX = float(np.finfo(np.float64).max)
# Types of a reward gymnasium's vector envs store in their float64 array as they are (the common case, looked at first).
_REAL_SCALARS = (float, int, np.floating, np.integer, np.bool_)


class _UnstorableStep(TypeError):
    """What an env's step or reset returned that a vector env cannot store or take apart (see :func:`_check_reward`,
    :func:`_unpacked_step`): a TypeError, named so in the env's error record; logged without a traceback (it would
    show this module's check, not the env)."""


class SpaceChangedError(ValueError):
    """The env's observation_space (or action_space) is no longer the one it had when it was built: the vector env
    stacks (and the learner sized its networks for) the one it had then."""


# Errors of what the env returned (not raised): their records and log lines say "returned".
_RETURNED = (_UnstorableStep, ReservedInfoKeyError, SpaceChangedError)


_OLD_GYM_FIX = (
    "wrap the env with shimmy's GymV21CompatibilityV0, gymnasium.make('GymV21Environment-v0', env=...) with "
    "pip install 'shimmy[gym-v21]', or update it"
)
_OLD_GYM_HINT = f"this looks like the old gym API ({_OLD_GYM_FIX})"


class _ResetSignatureError(TypeError):
    """The env's reset cannot be called as gymnasium calls it, ``reset(seed=..., options=...)``: Python's own
    "reset() got an unexpected keyword argument 'seed'" named (see :func:`_reset_signature_error`). A TypeError, named
    so in the env's error record; logged without a traceback (it would show the call, not the env)."""


_GYMNASIUM_RESET = ("seed", "options")
"""The keyword arguments gymnasium's reset takes, and its vector envs and wrappers pass every time."""


def _lacking_keywords(reset: Any) -> list[str]:
    """Which of :data:`_GYMNASIUM_RESET` ``reset`` (a bound method) cannot take as keywords; none where its signature
    cannot be read (a builtin's, say)."""
    try:
        parameters = inspect.signature(reset).parameters.values()
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return []
    named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return [name for name in _GYMNASIUM_RESET if name not in named]


def _reset_misfit(env: gym.Env[Any, Any]) -> tuple[str, Any, list[str]] | None:
    """The outermost of ``env`` and the envs it wraps whose reset cannot take gymnasium's keywords, as ``(the name of
    its class, its reset's code, the keywords it lacks)``; None where every reset takes them."""
    layer: Any = env
    while layer is not None:
        reset = getattr(type(layer), "reset", None)
        if callable(reset):
            lacking = _lacking_keywords(layer.reset)
            if lacking:
                # (a decorated reset's own code, not its decorator's)
                code = getattr(inspect.unwrap(reset), "__code__", None)
                return type(layer).__qualname__, code, lacking
        layer = layer.env if isinstance(layer, gym.Wrapper) else None
    return None


def _reset_signature_error(err: BaseException, misfit: tuple[str, Any, list[str]] | None) -> BaseException:
    """``err``, raised by resetting an env whose reset ``misfit`` (see :func:`_reset_misfit`) cannot take gymnasium's
    keywords, as the _ResetSignatureError saying so where it is Python's own error of that call's binding (a TypeError
    raised before that reset's code ran: it is no frame of ``err``'s traceback); else ``err`` as it is."""
    # ("got an unexpected keyword argument 'seed'"; for a positional-only seed, "got some positional-only arguments
    # passed as keyword arguments: 'seed'")
    if misfit is None or type(err) is not TypeError or "keyword argument" not in str(err):
        return err
    name, code, lacking = misfit
    if not any(repr(word) in str(err) for word in lacking):  # (another keyword's error: an outer wrapper's, say)
        return err
    if code is not None and any(frame.f_code is code for frame, _ in traceback.walk_tb(err.__traceback__)):
        return err  # (that reset ran: the TypeError is its own, raised inside it)
    words = " and ".join(repr(word) for word in lacking)
    message = (
        f"{name}.reset() does not take the keyword argument{'s' if len(lacking) > 1 else ''} {words}: gymnasium calls "
        "reset(seed=..., options=...), its signature is reset(self, *, seed=None, options=None)"
    )
    if "seed" in lacking:  # (gym's reset before 0.22, which took no seed: the old API)
        message += f"; {_OLD_GYM_HINT}"
    named = _ResetSignatureError(message)
    named.__cause__ = err
    return named


def _what(value: Any) -> str:
    """``value`` as the start of "returned ...": "None", "an ndarray of shape (2,)", "a list of length 3", "a float"."""
    if value is None:
        return "None"
    name = type(value).__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    if isinstance(value, np.ndarray):
        return f"an ndarray of shape {value.shape}"
    if isinstance(value, tuple | list):
        return f"{article} {name} of length {len(value)}"
    return f"{article} {name}"


def _kind(value: Any) -> str:
    """ "None", or "of type list": what came, in a few words."""
    return "None" if value is None else f"of type {type(value).__name__}"


def _unpacked_reset(result: Any, space: gym.Space[Any]) -> tuple[Any, Any]:
    """``(obs, info)`` of what an env's reset returned; _UnstorableStep where it is no such pair: an old gym env's
    observation alone (whose unpacking took an observation of shape (2,) for obs and info silently), or an info
    that is no dict (which fails the whole batch in the vector env). ``space``: the env's observation space, where
    a pair whose info is no dict may be an old gym env's observation alone (of a Tuple of two spaces, say)."""
    if not (isinstance(result, tuple) and len(result) == 2) and not (
        isinstance(result, list) and len(result) == 2 and isinstance(result[1], dict)
    ):
        raise _UnstorableStep(
            f"reset() returned {_what(result)}, not a tuple (obs, info): gymnasium's Env API (0.26+) has reset return "
            f"(obs, info); {_OLD_GYM_HINT}"
        )
    obs, info = result
    if not isinstance(info, Mapping) and _may_be_observation(result, space):
        raise _UnstorableStep(
            f"reset() returned info {_kind(info)}: expected a dict (gymnasium's (obs, info)); if the env uses the "
            f"old gym API (its reset returning the observation alone, here {_shown(result)}), {_OLD_GYM_FIX}"
        )
    return obs, _as_info(info, "reset() returned info {}: expected a dict (gymnasium's (obs, info))")


def _may_be_observation(result: Any, space: gym.Space[Any]) -> bool:
    """Whether ``result``, a pair reset returned, may be an observation of ``space`` alone: ``space`` is a Tuple of
    two spaces, or holds ``result`` (a Box of shape (2,) a tuple of 2 numbers, say)."""
    if isinstance(space, gym.spaces.Tuple) and len(space.spaces) == 2:
        return True
    try:
        with warnings.catch_warnings():  # (a Box's "Casting input x to numpy array")
            warnings.simplefilter("ignore")
            return bool(space.contains(result))
    except Exception:  # (a space that cannot even look at it: no observation of it)
        return False


def _as_info(info: Any, message: str) -> dict[str, Any]:
    """``info`` as a dict (a Mapping copied into one, as gymnasium's vector envs take it); _UnstorableStep with
    ``message``, formatted with what came, where it is none."""
    if isinstance(info, dict):
        return info
    if isinstance(info, Mapping):
        return dict(info)
    raise _UnstorableStep(message.format(_kind(info)))


def _unpacked_step(result: Any) -> tuple[Any, Any, Any, Any, Any]:
    """``(obs, reward, terminated, truncated, info)`` of what an env's step returned; _UnstorableStep where it is
    no such 5-tuple (an old gym env's 4 values, say) or its info is no dict."""
    if not isinstance(result, tuple | list):
        raise _UnstorableStep(
            f"step() returned {_what(result)}: expected a tuple of 5 (obs, reward, terminated, truncated, info)"
        )
    if len(result) == 4:
        raise _UnstorableStep(
            "step() returned 4 values (obs, reward, done, info: the old gym API): expected 5 (obs, reward, "
            f"terminated, truncated, info); {_OLD_GYM_HINT}"
        )
    if len(result) != 5:
        raise _UnstorableStep(
            f"step() returned {len(result)} values: expected 5 (obs, reward, terminated, truncated, info)"
        )
    info = _as_info(
        result[4], "step() returned info {}: expected a dict (gymnasium's (obs, reward, terminated, truncated, info))"
    )
    return result[0], result[1], result[2], result[3], info


def _shown(value: Any) -> str:
    """``value`` as an error names it: its type (and shape and dtype, for an array), with a short repr."""
    if value is None:
        return "None"
    if isinstance(value, np.ndarray):
        return f"of type ndarray, shape {value.shape}, dtype {value.dtype}"
    text = repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{text} of type {type(value).__name__}"


def _check_reward(reward: Any) -> None:
    """TypeError naming ``reward`` where it is no real number that fits a float64: what a gymnasium vector env
    stores in its rewards array (else it fails there, outside the env's isolation: "setting an array element
    with a sequence" for a 1-element array, an OverflowError for 10**400, a TypeError for a complex) or stores
    without a word what is none (None becomes NaN, "1.0" becomes 1.0). A Python int, float or bool, a numpy real
    scalar, a 0-d real array (or what numpy makes one of: a 0-d tensor) are numbers; NaN and infinities are
    too (the learner's to judge: it names them)."""
    if type(reward) is float:  # (most envs': nothing to look at)
        return
    value: Any
    if isinstance(reward, _REAL_SCALARS):
        value = reward
    elif reward is None or isinstance(reward, str | bytes | complex | np.complexfloating):
        raise _UnstorableStep(f"step() returned reward {_shown(reward)}: expected a number (a float)")
    else:
        try:
            array = np.asarray(reward)
        except Exception:
            array = np.asarray(None)
        if array.shape != () or array.dtype.kind not in "biuf":
            raise _UnstorableStep(f"step() returned reward {_shown(reward)}: expected a number (a float)")
        value = array[()]
    # Only a Python int and a long double can be beyond a float64 (numpy's ints, and its floats of 8 bytes or
    # fewer, never are), and only a finite one that is (an infinite one is the learner's to name).
    too_large = False
    if type(value) is int:
        try:
            float(value)
        except OverflowError:
            too_large = True
    elif isinstance(value, np.floating) and value.dtype.itemsize > 8:
        too_large = bool(np.isfinite(value)) and bool(abs(value) > _FLOAT64_MAX)
    if too_large:
        raise _UnstorableStep(f"step() returned reward {_shown(reward)}, which does not fit a float64")


def _check_flag(name: str, flag: Any) -> None:
    """TypeError naming ``flag`` (``name``: "terminated" or "truncated") where it is no bool: a Python or numpy
    bool, a 0-d bool array, or an int 0 or 1 (which old envs return; a gymnasium vector env stores them as
    False and True). Not None (stored as False), NaN (True), 2, "no" (True) or a 1-element array, which a
    gymnasium vector env stores without a word as a flag the env most likely did not mean."""
    if type(flag) is bool or isinstance(flag, np.bool_):  # (the common case first)
        return
    if isinstance(flag, np.ndarray) and flag.shape == () and flag.dtype.kind in "biu":
        flag = flag[()]
    if isinstance(flag, np.bool_) or (isinstance(flag, int | np.integer) and flag in (0, 1)):
        return
    raise _UnstorableStep(f"step() returned {name} {_shown(flag)}: expected a bool")


def _describe(where: str, err: BaseException) -> str:
    text = " ".join(escape_surrogates(str(err)).split())  # (sent as info["env_error"])
    kind = "TypeError" if isinstance(err, _UnstorableStep | _ResetSignatureError) else type(err).__name__
    if not isinstance(err, _NAMED_AS_THEY_ARE):  # (asyncio.CancelledError, GeneratorExit, an env's own)
        kind += " (a BaseException the env raised)"
    message = f"{where}: {kind}: {text}" if text else f"{where}: {kind}"
    if any(sign in text for sign in _THREAD_BOUND):
        message += f" ({_ONE_THREAD_HINT})"
    return message if len(message) <= _MAX_MESSAGE else message[: _MAX_MESSAGE - 3] + "..."


# What envs bound to their thread fail with where the server runs their quick calls on its event loop, and
# what to do (env_server.service.one_thread).
_THREAD_BOUND = ("cannot be called from a running event loop", "SQLite objects created in a thread")
ONE_THREAD_KEY = "envfleet_one_thread"
"""An env's ``metadata`` key: True has the server make every call on its envs from one thread (see
env_server.service.one_thread)."""
_ONE_THREAD_HINT = (
    f"an env that needs every call from one thread: set metadata[{ONE_THREAD_KEY!r}] = True in its class, "
    "and the server makes them all from its env thread"
)


class IsolateErrors(gym.Wrapper[Any, Any, Any, Any]):
    """Turns exceptions of the wrapped env's ``step`` and ``reset``, and infos that use a reserved key, into
    ``info["env_error"]`` (see module doc).

    ``repeat_on_reset``: the reset after an error repeats its ``env_error``; True for a vector env with
    same-step autoreset (whose step's top-level infos are that reset's), False otherwise.
    ``ctrl_c``: a KeyboardInterrupt is a Ctrl-C (envs in a learner's process, where a second Ctrl-C
    aborts), raised, not the env's error (a server, whose signals raise none, takes it for the env's).
    """

    envfleet_position: tuple[int, int] | None = None
    """``(i, K)``: this env is env i of the K of the vector env that holds it, as its log lines name it ("env 2
    of 4 raised in step"); None ("an env") until :func:`tell_positions` tells it. (A name no env of a user's is
    likely to have: gymnasium sets it on the outermost wrapper down that has it.)"""

    def __init__(self, env: gym.Env[Any, Any], *, repeat_on_reset: bool, ctrl_c: bool = False) -> None:
        super().__init__(env)
        self._repeat_on_reset = repeat_on_reset
        self._ctrl_c = ctrl_c
        # The spaces as built: what the vector env stacks (and the learner was told). An env that sets its own
        # anew later (in reset, say) is that env's error, named, not numpy's "Output array is the wrong shape";
        # this wrapper's stay the built ones (its placeholders, and the checks above it, use them).
        self._built_spaces = (env.observation_space, env.action_space)
        self.observation_space, self.action_space = self._built_spaces
        self._last_obs: Any = None
        # The call that returned _last_obs ("reset" or "step"; "" before any): with it, an observation
        # the vector env then fails to stack is named with the call that made it (env_server.envs).
        self._last_from = ""
        # The error that ended the current episode, reported again with the next reset's info
        # (with repeat_on_reset).
        self._pending: str | None = None
        # Why the env is out of order (its last reset raised), or None while it works.
        self._broken: str | None = None
        self.errors = 0
        """Exceptions caught so far (step and reset)."""
        # The env's reset that cannot take gymnasium's keywords (see _reset_misfit), looked for once: at the first
        # TypeError of a reset.
        self._reset_misfit: tuple[str, Any, list[str]] | None = None
        self._looked_for_misfit = False

    def name(self) -> str:
        """This env as log lines name it: "env 2 of 4", or "an env" while its position is unknown."""
        if self.envfleet_position is None:
            return "an env"
        index, count = self.envfleet_position
        return f"env {index} of {count}"

    @property
    def last_observation(self) -> tuple[Any, str]:
        """The last observation the wrapped env returned (None before any) and the call that returned it
        ("reset" or "step"): what the vector env stacked last for this env, unless a placeholder (which
        fits the space) stood in for it since."""
        return self._last_obs, self._last_from

    def _placeholder(self) -> Any:
        return self._last_obs if self._last_obs is not None else placeholder_observation(self.observation_space)

    def _check_spaces(self) -> None:
        """SpaceChangedError where the env's observation_space or action_space is not the one it was built with
        (an equal new one is fine). At each reset, where envs set theirs anew (some, equal ones, every time), not
        at each step: a space that is a property building a new one costs its env that much per call (~1 ms for
        a Box of frames), and an observation of another shape in a step is named as such anyway."""
        for which, built in zip(("observation_space", "action_space"), self._built_spaces, strict=True):
            now = getattr(self.env, which)
            if now is not built and now != built:
                who = "the env" if self.envfleet_position is None else f"env {self.envfleet_position[0]}"
                raise SpaceChangedError(
                    f"{who}'s {which} changed after it was built ({built} -> {now}); spaces must be set in "
                    "__init__ and stay fixed"
                )

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        if options is not None and NO_OPTIONS_KEY in options:
            options = None  # (a reset_mask reset that came with no options: see NO_OPTIONS_KEY)
        try:
            obs, info = _unpacked_reset(self.env.reset(seed=seed, options=options), self._built_spaces[0])
            _check_info(info)
            self._check_spaces()
        except _CAUGHT as err:
            if isinstance(err, TypeError) and not self._looked_for_misfit:
                self._reset_misfit, self._looked_for_misfit = _reset_misfit(self.env), True
            message = self._caught("reset", _reset_signature_error(err, self._reset_misfit))
            self._broken = message
            self._pending = None
            return self._placeholder(), {ENV_ERROR_KEY: message}
        if self._broken is not None:
            log.info("%s reset fine again; it was out of order", self.name())
            self._broken = None
        self._last_obs, self._last_from = obs, "reset"
        if self._pending is not None and self._repeat_on_reset:
            info = {**info, ENV_ERROR_KEY: self._pending}
        self._pending = None
        return obs, info

    def _caught(self, where: str, err: BaseException) -> str:
        """The error record of ``err``, caught in the env's ``where`` ("reset" or "step"), counted and logged (see
        _ErrorLog); raised on where it is a Ctrl-C (``ctrl_c``)."""
        if self._ctrl_c and isinstance(err, KeyboardInterrupt):
            raise err
        self.errors += 1
        message = _describe(where, err)
        # (a reset's error again, of an env out of order, is no new one)
        if _error_log.one_by_one(self.name(), message, new=where != "reset" or self._broken is None):
            then = "it is out of order until a reset works" if where == "reset" else "its episode ends and it is reset"
            if isinstance(err, _RETURNED):
                unusable = "used" if where == "reset" else "stored"
                log.warning("%s's %s returned what cannot be %s: %s; %s", self.name(), where, unusable, err, then)
            elif isinstance(err, _ResetSignatureError):
                log.warning("%s's %s cannot be called: %s; %s", self.name(), where, err, then)
            else:
                log.warning("%s raised in %s; %s", self.name(), where, then, exc_info=err)
        return message

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        if self._broken is not None:
            message = f"out of order since {self._broken}"
            self._pending = message
            return self._placeholder(), 0.0, False, True, {ENV_ERROR_KEY: message}
        try:
            obs, reward, terminated, truncated, info = _unpacked_step(self.env.step(action))
            # (in here, so that what a vector env cannot store costs this env's episode only, named)
            _check_reward(reward)
            _check_flag("terminated", terminated)
            _check_flag("truncated", truncated)
            if info:
                _check_info(info)
        except _CAUGHT as err:
            message = self._caught("step", err)
            self._pending = message
            return self._placeholder(), 0.0, False, True, {ENV_ERROR_KEY: message}
        self._last_obs, self._last_from = obs, "step"
        return obs, reward, terminated, truncated, info


def env_returned(record: str) -> bool:
    """Whether the error record ``record`` (``"<where>: <Type>: <message>"``) is of something the env returned
    (one of :data:`_RETURNED`, an _UnstorableStep recorded as the TypeError it is), not of an exception it raised."""
    where, _, rest = record.partition(": ")
    kind, _, text = rest.partition(": ")
    named = {error.__name__ for error in _RETURNED if error is not _UnstorableStep}
    return kind in named or (kind == "TypeError" and text.startswith(f"{where}() returned"))


def error_phrase(record: str) -> str:
    """What an env did, for a learner's message "env 3 <phrase>", of its error record ``record`` (``info["env_error"]``,
    ``"<where>: <Type>: <message>"``): "raised in step: ValueError: boom", but "returned in step what cannot be used:
    TypeError: step() returned reward None: ..." where the env returned something unusable (it raised nothing), and
    "is out of order since reset: ..." for an env whose reset failed."""
    if record.startswith("out of order since "):
        return f"is {record}"
    where, _, rest = record.partition(": ")
    return f"returned in {where} what cannot be used: {rest}" if env_returned(record) else f"raised in {record}"


def tell_positions(vector_env: gym.vector.VectorEnv) -> None:
    """Tell each env of ``vector_env``, a gymnasium SyncVectorEnv or AsyncVectorEnv (wrapped or not) whose envs
    are wrapped in IsolateErrors, its place in it (:attr:`IsolateErrors.envfleet_position`), for its log lines;
    nothing for another kind (a vector entry point's own: no IsolateErrors). Told once its envs are built, as
    gymnasium builds them from factories that take no index (under async vectorization, in worker processes:
    a message to each)."""
    base = vector_env.unwrapped
    if isinstance(base, gym.vector.SyncVectorEnv | gym.vector.AsyncVectorEnv):
        base.set_attr("envfleet_position", [(i, base.num_envs) for i in range(base.num_envs)])
