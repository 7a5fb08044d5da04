"""A signal's KeyboardInterrupt, raised where it cannot be lost: never inside one of the event loop's
callbacks (see :func:`interrupt`). Apart from :mod:`learner.loop` so that the commands' signal handlers
(:mod:`learner.progress`) can use it without importing gRPC, which reads its settings when imported."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import weakref
from collections.abc import Iterator
from types import FrameType

__all__ = [
    "interrupt",
    "interrupts_held",
    "raise_pending_interrupt",
    "signals_wake",
    "start_forkserver_deaf_to_ctrl_c",
    "take_ctrl_c",
]

# LoopRunner's loops, each added as its runner is made (a signal's interrupt waits for their next
# callback: see interrupt), and the one a signal handler left a KeyboardInterrupt for, not raised yet
# (None: none is pending).
ours: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
_interrupt_pending_on: asyncio.AbstractEventLoop | None = None
# (interrupts_held's: whether a block holds interrupts now, and whether one came meanwhile)
_held = 0  # (how many blocks deep)
_held_interrupt = False
_breakable = False  # (whether the innermost block lets a second interrupt through)


def interrupt() -> None:
    """Raise KeyboardInterrupt, for a signal handler (Ctrl-C, a command's SIGTERM): at once, or, where
    this thread runs one of :class:`~learner.loop.LoopRunner`'s event loops just then, as that loop's
    next callback, and at the latest once the loop stops (LoopRunner's calls look); inside
    :func:`interrupts_held`'s block, as that block ends.

    A handler runs wherever the main thread is, and raised in the middle of one of the loop's
    callbacks the interrupt could be lost: gRPC's completion callbacks (Cython, ``noexcept``) print it
    and swallow it, and with it the wakeup of the task that waited for the call, which then waits for
    ever, whatever its deadline (a SIGTERM as a learner waited for its servers left it running; in a
    script stepping a fleet over TCP about one Ctrl-C in ten hung it). Another loop (a caller's own:
    ``asyncio.run``, a notebook's kernel) is not waited for: the code that runs in it may not return to
    it for long, a step of RemoteVectorEnv's included."""
    global _interrupt_pending_on, _held_interrupt
    if _held and not (_breakable and _held_interrupt):
        _held_interrupt = True  # (raised as the block ends: interrupts_held)
        return
    _held_interrupt = False  # (a breakable block's second: raised now, not again as the block ends)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # (no loop runs here: the usual case, between steps)
        loop = None
    if loop is None or loop not in ours:
        raise KeyboardInterrupt
    _interrupt_pending_on = loop
    loop.call_soon_threadsafe(raise_pending_interrupt, loop)  # (which wakes the loop, as a signal did)


@contextlib.contextmanager
def interrupts_held(*, drop: bool = False, breakable: bool = False) -> Iterator[None]:
    """A block of the main thread that a signal's interrupt (:func:`interrupt`: the command's Ctrl-C,
    SIGTERM, SIGHUP) does not break: one that comes meanwhile is raised as it ends, or with ``drop``
    not at all (it came too late to stop anything: what the block did is the command's last word). For
    what must be done whole or not at all, and be known which (eval --json's object written, and noted
    so: see learner.cli). ``breakable``: a second interrupt (a Ctrl-C again, not a double tap) is raised
    at once, for a block that may take long (it starts processes that build envs, which can hang). A
    KeyboardInterrupt raised before the block begins, or as it ends, is outside it; one raised otherwise
    (Python's own handler, left in place) is not held. Blocks nest: the outermost one's end raises (or
    drops) what came during any of them."""
    global _held, _held_interrupt, _breakable
    if threading.current_thread() is not threading.main_thread():  # (signals interrupt the main thread only)
        yield
        return
    if not _held:
        _held_interrupt = False  # (one left by an earlier block, raised otherwise as it ended)
    _held += 1
    outer_breakable, _breakable = _breakable, breakable
    try:
        yield
    finally:
        _held -= 1
        _breakable = outer_breakable
        if not _held and _held_interrupt:
            _held_interrupt = False
            if not drop:
                raise KeyboardInterrupt


def raise_pending_interrupt(loop: asyncio.AbstractEventLoop) -> None:
    """Raise the KeyboardInterrupt :func:`interrupt` left for ``loop``, if it is not raised yet: only
    there, and only in the main thread, whose signal it is (another thread's calls on a loop of its own
    do not take it, nor does a close run on the main thread's loop by a worker, a garbage collection's
    finalizer say: the main thread's next call raises it)."""
    global _interrupt_pending_on
    if _interrupt_pending_on is loop and threading.current_thread() is threading.main_thread():
        _interrupt_pending_on = None
        raise KeyboardInterrupt


# signals_wake's socket pair, made at its first use and kept for the process's life: its write end may stay the
# wakeup fd (an interrupt that came between its setting and the block's start, or during the block's end, leaves it
# there), and a number closed then taken by another file would get every signal's byte. The loops that watch its
# read end (those that cannot: Windows' proactor loop, no add_reader), and the program's own wakeup fd it stands in
# for while a block lasts (-1: none).
_wakeup: tuple[socket.socket, socket.socket] | None = None
_watching: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
_deaf: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
_forward = -1


def _drain() -> None:
    """What came to the wakeup socket (the signals' numbers, a byte each): dropped, or handed to :data:`_forward`."""
    assert _wakeup is not None
    try:
        data = _wakeup[0].recv(4096)
    except OSError:  # (BlockingIOError: another loop read it)
        return
    if data and _forward != -1:
        with contextlib.suppress(OSError):  # (its reader gone, or full: as a signal's own write would be)
            os.write(_forward, data)


def _wakeup_fd(loop: asyncio.AbstractEventLoop) -> int:
    """The wakeup socket's write end, the socket made and ``loop`` watching it (first) where they are not yet;
    -1 where ``loop`` cannot watch it."""
    global _wakeup
    if loop in _watching:
        assert _wakeup is not None
        return _wakeup[1].fileno()
    if loop in _deaf:
        return -1
    if _wakeup is None:
        read, write = socket.socketpair()
        read.setblocking(False)
        write.setblocking(False)  # (as set_wakeup_fd asks: a signal's handler never waits on it)
        _wakeup = read, write
    try:
        loop.add_reader(_wakeup[0].fileno(), _drain)
    except NotImplementedError:
        _deaf.add(loop)
        return -1
    _watching.add(loop)
    return _wakeup[1].fileno()


class signals_wake:  # (lower case: a context manager used as a function is, ``with signals_wake(loop):``)
    """A block in which the main thread runs ``loop``: a signal (Ctrl-C, a command's SIGTERM) wakes it at once.

    Python runs a signal's handler (which raises KeyboardInterrupt, or asks the loop to: :func:`interrupt`) only
    once the main thread is back in Python code. A signal that came as the loop was about to wait in the system
    (its handler's checks done, the wait not begun), or that another thread took (a process's signal may go to
    any thread: macOS picks one), did not end that wait: the handler ran only when something else woke the loop,
    its next timer or a call's answer, which for a wait on a hanging server can be its deadline (a second Ctrl-C
    during the release of a connect's claims waited 10-30 s so, about 1 run in 6 of test_loop.py beside another
    pytest worker). So the signal's arrival is written, as asyncio's own signal handling does, to a socket the
    loop watches (``signal.set_wakeup_fd``), for the block's length only: the program's own wakeup fd (a loop of
    its own with signal handlers, not running meanwhile) is put back as the block ends, and gets what came
    meanwhile. Elsewhere than in the main thread, nothing (signals are the main thread's). (A class, not a
    generator's context manager: entered at every step, it costs ~1 us, not ~3.)"""

    __slots__ = ("_fd", "_previous")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._fd = _wakeup_fd(loop) if threading.current_thread() is threading.main_thread() else -1
        self._previous = -1

    def __enter__(self) -> None:
        global _forward
        if self._fd != -1:
            self._previous = previous = signal.set_wakeup_fd(self._fd, warn_on_full_buffer=False)
            if previous != self._fd:  # (else a block inside one, whose end puts the program's back)
                _forward = previous

    def __exit__(self, *exc_info: object) -> None:
        global _forward
        if self._fd != -1 and self._previous != self._fd:
            signal.set_wakeup_fd(self._previous)
            _forward = -1


def _interrupt_on_signal(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C's handler where the program left it to Python's own (see :func:`take_ctrl_c`):
    KeyboardInterrupt, as Python's is, by way of :func:`interrupt`."""
    interrupt()


def take_ctrl_c() -> None:
    """For the main thread's runner, made with its first fleet: where the program left Ctrl-C to Python
    (``signal.default_int_handler``, as a script does), a handler that raises KeyboardInterrupt as that
    one does, but never in the middle of one of the loop's callbacks (:func:`interrupt`). Once, and for
    the process's life; a handler of the program's own is left as it is. (``asyncio.run``, later in the
    same program, then keeps this one rather than installing its own: a Ctrl-C there raises
    KeyboardInterrupt where the code is, as before Python 3.11, instead of cancelling its main task.)"""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt_on_signal)


def start_forkserver_deaf_to_ctrl_c() -> None:
    """Start multiprocessing's forkserver (if it is not running) deaf to Ctrl-C, as the processes it starts then
    are, and return once it has imported its preload (call before the first subprocess starts through it). A
    terminal's Ctrl-C reaches every process of the command: the forkserver printed a KeyboardInterrupt traceback
    while it imported its preload, and so did each subprocess while it unpickled its target (an import: numpy's
    said ``PyCapsule_Import could not import module "datetime"``), before that target could ignore it. The
    command stops them itself, as it closes what started them.

    Ignored, not blocked, as it is started (the few ms of a fork and exec: a Ctrl-C just then is lost): a blocked
    SIGINT does not stay blocked (starting multiprocessing's resource tracker, first, unblocks it in this thread),
    an ignored one stays ignored through an exec. Elsewhere than in the main thread it is started as it would be (no signal
    handling there)."""
    import multiprocessing
    import multiprocessing.forkserver

    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            signal.signal(signal.SIGINT, previous)
    # Once it has imported its preload: a vector env stopped while its workers wait for that (a Ctrl-C as the
    # first one starts) would leave them to start later, without what they need, each saying so in a traceback.
    ready = multiprocessing.get_context("forkserver").Process(target=int, daemon=True)
    ready.start()
    ready.join()
