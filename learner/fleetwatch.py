"""The fleet, update by update: its fault counts, per-replica statistics, and replicas that stay slow."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from learner import rundir
from learner.device import machine_busy
from learner.local import server_label
from learner.stats import REPLICAS, ReplicaStats, StepTimer, replica_key

__all__ = [
    "FAULT_COUNTS",
    "REPLICA_METRICS_ALL",
    "SLOW_UPDATES",
    "FleetWatch",
    "ReplicaTotals",
    "SlowReplicas",
    "every_replica",
    "fleet_figures",
    "replica_metrics_note",
    "written_row",
]

log = logging.getLogger(__name__)

FAULT_COUNTS = ("failures", "shutdowns", "reconnects", "server_restarts", "servers_joined", "servers_left")
"""The fleet's fault counters (fields of ``FaultStats`` and of ``Counters``) that each metrics row gives for
its update (``faults/<name>``) and summary.json totals over the whole run. The other fields of
``FaultStats`` are not counts of the fleet's events (``servers_down``, ``envs_unavailable``,
``servers_not_joined``: now) or are counted by ``train`` from the steps' infos and the rollouts no update
learned from (``env_steps_lost``, for in-process envs too)."""


REPLICA_METRICS_ALL = 16
"""With ``--replica-metrics auto``, a session that starts with at most this many env servers writes each
one's figures (``replicas/<key>/<field>``) to metrics.jsonl and TensorBoard every update; one with more
writes the fleet's (``fleet/<field>``, as every run does) and only the servers of note (see
:meth:`FleetWatch.rollout_metrics`): at 256 servers, every server's made 162 KB rows and 3,584 tags."""


SLOW_RATIO = 3.0
"""A replica whose median env step (or round trip) is this many times the other replicas' median is slow..."""
SLOW_UPDATES = 3
"""... for this many updates in a row: then it is warned of (once, until it recovers)."""
SLOW_MIN_MS = 0.1
"""... and at least this many ms slower, so that the microseconds by which fast envs' replicas differ are not flagged."""


class SlowReplicas:
    """Warns of a replica that stays slower than the others (load imbalance: a synchronous fleet waits
    for its slowest replica on every step), by its ``env_p50_ms`` (its envs' own step time: a slow or
    overloaded host) or else its ``latency_p50_ms`` (the round trip: its network or server)."""

    def __init__(self) -> None:
        self._streaks: dict[str, int] = {}
        self._warned: set[str] = set()

    def check(self, replicas: list[ReplicaStats], label: Callable[[str], str] = str) -> list[tuple[int, str]]:
        """What to log (level, message) after an update whose windows are ``replicas``, each named
        ``label(its address)``."""
        said: list[tuple[int, str]] = []
        for replica in replicas:
            slow = _slowness(replica, replicas)
            if slow is None:
                continue  # not measured in this update (no steps, or no others to compare with)
            address = label(replica.address)
            who = address if address == replica.address else f"{address} ({replica.address})"
            if not slow[0]:
                self._streaks[address] = 0
                if address in self._warned:
                    self._warned.discard(address)
                    said.append((logging.INFO, f"env server {who} is no longer slow ({slow[1]})"))
                continue
            self._streaks[address] = self._streaks.get(address, 0) + 1
            if self._streaks[address] >= SLOW_UPDATES and address not in self._warned:
                self._warned.add(address)
                said.append(
                    (
                        logging.WARNING,
                        f"env server {who} is slow: {slow[1]}, for {SLOW_UPDATES} updates in a row; the "
                        f"fleet waits for it on every step (see replicas/{address}/ in {rundir.METRICS})"
                        + (_busy_here() if address != replica.address else ""),
                    )
                )
        return said

    def noted(self, name: str) -> bool:
        """Whether the replica ``name`` was slow in the last check (to be warned of, if it stays so), or was
        warned of as slow and has not recovered since."""
        return self._streaks.get(name, 0) > 0 or name in self._warned


def _busy_here() -> str:
    """For a server this learner started on this machine: that the machine is busy, which slows one
    local server more than another as the OS gives out the CPUs; "" otherwise."""
    busy = machine_busy()
    return f"; this machine is busy ({busy}), which may be all it is" if busy else ""


def _slowness(replica: ReplicaStats, replicas: list[ReplicaStats]) -> tuple[bool, str] | None:
    """(whether ``replica`` is slow against the median of the others, in words its figures that say so
    or, if not slow, its env step's); None when there is nothing to compare (no figure of its, or none of
    the others' above 0: env times their servers did not measure). (Against the others, not
    the whole fleet's median: with two replicas the fleet's median is their mean, which neither reaches
    3 times.)"""
    said: tuple[bool, str] | None = None
    for key, what in (("env_p50_ms", "its envs' median step"), ("latency_p50_ms", "its median round trip")):
        value = getattr(replica, key)
        others = [getattr(r, key) for r in replicas if r is not replica and r.steps]
        others = [v for v in others if math.isfinite(v)]
        if not (replica.steps and math.isfinite(value) and others):
            continue
        median = float(np.median(others))
        if not median > 0:
            continue  # (the others report none: 0 from servers that do not measure their env time)
        ratio = value / median
        text = f"{what} {value:.2f} ms, {ratio:.1f}x the other servers' median ({median:.2f} ms)"
        if ratio >= SLOW_RATIO and value - median >= SLOW_MIN_MS:
            return True, text
        said = said or (False, text)
    return said


@dataclass
class ReplicaTotals:
    """One env server's statistics over a session (summary.json's ``replicas``): sums of its windows'
    counts, means of their medians weighted by their steps, and the slowest round trip of any."""

    num_envs: int = 0
    steps: int = 0
    failures: int = 0
    shutdowns: int = 0
    reconnects: int = 0
    stalls: int = 0
    available: bool = True
    """Whether it was up as of the last window (its server's, at the last update)."""
    _weighted: dict[str, float] = field(default_factory=dict)
    _weights: dict[str, int] = field(default_factory=dict)
    _reported: set[str] = field(default_factory=set)  # (the MEANS the fleet gave, if only NaN: no steps)
    latency_max_ms: float | None = None

    COUNTS = StepTimer.COUNTS
    MEANS = ("env_p50_ms", "latency_p50_ms", "env_busy")

    def add(self, window: ReplicaStats) -> None:
        self.num_envs = window.num_envs
        self.available = window.available
        self.steps += window.steps
        for key in self.COUNTS:
            setattr(self, key, getattr(self, key) + getattr(window, key))
        for key in self.MEANS:
            value = getattr(window, key, None)  # (env_busy: where the fleet reports it)
            if value is not None:
                self._reported.add(key)
            if value is not None and window.steps and math.isfinite(value):
                self._weighted[key] = self._weighted.get(key, 0.0) + value * window.steps
                self._weights[key] = self._weights.get(key, 0) + window.steps
        if window.steps and math.isfinite(window.latency_max_ms):
            self.latency_max_ms = max(self.latency_max_ms or 0.0, window.latency_max_ms)

    def as_dict(self) -> dict[str, Any]:
        means = {
            k: round(self._weighted[k] / self._weights[k], 4) if self._weights.get(k) else None for k in self.MEANS
        }
        if "env_busy" not in self._reported:
            del means["env_busy"]
        counts = {k: getattr(self, k) for k in ("num_envs", "steps", *self.COUNTS)}
        slowest = None if self.latency_max_ms is None else round(self.latency_max_ms, 4)
        return {**counts, **means, "latency_max_ms": slowest, "available": self.available}


class FleetWatch:
    """A fleet's fault counters and per-replica statistics, rollout by rollout (``envs`` without them,
    in-process envs, give none)."""

    def __init__(self, envs: Any, carried: dict[str, int], local: bool = False, every_replica: bool = True) -> None:
        self._fault_stats = getattr(envs, "fault_stats", None)
        self._replica_stats = getattr(envs, "replica_stats", None)
        self._labels: dict[str, str] = {}
        self._kept: list[ReplicaStats] = []  # (what the windows start_rollout() ended counted: see _with_counts)
        if self._replica_stats is not None:
            first = self._replica_stats(reset=True)
            if local:
                # Servers the learner started: their addresses are new each session (a temporary
                # folder's socket, a free port), their places are not (a restart keeps its address).
                self._labels = {r.address: server_label(i) for i, r in enumerate(first)}  # (as their logs say)
            self._kept = _counted(first)
        self.every_replica = every_replica
        """Whether the rows give every server's figures (:func:`every_replica`), or only those of note."""
        # (What connecting and the first reset counted goes with the first rollout's, as totals() counts it.)
        self._before = dict.fromkeys(FAULT_COUNTS, 0)
        self.carried = carried
        """The fault counts of the run's earlier sessions (a resumed run's checkpoint)."""
        self.replicas: dict[str, ReplicaTotals] = {}
        """This session's statistics per replica (its :meth:`label`)."""
        self.server_ids: dict[str, str] = {}
        """Each replica's (:meth:`label`) server process id as of the last rollout ("" where unknown)."""
        self._slow = SlowReplicas()
        self.of_note: frozenset[str] = frozenset()
        """The servers (:meth:`label`) of the last :meth:`rollout_metrics`' windows that were down, counted a
        loss, a return or a stall, or are slow (from their first slow update: the warning after a few points
        to them): those whose figures the run's files give when not :attr:`every_replica`."""

    def start_rollout(self) -> None:
        """Start every server's window here, at a rollout's start, so that :meth:`rollout_metrics` gives
        the rollout's (not the update's before it, nor connecting and the first reset), keeping what the
        window it ends counted (a refresh between rollouts may lose or take back servers) and the servers
        that left the fleet in it, for :meth:`rollout_metrics` to give with the rollout's."""
        if self._replica_stats is not None:
            self._kept = _with_counts(_counted(self._replica_stats(reset=True)), self._kept)

    def rollout_metrics(self) -> dict[str, float]:
        """Since the last call: servers lost and back (``faults/<count>``, and ``faults/servers_down`` now),
        and per env server (``replicas/<address>/<field>``) the step latency p50/p99 as the learner saw it,
        the envs' own step time and env-steps/s over the rollout (since :meth:`start_rollout`; since the
        last call without it) with its counts since the last call, and the fleet's (:func:`fleet_figures`);
        warns of a replica that stays slow. Every server's figures, for --metrics-port; :attr:`of_note`
        says which of them the run's files give, unless :attr:`every_replica`."""
        metrics: dict[str, float] = {}
        if self._fault_stats is not None:
            now = self._fault_stats()
            for key in FAULT_COUNTS:
                metrics[f"faults/{key}"] = getattr(now, key) - self._before[key]
                self._before[key] = getattr(now, key)
            metrics["faults/servers_down"] = now.servers_down
            metrics["faults/servers_not_joined"] = now.servers_not_joined
        windows = self._replica_stats(reset=True) if self._replica_stats is not None else []
        windows, self._kept = _with_counts(windows, self._kept), []
        self.server_ids = {self.label(window.address): window.server_id for window in windows}
        for window in windows:
            # By address, not position: a fleet's positions shift as servers leave and join.
            name = self.label(window.address)
            metrics.update(window.metrics(f"{REPLICAS}{name}/"))
            self.replicas.setdefault(name, ReplicaTotals()).add(window)
        for level, message in self._slow.check(windows, self.label):
            log.log(level, "%s", message)
        if self._replica_stats is not None:
            metrics.update(fleet_figures(windows))
        self.of_note = frozenset(
            self.label(w.address)
            for w in windows
            if not w.available
            or any(getattr(w, k) for k in StepTimer.COUNTS)
            or self._slow.noted(self.label(w.address))
        )
        return metrics

    def label(self, address: str) -> str:
        """How metrics name a replica: its address, or ``local-<i>`` for the i-th server the learner
        started itself."""
        return self._labels.get(address, address)

    def totals(self) -> dict[str, int] | None:
        """The whole run's fault counts as of now (None for envs without them, unless carried over)."""
        if self._fault_stats is None and not any(self.carried.values()):
            return None
        now = self._fault_stats() if self._fault_stats is not None else None
        return {key: self.carried[key] + (getattr(now, key) if now is not None else 0) for key in FAULT_COUNTS}

    def servers_lost(self) -> int:
        """Servers lost so far (failed or shut down), counting each time one was; 0 for envs without them."""
        totals = self.totals() or {}
        return totals.get("failures", 0) + totals.get("shutdowns", 0)


def every_replica(replica_metrics: str, servers: int) -> bool:
    """Whether a session that starts with ``servers`` env servers writes every one's figures to its rows
    (--replica-metrics ``all``, or ``auto`` and at most :data:`REPLICA_METRICS_ALL`), or those of note only."""
    return replica_metrics == "all" or (replica_metrics == "auto" and servers <= REPLICA_METRICS_ALL)


def replica_metrics_note(servers: int) -> str:
    """What a session of ``servers`` env servers whose rows give only the servers of note says of it."""
    return (
        f"metrics.jsonl and TensorBoard: the fleet's figures (fleet/...) every update, and each of the {servers} "
        "servers' own (replicas/<server>/...) in the updates it was down, lost, back, stalled or slow in "
        "(--replica-metrics all: every server's, every update)"
    )


def fleet_figures(windows: list[ReplicaStats]) -> dict[str, float]:
    """The fleet's figures over the servers' ``windows`` (``fleet/<field>``, for metrics.jsonl): the servers
    up; the median and the largest of the servers' medians (round trip, envs' step time, share of the
    time their envs were busy); the largest of their p99s and their slowest round trip; their stalls.
    NaN where no server had steps (or measured its envs' time)."""
    stepped = [w for w in windows if w.steps]

    def figures(key: str) -> list[float]:
        return [v for w in stepped if math.isfinite(v := float(getattr(w, key)))]

    def median(key: str) -> float:
        values = figures(key)
        return float(np.median(values)) if values else math.nan

    def largest(key: str) -> float:
        return max(figures(key), default=math.nan)

    return {
        "fleet/servers": float(sum(w.available for w in windows)),
        "fleet/latency_p50_ms_median": median("latency_p50_ms"),
        "fleet/latency_p50_ms_max": largest("latency_p50_ms"),
        "fleet/latency_p99_ms_max": largest("latency_p99_ms"),
        "fleet/latency_max_ms": largest("latency_max_ms"),
        "fleet/env_p50_ms_median": median("env_p50_ms"),
        "fleet/env_p50_ms_max": largest("env_p50_ms"),
        "fleet/env_p99_ms_max": largest("env_p99_ms"),
        "fleet/env_busy_median": median("env_busy"),
        "fleet/env_busy_max": largest("env_busy"),
        "fleet/stalls": float(sum(w.stalls for w in windows)),
    }


def written_row(row: dict[str, Any], replicas: frozenset[str] | None) -> dict[str, Any]:
    """An update's metrics ``row`` as the run's files give it: with only the ``replicas`` named of its
    per-server figures (``replicas/<name>/<field>``); None: all of them."""
    if replicas is None:
        return row
    return {k: v for k, v in row.items() if not k.startswith(REPLICAS) or replica_key(k)[0] in replicas}


# What a window that start_rollout() ends passes on to the rollout's: its counts, and its steps (those of a
# rollout dropped, a server lost in it: they were taken all the same).
_KEPT = ("steps", *StepTimer.COUNTS)


def _counted(windows: list[ReplicaStats]) -> list[ReplicaStats]:
    """The ``windows`` to pass on: those that counted something (:data:`_KEPT`), and servers that left."""
    return [w for w in windows if not w.available or any(getattr(w, k) for k in _KEPT)]


def _with_counts(windows: list[ReplicaStats], earlier: list[ReplicaStats]) -> list[ReplicaStats]:
    """``windows`` with the counts (:data:`_KEPT`) of each of the ``earlier`` windows added to the one at
    its address; after them, unavailable, the earlier ones whose address has none (servers that left)."""
    windows = list(windows)
    for old in earlier:
        i = next((i for i, w in enumerate(windows) if w.address == old.address), None)
        if i is None:
            windows.append(dataclasses.replace(old, available=False))
        else:
            sums = {k: getattr(windows[i], k) + getattr(old, k) for k in _KEPT}
            windows[i] = dataclasses.replace(windows[i], **sums)
    return windows
