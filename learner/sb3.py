"""RemoteVecEnv: env servers as one Stable-Baselines3 ``VecEnv``, in place of ``SubprocVecEnv``.

Needs stable-baselines3 (``pip install 'envfleet[sb3]'``); ``import learner`` does not import it.
"""

from __future__ import annotations

import contextlib
import logging
import operator
from collections.abc import Mapping, Sequence
from typing import Any, cast

import gymnasium as gym
import numpy as np

try:
    from stable_baselines3.common.monitor import Monitor
    from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvIndices, VecEnvObs, VecEnvStepReturn
except ImportError as err:  # (an optional dependency: say which extra brings it)
    raise ImportError(
        "learner.sb3 (RemoteVecEnv) needs stable-baselines3, which is not installed: "
        "pip install 'envfleet[sb3]' (from a clone: pip install -e '.[sb3]'; it needs torch: on a CPU-only machine, "
        "install the small CPU build first, pip install torch --index-url https://download.pytorch.org/whl/cpu)"
    ) from err

from env_server import codec
from env_server.rpc import env_pb2 as pb
from learner.errors import EnvFleetError, InvalidArgumentError, ServerUnavailableError, SpecMismatchError
from learner.local import label_of
from learner.remote import ANSWERED_HERE, RemoteVectorEnv

__all__ = ["RemoteVecEnv"]

log = logging.getLogger(__name__)

# Top-level infos keys of RemoteVectorEnv's own (fault-tolerant: envs whose step was no transition;
# an env's exception, isolated by its server): under same-step autoreset, where an ended env's
# top-level infos are its new episode's reset info, they go with the step's info too; env_unavailable
# leaves the reset info (env_error stays: the server repeats it there on purpose, env_server.isolation).
_FLEET_KEYS = ("env_unavailable", "env_error")

_BY_NAME = (
    "RemoteVecEnv.{call}: the envs run on env servers, and no request may make a server read, set or "
    "call anything by name (a server runs only what its operator chose). {instead}"
)
_READ_INSTEAD = (
    "Have the env put what you need in its step or reset infos (infos[i] from step(), reset_infos[i]), "
    "or ask the servers' operator for an env or wrapper that does"
)
_CHANGE_INSTEAD = (
    "To change an env's parameters at run time, pass them as reset options: vec_env.set_options({...}) "
    "(one dict for every env, or a list of one per env), then vec_env.reset() hands them to each env's "
    "reset(options=...) (that reset only: the autoresets after it pass none, as in SB3's own VecEnvs); "
    "or serve the env with other --env-kwargs"
)


class RemoteVecEnv(VecEnv):
    """A :class:`~learner.remote.RemoteVectorEnv` (a fleet of env servers) as a Stable-Baselines3 ``VecEnv``.

    Swap it in for ``SubprocVecEnv`` / ``DummyVecEnv``::

        from stable_baselines3 import PPO
        from stable_baselines3.common.vec_env import VecMonitor
        from learner.sb3 import RemoteVecEnv

        vec_env = VecMonitor(RemoteVecEnv(["10.0.0.5:50051", "10.0.0.6:50051"]))  # was SubprocVecEnv([...])
        model = PPO("MlpPolicy", vec_env, seed=0).learn(100_000)

    SB3's semantics, exactly as ``DummyVecEnv`` gives them for the same seeds and actions:
    ``step`` returns ``(obs, rewards, dones, infos)`` with ``dones = terminated | truncated`` and a
    list of one info dict per env; an env whose episode ended is reset in the same step, its
    observation is the new episode's first, ``infos[i]["terminal_observation"]`` holds the final one
    and ``reset_infos[i]`` the new episode's reset info; ``infos[i]["TimeLimit.truncated"]`` is
    ``truncated and not terminated``. ``reset()`` returns the observations only and uses the seeds
    of :meth:`seed` (env i gets ``seed + i``) and the options of :meth:`set_options` once. Info
    values come as Python scalars, arrays and dicts (they crossed the wire as arrays over envs).
    Rewards keep the servers' dtype (float64, as ``SubprocVecEnv`` gives for Python floats;
    ``DummyVecEnv``'s are float32). Dict observations come as SB3's ``MultiInputPolicy``,
    ``VecNormalize(norm_obs_keys=...)`` and ``VecFrameStack`` take them, each step's arrays its own; a
    Discrete or MultiDiscrete part of a non-zero ``start``, which SB3's policies cannot one-hot, is warned
    of by name when this is made.

    Autoreset. Servers under ``--autoreset-mode SameStep`` reset an ended env in the step itself,
    which is SB3's form. Under the servers' default, ``NextStep`` (and ``Disabled``), a step in which
    envs ended is followed by a reset of those envs (a ``reset_mask`` reset, unseeded, the envs'
    ``reset`` given ``options=None``, as ``DummyVecEnv``'s autoreset): one more round trip on such
    steps, which ``SameStep`` servers save. That needs servers that honour ``reset_mask``, which an
    env's own vectorized implementation (``--vectorization vector_entry_point``) may not (gymnasium's
    CartPole one resets all its envs): such servers are refused unless they reset in the same step.

    By name: SB3's ``get_attr`` / ``set_attr`` / ``env_method`` would have a server read, set or call
    anything a request names, which envfleet does not allow. ``get_attr`` answers what is known here
    (``render_mode``: None, frames do not cross the wire; the single env's spaces; ``metadata``;
    ``spec``), and the rest raise ``AttributeError`` naming the attribute or method and what to do
    instead (so ``has_attr`` is False for them). ``env_is_wrapped`` answers what the servers' specs
    tell (a time limit's ``TimeLimit``, their ``--wrappers``), False for SB3's ``Monitor`` (wrap this
    env in ``VecMonitor`` for episode statistics), and ``AttributeError`` for other wrappers, which
    an operator's env may or may not have. Indices out of range raise ``IndexError``, as in
    ``DummyVecEnv``.

    Failures are the fleet's: by default a server that fails raises, as ``RemoteVectorEnv`` does.
    With ``fault_tolerant=True`` a lost server's envs end their episodes as truncations
    (``dones[i]`` True, ``infos[i]["TimeLimit.truncated"]`` True, their last observation as
    ``terminal_observation``); while it is down they repeat that observation with reward 0 and
    ``dones[i]`` False, and the step they rejoin hands over a new episode's first observation
    (reward 0), ending that stretch as a truncation (``dones[i]`` True, the observation it repeated
    as ``terminal_observation``), so that no transition bootstraps across it. Every such step has ``infos[i]["env_unavailable"] = True``. SB3 has no way to leave
    a step out of its rollout, so PPO and A2C train on those few placeholder steps too;
    ``vec_env.remote.fault_stats().env_steps_lost`` counts them. ``VecMonitor`` counts a cut
    episode as one that ended, and the steps while its env is down in the next one's length.

    Args:
        envs: server addresses (a list, or one comma-separated string, as ``RemoteVectorEnv``
            takes them), or a ``RemoteVectorEnv`` to use (made with ``copy=True``, the default).
        **kwargs: ``RemoteVectorEnv``'s options (``timeout``, ``fault_tolerant``, ``auth_token``,
            ``tls``, ...), when ``envs`` are addresses.

    ``close()`` closes the ``RemoteVectorEnv`` too, whether given or made here; ``remote`` is it.
    """

    def __init__(self, envs: str | Sequence[str] | RemoteVectorEnv, /, **kwargs: Any) -> None:
        if isinstance(envs, RemoteVectorEnv):
            if kwargs:
                raise InvalidArgumentError(
                    f"RemoteVecEnv: options {sorted(kwargs)} are for making a RemoteVectorEnv from addresses; "
                    "this one is made already (pass its addresses instead, or make it with those options)"
                )
            remote, owned = envs, False
        else:
            if kwargs.get("copy") is False:
                raise InvalidArgumentError(_COPY_NEEDED.format(got="copy=False"))
            remote, owned = RemoteVectorEnv(envs, **kwargs), True
        try:
            self._check(remote)
        except BaseException:
            if owned:
                remote.close()
            raise
        self.remote = remote
        self._same_step = remote.metadata["autoreset_mode"] is gym.vector.AutoresetMode.SAME_STEP
        self._waiting = False
        # MultiBinary actions (SB3 samples them as floats, 0. and 1.) are cast to the space's dtype.
        self._binary_actions = _has_multi_binary(remote.single_action_space)
        # Fault-tolerant: the observation each unavailable env repeats (its last), for the step it
        # rejoins, which ends that stretch as a truncation (terminal_observation: this one).
        self._held: dict[int, Any] = {}
        super().__init__(remote.num_envs, remote.single_observation_space, remote.single_action_space)
        starts = [
            *_nonzero_starts(remote.single_observation_space, "observation"),
            *_nonzero_starts(remote.single_action_space, "action"),
        ]
        if starts:
            # (SB3 neither refuses nor shifts them: PPO fails later in torch's one_hot, or the servers refuse
            # its actions; DummyVecEnv and SubprocVecEnv fail the same way, so this warns and refuses nothing)
            log.warning(
                "RemoteVecEnv: %s start%s at a non-zero value, which SB3's policies do not take into account "
                "(its env checker warns of it; DummyVecEnv's envs fail alike): they one-hot a Discrete or "
                "MultiDiscrete observation as if it started at 0, so its values beyond n - 1 (a start above 0) or "
                'below 0 (a start below 0) fail in torch\'s one_hot ("Class values must be smaller than num_classes", '
                '"Class values must be non-negative"), and sample actions from 0 to n - 1, not from start to '
                "start + n - 1: those outside the space the servers refuse. Serve the env with a wrapper that shifts "
                "them to start at 0 (learner train takes such spaces as they are)",
                ", ".join(starts),
                "s" if len(starts) == 1 else "",
            )
        if not self._same_step:
            log.debug(
                "RemoteVecEnv: the servers' autoreset mode is %s; envs that end are reset with a reset_mask "
                "reset after their step (--autoreset-mode SameStep saves that round trip)",
                remote.metadata["autoreset_mode"].value,
            )

    @staticmethod
    def _check(remote: RemoteVectorEnv) -> None:
        if remote.closed:
            raise InvalidArgumentError("RemoteVecEnv: the RemoteVectorEnv given is closed")
        if not remote.copy:
            raise InvalidArgumentError(_COPY_NEEDED.format(got="a RemoteVectorEnv made with copy=False"))
        missing = remote.servers_not_joined
        held = remote._held_at_start()
        if held:  # (another learner holds it: no connect_timeout helps)
            raise held[0]
        if missing:
            raise ServerUnavailableError(
                f"RemoteVecEnv: env server{'s' if len(missing) > 1 else ''} {', '.join(map(label_of, missing))} did not answer "
                "within connect_timeout, and SB3's vec env keeps the number of envs it starts with (nothing calls "
                "refresh(), which would take them in later): start them first, or raise connect_timeout",
                address=missing[0],
            )
        if remote.metadata["autoreset_mode"] is not gym.vector.AutoresetMode.SAME_STEP:
            servers = _unmasked(remote)
            if servers:
                raise SpecMismatchError(
                    f"RemoteVecEnv: env server{'s' if len(servers) > 1 else ''} {', '.join(map(label_of, servers))} step their envs "
                    f"with --vectorization vector_entry_point under --autoreset-mode "
                    f"{remote.metadata['autoreset_mode'].value}: SB3 needs an ended env reset in its step, which "
                    "takes a reset of those envs alone (reset_mask), and an env's own vectorized implementation "
                    "may reset all of its envs instead; serve them with --autoreset-mode SameStep (if the "
                    "implementation has it) or --vectorization sync",
                    address=servers[0],
                )

    # -- SB3's VecEnv API ---------------------------------------------------------------------------

    def reset(self) -> VecEnvObs:
        """Reset every env with the seeds of :meth:`seed` and the options of :meth:`set_options` (once).

        An env whose options are None or empty gets ``options=None``, as under ``DummyVecEnv``."""
        groups = _option_groups(self._options, self.num_envs)  # (checked before anything is reset)
        self._drain()
        self._held.clear()
        seeds = list(self._seeds)
        if len(groups) == 1:
            obs, infos = self.remote.reset(seed=_or_none(seeds), options=groups[0][0])
            self.reset_infos = [_env_info(infos, i) for i in range(self.num_envs)]
        else:
            # Options differ between envs (set_options with a list): one reset_mask reset per options.
            if _unmasked(self.remote):
                raise InvalidArgumentError(
                    "set_options: different options per env need resets of some envs alone (reset_mask), which "
                    "servers of --vectorization vector_entry_point may not do; give every env the same options"
                )
            if self.remote._needs_full_reset():
                # A server takes a reset_mask only once all its envs were reset, and after a failed step
                # or reset (or a session that ended) only a full reset makes the fleet steppable: every
                # env first, with its seed and no options, which is all the envs without options need.
                obs, infos = self.remote.reset(seed=_or_none(seeds))
                self.reset_infos = [_env_info(infos, i) for i in range(self.num_envs)]
                groups = [group for group in groups if group[0] is not None]
            for env_options, members in groups:
                mask = np.zeros(self.num_envs, dtype=np.bool_)
                mask[members] = True
                group_seeds = [s if m else None for s, m in zip(seeds, mask, strict=True)]
                obs, infos = self.remote._reset_unset_options(mask, seed=_or_none(group_seeds), options=env_options)
                for i in members:
                    self.reset_infos[i] = _env_info(infos, i)
        self._reset_seeds()
        self._reset_options()
        return obs

    def set_options(self, options: Sequence[dict[str, Any] | None] | dict[str, Any] | None = None) -> None:
        """SB3's ``set_options``, checked here: one dict (or None) for every env, or a list of one dict or
        None per env (``InvalidArgumentError`` otherwise, the options set before kept). The next
        :meth:`reset` uses them; an env given None or ``{}`` gets ``options=None``."""
        if isinstance(options, Mapping) and not isinstance(options, dict):
            options = dict(options)
        per_env = list(options) if isinstance(options, list | tuple) else None
        _option_groups(per_env if per_env is not None else [options] * self.num_envs, self.num_envs)
        super().set_options(cast(Any, per_env if per_env is not None else options))  # (SB3 types a list of dicts only)

    def step_async(self, actions: np.ndarray) -> None:
        if self._binary_actions:  # (SB3's PPO and A2C sample MultiBinary actions as float32 0. and 1.)
            actions = _binary_as_integers(self.remote.single_action_space, actions)
        self.remote.step_async(actions)
        self._waiting = True

    def step_wait(self) -> VecEnvStepReturn:
        self._waiting = False
        obs, rewards, terminations, truncations, infos = self.remote.step_wait()
        dones = terminations | truncations
        env_infos = [_env_info(infos, i) for i in range(self.num_envs)]
        ended: list[int] = np.flatnonzero(dones).tolist()
        back = self._rejoined(infos, obs)
        if ended and self._same_step:
            # The servers reset ended envs in the step: the top-level infos of such an env are its
            # reset's; the step's own are in final_info, its last observation in final_obs.
            for i in ended:
                top = env_infos[i]
                final = top.pop("final_info", {})
                final_obs = top.pop("final_obs", None)
                info = dict(final) if isinstance(final, Mapping) else {}
                info.update((key, top[key]) for key in _FLEET_KEYS if key in top)
                top.pop("env_unavailable", None)
                last = final_obs if final_obs is not None else _obs_at(obs, i)
                info["terminal_observation"] = _as_single(last, self.observation_space)
                self.reset_infos[i] = top
                env_infos[i] = info
        elif ended:
            # Next-step (or no) autoreset: reset the ended envs now, as DummyVecEnv does (unseeded). A
            # server that joined since (a reconnect, refresh()) may not take a mask: checked again.
            self._check(self.remote)
            for i in ended:
                env_infos[i]["terminal_observation"] = _as_single(_obs_at(obs, i), self.observation_space)
            # (with no options: the envs' reset gets options=None, as DummyVecEnv's autoreset gives them)
            obs, reset_infos = self.remote._reset_unset_options(dones.copy())
            for i in ended:
                self.reset_infos[i] = _env_info(reset_infos, i)
        for i in range(self.num_envs):
            env_infos[i]["TimeLimit.truncated"] = bool(truncations[i] and not terminations[i])
        for i, held in back.items():
            # Its envs' stretch while their server was down ends here, as a truncation: their first
            # observations after it start new episodes (no transition bootstraps across the two).
            self.reset_infos[i] = {
                k: v for k, v in env_infos[i].items() if k not in ("env_rejoined", "TimeLimit.truncated")
            }
            terminal = _as_single(held, self.observation_space)
            env_infos[i] = {"env_unavailable": True, "terminal_observation": terminal, "TimeLimit.truncated": True}
            dones[i] = True
        return obs, rewards, dones, env_infos

    def _rejoined(self, infos: Mapping[str, Any], obs: VecEnvObs) -> dict[int, Any]:
        """Fault-tolerant: hold the observation of each env that is unavailable (the one it repeats);
        the envs that rejoin on this step, with the observation each held (its stretch's last)."""
        unavailable = infos.get("env_unavailable")
        if unavailable is None and not self._held:
            return {}
        rejoined = infos.get("env_rejoined")
        back = {}
        for i in range(self.num_envs):
            if rejoined is not None and rejoined[i]:
                back[i] = self._held.pop(i, None)
                if back[i] is None:  # (down since the first reset: nothing held) its own first observation
                    back[i] = _obs_at(obs, i)
            elif unavailable is not None and unavailable[i]:
                if i not in self._held:
                    self._held[i] = _obs_at(obs, i)
            else:
                self._held.pop(i, None)
        return back

    def close(self) -> None:
        """Release the servers' envs and close the connections (the RemoteVectorEnv's close)."""
        self._waiting = False
        self.remote.close()

    def get_images(self) -> Sequence[np.ndarray | None]:
        """One None per env: frames do not cross the wire (the envs have no render mode here)."""
        return [None] * self.num_envs

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        """What can be answered here (``render_mode``, the single env's spaces, ``metadata``, ``spec``),
        one per env; ``AttributeError`` for anything else (a server reads nothing by name)."""
        if attr_name not in ANSWERED_HERE:
            answered = f"Answered here: {', '.join(ANSWERED_HERE)}. {_READ_INSTEAD}"
            raise AttributeError(_BY_NAME.format(call=f"get_attr({attr_name!r})", instead=answered))
        values = self.remote.get_attr(attr_name)
        return [values[i] for i in self._checked(indices, "get_attr")]

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        """Refused (``AttributeError``): a server sets nothing by name; reset options change an env's parameters."""
        self._checked(indices, "set_attr")  # (an index out of range is an IndexError first, as in DummyVecEnv)
        raise AttributeError(_BY_NAME.format(call=f"set_attr({attr_name!r}, ...)", instead=_CHANGE_INSTEAD))

    def env_method(
        self, method_name: str, *method_args: Any, indices: VecEnvIndices = None, **method_kwargs: Any
    ) -> list[Any]:
        """Refused (``AttributeError``): a server calls nothing by name."""
        self._checked(indices, "env_method")  # (an index out of range is an IndexError first, as in DummyVecEnv)
        raise AttributeError(
            _BY_NAME.format(call=f"env_method({method_name!r}, ...)", instead=f"{_READ_INSTEAD}. {_CHANGE_INSTEAD}")
        )

    def env_is_wrapped(
        self, wrapper_class: type[gym.Wrapper[Any, Any, Any, Any]], indices: VecEnvIndices = None
    ) -> list[bool]:
        """Whether each env is wrapped in ``wrapper_class`` (or a subclass), as far as its server's spec
        tells; ``AttributeError`` where it does not, rather than a guess.

        The servers' envs are out of reach; their spec says which wrappers each env surely has: a
        ``TimeLimit`` when it has a time limit (``max_episode_steps``), and gymnasium's wrappers of the
        server's ``--wrappers`` (``atari``: ``AtariPreprocessing`` and ``FrameStackObservation``;
        ``clip-action``: ``ClipAction``; ``flatten``: ``FlattenObservation``). True where one of
        those is a ``wrapper_class``. False for every class on a server of ``--vectorization
        vector_entry_point`` (an env's own vectorized implementation: no per-env wrappers). Otherwise
        the operator's env may have wrappers of its own, which no spec lists:

        - SB3's ``Monitor`` (what ``evaluate_policy`` and ``VecMonitor`` ask): False. ``evaluate_policy``
          then counts episodes and returns from ``dones`` and rewards itself (warning that the env has
          no ``Monitor``; wrap this VecEnv in ``VecMonitor``, whose statistics it then reads), where True
          would have it wait for ``info["episode"]``, forever if the envs have no ``Monitor``.
        - Any other class: ``AttributeError``, saying so (``VecMonitor`` takes that for False too).
        """
        answers = []
        for i in self._checked(indices, "env_is_wrapped"):
            spec = self.remote._client_of(i).spec
            known, complete = _served_wrappers(spec)
            if any(issubclass(wrapper, wrapper_class) for wrapper in known):
                answers.append(True)
            elif complete or issubclass(wrapper_class, Monitor):
                answers.append(False)
            else:
                listed = ", ".join(w.__name__ for w in known) or "none"
                raise AttributeError(
                    f"RemoteVecEnv.env_is_wrapped({wrapper_class.__name__}): env {i}'s wrappers are out of reach "
                    f"(it runs on env server {label_of(self.remote._client_of(i).address)}), and its spec tells only of some "
                    f"({listed}): whether the operator's env is wrapped in {wrapper_class.__name__} is not known "
                    f"here. Have the env say what you need in its infos, or ask the servers' operator"
                )
        return answers

    def _checked(self, indices: VecEnvIndices, call: str) -> list[int]:
        """The envs ``indices`` names (SB3's forms: None for all, an int, or a sequence of ints), each
        counted from 0; ``IndexError`` for one out of range, as ``DummyVecEnv``'s list of envs gives
        (a negative one counts from the end there too)."""
        envs = []
        for index in self._get_indices(indices):
            try:
                i = operator.index(index)
            except TypeError:
                raise TypeError(
                    f"RemoteVecEnv.{call}: indices: expected ints, got {type(index).__name__} {index!r}"
                ) from None
            if not -self.num_envs <= i < self.num_envs:
                raise IndexError(
                    f"RemoteVecEnv.{call}: env index {i} is out of range: there are {self.num_envs} envs "
                    f"(0 to {self.num_envs - 1})"
                )
            envs.append(i % self.num_envs)
        return envs

    # -- the rest -------------------------------------------------------------------------------------

    def _drain(self) -> None:
        """A step in flight (step_async without step_wait) is waited for and dropped, as SB3's
        ``reset`` cancels it; a failure of it is left to the reset to meet."""
        if self._waiting:
            self._waiting = False
            with contextlib.suppress(EnvFleetError):
                self.remote.step_wait()

    def __enter__(self) -> RemoteVecEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteVecEnv({self.remote!r})"


_COPY_NEEDED = (
    "RemoteVecEnv: got {got}; SB3 keeps the observations a step returns (PPO's _last_obs) while it takes "
    "the next, which copy=False would overwrite: use copy=True (the default)"
)


# The gymnasium wrappers each of the servers' --wrappers puts around every env (env_server.envs.WRAPPERS).
_SERVER_WRAPPERS: dict[str, tuple[type[gym.Wrapper[Any, Any, Any, Any]], ...]] = {
    "atari": (gym.wrappers.AtariPreprocessing, gym.wrappers.FrameStackObservation),
    "clip-action": (gym.wrappers.ClipAction,),
    "flatten": (gym.wrappers.FlattenObservation,),
}


def _served_wrappers(spec: pb.EnvSpec | None) -> tuple[list[type[gym.Wrapper[Any, Any, Any, Any]]], bool]:
    """The wrapper classes a server's spec says each of its envs has, and whether those are all (only
    for an env's own vectorized implementation, which has no per-env wrappers): a ``TimeLimit`` for a
    time limit, gymnasium's wrappers of its ``--wrappers``."""
    if spec is None:
        return [], False
    if spec.vectorization == "vector_entry_point":
        return [], True
    known: list[type[gym.Wrapper[Any, Any, Any, Any]]] = []
    if spec.max_episode_steps > 0:
        known.append(gym.wrappers.TimeLimit)
    for name in spec.wrappers:
        known += _SERVER_WRAPPERS.get(name, ())
    return known, False


def _unmasked(remote: RemoteVectorEnv) -> list[str]:
    """The servers of ``remote`` that step an env's own vectorized implementation, which may ignore
    ``reset_mask`` and reset all its envs (gymnasium's CartPole one does)."""
    return [
        address
        for address, vectorization in zip(remote.addresses, remote.vectorizations, strict=True)
        if vectorization == "vector_entry_point"
    ]


def _or_none(seeds: list[int | None]) -> list[int | None] | None:
    return None if all(s is None for s in seeds) else seeds


def _option_groups(options: Any, num_envs: int) -> list[tuple[dict[str, Any] | None, list[int]]]:
    """The envs of each distinct options in ``options`` (SB3's ``_options``: one per env), in order:
    None for no options (None or ``{}``: the env's reset gets ``options=None``, as ``DummyVecEnv``'s).
    Options are told apart by their wire form (arrays compare by dtype, shape and values).
    ``InvalidArgumentError``, naming ``set_options``, unless there is one dict or None per env, each
    one that can be sent."""
    expected = f"expected one dict (or None) for every env, or a list of {num_envs} (one per env, each a dict or None)"
    if not isinstance(options, list | tuple):
        raise InvalidArgumentError(f"set_options: {expected}, got {type(options).__name__}")
    if len(options) != num_envs:
        raise InvalidArgumentError(f"set_options: {expected}, got a list of {len(options)}")
    groups: dict[bytes, tuple[dict[str, Any] | None, list[int]]] = {}
    for i, env_options in enumerate(options):
        if env_options is not None and not isinstance(env_options, Mapping):
            raise InvalidArgumentError(
                f"set_options: env {i}'s options: expected a dict or None, got {type(env_options).__name__}"
            )
        value = dict(env_options) if env_options else None
        key = b""
        if value is not None:
            if "reset_mask" in value:
                raise InvalidArgumentError(
                    f"set_options: env {i}'s options: the key 'reset_mask' is reserved (the envs are reset with "
                    "it, by gymnasium's vector envs on the servers and by this VecEnv); name the option otherwise"
                )
            try:
                # (keys sorted: equal dicts whose keys came in another order are one group, as == has them)
                encoded = codec.encode_value(_keys_sorted(value), pb.Value(), "options")
                key = b"o" + encoded.SerializeToString(deterministic=True)
            except codec.CodecError as err:  # (it names the option: "options['x']: ...")
                raise InvalidArgumentError(f"set_options: env {i}'s {err}") from None
        groups.setdefault(key, (value, []))[1].append(i)
    return list(groups.values())


def _keys_sorted(value: Any) -> Any:
    """``value`` with its dicts' keys (and those of the dicts in it) in sorted order, where they can be sorted."""
    if isinstance(value, Mapping):
        items = [(key, _keys_sorted(item)) for key, item in value.items()]
        with contextlib.suppress(TypeError):
            items.sort(key=lambda pair: pair[0])
        return dict(items)
    if type(value) in (list, tuple):
        return type(value)(_keys_sorted(item) for item in value)
    return value


def _nonzero_starts(space: gym.Space[Any], where: str) -> list[str]:
    """The Discrete and MultiDiscrete parts of ``space`` whose ``start`` is not 0, each said with where it is in the
    space (``observation['phase']: Discrete(2, start=1)``)."""
    if isinstance(space, gym.spaces.Dict):
        return [found for key, sub in space.spaces.items() for found in _nonzero_starts(sub, f"{where}[{key!r}]")]
    if isinstance(space, gym.spaces.Tuple):
        return [found for i, sub in enumerate(space.spaces) for found in _nonzero_starts(sub, f"{where}[{i}]")]
    if isinstance(space, gym.spaces.Discrete | gym.spaces.MultiDiscrete) and np.any(space.start != 0):
        return [f"{where}: {space}"]
    return []


def _has_multi_binary(space: gym.Space[Any]) -> bool:
    """Whether ``space`` is a MultiBinary space or a Dict or Tuple space holding one."""
    if isinstance(space, gym.spaces.Dict):
        return any(_has_multi_binary(sub) for sub in space.spaces.values())
    if isinstance(space, gym.spaces.Tuple):
        return any(_has_multi_binary(sub) for sub in space.spaces)
    return isinstance(space, gym.spaces.MultiBinary)


def _binary_as_integers(space: gym.Space[Any], actions: Any) -> Any:
    """``actions`` for ``space`` with float arrays of MultiBinary parts whose values are all 0 or 1 cast to
    the space's dtype (SB3 samples MultiBinary actions as float32 0. and 1.; the servers take integers,
    and refuse floats: other values are left for that error to name)."""
    if isinstance(space, gym.spaces.MultiBinary):
        if isinstance(actions, np.ndarray) and actions.dtype.kind == "f" and np.all((actions == 0) | (actions == 1)):
            return actions.astype(space.dtype)
        return actions
    if isinstance(space, gym.spaces.Dict) and isinstance(actions, Mapping):
        return {
            key: _binary_as_integers(space.spaces[key], value) if key in space.spaces else value
            for key, value in actions.items()
        }
    if isinstance(space, gym.spaces.Tuple) and isinstance(actions, tuple) and len(actions) == len(space.spaces):
        return tuple(_binary_as_integers(sub, value) for sub, value in zip(space.spaces, actions, strict=True))
    return actions


def _env_info(infos: Mapping[str, Any], i: int) -> dict[str, Any]:
    """Env ``i``'s info dict from gymnasium's vector infos (arrays over envs, ``_key`` masks saying
    which envs have ``key``, dicts nested the same way), as SB3's per-env infos are."""
    out: dict[str, Any] = {}
    for key, value in infos.items():
        if key.startswith("_") and key[1:] in infos:
            continue  # (a mask)
        mask = infos.get(f"_{key}")
        if mask is not None and not mask[i]:
            continue
        out[key] = _env_info(value, i) if isinstance(value, Mapping) else _item(value[i])
    return out


def _item(value: Any) -> Any:
    """An info value of one env as a local env gives it: numpy scalars as Python's, arrays copied
    (a row of the vector infos' array)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.copy()
    return value


def _as_single(obs: Any, space: gym.Space[Any]) -> Any:
    """One env's observation as ``terminal_observation`` gives it, whichever autoreset mode the servers
    have (the batch's row under next-step autoreset, the step's ``final_obs`` under same-step): as the
    observation space holds it, which is what ``DummyVecEnv`` passes on from an env that returns its
    observations so: arrays of the space's dtype (a float64 observation of a float32 Box cast, as the
    batch holds it), a Discrete one as a Python int (as gymnasium's Discrete envs return theirs), a
    Dict's as a dict, a Tuple's as a tuple."""
    if isinstance(space, gym.spaces.Dict) and isinstance(obs, Mapping):
        return {
            key: _as_single(value, space.spaces[key]) if key in space.spaces else value for key, value in obs.items()
        }
    if isinstance(space, gym.spaces.Tuple) and isinstance(obs, tuple | list) and len(obs) == len(space.spaces):
        return tuple(_as_single(value, sub) for value, sub in zip(obs, space.spaces, strict=True))
    if isinstance(space, gym.spaces.Discrete) and np.ndim(obs) == 0:
        return int(obs)
    if isinstance(space, gym.spaces.Box | gym.spaces.MultiDiscrete | gym.spaces.MultiBinary):
        return np.array(obs, dtype=space.dtype)
    return obs.copy() if isinstance(obs, np.ndarray) else obs


def _obs_at(batch: VecEnvObs, i: int) -> Any:
    """Env ``i``'s observation from a batch (arrays, or dicts and tuples of them), copied."""
    if isinstance(batch, Mapping):
        return {key: _obs_at(value, i) for key, value in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_obs_at(value, i) for value in batch)
    single = batch[i]
    return single.copy() if isinstance(single, np.ndarray) else single  # (a numpy scalar is immutable)
