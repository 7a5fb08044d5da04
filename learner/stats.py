"""Per-replica step statistics the learner records: latency percentiles, env time and throughput."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

__all__ = [
    "REPLICAS",
    "RING",
    "ReplicaStats",
    "StepTimer",
    "format_return",
    "format_returns",
    "mean_of",
    "replica_key",
    "spread_of",
]

REPLICAS = "replicas/"
"""The prefix of a metrics row's per-server keys, ``replicas/<replica>/<field>`` (:meth:`ReplicaStats.metrics`)."""


def replica_key(key: str) -> tuple[str, str]:
    """The replica and the field a ``replicas/<replica>/<field>`` key names (replicas may hold "/": unix:/tmp/...)."""
    replica, _, field = key.removeprefix(REPLICAS).rpartition("/")
    return replica, field


@dataclass(frozen=True)
class ReplicaStats:
    """One env server's steps since the last reset of its statistics (its window: for a server that left the
    fleet in it, until it left; for one that joined in it, since it joined).

    The percentiles (``*_p50_ms``, ``*_p99_ms``) are of the window's last :data:`RING` steps (all of them in a
    window of fewer); the counts, rates, ``env_busy`` and ``latency_max_ms`` are of the whole window.

    A replica whose latency or env time stands out from the others is slow or overloaded, and the
    whole fleet waits for it on every synchronous step (load imbalance): ``env_busy`` near 1 for one
    replica and well under it for the others says which one the fleet waits for.
    """

    address: str
    """The server's address: a stable key for its numbers (its index changes when the fleet does)."""
    num_envs: int
    """Envs the server hosts (K)."""
    steps: int
    """Batched steps answered in the window."""
    env_steps_per_s: float
    """Env steps (K per batched step) per second of wall time in the window. Stepped synchronously,
    every replica steps at the fleet's pace, so this differs between replicas only by K."""
    env_busy: float
    """The fraction of the window's wall time the server's envs spent stepping (the sum of the env
    step times it reported, over the time elapsed): near 1, the replica is what the fleet waits for;
    low, it waits for the others (or for the learner). NaN where the server reported no env time
    (``env_seconds`` 0: a server that does not measure it) for the window's steps; 0 with no steps."""
    latency_p50_ms: float
    """Median round trip seen by the learner: from sending the actions until the answer arrived, as
    far as the learner can tell. It reads answers whenever it calls into the fleet (``step``,
    ``send``, ``recv``; with pipelining, the answers of every group in flight), so an answer that
    comes while the learner computes actions counts as arriving at its next call."""
    latency_p99_ms: float
    """99th percentile of the round trip."""
    latency_max_ms: float
    """The slowest round trip of the window (all its steps, however many): one slow step among a rollout's
    hundreds, which the p99 does not show."""
    env_p50_ms: float
    """Median time the server's envs took to step (reported by the server in each answer; steps it reported
    none for, ``env_seconds`` 0, are left out: NaN if it reported none)."""
    env_p99_ms: float
    """99th percentile of the envs' step time."""
    available: bool = True
    """Whether the server is up now (fault-tolerant fleets; always True otherwise)."""
    failures: int = 0
    """Times the server was lost in the window (not counting shutdowns)."""
    shutdowns: int = 0
    """Times it left in the window saying it was shutting down (a scale-down, a restart): planned."""
    reconnects: int = 0
    """Times it came back in the window."""
    stalls: int = 0
    """Its steps in the window that stalled the fleet: waited for long, far longer than usual outside its
    envs (a stalled link, a paused or overloaded server or learner host; see
    :data:`learner.faults.STALL`, which every one counts here whether warned of or not)."""
    server_id: str = ""
    """The server process's id (its spec's ``server_id``, which its ``envfleet_server_info`` metric
    carries too; a restarted server has a new one); "" where unknown."""

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """The numbers as a flat dict of floats (for metrics.jsonl and TensorBoard), keys prefixed;
        ``address`` and ``server_id`` are no numbers and are left out: put the address in the prefix
        to key them by server."""
        return {f"{prefix}{k}": float(v) for k, v in asdict(self).items() if k not in _NOT_NUMBERS}


_NOT_NUMBERS = ("address", "server_id")

RING = 4096
"""The steps a :class:`StepTimer` keeps (the last ones) for its percentiles."""


class StepTimer:
    """Round-trip and env times of one replica's recent steps (a ring of the last ``window``, for the
    percentiles), and the total env time and slowest round trip of the window (``env_busy``,
    ``latency_max_ms``). An env time of 0 is one the server did not measure (the proto's ``env_seconds``):
    kept as NaN, left out of the env figures."""

    COUNTS = ("failures", "shutdowns", "reconnects", "stalls")
    """What the window counts of the server beside its steps (each an attribute, and ReplicaStats')."""

    def __init__(self, address: str, num_envs: int, window: int = RING) -> None:
        self.address = address
        self.num_envs = num_envs
        self._latency = np.zeros(window)
        self._env = np.zeros(window)
        self._recorded = 0  # steps recorded in all (reset() keeps the ring: see outside_envs)
        self._count = 0  # of them, since the start of the window
        self._env_total = 0.0
        self._env_measured = 0  # (steps of the window with an env time)
        self._latency_max = math.nan  # (of the window's steps, all of them: the ring keeps the last only)
        self._elapsed = 0.0  # (the window's time before the last stop())
        self._since: float | None = time.perf_counter()  # (None: stopped)
        self.failures = 0
        self.shutdowns = 0
        self.reconnects = 0
        self.stalls = 0

    @property
    def steps(self) -> int:
        """Steps recorded in all (:meth:`reset` leaves it)."""
        return self._recorded

    def last_latency(self) -> float:
        """The round trip of the last step recorded, in seconds (0 before any)."""
        return float(self._latency[(self._recorded - 1) % len(self._latency)]) if self._recorded else 0.0

    def last_outside_envs(self) -> float:
        """The part of the last step's round trip that its envs did not take, in seconds (0 before any)."""
        if not self._recorded:
            return 0.0
        i = (self._recorded - 1) % len(self._latency)
        return float(self._latency[i] - np.nan_to_num(self._env[i]))

    def usual_outside_envs(self, at_least: int) -> float | None:
        """The median part of a round trip that the envs did not take, over the recent steps before the
        last (up to the ring's size, whatever :meth:`reset` did), in seconds; None with fewer than
        ``at_least`` of them."""
        size = len(self._latency)
        earlier = np.arange(max(0, self._recorded - size), self._recorded - 1) % size
        if len(earlier) < at_least:
            return None
        return float(np.median(self._latency[earlier] - np.nan_to_num(self._env[earlier])))

    def record(self, latency_s: float, env_s: float) -> None:
        """One step: its round trip (sent to arrived) and the time the server's envs took, in seconds (0: not
        measured)."""
        i = self._recorded % len(self._latency)
        self._latency[i] = latency_s
        self._env[i] = env_s if env_s > 0 else math.nan
        self._recorded += 1
        self._count += 1
        if env_s > 0:
            self._env_total += env_s
            self._env_measured += 1
        if not latency_s <= self._latency_max:  # (NaN: the window's first)
            self._latency_max = latency_s

    def count_loss(self, *, planned: bool) -> None:
        """Count a loss of the server in the window: a shutdown if it said it was shutting down
        (``planned``), else a failure (as :meth:`learner.faults.Replica.count_loss` counts it in the run's)."""
        if planned:
            self.shutdowns += 1
        else:
            self.failures += 1

    def take_counts(self, other: StepTimer) -> None:
        """Add the window's failures, shutdowns, reconnects and stalls of ``other`` (the timer of the
        server that was at this address before, with another number of envs) to this window's."""
        for name in self.COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def stop(self) -> None:
        """Stop the window's clock (its server left the fleet): its rates are of the time until now."""
        if self._since is not None:
            self._elapsed += time.perf_counter() - self._since
            self._since = None

    def start(self) -> None:
        """Run the window's clock again after :meth:`stop` (its server is back in the fleet); else nothing."""
        if self._since is None:
            self._since = time.perf_counter()

    def reset(self) -> None:
        """Start a new window of :meth:`stats` (the ring's steps stay, for :meth:`usual_outside_envs`)."""
        self._count = 0
        self._env_total = 0.0
        self._env_measured = 0
        self._latency_max = math.nan
        self._elapsed = 0.0
        if self._since is not None:
            self._since = time.perf_counter()
        for name in self.COUNTS:
            setattr(self, name, 0)

    def stats(self, available: bool = True, server_id: str = "") -> ReplicaStats:
        size = len(self._latency)
        n = min(self._count, size)
        running = time.perf_counter() - self._since if self._since is not None else 0.0
        elapsed = max(self._elapsed + running, 1e-9)
        lat = np.full(2, math.nan)
        env = np.full(2, math.nan)
        if n:
            window = np.arange(self._recorded - n, self._recorded) % size  # (the window's last steps)
            lat = np.percentile(self._latency[window], [50, 99]) * 1000.0
            measured = self._env[window][np.isfinite(self._env[window])]
            if len(measured):
                env = np.percentile(measured, [50, 99]) * 1000.0
        busy = self._env_total / elapsed if self._env_measured or not self._count else math.nan
        return ReplicaStats(
            address=self.address,
            num_envs=self.num_envs,
            steps=self._count,
            env_steps_per_s=self._count * self.num_envs / elapsed,
            env_busy=busy,
            latency_p50_ms=float(lat[0]),
            latency_p99_ms=float(lat[1]),
            latency_max_ms=float(self._latency_max) * 1000.0,
            env_p50_ms=float(env[0]),
            env_p99_ms=float(env[1]),
            available=available,
            failures=self.failures,
            shutdowns=self.shutdowns,
            reconnects=self.reconnects,
            stalls=self.stalls,
            server_id=server_id,
        )


def format_return(value: float) -> str:
    """A return (or its spread) as the closing lines and progress bars print it: 4 significant digits,
    1 decimal from 100 up, 6 significant digits with an exponent from 1e9 up (not 40 digits of 1e39's).
    One decimal alone would show returns in [0, 1] (FrozenLake's, success rates) as 1.0 at 0.9615, hiding
    the progress a run makes."""
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 1e9:
        return f"{value:.6g}"
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.4g}"


def format_returns(*values: float) -> tuple[str, ...]:
    """Returns printed on one line (learner eval's mean, spread, min and max) in one style: one decimal each
    where the largest is from 100 up ("97.0 +- 12.4 (min 81.0, max 115.0)"; each on its own gave "97 +- 12.39
    (min 81, max 115.0)"), otherwise each as :func:`format_return` gives it."""
    largest = max((abs(v) for v in values if math.isfinite(v)), default=0.0)
    if 100 <= largest < 1e9:
        return tuple(f"{v:.1f}" if math.isfinite(v) else str(v) for v in values)
    return tuple(format_return(v) for v in values)


def mean_of(values: Sequence[float] | Sequence[int] | np.ndarray) -> float:
    """The mean of ``values`` (returns: finite each, a mean finite too), as np.mean gives it, but where their sum
    overflowed float64 (returns near its max): then the sum of each divided by their number (no RuntimeWarning)."""
    with np.errstate(over="ignore", invalid="ignore"):
        mean = float(np.mean(values))
        if not math.isfinite(mean):
            mean = float(np.sum(np.asarray(values, dtype=np.float64) / len(values)))
    return mean


def spread_of(values: Sequence[float] | np.ndarray) -> float:
    """The (population) std of ``values``, as np.std gives it, but where their squares overflowed float64
    (returns beyond about 1e154): then that of the values scaled by their largest magnitude, scaled back."""
    with np.errstate(over="ignore", invalid="ignore"):
        std = float(np.std(values))
        if not math.isfinite(std):
            scaled = np.asarray(values, dtype=np.float64)
            scale = float(np.abs(scaled).max())
            std = float(np.std(scaled / scale)) * scale
    return std
