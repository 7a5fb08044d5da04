"""The asyncio event loop RemoteVectorEnv's gRPC calls run on, driven from synchronous code."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import inspect
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from types import FrameType
from typing import Any, Protocol, TypeVar, cast

import grpc.aio

from learner import interrupts

__all__ = ["LoopRunner", "gather"]

T = TypeVar("T")
A = TypeVar("A", bound=Awaitable[Any])  # (a coroutine, a future, ...)

_local = threading.local()
_background: LoopRunner | None = None
_background_lock = threading.Lock()
# The loops of runners nothing holds any more (their thread ended, and every env made on them is gone), with
# the tasks they still had scheduled: a new thread's runner takes one (see LoopRunner.for_this_thread).
# No lock: a runner's finalizer may run in any thread at any allocation (a garbage collection), even
# while that thread takes a loop from here or makes one; list.append and list.pop are atomic.
_spare: list[tuple[asyncio.AbstractEventLoop, set[asyncio.Task[Any]]]] = []
# How long the main thread's wait for a call another thread runs lasts at most before Python looks for signals
# (see _awake_until_done).
SIGNAL_LOOK_S = 0.2


class _Ended:
    """Set once, on another thread (the background loop's, as a call's task ends; a helper's, as its run of the loop
    ends); waited for by the caller's thread (:func:`_awake_until_done`), which a Ctrl-C may interrupt anywhere. A
    plain lock that thread releases, not what Python offers: the wait of a Condition (a concurrent future's, an
    Event's) holds its lock in Python code, ``with`` blocks whose ``__exit__`` is a Python function (a signal's
    handler runs as a function begins), and a KeyboardInterrupt raised there left the lock taken by the main thread:
    the loop's thread, settling the call's future, then waited for it for ever, and the caller for that (the
    background loop's calls, each polled every 0.2 s with ``concurrent.futures.wait``: test_loop.py's Ctrl-C at each
    call of a run hung so). Python 3.11's ``Thread.join``, interrupted, takes the thread for ended, its lock
    released, though it still runs (bpo-45274's cleanup). A lock's own wait, interrupted, is simply not taken, and
    one raised once it is taken leaves it taken: the flag, set before the lock is let go, says so to the next wait."""

    __slots__ = ("_lock", "done")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.done = False

    def set(self) -> None:
        self.done = True
        self._lock.release()

    def wait(self, timeout: float) -> bool:
        """Whether it is set, waiting up to ``timeout`` seconds for it."""
        if not self.done and self._lock.acquire(timeout=timeout):
            self._lock.release()
        return self.done


def _awake_until_done(done: _Ended) -> None:
    """Wait until ``done`` is set (a call another thread runs ended), Python's signal handlers running meanwhile. A
    signal that another thread took (macOS gives a process's signal to any of its threads; Linux when the main
    thread blocks it) sets Python's flag but does not end the main thread's wait on a lock: a Ctrl-C then ran its
    handler only once the call ended by itself, for a hanging server at its deadline (20 s of a 20 s call, in a
    test). So the wait ends every :data:`SIGNAL_LOOK_S` seconds, for Python to run them (no cost to a call shorter
    than that)."""
    while not done.wait(SIGNAL_LOOK_S):
        pass


async def gather(*awaitables: Awaitable[Any], return_exceptions: bool = False) -> list[Any]:
    """``asyncio.gather`` as a coroutine, so that it binds to the loop that runs it (not the default one)."""
    return await asyncio.gather(*awaitables, return_exceptions=return_exceptions)


class Readable(Protocol):
    """What :meth:`LoopRunner.wait` reads from meanwhile (a step-socket step: learner.client.SocketStep)."""

    def fileno(self) -> int: ...

    def receive(self) -> None:
        """Take in what has arrived, without waiting."""

    def done(self) -> bool:
        """Whether all of it is in (or it failed): nothing more to read."""


async def _create_task(call: Coroutine[Any, Any, T] | Callable[[], Coroutine[Any, Any, T]]) -> asyncio.Task[T]:
    return asyncio.get_running_loop().create_task(_made(call))


class LoopRunner:
    """Runs one event loop for synchronous callers.

    The usual runner (:meth:`for_this_thread`) belongs to the calling thread and runs its loop in
    that thread, only while a call needs it: gRPC's own threads keep connections alive and take in
    messages meanwhile, and the next call handles them. That saves two thread switches per call
    compared with a loop on a background thread (~50-100 us each on a busy 2-core machine).

    A thread that already runs an event loop of its own (Jupyter, async applications) cannot run
    another one; it gets the process's background runner instead, whose loop runs forever on a
    helper thread. A runner whose thread has since started a loop of its own (envs made before
    ``asyncio.run``, then used inside it) runs each call on a short-lived helper thread.

    Loops are shared (per thread) and never closed: gRPC binds every loop that ever made a call
    for the life of the process, and delivers late events (of calls cancelled at close) to it. So a
    thread's loop outlives the thread: once nothing holds its runner (the thread ended, and every env
    made on it is gone), the next new thread's runner takes it over, with the tasks it still had.
    Else each short-lived thread that made a fleet (a trial of a sweep, a ThreadPoolExecutor per run)
    would leave a loop behind for good, with its 3 file descriptors and the calls pending on it.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        thread: threading.Thread | None = None,
        scheduled: set[asyncio.Task[Any]] | None = None,
    ) -> None:
        self.loop = loop
        interrupts.ours.add(loop)
        self._thread = thread
        # Held by whichever thread runs the loop (for_this_thread's: the caller's thread): a call from
        # another thread (a close from a worker, a finalizer run by a garbage collection there) runs the
        # loop itself only when it is free, and never takes it from under the thread running it.
        self._running = threading.RLock()
        self._scheduled: set[asyncio.Task[Any]] = set() if scheduled is None else scheduled

    @classmethod
    def for_this_thread(cls) -> LoopRunner:
        """The runner for calls made from the current thread."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the usual case: no loop runs in this thread
            runner: LoopRunner | None = getattr(_local, "runner", None)
            if runner is None:
                try:
                    loop, scheduled = _spare.pop()
                except IndexError:
                    loop, scheduled = asyncio.new_event_loop(), set()
                runner = _local.runner = cls(loop, scheduled=scheduled)
                if threading.current_thread() is threading.main_thread():
                    interrupts.take_ctrl_c()
                weakref.finalize(runner, _spare_loop, loop, scheduled).atexit = False
            return runner
        return _background_runner()

    def run(self, call: Awaitable[T] | Callable[[], Awaitable[T]]) -> T:
        """Run ``call`` on the loop until it is done; return its result or raise its exception.

        ``call``: best a function that makes the coroutine (``lambda: self._connect(...)``), called here, where an
        interrupt cannot lose what it made. A coroutine made by the caller and handed over as it is was lost to a
        Ctrl-C handled as this method was entered (CPython runs a signal's handler as a function starts, and at
        the calls in it): never run, nor closed, it said "RuntimeWarning: coroutine ... was never awaited" on
        stderr as it was collected. (Still taken, for the tests' and a notebook's one-off calls: closed if the
        interrupt comes once inside, not if it comes as this method is entered.)

        Interrupted (Ctrl-C while it waits), the call is cancelled, and its cleanup run, before the
        interrupt goes on: left pending, it would resume at the loop's next run, unseen (a connect then
        claims a server for an env nobody holds)."""
        try:
            if self._thread is None:
                return self._run_until_complete(call)
            return self._run_in_background(call)
        except BaseException:
            _close_unstarted(call)  # (a coroutine handed over, interrupted before it was made a task: see above)
            raise

    def _run_in_background(self, call: Awaitable[T] | Callable[[], Awaitable[T]]) -> T:
        """:meth:`run` on the background loop."""
        # The call's own task, whose end (its cleanup included) the caller waits for (run_coroutine_threadsafe's
        # future, cancelled, is done at once, the task still running).
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        ended = _Ended()  # (set once ``done`` is: what this thread waits on)
        started: list[asyncio.Future[T]] = []
        awaitable: Awaitable[T] | None = None

        def start() -> None:  # (on the loop's thread)
            task = asyncio.ensure_future(awaitable, loop=self.loop)  # type: ignore[arg-type]  # (made below)
            started.append(task)
            task.add_done_callback(lambda _: _settle(task, done, ended))

        scheduled = False
        try:
            with interrupts.interrupts_held():  # (made and handed to the loop whole: an interrupt raised after)
                awaitable = _made(call)
                self.loop.call_soon_threadsafe(start)
                scheduled = True
            _awake_until_done(ended)
            return done.result()
        except BaseException:
            if not scheduled:  # (an interrupt not held: Python's own handler, a thread's; or _made's own error)
                _close_unstarted(awaitable)
            elif not ended.done:  # Ctrl-C in the caller's thread: end the call (scheduled after start) first
                self.loop.call_soon_threadsafe(lambda: _cancel(started[0]))
                _awake_until_done(ended)
            raise

    def _run_until_complete(self, call: Awaitable[T] | Callable[[], Awaitable[T]]) -> T:
        """Run this thread's loop until ``call`` (as :meth:`run` takes it) is done: in this thread, or, where this
        thread now runs an event loop of its own (an env made outside ``asyncio.run`` and used, or closed, inside
        it), on a helper thread for the call: a thread cannot run two loops, and gRPC's channels stay
        bound to the loop they were made on."""
        running = asyncio._get_running_loop()
        if running is self.loop:  # a re-entrant call, which the loop refuses (scheduling nothing)
            refused = _made(call)
            try:
                return self.loop.run_until_complete(refused)
            finally:
                _close_unstarted(refused)
        if running is None:
            with self._running, interrupts.signals_wake(self.loop):
                awaitable: Awaitable[T] | None = None
                task: asyncio.Future[T] | None = None
                try:
                    # Made and scheduled whole or not at all: a Ctrl-C inside ensure_future (Python's signal
                    # handlers run at its calls) could come after the task was made, or scheduled, but before it
                    # was ``task`` here; then closed below, it ran at the loop's next run on a closed coroutine
                    # ("Task exception was never retrieved", or "Task was destroyed but it is pending!", logged).
                    # Held, the interrupt is raised as the block ends, the task known: cancelled below.
                    with interrupts.interrupts_held():
                        awaitable = _made(call)
                        task = asyncio.ensure_future(awaitable, loop=self.loop)
                    result = self.loop.run_until_complete(task)
                    # (an interrupt asked for as the call ended, its callback left for the loop's next run)
                    interrupts.raise_pending_interrupt(self.loop)
                    return result
                except BaseException as err:
                    if task is None:  # (a Ctrl-C as the call began: nothing was scheduled, nothing ran)
                        _close_unstarted(awaitable)  # (else "coroutine ... was never awaited")
                        raise
                    _drop_stale_stops(self.loop, task)
                    if not task.done():  # Ctrl-C (KeyboardInterrupt) while the loop ran: see run
                        _cancel(task)
                        # (its own end, or a second Ctrl-C that stops a cleanup that hangs, is beside the point)
                        with contextlib.suppress(BaseException):
                            self.loop.run_until_complete(task)
                        _drop_stale_stops(self.loop, task)
                    # An interrupt asked for in the loop's last turn, as the call failed (a step whose servers
                    # the same Ctrl-C ended, one past its deadline): the interrupt, not left for a later call;
                    # where an interrupt is raised already (a second Ctrl-C during the cleanup), it stands for it.
                    try:
                        interrupts.raise_pending_interrupt(self.loop)
                    except KeyboardInterrupt:
                        if not isinstance(err, KeyboardInterrupt):
                            raise
                    raise
        if threading.current_thread() is threading.main_thread():
            interrupts.take_ctrl_c()  # (as each run of the main thread's loop does: see below)
        outcome: list[Any] = []
        ended = _Ended()  # (set once the helper's run of the loop is over)
        scheduled: list[asyncio.Future[T]] = []

        def drive() -> None:
            try:
                outcome.append((True, self.loop.run_until_complete(scheduled[0])))
            except BaseException as err:  # handed to the caller's thread
                outcome.append((False, err))
            finally:
                ended.set()

        helper = threading.Thread(target=drive, name="envfleet-loop-call")
        started = False
        try:
            # Scheduled and the helper started whole: Thread.start waits for the thread to begin, and a Ctrl-C raised
            # there (about 1 in 3 of those that came as a fleet made outside asyncio.run stepped inside it) left the
            # call to run on the helper unseen, not cancelled nor waited for: the loop still ran it as the program's
            # next call came (the fleet's close), which failed "This event loop is already running", it and the next
            # ones for seconds. Held (the handler is take_ctrl_c's: taken over above where the program put Python's
            # back), the interrupt is raised once the helper is known started, and ends the call below.
            with interrupts.interrupts_held():
                scheduled.append(self._schedule(call))
                helper.start()
                started = True
            _awake_until_done(ended)
        except BaseException:  # Ctrl-C in the caller's thread: end the call, so that the loop is free again
            if started or helper.is_alive():
                self.loop.call_soon_threadsafe(_cancel, scheduled[0])
                _awake_until_done(ended)
            elif scheduled:  # (the helper never started: the call is cancelled before it starts, at the next run)
                _cancel(scheduled[0])
            raise
        ok, value = outcome[0]
        if not ok:
            raise value
        return cast(T, value)

    def run_or_schedule(self, call: Coroutine[Any, Any, Any] | Callable[[], Coroutine[Any, Any, Any]]) -> None:
        """Run ``call`` (as :meth:`run` takes it) to completion, or, where that would block the loop itself (a
        finalizer called while the loop runs) or take it from the thread that runs it (a finalizer called by a
        garbage collection on another thread), schedule it to finish on the loop's next run. (A function that
        makes the coroutine is called only then: where the loop never runs again, the process ending, nothing
        was made that says it was never awaited.)"""
        if self._thread is not None:
            if threading.current_thread() is self._thread:
                self.loop.call_soon_threadsafe(self._keep, call)
            else:
                self.run(call)
            return
        if self.loop.is_running() or not self._running.acquire(blocking=False):
            self.loop.call_soon_threadsafe(self._keep, call)  # (another thread runs the loop: on its next run)
            return
        try:
            self.run(call)
        finally:
            self._running.release()

    def _keep(self, call: Coroutine[Any, Any, Any] | Callable[[], Coroutine[Any, Any, Any]]) -> None:
        # The loop holds tasks weakly: keep a reference until the task is done.
        task = self.loop.create_task(_made(call))
        self._scheduled.add(task)
        task.add_done_callback(self._scheduled.discard)

    def create_task(self, call: Coroutine[Any, Any, T] | Callable[[], Coroutine[Any, Any, T]]) -> asyncio.Task[T]:
        """Schedule ``call`` (as :meth:`run` takes it) on the loop; it starts at the next :meth:`run` or
        :meth:`spin`."""
        if self._thread is not None:
            return self.run(functools.partial(_create_task, call))
        return self._schedule(call)  # type: ignore[return-value]  # (a coroutine's: a Task; no cast(), a call)

    def _schedule(self, call: Awaitable[T] | Callable[[], Awaitable[T]]) -> asyncio.Future[T]:
        """``call`` (as :meth:`run` takes it) made and scheduled on the loop whole, for :meth:`create_task` and a
        call from a thread that runs a loop of its own (see _run_until_complete): an interrupt meanwhile is held,
        and raised once the task is known, which is then cancelled before it starts (it ends so at the loop's next
        run: neither unseen nor "never awaited"); one not held (not the main thread's) closes what was made."""
        awaitable = task = None
        try:
            with interrupts.interrupts_held():
                awaitable = _made(call)
                task = asyncio.ensure_future(awaitable, loop=self.loop)
        except BaseException:
            if task is None:
                _close_unstarted(awaitable)
            else:
                _cancel(task)
            raise
        return task

    def wait(self, tasks: list[asyncio.Task[Any]], timeout: float, reading: Sequence[Readable] = ()) -> None:
        """Run the loop until every task is done, or ``timeout`` seconds passed: then cancel the rest.

        ``reading``: meanwhile, ``receive()`` each of these whenever its file descriptor has something
        to read, until it is ``done()`` (step-socket steps beside steps over gRPC: each answer is taken
        in, and its round trip ends, as it arrives, not once the gRPC steps' wait is over)."""
        if all(t.done() for t in tasks):
            return
        if reading:
            self.run(lambda: _reading(_wait_or_cancel(tasks, timeout), reading))
            return
        # On the background loop, or where this thread runs a loop of its own (see _run_until_complete): the
        # wait as a coroutine on this runner's loop. asyncio.gather made here would bind to the thread's running
        # loop (Python 3.14 takes that one over the tasks'), and refuse this loop's tasks.
        # (A re-entrant call, from this loop's own callbacks, goes on below: the loop refuses it, as before.)
        running = asyncio._get_running_loop()
        if self._thread is not None or (running is not None and running is not self.loop):
            self.run(lambda: _wait_or_cancel(tasks, timeout))
            return
        # The lightest way to wait in the caller's thread (no extra task; measured ~100 us per step
        # cheaper than asyncio.wait): one future for all, and a timer that cancels what is left.
        joined = asyncio.gather(*tasks, return_exceptions=True)
        timer = self.loop.call_later(timeout, joined.cancel)
        try:
            self._run_until_complete(joined)
        except asyncio.CancelledError:
            pass  # the deadline passed: the late tasks are cancelled
        finally:
            timer.cancel()

    def cancel(self, tasks: list[asyncio.Task[Any]]) -> None:
        """Cancel ``tasks`` (from any thread; on this thread's loop, the cancellation runs with its next call)."""
        for task in tasks:
            if self._thread is None and not self.loop.is_running():
                task.cancel()
            else:  # (the loop runs on another thread: the background one, or a helper of _run_until_complete)
                self.loop.call_soon_threadsafe(task.cancel)

    def spin(self) -> None:
        """Let tasks that are ready run up to their next wait (e.g. hand a message to gRPC), then return."""
        if self._thread is None:
            self._run_until_complete(functools.partial(asyncio.sleep, 0))  # (made inside, as run makes its calls)
        # A background loop runs by itself.


def _made(call: A | Callable[[], A]) -> A:
    """What ``call`` (see :meth:`LoopRunner.run`) stands for: the awaitable its function makes, made now; or itself."""
    return call() if callable(call) else call


def _close_unstarted(awaitable: object, *, itself: bool = True) -> None:
    """Close ``awaitable`` where it is a coroutine that never started (nor will: the call it was made for was
    interrupted before it ran), and first the coroutines it was given that never started either (:func:`gather`'s,
    :func:`_create_task`'s, :func:`_reading`'s): a coroutine dropped unstarted, or closed so, drops its arguments,
    and each one said "RuntimeWarning: coroutine ... was never awaited" on stderr as it was collected. ``itself``:
    False for a task's coroutine, which the task's cancellation ends (see :func:`_cancel`)."""
    if not inspect.iscoroutine(awaitable) or inspect.getcoroutinestate(awaitable) != inspect.CORO_CREATED:
        return
    for value in cast(FrameType, awaitable.cr_frame).f_locals.values():  # (its arguments, as it has not started)
        for given in value if isinstance(value, tuple | list) else (value,):
            _close_unstarted(given)
    if itself:
        awaitable.close()


def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancel ``task``, an interrupted call's. Cancelled before its first step (the interrupt came as it was
    scheduled, or before the loop ran it), its coroutine is ended where it begins, and what it was given never
    runs: those coroutines are closed first (see :func:`_close_unstarted`)."""
    if isinstance(task, asyncio.Task):
        _close_unstarted(task.get_coro(), itself=False)
    task.cancel()


def _settle(task: asyncio.Future[T], done: concurrent.futures.Future[T], ended: _Ended) -> None:
    """Give ``done`` (a caller's, in another thread) the outcome of ``task``, which ended; then set ``ended``."""
    try:
        if task.cancelled():
            done.cancel()
        elif (err := task.exception()) is not None:
            done.set_exception(err)
        else:
            done.set_result(task.result())
    finally:
        ended.set()


def _drop_stale_stops(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any]) -> None:
    """After ``run_until_complete(future)`` was interrupted: cancel the loop.stop() it may have left scheduled.

    Its future, done in the same turn of the loop as the interrupt was raised, had scheduled the
    callback that stops the loop, which run_until_complete's cleanup does not take back once
    scheduled: the loop's next run (the fleet's close, say) then stopped at its first turn, "Event loop
    stopped before Future completed", and the close was cancelled, leaving the servers claimed by a
    process that still held their Hold streams (about 1 Ctrl-C in 100 while a script stepped a fleet)."""
    stop = getattr(asyncio.base_events, "_run_until_complete_cb", None)
    if stop is None or loop.is_running():  # (another thread's run: its own stop is no stale one)
        return
    for handle in list(getattr(loop, "_ready", ())):  # (a copy: other threads may schedule meanwhile)
        if getattr(handle, "_callback", None) is stop and getattr(handle, "_args", ())[:1] == (future,):
            handle.cancel()


def _spare_loop(loop: asyncio.AbstractEventLoop, scheduled: set[asyncio.Task[Any]]) -> None:
    """A thread's runner is gone (see LoopRunner): its loop and tasks are for the next thread's."""
    _spare.append((loop, scheduled))


async def _wait_or_cancel(tasks: list[asyncio.Task[Any]], timeout: float) -> None:
    _, late = await asyncio.wait(tasks, timeout=timeout)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)


async def _reading(awaitable: Awaitable[T], sources: Sequence[Readable]) -> T:
    """``await awaitable``, meanwhile reading ``sources`` as :meth:`LoopRunner.wait` says (on the running loop)."""
    loop = asyncio.get_running_loop()

    def read(fd: int, source: Readable) -> None:
        source.receive()
        if source.done():  # (failed, it closed its file descriptor already: see selectors' unregister)
            loop.remove_reader(fd)

    fds = [source.fileno() for source in sources]
    for fd, source in zip(fds, sources, strict=True):
        loop.add_reader(fd, read, fd, source)
    try:
        return await awaitable
    finally:
        for fd in fds:  # (those not removed by read already)
            loop.remove_reader(fd)


def _background_runner() -> LoopRunner:
    global _background
    with _background_lock:
        if _background is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="envfleet-loop", daemon=True)
            thread.start()
            _background = LoopRunner(loop, thread)
            # gRPC AsyncIO shuts itself down when its last channel goes, from whichever thread drops it,
            # while this loop (which runs on) may be handling its poller's socket: then the loop printed
            # "OSError: [Errno 9] Bad file descriptor" from PollerCompletionQueue._handle_events at a
            # script's exit, now and then. One more reference on it keeps it up for the process's life.
            _background.run(_hold_grpc_aio)
        return _background


async def _hold_grpc_aio() -> None:
    grpc.aio.init_grpc_aio()  # (never undone; bound to the running loop, this one)
