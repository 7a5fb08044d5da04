"""RemoteVecEnv: env servers as one Stable-Baselines3 ``VecEnv``, in place of ``SubprocVecEnv``.

Needs stable-baselines3 (``pip install 'envfleet[sb3]'``); ``import learner`` does not import it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from copy import deepcopy
from typing import Any

import gymnasium as gym
import numpy as np

try:
    from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvIndices, VecEnvObs, VecEnvStepReturn
except ImportError as err:  # (an optional dependency: say which extra brings it)
    raise ImportError(
        "learner.sb3 (RemoteVecEnv) needs stable-baselines3, which is not installed: "
        "pip install 'envfleet[sb3]' (from a clone: pip install -e '.[sb3]')"
    ) from err

from learner.errors import EnvFleetError, InvalidArgumentError, ServerUnavailableError, SpecMismatchError
from learner.remote import RemoteVectorEnv

__all__ = ["RemoteVecEnv"]

log = logging.getLogger(__name__)

# What get_attr answers here, without asking a server (the rest is refused, see _BY_NAME).
_LOCAL_ATTRS = ("render_mode", "observation_space", "action_space", "metadata", "spec")

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
    ``DummyVecEnv``'s are float32).

    Autoreset. Servers under ``--autoreset-mode SameStep`` reset an ended env in the step itself,
    which is SB3's form. Under the servers' default, ``NextStep`` (and ``Disabled``), a step in which
    envs ended is followed by a reset of those envs (a ``reset_mask`` reset, unseeded, as
    ``DummyVecEnv``'s autoreset): one more round trip on such steps, which ``SameStep`` servers save.
    That needs servers that honour ``reset_mask``, which an env's own vectorized implementation
    (``--vectorization vector_entry_point``) may not (gymnasium's CartPole one resets all its envs):
    such servers are refused unless they reset in the same step.

    By name: SB3's ``get_attr`` / ``set_attr`` / ``env_method`` would have a server read, set or call
    anything a request names, which envfleet does not allow. ``get_attr`` answers what is known here
    (``render_mode``: None, frames do not cross the wire; the single env's spaces; ``metadata``;
    ``spec``), ``env_is_wrapped`` is False for every env (SB3's wrappers never run on the servers;
    wrap this env in ``VecMonitor`` for episode statistics), and the rest raise ``AttributeError``
    naming the attribute or method and what to do instead (so ``has_attr`` is False for them).

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
        self._ever_reset = False
        # Fault-tolerant: the observation each unavailable env repeats (its last), for the step it
        # rejoins, which ends that stretch as a truncation (terminal_observation: this one).
        self._held: dict[int, Any] = {}
        super().__init__(remote.num_envs, remote.single_observation_space, remote.single_action_space)
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
                f"RemoteVecEnv: env server{'s' if len(missing) > 1 else ''} {', '.join(missing)} did not answer "
                "within connect_timeout, and SB3's vec env keeps the number of envs it starts with (nothing calls "
                "refresh(), which would take them in later): start them first, or raise connect_timeout",
                address=missing[0],
            )
        if remote.metadata["autoreset_mode"] is not gym.vector.AutoresetMode.SAME_STEP:
            servers = _unmasked(remote)
            if servers:
                raise SpecMismatchError(
                    f"RemoteVecEnv: env server{'s' if len(servers) > 1 else ''} {', '.join(servers)} step their envs "
                    f"with --vectorization vector_entry_point under --autoreset-mode "
                    f"{remote.metadata['autoreset_mode'].value}: SB3 needs an ended env reset in its step, which "
                    "takes a reset of those envs alone (reset_mask), and an env's own vectorized implementation "
                    "may reset all of its envs instead; serve them with --autoreset-mode SameStep (if the "
                    "implementation has it) or --vectorization sync"
                )

    # -- SB3's VecEnv API ---------------------------------------------------------------------------

    def reset(self) -> VecEnvObs:
        """Reset every env with the seeds of :meth:`seed` and the options of :meth:`set_options` (once)."""
        self._drain()
        self._held.clear()
        seeds, options = list(self._seeds), self._options
        groups: list[tuple[dict[str, Any], list[int]]] = []  # envs with equal options reset together
        for i, env_options in enumerate(options):
            group = next((g for g in groups if g[0] == env_options), None)
            if group is None:
                groups.append((env_options, [i]))
            else:
                group[1].append(i)
        if len(groups) == 1:
            obs, infos = self.remote.reset(seed=_or_none(seeds), options=groups[0][0] or None)
            self.reset_infos = [_env_info(infos, i) for i in range(self.num_envs)]
        else:
            # Options differ between envs (set_options with a list): one reset_mask reset per options.
            if _unmasked(self.remote):
                raise InvalidArgumentError(
                    "set_options: different options per env need resets of some envs alone (reset_mask), which "
                    "servers of --vectorization vector_entry_point may not do; give every env the same options"
                )
            if not self._ever_reset:  # (a server takes a reset_mask only once all its envs were reset)
                self.remote.reset(seed=_or_none(seeds))
            for env_options, members in groups:
                mask = np.zeros(self.num_envs, dtype=np.bool_)
                mask[members] = True
                group_seeds = [s if m else None for s, m in zip(seeds, mask, strict=True)]
                obs, infos = self.remote.reset(seed=_or_none(group_seeds), options={**env_options, "reset_mask": mask})
                for i in members:
                    self.reset_infos[i] = _env_info(infos, i)
        self._ever_reset = True
        self._reset_seeds()
        self._reset_options()
        return obs

    def step_async(self, actions: np.ndarray) -> None:
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
                info["terminal_observation"] = final_obs if final_obs is not None else _obs_at(obs, i)
                self.reset_infos[i] = top
                env_infos[i] = info
        elif ended:
            # Next-step (or no) autoreset: reset the ended envs now, as DummyVecEnv does (unseeded). A
            # server that joined since (a reconnect, refresh()) may not take a mask: checked again.
            self._check(self.remote)
            for i in ended:
                env_infos[i]["terminal_observation"] = _obs_at(obs, i)
            obs, reset_infos = self.remote.reset(options={"reset_mask": dones.copy()})
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
            env_infos[i] = {"env_unavailable": True, "terminal_observation": held, "TimeLimit.truncated": True}
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
        if attr_name not in _LOCAL_ATTRS:
            answered = f"Answered here: {', '.join(_LOCAL_ATTRS)}. {_READ_INSTEAD}"
            raise AttributeError(_BY_NAME.format(call=f"get_attr({attr_name!r})", instead=answered))
        value: Any
        if attr_name == "render_mode":
            value = None  # (frames do not cross the wire: the served envs render nothing here)
        elif attr_name == "observation_space":
            value = self.remote.single_observation_space
        elif attr_name == "action_space":
            value = self.remote.single_action_space
        elif attr_name == "metadata":
            value = {k: v for k, v in self.remote.metadata.items() if k != "autoreset_mode"}
        else:
            value = self.remote.spec
        return [deepcopy(value) for _ in self._get_indices(indices)]

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        """Refused (``AttributeError``): a server sets nothing by name; reset options change an env's parameters."""
        raise AttributeError(_BY_NAME.format(call=f"set_attr({attr_name!r}, ...)", instead=_CHANGE_INSTEAD))

    def env_method(
        self, method_name: str, *method_args: Any, indices: VecEnvIndices = None, **method_kwargs: Any
    ) -> list[Any]:
        """Refused (``AttributeError``): a server calls nothing by name."""
        raise AttributeError(
            _BY_NAME.format(call=f"env_method({method_name!r}, ...)", instead=f"{_READ_INSTEAD}. {_CHANGE_INSTEAD}")
        )

    def env_is_wrapped(
        self, wrapper_class: type[gym.Wrapper[Any, Any, Any, Any]], indices: VecEnvIndices = None
    ) -> list[bool]:
        """False for every env: the servers' envs are out of reach, and SB3's own wrappers (``Monitor``,
        ``AtariWrapper``) never run there (the servers apply the operator's ``--wrappers``, gymnasium's;
        wrap this VecEnv in ``VecMonitor`` for episode statistics)."""
        return [False for _ in self._get_indices(indices)]

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


def _obs_at(batch: VecEnvObs, i: int) -> Any:
    """Env ``i``'s observation from a batch (arrays, or dicts and tuples of them), copied."""
    if isinstance(batch, Mapping):
        return {key: _obs_at(value, i) for key, value in batch.items()}
    if isinstance(batch, tuple):
        return tuple(_obs_at(value, i) for value in batch)
    single = batch[i]
    return single.copy() if isinstance(single, np.ndarray) else single  # (a numpy scalar is immutable)
