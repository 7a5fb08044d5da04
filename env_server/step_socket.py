"""The step socket: StepStream's twin on a plain Unix socket, for learners on the server's host.

Same messages, checks and errors as StepStream, framed as the proto's header describes, without
HTTP/2: a gRPC message in Python costs several thread switches on each side, a frame here none. A
quick step (see ``service.INLINE_LIMIT_S``) runs inside ``data_received``, the answer written before
the callback returns; a slow one runs as a task, like any env call of the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat

import grpc

from env_server.protocol import FRAME_ERROR, FRAME_HEADER, FRAME_STEP, MAX_MESSAGE_BYTES
from env_server.rpc import env_pb2 as pb
from env_server.service import EnvService, ServiceError, shutting_down

__all__ = ["MAX_CONNECTIONS", "StepSocketServer"]

log = logging.getLogger(__name__)

# Open connections at once: a learner needs one per session; more is a misbehaving peer.
MAX_CONNECTIONS = 8


class StepSocketServer:
    """Listens on ``path`` and serves the steps of ``service``'s session there."""

    def __init__(self, service: EnvService, path: str) -> None:
        self.service = service
        self.path = path
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None

    async def start(self, mode_of: str) -> None:
        """Listen; the socket gets the permissions of the file ``mode_of`` (the gRPC socket)."""
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(os.stat(self.path).st_mode):
                os.unlink(self.path)  # left by a server that was killed (gRPC does the same for its own)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(lambda: _Connection(self), path=self.path)
        os.chmod(self.path, stat.S_IMODE(os.stat(mode_of).st_mode))

    def drain(self) -> None:
        """Shutdown starts: idle connections are told so and closed; busy ones after their step."""
        for connection in list(self.connections):
            connection.drain()

    async def finish(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the steps in progress (slow envs) to be answered."""
        tasks = [c.task for c in self.connections if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.abort()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class _Connection(asyncio.Protocol):
    """One learner's connection: frames in, one answer each, in order; the first error ends it."""

    def __init__(self, owner: StepSocketServer) -> None:
        self.owner = owner
        self.service = owner.service
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.task: asyncio.Task[None] | None = None  # a slow step in progress
        self.paused = False  # the peer does not read its answers: stop serving until it does
        self.closed = False

    # -- asyncio.Protocol --------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if len(self.owner.connections) >= MAX_CONNECTIONS:
            log.warning("step socket: refused a connection (%d already open)", MAX_CONNECTIONS)
            self.closed = True
            transport.close()
            return
        self.owner.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.buffer += data
        self.serve()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.owner.connections.discard(self)
        if self.task is not None:
            self.task.cancel()  # the env call itself finishes (see EnvService._run_env)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self.serve()

    # -- serving -----------------------------------------------------------------------------------

    def serve(self) -> None:
        """Answer the complete frames received, in order, unless a step is in progress."""
        try:
            while not (self.closed or self.paused or self.task is not None):
                request = self.next_request()
                if request is None:
                    return
                if self.service.draining:
                    raise shutting_down()
                response = self.service.step_now(request)
                if response is None:  # the envs are busy or slow: step on the loop's terms
                    self.task = asyncio.get_running_loop().create_task(self.step_later(request))
                    return
                self.send(FRAME_STEP, response.SerializeToString())
        except Exception as err:
            self.fail(err)

    def next_request(self) -> pb.StepRequest | None:
        """The next complete frame's request (removed from the buffer), or None until one is in."""
        if len(self.buffer) < FRAME_HEADER.size:
            return None
        length, kind = FRAME_HEADER.unpack_from(self.buffer)
        if length > MAX_MESSAGE_BYTES:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"step socket: a frame of {length} bytes is over the {MAX_MESSAGE_BYTES}-byte message limit",
            )
        end = FRAME_HEADER.size + length
        if len(self.buffer) < end:
            return None
        payload = bytes(self.buffer[FRAME_HEADER.size : end])
        del self.buffer[:end]
        if kind != FRAME_STEP:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"step socket: expected a frame of kind {FRAME_STEP} (a StepRequest), got kind {kind}",
            )
        try:
            return pb.StepRequest.FromString(payload)
        except Exception as err:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"step socket: the frame is not a valid StepRequest ({type(err).__name__}: {err}); "
                "is the client built from envfleet.v1's proto?",
            ) from err

    async def step_later(self, request: pb.StepRequest) -> None:
        try:
            response = await self.service.step(request)
        except Exception as err:
            self.task = None
            self.fail(err)
            return
        self.task = None
        if self.closed:
            return
        self.send(FRAME_STEP, response.SerializeToString())
        if self.service.draining:
            self.fail(shutting_down())
            return
        self.serve()  # frames that came meanwhile

    def send(self, kind: int, payload: bytes) -> None:
        assert self.transport is not None
        self.transport.write(FRAME_HEADER.pack(len(payload), kind) + payload)

    def fail(self, err: Exception) -> None:
        """Send the status ``err`` means as a StepError, then close (as a status ends a StepStream)."""
        if self.closed:
            return
        code, message, env_index = self.service.status(err, "StepSocket")
        self.send(
            FRAME_ERROR, pb.StepError(code=code.value[0], message=message, env_index=env_index).SerializeToString()
        )
        self.closed = True
        assert self.transport is not None
        self.transport.close()  # after what is buffered is written

    def drain(self) -> None:
        if self.task is None:
            self.fail(shutting_down())

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
