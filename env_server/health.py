"""A health probe: ask an env server's gRPC health service whether it is SERVING (exit 0) or not (1).

    python -m env_server.health                       # 127.0.0.1:$ENVFLEET_PORT (default 50051)
    python -m env_server.health --address 10.0.0.5:50051 --service envfleet.v1.EnvService

The container image's HEALTHCHECK runs this file by path (``python -I .../health.py``), which skips
the package's ``__init__`` (numpy, gymnasium): a probe then costs grpc's import alone, ~0.1 s of CPU
every interval per replica. So this module imports nothing from ``env_server``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["check", "default_address", "main"]

# A server listening on every interface is asked on loopback.
_LOOPBACK = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1"}


def default_address(environ: Mapping[str, str] = os.environ) -> str:
    """Where the server started with the same ``ENVFLEET_*`` variables listens, as seen from its host."""
    if environ.get("ENVFLEET_UNIX_SOCKET"):
        return f"unix:{environ['ENVFLEET_UNIX_SOCKET']}"
    host = environ.get("ENVFLEET_HOST", "127.0.0.1")
    host = _LOOPBACK.get(host, host).strip("[]")
    port = environ.get("ENVFLEET_PORT", "50051")
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check(address: str, service: str = "", timeout: float = 3.0) -> str:
    """The health status name (``SERVING``, ``NOT_SERVING``, ...) of ``service`` at ``address``.

    Raises:
        grpc.RpcError: nothing answered within ``timeout`` seconds, or the service is unknown.
    """
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m env_server.health",
        description="Exit 0 if the env server's gRPC health service says SERVING, 1 otherwise.",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="host:port or unix:PATH (default: from ENVFLEET_HOST/ENVFLEET_PORT/ENVFLEET_UNIX_SOCKET, else 127.0.0.1:50051)",
    )
    parser.add_argument(
        "--service", default="", help="service to ask about ('' = the whole server, or envfleet.v1.EnvService)"
    )
    parser.add_argument(
        "--timeout", type=float, default=3.0, help="seconds to wait for an answer (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    address = args.address or default_address()
    try:
        status = check(address, args.service, args.timeout)
    except grpc.RpcError as err:
        if err.code() is grpc.StatusCode.NOT_FOUND:
            print(f"{address}: unhealthy: the server knows no service {args.service!r}", file=sys.stderr)
        else:
            print(f"{address}: unhealthy: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    print(f"{address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    sys.exit(main())
