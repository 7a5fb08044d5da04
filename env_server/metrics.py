"""Prometheus metrics of one env server: step latency, steps, resets, errors (``--metrics-port``)."""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server

__all__ = ["LATENCY_BUCKETS", "ServerMetrics"]

log = logging.getLogger(__name__)

# Seconds. A CartPole batch takes ~50 us to step and ~150 us to serve; an Atari batch milliseconds;
# a robot or a remote simulator up to seconds.
LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
)


class ServerMetrics:
    """The server's counters and histograms, in a registry of their own.

    Recording is a few microseconds per step; nothing is served until :meth:`serve_http` is called.
    """

    def __init__(self, *, env_id: str, num_envs: int, vectorization: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.step_latency = Histogram(
            "envfleet_step_latency_seconds",
            "Time the server took to answer one Step/StepStream request (decode, check, step all K envs, "
            "encode), excluding the network",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.env_step_latency = Histogram(
            "envfleet_env_step_latency_seconds",
            "Time the vector env's own step took for one request (all K envs)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.steps = Counter("envfleet_steps", "Batched steps served (one per Step request)", registry=r)
        self.env_steps = Counter("envfleet_env_steps", "Env steps served (K per batched step)", registry=r)
        self.resets = Counter("envfleet_resets", "Reset requests served", registry=r)
        self.errors = Counter(
            "envfleet_errors", "Requests that failed, by gRPC status code", labelnames=("code",), registry=r
        )
        self.env_errors = Counter(
            "envfleet_env_errors",
            "Env steps reported with an error record (one env raised; the others' results were sent)",
            registry=r,
        )
        self.session_active = Gauge(
            "envfleet_session_active", "1 while a learner holds this server's envs, else 0", registry=r
        )
        self.num_envs = Gauge("envfleet_num_envs", "Envs this server hosts (K)", registry=r)
        self.num_envs.set(num_envs)
        Info("envfleet_server", "What this server hosts", registry=r).info(
            {"env_id": env_id, "vectorization": vectorization}
        )
        self._httpd: Any = None

    def observe_step(self, seconds: float, env_seconds: float, num_envs: int) -> None:
        self.step_latency.observe(seconds)
        self.env_step_latency.observe(env_seconds)
        self.steps.inc()
        self.env_steps.inc(num_envs)

    def serve_http(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: any free port) from a daemon thread; returns the port."""
        httpd, _ = start_http_server(port, addr=host, registry=self.registry)
        self._httpd = httpd
        return int(httpd.server_port)

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
