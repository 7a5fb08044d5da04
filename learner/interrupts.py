"""A signal's KeyboardInterrupt, raised where it cannot be lost: never inside one of the event loop's
callbacks (see :func:`interrupt`). Apart from :mod:`learner.loop` so that the commands' signal handlers
(:mod:`learner.progress`) can use it without importing gRPC, which reads its settings when imported."""

from __future__ import annotations

import _signal
import asyncio
import atexit
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
    it for long, a step of RemoteVectorEnv's included. Inside :class:`signals_wake`'s block (the main thread
    about to run its loop, or just done with it), the interrupt is that loop's, as while it runs."""
    global _interrupt_pending_on, _held_interrupt
    if _held and not (_breakable and _held_interrupt):
        _held_interrupt = True  # (raised as the block ends: interrupts_held)
        return
    _held_interrupt = False  # (a breakable block's second: raised now, not again as the block ends)
    loop: asyncio.AbstractEventLoop | None
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # (no loop runs here: the usual case, between steps)
        # (inside signals_wake's block, not running its loop just then: as it begins or ends its run, and at the
        # block's very ends, where a KeyboardInterrupt raised would leave the wakeup fd swapped: the loop's too)
        loop = _waking
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


# signals_wake's socket pair, made at its first use and kept for the process's life: its write end is the wakeup fd only
# while a block lasts, but a fork child started meanwhile (by another thread) keeps it as its own, and a number closed
# then taken by another file would get every signal's byte. The loops that watch its read end (those that cannot:
# Windows' proactor loop, no add_reader), and the program's own wakeup fd it stands in for while a block lasts (-1:
# none).
_wakeup: tuple[socket.socket, socket.socket] | None = None
_watching: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
_deaf: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()
_forward = -1
# The loop of the signals_wake block the main thread is in (None: none), whose interrupts it takes (see interrupt).
_waking: asyncio.AbstractEventLoop | None = None
_exited = False  # (the interpreter ends: see _let_go_at_exit)


def _let_go_at_exit() -> None:
    """As the interpreter ends (atexit): the wakeup socket pair's objects let go of their file descriptors, left open
    (the process's end closes them). Kept for the process's life, they were garbage once the interpreter cleared this
    module, and said so (``ResourceWarning: unclosed <socket.socket ...>``, twice, under ``-X dev``); closed here
    instead, their numbers could be taken by another file that a loop still watches. A loop run after this (a
    finalizer's close) runs without them: no block swaps the wakeup fd then (and what came before is read now: a
    loop still watching the read end is not woken by it for ever)."""
    global _exited
    if _wakeup is not None:
        _drain(dry=True)
        for end in _wakeup:
            end.detach()
    _exited = True


def _drain(*, dry: bool = False) -> None:
    """What came to the wakeup socket (the signals' numbers, a byte each): dropped, or handed to :data:`_forward`.
    ``dry``: all of it (as a block ends: what came after the loop's last look would wait for the next block).

    Not on another thread's run: a loop the main thread once ran (the close of an env a worker made, run here by
    run_or_schedule) watched the socket for good, and run later by its own thread it read the byte that was to
    wake the main thread's loop, which then slept on (2 waits in 100 ran to their end so). That loop stops watching;
    the main thread's next run of it watches again."""
    assert _wakeup is not None
    if _exited:  # (let go of: nothing to read through them)
        return
    if not dry and threading.current_thread() is not threading.main_thread():
        loop = asyncio.get_running_loop()
        loop.remove_reader(_wakeup[0].fileno())
        _watching.discard(loop)
        return
    while True:
        try:
            data = _wakeup[0].recv(4096)
        except OSError:  # (BlockingIOError: nothing more, or another loop read it)
            return
        if data and _forward != -1:
            with contextlib.suppress(OSError):  # (its reader gone, or full: as a signal's own write would be)
                os.write(_forward, data)
        if not dry or len(data) < 4096:
            return


def _wakeup_fd(loop: asyncio.AbstractEventLoop) -> int:
    """The wakeup socket's write end, the socket made and ``loop`` watching it (first) where they are not yet;
    -1 where ``loop`` cannot watch it."""
    global _wakeup
    if _exited:
        return -1
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
        atexit.register(_let_go_at_exit)
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

    __slots__ = ("_fd", "_loop", "_outer", "_previous")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        if threading.current_thread() is threading.main_thread():
            take_ctrl_c()  # (again at each run: the program may have put Python's handler back since)
            self._fd = _wakeup_fd(loop)
        else:
            self._fd = -1
        self._loop = loop
        self._outer: asyncio.AbstractEventLoop | None = None
        self._previous = -1

    # An interrupt (a signal's handler, run where the main thread is: as a function begins, after each call from
    # it) raised between the swap of the wakeup fd and what remembers it, or as __exit__ begins, left the loop's
    # socket the wakeup fd for good, the program's lost: the next block took it for a block's inside another's
    # and put nothing back, and the program's own loop never heard of its signals again. So from before the swap
    # to the end of the one back, an interrupt is the loop's (see interrupt: :data:`_waking`), as inside the run,
    # and raised by the run (LoopRunner._run_until_complete looks as the run ends, as it fails), or here, once
    # the program's fd is back. (No exception raised here before that: then the with statement calls no __exit__.)
    def __enter__(self) -> None:
        global _forward, _waking
        if self._fd == -1:
            return
        self._outer, _waking = _waking, self._loop
        try:
            self._previous = previous = signal.set_wakeup_fd(self._fd, warn_on_full_buffer=False)
        except BaseException:  # (the swap refused: no block, no __exit__; an interrupt since is the loop's next)
            _waking = self._outer
            raise
        if previous != self._fd:  # (else a block inside one, whose end puts the program's back)
            _forward = previous

    def __exit__(self, *exc_info: object) -> None:
        global _forward, _waking
        if self._fd == -1:
            return
        if self._previous != self._fd:
            try:
                signal.set_wakeup_fd(self._previous)
            except (OSError, ValueError):  # (the program's closed meanwhile: none rather than a number reused)
                signal.set_wakeup_fd(-1)
            if _forward != -1:
                _drain(dry=True)  # (signals that came since the loop last looked: the program's too)
            _forward = -1
        _waking = self._outer
        if _interrupt_pending_on is self._loop:  # (one that came as the block ended, left for the loop)
            try:
                raise_pending_interrupt(self._loop)
            except KeyboardInterrupt:
                if not isinstance(exc_info[1], KeyboardInterrupt):  # (else the one raised stands for it)
                    raise


def _interrupt_on_signal(signum: int, frame: FrameType | None) -> None:
    """Ctrl-C's handler where the program left it to Python's own (see :func:`take_ctrl_c`):
    KeyboardInterrupt, as Python's is, by way of :func:`interrupt`."""
    interrupt()


def take_ctrl_c() -> None:
    """For the main thread's runner, made with its first fleet: where the program left Ctrl-C to Python
    (``signal.default_int_handler``, as a script does), a handler that raises KeyboardInterrupt as that
    one does, but never in the middle of one of the loop's callbacks (:func:`interrupt`), nor inside a
    task. Kept, not put back after; a handler of the program's own is left as it is. (``asyncio.run``,
    later in the same program, then keeps this one rather than installing its own: a Ctrl-C there raises
    KeyboardInterrupt where the code is, as before Python 3.11, instead of cancelling its main task.)

    Again as each run of the main thread's loop begins (:class:`signals_wake`, ~0.05 us): a program that put
    Python's handler back after its first fleet was made (a library's signal handling that restores what it
    found; one that did so for an ``asyncio.run`` of its own, as the README advises) had Ctrl-C raised
    wherever the main thread was, in a task among others: in the Handshake of a connect, after its answer was
    read, the task's outcome was the KeyboardInterrupt, and the session the server granted was never released
    (held for the server's claim timeout); in one of gRPC's completion callbacks, it hung the step (see
    :func:`interrupt`); and asyncio logged "Task exception was never retrieved"."""
    # (_signal's getsignal, not signal's: that one's wrapper looks the handler up in an enum first, ~1.4 us a call)
    if _signal.getsignal(signal.SIGINT) is signal.default_int_handler:
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
