"""What train and eval show while they run (a progress bar, or lines in a log), and Ctrl-C as a request to stop."""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import logging
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

from learner.stats import format_return

__all__ = [
    "DOUBLE_TAP_S",
    "StopRequest",
    "ending_as_interrupt",
    "bar_postfix",
    "close_bar",
    "in_notebook",
    "logging_above_bar",
    "progress_bar",
    "progress_line",
    "widget_total",
]

log = logging.getLogger(__name__)

DOUBLE_TAP_S = 0.5
"""A second Ctrl-C this soon after the first is the same press (a key pressed twice in a hurry, a
terminal's Ctrl-C sent twice), not a request to abort: aborting would throw away the stop's checkpoint."""

# Signals that ask the process to end, besides Ctrl-C: an orchestrator's SIGTERM (docker stop, systemd,
# Kubernetes), SIGHUP (the terminal closed, an ssh session dropped). Not on Windows, which has neither.
_ENDING = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
_ended = False  # one of them came: the process is to end, and later ones change nothing
_stopped = False  # a signal (Ctrl-C too) asked a StopRequest to stop (see ending_as_interrupt)


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
                if sig == signal.SIGINT or signal.getsignal(sig) is not signal.SIG_IGN:
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        global _ended, _stopped
        _stopped = True
        if signum != signal.SIGINT:
            _ended = True
        if self.signalled:
            if signum == signal.SIGINT and time.monotonic() - self._at >= DOUBLE_TAP_S:
                raise KeyboardInterrupt
            return  # (a double tap, a second SIGTERM or SIGHUP: the stop asked for stands)
        self.signalled, self._at = True, time.monotonic()
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self._log.warning("%s: stopping after this step (%s); Ctrl-C again to abort at once", what, self._then)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _end_as_interrupt(signum: int, frame: FrameType | None) -> None:
    global _ended
    if _ended:  # (the process is ending already: closing down, as asked)
        return
    _ended = True
    raise KeyboardInterrupt


@contextlib.contextmanager
def ending_as_interrupt() -> Iterator[None]:
    """For a command's whole run (the learner's CLI): the first SIGTERM or SIGHUP interrupts as Ctrl-C
    does where no :class:`StopRequest` takes it (starting up, closing down), so that the command closes
    what it opened (its servers, their socket folder) and says so; later ones, and those after a stop
    they asked for, change nothing, to the process's exit (a Ctrl-C after one that stopped the command
    too, once the interpreter exits). A signal ignored when it begins stays ignored."""
    global _ended, _stopped
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _ended = _stopped = False
    # (None: a handler not set from Python, which cannot be put back: left alone)
    previous = {sig: handler for sig in _ENDING if (handler := signal.getsignal(sig)) is not None}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, _end_as_interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if _stopped or _ended:  # (asked to stop or end: the process's exit is as asked, unbroken)
            _quiet_exit()


_quiet_exit_registered = False


def _quiet_exit() -> None:
    """Ignore Ctrl-C, SIGTERM and SIGHUP once the interpreter exits (atexit: not in a process that
    goes on after the command, a test's): a second Ctrl-C after the one that stopped the command
    (a double tap), or a second SIGTERM, would break the exit (torch's atexit hooks' traceback, a
    status of -2 or -15 instead of the command's)."""
    global _quiet_exit_registered
    if not _quiet_exit_registered:
        _quiet_exit_registered = True
        atexit.register(_ignore_signals)


def _ignore_signals() -> None:
    for sig in (signal.SIGINT, *_ENDING):
        signal.signal(sig, signal.SIG_IGN)


def progress_line(row: dict[str, Any], total: int) -> str:
    """An update's metrics row as one line, for logs: steps, share done, SPS, recent return, elapsed
    and, until ``total``, the time left at this session's SPS."""
    step, recent = row["global_step"], row["episodic_return_mean"]
    line = (
        f"step {step:,}/{total:,} ({100 * step / max(total, 1):.0f}%), {row['sps']:,.0f} SPS, "
        f"mean return {'-' if recent is None else format_return(recent)}, {row['seconds']:.0f} s"
    )
    if step < total and row["sps"] > 0:
        line += f", ~{_duration((total - step) / row['sps'])} left"
    return line


def _duration(seconds: float) -> str:
    """A time left, as precise as such a guess is: seconds, then minutes, then hours (rounded first,
    so that 119.6 s reads 2 min, not 120 s)."""
    if round(seconds) < 120:
        return f"{seconds:.0f} s"
    if round(seconds / 60) < 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def bar_postfix(sps: float | None, recent: float | None) -> str:
    """What the training progress bar shows after its count: SPS and the recent mean return."""
    return f"SPS {'-' if sps is None else f'{sps:,.0f}'}, return {'-' if recent is None else format_return(recent)}"


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
    Handlers of files and of log collectors are left as they are."""
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

    return tqdm


def widget_total(bar: Any) -> None:
    """tqdm's notebook widget keeps the total it was made with (its progress's ``max``) when ``total``
    changes: made to follow, so that a full bar looks full."""
    children: Any = getattr(getattr(bar, "container", None), "children", ())
    if len(children) > 1 and hasattr(children[1], "max"):
        children[1].max = bar.total


@contextlib.contextmanager
def progress_bar(show: bool, total: int, initial: int = 0, *, unit: str = "step", scale: bool = True) -> Iterator[Any]:
    """A tqdm bar on stderr counting ``unit``s up to ``total`` (``scale``: as 12.3k), or None when not
    ``show`` (callers pass ``sys.stderr.isatty()`` unless told, so that logs and pipes stay free of it;
    train also ``in_notebook()``). In a notebook with ipywidgets, tqdm's widget instead.
    While it is up, log records are written above it (see logging_above_bar), not into its line."""
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
        bar_format=f"{{l_bar}}{{bar}}| {{n_fmt}}/{{total_fmt}} {unit}s [{{elapsed}}<{{remaining}}{{postfix}}]",
    )
    try:
        with logging_above_bar():
            yield bar
    finally:
        bar.close()


def close_bar(bar: Any, summary: dict[str, Any], stop_reason: str | None, since: tuple[float, int]) -> None:
    """The training bar's last state, before it closes: the run's final figures (summary.json's), not
    those of its last update. A run stopped by --stop-at-return ends at 100% of the steps it took (the
    bar's total was --total-timesteps, whose remaining time it would show); one stopped by Ctrl-C
    keeps its total (it is to be resumed). ``since``: (time.perf_counter(), step) of the session's start:
    the SPS of a run stopped mid-rollout counts the steps after its last update too."""
    step, sps = summary["total_steps"], summary["sps"]
    if stop_reason == "stop_at_return":
        bar.total = step
        widget_total(bar)
        sps = (step - since[1]) / max(time.perf_counter() - since[0], 1e-9)
    if stop_reason in ("stop_at_return", "total_timesteps") and step >= bar.n:
        bar.update(step - bar.n)
    bar.set_postfix_str(bar_postfix(sps, summary["final_return_mean"]))
