"""``python -m tests.old_server ARGS``: an env-server (ARGS as env-server's) as envfleet's first versions
served, before StepStream: it answers Handshake and Reset, and every step UNIMPLEMENTED, as gRPC answers
for a method a server does not have; its specs' Box bounds at full shape (tests.full_bounds_server)."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc

from env_server.__main__ import main
from env_server.service import EnvService
from tests.full_bounds_server import serve_full_bounds


async def _no_step_stream(self: EnvService, requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
    yield None  # (never reached: makes this the async generator a stream-stream handler is)


if __name__ == "__main__":
    EnvService.StepStream = _no_step_stream  # type: ignore[method-assign,assignment]
    serve_full_bounds()
    sys.exit(main())
