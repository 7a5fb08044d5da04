"""Prometheus metrics of a training run, served while it runs (``learner train --metrics-port``)."""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections import deque
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from prometheus_client import (
    Counter,
    Gauge,
    Info,
    PlatformCollector,
    ProcessCollector,
)

from env_server.metrics import NoCreatedRegistry, serve_registry
from env_server.protocol import bind_hint, host_port, host_problem, http_host, package_version
from learner.errors import OptionError, os_reason
from learner.stats import REPLICAS, replica_key

__all__ = [
    "FAULT_COUNTERS",
    "PREFIX",
    "REPLICA_COUNTERS",
    "REPLICA_GAUGES",
    "ROW_COUNTERS",
    "ROW_GAUGES",
    "LearnerMetrics",
    "lingering",
    "serve_metrics",
    "wait_for_lingering",
]

log = logging.getLogger(__name__)

PREFIX = "envfleet_learner_"

ROW_GAUGES: dict[str, str] = {
    "global_step": "Env steps of the run so far, over all envs (a resumed run's earlier sessions included)",
    "update": "PPO updates of the run so far (a resumed run's earlier sessions included)",
    "sps": "Env steps per second of this session, as of the last update (CleanRL's SPS)",
    "episodic_return_mean": "Mean return of the last 20 finished episodes as of the last update; NaN until one ended",
    "episodic_length_mean": "Mean length of the last 20 finished episodes as of the last update; NaN until one ended",
    "value_loss": "Value loss of the last update",
    "policy_loss": "Policy (clipped surrogate) loss of the last update",
    "entropy": "Policy entropy of the last update",
    "approx_kl": "Approximate KL divergence of the last update's policy from the one that acted",
    "clipfrac": "Fraction of the last update's ratios that were clipped",
    "explained_variance": "Explained variance of the value function in the last update's batch",
    "learning_rate": "Learning rate of the last update",
    "num_envs": "Envs in the fleet during the last update's rollout",
    "envs_unavailable": "Envs unavailable (their server down, or their env raising) at the end of the last rollout "
    "(while every server is down, no rollout ends: all of them, until one answers steps again)",
    "rollout_seconds": "Seconds the last update's rollout took to collect",
    "update_seconds": "Seconds the last update's optimisation took",
    "eval/return_mean": "Mean return of the last evaluation (--eval-every: the deterministic policy over "
    "--eval-episodes episodes); NaN until one ran",
    "faults/servers_down": "Env servers down at the end of the last rollout (while every server is down, no rollout "
    "ends: all of them, until one answers steps again)",
    "faults/servers_not_joined": "Env servers listed at the start that have not joined the fleet yet",
}
"""metrics.jsonl row keys exported as gauges (``envfleet_learner_<key>``, ``/`` dropped; ``update`` as
``updates``), set at each update; a key a row lacks (no fleet: no ``faults/``) leaves its gauge as it was."""

ROW_COUNTERS: dict[str, str] = {
    "env_steps_lost": "Env steps not learned from because of a fault: their env was unavailable (server lost, env "
    "raised), or their rollout was dropped (a failed step without fault tolerance, every server lost)",
    "env_errors": "Env steps whose env raised (reported by its server; of env_steps_lost)",
    "episodes_cut": "Episodes that ended because their env became unavailable (not counted in the returns)",
}
"""Per-update counts of a metrics.jsonl row, added up into counters (``envfleet_learner_<key>_total``)."""

FAULT_COUNTERS: dict[str, tuple[str, str]] = {
    "failures": ("server_failures", "Times an env server was lost (an error or a missed deadline), not shutdowns"),
    "shutdowns": ("server_shutdowns", "Times an env server left saying it was shutting down (planned)"),
    "reconnects": ("server_reconnects", "Times a lost env server came back"),
    "server_restarts": ("server_restarts", "Reconnects to another process than the one lost (its server id changed)"),
    "servers_joined": ("servers_joined", "Env servers that joined the fleet when it was looked up again"),
    "servers_left": ("servers_left", "Env servers that left the fleet (no longer listed, or their session ended)"),
}
"""The fleet's fault counts of each row (``faults/<key>``, this update's) as counters: key -> (name, help)."""

REPLICA_GAUGES: dict[str, tuple[str, float, str]] = {
    "latency_p50_ms": (
        "latency_p50_seconds",
        1e-3,
        "Median round trip of the env server's steps in the last rollout, as the learner saw it",
    ),
    "latency_p99_ms": (
        "latency_p99_seconds",
        1e-3,
        "99th percentile of the env server's round trips in the last rollout",
    ),
    "latency_max_ms": (
        "latency_max_seconds",
        1e-3,
        "The env server's slowest round trip in the rollouts of the last minute (a stall shows for a minute)",
    ),
    "env_p50_ms": (
        "env_step_p50_seconds",
        1e-3,
        "Median time the env server's envs took to step in the last rollout (as it reported)",
    ),
    "env_p99_ms": (
        "env_step_p99_seconds",
        1e-3,
        "99th percentile of the time the env server's envs took to step in the last rollout",
    ),
    "env_busy": (
        "env_busy",
        1.0,
        "Share of the last rollout's wall time the env server's envs spent stepping (near 1: the fleet waits for it)",
    ),
    "available": (
        "available",
        1.0,
        "1 while the env server is up, 0 while it is down or, listed at the start, not joined yet (as of the end of "
        "the last rollout; 0 for every server while all are down, until one answers steps again)",
    ),
    "num_envs": ("envs", 1.0, "Envs the env server hosts"),
}
"""Per-replica fields of a row (``replicas/<replica>/<field>``, over the last rollout; NaN: no steps) as gauges
``envfleet_learner_replica_<name>{replica=...}``: field -> (name, scale to the metric's unit, help)."""

REPLICA_COUNTERS: dict[str, str] = {
    "failures": "Times the env server was lost (an error or a missed deadline), not shutdowns",
    "shutdowns": "Times the env server left saying it was shutting down (planned)",
    "reconnects": "Times the env server came back",
    "stalls": "Steps of the env server that stalled the fleet (far slower than usual outside its envs)",
}
"""Per-replica counts of a row (this update's) as counters ``envfleet_learner_replica_<key>_total{replica=...}``."""


SLOWEST_WINDOW_S = 60.0
"""``envfleet_learner_replica_latency_max_seconds`` is the slowest round trip of the rollouts of this many
seconds (the other per-replica gauges are of the last rollout): a rollout takes ~0.1 s on CartPole, a scrape
comes every 15-60 s, so a stall in one rollout was overwritten long before any scrape saw it."""


def _metric_name(key: str) -> str:
    return PREFIX + ("updates" if key == "update" else key.replace("faults/", "").replace("/", "_"))


def _number(value: Any) -> float:
    """A row's value as a sample: None (no episode ended yet) as NaN."""
    return math.nan if value is None else float(value)


class _SessionCounter:
    """A counter of this process's part of one of the run's running totals (episodes, env steps, updates):
    it goes up by the total's growth, from where the session started (a resumed run's checkpoint)."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.total = 0

    def advance(self, total: int) -> None:
        self.counter.inc(max(total - self.total, 0))
        self.total = total


class LearnerMetrics:
    """A training run as Prometheus metrics, in a registry of their own, with the process's CPU and memory
    (``process_*``) and Python's version (``python_info``), as env-server's.

    Gauges and counters are set from each update's metrics.jsonl row (:meth:`observe_update`): what the
    run writes there, nothing computed anew. Counters count this process's session (they start at 0 in a
    resumed run, as Prometheus expects of a restarted process); gauges of the run's totals (``global_step``,
    ``updates``) go on from its checkpoint. Per env server, gauges carry a ``replica`` label, the key
    metrics.jsonl names it by (``local-0``, or its address); a replica that leaves the fleet has its series
    removed, so a fleet whose servers come and go keeps a bounded number of them.
    """

    def __init__(self, *, env_id: str = "", run_dir: str = "") -> None:
        self.registry = NoCreatedRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)  # (exports nothing where there is no /proc)
        PlatformCollector(registry=r)
        self._info = Info(PREFIX.rstrip("_"), "What the learner trains: env id, run dir, envfleet version", registry=r)
        self._gauges = {key: Gauge(_metric_name(key), text, registry=r) for key, text in ROW_GAUGES.items()}
        for gauge in self._gauges.values():
            gauge.set(math.nan)  # (until an update says: no 0 that a "too low" alert mistakes for one)
        self._counters = {key: Counter(_metric_name(key), text, registry=r) for key, text in ROW_COUNTERS.items()}
        self._faults = {key: Counter(PREFIX + name, text, registry=r) for key, (name, text) in FAULT_COUNTERS.items()}
        self._episodes = _SessionCounter(
            Counter(
                PREFIX + "episodes",
                "Episodes that ended since this learner started (not a resumed run's earlier sessions')",
                registry=r,
            )
        )
        self._steps = _SessionCounter(
            Counter(
                PREFIX + "env_steps",
                "Env steps since this learner started (global_step's; not a resumed run's earlier sessions')",
                registry=r,
            )
        )
        self._updates = _SessionCounter(
            Counter(PREFIX + "ppo_updates", "PPO updates since this learner started", registry=r)
        )
        self._replica_counters = {
            key: Counter(f"{PREFIX}replica_{key}", text, labelnames=("replica",), registry=r)
            for key, text in REPLICA_COUNTERS.items()
        }
        self._replica_info = Gauge(
            f"{PREFIX}replica_info",
            "1 for each env server of the fleet: its replica label and its process's server_id (as the server's "
            "envfleet_server_info says it), to join the two sides' series",
            labelnames=("replica", "server_id"),
            registry=r,
        )
        self._replica_ids: dict[str, str] = {}
        self._replica_gauges = {
            key: (Gauge(f"{PREFIX}replica_{name}", text, labelnames=("replica",), registry=r), scale)
            for key, (name, scale, text) in REPLICA_GAUGES.items()
        }
        self._replicas: set[str] = set()
        self._waiting: set[str] = set()  # (servers listed at the start that have not joined: available 0 only)
        self._slowest: dict[str, deque[tuple[float, float]]] = {}  # (replica: its rollouts' (time, slowest round trip))
        self._total_timesteps = Gauge(
            PREFIX + "total_timesteps", "Env steps the run trains for (--total-timesteps; NaN until known)", registry=r
        )
        self._total_timesteps.set(math.nan)
        self._solved = Gauge(
            PREFIX + "solved",
            "1 once the run is solved (mean return of the last 20 episodes >= its bar), else 0 (NaN until known)",
            registry=r,
        )
        self._solved.set(math.nan)  # (a resumed run that was solved: not a 0 while it starts)
        self._ended = Gauge(
            PREFIX + "run_ended_timestamp_seconds",
            "Unix time the run ended, by its reason: total_timesteps, stop_at_return, interrupted or error "
            "(with --metrics-linger, served for that long after)",
            labelnames=("reason",),
            registry=r,
        )
        self._ended_by: str | None = None
        self._last_update = Gauge(
            PREFIX + "last_update_timestamp_seconds",
            "Unix time of the last PPO update (until the first: when the learner started)",
            registry=r,
        )
        self._last_update.set(time.time())
        self.set_run(env_id=env_id, run_dir=run_dir)
        self._httpd: Any = None
        self._stopping = threading.Lock()  # (close()'s timer and a Ctrl-C's wait_for_lingering may both stop it)
        self.url: str | None = None
        """``http://HOST:PORT/metrics`` once served (:meth:`serve_http`)."""

    def set_run(self, *, env_id: str, run_dir: str) -> None:
        """The info metric's env id and run dir ("" while not known: servers still to say their env, a run
        dir still to be made)."""
        self._info.info({"env_id": env_id, "run_dir": run_dir, "version": package_version()})

    def run_started(
        self,
        *,
        env_id: str,
        run_dir: str,
        total_timesteps: int,
        global_step: int,
        updates: int,
        episodes: int,
        solved: bool,
    ) -> None:
        """The run is set up (a resumed one from its checkpoint, whose counts these are): what it is, and
        where it starts from."""
        self.set_run(env_id=env_id, run_dir=run_dir)
        self._total_timesteps.set(total_timesteps)
        self._gauges["global_step"].set(global_step)
        self._gauges["update"].set(updates)
        self._solved.set(int(solved))
        # (the run's totals before this session: its counters count from there)
        self._episodes.total, self._steps.total, self._updates.total = episodes, global_step, updates

    def observe_evaluation(self, columns: Mapping[str, Any]) -> None:
        """The eval/ ``columns`` of an evaluation added to the last update's row after it was observed (learner train
        --eval-every, a run stopped by --stop-at-return: Recorder.add_evaluation): their gauges, and nothing counted
        again."""
        for key, gauge in self._gauges.items():
            if key in columns:
                gauge.set(_number(columns[key]))

    def observe_update(
        self,
        row: Mapping[str, Any],
        *,
        solved: bool,
        server_ids: Mapping[str, str] | None = None,
        not_joined: Iterable[str] = (),
    ) -> None:
        """An update's metrics.jsonl ``row`` (``learner.records.metrics_row``'s), whether the run is solved,
        each replica's server process id (by its label in the row; missing or "": unknown), and the servers
        listed at the start that have not joined yet (``available`` 0 for each, until it joins: an alert on
        it sees them)."""
        for key, gauge in self._gauges.items():
            if key in row:
                gauge.set(_number(row[key]))
        for key, counter in self._counters.items():
            counter.inc(max(row.get(key) or 0, 0))
        for key, counter in self._faults.items():
            counter.inc(max(row.get(f"faults/{key}") or 0, 0))
        # (the run's totals so far: a resumed run's earlier sessions' too)
        self._episodes.advance(int(row["episodes"]))
        self._steps.advance(int(row["global_step"]))
        self._updates.advance(int(row["update"]))
        replicas: set[str] = set()
        for key, value in row.items():
            if not key.startswith(REPLICAS):
                continue
            replica, field = replica_key(key)
            if field in self._replica_gauges:
                gauge, scale = self._replica_gauges[field]
                if field == "latency_max_ms":
                    value = self._slowest_lately(replica, _number(value))
                gauge.labels(replica).set(_number(value) * scale)
                replicas.add(replica)
            elif field in self._replica_counters:
                self._replica_counters[field].labels(replica).inc(max(value or 0, 0))
        available, _ = self._replica_gauges["available"]
        waiting = set(not_joined) - replicas
        for replica in self._waiting - waiting - replicas:  # (no longer listed: it never joined)
            available.remove(replica)
        for replica in waiting:
            available.labels(replica).set(0)
        self._waiting = waiting
        # Each row names every replica of the fleet: one missing has left it (back, it is named again).
        for replica in self._replicas - replicas:
            for gauge, _ in self._replica_gauges.values():
                gauge.remove(replica)
            for counter in self._replica_counters.values():
                counter.remove(replica)
            self._slowest.pop(replica, None)
        self._replicas = replicas
        ids = {replica: (server_ids or {}).get(replica, "") for replica in replicas}
        for replica, server_id in self._replica_ids.items():
            if ids.get(replica) != server_id:  # (left, or restarted: a new process, a new id)
                self._replica_info.remove(replica, server_id)
        for replica, server_id in ids.items():
            self._replica_info.labels(replica, server_id).set(1)
        self._replica_ids = ids
        self._solved.set(int(solved))
        self._last_update.set(time.time())

    def observe_fleet_down(self, servers: int, envs: int | None = None) -> None:
        """Every server of the fleet is down (``servers`` of them; see ``Recorder.fleet_down``): no update comes
        while it lasts, so the gauges an update sets would go on saying the fleet is up (``_servers_down`` 0,
        each replica's ``_available`` 1) through an outage of any length, where an alert on them should fire.
        They say it now (``_envs_unavailable``: ``envs``, every env of the fleet, where given);
        :meth:`observe_fleet_up` as the first server is back, and the next update from its row. (It is
        :meth:`observe_fleet_up` with no server up.)"""
        self.observe_fleet_up((), servers, envs)

    def observe_fleet_up(self, up: Collection[str], servers_down: int, envs_unavailable: int | None = None) -> None:
        """A server answers steps again after :meth:`observe_fleet_down` (``up``: those up now, by their labels;
        ``servers_down``: the fleet's others): the gauges say so now, not "every server down" until the next
        update, minutes away where a rollout is long (Atari's). Each replica the last update named is
        ``_available`` 1 if it is up, else 0 (one that has left since included, until the next update's row
        drops it); ``_envs_unavailable`` the envs of the servers still down, where given."""
        self._gauges["faults/servers_down"].set(servers_down)
        if envs_unavailable is not None:
            self._gauges["envs_unavailable"].set(envs_unavailable)
        available, _ = self._replica_gauges["available"]
        for replica in self._replicas:
            available.labels(replica).set(int(replica in up))

    def _slowest_lately(self, replica: str, slowest: float) -> float:
        """The slowest round trip of ``replica`` over the rollouts of the last :data:`SLOWEST_WINDOW_S`, this
        one's ``slowest`` (NaN: no steps) included."""
        now = time.monotonic()
        kept = self._slowest.setdefault(replica, deque())
        if not math.isnan(slowest):
            kept.append((now, slowest))
        while kept and kept[0][0] < now - SLOWEST_WINDOW_S:
            kept.popleft()
        return max((value for _, value in kept), default=math.nan)

    def observe_progress(self, *, global_step: int, solved: bool) -> None:
        """The run's steps and whether it is solved as of now, between updates: a run solved by --stop-at-return
        in a rollout no update learns from, before its last nets are evaluated (learner train --eval-every:
        PeriodicEval.final, which takes as long as its episodes, minutes with --eval-episodes 1000), the solved
        gauge said 0, and the steps those of the last update, throughout; then :meth:`run_ended`."""
        self._gauges["global_step"].set(global_step)
        self._steps.advance(global_step)
        self._solved.set(int(solved))

    def run_ended(self, *, global_step: int, solved: bool, stop_reason: str | None = None) -> None:
        """The run's end: its steps since the last update's row (a last rollout that no update learned
        from), whether it is solved, and why it ended (summary.json's ``stop_reason``: an error's is said
        as ``error``), for the scrapes before the endpoint closes (:meth:`close`)."""
        self.observe_progress(global_step=global_step, solved=solved)
        reason = "error" if (stop_reason or "error").startswith("error") else stop_reason
        self._ended_by = reason
        self._ended.labels(reason).set(time.time())

    def serve_http(self, host: str, port: int, *, shown: str | None = None) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: any free port) from a daemon thread; returns the port. ``url``
        names ``shown`` (the host as the user gave it: 0.0.0.0, not the :: served on), else ``host``."""
        httpd = serve_registry(self.registry, host, port)  # (idle connections closed, at most a few at once)
        self._httpd = httpd
        port = int(httpd.server_port)
        self.url = f"http://{host_port(shown or host, port)}/metrics"
        return port

    def close(self, linger: float = 0.0) -> None:
        """Stop serving (the listening socket closes): now, or ``linger`` seconds from now where the run ended
        other than by a Ctrl-C (:meth:`run_ended`), its last values served meanwhile (a scrape every 15 s
        or more rarely saw them otherwise: the endpoint closed ~2 s after the last update). The command
        waits for that (:func:`wait_for_lingering`); a Python program ends it by ending."""
        if self._httpd is None:
            return
        if linger > 0 and self._ended_by not in (None, "interrupted"):
            timer = threading.Timer(linger, self._stop)
            timer.daemon = True  # (it does not keep a Python program alive: the command waits for it)
            now = time.monotonic()
            _lingering.append((timer, self, now + linger, now))
            timer.start()
            return
        self._stop()

    def _stop(self) -> None:
        with self._stopping:
            if self._httpd is not None:
                self._httpd.shutdown()
                self._httpd.server_close()
                self._httpd = None


_lingering: list[tuple[threading.Timer, LearnerMetrics, float, float]] = []
"""Endpoints served on after their run's end (:meth:`LearnerMetrics.close`): their timers, when they close, and
when they began to linger (time.monotonic())."""


def lingering(since: float = -math.inf) -> list[tuple[str, float]]:
    """The endpoints still served after their run's end (those whose run ended after ``since``, on
    time.monotonic()'s clock): their URL and the seconds until they close."""
    now = time.monotonic()
    return [
        (metrics.url or "", max(0.0, until - now))
        for timer, metrics, until, ended in _lingering
        if timer.is_alive() and ended >= since
    ]


def wait_for_lingering(since: float = -math.inf) -> None:
    """Wait until every endpoint served on after its run's end (``close(linger)``; those whose run ended
    after ``since``) has closed; a Ctrl-C closes them at once. (A Python program that trains with
    ``metrics_linger`` calls it before it ends: the endpoint's thread does not keep it alive.)"""
    waited = [entry for entry in _lingering if entry[3] >= since]
    try:
        for timer, _, _, _ in waited:
            while timer.is_alive():
                timer.join(0.25)  # (in steps: a Ctrl-C raises between them, wherever it was sent from)
    except KeyboardInterrupt:
        _end_lingering(waited)
    _lingering[:] = [entry for entry in _lingering if entry[0].is_alive() and entry not in waited]


def _end_lingering(entries: list[tuple[threading.Timer, LearnerMetrics, float, float]]) -> None:
    """End the linger of the endpoints ``entries`` (of :data:`_lingering`) now."""
    for timer, metrics, _, _ in entries:
        timer.cancel()
        metrics._stop()


def serve_metrics(host: str, port: int, *, env_id: str = "", run_dir: str = "") -> LearnerMetrics:
    """A run's :class:`LearnerMetrics`, served on ``host:port`` (0: a free port) and logged; OptionError
    naming --metrics-port (or --metrics-host) where it cannot be."""
    metrics = LearnerMetrics(env_id=env_id, run_dir=run_dir)
    _end_lingering(_lingering)  # (an earlier run of this process, served on after its end: its port may be this one)
    _lingering.clear()
    try:
        # (0.0.0.0: served on "::" where that takes IPv4 too, as gRPC's)
        metrics.serve_http(http_host(host), port, shown=host)
    except socket.gaierror as err:
        problem = host_problem(host, host_option="--metrics-host", port_option="--metrics-port")
        raise OptionError(problem or f"--metrics-host {host!r}: cannot resolve it: {err.strerror}") from err
    except OSError as err:
        where = host_port(host, port)
        hint = bind_hint(host, err.errno, host_option="--metrics-host", port_option="--metrics-port")
        raise OptionError(f"cannot serve metrics on {where}: {os_reason(err)} ({hint})") from err
    log.info("Prometheus metrics on %s", metrics.url)
    return metrics
