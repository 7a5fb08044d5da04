"""What a server's EnvSpec says of its env, as the learner reads it, and whether it fits a fleet's."""

from __future__ import annotations

import json
from typing import Any

import gymnasium as gym
from gymnasium.envs.registration import EnvSpec

from env_server import codec
from env_server.rpc import env_pb2 as pb

__all__ = ["FLEET_FIELDS", "gym_env_spec", "incompatible", "served_kwargs"]

FLEET_FIELDS = ("observation_space", "action_space", "autoreset_mode")
"""What every server of one fleet must agree on (their EnvSpec fields)."""


def incompatible(want: pb.EnvSpec, got: pb.EnvSpec, *, whose: str = "the fleet's", same_size: bool = False) -> str:
    """Why a server whose env has spec ``got`` cannot be in one fleet with one whose env has ``want``;
    "" if it can. The one check of a fleet's servers: when it is made, when one joins, when one comes back.

    The first of :data:`FLEET_FIELDS` that differs (with ``same_size``, for a server back in its old
    place, ``num_envs`` first), as "another <field> than <whose>: <got's> (<env id>), not <want's>
    (<env id>)"; ``whose`` names ``want``'s server ("the fleet's", "env server ADDRESS's"). A space that
    differs where both servers said their env kwargs and those differ too says so, naming both: kwargs can
    change an env's spaces (LunarLander's ``continuous``), and servers started with other ``--env-kwargs``
    (a typo in one, a variant meant for another fleet) looked like servers of another env.
    """
    for name in ("num_envs", *FLEET_FIELDS) if same_size else FLEET_FIELDS:
        if getattr(want, name) != getattr(got, name):
            kwargs = served_kwargs(got), served_kwargs(want)
            hint = ""
            if name.endswith("_space") and None not in kwargs and kwargs[0] != kwargs[1]:
                got_kwargs, want_kwargs = (json.dumps(k, sort_keys=True) for k in kwargs)
                hint = (
                    f" (its envs are made with env kwargs {got_kwargs}, {whose} with {want_kwargs}: the "
                    "env-server --env-kwargs they were started with may be what changed it)"
                )
            return (
                f"another {name} than {whose}: {_field_text(got, name)} ({got.env_id}), "
                f"not {_field_text(want, name)} ({want.env_id}){hint}"
            )
    return ""


def _field_text(spec: pb.EnvSpec, name: str) -> str:
    """One field of ``spec`` as a person reads it: a space as gymnasium prints it, a mode by its name."""
    value = getattr(spec, name)
    if name == "autoreset_mode":
        mode = codec.AUTORESET_FROM_PROTO.get(value)
        return str(mode.value) if mode is not None else f"mode {value}"
    if name.endswith("_space"):
        try:
            return repr(codec.decode_space(value, name))
        except Exception:  # (a space this learner cannot read: that it differs is still the point)
            return "a space this learner cannot read"
    return f"{value} envs" if name == "num_envs" else str(value)


def gym_env_spec(spec: pb.EnvSpec) -> EnvSpec | None:
    """A gymnasium EnvSpec for the served env: its id, time limit and (when registered here) reward
    threshold; no entry point or kwargs (the server made the env; ``make`` from it is not possible)."""
    try:
        registered = gym.spec(spec.env_id)
    except Exception:  # an entry point, or an id registered only on the server
        registered = None
    try:
        return EnvSpec(
            id=spec.env_id,
            entry_point=None,
            reward_threshold=None if registered is None else registered.reward_threshold,
            max_episode_steps=spec.max_episode_steps or None,
        )
    except Exception:  # an id gymnasium cannot parse: no spec, as for vector envs made of functions
        return None


def served_kwargs(spec: pb.EnvSpec) -> dict[str, Any] | None:
    """The kwargs a server's envs are made with (EnvSpec.env_kwargs), None when it does not say (older
    than the field, or not a JSON object)."""
    if not spec.HasField("env_kwargs"):
        return None
    if not spec.env_kwargs:
        return {}
    try:
        kwargs = json.loads(spec.env_kwargs)
    except ValueError:
        return None
    return kwargs if isinstance(kwargs, dict) else None
