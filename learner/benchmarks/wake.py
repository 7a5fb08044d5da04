"""What a step's own code costs right after a wait, against the same code run back to back.

A server's first work on a step request, decoding its actions and checking them against the action
space (``codec.decode_value`` and ``validation.check_actions``, 4 CartPole actions), timed alone
after each of several waits: none (back to back, as a profile of a hot loop sees it), running other
Python for a while (busy), or sleeping. In a fleet every process waits between steps (for the
learner, for the envs, for a 2 ms simulator), so the per-step costs that add up to a round trip are
the ones after a wait, not the back-to-back ones.

On the 2-core development VM the code took 7-12 us back to back, 90-120 us after 2 ms of running
other Python and ~150 us after 2 ms asleep (benchmarks README, "Where a step's overhead goes"): it
grows with the time away, so waiting awake keeps only part of it down. That cost is the machine's
(what else runs on its cores and caches meanwhile): measure it where the fleet runs.

    python -m learner.benchmarks.wake [--samples N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence

import gymnasium as gym
import numpy as np

from env_server import codec
from env_server.rpc import env_pb2 as pb
from env_server.validation import check_actions
from learner.argtypes import positive_int

__all__ = ["WAITS", "main", "measure_wake"]


def _busy(seconds: float) -> None:
    """Run other Python (looking at the clock) for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


# (label, the wait before each timed call)
WAITS: list[tuple[str, Callable[[], None]]] = [
    ("none (back to back)", lambda: None),
    ("busy 0.02 ms", lambda: _busy(0.00002)),
    ("busy 0.2 ms", lambda: _busy(0.0002)),
    ("busy 2 ms", lambda: _busy(0.002)),
    ("sleep 0.1 ms", lambda: time.sleep(0.0001)),
    ("sleep 2 ms", lambda: time.sleep(0.002)),
]


def measure_wake(samples: int = 400) -> list[dict[str, float | str]]:
    """Median microseconds of the step request's decode and check after each of WAITS, and its
    ratio to back to back (the first)."""
    space = gym.spaces.Discrete(2)
    request = pb.StepRequest(session_id="s")
    codec.encode_value(np.random.default_rng(0).integers(0, 2, 4), request.actions, "actions")

    def work() -> None:
        check_actions(space, codec.decode_value(request.actions, "actions", writeable=True), 4)

    for _ in range(200):  # (imports, first calls: not what is measured)
        work()
    rows: list[dict[str, float | str]] = []
    for label, wait in WAITS:
        times = []
        for _ in range(samples):
            wait()
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
        median = statistics.median(times) * 1e6
        rows.append(
            {
                "wait": label,
                "median_us": median,
                "x_back_to_back": median / float(rows[0]["median_us"]) if rows else 1.0,
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m learner.benchmarks.wake",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument(
        "--samples", type=positive_int, default=400, metavar="N", help="timed calls per wait (default: 400)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    rows = measure_wake(args.samples)
    print("| wait before the call | median (us) | x back to back |\n|---|---:|---:|")
    for row in rows:
        print(f"| {row['wait']} | {row['median_us']:.1f} | {row['x_back_to_back']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples": args.samples, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
