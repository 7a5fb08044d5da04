"""Fleet-wide batches: split into per-server slices, joined back from their answers, laid out as spaces batch."""

from __future__ import annotations

import itertools
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import concatenate, create_empty_array

from env_server import codec
from env_server.envs import widened_dtype
from env_server.isolation import placeholder_observation
from env_server.rpc import env_pb2 as pb
from env_server.validation import InvalidActionError

__all__ = [
    "InfoPart",
    "as_arrays",
    "check_batch",
    "merge_infos",
    "placeholder_batch",
    "response_infos",
    "slice_batch",
    "split_groups",
    "write_batch",
]

InfoPart = tuple[dict[str, Any], int, int]
"""One server's vector infos, the index of its first env in the joined batch, and its number of envs."""


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Envs ``start:stop`` of a batch laid out like a batched space (arrays, dicts, tuples)."""
    if isinstance(batch, dict):
        return {k: slice_batch(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(slice_batch(v, start, stop) for v in batch)
    return batch[start:stop]


def check_batch(out: Any, part: Any, count: int, where: str = "observations") -> None:
    """Raise ValueError (naming ``where``) unless ``part`` is a batch of ``count`` envs laid out as the
    fleet-wide batch ``out`` is (the same dict keys and tuple lengths, arrays of the same shape per env)."""
    if isinstance(out, dict):
        if not isinstance(part, dict) or part.keys() != out.keys():
            got = f"keys {list(part)}" if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}: expected a dict with keys {list(out)}, got {got}")
        for key, value in out.items():
            check_batch(value, part[key], count, f"{where}[{key!r}]")
    elif isinstance(out, tuple):
        if not isinstance(part, tuple) or len(part) != len(out):
            raise ValueError(f"{where}: expected a tuple of {len(out)}, got {type(part).__name__}")
        for i, (o, p) in enumerate(zip(out, part, strict=True)):
            check_batch(o, p, count, f"{where}[{i}]")
    else:
        shape = getattr(part, "shape", None)
        if shape is None or shape != (count, *out.shape[1:]):
            raise ValueError(
                f"{where}: expected a batch of shape {(count, *out.shape[1:])} ({count} envs), got "
                f"{f'shape {shape}' if shape is not None else type(part).__name__}"
            )


def write_batch(out: Any, part: Any, start: int) -> None:
    """Copy one server's batch into envs ``start:`` of the preallocated fleet-wide batch ``out``: a plain
    copy, on the hot path; ``part`` has passed ``check_batch`` against ``out`` (or is a slice of it)."""
    if isinstance(out, dict):
        for key, value in out.items():
            write_batch(value, part[key], start)
    elif isinstance(out, tuple):
        for o, p in zip(out, part, strict=True):
            write_batch(o, p, start)
    else:
        out[start : start + len(part)] = part


def merge_infos(
    parts: list[InfoPart], num_envs: int, misfits: list[tuple[int, ValueError]] | None = None
) -> dict[str, Any]:
    """Join per-server vector infos into one for ``num_envs`` envs, as one server (or gymnasium's
    SyncVectorEnv) of all ``num_envs`` envs would have made them: whatever the layout (but for a None that a
    server's own vector env cast into a bool or int array: the 0 there, which gymnasium would have made nan).

    ``parts`` holds ``(infos, start, count)`` per server, in env order. As in gymnasium's
    ``VectorEnv._add_info``, each value is an array over envs (zeros, or None for object arrays, where a
    server lacks the key) and its ``_key`` mask says which envs have it; dicts nest. The first part
    with a key makes its array: that part's type (its first env's value's, as gymnasium makes it)
    and shape per env. Later parts' values go into it as gymnasium writes an env's value, but
    widened as servers widen them (``np.result_type``: a longer string or floats after ints widen
    it, never cut what is written; see env_server.envs.widened_dtype):

    - into a number array, an object array's values one by one, for the envs its mask has: None
      becomes nan in a float array, a scalar fills a row (gymnasium's casts); a part whose values
      cannot go in (a str in a number array) turns the key's array into an object array, if its
      shape per env is the part's;
    - into an object array of one item per env, a number array's values one by one: numpy scalars
      and rows (copies), None where its mask has no value.

    A part that does not fit (not arrays over its envs; a dict here, an array there; values that no
    such cast puts in; strings and numbers) raises ValueError naming the key; with ``misfits``, it
    is left out whole instead (nothing of it is written) and ``(its index in parts, the error)``
    appended.
    """
    out: dict[str, Any] = {}
    for index, (infos, start, count) in enumerate(parts):
        try:
            fitted = _check_part(out, infos, count, "infos")
        except ValueError as err:
            if misfits is None:
                raise
            misfits.append((index, err))
            continue
        _merge_into(out, fitted, start, count, num_envs)
    return out


def _check_part(out: dict[str, Any], infos: dict[str, Any], count: int, where: str) -> dict[str, Any]:
    """``infos`` (one server's, of ``count`` envs) as :func:`_merge_into` writes them into ``out``:
    itself, but for values that do not go into ``out``'s arrays by a plain copy (see
    :func:`_fitted`); ValueError if they cannot be merged at all."""
    fitted = infos
    for key, value in infos.items():
        path = f"{where}[{key!r}]"
        target = out.get(key)
        if isinstance(value, dict):
            if target is not None and not isinstance(target, dict):
                raise ValueError(f"{path}: a dict on this server but an array on another")
            inner: Any = _check_part(target or {}, value, count, path)
        else:
            if not isinstance(value, np.ndarray) or value.ndim == 0 or len(value) != count:
                what = f"shape {value.shape}" if isinstance(value, np.ndarray) else type(value).__name__
                raise ValueError(f"{path}: expected an array over this server's {count} envs, got {what}")
            if target is None:
                continue
            if isinstance(target, dict):
                raise ValueError(f"{path}: an array on this server but a dict on another")
            if value.dtype == target.dtype and value.shape[1:] == target.shape[1:]:
                continue  # (the common case: a plain copy)
            inner = _fitted(target, value, infos.get(f"_{key}"), path)
        if inner is not value:
            if fitted is infos:
                fitted = dict(infos)
            fitted[key] = inner
    return fitted


def _fitted(target: np.ndarray, value: np.ndarray, mask: Any, path: str) -> np.ndarray:
    """``value`` (one server's array for a key, of another dtype or shape per env than the fleet's
    ``target``) as an array that goes into ``target`` by a plain copy, after :func:`_merge_into`
    widens ``target`` to its dtype; ``mask``: the server's ``_key`` array (which envs have a value)."""
    shape = target.shape[1:]
    if target.dtype == object:
        if value.shape[1:] == shape and (value.dtype == object or shape):
            return value  # (as gymnasium writes an env's array into an object array's row)
        block = np.full((len(value), *shape), None, dtype=object)
        dtype = block.dtype
    elif value.dtype != object and value.shape[1:] == shape:
        try:
            widened_dtype(target.dtype, value.dtype)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"{path}: dtype {value.dtype} here cannot join dtype {target.dtype} before ({err})"
            ) from None
        return value
    else:
        dtype = target.dtype
        block = np.zeros((len(value), *shape), dtype=dtype)
    has = mask if isinstance(mask, np.ndarray) and mask.shape == (len(value),) else None
    for i, item in enumerate(value):
        if has is not None and not has[i]:
            continue  # (gymnasium's filler there: the server's is that of its own array's type)
        if isinstance(item, np.ndarray) and value.ndim > 1:
            item = item.copy()  # (a row: its own, writeable, as an env's array is)
        if dtype.kind != "O":  # (widened as servers widen their envs' values: env_server.envs._widen_infos)
            if isinstance(item, np.ndarray):
                here = item.dtype if item.shape == shape else None
            elif isinstance(item, bool | int | float | np.number | np.bool_) or (
                isinstance(item, str) and dtype.kind in "US"
            ):
                here = np.asarray(item).dtype
            else:
                here = None
            if here is not None and here != dtype:
                try:
                    wide = widened_dtype(dtype, here)
                except (TypeError, ValueError):
                    wide = dtype
                if wide != dtype:
                    block, dtype = block.astype(wide), wide
        try:
            block[i] = item
        except (TypeError, ValueError, OverflowError) as err:
            if dtype.kind != "O" and value.dtype == object and value.shape[1:] == shape:
                return value  # (no cast puts it in: the key's array becomes an object array)
            if value.dtype != object:
                raise ValueError(
                    f"{path}: shapes per env differ between servers ({value.shape[1:]} here, {shape} before)"
                ) from None
            what = f"a {type(item).__name__}" if not isinstance(item, np.ndarray) else f"an array of shape {item.shape}"
            raise ValueError(
                f"{path}: {what} here cannot go into an array of dtype {dtype} and shape {shape} per env "
                f"before ({type(err).__name__}: {err})"
            ) from None
    return block


def _merge_into(out: dict[str, Any], infos: dict[str, Any], start: int, count: int, num_envs: int) -> None:
    """Write ``infos`` (as :func:`_check_part` fitted them) into envs ``start:start + count`` of ``out``."""
    for key, value in infos.items():
        if isinstance(value, dict):
            _merge_into(out.setdefault(key, {}), value, start, count, num_envs)
            continue
        target = out.get(key)
        if target is None:
            if value.dtype == object:
                target = np.full((num_envs, *value.shape[1:]), None, dtype=object)
            else:
                target = np.zeros((num_envs, *value.shape[1:]), dtype=value.dtype)
            out[key] = target
        elif value.dtype != target.dtype and target.dtype != object:
            if value.dtype == object:  # (values no cast puts in: see _fitted)
                target = out[key] = _objects(target)
            else:
                wide = widened_dtype(target.dtype, value.dtype)  # (checked by _check_part)
                if wide != target.dtype:  # e.g. a longer string, or floats after ints: widen, keeping what is written
                    target = out[key] = target.astype(wide)
        target[start : start + count] = value


def _objects(array: np.ndarray) -> np.ndarray:
    """``array`` as an object array: of numpy scalars, as gymnasium's hold an env's, if one per env."""
    if array.ndim != 1:
        return array.astype(object)
    objects = np.empty(len(array), dtype=object)
    objects[:] = list(array)
    return objects


def split_groups(num_servers: int, num_groups: int) -> list[list[int]]:
    """Server indices of each of ``num_groups`` contiguous groups, as even as possible."""
    bounds = np.linspace(0, num_servers, num_groups + 1).round().astype(int)
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds)]


def as_arrays(space: gym.Space[Any], actions: Any, where: str) -> Any:
    """``actions`` laid out as ``space``'s batches are (dicts and tuples of arrays), leaves as arrays;
    what does not fit is left as it is, for check_actions to name. ``where``: how errors name it."""
    if isinstance(space, gym.spaces.Dict):
        if not isinstance(actions, dict):
            return actions
        return {
            k: as_arrays(space.spaces[k], v, f"{where}[{k!r}]") if k in space.spaces else v for k, v in actions.items()
        }
    if isinstance(space, gym.spaces.Tuple):
        if not isinstance(actions, tuple | list) or len(actions) != len(space.spaces):
            return actions
        return tuple(
            as_arrays(sub, a, f"{where}[{i}]") for i, (sub, a) in enumerate(zip(space.spaces, actions, strict=True))
        )
    if actions is None or isinstance(actions, str | bytes):  # (as an array: one object or string, of shape ())
        what = "None" if actions is None else f"a {type(actions).__name__} ({actions!r})"
        raise InvalidActionError(f"{where}: expected an array for {space} (one action per env), got {what}")
    try:
        return np.asarray(actions)
    except ValueError:  # ragged: check_actions names what came
        return actions


def response_infos(response: pb.StepResponse | pb.ResetResponse) -> dict[str, Any]:
    """A response's vector infos (an empty dict, the common case, without decoding)."""
    if not response.HasField("infos") or (response.infos.WhichOneof("kind") == "map" and not response.infos.map.keys):
        return {}
    infos = codec.decode_value(response.infos, "infos")
    if not isinstance(infos, dict):
        raise codec.CodecError(f"infos: expected a map, got {type(infos).__name__}")
    return infos


def placeholder_batch(space: gym.Space[Any], count: int) -> Any:
    """A batch of ``count`` observations of ``space`` that are members of it, for envs not reset yet
    (their server down when the fleet is reset): each the server's own placeholder
    (env_server.isolation.placeholder_observation: zeros where zero is in the space, else its lowest
    value). An agent that one-hot encodes ``obs - start`` must not meet a value outside the space."""
    batch = create_empty_array(space, count, fn=np.zeros)
    assert batch is not None
    return concatenate(space, [placeholder_observation(space)] * count, batch)
