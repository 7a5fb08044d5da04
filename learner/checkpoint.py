"""Checkpoints: saving and loading a learner's state atomically, RNG states included (needs torch).

A checkpoint is a ``torch.save`` of plain containers, tensors, numbers and strings only, so it
loads with ``weights_only=True``: loading one never runs code from the file.
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from learner.rundir import BEST_CHECKPOINT, CHECKPOINTS, atomic_write, checkpoint_path, list_checkpoints

__all__ = [
    "capture_rng",
    "find_checkpoint",
    "load_checkpoint",
    "load_nets",
    "restore_rng",
    "save_best_checkpoint",
    "save_checkpoint",
]

FORMAT = 1


def load_nets(net: torch.nn.Module, state: dict[str, Any], what: str) -> None:
    """Load a checkpoint's ``state`` into ``net``, the policy this version builds for the checkpoint's
    spaces; ValueError (naming ``what``, the checkpoint) where they do not fit: nets of another layout
    (an older envfleet built an MLP for 2-d uint8 frames, which get the Nature CNN now), not torch's
    bare RuntimeError."""
    try:
        net.load_state_dict(state)
    except RuntimeError as err:
        detail = str(err).splitlines()[0]
        raise ValueError(
            f"{what}: its nets do not fit the policy this envfleet builds for its spaces ({detail}); it was "
            "probably written by an older version: evaluate or resume it with that version"
        ) from None


def capture_rng() -> dict[str, Any]:
    """The state of every RNG training draws from: Python's, NumPy's global one, torch's CPU and CUDA ones."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos)},
        "numpy_gauss": (int(has_gauss), float(gauss)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    np_state = state["numpy"]
    has_gauss, gauss = state["numpy_gauss"]
    keys = np_state["keys"].numpy().astype(np.uint32)
    np.random.set_state((np_state["kind"], keys, np_state["pos"], has_gauss, gauss))
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save_checkpoint(run_dir: str | Path, global_step: int, payload: dict[str, Any], keep: int = 3) -> Path:
    """Write ``payload`` as the run's checkpoint at ``global_step`` (atomically); keep the latest ``keep``."""
    path = checkpoint_path(run_dir, global_step)
    atomic_write(path, lambda f: torch.save({"format": FORMAT, **payload}, f))
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def save_best_checkpoint(run_dir: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as the run's best checkpoint, ``checkpoints/best.pt`` (atomically, replacing it)."""
    path = Path(run_dir) / CHECKPOINTS / BEST_CHECKPOINT
    atomic_write(path, lambda f: torch.save({"format": FORMAT, **payload}, f))
    return path


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint file as given, or a run dir's latest checkpoint."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        found = list_checkpoints(path)
        if found:
            return found[-1]
        raise FileNotFoundError(f"{path}: expected a run dir with checkpoints/step-*.pt, found none")
    raise FileNotFoundError(f"{path}: expected a checkpoint file or a run dir, but nothing is there")


def _reason(err: BaseException) -> str:
    """Why torch.load failed, in one line. Its weights-only message advises weights_only=False, which
    would run code from the file: only its last part (what it found) is kept."""
    text = str(err)
    if "Weights only load failed" in text:
        found = text.rpartition("WeightsUnpickler error:")[2].strip().splitlines()
        return f"not a weights-only torch file: {found[0]}" if found and found[0] else "not a weights-only torch file"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint's contents, tensors on the CPU (``load_state_dict`` moves them to the model's device)."""
    file = find_checkpoint(path)
    try:
        payload: dict[str, Any] = torch.load(file, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as err:
        raise ValueError(
            f"{file}: expected an envfleet checkpoint, but torch cannot read it ({_reason(err)})"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        got = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(f"{file}: expected an envfleet checkpoint (format {FORMAT}), got format {got!r}")
    return payload
