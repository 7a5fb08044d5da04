"""The server's interceptors: the shared-token check (UNAUTHENTICATED), and INVALID_ARGUMENT for bytes that are no message.

TokenAuthInterceptor. Clients send ``authorization: Bearer <token>`` metadata with every call (``RemoteVectorEnv(...,
auth_token=...)``). The comparison takes the same time whatever the token given (``hmac.compare_digest``),
so a caller cannot find the token byte by byte by timing refusals.

The gRPC health service stays open: container and Kubernetes probes cannot send a token, and it
tells nothing but SERVING or NOT_SERVING. Everything of EnvService, GetSpec included, needs the token.
(The step socket, outside gRPC, checks no token: a step there needs the session id, which only a
Handshake that passed this check hands out.)

RequestGuardInterceptor. A request whose bytes do not parse as the method's message would otherwise
end as UNKNOWN ("Exception deserializing request!"); it gets INVALID_ARGUMENT naming the message
type instead, like any other malformed request, and is counted and logged as the service's own
refusals are. (A request larger than the server's receive limit never gets here: gRPC core refuses
it, RESOURCE_EXHAUSTED, before any Python code sees its bytes, and tells Python nothing of it.)
"""

from __future__ import annotations

import hmac
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from env_server.protocol import AUTH_METADATA_KEY, ERROR_ORIGIN_KEY, ERROR_ORIGIN_SERVER, SERVICE_NAME, check_token

__all__ = [
    "OPEN_SERVICES",
    "MalformedRequest",
    "RefusalLog",
    "RequestGuardInterceptor",
    "TokenAuthInterceptor",
    "end_call",
    "method_name",
]

log = logging.getLogger(__name__)

OPEN_SERVICES = ("/grpc.health.v1.Health/",)
"""Method prefixes served without a token."""

# Seconds between two log lines about refused calls of one kind (a scan or a misconfigured learner
# may send many).
_LOG_EVERY_S = 10.0
# Marks a status as this server's own (see ERROR_ORIGIN_KEY).
_ORIGIN = ((ERROR_ORIGIN_KEY, ERROR_ORIGIN_SERVER),)


class RefusalLog:
    """Rate limits for log lines about refused calls: at most one line per ``every_s`` seconds for
    each kind of refusal (a method and a status code), so that a flood of one kind does not hide
    another, and each line says how many of its kind were left out since the last.

    ``what`` names the events counted in those lines, for a log of something other than refused
    calls (connections closed to make room, say)."""

    def __init__(self, every_s: float = _LOG_EVERY_S, what: str = "refused calls") -> None:
        self._every_s = every_s
        self._what = what
        self._kinds: dict[tuple[str, str], tuple[float, int]] = {}  # kind -> (last line, left out since)
        self.refused = 0
        """Refused calls (events) so far, of every kind."""

    def note(self, method: str, code: grpc.StatusCode) -> str | None:
        """Count a refused call; the suffix for its log line (how many refused calls so far, and of
        its kind left out since its kind's last line), or None when no line is due."""
        self.refused += 1
        now = time.monotonic()
        kind = (method, code.name)  # (a bounded set: the server's methods and the codes it sends)
        last, left_out = self._kinds.get(kind, (-math.inf, 0))
        if now - last < self._every_s:
            self._kinds[kind] = (last, left_out + 1)
            return None
        self._kinds[kind] = (now, 0)
        since = f", {left_out} more like it not logged since the last such line" if left_out else ""
        return f"({self.refused} {self._what} so far{since})"


def method_name(method: str) -> str:
    """``Step`` of ``/envfleet.v1.EnvService/Step``."""
    return method.rsplit("/", 1)[-1]


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Lets through calls whose ``authorization`` metadata is ``Bearer <token>``; refuses the rest.

    ``on_refusal`` (e.g. a metrics counter) is called once per refused call, with the method's name
    (``Step``).
    """

    def __init__(self, token: str, on_refusal: Callable[[str], None] | None = None) -> None:
        self._expected = f"Bearer {check_token(token)}".encode()
        self._on_refusal = on_refusal
        self._log = RefusalLog()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        given = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                break
        if hmac.compare_digest(given, self._expected):
            return handler
        reason = "no token was sent" if not given else "the token is wrong"
        return self._refusal(handler, method, reason)

    def _refusal(self, handler: grpc.RpcMethodHandler, method: str, reason: str) -> grpc.RpcMethodHandler:
        message = (
            f"{method}: this server requires an auth token and {reason}; pass the server's token "
            "(RemoteVectorEnv(auth_token=...); learner train --auth-token, or ENVFLEET_AUTH_TOKEN in its environment)"
        )

        async def refuse(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
            self._note(method, context.peer(), reason)
            end_call(context, grpc.StatusCode.UNAUTHENTICATED, message)

        # (the request is not parsed, which can take ~25x its size in memory: a caller without the
        # token costs no more than its bytes)
        return _handler_like(handler, refuse, _unparsed)

    def _note(self, method: str, peer: str, reason: str) -> None:
        if self._on_refusal is not None:
            self._on_refusal(method_name(method))
        suffix = self._log.note(method, grpc.StatusCode.UNAUTHENTICATED)
        if suffix is not None:
            log.warning("refused %s from %s: %s %s", method, peer, reason, suffix)


class MalformedRequest:
    """What a request that does not parse becomes (instead of an exception inside gRPC): the reason."""

    def __init__(self, message: str) -> None:
        self.message = message


class RequestGuardInterceptor(grpc.aio.ServerInterceptor):
    """Requests that are no valid message reach the handler as :class:`MalformedRequest`; unary ones
    (and Hold's, whose response streams) are refused here with INVALID_ARGUMENT. Streaming handlers
    that read with ``context.read()`` (StepStream) check for it themselves, and count and log it as
    the service's other refusals.

    Each refusal here is logged (at most one line per 10 s for each method, see :class:`RefusalLog`),
    and ``on_refusal`` (e.g. a metrics counter) is called once per refused call of EnvService with
    the method's name (``Step``); the health service's calls are logged only.
    """

    def __init__(self, on_refusal: Callable[[str], None] | None = None) -> None:
        self._on_refusal = on_refusal
        self._log = RefusalLog()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        deserialize = handler.request_deserializer

        def parse(data: bytes) -> Any:
            try:
                return deserialize(data)
            except Exception as err:
                return MalformedRequest(
                    f"{method}: the request is not a valid protobuf message of this method "
                    f"({type(err).__name__}: {err}); is the client built from envfleet.v1's proto?"
                )

        if handler.request_streaming:
            return _handler_like(handler, handler.stream_stream or handler.stream_unary, parse)
        inner = handler.unary_stream if handler.response_streaming else handler.unary_unary
        if handler.response_streaming:

            async def guarded_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, MalformedRequest):
                    self._refuse(context, method, request.message)
                    return
                async for response in inner(request, context):
                    yield response

            return _handler_like(handler, guarded_stream, parse)

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, MalformedRequest):
                self._refuse(context, method, request.message)
                return None
            return await inner(request, context)

        return _handler_like(handler, guarded, parse)

    def _refuse(self, context: grpc.aio.ServicerContext, method: str, message: str) -> None:
        """End the call INVALID_ARGUMENT with ``message``; count it (EnvService's) and log it (rate-limited)."""
        code = grpc.StatusCode.INVALID_ARGUMENT
        name = method_name(method)
        if self._on_refusal is not None and method.startswith(f"/{SERVICE_NAME}/"):
            self._on_refusal(name)
        suffix = self._log.note(method, code)
        if suffix is not None:
            # (as the service logs its own refusals: "refused Step from PEER [CODE]: message (...)")
            log.warning("refused %s from %s [%s]: %s %s", name, context.peer(), code.name, message, suffix)
        end_call(context, code, message)


def end_call(
    context: grpc.aio.ServicerContext,
    code: grpc.StatusCode,
    message: str,
    trailing_metadata: tuple[tuple[str, str], ...] = _ORIGIN,
) -> None:
    """Set a status of this server's own on the call (``trailing_metadata`` marks it so, see
    ERROR_ORIGIN_KEY); the handler then returns, with no response (gRPC sends none with an error).

    Not ``context.abort()``: grpc.aio keeps the AbortError it raises on the call's state, and its
    traceback holds the handler's frames (the request among their locals) and the call's state: a
    reference cycle that keeps each refused request in memory until Python's cyclic garbage
    collector runs, which can be GBs of requests later.
    """
    context.set_code(code)
    context.set_details(message)
    context.set_trailing_metadata(trailing_metadata)


def _unparsed(data: bytes) -> None:
    """The deserializer of a request no one reads."""
    return None


def _handler_like(
    handler: grpc.RpcMethodHandler, behavior: Callable[..., Any], deserializer: Callable[[bytes], Any] | None
) -> grpc.RpcMethodHandler:
    """A handler of the same kind (unary or streaming, both ways) as ``handler`` that runs ``behavior``."""
    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(behavior, request_deserializer=deserializer, response_serializer=handler.response_serializer)
