"""What train and eval show while they run (a progress bar, or lines in a log), Ctrl-C as a request to stop, and
a stop once the process that started the command is gone (--parent-pid)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from types import FrameType
from typing import Any

from env_server.protocol import DOUBLE_TAP_S
from env_server.tuning import detach_from_terminal
from learner.interrupts import interrupt
from learner.stats import format_return

__all__ = [
    "DOUBLE_TAP_S",
    "StopRequest",
    "ending_as_interrupt",
    "eval_note",
    "eval_running_note",
    "video_running_note",
    "quiet_exit",
    "stopping_with_parent",
    "bar_by_default",
    "bar_postfix",
    "close_bar",
    "fleet_down_note",
    "fleet_note",
    "in_notebook",
    "logging_above_bar",
    "progress_bar",
    "progress_line",
    "waiting_line",
    "widget_total",
]

log = logging.getLogger(__name__)


# Signals that ask the process to end, besides Ctrl-C: an orchestrator's SIGTERM (docker stop, systemd,
# Kubernetes), SIGHUP (the terminal closed, an ssh session dropped; Windows has none).
_ENDING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
_stop_at: float | None = None  # (time.monotonic()) when a signal first asked the command to stop
_stop_signal: int | None = None  # which signal that was


def _taken_over(sig: int) -> bool:
    """Whether a handler may take ``sig`` over: not SIGTERM or SIGHUP ignored when the process began
    (SIGHUP under ``nohup``), nor one set outside Python (it cannot be put back). Ctrl-C is taken even
    where ignored: a script's background job ignores it (no terminal's Ctrl-C reaches one), and a
    SIGINT sent to it on purpose (a test's, a supervisor's) asks for a stop."""
    handler = signal.getsignal(sig)
    return handler is not None and (sig == signal.SIGINT or handler is not signal.SIG_IGN)


def _aborts(signum: int, stop_at: float) -> bool:
    """Whether a signal after the one that asked for a stop at ``stop_at`` aborts: a Ctrl-C, unless a
    double tap of the first (:data:`DOUBLE_TAP_S`); a second SIGTERM or SIGHUP never does."""
    return signum == signal.SIGINT and time.monotonic() - stop_at >= DOUBLE_TAP_S


def _note_stop(signum: int) -> None:
    global _stop_at, _stop_signal
    if signum == getattr(signal, "SIGHUP", None):
        detach_from_terminal()  # (what is left to say, the summary and resume hint, goes nowhere, not a traceback)
    if _stop_at is None:
        _stop_at, _stop_signal = time.monotonic(), signum


def note_ctrl_c() -> None:
    """A Ctrl-C's KeyboardInterrupt caught before a command took the signals (its parser being built)."""
    _note_stop(signal.SIGINT)


def stopped_by_ctrl_c() -> bool:
    """Whether a Ctrl-C (SIGINT) was the signal that first asked the command to stop."""
    return _stop_at is not None and _stop_signal == signal.SIGINT


class StopRequest:
    """Turns the first Ctrl-C (or SIGTERM, or SIGHUP) into a request to stop at the next step; a second
    Ctrl-C (not a double tap: :data:`DOUBLE_TAP_S`) interrupts. A second SIGTERM or SIGHUP changes nothing.

    ``then`` says what follows the stop (in the warning the first one logs). ``event``, set from any
    thread, asks for the same stop (a caller's: signals reach only the main thread); ``signalled`` says
    whether a signal asked for it. A signal ignored when it begins (SIGHUP under ``nohup``) stays ignored."""

    def __init__(
        self,
        then: str = "checkpoint and summary follow",
        logger: logging.Logger | None = None,
        event: threading.Event | None = None,
    ) -> None:
        self.signalled = False
        self._then = then
        self._log = logger or log
        self._event = event
        self._previous: dict[int, Any] = {}
        self._at = 0.0  # (time.monotonic() of the signal that asked for the stop)

    @property
    def requested(self) -> bool:
        return self.signalled or (self._event is not None and self._event.is_set())

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, *_ENDING):
                if _taken_over(sig):
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        _note_stop(signum)
        if self.signalled:
            if _aborts(signum, self._at):
                interrupt()
            return  # (a double tap, a second SIGTERM or SIGHUP: the stop asked for stands)
        self.signalled, self._at = True, time.monotonic()
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self._log.warning("%s: stopping after this step (%s); Ctrl-C again to abort at once", what, self._then)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _as_the_command_does(signum: int, frame: FrameType | None) -> None:
    """A command's signals where no StopRequest takes them (starting up, closing down, exiting): the
    first interrupts as Ctrl-C does; then a double tap of Ctrl-C, and a second SIGTERM or SIGHUP,
    change nothing (the stop asked for stands); a later Ctrl-C interrupts what is left."""
    stop_at = _stop_at
    _note_stop(signum)
    if stop_at is None or _aborts(signum, stop_at):
        interrupt()


@contextlib.contextmanager
def ending_as_interrupt(*, then_exit: bool = False) -> Iterator[None]:
    """For a command's whole run (the learner's CLI): Ctrl-C, SIGTERM and SIGHUP where no
    :class:`StopRequest` takes them (starting up, closing down): the first interrupts as Ctrl-C does
    (so the command closes what it opened, its servers and their socket folder, and says so), and
    after a stop (here or a StopRequest's) a double-tapped Ctrl-C or a second SIGTERM or SIGHUP
    changes nothing. A signal ignored when it begins stays ignored.

    ``then_exit``: the process exits after it (the command's entry point). After a stop, the signals
    then go from these handlers straight to :func:`quiet_exit`'s, never back to their defaults: a
    SIGTERM after a Ctrl-C that came between the two ended the process -15 (the command's objects
    being freed as its function returns can take a while)."""
    global _stop_at, _stop_signal
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _stop_at = _stop_signal = None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, *_ENDING) if _taken_over(sig)}
    for sig in previous:
        signal.signal(sig, _as_the_command_does)
    try:
        yield
    finally:
        if then_exit and _stop_at is not None:
            quiet_exit()
        else:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


PARENT_WATCH_S = 0.5
"""How often :func:`stopping_with_parent` looks for its parent process."""


@contextlib.contextmanager
def stopping_with_parent(parent_pid: int | None) -> Iterator[None]:
    """For a command another process starts and stops (``learner bench``'s ``learner train``, given
    ``--parent-pid``): once ``parent_pid`` is no longer this process's parent (it was killed, and could
    not stop this one), the command stops as SIGTERM stops it (at its next step, its files written, the
    env servers it started closed and their socket folder removed), instead of running on to its end
    unseen. As env-server's ``--parent-pid``: a process whose parent ends is given another one."""
    if parent_pid is None:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while os.getppid() == parent_pid:
            if done.wait(PARENT_WATCH_S):
                return
        if done.is_set():  # (the command is over: nothing to stop)
            return
        log.warning("--parent-pid: process %d, which started this one, is gone: stopping", parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    watcher = threading.Thread(target=watch, name="envfleet-parent-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()


def quiet_exit() -> None:
    """For an entry point, once its command returned: if a signal asked it to stop, ignore Ctrl-C,
    SIGTERM and SIGHUP for the rest of the process's exit (joining threads, exit hooks, freeing
    memory): the exit then is the command's, not ended -2 or -15 by a double tap or a repeated
    SIGTERM (Python handlers are reset at the interpreter's end; ignored signals stay ignored)."""
    if _stop_at is not None and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, *_ENDING):
            if _taken_over(sig):
                signal.signal(sig, signal.SIG_IGN)


def progress_line(row: dict[str, Any], total: int, evaluation: float | None = None) -> str:
    """An update's metrics row as one line, for logs: steps, share done, SPS, recent return, elapsed
    and, until ``total``, the time left at this session's SPS; then, while the fleet is degraded, what it
    is missing (:func:`fleet_note`); then the last evaluation's mean return, ``evaluation`` (:func:`eval_note`)."""
    step = row["global_step"]
    line = _line_head(step, total, row["sps"], row["episodic_return_mean"], row["seconds"])
    if step < total and row["sps"] > 0:
        line += f", ~{_duration((total - step) / row['sps'])} left"
    if note := fleet_note(row):
        line += f", {note}"
    return line + eval_note(evaluation)


def eval_note(value: float | None) -> str:
    """What the progress bar and lines add once an evaluation ran (--eval-every): ", eval 500.0", the last one's
    mean return (the deterministic policy's), at every update until the next evaluation's (it had been said at
    the evaluated update only, gone from the bar a tenth of a second later, and from nearly every line); "" before
    any ran (None)."""
    return "" if value is None else f", eval {format_return(value)}"


def eval_running_note(step: int, ended: int, episodes: int) -> str:
    """What the progress bar and lines say instead of :func:`fleet_note` while an evaluation (--eval-every) plays its
    episodes: ``evaluating at step 16,384: 3 of 10 episodes`` (``step``: the update's it evaluates; ``ended`` of the
    ``episodes`` asked). No update comes while it runs, and the bar (and the lines) went on showing the last
    update's figures, frozen: with --eval-episodes 1000, minutes of a run that looked hung."""
    return f"evaluating at step {step:,}: {ended:,} of {episodes:,} episode{'' if episodes == 1 else 's'}"


def video_running_note(step: int, steps: int) -> str:
    """What the progress bar and lines say, as :func:`eval_running_note` says an evaluation, while --capture-video
    records its video of the nets of the update at env step ``step``, ``steps`` of its episode played:
    ``recording a video at step 16,384: 312 steps``. No update comes while it plays (a MuJoCo episode of 1,000
    rendered steps: seconds, a minute rendered in software), and the bar (and the lines) showed the last update's
    figures, or the evaluation's last count, frozen."""
    return f"recording a video at step {step:,}: {steps:,} step{'' if steps == 1 else 's'}"


def fleet_note(row: dict[str, Any]) -> str:
    """What the progress bar (before its figures: :func:`bar_postfix`) and lines (after theirs) add while the fleet
    of env servers is degraded, from an update's metrics row (as of the end of the rollout it learned from): the
    servers down of those in the fleet (``faults/servers_down``: lost and being reconnected, found broken, or back
    but not stepping yet; of those and the ones up, ``fleet/servers``), then the servers listed at the start that
    it went on without and that have not joined since (``faults/servers_not_joined``): ``1 of 3 servers down``,
    ``1 of 3 servers down, 1 not joined``, ``2 servers not joined``. "" while every server is up, and for envs without servers (--backend gym: a row
    without those keys), so that the usual bar and lines stay as they were. Else a fleet going on without some of
    its envs showed nothing but a lower SPS there: the warnings that say so at the time grow rarer as it stays so.
    (Servers listed at a later look-up that do not join are no part of the fleet yet: their warnings say so.)"""
    down, not_joined = int(row.get("faults/servers_down", 0)), int(row.get("faults/servers_not_joined", 0))
    said = []
    if down:
        up = row.get("fleet/servers")  # (absent: envs that count their servers down but not those up)
        counted = down if up is None else down + int(up)
        said.append(f"{down}{'' if up is None else f' of {counted}'} server{'s' if counted > 1 else ''} down")
    if not_joined:
        said.append(f"{not_joined} {'' if said else 'server ' if not_joined == 1 else 'servers '}not joined")
    return ", ".join(said)


def fleet_down_note(servers: int, seconds: float, not_joined: int = 0, *, waiting: bool = True) -> str:
    """What the progress bar and lines say instead of :func:`fleet_note` while every server of the fleet is down
    (``learner train`` waits for one to come back, up to --give-up-after): ``all 2 servers down for 35 s, waiting``,
    ``the only server down for 3 min, waiting`` (``seconds``: since the loop found them all down; under a second,
    ``all 2 servers down, waiting``), then the listed servers that have not joined, as fleet_note says them
    (``all 2 servers down for 35 s, 1 not joined, waiting``; ``1 of 1 server down ..., 2 not joined``, not "the
    only server", which read as a fleet of one). ``waiting``: False for the bar's last state, a run
    stopped (Ctrl-C) or given up in the outage. Else no update came while it lasted, and the bar (and the lines)
    went on showing the last update's figures, frozen, for minutes: a program that looked hung."""
    # (one server joined of several listed: "1 of 1 server", as fleet_note says it, not "the only server")
    only = "1 of 1 server" if not_joined else "the only server"
    who = only if servers == 1 else f"all {servers} servers" if servers else "every server"
    said = f"{who} down" if seconds < 1 else f"{who} down for {_duration(seconds)}"
    if not_joined:
        said += f", {not_joined} not joined"
    return f"{said}, waiting" if waiting else said


def waiting_line(
    row: dict[str, Any], total: int, *, step: int, seconds: float, note: str, evaluation: float | None = None
) -> str:
    """A progress line while every server is down (``note``: :func:`fleet_down_note`): the last update's
    figures (``row``; ``{}`` before the first update: ``step``, the session's first, and no SPS nor return),
    the run's ``seconds`` as of now, no time left (nothing steps), then ``note``: ``step 8,960/200,000 (4%),
    1,041 SPS, mean return 151.9, 29 s, all 2 servers down for 20 s, waiting``; then, as :func:`progress_line`
    and the bar during the outage, the last evaluation's mean return (``evaluation``, --eval-every:
    :func:`eval_note`), which these lines alone dropped while the outage lasted."""
    head = _line_head(row.get("global_step", step), total, row.get("sps"), row.get("episodic_return_mean"), seconds)
    return f"{head}, {note}{eval_note(evaluation)}"


def _line_head(step: int, total: int, sps: float | None, recent: float | None, seconds: float) -> str:
    """The figures every progress line starts with, :func:`progress_line`'s and :func:`waiting_line`'s alike:
    ``step 8,960/200,000 (4%), 1,041 SPS, mean return 151.9, 29 s``; an SPS or a return not known yet (None: no
    update yet, or no episode ended) reads ``-``. (Each line wrote it out again, the two copies kept in step by
    hand.)"""
    return (
        f"step {step:,}/{total:,} ({100 * step / max(total, 1):.0f}%), {'-' if sps is None else f'{sps:,.0f}'} SPS, "
        f"mean return {'-' if recent is None else format_return(recent)}, {seconds:.0f} s"
    )


def _duration(seconds: float) -> str:
    """A time left, as precise as such a guess is: seconds, then minutes, then hours (rounded first,
    so that 119.6 s reads 2 min, not 120 s)."""
    if round(seconds) < 120:
        return f"{seconds:.0f} s"
    if round(seconds / 60) < 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def bar_postfix(sps: float | None, recent: float | None, note: str = "") -> str:
    """What the training progress bar shows after its count: ``note`` first, where there is something to say (what a
    degraded fleet is missing, :func:`fleet_note`; every server down, :func:`fleet_down_note`; an evaluation or a
    video under way, :func:`eval_running_note`, :func:`video_running_note`), then SPS and the recent mean return
    (``1 of 3 servers down, SPS 1,648, return 500.0``). The note before the figures, for all of them alike: tqdm
    cuts the bar at the terminal's width, and a note after them was what a narrow terminal cut (on 80 columns,
    ``0% 19.2k/100M steps, SPS 3,266, return 199.4, all 2 servers down for 10 s, wa``), the figures, which stay
    the last update's, being what it can spare. (A fleet's partial outage, and a stopped run's last frame, still
    came after them once the other notes came first.)"""
    shown = f"SPS {'-' if sps is None else f'{sps:,.0f}'}, return {'-' if recent is None else format_return(recent)}"
    return f"{note}, {shown}" if note else shown


class _TqdmHandler(logging.Handler):
    """Stands in for a console handler while a progress bar is up: formats a record with that
    handler's formatter and writes it with ``tqdm.write``, which clears the bar, writes the line and
    draws the bar again below it; written straight to the stream, the record would continue the
    bar's line (a bar ends in a carriage return, not a newline)."""

    def __init__(self, console: logging.StreamHandler[Any], stream: Any) -> None:
        super().__init__(console.level)
        self.setFormatter(console.formatter)
        self.filters = list(console.filters)
        self._stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self._stream)
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def logging_above_bar() -> Iterator[None]:
    """While the block runs (a progress bar is up), the root logger's console handlers (a
    ``StreamHandler`` on stderr or stdout, as ``configure_logging`` makes: text or JSON) and
    ``logging.lastResort`` (no logging configured) write through ``tqdm.write``; restored after.
    Handlers of files and of log collectors are left as they are. So do Python's warnings where they are
    printed as Python prints them (text logs; not captured as records, as JSON logs have them): an in-process
    env's (--backend gym) continued the bar's line and left its frame on the screen."""
    global _bars_up, _python_s_showwarning
    with _bars_lock:  # (from the first bar up to the last one's end: two may be up at once, ending in any order)
        if not _bars_up and _is_python_s(warnings.showwarning):
            _python_s_showwarning, warnings.showwarning = warnings.showwarning, _warning_above_bar
        _bars_up += 1
    try:
        with _handlers_above_bar():
            yield
    finally:
        with _bars_lock:
            _bars_up -= 1
            if not _bars_up and warnings.showwarning is _warning_above_bar:
                warnings.showwarning = _python_s_showwarning


_bars_lock = threading.Lock()
_bars_up = 0  # (logging_above_bar's blocks under way)
_python_s_showwarning: Any = warnings.showwarning


def _is_python_s(function: Any) -> bool:
    """Whether ``function`` is the warnings module's own (not a replacement: logging.captureWarnings's, a test's)."""
    return getattr(function, "__module__", None) in ("warnings", "_py_warnings")


def _warning_above_bar(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    """warnings.showwarning while a bar is up: a warning for stderr written above the bar. Any other (for a file of
    its own; while warnings are recorded, by catch_warnings(record=True) or pytest) as Python would show it."""
    from tqdm import tqdm

    recording = not _is_python_s(getattr(warnings, "_showwarnmsg_impl", _python_s_showwarning))
    if recording or (file is not None and file is not sys.stderr):
        _python_s_showwarning(message, category, filename, lineno, file, line)
    elif sys.stderr is not None:  # (none: Python's drops it too)
        with contextlib.suppress(OSError):  # (as Python's: a warning that cannot be written is lost)
            tqdm.write(warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"), file=sys.stderr)


@contextlib.contextmanager
def _handlers_above_bar() -> Iterator[None]:
    """logging_above_bar's for the logging handlers."""
    root = logging.getLogger()
    last_resort = logging.lastResort
    console = (sys.stderr, sys.stdout)
    stand_ins: dict[logging.Handler, logging.Handler] = {
        _TqdmHandler(h, h.stream): h
        for h in root.handlers
        if isinstance(h, logging.StreamHandler) and any(h.stream is s for s in console)
    }
    originals = {h: stand_in for stand_in, h in stand_ins.items()}
    root.handlers = [originals.get(h, h) for h in root.handlers]
    ours = _TqdmHandler(last_resort, sys.stderr) if isinstance(last_resort, logging.StreamHandler) else None
    if ours is not None:
        logging.lastResort = ours
    try:
        yield
    finally:  # (the handlers added or removed meanwhile stay so)
        root.handlers = [stand_ins.get(h, h) for h in root.handlers]
        # Only its own stand-in: two bars up at once (train() in a thread, evaluate() in the notebook) may
        # end in either order, and the second saw the first's stand-in as the last resort.
        if ours is not None and logging.lastResort is ours:
            logging.lastResort = last_resort


def bar_by_default() -> bool:
    """Whether a command shows a progress bar where it is not told (--progress, --no-progress): on stderr a
    terminal of a known size, or in a notebook. A terminal whose size was never set (0 rows: ``script -c``,
    ``ssh -tt`` or ``docker exec -t`` run from a script) showed nothing at all, as tqdm draws no bar there and
    training then wrote no progress lines either, until its summary: it gets the lines."""
    if not sys.stderr.isatty():
        return in_notebook()
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError):  # (no size to be had: tqdm's defaults)
        return True
    return size.lines > 0 and size.columns > 0


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel's (a notebook's, JupyterLab's, VS Code's): IPython's shell
    is ipykernel's ZMQInteractiveShell. Its stderr is no terminal, yet shows a progress bar well. Looked up
    in ``sys.modules`` only: nothing is imported where no kernel runs."""
    zmqshell, ipython = sys.modules.get("ipykernel.zmqshell"), sys.modules.get("IPython")
    shell_class = getattr(zmqshell, "ZMQInteractiveShell", None)
    get_ipython = getattr(ipython, "get_ipython", None)
    if not isinstance(shell_class, type) or get_ipython is None:
        return False
    try:
        return isinstance(get_ipython(), shell_class)
    except Exception:  # (an IPython of another make: no notebook to go by)
        return False


def _tqdm_class() -> Any:
    """tqdm's widget bar in a notebook that can show one (ipywidgets installed), else its text bar, which
    a notebook shows as well: ``tqdm.auto`` without ipywidgets would warn "IProgress not found" (and fall
    back to the text bar all the same)."""
    if in_notebook() and importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.auto import tqdm as auto_tqdm

        return auto_tqdm
    from tqdm import tqdm

    return _narrow_as_well(tqdm)


NARROW_COLUMNS = 80
"""Below this width the text bar leaves out its bar and times (see _narrow_as_well)."""


@functools.cache
def _narrow_as_well(tqdm: Any) -> Any:
    """tqdm's text bar, which on a terminal narrower than :data:`NARROW_COLUMNS` shows its count and figures
    alone (``17% 10.2k/60.0k steps, SPS 2,180, return 187.9``): tqdm shrinks the bar to one character, then cuts
    the line at the width, and at 60 columns the return read ``return 1`` for 187.9 (at 40 neither figure came).

    On a terminal whose size was never set (0 rows and columns, or 0 rows alone: ``script -c`` run from a script,
    some CI runners, ``docker run -t`` before a size is set) it draws the bar as where no size is to be had: tqdm
    takes a size one less than the terminal's, -1 rows and -1 columns there, and draws nothing at -1 rows (its
    ``display`` hides a bar at a position past the rows, as below a screen full of bars), and cuts the line's
    last character off at -1 columns. ``learner train --progress`` on such a terminal showed nothing at all
    until its summary, a silent run (without --progress, :func:`bar_by_default` gives it the progress lines).
    Such a size is none: tqdm's defaults, 20 rows and a line not cut (its bar 10 characters wide)."""

    class Bar(tqdm):
        # (tqdm sets them as it starts and, with dynamic_ncols, at each redraw, from the terminal's size less one)
        @property
        def nrows(self) -> int | None:
            return self._sized_rows

        @nrows.setter
        def nrows(self, value: int | None) -> None:
            self._sized_rows = value if value is None or value > 0 else None

        @property
        def ncols(self) -> int | None:
            return self._sized_columns

        @ncols.setter
        def ncols(self, value: int | None) -> None:
            self._sized_columns = value if value is None or value > 0 else None

        @property
        def format_dict(self) -> dict[str, Any]:
            shown: dict[str, Any] = super().format_dict
            if shown.get("ncols") and shown["ncols"] < NARROW_COLUMNS and shown.get("bar_format"):
                shown["bar_format"] = "{percentage:3.0f}% {n_fmt}/{total_fmt} " + f"{shown['unit']}s{{postfix}}"
            return shown

    return Bar


def widget_total(bar: Any) -> None:
    """tqdm's notebook widget keeps the total it was made with (its progress's ``max``) when ``total``
    changes: made to follow, so that a full bar looks full."""
    children: Any = getattr(getattr(bar, "container", None), "children", ())
    if len(children) > 1 and hasattr(children[1], "max"):
        children[1].max = bar.total


@contextlib.contextmanager
def progress_bar(show: bool, total: int, initial: int = 0, *, unit: str = "step", scale: bool = True) -> Iterator[Any]:
    """A tqdm bar on stderr counting ``unit``s up to ``total`` (``scale``: as 12.3k), or None when not
    ``show`` (callers pass :func:`bar_by_default` unless told, so that logs and pipes stay free of it). In a
    notebook with ipywidgets, tqdm's widget instead.
    While it is up, log records are written above it (see logging_above_bar), not into its line.

    Its time left is at the rate since it started (tqdm's ``smoothing=0``: the ``initial`` count not
    counted), as the progress lines' is at the session's SPS: tqdm's default, a moving average of the
    rates between redraws, swung from 114 h to 736 h within minutes of a noisy run. It is redrawn at most
    every tqdm mininterval (0.1 s; TQDM_MININTERVAL sets another). Its times are the monotonic clock's: the
    wall clock set back or ahead mid-run changes neither them nor its redraws."""
    if not show:
        yield None
        return
    tqdm = _tqdm_class()

    bar = tqdm(
        total=total,
        initial=initial,
        unit=unit,
        unit_scale=scale,
        dynamic_ncols=True,
        smoothing=0,
        miniters=1,  # (redrawn by time alone: unsmoothed, tqdm's own grows to the most steps between redraws)
        bar_format=f"{{l_bar}}{{bar}}| {{n_fmt}}/{{total_fmt}} {unit}s [{{elapsed}}<{{remaining}}{{postfix}}]",
    )
    # tqdm keeps time by the wall clock (its _time: time.time), which jumps: set back a day mid-run, the bar
    # was not redrawn again (the time since its last redraw was negative) and ended at -23:59:50; set 3 days
    # ahead, it showed 72 h of a 14-s run. The monotonic clock from its start on. (tqdm's monitor thread,
    # which compares its wall clock with last_print_t, acts on bars of miniters > 1 only.)
    bar._time = time.monotonic
    bar.start_t = bar.last_print_t = bar._time()
    try:
        with logging_above_bar():
            yield bar
    finally:
        bar.close()


def close_bar(
    bar: Any,
    summary: dict[str, Any],
    stop_reason: str | None,
    since: tuple[float, int],
    fleet: str = "",
    evaluation: float | None = None,
) -> None:
    """The training bar's last state, before it closes: the run's final figures (summary.json's), not
    those of its last update. A run stopped by --stop-at-return ends at 100% of the steps it took (the
    bar's total was --total-timesteps, whose remaining time it would show); one stopped by Ctrl-C
    keeps its total (it is to be resumed). ``since``: (time.perf_counter(), step) of the session's start:
    the SPS of a run stopped mid-rollout counts the steps after its last update too. ``fleet``: the last
    update's :func:`fleet_note`, which the bar went on showing (the SPS of a run that ended with servers down
    is that of a smaller fleet), or, for a run that ended while every server was down, that outage
    (:func:`fleet_down_note`, no longer waiting): before the figures, as the bar said it (:func:`bar_postfix`).
    ``evaluation``: the last evaluation's mean return, which the bar went on showing too (:func:`eval_note`; None:
    none ran)."""
    step, sps = summary["total_steps"], summary["sps"]
    if stop_reason == "stop_at_return":
        bar.total = step
        widget_total(bar)
        sps = (step - since[1]) / max(time.perf_counter() - since[0], 1e-9)
    if stop_reason in ("stop_at_return", "total_timesteps") and step >= bar.n:
        bar.update(step - bar.n)
    bar.set_postfix_str(bar_postfix(sps, summary["final_return_mean"], fleet) + eval_note(evaluation))
