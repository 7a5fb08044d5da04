"""Whether this process itself was held up for a while (SIGSTOP, a debugger, a suspended VM or laptop, a
host that starved it of CPU, a long call holding the interpreter): a server lost just after looks lost from
here, though it may be fine. A daemon thread, while a fault-tolerant fleet is open, wakes every
:data:`TICK_S` and notices a wake-up far later than it asked for."""

from __future__ import annotations

import threading
import time

__all__ = ["PAUSE_S", "own_pause", "start", "stop"]

TICK_S = 0.5
"""How often the watching thread wakes."""

PAUSE_S = 5.0
"""A wake-up this much later than asked for is a pause of this process (not a busy moment)."""

RECENT_S = 60.0
"""How long after a pause ended a server's loss is said to follow it (gRPC notices a dead connection
after its keepalive ping goes unanswered: 10 s of quiet, then the ping's timeout)."""

# (includes a system's suspend where the platform has it, which time.monotonic does not on Linux)
_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)

_lock = threading.Lock()
_users = 0  # (the open fleets that asked for the watch: see start and stop)
_watcher: tuple[threading.Thread, threading.Event] | None = None
_last_tick = 0.0  # (_CLOCK's time of the watcher's last wake-up)
_last_pause: tuple[float, float] = (0.0, -float("inf"))  # (how long, when it ended: _CLOCK's time)


def _now() -> float:
    return time.clock_gettime(_CLOCK)


def _watch(stopped: threading.Event) -> None:
    # (an Event's wait, not time.sleep: a test that replaces time.sleep for a while does not reach this thread)
    global _last_tick, _last_pause
    while not stopped.wait(TICK_S):
        now = _now()
        late = now - _last_tick - TICK_S
        if late >= PAUSE_S:
            _last_pause = (late, now)
        _last_tick = now


def start() -> None:
    """Watch while the caller (a fault-tolerant fleet) is open: a thread for all of them, until the last
    one calls :func:`stop`."""
    global _users, _watcher, _last_tick
    with _lock:
        _users += 1
        if _watcher is None:
            stopped = threading.Event()
            _last_tick = _now()
            thread = threading.Thread(target=_watch, args=(stopped,), name="envfleet-pause-watch", daemon=True)
            thread.start()
            _watcher = (thread, stopped)


def stop() -> None:
    """The caller of :func:`start` no longer needs the watch (closed): the thread ends with the last one."""
    global _users, _watcher
    with _lock:
        _users = max(0, _users - 1)
        if _users == 0 and _watcher is not None:
            _watcher[1].set()
            _watcher = None


def own_pause(within: float | None = None) -> float | None:
    """How long this process was held up, where that ended within :data:`RECENT_S` (``within``: within that
    many seconds, as during a call that took them) or is going on as this is asked (the watcher has not had
    its turn since: woken with the caller, after the same pause); None otherwise, and while nothing watches."""
    now = _now()
    length, ended = _last_pause
    if now - ended <= (RECENT_S if within is None else within + TICK_S):  # (the watcher's turn comes after it)
        return length
    late = now - _last_tick - TICK_S
    return late if _watcher is not None and late >= PAUSE_S else None
