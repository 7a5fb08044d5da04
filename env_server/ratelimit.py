"""Rate-limited log lines: the first at once, then at most one per interval, with how many were left out since.

(No grpc here: the learner imports this too.)
"""

from __future__ import annotations

import math
import time

__all__ = ["LogBudget"]


class LogBudget:
    """At most one log line per ``every_s`` seconds (the first at once), counting the ones left out since."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.last = -math.inf
        """``time.monotonic()`` of the last line (none yet: ``-inf``)."""
        self.left_out = 0
        """Lines left out since the last."""

    def due(self, now: float | None = None) -> int | None:
        """Whether a line is due now (``now``: ``time.monotonic()`` unless given): if so, how many were left out
        since the last (and the line counts as said now); else None (and this one counts as left out)."""
        now = time.monotonic() if now is None else now
        if now - self.last < self.every_s:
            self.left_out += 1
            return None
        left_out, self.last, self.left_out = self.left_out, now, 0
        return left_out
