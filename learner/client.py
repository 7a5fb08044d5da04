"""One env server seen from the learner: its channel, session, deadlines, and RpcError translation."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Sequence
from typing import Any, TypeVar

import grpc

from env_server.protocol import ENV_INDEX_KEY, MAX_MESSAGE_BYTES, PROTOCOL_VERSION
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from learner.errors import (
    AuthenticationError,
    EnvCrashedError,
    InvalidRequestError,
    RemoteEnvError,
    RemoteTimeoutError,
    ServerBusyError,
    ServerUnavailableError,
    SessionError,
)

__all__ = ["EnvClient", "channel_options", "translate_error"]

log = logging.getLogger(__name__)

T = TypeVar("T")


def channel_options() -> list[tuple[str, Any]]:
    """Client channel options: message limits, keepalive, and quick reconnects."""
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # Notice a dead server within ~15 s even while no call is in flight.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # After a lost connection, try again soon (the default starts at 1 s and grows to 120 s).
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.min_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", 2_000),
        # One connection per client, not shared with other clients to the same address: each server
        # gets its own HTTP/2 connection and I/O.
        ("grpc.use_local_subchannel_pool", 1),
    ]


_CODE_TO_ERROR: dict[grpc.StatusCode, type[RemoteEnvError]] = {
    grpc.StatusCode.UNAVAILABLE: ServerUnavailableError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ServerBusyError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.FAILED_PRECONDITION: SessionError,
    grpc.StatusCode.DEADLINE_EXCEEDED: RemoteTimeoutError,
    grpc.StatusCode.INTERNAL: EnvCrashedError,
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: AuthenticationError,
    grpc.StatusCode.CANCELLED: ServerUnavailableError,
}


def translate_error(
    err: grpc.RpcError, *, address: str, method: str, env_offset: int = 0, timeout: float | None = None
) -> RemoteEnvError:
    """The envfleet exception for a failed call (the one place RpcError is translated)."""
    code = err.code() if isinstance(err, grpc.Call) else None
    details = (err.details() if isinstance(err, grpc.Call) else None) or str(err)
    env_index: int | None = None
    if isinstance(err, grpc.Call):
        for key, value in err.trailing_metadata() or ():
            if key == ENV_INDEX_KEY:
                with contextlib.suppress(ValueError):
                    env_index = env_offset + int(value)
    cls = _CODE_TO_ERROR.get(code, RemoteEnvError) if code is not None else RemoteEnvError
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
        details = f"no answer within the {timeout:g} s deadline ({details}); raise `timeout` if the env is slow"
    prefix = f"env server {address}: {method}"
    if env_index is not None:
        prefix += f" (env {env_index} of the fleet)"
    name = code.name if code is not None else "error"
    return cls(f"{prefix} failed [{name}]: {details}", address=address, code=code, env_index=env_index)


class EnvClient:
    """One connection to one env server, holding its session once :meth:`handshake` succeeds."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float,
        env_offset: int = 0,
        client_name: str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.env_offset = env_offset
        self.client_name = client_name or f"{socket.gethostname()}:{os.getpid()}"
        self.metadata = tuple(metadata)
        options = channel_options()
        if credentials is None:
            self.channel = grpc.insecure_channel(address, options=options)
        else:
            self.channel = grpc.secure_channel(address, credentials, options=options)
        self.stub = pb_grpc.EnvServiceStub(self.channel)
        self.session_id = ""
        self.spec: pb.EnvSpec | None = None
        self._hold: Any = None

    # -- connection ---------------------------------------------------------------------------

    def ready_future(self) -> grpc.Future:
        """A future that completes once the channel is connected."""
        return grpc.channel_ready_future(self.channel)

    def handshake_future(self) -> grpc.Future:
        request = pb.HandshakeRequest(protocol_version=PROTOCOL_VERSION, client_name=self.client_name)
        return self.stub.Handshake.future(request, timeout=self.timeout, metadata=self.metadata)

    def start_session(self, response: pb.HandshakeResponse) -> None:
        """Adopt the session a Handshake returned and open its Hold stream (which keeps the claim)."""
        self.session_id = response.session_id
        self.spec = response.spec
        self._hold = self.stub.Hold(pb.HoldRequest(session_id=self.session_id), metadata=self.metadata)

    def get_spec(self) -> pb.EnvSpec:
        response = self.call(
            self.stub.GetSpec.future(pb.GetSpecRequest(), timeout=self.timeout, metadata=self.metadata), "GetSpec"
        )
        return response.spec

    # -- calls ----------------------------------------------------------------------------------

    def reset_future(
        self, seeds: Sequence[int | None] | None, options: pb.Value | None, mask: Sequence[bool] | None
    ) -> grpc.Future:
        request = pb.ResetRequest(session_id=self.session_id)
        if seeds is not None:
            for seed in seeds:
                request.seeds.add() if seed is None else request.seeds.add(value=seed)
        if options is not None:
            request.options.CopyFrom(options)
        if mask is not None:
            request.reset_mask.extend(mask)
        return self.stub.Reset.future(request, timeout=self.timeout, metadata=self.metadata)

    def step_future(self, actions: pb.Value) -> grpc.Future:
        request = pb.StepRequest(session_id=self.session_id)
        request.actions.CopyFrom(actions)
        return self.stub.Step.future(request, timeout=self.timeout, metadata=self.metadata)

    def call(self, future: grpc.Future, method: str) -> Any:
        """The response of ``future``, or the envfleet exception its failure means."""
        try:
            return future.result()
        except grpc.RpcError as err:
            raise translate_error(
                err, address=self.address, method=method, env_offset=self.env_offset, timeout=self.timeout
            ) from None

    # -- shutdown -------------------------------------------------------------------------------

    def release(self, timeout: float = 2.0) -> None:
        """End the session (best effort: the server also ends it when the connection drops)."""
        if self.session_id:
            try:
                self.stub.Release(
                    pb.ReleaseRequest(session_id=self.session_id), timeout=timeout, metadata=self.metadata
                )
            except grpc.RpcError as err:
                log.debug("release of %s failed: %s", self.address, err)
            self.session_id = ""
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None

    def close(self) -> None:
        self.release()
        self.channel.close()
