"""Prometheus metrics of one env server: step and reset latency, steps, resets, errors, sessions (``--metrics-port``)."""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    make_wsgi_app,
)
from prometheus_client.metrics_core import Metric

from env_server.interceptors import RefusalLog
from env_server.protocol import host_port, package_version

__all__ = [
    "ERROR_CODES",
    "LATENCY_BUCKETS",
    "MAX_HTTP_CONNECTIONS",
    "METHODS",
    "HTTP_TIMEOUT_S",
    "SESSION_END_REASONS",
    "NoCreatedRegistry",
    "ServerMetrics",
    "serve_registry",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# Seconds. A CartPole batch takes ~50 us to step and ~150 us to serve (10 us: the step socket's
# overhead alone); an Atari batch milliseconds; a robot or a remote simulator up to seconds; past
# 10 s (the learner's default timeout, learner train --timeout) a step has failed the learner.
# 1-1.5-2-3-5-7 in each decade (at most 1.67x apart), not 1-2-5: a step of a fixed D ms (--step-delay-ms,
# a robot's rate) takes a little over D, just above an edge, and histogram_quantile() puts the median
# halfway up its bucket (3.5 ms for 2.1 ms in (2, 5], 15 ms for 10.4 ms in (10, 20]); for figures to
# compare with the learner's, the mean (the _sum's rate over the _count's) is exact.
LATENCY_BUCKETS = (
    0.00001,
    0.000015,
    0.00002,
    0.00003,
    0.00005,
    0.00007,
    0.0001,
    0.00015,
    0.0002,
    0.0003,
    0.0005,
    0.0007,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.007,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.07,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.7,
    1.0,
    1.5,
    2.0,
    3.0,
    5.0,
    7.0,
    10.0,
    30.0,
    60.0,
)

METHODS = ("GetSpec", "Handshake", "Hold", "Reset", "Step", "StepStream", "Release")
"""The ``method`` label of ``envfleet_errors_total``: the EnvService rpc (the step socket's steps
count as StepStream)."""
ERROR_CODES = (
    "INVALID_ARGUMENT",
    "FAILED_PRECONDITION",
    "RESOURCE_EXHAUSTED",
    "UNAVAILABLE",
    "INTERNAL",
    "DEADLINE_EXCEEDED",
)
"""The status codes the service sends, besides UNAUTHENTICATED (the token check's); DEADLINE_EXCEEDED:
a Handshake that came after its deadline."""
SESSION_END_REASONS = ("released", "hold_ended", "claim_timeout", "shutdown", "unanswered")
"""The ``reason`` label of ``envfleet_sessions_ended_total``: the learner released the session
(Release: it closed); its Hold stream ended without a Release (the learner closed without one,
crashed, or its connection dropped); the claim timed out (no Hold stream and no calls for
``--claim-timeout``); the server shut down; the Handshake's answer could not be sent (the call's
deadline passed, the client cancelled it or refused an answer over its receive limit), so no client
knew the session."""

_CREATED_SUFFIX = "_created"
_TYPES_WITH_CREATED = ("counter", "histogram", "summary")


class NoCreatedRegistry(CollectorRegistry):
    """A registry that exports no ``_created`` series (the time each series was made: one more series
    per counter and histogram that dashboards do not use). Per registry, unlike prometheus_client's
    ``disable_created_metrics()``, which turns them off for every registry of the process (the
    learner's, ``learner train --metrics-port``, is one too)."""

    def collect(self) -> Iterable[Metric]:
        return map(_without_created, super().collect())

    def restricted_registry(self, names: Iterable[str]) -> Any:  # (what ?name[]=... on /metrics serves)
        return _Filtered(super().restricted_registry(names))


class _Filtered:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def collect(self) -> Iterable[Metric]:
        return map(_without_created, self._inner.collect())


def _without_created(metric: Metric) -> Metric:
    if metric.type in _TYPES_WITH_CREATED:
        created = metric.name + _CREATED_SUFFIX
        metric.samples = [s for s in metric.samples if s.name != created]  # (a fresh Metric per collect)
    return metric


class ServerMetrics:
    """The server's counters and histograms, in a registry of their own, with the process's CPU and
    memory (``process_*``) and Python's version (``python_info``).

    Recording is a few microseconds per step; nothing is served until :meth:`serve_http` is called.
    """

    def __init__(self, *, env_id: str, num_envs: int, vectorization: str, needs_token: bool = False) -> None:
        self.registry = NoCreatedRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)  # (exports nothing where there is no /proc)
        PlatformCollector(registry=r)
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
        self.reset_latency = Histogram(
            "envfleet_reset_latency_seconds",
            "Time the server took to answer one Reset request (all K envs, or those of its reset_mask)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.steps = Counter("envfleet_steps", "Batched steps served (one per Step request)", registry=r)
        self.env_steps = Counter("envfleet_env_steps", "Env steps served (K per batched step)", registry=r)
        self.resets = Counter("envfleet_resets", "Reset requests served", registry=r)
        self.errors = Counter(
            "envfleet_errors",
            "Requests that failed, by EnvService method and gRPC status code",
            labelnames=("method", "code"),
            registry=r,
        )
        # Every series a refusal may land in exists from the start, at 0: Prometheus' increase() and
        # rate() see a series' first error only against an earlier sample of it.
        codes = ERROR_CODES + (("UNAUTHENTICATED",) if needs_token else ())
        for method in METHODS:
            for code in codes:
                self.errors.labels(method, code)
        self.env_errors = Counter(
            "envfleet_env_errors",
            "Env steps reported with an error record (one env raised; the others' results were sent)",
            registry=r,
        )
        self.session_active = Gauge(
            "envfleet_session_active", "1 while a learner holds this server's envs, else 0", registry=r
        )
        self.sessions_started = Counter(
            "envfleet_sessions_started", "Sessions begun (Handshakes that claimed the envs)", registry=r
        )
        self.sessions_ended = Counter(
            "envfleet_sessions_ended",
            "Sessions ended, by why: released, hold_ended (learner closed or disconnected without a Release), "
            "claim_timeout, shutdown, unanswered (its Handshake's answer could not be sent)",
            labelnames=("reason",),
            registry=r,
        )
        for reason in SESSION_END_REASONS:  # (at 0 from the start, as the error series)
            self.sessions_ended.labels(reason)
        self.ready = Gauge(
            "envfleet_ready",
            "1 while the server serves its envs (health SERVING), else 0: building them, shutting down, or its "
            "envs can no longer run",
            registry=r,
        )
        self.env_build_seconds = Gauge(
            "envfleet_env_build_seconds",
            "Seconds the server took to build its envs (0 until they are built)",
            registry=r,
        )
        self.env_rebuilds = Counter(
            "envfleet_env_rebuilds",
            "Builds of the envs anew for a new learner (env-server --fresh-envs), by outcome: ok, failed",
            labelnames=("outcome",),
            registry=r,
        )
        for outcome in ("ok", "failed"):  # (at 0 from the start, as the error series)
            self.env_rebuilds.labels(outcome)
        self.num_envs = Gauge("envfleet_num_envs", "Envs this server hosts (K)", registry=r)
        self.num_envs.set(num_envs)
        self._server_info = Info("envfleet_server", "What this server hosts and how it is reached", registry=r)
        self._info = {"env_id": env_id, "vectorization": vectorization, "version": package_version(), "server_id": ""}
        self.set_transport("tcp")
        self._httpd: Any = None

    def set_transport(self, transport: str) -> None:
        """How learners reach the server (``tcp``, ``unix``, or ``unix+step-socket``), for the info metric."""
        self._info["transport"] = transport
        self._server_info.info(self._info)

    def set_server_id(self, server_id: str) -> None:
        """The process's id, as its spec gives it to learners (their ``envfleet_learner_replica_info``
        says which replica it is), for the info metric (set as the service is made, before the envs)."""
        self._info["server_id"] = server_id
        self._server_info.info(self._info)

    def observe_step(self, seconds: float, env_seconds: float, num_envs: int) -> None:
        self.step_latency.observe(seconds)
        self.env_step_latency.observe(env_seconds)
        self.steps.inc()
        self.env_steps.inc(num_envs)

    def count_error(self, method: str, code: str) -> None:
        """One request of ``method`` (``Step``) failed with status ``code`` (``INVALID_ARGUMENT``)."""
        self.errors.labels(method, code).inc()

    def session_started(self) -> None:
        """A session began: the envs are claimed."""
        self.sessions_started.inc()
        self.session_active.set(1)

    def session_ended(self, reason: str) -> None:
        """The session ended, for ``reason``, one of :data:`SESSION_END_REASONS`."""
        if reason not in SESSION_END_REASONS:
            raise ValueError(f"reason: expected one of {', '.join(SESSION_END_REASONS)}, got {reason!r}")
        self.sessions_ended.labels(reason).inc()
        self.session_active.set(0)

    def observe_reset(self, seconds: float) -> None:
        self.reset_latency.observe(seconds)
        self.resets.inc()

    def serve_http(self, host: str, port: int) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: any free port) from a daemon thread; returns the port."""
        self._httpd = serve_registry(self.registry, host, port)
        return int(self._httpd.server_port)

    def http_host(self) -> str:
        """The address ``/metrics`` is served on (of those its host resolves to, the one bound)."""
        return str(self._httpd.server_address[0]) if self._httpd is not None else ""

    def close(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None


# -- the HTTP endpoint -----------------------------------------------------------------------------

HTTP_TIMEOUT_S = 10.0
"""Seconds the metrics endpoint waits on a connection for the next bytes of its request (or for room
to send the answer) before closing it. A scrape sends its request at once; a connection that sends
nothing, or half a request, would otherwise keep its thread for ever (1000 such held ~900 threads)."""
HTTP_DEADLINE_S = 30.0
"""Seconds a connection to the metrics endpoint may take in all, its request read and answered, before
it is closed: HTTP_TIMEOUT_S bounds each wait for bytes, so a peer sending a byte every few seconds
would otherwise keep its thread (and, MAX_HTTP_CONNECTIONS of them, every scrape out) for ever. A
scrape takes milliseconds."""
MAX_HTTP_CONNECTIONS = 16
"""Connections the metrics endpoint serves at once, each on a thread of its own; one more takes the
place of the oldest whose request has not all come (a scrape sends its request at once: only a peer
holding connections open loses one), or is closed unanswered if every one has sent its request.
Prometheus scrapes one at a time (a few, with replicas or more than one Prometheus)."""
# Seconds a new connection waits for the place of one closed to make room for it (its thread ends at once).
_ROOM_WAIT_S = 5.0
# Seconds between two log lines about connections closed unanswered.
_LOG_EVERY_S = 10.0


def serve_registry(registry: CollectorRegistry, host: str, port: int) -> Any:
    """Serve ``registry`` at ``http://host:port/metrics`` (0: any free port) from a daemon thread, as
    prometheus_client's ``start_http_server`` does, but for what a peer may hold: a connection is
    closed after :data:`HTTP_TIMEOUT_S` without progress, and at most :data:`MAX_HTTP_CONNECTIONS`
    are served at once. Returns the server (``server_port``; ``shutdown()`` then ``server_close()``
    to stop); OSError (socket.gaierror for a host that does not resolve) if it cannot listen."""

    def listen(family: socket.AddressFamily, sockaddr: Any) -> _MetricsServer:
        class Server(_MetricsServer):
            address_family = family

        return Server(sockaddr, _MetricsHandler)  # (IPv6's whole 4-tuple: a link-local address's scope id)

    httpd = _bind_first(host, port, listen)
    httpd.set_app(make_wsgi_app(registry))
    threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True).start()
    return httpd


def _bind_first(host: str, port: int, bind: Callable[[socket.AddressFamily, Any], T]) -> T:
    """``bind(family, socket address)`` for each address ``host`` resolves to (see :func:`metrics_addresses`)
    until one binds: its result (localhost: 127.0.0.1 where there is no ::1, or ::1 where /etc/hosts lists
    127.0.0.1 first and there is no IPv4 loopback). The next is tried only after an error that says this machine
    lacks the address (NO_SUCH_ADDRESS): a port taken is the error, not served on another of the host's
    addresses, which others would not reach. OSError naming the addresses tried (see :func:`none_bound`);
    socket.gaierror where ``host`` does not resolve."""
    tried: list[tuple[Any, OSError]] = []
    for family, sockaddr in metrics_addresses(host, port):
        try:
            return bind(family, sockaddr)
        except OSError as err:
            tried.append((sockaddr, err))
            if err.errno not in NO_SUCH_ADDRESS:
                break
    raise none_bound(tried, port)


NO_SUCH_ADDRESS = (errno.EADDRNOTAVAIL, errno.ENETUNREACH, errno.EAFNOSUPPORT)
"""A bind's errors that say this machine lacks the address (no IPv4 loopback, IPv6 disabled), not that the port
is taken: after them the next address is tried."""


def metrics_addresses(host: str, port: int) -> list[tuple[socket.AddressFamily, Any]]:
    """(family, socket address) of each address the metrics endpoint may listen on for ``host``, in the
    order :func:`serve_registry` tries them: those ``host`` resolves to, in the system's order, and for
    localhost then both loopbacks, as gRPC listens on both whatever the system's look-up says (/etc/hosts
    may list 127.0.0.1 alone, on a machine that has ::1 alone). socket.gaierror where ``host`` does not resolve."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    if host.lower() == "localhost":
        infos += [
            (socket.AF_INET6, socket.SOCK_STREAM, 0, "", ("::1", port, 0, 0)),
            (socket.AF_INET, socket.SOCK_STREAM, 0, "", ("127.0.0.1", port)),
        ]
    addresses: list[tuple[socket.AddressFamily, Any]] = []
    for family, _, _, _, sockaddr in infos:
        if (family, sockaddr) not in addresses:
            addresses.append((family, sockaddr))
    return addresses


def bind_error(host: str, port: int) -> OSError | None:
    """Why the metrics endpoint cannot listen on ``host:port`` now, as :func:`serve_registry` binds (the
    first of ``host``'s addresses that binds); None if it can. socket.gaierror where ``host`` does not
    resolve. Only a check: the bind decides in the end."""

    def check(family: socket.AddressFamily, sockaddr: Any) -> None:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as http.server binds)
            _both_families(sock, family, sockaddr)
            sock.bind(sockaddr)

    try:
        _bind_first(host, port, check)
    except socket.gaierror:
        raise
    except OSError as err:
        return err
    return None


def none_bound(tried: list[tuple[Any, OSError]], port: int) -> OSError:
    """The error of a host none of whose addresses bound (``tried``: each address and its error): the
    error itself for one address; for more, one naming each (its errno: a taken port's, where one is)."""
    if len(tried) == 1:
        return tried[0][1]
    if not tried:
        return OSError(errno.EADDRNOTAVAIL, "the host resolves to no address")
    where = [host_port(str(address[0]), port) for address, _ in tried]
    reasons = {err.strerror or str(err) for _, err in tried}
    if len(reasons) == 1:
        text = f"{reasons.pop()} at each of its addresses ({', '.join(where)})"
    else:
        text = "; ".join(f"{err.strerror or err} at {w}" for w, (_, err) in zip(where, tried, strict=True))
    taken = [err for _, err in tried if err.errno == errno.EADDRINUSE]
    return OSError((taken or [tried[0][1]])[0].errno, text)


def _both_families(sock: socket.socket, family: int, sockaddr: Any) -> None:
    """An IPv6 wildcard takes IPv4 too, as gRPC's does, even where ``net.ipv6.bindv6only`` makes IPv6
    sockets IPv6-only by default (where the platform has the option)."""
    if family == socket.AF_INET6 and sockaddr[0] == "::" and hasattr(socket, "IPV6_V6ONLY"):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)


class _MetricsHandler(WSGIRequestHandler):
    """One connection: one request, read (and answered) within HTTP_TIMEOUT_S between bytes and
    HTTP_DEADLINE_S in all; no log lines."""

    server: _MetricsServer
    connection: socket.socket

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(HTTP_TIMEOUT_S)  # (read here, not at import: the tests shorten it)
        self._deadline = threading.Timer(HTTP_DEADLINE_S, self._cut)
        self._deadline.daemon = True
        self._deadline.start()

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        self.server.read(self.connection)  # (its request line and headers are in: not to be closed for room)
        return parsed

    def _cut(self) -> None:
        """Past the deadline: end the connection (the thread's read or write fails, and it ends)."""
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        self._deadline.cancel()
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        """Log nothing (as prometheus_client's handler): a line per scrape."""


class _MetricsServer(ThreadingMixIn, WSGIServer):
    """A thread per connection (daemon threads: none is waited for at exit), at most MAX_HTTP_CONNECTIONS;
    past them, a new connection takes the place of the oldest whose request has not all come."""

    daemon_threads = True
    # (the listen backlog: socketserver's 5 dropped the 7th connect of a burst until its SYN was sent again, 1 s
    # later, or 3 s: a scrape coming in a flood of connections waited that long, where the accept loop keeps up)
    request_queue_size = 128

    def server_bind(self) -> None:
        _both_families(self.socket, self.address_family, self.server_address)
        super().server_bind()

    def server_activate(self) -> None:
        super().server_activate()
        self._slots = threading.BoundedSemaphore(MAX_HTTP_CONNECTIONS)
        # (log lines of each at most every _LOG_EVERY_S, with the count so far and of those left out)
        self._closed_unanswered = RefusalLog(_LOG_EVERY_S, what="connections closed unanswered")
        self._made_room = RefusalLog(_LOG_EVERY_S, what="connections closed to make room")
        # Connections whose request line and headers have not all come, oldest first, and their peers.
        self._reading: dict[socket.socket, Any] = {}
        self._reading_lock = threading.Lock()

    def read(self, connection: socket.socket) -> None:
        """``connection`` has its request (or has ended)."""
        with self._reading_lock:
            self._reading.pop(connection, None)

    def _make_room(self, client_address: Any) -> bool:
        """Close the oldest connection whose request has not all come, and wait for its place; False if
        there is none, or its place did not come free in time."""
        with self._reading_lock:
            if not self._reading:
                return False
            oldest = next(iter(self._reading))
            peer = self._reading.pop(oldest)
        with contextlib.suppress(OSError):  # (its thread's read fails, and it ends)
            oldest.shutdown(socket.SHUT_RDWR)
        suffix = self._made_room.note("metrics", grpc.StatusCode.RESOURCE_EXHAUSTED)
        if suffix is not None:
            log.warning(
                "metrics endpoint: %d connections open, the most it serves at once; closed the oldest whose "
                "request had not come (from %s), for one from %s %s",
                MAX_HTTP_CONNECTIONS,
                peer[0] if peer else "?",
                client_address[0] if client_address else "?",
                suffix,
            )
        return self._slots.acquire(timeout=_ROOM_WAIT_S)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False) and not self._make_room(client_address):
            self._note_closed(client_address)
            self.shutdown_request(request)
            return
        with self._reading_lock:
            self._reading[request] = client_address
        try:
            super().process_request(request, client_address)
        except BaseException:  # (the thread did not start: its slot is free again)
            self.read(request)
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.read(request)  # (its connection done: no longer one to close for room)
            self._slots.release()

    def _note_closed(self, client_address: Any) -> None:
        suffix = self._closed_unanswered.note("metrics", grpc.StatusCode.RESOURCE_EXHAUSTED)
        if suffix is not None:
            log.warning(
                "metrics endpoint: %d connections open, the most it serves at once; closed one from %s unanswered %s",
                MAX_HTTP_CONNECTIONS,
                client_address[0] if client_address else "?",
                suffix,
            )

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that timed out or broke is the peer's doing: a debug line, not a traceback on stderr."""
        err = sys.exc_info()[1]
        if isinstance(err, OSError):  # (TimeoutError, ConnectionResetError, BrokenPipeError, ...)
            log.debug("metrics endpoint: connection from %s: %s", client_address, err)
            return
        super().handle_error(request, client_address)
