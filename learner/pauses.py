"""Whether this process itself stopped running for a while (SIGSTOP, a debugger, a suspended VM or laptop,
a host that starved it of CPU): a server lost just after looks lost from here, its keepalive pings
unanswered in time, though it may be fine. A daemon thread that wakes every :data:`TICK_S` notices a
wake-up far later than it asked for."""

from __future__ import annotations

import threading
import time

__all__ = ["PAUSE_S", "own_pause"]

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
_thread: threading.Thread | None = None
_last_pause: tuple[float, float] = (0.0, -float("inf"))  # (how long, when it ended: _CLOCK's time)


def _now() -> float:
    return time.clock_gettime(_CLOCK)


def _watch() -> None:
    global _last_pause
    before = _now()
    while True:
        time.sleep(TICK_S)
        now = _now()
        late = now - before - TICK_S
        if late >= PAUSE_S:
            _last_pause = (late, now)
        before = now


def start() -> None:
    """Start watching (once per process; the thread is a daemon's, and costs a wake-up every TICK_S)."""
    global _thread
    with _lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_watch, name="envfleet-pause-watch", daemon=True)
            _thread.start()


def own_pause() -> float | None:
    """How long this process did not run, where that ended within :data:`RECENT_S` (None otherwise, and
    before :func:`start`)."""
    length, ended = _last_pause
    return length if _now() - ended <= RECENT_S else None
