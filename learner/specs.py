"""What a server's EnvSpec says of its env, as the learner reads it, and whether it fits a fleet's."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Mapping
from typing import Any

import gymnasium as gym
from google.protobuf import text_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from gymnasium.envs.registration import EnvSpec

from env_server import codec
from env_server.rpc import env_pb2 as pb

__all__ = ["FLEET_FIELDS", "gym_env_spec", "incompatible", "other_env_servers", "served_kwargs", "warn_if_other_env"]

# (the fleet's own lines, as connecting and membership log them: one logger for a fleet's servers)
log = logging.getLogger("learner.remote")

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
        wanted, given = getattr(want, name), getattr(got, name)
        if wanted != given and name.endswith("_space"):
            # (a server older than compact bounds sends full-shape ones where a newer one sends one value: compared,
            # and their differences said, in the compact form, where one server sent it and the other did not)
            compact = codec.compact_bounds(wanted), codec.compact_bounds(given)
            if compact[0] == compact[1]:
                continue
            if _sent_compact(wanted) != _sent_compact(given):
                wanted, given = compact
        if wanted != given:
            kwargs = served_kwargs(got), served_kwargs(want)
            hint = ""
            if name.endswith("_space") and None not in kwargs and kwargs[0] != kwargs[1]:
                got_kwargs, want_kwargs = (json.dumps(k, sort_keys=True) for k in kwargs)
                hint = (
                    f" (its envs are made with env kwargs {got_kwargs}, {whose} with {want_kwargs}: the "
                    "env-server --env-kwargs they were started with may be what changed it)"
                )
            got_text, want_text = _field_text(got, name), _field_text(want, name)
            if got_text == want_text:  # (gymnasium's text leaves out what differs: say what does)
                hint = f"{_wire_difference(given, wanted, name, whose)}{hint}"
            return f"another {name} than {whose}: {got_text} ({got.env_id}), not {want_text} ({want.env_id}){hint}"
    return ""


def _sent_compact(space: pb.Space) -> bool:
    """Whether ``space`` has a Box sent with compact bounds (its BoxSpace.shape set), in a Dict or Tuple too."""
    kind = space.WhichOneof("kind")
    if kind == "box":
        return bool(space.box.shape)
    if kind in ("tuple", "dict"):
        return any(_sent_compact(sub) for sub in getattr(space, kind).spaces)
    return False


def _wire_difference(got: Message, want: Message, name: str, whose: str) -> str:
    """Where spec field ``name`` of two servers differs, for fields that gymnasium prints the same (a
    MultiDiscrete's dtype; an integer Box with infinite bounds, said without its unbounded_below/above by
    servers older than them): the innermost fields that differ, up to three."""
    differences = _differences(got, want, name)
    shown = ", ".join(f"{path} (its: {mine}; {whose}: {theirs})" for path, mine, theirs in differences[:3])
    if len(differences) > 3:
        shown += f", and {len(differences) - 3} more"
    return (
        f" (the same as gymnasium prints them, but they differ {f'in {shown}' if shown else 'on the wire'}; "
        "servers of different envfleet versions may say one space differently: if so, run one version on all)"
    )


def _differences(got: Message, want: Message, path: str) -> list[tuple[str, str, str]]:
    """Where messages ``got`` and ``want`` differ: (the field's path from ``path``, got's value, want's) for
    each innermost field that does, in field order (a Tensor as a whole; a repeated field of messages entry by
    entry where both have as many). Fields this learner's proto does not have are not looked at."""
    found: list[tuple[str, str, str]] = []
    fields = {field.number: field for field, _ in (*got.ListFields(), *want.ListFields())}
    for _, field in sorted(fields.items()):
        where, mine, theirs = f"{path}.{field.name}", getattr(got, field.name), getattr(want, field.name)
        both = not field.has_presence or (got.HasField(field.name) and want.HasField(field.name))
        if mine == theirs and both:
            continue
        kind = field.message_type
        nested = kind is not None and kind is not pb.Tensor.DESCRIPTOR and not kind.GetOptions().map_entry
        if nested and not field.is_repeated and both:
            found += _differences(mine, theirs, where)
        elif nested and field.is_repeated and len(mine) == len(theirs):
            for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                found += _differences(a, b, f"{where}[{i}]")
        else:
            found.append((where, _value_text(got, field), _value_text(want, field)))
    return found


def _value_text(message: Message, field: FieldDescriptor) -> str:
    """Field ``field`` of ``message`` as a person reads it, short: "not set" where it is not; a Tensor's
    elements and dtype (a large one: its dtype and shape), the first 8 of a repeated field, else protobuf's
    text format (an enum by its name)."""
    if field.has_presence and not message.HasField(field.name):
        return "not set"
    value = getattr(message, field.name)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return repr(dict(value))
    if not field.is_repeated:
        return _one_value(field, value)
    shown = ", ".join(_one_value(field, v) for v in list(value)[:8])
    return f"[{shown}{', ...' if len(value) > 8 else ''}]"


def _one_value(field: FieldDescriptor, value: Any) -> str:
    if field.message_type is pb.Tensor.DESCRIPTOR:
        try:
            array = codec.decode_tensor(value)
        except Exception:  # (one this learner cannot read: as protobuf prints it)
            pass
        else:
            return (
                f"{json.dumps(array.tolist())} ({array.dtype})" if array.size <= 8 else f"{array.dtype} {array.shape}"
            )
    out = io.StringIO()
    text_format.PrintFieldValue(field, value, out, as_one_line=True)
    return out.getvalue()


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


def warn_if_other_env(want: pb.EnvSpec, got: pb.EnvSpec, address: str, whose: str) -> None:
    """Warn of a server whose env fits the fleet's spaces but is not the same env (another id, another
    time limit): allowed (variants of a task, one per server), but a mistake as often."""
    # (servers older than EnvSpec.env_kwargs said a time limit of 0 under async vectorization, whatever
    # it was: not compared then)
    known = [s for s in (got, want) if s.HasField("env_kwargs") or s.vectorization != "async"]
    differ = [
        f"{name} {getattr(got, name)!r}, not {whose} {getattr(want, name)!r}"
        for name in ("env_id", "max_episode_steps")
        if getattr(got, name) != getattr(want, name) and (name == "env_id" or len(known) == 2)
    ]
    kwargs, wanted = served_kwargs(got), served_kwargs(want)
    if kwargs is not None and wanted is not None and kwargs != wanted:  # (servers too old to say: not compared)
        differ.append(f"env kwargs {json.dumps(kwargs)}, not {whose} {json.dumps(wanted)}")
    if differ:
        log.warning(
            "env server %s serves another env than the rest (%s); its spaces fit, so it steps with them "
            "(RemoteVectorEnv.spec is the first server's)",
            address,
            "; ".join(differ),
        )
    # (python's patch level aside: the libraries an env's dynamics depend on; servers older than
    # EnvSpec.versions send none, and are not compared)
    other = sorted(
        f"{name} {got.versions[name]}, not {want.versions[name]}"
        for name in set(got.versions) & set(want.versions)
        if name != "python" and got.versions[name] != want.versions[name]
    )
    if other:
        log.warning(
            "env server %s runs other versions than %s (%s): the same env may behave otherwise there "
            "(RemoteVectorEnv.server_versions has every server's)",
            address,
            "it did before" if whose == "its old" else whose.removesuffix("'s"),
            "; ".join(other),
        )


def other_env_servers(env: str, served: Mapping[str, str]) -> str:
    """The servers of ``served`` (address -> the env it serves, in fleet order) that serve another env than
    ``env``, in words for an error: "the servers at A, B serve X" (several other envs: each with its
    servers, "; "-separated), then, where the rest serve ``env``, "(a mixed fleet: the server at C serves
    ENV)"; "" where every server serves ``env``. A fleet's servers need only fit one another's spaces
    (:func:`incompatible`), so an error that named the first server's env as the fleet's was false for the
    others (``--env`` of the second server's env: "expected the env the servers at A,B serve, X")."""
    by_env: dict[str, list[str]] = {}
    for address, env_id in served.items():
        by_env.setdefault(env_id, []).append(address)
    said = "; ".join(_serve(addresses, env_id) for env_id, addresses in by_env.items() if env_id != env)
    if said and env in by_env:
        said += f" (a mixed fleet: {_serve(by_env[env], env)})"
    return said


def _serve(addresses: list[str], env_id: str) -> str:
    """ "the server at A serves X", "the servers at A, B serve X"."""
    if len(addresses) == 1:
        return f"the server at {addresses[0]} serves {env_id}"
    return f"the servers at {', '.join(addresses)} serve {env_id}"
