"""Building and running the gRPC server: the env service, the health service, and shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from env_server.config import ServerConfig
from env_server.envs import build_vector_env
from env_server.metrics import ServerMetrics
from env_server.protocol import MAX_MESSAGE_BYTES, SERVICE_NAME
from env_server.rpc import env_pb2_grpc as pb_grpc
from env_server.service import EnvService

__all__ = ["server_options", "serve", "run"]

log = logging.getLogger(__name__)


def server_options() -> list[tuple[str, int]]:
    """Channel options for the server: message limits and keepalive so dead peers are noticed."""
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # Ping an idle client every 10 s; a peer that does not answer within 5 s is dead, which ends
        # its Hold stream and so its claim.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        # Let clients ping us as often as every 5 s (their own keepalive).
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.so_reuseport", 0),
    ]


def _listen_address(config: ServerConfig) -> str:
    if config.unix_socket:
        return f"unix:{config.unix_socket}"
    host = f"[{config.host}]" if ":" in config.host else config.host
    return f"{host}:{config.port}"


async def serve(config: ServerConfig, on_ready: Callable[[str], None]) -> None:
    """Build the envs, serve them until SIGTERM/SIGINT (or the parent process dies), then shut down.

    ``on_ready`` receives the address actually listened on (``HOST:PORT`` with the real port, or
    ``unix:PATH``) once the server accepts calls.
    """
    # Handle SIGTERM/SIGINT from the start, so a signal that comes as soon as we say we are ready
    # still means a clean shutdown.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    env = build_vector_env(config)
    metrics = None
    if config.metrics_port is not None:
        metrics = ServerMetrics(env_id=config.env, num_envs=env.num_envs, vectorization=config.vectorization)
    service = EnvService(config, env, metrics)
    server = grpc.aio.server(options=server_options())
    pb_grpc.add_EnvServiceServicer_to_server(service, server)
    health_service = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_service, server)
    address = _listen_address(config)
    try:
        port = server.add_insecure_port(address)
    except RuntimeError as err:
        env.close()
        raise OSError(f"cannot listen on {address}: {err}") from err
    if metrics is not None:
        assert config.metrics_port is not None
        metrics_host = "127.0.0.1" if config.unix_socket else config.host
        try:
            metrics_port = metrics.serve_http(metrics_host, config.metrics_port)
        except OSError as err:
            env.close()
            raise OSError(f"cannot serve metrics on {metrics_host}:{config.metrics_port}: {err}") from err
        shown = f"[{metrics_host}]" if ":" in metrics_host else metrics_host
        log.info("Prometheus metrics on http://%s:%d/metrics", shown, metrics_port)
    await server.start()
    # The envs exist: report healthy, for the service and overall ("").
    for name in (SERVICE_NAME, ""):
        await health_service.set(name, health_pb2.HealthCheckResponse.SERVING)
    if config.unix_socket:
        ready = address
    else:
        host = f"[{config.host}]" if ":" in config.host else config.host
        ready = f"{host}:{port}"
    log.info("serving %d x %s (%s) on %s", config.num_envs, config.env, config.vectorization, ready)
    on_ready(ready)

    watchdog = asyncio.create_task(_watch_parent(config.parent_pid, stop)) if config.parent_pid else None
    await stop.wait()

    log.info("shutting down: finishing calls in flight (up to %.1f s)", config.grace_s)
    await health_service.enter_graceful_shutdown()
    service.end_all("server shutting down")
    await server.stop(config.grace_s)
    if watchdog is not None:
        watchdog.cancel()
    service.close()
    if metrics is not None:
        metrics.close()
    env.close()
    if config.unix_socket:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(config.unix_socket)
    log.info("stopped after %d steps", service.steps)


async def _watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    """Set ``stop`` once ``parent_pid`` is no longer our parent (it exited or was killed)."""
    while not stop.is_set():
        if os.getppid() != parent_pid:
            log.warning("parent process %d is gone; shutting down", parent_pid)
            stop.set()
            return
        await asyncio.sleep(0.5)


def run(config: ServerConfig, on_ready: Callable[[str], None]) -> None:
    """Synchronous entry: serve until stopped."""
    asyncio.run(serve(config, on_ready))
