"""Checkpoints: saving and loading a learner's state atomically, RNG states included (needs torch).

A checkpoint is a ``torch.save`` of plain containers, tensors, numbers and strings only, so it
loads with ``weights_only=True``: loading one never runs code from the file.
"""

from __future__ import annotations

import io
import logging
import random
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from learner.errors import os_reason
from learner.rundir import (
    BEST_CHECKPOINT,
    CHECKPOINTS,
    CONFIG,
    atomic_write,
    checkpoint_path,
    list_checkpoints,
    read_json,
)

__all__ = [
    "capture_rng",
    "UnreadableCheckpointError",
    "find_checkpoint",
    "load_checkpoint",
    "load_latest_readable",
    "load_nets",
    "nets_differ",
    "restore_rng",
    "save_best_checkpoint",
    "save_checkpoint",
    "written_by",
]

FORMAT = 1

REQUIRED = ("args", "ppo", "model", "observation_space", "action_space")
"""What every checkpoint of :data:`FORMAT` holds, and both eval and ``--resume`` read."""
RESUMED = ("counters", "optimizer", "rng")
"""What every checkpoint ``learner train`` saves holds too, and ``--resume`` reads (eval does not)."""

log = logging.getLogger(__name__)


def load_nets(
    net: torch.nn.Module,
    state: dict[str, Any],
    what: str,
    *,
    checkpoint: dict[str, Any] | None = None,
    file: str | Path | None = None,
) -> None:
    """Load a checkpoint's ``state`` into ``net``, the policy this version builds for the checkpoint's
    spaces; ValueError (naming ``what``, the checkpoint) where they do not fit: nets of another layout
    (an older envfleet built an MLP for 2-d uint8 frames, which get the Nature CNN now), not torch's
    bare RuntimeError, whose first line ("Error(s) in loading state_dict for Agent:") says nothing of
    what differs. The error says how they differ (:func:`nets_differ`), which envfleet wrote the
    checkpoint as far as it can be told (``checkpoint``, its whole contents, and ``file``, where it was
    read: :func:`written_by`), and what to do: that version evaluates or resumes it; this one can
    train the run anew (``learner train --like RUN``, where the file is in a run dir)."""
    try:
        net.load_state_dict(state)
    except RuntimeError as err:
        detail = nets_differ(net.state_dict(), state) or str(err).splitlines()[0]
        raise ValueError(
            f"{what}: its nets do not fit the policy this envfleet builds for its spaces ({detail}); "
            + _other_version_advice(checkpoint, file)
        ) from None


def nets_differ(here: dict[str, Any], saved: dict[str, Any]) -> str | None:
    """How the state dict ``saved`` (a checkpoint's nets) differs from ``here`` (the nets this version builds),
    in a user's words: the layout of each where they differ (an MLP, the Nature CNN, a Dict observation's
    extractor), else the parameters one of them lacks, else the first parameter of another shape; None where
    they agree in keys and shapes (torch failed for another reason)."""
    layouts = _layout(saved), _layout(here)
    if layouts[0] != layouts[1]:
        return f"it holds {layouts[0]} where this version builds {layouts[1]}"
    missing = [key for key in here if key not in saved]
    unexpected = [key for key in saved if key not in here]
    if missing and unexpected:
        return f"it has {_some(unexpected)} where this version's have {_some(missing)}"
    if missing or unexpected:
        return f"it has {_some(unexpected)} that this version's do not" if unexpected else f"it lacks {_some(missing)}"
    for key, tensor in here.items():
        theirs = saved[key]
        if isinstance(theirs, torch.Tensor) and theirs.shape != tensor.shape:
            return f"its {key} is {tuple(theirs.shape)}, this version's {tuple(tensor.shape)}"
    return None


def _layout(state: dict[str, Any]) -> str:
    """The policy's layout that a state dict's keys say (:class:`learner.ppo.Agent`'s modules)."""
    if any(key.startswith("combined.") for key in state):
        return "a Dict observation's extractor (a CNN per camera beside the vector keys)"
    if any(key.startswith("cnn.") for key in state):
        return "the Nature CNN"
    first = state.get("actor.0.weight")
    return f"an MLP over {first.shape[1]} inputs" if isinstance(first, torch.Tensor) and first.dim() == 2 else "an MLP"


def _some(keys: list[str], most: int = 3) -> str:
    return ", ".join(keys[:most]) + (f" (+{len(keys) - most} more)" if len(keys) > most else "")


def written_by(checkpoint: dict[str, Any] | None, file: str | Path | None) -> str | None:
    """Which envfleet wrote a checkpoint (``checkpoint``, its contents, read from ``file``), as far as it can be
    told: its own record (``versions``, which checkpoints hold since 2026-12-07), else its run's config.json
    (``file`` in a run dir's checkpoints/ folder), which has said the envfleet version and commit of the run's
    latest session since 2026-12-02; None where neither says (a checkpoint of an older version, or one
    copied out of its run dir). E.g. ``envfleet 0.1.0, commit a1d43b5509fb (as its run's config.json says)``."""
    found = _writer(checkpoint, file)
    return None if found is None else found[0]


def _writer(checkpoint: dict[str, Any] | None, file: str | Path | None) -> tuple[str, str | None] | None:
    """:func:`written_by`'s words, and the commit they name (None where the versions recorded have none)."""
    versions = (checkpoint or {}).get("versions")
    source = "its own record"
    if not isinstance(versions, dict) and file is not None and Path(file).parent.name == CHECKPOINTS:
        try:
            config = read_json(Path(file).parent.parent / CONFIG)
        except (OSError, ValueError):
            config = None
        versions = config.get("versions") if isinstance(config, dict) else None
        source = f"its run's {CONFIG}"
    if not isinstance(versions, dict) or not isinstance(versions.get("envfleet"), str):
        return None
    commit = versions.get("envfleet_commit")
    commit = commit.removesuffix("+dirty") if isinstance(commit, str) and commit else None
    at = f", commit {commit[:12]}" if commit else ""
    return f"envfleet {versions['envfleet']}{at} (as {source} says)", commit


def _other_version_advice(checkpoint: dict[str, Any] | None, file: str | Path | None) -> str:
    """The end of :func:`load_nets`'s error: which version wrote the checkpoint (:func:`written_by`), this
    one's, and what to do."""
    from env_server.protocol import package_version, source_commit  # (git runs: on this error's way alone)

    writer = _writer(checkpoint, file)
    commit = source_commit()
    here = f"envfleet {package_version()}" + (f", commit {commit[:12]}" if commit else "")
    if writer is None:
        said = (
            "it was written by an older version, one that recorded its version neither in its checkpoints nor in "
            f"its run's {CONFIG} (before 2026-12-02)"
        )
        how = "evaluate or resume it with the version that wrote it"
    else:
        said, written_commit = f"it was written by {writer[0]}", writer[1]
        how = "evaluate or resume it with that version" + (
            f" (from a clone of envfleet: git worktree add ../envfleet-{written_commit[:7]} {written_commit[:12]})"
            if written_commit
            else ""
        )
    run = Path(file).parent.parent if file is not None and Path(file).parent.name == CHECKPOINTS else None
    anew = f"learner train --like {run}" if run is not None else "learner train --like RUN_DIR, its run dir"
    return f"{said} (this one is {here}): {how}, or train the run anew with this one ({anew})"


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
        # (one state per GPU of the host that saved it: a run resumed on a host with fewer GPUs, a
        # rescheduled Job's, restores those it has; more states than GPUs was "invalid device ordinal")
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"][: torch.cuda.device_count()]])


def save_checkpoint(run_dir: str | Path, global_step: int, payload: dict[str, Any], keep: int = 3) -> Path:
    """Write ``payload`` as the run's checkpoint at ``global_step`` (atomically); keep the latest ``keep``."""
    path = checkpoint_path(run_dir, global_step)
    atomic_write(path, _saved(payload), run_dir=Path(run_dir))
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def save_best_checkpoint(run_dir: str | Path, payload: dict[str, Any], name: str = BEST_CHECKPOINT) -> Path:
    """Write ``payload`` as the run's best checkpoint, ``checkpoints/best.pt`` (atomically, replacing it); ``name``:
    another best's (``best-eval.pt``, the best evaluation's: --eval-every)."""
    path = Path(run_dir) / CHECKPOINTS / name
    atomic_write(path, _saved(payload), run_dir=Path(run_dir))
    return path


def _saved(payload: dict[str, Any]) -> Callable[[IO[bytes]], None]:
    """What writes ``payload`` as a checkpoint file: torch.save'd in memory, then written whole, so that a full
    disk is said as the OSError it is (torch's zip writer, writing the file itself, raised "[enforce fail at
    inline_container.cc:672] . unexpected pos 91904 vs 91796")."""

    def write(f: IO[bytes]) -> None:
        saved = io.BytesIO()
        torch.save({"format": FORMAT, **payload}, saved)
        f.write(saved.getbuffer())

    return write


def find_checkpoint(path: str | Path, *, checkpoints_folder: bool = False) -> Path:
    """A checkpoint file as given, or a run dir's latest checkpoint; with ``checkpoints_folder``, also a
    run's ``checkpoints/`` folder itself (its latest ``step-*.pt``), where eval may be pointed at it.
    Off by default because ``--resume`` goes on writing in the folder it is given, which must be the run dir."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        found = list_checkpoints(path)
        if found:
            return found[-1]
        # (resolved: "." inside checkpoints/ has no name of its own)
        if checkpoints_folder and path.resolve().name == CHECKPOINTS:
            found = list_checkpoints(path.resolve().parent)
            if found:
                return path / found[-1].name
        what = "a run dir with checkpoints/step-*.pt" + (" (or that checkpoints folder)" if checkpoints_folder else "")
        hint = ""
        if checkpoints_folder:  # (not for --resume, which takes a run dir only)
            best = next(
                (p for p in (path / BEST_CHECKPOINT, path / CHECKPOINTS / BEST_CHECKPOINT) if p.is_file()), None
            )
            hint = f"; {best} is there: pass that file to evaluate it" if best is not None else ""
        raise FileNotFoundError(f"{path}: expected {what}, found none{hint}")
    hint = ""
    if path.name != BEST_CHECKPOINT and (missing := missing_checkpoint(path)):
        raise FileNotFoundError(missing)
    if path.name == BEST_CHECKPOINT and path.parent.is_dir() and list_checkpoints(path.parent.parent):
        hint = (
            f" (a run writes {BEST_CHECKPOINT}, unless --no-save-best, at an update's end once 20 episodes have "
            f"ended, when their mean return is a new best: this one has none; pass {path.parent.parent} for its "
            "latest checkpoint)"
        )
    raise FileNotFoundError(f"{path}: expected a checkpoint file or a run dir, but nothing is there{hint}")


SHOWN_CHECKPOINTS = 5
"""How many of a run dir's checkpoints :func:`missing_checkpoint` names (its latest)."""


def missing_checkpoint(path: Path, flag: str = "") -> str | None:
    """What to say of ``path``, a checkpoint file that does not exist (``learner train --resume
    RUN/checkpoints/step-N.pt`` with a step never checkpointed, or pruned by --keep-checkpoints since), else None
    (``path`` is there, or names no checkpoint: neither a ``.pt`` file nor one in a ``checkpoints/`` folder): that it
    does not exist, and the checkpoints its run dir has (the latest :data:`SHOWN_CHECKPOINTS`), or that the folder
    is not there either; and that the run dir itself resumes from its latest. ``flag``: the option named first.
    (--resume said "expected a run dir holding config.json, but RUN/checkpoints/step-N.pt/config.json does not
    exist", as if the file were to be a run dir.)"""
    if path.exists() or not (path.suffix == ".pt" or path.parent.name == CHECKPOINTS):
        return None
    said = f"{flag}: " if flag else ""
    run_dir = path.parent.parent if path.parent.name == CHECKPOINTS else path.parent
    found = list_checkpoints(run_dir) if run_dir.is_dir() else []
    if not found:
        there = f"{run_dir} has no {CHECKPOINTS}/step-*.pt" if run_dir.is_dir() else f"{run_dir} does not exist either"
        return f"{said}the checkpoint file {path} does not exist; {there}"
    names = ", ".join(p.name for p in found[-SHOWN_CHECKPOINTS:])
    older = len(found) - SHOWN_CHECKPOINTS
    listed = f"{names} (and {older} older)" if older > 0 else names
    return (
        f"{said}the checkpoint file {path} does not exist; {run_dir / CHECKPOINTS} has {listed}: pass one of them, or "
        f"the run dir {run_dir} for its latest"
    )


def _reason(err: BaseException) -> str:
    """Why torch.load failed, in one line. Its weights-only message advises weights_only=False, which
    would run code from the file: only its last part (what it found) is kept."""
    text = str(err)
    if "Weights only load failed" in text:
        found = text.rpartition("WeightsUnpickler error:")[2].strip().splitlines()
        return f"not a weights-only torch file: {found[0]}" if found and found[0] else "not a weights-only torch file"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


class UnreadableCheckpointError(ValueError):
    """A checkpoint file torch cannot read: empty, truncated, corrupt, or not a torch file at all; or one
    of this format that lacks what each holds (:data:`REQUIRED`). An envfleet checkpoint of another
    format is a plain ValueError: an older checkpoint would not help."""


# torch.save writes a zip archive (since torch 1.6): a file that starts as one and does not load was cut
# short or damaged (a disk that filled up, a copy interrupted).
_ZIP_MAGIC = b"PK\x03\x04"


def _unreadable(file: Path, err: BaseException) -> str:
    """Why torch cannot read ``file``, in the user's terms: torch's own error for a damaged archive is an
    internal one (``OSError: [Errno 22] Invalid argument``, a miniz message, the unpickler's KeyError)."""
    if isinstance(err, PermissionError | IsADirectoryError):
        return f"cannot read it: {os_reason(err)}"
    try:
        with open(file, "rb") as f:
            head = f.read(8)
    except OSError as read_err:
        return f"cannot read it: {os_reason(read_err)}"
    if not head:
        return "the file is empty (a write cut short before its first byte)"
    if not head.startswith(_ZIP_MAGIC):
        return f"it is not a checkpoint torch can read (torch.save writes a zip archive; this file starts {head!r})"
    if "weights_only" in str(err) or "Weights only" in str(err):  # a whole torch file, of more than weights
        return f"torch cannot read it ({_reason(err)})"
    detail = _reason(err).split(". ")[0]  # (miniz's messages go on with advice for torch's developers)
    return f"the file is truncated or corrupt: not a checkpoint torch can read ({detail})"


def _damaged_record(file: Path) -> str | None:
    """The first record of ``file`` (a zip archive torch read) whose bytes fail the CRC-32 torch.save
    wrote for them, else None. torch's reader never checks them, so bytes a disk or a copy changed inside
    a tensor load as wrong weights. Records written without one (CRC 0: torch.serialization's
    set_crc32_options(False)) are not checked; nor is an archive Python's zipfile cannot read (torch could)."""
    try:
        with zipfile.ZipFile(file) as archive:
            for info in archive.infolist():
                if info.CRC == 0 or info.is_dir():
                    continue
                try:
                    with archive.open(info) as record:
                        while record.read(1 << 20):
                            pass
                except zipfile.BadZipFile:  # (a checksum or a local header that does not match)
                    return info.filename
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError):
        return None
    return None


def load_checkpoint(path: str | Path, *, resuming: bool = False) -> dict[str, Any]:
    """A checkpoint's contents, tensors on the CPU (``load_state_dict`` moves them to the model's device).

    UnreadableCheckpointError (a ValueError naming the file) where torch cannot read the file: a damaged
    one fails anywhere in torch's reader or its unpickler, with errors of any type (KeyError, OSError,
    RuntimeError, EOFError, ...), none of which says to the user what is wrong; also where the file lacks
    one of :data:`REQUIRED` (a KeyError wherever it was read), or ``resuming``, of :data:`RESUMED`."""
    file = find_checkpoint(path)
    try:
        payload: dict[str, Any] = torch.load(file, map_location="cpu", weights_only=True)
    except MemoryError:
        raise  # (no word on the file: too little memory here)
    except Exception as err:
        reason = _unreadable(file, err)
        # A whole torch file of more than weights is no damage: an older checkpoint would be no better.
        kind = ValueError if reason.startswith("torch cannot read it") else UnreadableCheckpointError
        raise kind(f"{file}: expected an envfleet checkpoint, but {reason}") from None
    damaged = _damaged_record(file)
    if damaged is not None:
        raise UnreadableCheckpointError(
            f"{file}: expected an envfleet checkpoint, but the file is corrupt: its record {damaged!r} fails "
            "its checksum (a disk or a copy that changed its bytes; torch itself does not check them)"
        )
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        got = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        if isinstance(got, int) and not isinstance(got, bool) and got > FORMAT:  # (a newer version's)
            writer = written_by(payload, file) if isinstance(payload, dict) else None
            raise ValueError(
                f"{file}: a checkpoint of format {got}, written by a newer envfleet"
                + (f" ({writer})" if writer else "")
                + f" than this one, which reads format {FORMAT}: upgrade envfleet to evaluate or resume it"
            )
        raise ValueError(f"{file}: expected an envfleet checkpoint (format {FORMAT}), got format {got!r}")
    missing = [key for key in (*REQUIRED, *(RESUMED if resuming else ())) if key not in payload]
    if missing:  # (a torch file that only says it is one: eval and --resume read each of these)
        raise UnreadableCheckpointError(
            f"{file}: expected an envfleet checkpoint, missing {', '.join(map(repr, missing))} (it has "
            f"{', '.join(map(repr, sorted(map(str, payload)))) or 'nothing'})"
        )
    return payload


def load_latest_readable(run_dir: str | Path) -> tuple[Path, dict[str, Any], list[tuple[Path, str]]]:
    """A run dir's latest checkpoint that torch can read: its path, its contents, and the newer ones
    skipped, each with why (oldest first), for ``--resume`` to go on from the last good one where the
    newest was damaged (atomic writes rule out a half-written one, not a disk or a copy that loses data).

    The caller should set the skipped files aside before it saves again: they keep the highest step
    numbers, so ``save_checkpoint`` would prune the good checkpoints before them. A checkpoint of another
    format is raised, not skipped (its older ones are of that format too), as is the last one's error
    when none can be read."""
    found = list_checkpoints(run_dir)
    if not found:
        raise FileNotFoundError(f"{run_dir}: expected a run dir with checkpoints/step-*.pt, found none")
    skipped: list[tuple[Path, str]] = []
    for path in reversed(found):
        try:
            return path, load_checkpoint(path, resuming=True), skipped[::-1]
        except UnreadableCheckpointError as err:
            if path == found[0]:
                raise
            log.warning("%s; trying the checkpoint before it", err)
            skipped.append((path, str(err)))
    raise AssertionError("unreachable")
