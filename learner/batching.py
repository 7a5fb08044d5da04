"""Splitting a fleet-wide batch into per-server slices, and joining per-server results back."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["merge_infos", "slice_batch", "write_batch"]


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Envs ``start:stop`` of a batch laid out like a batched space (arrays, dicts, tuples)."""
    if isinstance(batch, dict):
        return {k: slice_batch(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, tuple):
        return tuple(slice_batch(v, start, stop) for v in batch)
    return batch[start:stop]


def write_batch(out: Any, part: Any, start: int, where: str = "observations") -> None:
    """Copy one server's batch into envs ``start:`` of the preallocated fleet-wide batch ``out``."""
    if isinstance(out, dict):
        if not isinstance(part, dict) or part.keys() != out.keys():
            raise ValueError(f"{where}: expected a dict with keys {list(out)}, got {type(part).__name__}")
        for key, value in out.items():
            write_batch(value, part[key], start, f"{where}[{key!r}]")
    elif isinstance(out, tuple):
        if not isinstance(part, tuple) or len(part) != len(out):
            raise ValueError(f"{where}: expected a tuple of {len(out)}, got {type(part).__name__}")
        for i, (o, p) in enumerate(zip(out, part, strict=False)):
            write_batch(o, p, start, f"{where}[{i}]")
    else:
        part = np.asarray(part)
        stop = start + len(part)
        if part.shape[1:] != out.shape[1:] or stop > len(out):
            raise ValueError(f"{where}: expected envs of shape {out.shape[1:]}, got a batch of shape {part.shape}")
        out[start:stop] = part


def merge_infos(parts: list[tuple[dict[str, Any], int, int]], num_envs: int) -> dict[str, Any]:
    """Join per-server vector infos into one for ``num_envs`` envs.

    ``parts`` holds ``(infos, start, count)`` per server. As in gymnasium's ``VectorEnv._add_info``,
    each value is an array over envs (zeros, or None for object arrays, where a server lacks the key)
    and its ``_key`` mask says which envs have it; dicts nest.
    """
    out: dict[str, Any] = {}
    for infos, start, count in parts:
        _merge_into(out, infos, start, count, num_envs, "infos")
    return out


def _merge_into(out: dict[str, Any], infos: dict[str, Any], start: int, count: int, num_envs: int, where: str) -> None:
    for key, value in infos.items():
        path = f"{where}[{key!r}]"
        if isinstance(value, dict):
            sub = out.setdefault(key, {})
            if not isinstance(sub, dict):
                raise ValueError(f"{path}: a dict on one server but an array on another")
            _merge_into(sub, value, start, count, num_envs, path)
            continue
        if not isinstance(value, np.ndarray) or value.ndim == 0 or len(value) != count:
            raise ValueError(f"{path}: expected an array over this server's {count} envs, got {type(value).__name__}")
        target = out.get(key)
        if target is None:
            if value.dtype == object:
                target = np.full((num_envs, *value.shape[1:]), None, dtype=object)
            else:
                target = np.zeros((num_envs, *value.shape[1:]), dtype=value.dtype)
            out[key] = target
        elif not isinstance(target, np.ndarray) or target.shape[1:] != value.shape[1:]:
            raise ValueError(
                f"{path}: shapes differ between servers ({getattr(target, 'shape', None)} vs {value.shape})"
            )
        target[start : start + count] = value
