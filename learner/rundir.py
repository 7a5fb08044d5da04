"""A run directory's files: config.json, metrics.jsonl, summary.json, checkpoints/ (reading and writing).

Every file a run rewrites is written atomically (a temporary file, then ``os.replace``), so a
learner killed at any moment leaves the previous version intact, never half a file.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import math
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from learner.errors import RunDirWriteError, os_reason, out_of_fds

# The run dir's lock: flock where there is one (Linux, macOS, the BSDs), else Windows' byte-range locks
# (msvcrt.locking); where neither is, the run dir is used unlocked (said as a warning).
try:
    import fcntl
except ImportError:  # (Windows)
    fcntl = None  # type: ignore[assignment]
try:
    import msvcrt
except ImportError:  # (every platform but Windows)
    msvcrt = None  # type: ignore[assignment]

__all__ = [
    "BEST_CHECKPOINT",
    "BEST_EVAL_CHECKPOINT",
    "CHECKPOINTS",
    "CONFIG",
    "LOCK",
    "METRICS",
    "PLOT",
    "SUMMARY",
    "RunDirGone",
    "VIDEOS",
    "WANDB_RUN",
    "append_jsonl",
    "atomic_write",
    "cannot_write",
    "check_holds_a_run",
    "check_makeable",
    "check_name_lengths",
    "check_starts_over",
    "checkpoint_path",
    "checkpoint_step",
    "drop_rows_after",
    "gone",
    "is_run_config",
    "jsonable",
    "last_row",
    "list_checkpoints",
    "list_videos",
    "lock",
    "remove_stale_temp_files",
    "read_json",
    "iter_jsonl",
    "read_jsonl",
    "rewrite_jsonl",
    "set_aside",
    "set_aside_abandoned",
    "set_aside_unreadable",
    "still_there",
    "video_step",
    "write_json",
    "write_text",
    "writing",
]

log = logging.getLogger(__name__)

CONFIG = "config.json"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
PLOT = "returns.png"
WANDB_RUN = "wandb-run.json"
"""``learner train --track``: the W&B run the run logs to (its id, project, entity and URL), which --resume
goes on in."""
CHECKPOINTS = "checkpoints"
_CHECKPOINT = re.compile(r"^step-(\d+)\.pt$")
VIDEOS = "videos"
"""``learner train --capture-video``: the run dir's folder of GIFs of the policy, ``step-<global step>.gif``."""
_VIDEO = re.compile(r"^step-(\d+)\.gif$")


NAME_MAX = 255
"""The bytes a name in a path can have (a file or folder's: Linux's, macOS's), where the file system
does not say its own (``pathconf``)."""


def check_makeable(folder: Path, option: str, *, not_a_folder: type[Exception] = ValueError) -> None:
    """Refuse ``folder``, one a command is to make (``option`` gave it, and is named), where it cannot be made: the
    deepest part of it that exists is a file (``not_a_folder``: ValueError unless told; learner train's --run-dir
    raises FileExistsError, as for a run dir that holds a run), or a folder this user cannot write in (ValueError);
    so that the command says so before anything starts, not at its first write, minutes in. (learner train's
    --run-dir and learner bench's --out each looked for that part and wrote both refusals by themselves.)"""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise not_a_folder(f"{option}: cannot make {folder}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{option}: cannot make {folder}: {existing} is not writable")


def check_name_lengths(path: str | os.PathLike[str]) -> None:
    """Refuse ``path`` (ValueError: ``File name too long (...)``) where a name in it is longer than its
    file system takes (255 bytes, mostly; that of the deepest folder of it that exists), or the OS says
    the whole is too long (ENAMETOOLONG), so that a command says so of the option that gave it rather than
    fail later at the first ``exists()`` with a traceback. (A name in a folder not made yet is held to the
    limit of the folder it would be made in.)"""
    limit, folder = NAME_MAX, Path(path).anchor or "."
    for name in Path(path).parts[1 if Path(path).anchor else 0 :]:
        with contextlib.suppress(AttributeError, OSError, ValueError):  # (gone, not a folder; no pathconf)
            limit = os.pathconf(folder, "PC_NAME_MAX") if os.path.isdir(folder) else limit
        if (size := len(os.fsencode(name))) > limit:
            raise ValueError(f"{_too_long()} (a name in the path is {size} bytes, over {limit})")
        folder = os.path.join(folder, name)
    try:
        os.stat(path)
    except OSError as err:
        if err.errno == errno.ENAMETOOLONG:
            raise ValueError(f"{_too_long()} (the path is {len(os.fsencode(os.fspath(path))):,} bytes)") from None
    except ValueError:  # (an embedded NUL: the caller's to refuse, as open() would)
        pass


def _too_long() -> str:
    return os.strerror(errno.ENAMETOOLONG)  # ("File name too long")


def make_new_dir(path: Path) -> Path:
    """Make ``path``, or, where it exists already, the first of ``path-2``, ``path-3``, ... that does not;
    returns the folder made (made here: another process cannot have made it too)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        candidate = path if n == 1 else path.with_name(f"{path.name}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise AssertionError("unreachable")


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None], *, run_dir: Path | None = None) -> None:
    """Call ``write`` on a temporary file beside ``path``, then move it onto ``path`` in one step.

    The data is flushed to disk (fsync) before the move, so that after a crash ``path`` holds the
    old version or the new one in full. A process killed mid-write leaves a temporary file
    (``.<name>.*.tmp``) behind; :func:`remove_stale_temp_files` clears them. The folders up to
    ``path`` are made, but for ``run_dir``, a run's (FileNotFoundError where it is gone, see
    :func:`gone`): a run dir deleted or moved mid-run was made anew, holding a checkpoint and
    summary.json without the config.json and metrics.jsonl that would make it a run.
    """
    path = Path(path)
    if run_dir is not None and not run_dir.is_dir():
        raise gone(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _new_temp_file(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _sync_dir(path.parent)


def _sync_dir(folder: Path) -> None:
    """Flush ``folder``'s entries to disk (the rename just made), so that a power cut keeps it too."""
    with contextlib.suppress(OSError):  # (file systems that cannot: the rename still happened)
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _new_temp_file(path: Path) -> tuple[int, str]:
    """A new file ``.<name>.<random>.tmp`` beside ``path``, open for writing, with a normal file's mode
    (0666 less the umask; tempfile.mkstemp's would be 0600, and reading the umask means setting it)."""
    while True:
        tmp = str(path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp"))
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), tmp
        except FileExistsError:
            continue


def jsonable(value: Any) -> Any:
    """``value`` as valid JSON can hold it: JSON has no NaN or infinities, written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def write_text(path: str | Path, text: str, *, run_dir: Path | None = None) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically (:func:`atomic_write`, as its ``run_dir``)."""

    def write(f: IO[bytes]) -> None:
        f.write(text.encode())

    atomic_write(path, write, run_dir=run_dir)


def write_json(path: str | Path, obj: Any, *, run_dir: Path | None = None) -> None:
    write_text(path, json.dumps(jsonable(obj), indent=2) + "\n", run_dir=run_dir)


def read_json(path: str | Path) -> Any:
    with open(path) as f:
        return json.load(f)


class RunDirGone(FileNotFoundError):
    """A write in a run dir that is not there any more (deleted or moved while the run ran)."""


def gone(run_dir: Path) -> RunDirGone:
    """The error of a write in ``run_dir``, which is not there any more."""
    return RunDirGone(errno.ENOENT, f"the run dir {run_dir} is gone (deleted or moved while the run ran)")


def still_there(run_dir: Path, metrics: IO[str]) -> None:
    """FileNotFoundError (:func:`gone`) unless ``run_dir``'s metrics.jsonl is the file ``metrics`` (open for
    appending) still: rows written to a file deleted, or moved with its run dir, were lost without a word."""
    held = os.fstat(metrics.fileno())
    try:
        there = os.stat(run_dir / METRICS)
    except FileNotFoundError:
        raise gone(run_dir) from None
    if (there.st_dev, there.st_ino) != (held.st_dev, held.st_ino):
        raise gone(run_dir)


def append_jsonl(f: IO[str], obj: dict[str, Any]) -> None:
    """One JSON object per line, flushed so readers (``learner plot``, ``tail -f``) see it at once."""
    f.write(json.dumps(jsonable(obj)) + "\n")
    f.flush()


def read_jsonl(path: str | Path, *, skipped: list[int] | None = None) -> list[dict[str, Any]]:
    """The objects in a JSON-lines file, skipping a last line cut short by a crash, and any other line
    that is no JSON (bytes that are no UTF-8 included: read as U+FFFD, not a UnicodeDecodeError for the
    whole file). ``skipped``: the numbers (from 1) of those other lines are appended to it. All in
    memory: a long run's metrics.jsonl is read with :func:`iter_jsonl`."""
    return list(iter_jsonl(path, skipped=skipped))


def iter_jsonl(
    path: str | Path, *, skipped: list[int] | None = None, parse: Callable[[str], Any] = json.loads
) -> Iterator[Any]:
    """:func:`read_jsonl`'s objects one at a time, as read (a long run's metrics, 2 KB a row, are never
    all in memory). ``parse``: what reads a line (json.loads, or one that reads only what its caller
    needs of a line it knows; a JSONDecodeError for a line that is no JSON)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield parse(line)
            except json.JSONDecodeError:
                if skipped is not None and line.endswith("\n"):  # (a last line without its end: cut short)
                    skipped.append(number)


def drop_rows_after(path: str | Path, update: int, *, block: int = 1 << 16) -> int:
    """Cut a run's metrics file (``path``) after its last row of an update up to ``update`` (a checkpoint's):
    the rows of later updates at its end go (a killed run's, past its checkpoint; those of the timeline a
    run resumed from an older checkpoint abandons), with the lines among them that are no row (a last
    line cut short by a crash, say), and a last row left without its line's end gets one (else the next
    row written would continue its line). A row without an update (an older version's) is kept.

    Read from its end, a block at a time, and cut there (``os.truncate``): what it costs is that of the
    lines it drops, however long the file, and a file with nothing to drop is not written at all (its
    bytes, and its modification time, as they were). Returns the number of lines dropped."""
    with open(path, "rb") as f:
        end = f.seek(0, os.SEEK_END)
        keep, dropped, line = 0, 0, b""  # (where the file is cut: none of its lines kept, until one is found)
        for start, line in _lines_from_end(f, end, block):
            if not line.strip():
                continue  # (a blank line past the rows kept goes with them; not counted)
            if _row_kept(line, update):
                keep = start + len(line)
                break
            dropped += 1
    if keep == end and (end == 0 or line.endswith(b"\n")):
        return 0
    if keep < end:
        os.truncate(path, keep)
    with open(path, "ab") as f:
        if keep and not line.endswith(b"\n"):  # (the last row kept, cut short just before its line's end)
            f.write(b"\n")
        f.flush()
        os.fsync(f.fileno())
    return dropped


def rewrite_last_row(path: str | Path, row: dict[str, Any], *, block: int = 1 << 16) -> None:
    """Write the metrics file's (``path``) last row, that of ``row``'s update, again as ``row`` (the same row with
    columns added: learner train's evaluation of a solved run's last nets, Recorder.add_evaluation), in place:
    the bytes from where the two first differ, in one write at that offset (the new row being the old one with
    columns after its own, only its end); the file is cut after it where the new row is shorter (never so here; a
    kill between that write and the cut would leave the old row's end after it). The file holds the old row or the
    new one (the new one as long or longer), whenever the learner is killed: cut off and appended again
    (drop_rows_after, then append_jsonl), a kill between the two, or an append that failed (a full disk), left it
    without that update's row, for good, while the run's last checkpoint counts it. A file whose last row is not of
    that update (none is written yet) gets it appended. Not fsynced: as append_jsonl's rows, the next checkpoint's
    sync makes it durable."""
    line = (json.dumps(jsonable(row)) + "\n").encode("utf-8")
    with open(path, "r+b") as f:
        end = f.seek(0, os.SEEK_END)
        start, old = next(((at, text) for at, text in _lines_from_end(f, end, block) if text.strip()), (end, b""))
        if not _is_row_of(old, row.get("update")):
            start, old = end, b""
            if end and not _ends_line(f, end):
                line = b"\n" + line  # (after a last line cut short, on a line of its own: readers skip that one)
        # (where they first differ: the old row's closing brace, for a row with columns added after its own)
        same = next((i for i, (a, b) in enumerate(zip(old, line, strict=False)) if a != b), min(len(old), len(line)))
        tail = memoryview(line)[same:]
        at = start + same
        while tail:
            done = os.pwrite(f.fileno(), tail, at)
            tail, at = tail[done:], at + done
        if start + len(line) < end:
            f.truncate(start + len(line))


def last_row(path: str | Path, *, block: int = 1 << 16) -> dict[str, Any] | None:
    """The last row of a run's metrics file (``path``), read from its end (a long run's file is not read whole);
    None where there is none (no file, no row, a last line that is no JSON object: cut short by a crash)."""
    try:
        with open(path, "rb") as f:
            end = f.seek(0, os.SEEK_END)
            line = next((text for _, text in _lines_from_end(f, end, block) if text.strip()), b"")
    except FileNotFoundError:
        return None
    try:
        row = json.loads(line.decode("utf-8", errors="replace"))
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


def _is_row_of(line: bytes, update: Any) -> bool:
    """Whether a metrics line is the row of update ``update``."""
    try:
        row = json.loads(line.decode("utf-8", errors="replace"))
    except json.JSONDecodeError:
        return False
    return isinstance(row, dict) and update is not None and row.get("update") == update


def _ends_line(f: IO[bytes], end: int) -> bool:
    """Whether the file ``f`` (``end`` bytes long, not empty) ends in a line's end."""
    f.seek(end - 1)
    return f.read(1) == b"\n"


def _row_kept(line: bytes, update: int) -> bool:
    """Whether a metrics line is a row that :func:`drop_rows_after` keeps: a JSON object whose update, if it
    has one, is at most ``update``."""
    try:
        row = json.loads(line.decode("utf-8", errors="replace"))
    except json.JSONDecodeError:
        return False
    if not isinstance(row, dict):
        return False
    number = row.get("update", 0)
    return not (isinstance(number, int | float) and number > update)


def _lines_from_end(f: IO[bytes], end: int, block: int) -> Iterator[tuple[int, bytes]]:
    """The lines of the file ``f`` (``end`` bytes long), last first, each with its offset (a line with its
    ``\\n``, but the last one where the file does not end in one), reading ``block`` bytes at a time. A
    line longer than a block is searched and copied once (its blocks joined as it is given), not again
    at every block read (a 64 MB tail without a newline took 27 s)."""
    pos, buf, stop = end, b"", 0  # (buf[:stop]: the bytes from pos not yet given as lines)
    rest: list[bytes] = []  # (the blocks after buf of a line that starts before it, last first)
    while stop or pos:
        # (where the line ending at buf[:stop] + rest starts, if a newline before its own end says so)
        limit = stop if rest else stop - 1
        cut = buf.rfind(b"\n", 0, limit) + 1 if limit > 0 else 0
        if cut or not pos:
            yield pos + cut, buf[cut:stop] + b"".join(reversed(rest))
            stop, rest = cut, []
        else:
            if stop:
                rest.append(buf[:stop])
            size = min(block, pos)
            pos -= size
            f.seek(pos)
            buf = f.read(size)
            stop = len(buf)


def rewrite_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> None:
    write_text(path, "".join(json.dumps(jsonable(r)) + "\n" for r in rows))


@contextlib.contextmanager
def writing(path: Path, *, torch_save: bool = False) -> Iterator[None]:
    """A write of ``path`` in a run dir: its OSError (and, ``torch_save``, RuntimeError, which torch's
    writer raises for a full disk) becomes :func:`cannot_write`'s one-line error."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        if not (isinstance(err, OSError) or torch_save):
            raise
        raise cannot_write(path, err) from err


def cannot_write(path: Path, err: BaseException) -> RunDirWriteError:
    """What a failed write of ``path`` in a run dir raises: the file, why, and the room left there."""
    fds = out_of_fds(err)  # (not the disk's fault: the room left there would only mislead)
    if fds:
        return RunDirWriteError(f"cannot write {path}: {fds}")
    lines = str(err).strip().splitlines()
    reason = err.strerror if isinstance(err, OSError) and err.strerror else lines[0] if lines else type(err).__name__
    if isinstance(err, FileNotFoundError) and not isinstance(err, RunDirGone) and not path.parent.exists():
        reason = f"{path.parent} is gone (deleted or moved while the run ran)"  # (a TensorBoard file's, say)
    try:
        room = f"; {shutil.disk_usage(path.parent).free / 1e6:,.1f} MB free there"
    except OSError:
        room = ""
    return RunDirWriteError(f"cannot write {path}: {reason}{room}")


def _cannot_write_there(run_dir: str | Path, err: OSError) -> ValueError:
    """The run dir cannot be written (its lock file): why, in words (:func:`out_of_fds`: not the folder's fault)."""
    fds = out_of_fds(err)
    return ValueError(
        f"run dir {run_dir}: {fds}" if fds else f"run dir {run_dir}: cannot write there ({err.strerror or err})"
    )


BEST_CHECKPOINT = "best.pt"
BEST_EVAL_CHECKPOINT = "best-eval.pt"
"""The nets of the run's best evaluation (--eval-every; not with --no-save-best)."""


def checkpoint_path(run_dir: str | Path, global_step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{global_step:010d}.pt"


def checkpoint_step(path: Path) -> int | None:
    """The step of a checkpoint file named as :func:`checkpoint_path` names them, else None."""
    m = _CHECKPOINT.match(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """A run's checkpoints, oldest first."""
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _CHECKPOINT.match(p.name))]
    return [p for _, p in sorted(found)]


def video_step(path: Path) -> int | None:
    """The step of a --capture-video GIF named as the run names them (``videos/step-<step>.gif``), else None."""
    m = _VIDEO.match(path.name)
    return int(m.group(1)) if m else None


def list_videos(run_dir: str | Path) -> list[Path]:
    """A run's --capture-video GIFs (``videos/step-<step>.gif``), oldest first (none set aside)."""
    folder = Path(run_dir) / VIDEOS
    if not folder.is_dir():
        return []
    found = [(step, p) for p in folder.iterdir() if (step := video_step(p)) is not None and p.is_file()]
    return [p for _, p in sorted(found)]


def remove_stale_temp_files(run_dir: str | Path) -> list[Path]:
    """Delete the temporary files of writes that a killed learner never finished (a GIF's in videos/ too: a
    learner killed while --capture-video wrote one); returns them."""
    removed = []
    for folder in (Path(run_dir), Path(run_dir) / CHECKPOINTS, Path(run_dir) / VIDEOS):
        if not folder.is_dir():
            continue
        for path in folder.glob(".*.tmp"):
            with contextlib.suppress(OSError):
                path.unlink()
                removed.append(path)
    return removed


LOCK = ".lock"


@contextlib.contextmanager
def lock(run_dir: str | Path) -> Iterator[None]:
    """Hold ``run_dir`` for one learner while the block runs (``flock`` on ``run_dir/.lock``, on Windows a
    byte-range lock on it; released by the system whatever ends the process); FileExistsError naming the
    holder's pid where another learner holds it (two writing one run dir lose each other's metrics and
    checkpoints)."""
    path = Path(run_dir) / LOCK
    try:
        f = open(path, "a+")  # noqa: SIM115 (closed by the with below)
    except OSError as err:
        raise _cannot_write_there(run_dir, err) from None
    with f:
        locked = False
        try:
            _lock_file(f)
            locked = True
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            raise FileExistsError(
                f"run dir {run_dir}: in use by another learner ({holder}); wait for it to end, or pass another "
                "--run-dir"
            ) from None
        except OSError as err:  # (a file system without locks: some NFS, CIFS and FUSE mounts; no way to lock)
            log.warning(
                "run dir %s: cannot lock it (%s): nothing keeps another learner from writing it too",
                run_dir,
                os_reason(err),
            )
        try:
            f.seek(0)
            f.truncate()
            f.flush()
            # (unbuffered: a row left in the file's buffer by a full disk failed again as the file closed, a
            # traceback in place of this one line)
            os.write(f.fileno(), f"pid {os.getpid()} on {socket.gethostname()}\n".encode())
        except OSError as err:
            raise _cannot_write_there(run_dir, err) from None
        try:
            yield
        finally:
            if locked:
                _unlock_file(f)


# Where Windows' lock of the lock file lies: a byte far past its text, which Windows' locks (mandatory,
# unlike flock) would otherwise keep a second learner from reading to name the holder. (Locking past the
# end of a file is allowed; the lock goes with the file handle, closed at the process's end.)
_MSVCRT_LOCK_OFFSET = 1 << 20


def _lock_file(f: IO[str]) -> None:
    """Lock ``f`` for this process, without waiting: BlockingIOError where another process holds it; another
    OSError where it cannot be locked (the file system, or a platform with neither flock nor msvcrt)."""
    if fcntl is not None:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    elif msvcrt is not None:
        fd = f.fileno()
        os.lseek(fd, _MSVCRT_LOCK_OFFSET, os.SEEK_SET)  # (msvcrt.locking locks from the file's position)
        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
        except OSError as err:
            # (a lock held elsewhere: EACCES, or EDEADLOCK, the C runtime's name for a lock not taken)
            if err.errno in (errno.EACCES, getattr(errno, "EDEADLOCK", errno.EDEADLK)):
                raise BlockingIOError(err.errno, err.strerror) from err
            raise
    else:
        raise OSError(errno.ENOSYS, "this platform has neither flock nor msvcrt's locks")


def _unlock_file(f: IO[str]) -> None:
    """Unlock what :func:`_lock_file` locked. Windows' locks, at once: the system unlocks them when the file
    is closed, but "the time it takes ... depends upon available system resources" (LockFileEx's
    documentation), which a learner resuming the run at once could find still held. (flock's go with
    the file's close.)"""
    if fcntl is None and msvcrt is not None:
        with contextlib.suppress(OSError):
            os.lseek(f.fileno(), _MSVCRT_LOCK_OFFSET, os.SEEK_SET)
            msvcrt.locking(f.fileno(), msvcrt.LK_UNLCK, 1)


_RUN_FILES = (CONFIG, METRICS, SUMMARY, PLOT, WANDB_RUN)


def set_aside_unreadable(paths: Iterable[Path]) -> list[Path]:
    """Rename each of ``paths`` (checkpoints torch cannot read) ``NAME.unreadable`` (``NAME.unreadable-2``, ...
    where that name is taken), out of the listing of checkpoints (their step numbers are the highest:
    pruning would keep them and delete good ones); the new paths. The renames are flushed to disk with
    their folders; one that fails is :func:`cannot_write`'s error."""
    return _rename_aside(paths, "unreadable")


def set_aside_abandoned(paths: Iterable[Path]) -> list[Path]:
    """Rename each of ``paths`` (checkpoints newer than the one a run was resumed from: a timeline that run
    abandoned) ``NAME.abandoned``, out of the listing of checkpoints, as :func:`set_aside_unreadable` does
    (else pruning deletes the resumed run's checkpoints before them, and a later --resume goes on from
    them); the new paths."""
    return _rename_aside(paths, "abandoned")


def _rename_aside(paths: Iterable[Path], why: str) -> list[Path]:
    moved = []
    for path in paths:
        # (NAME.why-2, ... where one is there already: a run dir resumed from an old file twice abandons a step twice)
        aside = path.with_name(f"{path.name}.{why}")
        n = 2
        while aside.exists():
            aside, n = path.with_name(f"{path.name}.{why}-{n}"), n + 1
        with writing(path):  # (a read-only run dir: one line naming the file)
            moved.append(path.rename(aside))
    for folder in {path.parent for path in moved}:
        _sync_dir(folder)
    return moved


def set_aside(run_dir: str | Path) -> Path | None:
    """Move what a run without a checkpoint left in ``run_dir`` (killed before its first one: it can only
    start over) into ``run_dir/previous/`` (or ``previous-2/``, ...: TensorBoard shows it as a run of its
    own), as it was laid out (``checkpoints/``'s files in ``previous/checkpoints/``); the folder, or None
    where there was nothing to move."""
    run_dir = Path(run_dir)
    found = _run_files(run_dir)
    if not found:
        return None
    check_holds_a_run(run_dir)
    check_starts_over(run_dir, "--run-dir")
    aside = make_new_dir(run_dir / "previous")
    for path in found:
        moved = aside / path.relative_to(run_dir)
        moved.parent.mkdir(exist_ok=True)
        path.rename(moved)
    _sync_dir(run_dir)
    return aside


def _run_files(run_dir: Path) -> list[Path]:
    """The files in ``run_dir`` named as a run names its files, and those in its checkpoints/ and videos/ folders
    (--capture-video's GIFs: a run killed after its first evaluation's video, before that update's checkpoint,
    left one, which the run started over there listed as its own, of another run's nets, until it overwrote it)."""
    found = [p for p in run_dir.iterdir() if p.name in _RUN_FILES or p.name.startswith("events.out.tfevents")]
    for folder in (run_dir / CHECKPOINTS, run_dir / VIDEOS):
        found += [p for p in folder.glob("*") if p.is_file()] if folder.is_dir() else []
    return found


def check_starts_over(run_dir: Path, flag: str) -> None:
    """FileExistsError where ``run_dir``, which holds no step checkpoint, shows that its run had one all the same
    (deleted or lost since: its best.pt kept, say), naming what shows it: a run stopped before its first
    checkpoint starts over, its files set aside (:func:`set_aside`), but this one would start over for a reason
    that is not so, where its owner may mean to go on with it. ``flag``: the option that named the folder."""
    found = _past_first_checkpoint(run_dir)
    if not found:
        return
    best = run_dir / CHECKPOINTS / BEST_CHECKPOINT
    evaluate = f"; learner eval {best} evaluates its best policy" if best.is_file() else ""
    raise FileExistsError(
        f"{flag} {run_dir}: no step checkpoint ({CHECKPOINTS}/step-*.pt) to go on from, but the run had some, "
        f"deleted or lost since: it holds {', '.join(found)}; left as it is (only a run that stopped before its "
        f"first checkpoint starts over){evaluate}; to start the run over, move its files out of {run_dir} (or pass "
        "another --run-dir)"
    )


def _past_first_checkpoint(run_dir: Path) -> list[str]:
    """What in ``run_dir`` (of a run with no step checkpoint) shows its run had one, as "what (why)": files in
    checkpoints/ (best.pt, written after an update; *.unreadable and *.abandoned, set aside by a resume), a
    summary.json of a run that updated and did not end in an error (its end writes a checkpoint of its last
    update; an error may be that the first one could not be written, a full disk), metrics.jsonl rows
    past the first update of a run that checkpointed (the first update's checkpoint is written right after
    its row; with --checkpoint-every 0 none is written until the end). Empty for a run killed in its first
    update (or with --checkpoint-every 0, before its end)."""
    found = []
    folder = run_dir / CHECKPOINTS
    if folder.is_dir():
        found += [
            f"{CHECKPOINTS}/{p.name}"
            for p in sorted(folder.iterdir())
            if not (p.name.startswith(".") and p.name.endswith(".tmp")) and not _CHECKPOINT.match(p.name)
        ]
    with contextlib.suppress(OSError, ValueError):  # (unreadable: it shows nothing)
        summary = read_json(run_dir / SUMMARY)
        # (not a run that ended in an error: its first checkpoint may be what failed, a full disk say)
        ended_well = isinstance(summary, dict) and not str(summary.get("stop_reason") or "").startswith("error")
        if ended_well and summary.get("updates", summary.get("total_steps")):  # (older: no updates)
            found.append(f"{SUMMARY} (of a run that ended at step {summary.get('total_steps')})")
    every = 1  # (--checkpoint-every as the run recorded it)
    with contextlib.suppress(OSError, ValueError):
        recorded = read_json(run_dir / CONFIG)
        every = recorded["args"].get("checkpoint_every", 1) if is_run_config(recorded) else 1
    with contextlib.suppress(OSError, ValueError):
        rows = iter_jsonl(run_dir / METRICS)  # (one at a time: a long run's file is never all in memory)
        updates = max(
            (r["update"] for r in rows if isinstance(r, dict) and isinstance(r.get("update"), int)), default=0
        )
        if every and updates > 1:
            found.append(f"{METRICS} (rows up to update {updates}; the run was checkpointed at its first)")
    return found


def is_run_config(recorded: Any) -> bool:
    """Whether ``recorded`` (a config.json's contents) is a run's: an object with an ``args`` object."""
    return isinstance(recorded, dict) and isinstance(recorded.get("args"), dict)


def check_holds_a_run(run_dir: Path) -> None:
    """ValueError where ``run_dir`` holds files by a run's names that are no run's: a run writes its
    config.json, with an ``args`` object, before any of the others, so a folder whose config.json is
    missing or has none holds someone else's files (a project's config.json, say), which a new run
    would take for a failed run's and move aside (:func:`set_aside`)."""
    found = _run_files(run_dir) if run_dir.is_dir() else []
    if not found:
        return
    config = run_dir / CONFIG
    try:
        recorded = read_json(config)
    except FileNotFoundError:
        why = f"but no {CONFIG}"
    except (OSError, ValueError) as err:
        why = f"and its {CONFIG} cannot be read ({err.strerror if isinstance(err, OSError) else err})"
    else:
        if is_run_config(recorded):
            return
        why = f"and its {CONFIG} is no run's (it has no 'args' object)"
    names = ", ".join(sorted(str(p.relative_to(run_dir)) for p in found))
    raise ValueError(
        f"--run-dir {run_dir}: expected a new or empty folder, or a run's, but it holds {names}, {why}: files that "
        "are not a run's, left as they are; pass another --run-dir (a folder of the run's own), or move them out"
    )
