"""Splitting a fleet-wide batch into per-server slices, and joining per-server results back."""

from __future__ import annotations

from typing import Any

import numpy as np

from env_server.envs import widened_dtype

__all__ = ["InfoPart", "check_batch", "merge_infos", "slice_batch", "write_batch"]

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
    """Join per-server vector infos into one for ``num_envs`` envs.

    ``parts`` holds ``(infos, start, count)`` per server. As in gymnasium's ``VectorEnv._add_info``,
    each value is an array over envs (zeros, or None for object arrays, where a server lacks the key)
    and its ``_key`` mask says which envs have it; dicts nest. The first part with a key sets its
    array's shape per env; its dtype is the one all parts with the key promote to (``np.result_type``:
    a longer string or floats after ints widen it, never cut what is written).

    A part that does not fit (not arrays over its envs, or a key whose shape or nesting differs from
    the parts before it, or whose dtype cannot be promoted with theirs: strings and numbers, say)
    raises ValueError naming the key; with ``misfits``, it is left out whole instead (nothing of it is
    written) and ``(its index in parts, the error)`` appended.
    """
    out: dict[str, Any] = {}
    for index, (infos, start, count) in enumerate(parts):
        try:
            _check_part(out, infos, count, "infos")
        except ValueError as err:
            if misfits is None:
                raise
            misfits.append((index, err))
            continue
        _merge_into(out, infos, start, count, num_envs)
    return out


def _check_part(out: dict[str, Any], infos: dict[str, Any], count: int, where: str) -> None:
    """Raise ValueError unless ``infos`` (one server's, of ``count`` envs) can be merged into ``out``."""
    for key, value in infos.items():
        path = f"{where}[{key!r}]"
        target = out.get(key)
        if isinstance(value, dict):
            if target is not None and not isinstance(target, dict):
                raise ValueError(f"{path}: a dict on this server but an array on another")
            _check_part(target or {}, value, count, path)
            continue
        if not isinstance(value, np.ndarray) or value.ndim == 0 or len(value) != count:
            what = f"shape {value.shape}" if isinstance(value, np.ndarray) else type(value).__name__
            raise ValueError(f"{path}: expected an array over this server's {count} envs, got {what}")
        if target is None:
            continue
        if isinstance(target, dict):
            raise ValueError(f"{path}: an array on this server but a dict on another")
        if target.shape[1:] != value.shape[1:]:
            raise ValueError(
                f"{path}: shapes per env differ between servers ({value.shape[1:]} here, {target.shape[1:]} before)"
            )
        if value.dtype != target.dtype:
            try:  # (the merge widens the key's array to the dtype both promote to)
                widened_dtype(target.dtype, value.dtype)
            except (TypeError, ValueError) as err:
                raise ValueError(
                    f"{path}: dtype {value.dtype} here cannot join dtype {target.dtype} before ({err})"
                ) from None


def _merge_into(out: dict[str, Any], infos: dict[str, Any], start: int, count: int, num_envs: int) -> None:
    """Write ``infos`` (checked by :func:`_check_part`) into envs ``start:start + count`` of ``out``."""
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
            wide = widened_dtype(target.dtype, value.dtype)  # (checked by _check_part)
            if wide != target.dtype:  # e.g. a longer string, or floats after ints: widen, keeping what is written
                target = out[key] = target.astype(wide)
        target[start : start + count] = value
