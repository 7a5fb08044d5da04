"""``python -m tests.full_bounds_server ARGS``: an env-server (ARGS as env-server's) as servers older than
compact Box bounds served: every spec with its bounds at full shape, whatever the request asks (such a server
does not know GetSpecRequest.accepts_compact_bounds, nor HandshakeRequest's: protobuf reads them as unknown
fields, which nothing looks at)."""

from __future__ import annotations

import sys
from typing import Any

import grpc

from env_server.__main__ import main
from env_server.rpc import env_pb2 as pb
from env_server.service import EnvService


def serve_full_bounds() -> None:
    """Patch EnvService so that GetSpec and Handshake answer as if the request did not ask for compact bounds."""
    get_spec, handshake = EnvService.GetSpec, EnvService.Handshake

    async def old_get_spec(self: EnvService, request: pb.GetSpecRequest, context: grpc.aio.ServicerContext) -> Any:
        return await get_spec(self, pb.GetSpecRequest(server_id_only=request.server_id_only), context)

    async def old_handshake(self: EnvService, request: pb.HandshakeRequest, context: grpc.aio.ServicerContext) -> Any:
        old = pb.HandshakeRequest()
        old.CopyFrom(request)
        old.ClearField("accepts_compact_bounds")
        return await handshake(self, old, context)

    EnvService.GetSpec = old_get_spec  # type: ignore[method-assign]
    EnvService.Handshake = old_handshake  # type: ignore[method-assign]


if __name__ == "__main__":
    serve_full_bounds()
    sys.exit(main())
