"""Building and running the gRPC server: the env service, the health service, and shutdown."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import errno
import functools
import gc
import ipaddress
import json
import logging
import multiprocessing
import os
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import IO, Any

import grpc
import gymnasium as gym
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from env_server.codec import UnsupportedSpaceError
from env_server.config import DEFAULT_MAX_REQUEST_BYTES, ServerConfig
from env_server.envs import EnvBuildError, build_vector_env, check_env
from env_server.interceptors import CallLimitInterceptor, RequestGuardInterceptor, TokenAuthInterceptor
from env_server.isolation import IsolateErrors, tell_positions
from env_server.metrics import NO_SUCH_ADDRESS, ServerMetrics
from env_server.metrics import bind_error as metrics_bind_error
from env_server.protocol import (
    DOUBLE_TAP_S,
    MAX_MESSAGE_BYTES,
    MAX_UNIX_PATH,
    SERVICE_NAME,
    STEP_SOCKET_SUFFIX,
    bind_hint,
    check_key_pair,
    grpc_target,
    host_port,
    host_problem,
    http_host,
    runtime_versions,
    unreadable_ca,
)
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from env_server.service import ANSWER_HEADROOM, SPEC_ROOM, AnswerHandshakes, EnvService, space_bytes
from env_server.step_socket import FileIdentity, StepSocketServer, check_stale, file_identity, remove_own_file
from env_server.tuning import detach_from_terminal

__all__ = ["MAX_STREAMS_PER_CONNECTION", "HealthService", "run", "serve", "server_credentials", "server_options"]

log = logging.getLogger(__name__)


MAX_STREAMS_PER_CONNECTION = 8
"""Calls in progress at once on one connection (HTTP/2 streams): a learner's connection carries 2-3."""

EXIT_MARGIN_S = 10.0
"""How long a server's teardown (after the drain) may take before the process exits regardless: the
default of :func:`run`'s and :func:`serve`'s ``exit_margin_s``."""


# The gRPC core compression levels (grpc_compression_level: 1 LOW, 3 HIGH) that pick each algorithm first.
_COMPRESSION_LEVELS = {"gzip": 1, "deflate": 3}


def server_options(
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, bdp_probe: bool = False, compression: str = "none"
) -> list[tuple[str, int]]:
    """Channel options for the server: message limits and keepalive so dead peers are noticed;
    ``bdp_probe``: see below (``env-server --http2-bdp-probe``); ``compression``: how answers are
    compressed (``env-server --compression``: none, gzip or deflate)."""
    return [*_compression_options(compression), *_base_options(max_request_bytes, bdp_probe)]


def _compression_options(compression: str) -> list[tuple[str, int]]:
    """The server option that compresses every answer (each message of every call, streamed or not,
    the health service's too) with ``compression``, where the client accepts it.

    A compression *level*, not gRPC's default algorithm (``grpc.aio.server(compression=...)``): with
    an algorithm, gRPC core compresses with it whatever the client said it accepts (its
    grpc-accept-encoding), and a client that does not accept it fails every call whose answer
    compression shrinks ("Compression algorithm not supported", INTERNAL). With a level, gRPC core
    picks, per call, an algorithm among those the client accepts: level 1 (LOW) gzip, else deflate;
    3 (HIGH) deflate, else gzip; none when it accepts neither. gRPC's own clients (the learner's)
    accept both and decompress by themselves. An answer that compression would not make smaller
    (a health check's) goes uncompressed. (tests/test_compression.py checks each case.)"""
    if compression == "none":
        return []
    return [("grpc.default_compression_level", _COMPRESSION_LEVELS[compression])]


def _base_options(max_request_bytes: int, bdp_probe: bool) -> list[tuple[str, int]]:
    return [
        # A larger request is refused (RESOURCE_EXHAUSTED) before protobuf parses it, which can take
        # ~25x its size in memory; responses (observations) are larger by nature.
        ("grpc.max_receive_message_length", max_request_bytes),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # Ping an idle client every 10 s; a peer that does not answer within 5 s is dead, which ends
        # its Hold stream and so its claim.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        # gRPC core also waits this long for any ping's ack (default 60 s, which otherwise wins: a
        # stopped learner, whose host still acks TCP, kept its claim for ~68 s).
        ("grpc.http2.ping_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Let clients ping us as often as every 5 s (their own keepalive).
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
        # Never close a connection for "too many pings" (GOAWAY too_many_pings): seen in the Docker
        # tests on a loaded host, where pings bunch up; a learner's connection is worth more than
        # strict ping accounting, and the message and stream limits still bound a misbehaving peer.
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.so_reuseport", 0),
        # A learner opens a few streams per server, each on a connection of its own (Hold, StepStream,
        # a unary call or two); more at once on one connection is a misbehaving peer, which should not
        # take every place --max-concurrent-rpcs allows alone. (A client past it waits for a stream to
        # end; streams it opened before it heard of the limit are reset: UNAVAILABLE, REFUSED_STREAM.)
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        # Each stream's receive window stays at gRPC's initial 64 KiB, not grown to what the link could
        # carry (BDP probing: up to MBs): a call's request is read as its handler asks for it, whatever
        # the window, but a call not yet taken in (gRPC core holds them before Python does; past
        # --max-concurrent-rpcs, until refused) may have only its window's worth sent and held. With
        # probing, 64 connections x 8 calls of 4 MB held ~1.2 GB, cap or no cap; without, ~0.45 GB.
        # Requests (actions) are small; one over 64 KiB waits one round trip more for its window
        # (--http2-bdp-probe turns probing back on, for large actions across slow links).
        ("grpc.http2.bdp_probe", int(bdp_probe)),
    ]


class HealthService(health.aio.HealthServicer):
    """gRPC's health service, but for Watch, whose streams end (status OK) once the server shuts down,
    right after telling NOT_SERVING.

    gRPC's own Watch waits for the next change for as long as the stream is open, and after
    ``enter_graceful_shutdown`` none comes: each open Watch stream held the server's stop up for the
    whole grace period (``--grace``). Statuses change through :meth:`set` and
    :meth:`enter_graceful_shutdown` only, which this follows (Check still answers from gRPC's own).
    """

    def __init__(self) -> None:
        super().__init__()
        self._statuses: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}  # (as gRPC's starts)
        self._changed = asyncio.Event()  # set, and replaced, at each change
        self._shutting_down = False

    async def set(self, service: str, status: int) -> None:
        await super().set(service, status)
        if not self._shutting_down:  # (then gRPC's ignores it too)
            self._statuses[service] = status
            self._notify()

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        if not self._shutting_down:
            self._shutting_down = True
            self._statuses = dict.fromkeys(self._statuses, health_pb2.HealthCheckResponse.NOT_SERVING)
            self._notify()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        last = None
        while True:
            changed = self._changed  # (taken before the status is read: any change from here on sets it)
            # (taken with the status: a shutdown during the write below comes round again, and is told)
            shutting_down = self._shutting_down
            status = self._statuses.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if shutting_down:
                return
            await changed.wait()


def _report_dead(
    loop: asyncio.AbstractEventLoop, health_service: health.aio.HealthServicer, metrics: ServerMetrics | None
) -> None:
    """Health NOT_SERVING for good (and ``envfleet_ready`` 0): the envs cannot run any more (probes,
    compose: and Kubernetes then leave the server out; restart it)."""
    if metrics is not None:
        metrics.ready.set(0)
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    loop.call_soon_threadsafe(lambda: _DEAD_REPORTS.add(loop.create_task(_set_health(health_service, not_serving))))


async def _set_health(health_service: health.aio.HealthServicer, status: int) -> None:
    """``status`` for the env service and for the server overall ("")."""
    for name in (SERVICE_NAME, ""):
        await health_service.set(name, status)


# (the loop keeps tasks weakly: one reference per report, for the server's life)
_DEAD_REPORTS: set[asyncio.Task[None]] = set()


def _listen_address(config: ServerConfig) -> str:
    if config.unix_socket:
        return f"unix:{config.unix_socket}"
    return host_port(config.host, config.port)


def _check_bindable(config: ServerConfig) -> None:
    """Fail with the cause (another process has the port, a file is in the socket's place, ...)
    before gRPC tries and logs its own error lines, and before any env is built (a build may take
    minutes); the metrics port (``--metrics-port``) likewise. Only a check: the bind decides in the end."""
    if config.unix_socket:
        _check_socket_path(config.unix_socket)
    else:
        problem = _bind_error(config)
        if problem is not None:
            raise _cannot_listen(config, problem)
    if config.metrics_port is None:
        return
    if not config.unix_socket and config.metrics_port == config.port != 0:
        raise OSError(
            f"--metrics-port {config.metrics_port}: expected a port other than --port's (gRPC listens there), "
            "got the same; pick another, or 0 for a free one"
        )
    hosts = _metrics_hosts(config)
    for i, host in enumerate(hosts):
        try:
            problem = metrics_bind_error(host, config.metrics_port)
        except socket.gaierror as err:
            raise OSError(host_problem(host) or f"--host {host!r}: cannot resolve it: {err.strerror}") from err
        if problem is None:
            return
        if i + 1 < len(hosts) and problem.errno in NO_SUCH_ADDRESS:
            continue  # (no IPv4 loopback: the next, ::1)
        raise _cannot_serve_metrics(config, host, problem)


def _metrics_hosts(config: ServerConfig) -> list[str]:
    """The hosts the metrics endpoint may listen on, tried in order until one binds: ``--host``'s, as gRPC
    listens there (see :func:`~env_server.protocol.http_host`: ``::`` for 0.0.0.0, the image's, where that
    takes IPv4 too; a name, each of its addresses in turn: see :func:`~env_server.metrics.serve_registry`).
    A Unix-socket server's (whatever ``--host``, which serves nothing else then): 127.0.0.1, or ::1 where this
    machine has no IPv4 loopback."""
    if config.unix_socket:
        return ["127.0.0.1", "::1"]
    return [http_host(config.host)]


def _metrics_shown(config: ServerConfig, bound: str) -> str:
    """The host the metrics' log line names: the address the user gave (0.0.0.0, not the :: it is served
    on), else the address bound: which of a name's (localhost's), or of a Unix-socket server's loopbacks."""
    return bound if config.unix_socket or not _is_address(config.host) else config.host


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _cannot_serve_metrics(config: ServerConfig, host: str, err: OSError) -> OSError:
    """``err``, binding the metrics endpoint on ``host`` (the address that failed), with what to do."""
    shown = config.host if http_host(config.host) == host else host  # (0.0.0.0 as given, not ::)
    where = host_port(shown, config.metrics_port)
    hint = bind_hint(shown, err.errno, port_option="--metrics-port")
    return OSError(f"cannot serve metrics on {where}: {err.strerror or err} ({hint})")


def _bind_error(config: ServerConfig) -> OSError | None:
    """Why binding the TCP address of ``config`` fails now, as gRPC binds it; None if it binds.

    Port 0 is tried too: it tells an address this machine does not have (EADDRNOTAVAIL)."""
    return _bind_error_at(config.host, config.port)


def _bind_error_at(host: str, port: int) -> OSError | None:
    """Why binding ``host:port`` fails now, as gRPC binds (every address it listens on for ``host``: see
    :func:`_grpc_addresses`); None if it binds.

    gRPC listens if any of its addresses binds: on ``--host localhost`` with [::1]:PORT taken by another
    server it would listen on 127.0.0.1 alone, and the address it printed, localhost:PORT, would reach
    the other server too. So an address another process has fails the check, whichever it is (the
    error names it); one this machine lacks (no IPv6, no IPv4 loopback) is done without, as gRPC does,
    while another binds."""
    try:
        infos = _grpc_addresses(host, port)
    except socket.gaierror as err:
        problem = host_problem(host)
        raise OSError(problem or f"--host {host!r}: cannot resolve it: {err.strerror}") from err
    errors: list[OSError] = []
    bound = False
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds (and http.server)
                if family == socket.AF_INET6 and sockaddr[0] == "::":
                    # (gRPC's [::] takes IPv4 too; 0.0.0.0 is checked on its own, so that the error names it)
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(sockaddr)
        except OSError as err:
            if err.errno == errno.EAFNOSUPPORT:  # (no IPv6 here: gRPC does without it too)
                continue
            where = host_port(str(sockaddr[0]), port)
            if len(infos) > 1 and where != host_port(host, port):  # (which of the addresses, in the error)
                if sockaddr[0] in ("::", "0.0.0.0"):  # (the wildcard: some address of that family has the port)
                    kind = "IPv6" if family == socket.AF_INET6 else "IPv4"
                    err = OSError(err.errno, f"{err.strerror} on an {kind} address of this machine (tried {where})")
                else:
                    err = OSError(err.errno, f"{err.strerror} at {where}")
            errors.append(err)
        else:
            bound = True
    absent = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)
    taken = [err for err in errors if err.errno not in absent]
    if taken or not bound:
        return (taken or errors)[0] if errors else None
    return None


def _grpc_addresses(host: str, port: int) -> list[tuple[Any, Any, int, str, Any]]:
    """The addresses gRPC listens on for ``host`` (as ``socket.getaddrinfo`` gives them): for localhost
    [::1] and 127.0.0.1, which gRPC binds whatever the system's look-up says (that may give 127.0.0.1
    alone); for 0.0.0.0 and ::, the wildcard of both families (gRPC binds [::] taking IPv4 too, or
    0.0.0.0 where that fails); else those the name resolves to."""
    stream = (socket.SOCK_STREAM, socket.IPPROTO_TCP)
    if host.lower() == "localhost":
        return [(socket.AF_INET6, *stream, "", ("::1", port, 0, 0)), (socket.AF_INET, *stream, "", ("127.0.0.1", port))]
    if host in ("0.0.0.0", "::"):
        return [(socket.AF_INET6, *stream, "", ("::", port, 0, 0)), (socket.AF_INET, *stream, "", ("0.0.0.0", port))]
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)


def _cannot_listen(config: ServerConfig, err: OSError) -> OSError:
    return OSError(f"cannot listen on {_listen_address(config)}: {err.strerror} ({bind_hint(config.host, err.errno)})")


def _scratch_file() -> IO[bytes] | None:
    """An anonymous read-write file, for :class:`_StderrHeld`: in memory (``os.memfd_create``, Linux's),
    needing no writable directory; else (macOS, say) a temporary file; None where neither can be made."""
    memfd_create = getattr(os, "memfd_create", None)
    if memfd_create is not None:
        try:
            return os.fdopen(memfd_create("envfleet-stderr"), "w+b")  # (close-on-exec, as a file opened here is)
        except OSError:  # (a sandbox that refuses the call: a temporary file then)
            pass
    try:
        return tempfile.TemporaryFile()
    except OSError:  # ("No usable temporary directory found": a read-only filesystem, no tmpfs on /tmp)
        return None


class _StderrHeld:
    """Holds what is written to file descriptor 2 (gRPC core's C++ log lines, which bypass Python's
    logging) while the block runs, and writes it out at the end unless :meth:`drop` was called.

    Nothing is lost: lines other threads write meanwhile come out a moment late, in order. They are held
    in an anonymous in-memory file (see :func:`_scratch_file`), which needs no writable directory (a
    container's read-only root with no tmpfs on /tmp); where none can be made, nothing is held."""

    def __init__(self) -> None:
        self._dropped = False

    def __enter__(self) -> _StderrHeld:
        sys.stderr.flush()
        self._file = _scratch_file()
        if self._file is not None:
            try:
                self._saved = os.dup(2)
            except OSError:  # (out of file descriptors, say: hold nothing, as where no file could be made)
                self._file.close()
                self._file = None
            else:
                os.dup2(self._file.fileno(), 2)
        return self

    def drop(self) -> None:
        """Write nothing at the end (the text goes to the debug log)."""
        self._dropped = True

    def __exit__(self, *exc_info: object) -> None:
        if self._file is None:  # (held nothing: gRPC's lines went to stderr as they came)
            return
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        with self._file:
            self._file.seek(0)
            text = self._file.read()
        if not text:
            return
        if self._dropped:
            log.debug("gRPC: %s", text.decode(errors="replace").strip())
        else:
            os.write(2, text)


def _add_port(server: grpc.aio.Server, config: ServerConfig, credentials: grpc.ServerCredentials | None) -> int:
    """Listen on the address of ``config``; the port gRPC bound. Raises OSError saying why it cannot.

    gRPC raises only "Failed to bind" and logs the cause to stderr itself (``E... add_port.cc ...``).
    That line stays off stderr where a fresh check of the address tells the cause (the bind check
    before passed, so something changed since); otherwise it is shown above the error."""
    address = _listen_address(config)
    with _StderrHeld() as held:
        try:
            if credentials is None:
                return server.add_insecure_port(grpc_target(address))
            return server.add_secure_port(grpc_target(address), credentials)
        except RuntimeError as err:
            problem = None if config.unix_socket else _bind_error(config)
            if problem is not None:
                held.drop()
                raise _cannot_listen(config, problem) from err
            reason = str(err).split("; set GRPC_VERBOSITY")[0]
            raise OSError(f"cannot listen on {address}: {reason} (gRPC's log line above says why)") from err


def _check_socket_path(path: str) -> None:
    """A Unix socket can be made at ``path`` (gRPC replaces a stale socket there, nothing else)."""
    if not hasattr(socket, "AF_UNIX"):  # (Windows' Python: the probe below and the step socket need them)
        raise OSError(f"--unix-socket {path}: this platform has no Unix sockets; listen on TCP (--host, --port)")
    if "," in path:
        raise OSError(
            f"--unix-socket {path}: a comma in the path, where gRPC clients split a unix: address (a list of "
            "addresses), so no learner could connect; pick a path without one"
        )
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        folder = os.path.dirname(path) or "."
        if not os.path.isdir(folder):
            raise OSError(f"--unix-socket {path}: no folder {folder} to make it in") from None
        return
    except OSError as err:
        raise OSError(f"--unix-socket {path}: {err.strerror}") from err
    if not stat.S_ISSOCK(mode):
        kind = "a folder" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else "not a socket"
        raise OSError(f"--unix-socket {path}: exists and is {kind}, not a socket; remove it or pick another path")
    # A socket there: stale (left by a server that was killed; gRPC replaces it) or another server's,
    # which gRPC would replace too, taking its learners over and leaving it unreachable.
    check_stale(path, f"--unix-socket {path}")


def _read_pem(path: str, option: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise OSError(f"{option} {path}: cannot read it: {err.strerror}") from err
    if b"-----BEGIN " not in data:
        raise OSError(f"{option} {path}: expected a PEM file (-----BEGIN ...), got something else")
    return data


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from ``config.tls_cert`` and ``config.tls_key``, or None for plaintext. With
    ``config.tls_client_ca`` a client must present a certificate that CA signed, or the handshake
    fails (mutual TLS): every caller, the health service's included."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    cert = _read_pem(config.tls_cert, "--tls-cert")
    key = _read_pem(config.tls_key, "--tls-key")
    try:
        # Said here, rather than as gRPC's failure to bind with the reason a few log lines up.
        check_key_pair(config.tls_cert, config.tls_key, "--tls-cert", "--tls-key")
    except ValueError as err:
        raise OSError(str(err)) from None
    if config.tls_client_ca is None:
        return grpc.ssl_server_credentials([(key, cert)])
    client_ca = _read_client_ca(config.tls_client_ca)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca, require_client_auth=True)


def _read_client_ca(path: str) -> bytes:
    """The CA certificate(s) in ``path`` (``--tls-client-ca``), checked as OpenSSL will read them."""
    data = _read_pem(path, "--tls-client-ca")
    expected = "expected the PEM certificate(s) of the CA that signs the learners' client certificates"
    if b"-----BEGIN CERTIFICATE-----" not in data:
        got = "a private key" if b"PRIVATE KEY-----" in data else "no certificate"
        raise OSError(f"--tls-client-ca {path}: {expected} (-----BEGIN CERTIFICATE-----), got {got}")
    if (why := unreadable_ca(data)) is not None:
        raise OSError(f"--tls-client-ca {path}: {expected}, got one OpenSSL cannot read ({why})")
    return data


async def serve(
    config: ServerConfig,
    on_ready: Callable[[str], None],
    *,
    watch_exit: bool = False,
    stop: asyncio.Event | None = None,
    exit_margin_s: float = EXIT_MARGIN_S,
) -> int:
    """Listen, build the envs, serve them until SIGTERM/SIGINT/SIGHUP (or the parent process dies), then drain.

    The health service answers NOT_SERVING from the moment the server listens until the envs exist
    (EnvService calls get UNAVAILABLE meanwhile), SERVING while they are served, and NOT_SERVING
    again once shutdown starts. ``on_ready`` receives the address actually listened on (``HOST:PORT``
    with the real port, or ``unix:PATH``) once the server serves its envs. With ``metrics_port``,
    ``/metrics`` is served from the moment the server listens, while the envs are built too, and its
    ``envfleet_ready`` is 1 exactly while health says SERVING (under async vectorization the envs are
    built before anything listens, metrics included: their worker processes are forked first).
    Both ports are checked before anything is built.
    Returns the exit status: 0, or HARD_EXIT_STATUS if the envs' close raised, or if an env call still
    ran on the env thread when the exit margin was up (the envs then left unclosed: see _teardown).

    ``stop``: an event of the running loop that, once set, shuts the server down as SIGTERM does (from
    another thread: ``loop.call_soon_threadsafe(stop.set)``). Run in the main thread, the server takes
    SIGTERM, SIGINT and SIGHUP (unless ignored, as under ``nohup``) over while it serves (and gives them
    back, unless ``watch_exit``; on Windows SIGBREAK too, Ctrl-Break); in another thread it takes no
    signal (Python handles them in the main thread only): ``stop`` is then the way to stop it.

    A watchdog thread (``_Watchdog``) runs meanwhile; ``watch_exit`` (:func:`run`, whose process
    exits next) keeps it running after the return, so that the process exits within ``exit_margin_s``
    (default :data:`EXIT_MARGIN_S`) of the teardown's start even where an env thread that cannot be
    stopped (or a non-daemon thread an env started) would hold its exit up, with the status returned
    (see ``_Watchdog.served``); its signal handlers then stay, so that a signal on the way out changes
    nothing (a second Ctrl-C exits at once, status 1). One server per process.
    """
    if isinstance(exit_margin_s, bool) or not (isinstance(exit_margin_s, int | float) and exit_margin_s >= 0):
        raise ValueError(f"exit_margin_s: expected a number of seconds >= 0, got {exit_margin_s!r}")
    # Handle SIGTERM/SIGINT/SIGHUP from the start, so a signal that comes as soon as we say we are ready
    # still means a clean shutdown. Both the loop's handlers (its wakeup fd wakes the loop whichever
    # thread the signal reaches) and, over the Python-level part of them, handlers that run in this
    # thread between two bytecodes while an env call on the loop hangs too, and tell the watchdog.
    stop = asyncio.Event() if stop is None else stop
    loop = asyncio.get_running_loop()
    watchdog = _Watchdog(config, loop, stop, exit_margin_s)
    watchdog.exits_process = watch_exit
    in_main_thread = threading.current_thread() is threading.main_thread()
    signals = _stopping_signals()
    previous = {sig: signal.getsignal(sig) for sig in signals} if in_main_thread else {}
    on_loop = []
    for sig in signals:
        # (not on Windows' event loops, NotImplementedError; nor outside the main thread, RuntimeError)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, watchdog.request_stop)
            on_loop.append(sig)
        if in_main_thread:
            signal.signal(sig, watchdog.on_signal)  # (the C-level handler still writes the loop's wakeup fd)
    if watch_exit and in_main_thread:
        atexit.register(_deaf_at_exit, signals, watchdog.on_signal)
    if config.vectorization != "async":  # (async vectorization: once its workers exist, see _build_before_listening)
        watchdog.begin()
    try:
        status = await _serve(config, on_ready, stop, watchdog)
    except BaseException as err:
        # (what main() makes of it: see env_server.__main__)
        watchdog.served(START_FAILED_STATUS if isinstance(err, EnvBuildError | OSError) else HARD_EXIT_STATUS)
        raise
    else:
        watchdog.served(status)
        return status
    finally:
        for sig in signals:
            if sig in on_loop and watch_exit and sig in previous:
                _hand_over_from_loop(loop, sig, watchdog.on_signal)
                continue
            if sig in on_loop:
                loop.remove_signal_handler(sig)  # (which puts SIG_DFL back: replaced at once, below)
            if sig in previous:
                # In a process that exits next (run()'s), a signal that comes on its way out (asyncio.run's
                # clean-up, the interpreter's exit) is still the server's: a second SIGTERM changes nothing
                # and a second Ctrl-C exits at once, as during the drain. The handlers from before (SIG_DFL)
                # would have it end by the signal, its exit status lost.
                signal.signal(sig, watchdog.on_signal if watch_exit else previous[sig])
        if not watch_exit:
            watchdog.finished.set()


def _hand_over_from_loop(loop: asyncio.AbstractEventLoop, sig: int, handler: Callable[[int, Any], None]) -> None:
    """Take ``sig`` off ``loop``'s signal handlers, leaving it to ``handler`` with no moment in between at
    SIG_DFL (``loop.remove_signal_handler`` puts that back, and a SIGTERM in the gap, a thread switch long
    under load, ended the process by the signal: seen in CI). The loop's own record of its handlers is
    private: where it is not as expected, its public removal, then ``handler``."""
    handlers = getattr(loop, "_signal_handlers", None)
    if not isinstance(handlers, dict) or sig not in handlers:
        loop.remove_signal_handler(sig)
        signal.signal(sig, handler)
        return
    signal.signal(sig, handler)  # (the C-level handler, which writes the loop's wakeup fd, stays Python's)
    del handlers[sig]
    if not handlers:
        signal.set_wakeup_fd(-1)  # (as the loop's removal of its last handler does)


def _deaf_at_exit(signals: list[signal.Signals], handler: Callable[[int, Any], None]) -> None:
    """At the interpreter's exit after :func:`run` (an exit handler: once the threads it waits for have
    ended, with the other exit handlers), ignore ``signals`` where ``handler`` (the watchdog's) still
    takes them: as its finalization begins, Python puts SIG_DFL back for every signal a Python
    function handled (not for an ignored one) and then takes a while (tens of ms: freeing its modules),
    and a SIGTERM meanwhile ended the process by the signal, its exit status lost."""
    for sig in signals:
        if signal.getsignal(sig) == handler:
            signal.signal(sig, signal.SIG_IGN)


def _stopping_signals() -> list[signal.Signals]:
    """The signals that stop a server run in the main thread: SIGTERM, SIGINT (Ctrl-C), SIGHUP (its
    terminal closed, an ssh session dropped) unless ignored when the server began (under ``nohup``),
    and Windows' SIGBREAK (Ctrl-Break, and the CTRL_BREAK_EVENT that stops a child process there)."""
    signals = [signal.SIGTERM, signal.SIGINT]
    if hasattr(signal, "SIGHUP") and signal.getsignal(signal.SIGHUP) not in (signal.SIG_IGN, None):
        signals.append(signal.SIGHUP)
    if hasattr(signal, "SIGBREAK"):
        signals.append(signal.SIGBREAK)
    return signals


@dataclasses.dataclass
class _Serving:
    """What one :func:`_serve` set up, and so what its one teardown undoes whichever way it ends."""

    config: ServerConfig
    watchdog: _Watchdog
    service: EnvService
    metrics: ServerMetrics | None
    server: grpc.aio.Server
    health: HealthService
    env: Any = None
    step_server: StepSocketServer | None = None
    made_socket: FileIdentity | None = None  # (the Unix socket gRPC made: the teardown removes that one alone)
    orphaned: bool = False  # (the parent died while the envs were built: their build not waited for)


async def _serve(
    config: ServerConfig,
    on_ready: Callable[[str], None],
    stop: asyncio.Event,
    watchdog: _Watchdog,
) -> int:
    """:func:`serve`, its signal handlers and watchdog set up."""
    _check_before_building(config)
    env, build_s = _build_before_listening(config, watchdog)
    metrics = _server_metrics(config, build_s)
    service = watchdog.service = EnvService(config, metrics=metrics)
    server = _grpc_server(config, service, metrics)
    health_service = HealthService()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    await _set_health(health_service, health_pb2.HealthCheckResponse.NOT_SERVING)
    service.on_dead = functools.partial(_report_dead, asyncio.get_running_loop(), health_service, metrics)
    serving = _Serving(config, watchdog, service, metrics, server, health_service, env)
    del env  # (held by ``serving`` alone, which the teardown lets go of before its gc.collect)
    address = _listen_address(config)
    try:
        credentials = server_credentials(config)
        port = await _listen(serving, credentials)
        if serving.env is None:
            serving.env = await _build_while_listening(serving, stop, address, port)
            if serving.env is None:  # (the parent is gone: nobody to serve them to; the teardown exits)
                serving.orphaned = True
                return HARD_EXIT_STATUS
        _attach_envs(serving)
        if stop.is_set():  # stopped while building: it never served, nor said it would
            log.info("stopped while building its envs")
        else:
            await _serve_until_stopped(serving, on_ready, stop, address, port, credentials)
    finally:
        # (one teardown for every way out: a failed start, a stop while building, a served shutdown)
        running, closed = await _teardown(serving)
    if running is not None:
        log.error(
            "stopped after %d steps; %s still runs on the env thread: the envs were not closed", service.steps, running
        )
        return HARD_EXIT_STATUS
    log.info("stopped after %d steps%s", service.steps, "" if closed else " (the envs' close raised: see above)")
    return 0 if closed else HARD_EXIT_STATUS


def _check_before_building(config: ServerConfig) -> None:
    """Say what is wrong with the env or the ports before anything is built: a build may take minutes."""
    # A bad env id or wrapper is the first thing to say, before a port in use (cheap: nothing is built).
    check_env(config)
    if config.spin_wait_ms > 0 and not (config.unix_socket and config.step_socket):
        log.warning("--spin-wait-ms applies to the step socket only (--unix-socket, step socket on): ignored")
    # A port in use (gRPC's or the metrics') next, before the envs are built: a build may take minutes.
    _check_bindable(config)
    # envfleet's version and commit, which the spec and the metrics say (importlib.metadata and git: ~0.1 s, up to
    # 10 s where git hangs), found once, now that the loop serves nothing yet: not as the envs are attached, when
    # the loop answers health checks and learners (the first time and after each --fresh-envs rebuild).
    runtime_versions()


def _build_before_listening(config: ServerConfig, watchdog: _Watchdog) -> tuple[Any, float]:
    """Under async vectorization, the envs and their build's seconds, built before anything else starts (their
    workers are forked); otherwise (None, 0.0): they are built once the server listens."""
    if config.vectorization != "async":
        return None, 0.0
    # AsyncVectorEnv forks its workers: do it before gRPC starts its threads and sockets, which a
    # forked child must not inherit (the metrics endpoint's too: its thread and listening socket).
    # Until then nothing listens (connections are refused). Before the watchdog's thread too (a
    # child may inherit a lock another thread held, for good; Python 3.12 warns of a fork from a
    # process of several threads): it starts once they exist, or at a SIGTERM/SIGINT meanwhile (see
    # _Watchdog.request_stop), which a build that hangs then cannot hold up past the grace period.
    # (the parent process, --parent-pid, is looked for meanwhile all the same: see _parent_watched)
    started = time.perf_counter()
    # (each result is encoded before the next call)
    env = build_vector_env(
        config,
        copy=False,
        workers_starting=functools.partial(_parent_watched, config),
        first_building=functools.partial(_parent_watched_by_thread, config),
    )
    build_s = time.perf_counter() - started
    watchdog.begin()
    return env, build_s


def _server_metrics(config: ServerConfig, build_s: float) -> ServerMetrics | None:
    """The server's Prometheus metrics with ``--metrics-port``, else None."""
    if config.metrics_port is None:
        return None
    metrics = ServerMetrics(
        env_id=config.env,
        num_envs=config.num_envs,
        vectorization=config.vectorization,
        needs_token=config.auth_token is not None,
    )
    metrics.env_build_seconds.set(build_s)
    return metrics


def _grpc_server(config: ServerConfig, service: EnvService, metrics: ServerMetrics | None) -> grpc.aio.Server:
    """The gRPC server of ``service``, not yet listening, behind the interceptors that bound and guard its calls."""
    # The count of calls in progress first (it sees every call); then the token check: a caller
    # without it learns nothing, not even whether its bytes parse.
    on_full = None if metrics is None else functools.partial(metrics.count_error, code="RESOURCE_EXHAUSTED")
    interceptors: list[grpc.aio.ServerInterceptor] = [CallLimitInterceptor(config.max_concurrent_rpcs, on_full)]
    if config.auth_token is not None:
        on_refusal = None if metrics is None else functools.partial(metrics.count_error, code="UNAUTHENTICATED")
        interceptors.append(TokenAuthInterceptor(config.auth_token, on_refusal))
    on_malformed = None if metrics is None else functools.partial(metrics.count_error, code="INVALID_ARGUMENT")
    interceptors.append(RequestGuardInterceptor(on_malformed))
    interceptors.append(AnswerHandshakes(service))  # (the last: the others see the handler it gives)
    server = grpc.aio.server(
        options=server_options(config.max_request_bytes, config.http2_bdp_probe, config.compression),
        interceptors=interceptors,
        # Past it, gRPC refuses a call (RESOURCE_EXHAUSTED) before reading its request: what the calls in
        # progress hold, caller with a token or not, is bounded (see DEFAULT_MAX_CONCURRENT_RPCS).
        maximum_concurrent_rpcs=config.max_concurrent_rpcs,
    )
    pb_grpc.add_EnvServiceServicer_to_server(service, server)
    return server


async def _listen(serving: _Serving, credentials: grpc.ServerCredentials | None) -> int:
    """Start listening (gRPC, the step socket, the metrics endpoint), the files made recorded for the teardown;
    the port gRPC listens on."""
    config, watchdog = serving.config, serving.watchdog
    if serving.env is not None:
        # Checked again, the envs built (under async vectorization, before anything listens: that may
        # take minutes): another server may have started at the Unix socket's path meanwhile, whose
        # socket gRPC would replace, taking its learners over (and the same goes for the ports).
        _check_bindable(config)
    port = _add_port(serving.server, config, credentials)
    await serving.server.start()
    if config.unix_socket:
        serving.made_socket = file_identity(config.unix_socket)
        watchdog.own_files = ((config.unix_socket, serving.made_socket),)
    serving.step_server = step_server = await _serve_step_socket(config, serving.service)
    if step_server is not None:
        watchdog.own_files += ((step_server.path, step_server.made),)
    if serving.metrics is not None:
        # Served from here on, the build included (envfleet_ready 0 meanwhile): a long build is
        # not a scrape target that is down.
        serving.metrics.set_transport(_transport(config, step_server))
        _serve_metrics(serving.metrics, config)
    return port


async def _build_while_listening(serving: _Serving, stop: asyncio.Event, address: str, port: int) -> Any:
    """The envs, built while the server listens and says NOT_SERVING; None if the parent process died first."""
    config, metrics = serving.config, serving.metrics
    log.info(
        "building %d x %s (health: NOT_SERVING until done), listening on %s",
        config.num_envs,
        config.env,
        address if config.unix_socket else f"port {port}",
    )
    # Built on the env thread, so the loop answers health checks (NOT_SERVING) meanwhile.
    started = time.perf_counter()
    env = await _build_unless_orphaned(serving.service, config, serving.watchdog, stop)
    if env is not None and metrics is not None:
        metrics.env_build_seconds.set(time.perf_counter() - started)
    return env


def _attach_envs(serving: _Serving) -> None:
    """Hand the built envs to the service, checked to be servable within the answer size."""
    # (``serving.env`` is read where it is used, never held here: an error raised here keeps this frame in its
    # traceback, past the teardown's gc.collect, which must find the envs let go of, see _serve)
    config, service = serving.config, serving.service
    # (on the env thread, as every call on the envs: see EnvThread)
    service.call_in_env_thread(_tell_positions, serving.env)
    try:
        service.attach(serving.env)
    except UnsupportedSpaceError as err:
        raise EnvBuildError(f"cannot serve env {config.env!r}: {err}") from err
    assert service.spec is not None  # (attach made it)
    _check_answer_size(config, serving.env.single_observation_space, service.spec)
    if service.full_spec_bytes > SPEC_ROOM:
        log.warning(
            "its spec takes %s bytes with its Box bounds at full shape, over what an answer leaves it: learners "
            "older than compact bounds (before 2026-12-07) are refused, saying so; newer ones get it in %s bytes",
            f"{service.full_spec_bytes:,}",
            f"{service.spec.ByteSize():,}",
        )
    if config.fresh_envs:  # (a new learner's Handshake builds them anew: see EnvService._fresh_envs)
        service.build_envs = functools.partial(_build_anew, config)


async def _serve_until_stopped(
    serving: _Serving,
    on_ready: Callable[[str], None],
    stop: asyncio.Event,
    address: str,
    port: int,
    credentials: grpc.ServerCredentials | None,
) -> None:
    """Say SERVING and serve the envs until ``stop`` is set, then drain the calls in flight."""
    config, service, metrics, step_server = serving.config, serving.service, serving.metrics, serving.step_server
    # The envs exist: report healthy.
    await _set_health(serving.health, health_pb2.HealthCheckResponse.SERVING)
    if metrics is not None:
        metrics.ready.set(1)
    ready = address if config.unix_socket else host_port(config.host, port)
    security = ", ".join(part for part in (_tls_mode(config, credentials), _token_mode(config)) if part)
    log.info(
        "serving %d x %s (%s) on %s%s%s",
        config.num_envs,
        config.env,
        _describe_envs(config),
        ready,
        f" ({security})" if security else " (plaintext, no auth token)",
        _compression_note(config, step_server),
    )
    _warn_if_open(config, tls=credentials is not None)
    on_ready(ready)

    expiry = asyncio.create_task(service.expire_claims())
    await stop.wait()
    expiry.cancel()
    serving.watchdog.stop_asked_at = serving.watchdog.stop_asked_at or time.monotonic()  # (a caller's ``stop``)

    # Drain: NOT_SERVING (load balancers and probes stop sending), no new sessions or steps, the
    # session and idle step streams end at once; steps in flight finish within the grace period.
    log.info("shutting down: finishing calls in flight (up to %.1f s)", config.grace_s)
    if metrics is not None:
        metrics.ready.set(0)
    await serving.health.enter_graceful_shutdown()
    service.drain()
    if step_server is not None:
        step_server.drain()
        await asyncio.gather(serving.server.stop(config.grace_s), step_server.finish(config.grace_s))
    else:
        await serving.server.stop(config.grace_s)


async def _teardown(serving: _Serving) -> tuple[str | None, bool]:
    """Stop serving and close the envs unless a call still runs on them: what still runs (None if nothing), and
    whether the envs' close went well. Where the process exits next and cannot wait, it exits here."""
    config, watchdog, service = serving.config, serving.watchdog, serving.service
    watchdog.teardown_at = time.monotonic()
    await serving.server.stop(None)
    await _let_calls_end()
    if serving.step_server is not None:
        serving.step_server.close()
    # An env call may still run on the env thread (a step past the grace period: gRPC has ended its
    # call, the env goes on, see EnvService._run_env). The envs are closed once it is done, never
    # under it (a simulator closed mid-step may crash, or hang): waited for as long as the exit
    # margin leaves (less a look of the watchdog's, so that this says why, not the watchdog).
    busy = serving.env is not None and not await service.idle(watchdog.exit_deadline() - _WATCH_S - time.monotonic())
    if not busy and service.spec is not None:
        # (the envs served last: --fresh-envs builds them anew; none where that failed, the old ones closed)
        serving.env = service.served_env
    if serving.metrics is not None:
        serving.metrics.close()
    closed = True
    running = None
    if busy:
        running = _running_call(service)
    elif serving.env is not None:
        closed = _close_envs(service, serving.env)
        # Closed, the envs are let go of now, not at the interpreter's shutdown (the watchdog
        # thread, which holds the service, runs until then): a simulator whose bindings are still
        # alive then reports them as leaked, ale-py's nanobind in ~20 lines on stderr.
        serving.env = None
        gc.collect()
    service.close()
    if config.unix_socket:
        remove_own_file(config.unix_socket, serving.made_socket)
    if serving.orphaned and watchdog.exits_process:
        # (the env thread, building, cannot be stopped, and the interpreter's exit would wait for it)
        _exit_orphaned(config)
    if running is not None and watchdog.exits_process:
        # (the env thread cannot be stopped, and the interpreter's exit would wait for it)
        _exit_now(
            config,
            HARD_EXIT_STATUS,
            "%s still runs on the env thread: the envs were not closed (closed under it, an env may crash "
            "or hang); exiting without waiting for it (status %d)",
            running,
            HARD_EXIT_STATUS,
        )
    return running, closed


def _running_call(service: EnvService) -> str:
    """The env call that still runs on the env thread, as the logs name it."""
    started = service.call_started
    return f"the envs' {service.call_kind or 'call'}" + (
        f" (running for {time.monotonic() - started:.1f} s)" if started else ""
    )


def _close_envs(service: EnvService, env: Any) -> bool:
    """Close ``env`` on the env thread and detach it from ``service``: whether its close went well (a raise is
    logged, so that the rest of the teardown still runs)."""
    closed = True
    try:
        service.call_in_env_thread(env.close)  # (on the env thread, as every call on the envs)
    except BaseException:  # (the env's own close, raised on its thread: the rest of the teardown still runs)
        log.exception("the envs' close raised")
        closed = False
    service.detach()
    return closed


async def _build_unless_orphaned(
    service: EnvService, config: ServerConfig, watchdog: _Watchdog, stop: asyncio.Event
) -> Any:
    """The envs, built on the env thread; None if the parent process (``--parent-pid``) dies first: a
    server of a learner that was killed serves nobody, and does not wait out a long build (a stop asked
    otherwise, SIGTERM, waits for the build, as the envs are then closed: it says so, and drains)."""
    build = asyncio.ensure_future(service.run_in_env_thread(functools.partial(build_vector_env, config, copy=False)))
    orphaned = asyncio.ensure_future(watchdog.orphaned.wait())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({build, orphaned, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if stopped in done and not build.done() and not orphaned.done():
            log.info(
                "shutting down while its envs are being built: waiting for the build to end (up to %.1f s), "
                "then closing them",
                config.grace_s + watchdog.exit_margin_s,
            )
            service.drain()  # (calls meanwhile: "shutting down", not "starting")
            await asyncio.wait({build, orphaned}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        orphaned.cancel()
        stopped.cancel()
    if not build.done():
        build.add_done_callback(_forget)  # (whatever it ends with: nobody waits for it)
        return None
    return build.result()


@contextlib.contextmanager
def _parent_watched(config: ServerConfig) -> Iterator[None]:
    """While async vectorization's workers start and build their envs (this thread waiting on their pipes),
    before the watchdog's thread may start (see _build_before_listening), look for the parent process (``--parent-pid``)
    every _WATCH_S all the same, with a timer's SIGALRM (no thread): once it is gone, exit (status 1), as
    a server whose parent dies during a sync build does, killing the workers forked so far and the rest of
    the process group, rather than build on for nobody (for good, where a worker's build hangs). The
    handler runs between two bytecodes of this thread, a blocking call (a pipe's read) interrupted and
    retried. Not while the env built in this process first is made: its constructor's own system calls
    (a simulator's client, which may not retry on EINTR) and its own use of SIGALRM are left alone (see
    :func:`_parent_watched_by_thread`). Only where the timer and SIGALRM are free (Unix,
    the main thread, no handler or timer of someone else's)."""
    parent = config.parent_pid
    if not (
        parent
        and hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGALRM) is signal.SIG_DFL
        and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    ):
        yield
        return
    server_pid = os.getpid()

    def look(signum: int, frame: object) -> None:
        if os.getpid() != server_pid:  # (a worker, which inherits the handler, not the timer: not ours)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGALRM)
            return
        _exit_if_orphaned(config)

    signal.signal(signal.SIGALRM, look)
    signal.setitimer(signal.ITIMER_REAL, _WATCH_S, _WATCH_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)


@contextlib.contextmanager
def _parent_watched_by_thread(config: ServerConfig) -> Iterator[None]:
    """While async vectorization's first env is built in this process (before its workers fork, and before
    the watchdog's thread starts), look for the parent process (``--parent-pid``) every _WATCH_S from a thread
    of its own: once it is gone, exit (status 1), as :func:`_parent_watched` does, rather than wait for a
    constructor that may hang for good. A thread, not SIGALRM: the constructor's system calls are left
    uninterrupted. It ends (joined) before the context does, so that no thread runs when the workers fork."""
    parent = config.parent_pid
    if not parent:
        yield
        return
    done = threading.Event()

    def watch() -> None:
        while not done.wait(_WATCH_S):
            _exit_if_orphaned(config)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _exit_if_orphaned(config: ServerConfig) -> None:
    """During a build, before the watchdog runs: exit at once (status 1) if the parent process (``--parent-pid``) is gone."""
    if os.getppid() != config.parent_pid:
        _exit_orphaned(config)


def _exit_orphaned(config: ServerConfig) -> None:
    """Exit at once (status 1): the parent process (``--parent-pid``) is gone while the envs are built."""
    _exit_now(
        config,
        HARD_EXIT_STATUS,
        "parent process %d is gone: exiting without waiting for the envs' build (status %d)",
        config.parent_pid,
        HARD_EXIT_STATUS,
    )


def _forget(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # (retrieved: not logged as "never retrieved")


# Longest the teardown waits for gRPC's tasks of calls that have ended to finish (see _let_calls_end).
_CALLS_END_S = 1.0
# The coroutines of gRPC's aio server that run a call (its own names: gRPC's internals, which have kept
# them since grpc.aio began; were they renamed, the wait would find nothing to wait for, no more).
_GRPC_CALL_COROUTINES = frozenset({"_schedule_rpc_coro", "_handle_exceptions"})


async def _let_calls_end() -> None:
    """Let the tasks of calls the stopped gRPC server has ended finish before :func:`serve` returns.

    Once the server has stopped, the task of a call whose end it has just been told of (a Hold stream
    or a Release the learner sent while the server stopped) may still be waiting for its turn on the
    loop; ``asyncio.run`` would cancel it on the way out, and gRPC logs a cancelled call task as
    "Exception not handled by _handle_exceptions" with a traceback on stderr (which a learner
    forwards as warnings). That is a few turns of the loop; a task still running after
    :data:`_CALLS_END_S` is left as it is. Only gRPC's call tasks are waited for: a caller's own
    tasks on the same loop are none of the server's business."""
    left = [
        task
        for task in asyncio.all_tasks()
        if not task.done() and getattr(task.get_coro(), "__name__", None) in _GRPC_CALL_COROUTINES
    ]
    if left:
        await asyncio.wait(left, timeout=_CALLS_END_S)


def _check_answer_size(config: ServerConfig, space: gym.Space[Any], spec: pb.EnvSpec) -> None:
    """Refuse at start envs whose answers would not fit in the largest message (every call would
    fail, with gRPC's own error): the spec, in every GetSpec's and Handshake's answer; the
    observations, saying how many envs would fit (under same-step autoreset, an answer can carry
    each env's final observation too)."""
    _check_spec_size(config, spec)
    per_env = space_bytes(space) * (2 if config.autoreset_mode == "SameStep" else 1)
    room = MAX_MESSAGE_BYTES - ANSWER_HEADROOM
    if per_env * config.num_envs <= room:
        return
    fits = room // per_env
    raise EnvBuildError(
        f"cannot serve {config.num_envs} x {config.env!r}: each env's observation"
        + (" and final observation (same-step autoreset) take" if config.autoreset_mode == "SameStep" else " takes")
        + f" {per_env:,} bytes, so an answer would take {per_env * config.num_envs:,}, over the {room:,} bytes a "
        f"message leaves them (64 MiB less 1 MiB for the rest); "
        + (f"serve at most {fits} envs per server (--num-envs), and more servers" if fits else "it cannot be sent")
    )


def _check_spec_size(config: ServerConfig, spec: pb.EnvSpec) -> None:
    """Refuse a spec too large for the answers that carry it (GetSpec's, Handshake's), as learners that read
    compact bounds get it (``spec``): a Box space whose low or high bounds differ between elements sends them
    at full shape, in its dtype (a MultiDiscrete space's nvec and start alike), bounds of one value as that
    value. (A spec that fits so but not with full-shape bounds, as older learners get it, is served: those
    are refused, see EnvService._spec_for.)"""
    size = spec.ByteSize()
    if size <= SPEC_ROOM:
        return
    raise EnvBuildError(
        f"cannot serve {config.env!r}: its spec (the answer to GetSpec and Handshake) takes {size:,} bytes, over "
        f"the {SPEC_ROOM:,} bytes a message leaves it (64 MiB less 4 KiB for the rest of the answer): a Box space "
        "whose low or high bounds differ between elements sends them at full shape (bounds of one value go as "
        f"that value); the observation space's take {spec.observation_space.ByteSize():,} bytes, the action "
        f"space's {spec.action_space.ByteSize():,}; it cannot be sent: serve an env with smaller spaces"
    )


def _serve_metrics(metrics: ServerMetrics, config: ServerConfig) -> None:
    """Serve ``/metrics`` on ``--metrics-port`` (at ``--host``, 127.0.0.1 or ::1 for a Unix-socket server:
    see :func:`_metrics_hosts`) and log where; OSError saying why it cannot."""
    assert config.metrics_port is not None
    hosts = _metrics_hosts(config)
    for i, host in enumerate(hosts):
        try:
            port = metrics.serve_http(host, config.metrics_port)
        except OSError as err:
            if i + 1 < len(hosts) and err.errno in NO_SUCH_ADDRESS:
                continue
            raise _cannot_serve_metrics(config, host, err) from err
        shown = _metrics_shown(config, metrics.http_host())
        log.info("Prometheus metrics on http://%s/metrics", host_port(shown, port))
        return


def _transport(config: ServerConfig, step_server: StepSocketServer | None) -> str:
    """How learners reach the server, for the metrics' server info: tcp, unix or unix+step-socket."""
    if not config.unix_socket:
        return "tcp"
    return "unix+step-socket" if step_server is not None else "unix"


def _describe_envs(config: ServerConfig) -> str:
    """What the server's envs are made of, beyond id and count: how they are stepped, and whatever
    the operator set (kwargs, wrappers, autoreset mode, step delay)."""
    parts = [config.vectorization]
    if config.env_kwargs:
        parts.append(f"kwargs {json.dumps(config.env_kwargs, default=repr)}")
    if config.wrappers:
        parts.append(f"wrappers {','.join(config.wrappers)}")
    if config.autoreset_mode != "NextStep":
        parts.append(f"autoreset {config.autoreset_mode}")
    if config.max_episode_steps is not None:
        parts.append(f"time limit {config.max_episode_steps} steps")
    if config.step_delay_ms:
        parts.append(f"step delay {config.step_delay_ms:g} ms")
    return "; ".join(parts)


def _compression_note(config: ServerConfig, step_server: StepSocketServer | None) -> str:
    """How the server's start line ends about ``--compression``: nothing for none."""
    if config.compression == "none":
        return ""
    note = f", gRPC answers compressed with {config.compression}"
    return note + " (the step socket's are not)" if step_server is not None else note


def _tls_mode(config: ServerConfig, credentials: grpc.ServerCredentials | None) -> str:
    """How the server's start line names its TLS: "" (none), "TLS", or TLS requiring client certificates."""
    if credentials is None:
        return ""
    return "TLS, client certificates required" if config.tls_client_ca is not None else "TLS"


def _token_mode(config: ServerConfig) -> str:
    return "auth token" if config.auth_token is not None else ""


def _warn_if_open(config: ServerConfig, *, tls: bool) -> None:
    """Warn of a server that anyone who reaches it can use: off loopback, with neither a token nor
    client certificates required. TLS alone does not close it: it encrypts the calls and proves the
    server to learners, and anyone may still call; with ``--tls-client-ca`` only a caller holding a
    certificate that CA signed gets past the handshake."""
    if config.auth_token is not None or config.unix_socket or _is_loopback(config.host):
        return
    if tls and config.tls_client_ca is not None:
        return
    if tls:
        log.warning(
            "listening on %s with TLS but no auth token: anyone who reaches it can claim and step its envs "
            "(TLS encrypts the calls, it does not say who may make them; see --auth-token, or --tls-client-ca "
            "to require client certificates)%s",
            config.host,
            _both_families(config.host),
        )
    else:
        log.warning(
            "listening on %s with neither TLS nor an auth token: anyone who reaches it can claim and "
            "step its envs (see --auth-token and --tls-cert)%s",
            config.host,
            _both_families(config.host),
        )


def _both_families(host: str) -> str:
    """What :func:`_warn_if_open` adds for a wildcard ``host``: gRPC takes IPv6 on 0.0.0.0 too (and IPv4 on ::)."""
    if host not in ("0.0.0.0", "::"):
        return ""
    return "; on every address of this machine, IPv4 and IPv6 alike (gRPC listens on both for 0.0.0.0 and ::)"


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    # (::ffff:127.0.0.1, IPv4's loopback as an IPv6 socket sees it: ipaddress calls it no loopback)
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


async def _serve_step_socket(config: ServerConfig, service: EnvService) -> StepSocketServer | None:
    """Listen on the step socket (``--unix-socket`` PATH + ".steps") unless it is off; None when there is none."""
    if not config.unix_socket or not config.step_socket:
        return None
    path = os.path.abspath(config.unix_socket) + STEP_SOCKET_SUFFIX
    if len(os.fsencode(path)) > MAX_UNIX_PATH:
        log.warning("no step socket: its path %s is longer than Unix sockets allow; steps go over gRPC", path)
        return None
    step_server = StepSocketServer(
        service, path, spin_wait_s=config.spin_wait_ms / 1000.0, max_request_bytes=config.max_request_bytes
    )
    try:
        await step_server.start(mode_of=config.unix_socket)
    except OSError as err:
        log.warning("no step socket on %s (%s); steps go over gRPC", path, err)
        step_server.close()
        return None
    service.step_socket = path
    log.debug("step socket on %s", path)
    if config.spin_wait_ms > 0:
        # (debug: learners that start local servers pass it to each, and it changes nothing an operator sees)
        log.debug(
            "step socket: waiting for a learner's next step awake, up to %g ms after each answer", config.spin_wait_ms
        )
    return step_server


# The exit status then (the envs were not closed: not a clean shutdown); also when the envs' close raised.
HARD_EXIT_STATUS = 1
# The exit status of a server that could not start (a bad configuration, its envs' build failed, its
# address taken): env-server's (see env_server.__main__), as argparse's for a bad option.
START_FAILED_STATUS = 2
# The exit status of a server whose env call ran past --hang-timeout.
HUNG_EXIT_STATUS = 3
# How often the watchdog looks.
_WATCH_S = 0.25
# A watchdog's wake-up this much later than it asked for, the process having used little CPU meanwhile (under
# _HELD_UP_CPU of the time), is the whole process held up (SIGSTOP, `docker pause`, a VM paused or migrated, a
# debugger, a host that gave it no CPU), not its env call: that time does not count as the call's
# (--hang-timeout, the slow-call warning). (An env's native code that holds the GIL delays the watchdog too,
# but uses the CPU meanwhile: its time counts.)
_HELD_UP_S = 1.0
_HELD_UP_CPU = 0.25
SLOW_CALL_S = 10.0
"""An env call that has run this long (and :data:`_SLOW_CALL_FACTOR` times its kind's usual time) is warned of,
once, saying where it is stuck: learner train's default ``--timeout``, past which such a learner has given up on
the call (DEADLINE_EXCEEDED) and takes the server for lost, while the server, without ``--hang-timeout``, said
nothing of it."""
# Nor before this many times as long as its kind's calls take lately: an env whose every step takes 12 s (its
# learner given a longer --timeout) is not warned of at each step.
_SLOW_CALL_FACTOR = 10.0
# The innermost frames of a stuck env call's stack that the watchdog's lines show.
_STUCK_FRAMES = 4


class _Watchdog(threading.Thread):
    """What must happen even while an env call holds the event loop up (a quick env's steps run on the loop,
    or with it waiting for the env thread, see env_server.service.INLINE_LIMIT_S, and one of them may hang): noticing that the
    parent process is gone; exiting when a shutdown asked for (SIGTERM, SIGINT, SIGHUP, the parent gone) has
    not begun its teardown within the grace period and ``exit_margin_s``, or the teardown has not ended
    within ``exit_margin_s`` (an env call on the env thread or the envs' close still running: that thread
    cannot be stopped, and waiting for it would keep the process up as long as it runs), or the process
    has not exited by then once serve() returned (a non-daemon thread an env left running: then with
    serve()'s status); and ``--hang-timeout``. Its exits at once remove the socket files the server made.
    A thread, so that it runs while the loop cannot: a hang in Python code or in
    a blocking call lets it run; one in C code that holds the GIL stops every thread, and only
    SIGKILL ends it."""

    def __init__(
        self,
        config: ServerConfig,
        loop: asyncio.AbstractEventLoop,
        stop: asyncio.Event,
        exit_margin_s: float = EXIT_MARGIN_S,
    ) -> None:
        super().__init__(name="env-server-watchdog", daemon=True)
        self.config = config
        self.exit_margin_s = exit_margin_s
        self.loop = loop
        self.stop = stop
        self.service: EnvService | None = None
        self.stop_asked_at = 0.0  # (time.monotonic(); 0: not yet)
        self.signal_at = 0.0  # (of the first signal that asked for it; 0: none did, as when the parent is gone)
        self.teardown_at = 0.0
        self.exits_process = False
        """Whether the process exits once serve() returns (run()'s): the teardown then exits it at once
        when an env call still runs (see _teardown), rather than leave it to wait for the env thread."""
        self.finished = threading.Event()
        """Set when there is nothing more to watch (serve() returned in a process that goes on)."""
        self.parent_gone = False
        self.orphaned = asyncio.Event()
        """Set (on the loop) once the parent process (``--parent-pid``) is gone."""
        self.own_files: tuple[tuple[str, FileIdentity | None], ...] = ()
        """The socket files this server made (the Unix socket, the step socket) and their identities: an
        exit at once removes them (those alone, not another server's made at the path since)."""
        self.exit_status: int | None = None
        """What serve() returned (or the exit status its exception makes); None while it runs."""
        self._begun = False
        self._held_up: list[tuple[float, float]] = []
        """When (time.monotonic(): from, to) this process was held up (see _HELD_UP_S) during the env call under
        way (none kept while no call runs)."""

    def begin(self) -> None:
        """Start the thread, unless it has been started already (here, or by a signal handler that ran
        meanwhile: a second start of a thread raises RuntimeError)."""
        if self._begun:
            return
        self._begun = True
        with contextlib.suppress(RuntimeError):
            self.start()

    def on_signal(self, signum: int, frame: object) -> None:
        # A second Ctrl-C (not a double tap of the first) during the drain: exit now, as servers
        # commonly do; the calls in flight are abandoned (their learners see the connection drop). A
        # second SIGTERM changes nothing: the drain has its deadline (the grace period, then the
        # watchdog's exit).
        # SIGHUP is taken as SIGTERM is (its terminal closed, say: see detach_from_terminal).
        first = self.signal_at
        if first and signum == signal.SIGINT and time.monotonic() - first >= DOUBLE_TAP_S:
            self.exit_now(1, "second Ctrl-C: exiting now, without waiting for the calls in flight")
        if signum == getattr(signal, "SIGHUP", None):
            detach_from_terminal()  # (its log lines from here on, the drain's, go nowhere)
        if self.stop_asked_at:
            log.info("%s: already shutting down", signal.Signals(signum).name)
        self.signal_at = self.signal_at or time.monotonic()
        self.request_stop()

    def served(self, status: int) -> None:
        """serve() is done, and the process is to exit with ``status``: should anything hold its exit up
        past the deadline (a non-daemon thread an env started and did not stop), :meth:`run` exits with
        ``status``, saying what held it up, not as a teardown that did not end."""
        self.exit_status = status
        self.teardown_at = self.teardown_at or time.monotonic()  # (a start that failed before its teardown)
        if self.exits_process:
            self.begin()  # (a start under async vectorization may fail before the watchdog's)

    def exit_now(self, status: int, message: str, *args: object) -> None:
        """:func:`_exit_now`, removing the socket files this server made."""
        _exit_now(self.config, status, message, *args, own_files=self.own_files)

    def request_stop(self) -> None:
        """Shut down: the loop drains as soon as it can; if it cannot in time, :meth:`run` exits (started
        now if it was not yet: asked while async vectorization's workers are made, see _build_before_listening)."""
        if not self.stop_asked_at:
            self.stop_asked_at = time.monotonic()
        with contextlib.suppress(RuntimeError):  # (the loop is closed: the server is on its way out)
            self.loop.call_soon_threadsafe(self.stop.set)
        self.begin()

    def exit_deadline(self) -> float:
        """When (time.monotonic()) :meth:`run` exits the process regardless, once the teardown has begun:
        the grace period and the exit margin after a shutdown was asked for; else (a failed start) the
        exit margin after the teardown began."""
        if self.stop_asked_at:
            return self.stop_asked_at + self.config.grace_s + self.exit_margin_s
        return self.teardown_at + self.exit_margin_s

    def run(self) -> None:
        parent, hang_s = self.config.parent_pid, self.config.hang_timeout_s
        warned = 0.0  # (the call_started of the env call last warned of as slow: one warning per call)
        last, last_cpu = time.monotonic(), time.process_time()
        while not self.finished.wait(_WATCH_S):
            now = time.monotonic()
            overslept = now - last - _WATCH_S
            if overslept >= _HELD_UP_S and time.process_time() - last_cpu < _HELD_UP_CPU * overslept:
                self._held_up.append((last + _WATCH_S, now))
                log.info(
                    "this server was held up for %.1f s (SIGSTOP, docker pause, a paused VM, a debugger, or no CPU "
                    "for it): not counted as an env call's time",
                    overslept,
                )
            if parent and not self.parent_gone and os.getppid() != parent:
                self.parent_gone = True
                if not self.stop_asked_at:
                    log.warning("parent process %d is gone; shutting down", parent)
                with contextlib.suppress(RuntimeError):  # (the loop is closed: the server is on its way out)
                    self.loop.call_soon_threadsafe(self.orphaned.set)
                self.request_stop()
            service = self.service
            started = service.call_started if service is not None else 0.0
            self._held_up = [held for held in self._held_up if started and held[1] > started]  # (this call's)
            ran = self._ran(started, now) if started else 0.0
            if hang_s and started and ran > hang_s:
                assert service is not None
                self.exit_now(
                    HUNG_EXIT_STATUS,
                    "the envs' %s has run for %.1f s, longer than --hang-timeout %g s: exiting (status %d) so that "
                    "whatever runs this server can start it again (a hung env call can be neither stopped nor "
                    "waited out)%s",
                    service.call_kind,
                    ran,
                    hang_s,
                    HUNG_EXIT_STATUS,
                    self._stuck(service),
                )
            if started and started != warned and service is not None and ran > _slow_after(service):
                warned = started
                self._warn_slow(service, started, ran)
            # A shutdown asked for ends within the grace period and the exit margin, however late its
            # teardown began (a loop held up until then); one not asked for (a failed start), within
            # the exit margin of its teardown's start.
            margin = self.exit_margin_s
            late = bool(self.stop_asked_at) and now - self.stop_asked_at > self.config.grace_s + margin
            if self.teardown_at and (late or (not self.stop_asked_at and now - self.teardown_at > margin)):
                if self.exit_status is not None:
                    self._exit_held_up(self.exit_status)
                self.exit_now(
                    HARD_EXIT_STATUS,
                    "the teardown did not end within %.0f s (an env call or the envs' close still running): "
                    "exiting without waiting for it (status %d)",
                    now - self.teardown_at,
                    HARD_EXIT_STATUS,
                )
            if late and not self.teardown_at:
                self.exit_now(
                    HARD_EXIT_STATUS,
                    "asked to shut down %.0f s ago, and %s still holds the server up: exiting without "
                    "waiting for it (status %d)%s",
                    now - self.stop_asked_at,
                    f"an env call ({service.call_kind}, running for {ran:.1f} s)"
                    if service is not None and started
                    else "an env call or the envs' build",
                    HARD_EXIT_STATUS,
                    self._stuck(service) if service is not None and started else "",
                )
            # (from here: the time this turn took, a warning's frames or a log line, is no hold-up)
            last, last_cpu = time.monotonic(), time.process_time()

    def _ran(self, started: float, now: float) -> float:
        """How long the env call that began at ``started`` has run by ``now``, less the times this process was
        held up meanwhile."""
        return now - started - sum(max(0.0, to - max(since, started)) for since, to in self._held_up)

    def _warn_slow(self, service: EnvService, started: float, ran: float) -> None:
        """Warn that the env call that began at ``started`` has run for long (``ran`` s: see SLOW_CALL_S), saying
        where it is stuck; the service logs its end (see EnvService.slow_call)."""
        service.slow_call = started
        kind, stuck = service.call_kind, self._stuck(service)
        if service.call_started != started:  # (it returned meanwhile: its end line, if any, says how long it took)
            return
        hang_s = self.config.hang_timeout_s
        log.warning(
            "the envs' %s has run for %.1f s and not returned%s; meanwhile the envs serve no other call (a learner "
            "gives up on a call after its --timeout: learner train's default is 10 s) and %s",
            kind,
            ran,
            stuck,
            f"--hang-timeout {hang_s:g} s exits the server at {hang_s:g} s"
            if hang_s
            else "the server waits for it (with --hang-timeout S, it would exit after S s, for whatever runs it "
            "to start it again)",
        )

    def _stuck(self, service: EnvService) -> str:
        """Where the service's env call is stuck, for the end of a log line ("; it is stuck in env 1 of 2, at
        ..."): "" where its thread runs no Python code any more, or where it cannot be told (the watchdog's
        own work must go on: it exits a hung server)."""
        try:
            where = _stuck_at(service.call_thread)
        except Exception:  # (another thread's frames, read as they change; a working directory removed, ...)
            log.debug("cannot tell where the env call is stuck", exc_info=True)
            return ""
        if not where:
            return ""
        if self.config.vectorization == "async":
            # (the thread waits for the worker processes, where the envs run)
            return f"; the envs run in worker processes (--vectorization async), which the server waits for {where}"
        return f"; it is stuck {where}"

    def _exit_held_up(self, status: int) -> None:
        """Exit with ``status``, serve()'s: its teardown is over, and something else holds the process's
        exit up (the interpreter waits for every non-daemon thread before it exits)."""
        main = threading.main_thread()
        threads = [t.name for t in threading.enumerate() if t is not main and not t.daemon and t.is_alive()]
        _exit_now(
            self.config,
            status,
            "the server has stopped, but %s the process's exit up: exiting without waiting for %s (status %d)",
            f"non-daemon thread(s) {', '.join(map(repr, threads))} (an env's, which its close did not end?) hold"
            if threads
            else "something (an exit handler?) holds",
            "them" if threads else "it",
            status,
            own_files=self.own_files,
            level=logging.WARNING if status == 0 else logging.ERROR,
        )


def _slow_after(service: EnvService) -> float:
    """How long the service's env call may run before the watchdog warns of it (see SLOW_CALL_S)."""
    return max(SLOW_CALL_S, _SLOW_CALL_FACTOR * service.usual_seconds(service.call_kind))


def _stuck_at(thread_id: int) -> str:
    """Where thread ``thread_id`` is, an env call's: "in env 1 of 2, at FILE:LINE in FUNC (SOURCE), from FILE:LINE
    in FUNC, ..." (its innermost frames, the first with its source line; the env named where the stack passes an
    IsolateErrors that knows its place); "" where that thread runs no Python code any more."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    frames = traceback.extract_stack(frame, limit=_STUCK_FRAMES)[::-1]  # (innermost first)
    places = [f"{_short_path(f.filename)}:{f.lineno} in {f.name}" for f in frames]
    if frames and frames[0].line:
        places[0] += f" ({frames[0].line})"
    env = _isolated_env(frame)
    return f"{f'in {env}, ' if env else ''}at {', from '.join(places)}"


# The code of the IsolateErrors methods that call an env (an env call's stack passes one: it names the env).
_ENV_CALLS = (IsolateErrors.step.__code__, IsolateErrors.reset.__code__)


def _isolated_env(frame: Any) -> str:
    """The env ("env 1 of 2") whose IsolateErrors called what ``frame`` (or a frame it was called from) runs; ""
    where none did or its place is unknown (async vectorization: the envs are in other processes)."""
    while frame is not None:
        if frame.f_code in _ENV_CALLS:
            env = frame.f_locals.get("self")  # (read once per slow call, from another thread: it only reads)
            if isinstance(env, IsolateErrors) and env.envfleet_position is not None:
                return env.name()
            return ""
        frame = frame.f_back
    return ""


def _short_path(filename: str) -> str:
    """``filename`` from the sys.path folder it is in (gymnasium/core.py, not /usr/lib/.../site-packages/
    gymnasium/core.py): as its module is named, short enough for a log line."""
    folders = [os.path.join(os.path.abspath(folder), "") for folder in sys.path]  # ("": the working directory)
    within = [folder for folder in folders if filename.startswith(folder)]
    return filename[len(max(within, key=len)) :] if within else filename


def _build_anew(config: ServerConfig) -> gym.vector.VectorEnv:
    """The envs built anew for a new session (``--fresh-envs``), on the env thread, as at start."""
    env = build_vector_env(config, copy=False)
    _tell_positions(env)
    return env


def _tell_positions(env: gym.vector.VectorEnv) -> None:
    """Tell the envs their places in ``env`` (see env_server.isolation.tell_positions), for their log lines; a
    failure to is only logged (the envs still serve, named "an env" in their lines)."""
    try:
        tell_positions(env)
    except Exception as err:  # (an async worker that ended: the first call says so, as the server's error)
        log.debug("could not tell the envs their places: %s: %s", type(err).__name__, err)


def _exit_now(
    config: ServerConfig,
    status: int,
    message: str,
    *args: object,
    own_files: tuple[tuple[str, FileIdentity | None], ...] = (),
    level: int = logging.ERROR,
) -> None:
    """Log ``message`` (as an error: ``level``) and exit at once with ``status``: no cleanup, no waiting for the env
    thread; the socket files in ``own_files`` (path, identity: see :func:`remove_own_file`) are removed;
    async vectorization's worker processes are killed, not left behind, and so, in a server a
    learner started (``--parent-pid``; it leads its own process group), is the rest of its group: what
    its envs started (a simulator), whose envs will not be closed."""
    log.log(level, message, *args)
    for path, made in own_files:
        with contextlib.suppress(OSError):
            remove_own_file(path, made)
    for child in multiprocessing.active_children():
        with contextlib.suppress(Exception):
            child.kill()
    logging.shutdown()
    if config.parent_pid and os.getpgrp() == os.getpid():
        _kill_own_group()
    os._exit(status)


def _kill_own_group() -> None:
    """SIGKILL the other processes of the group this process leads, looked for again until none is
    left (one forked meanwhile: a simulator started by the build still running), a few times at most;
    with no /proc of this PID namespace to find them by (macOS; a /proc mounted for another), the whole
    group, this process with it (its exit status is then lost)."""
    me = os.getpid()
    try:
        ours = os.readlink("/proc/self") == str(me)
    except OSError:
        ours = False
    if not ours:
        os.killpg(me, signal.SIGKILL)
        return
    for _ in range(5):
        killed = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()  # (after the command's name: it may hold anything)
                if int(fields[2]) == me and fields[0] != b"Z":  # (state, ppid, pgrp; a zombie is dead already)
                    os.kill(int(entry), signal.SIGKILL)
                    killed += 1
            except (OSError, IndexError, ValueError):
                continue  # (gone meanwhile)
        if not killed:
            return


def run(config: ServerConfig, on_ready: Callable[[str], None], *, exit_margin_s: float = EXIT_MARGIN_S) -> int:
    """Synchronous entry: serve until stopped (see :func:`serve`); the exit status. Once a shutdown is
    asked for, the process exits within the grace period and ``exit_margin_s`` even while an env
    call still runs or the envs' close hangs (see ``_Watchdog``)."""
    return asyncio.run(serve(config, on_ready, watch_exit=True, exit_margin_s=exit_margin_s))
