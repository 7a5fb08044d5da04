"""The server's interceptors: the shared-token check (UNAUTHENTICATED), and INVALID_ARGUMENT for bytes that are no message.

TokenAuthInterceptor. Clients send ``authorization: Bearer <token>`` metadata with every call (``RemoteVectorEnv(...,
auth_token=...)``). The comparison takes the same time whatever the token given (``hmac.compare_digest``),
so a caller cannot find the token byte by byte by timing refusals. A refusal says whether the value was of
the wrong form (none, empty, no ``Bearer `` before the token, another case of it) or the token wrong, from the
form of the value alone: nothing about the token.

The gRPC health service stays open: container and Kubernetes probes cannot send a token, and it
tells nothing but SERVING or NOT_SERVING. Everything of EnvService, GetSpec included, needs the token.
(The step socket, outside gRPC, checks no token: a step there needs the session id, which only a
Handshake that passed this check hands out.)

CallLimitInterceptor. gRPC itself caps the calls in progress (``env-server --max-concurrent-rpcs``): it
refuses the rest with RESOURCE_EXHAUSTED before reading their requests, after the interceptors have
run and without a word to Python. This interceptor, the first, counts the calls in progress as gRPC
does, to log (rate-limited) that the server is refusing calls, and keeps the health service's Watch
streams, which need no token and may stay open for ever, to a few (MAX_WATCH_STREAMS), so that they
cannot take every place under the cap.

RequestGuardInterceptor. A request whose bytes do not parse as the method's message would otherwise
end as UNKNOWN ("Exception deserializing request!"); it gets INVALID_ARGUMENT naming the message
type instead, like any other malformed request, and is counted and logged as the service's own
refusals are. (A request larger than the server's receive limit never gets here: gRPC core refuses
it, RESOURCE_EXHAUSTED, before any Python code sees its bytes, and tells Python nothing of it.)
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import inspect
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from env_server.protocol import (
    AUTH_METADATA_KEY,
    ERROR_ORIGIN_KEY,
    ERROR_ORIGIN_SERVER,
    SERVICE_NAME,
    check_token,
    peer_text,
)

__all__ = [
    "MAX_WATCH_STREAMS",
    "OPEN_SERVICES",
    "CallLimitInterceptor",
    "MalformedRequest",
    "RefusalLog",
    "RequestGuardInterceptor",
    "TokenAuthInterceptor",
    "end_call",
    "method_name",
    "refuse",
]

log = logging.getLogger(__name__)

OPEN_SERVICES = ("/grpc.health.v1.Health/",)
"""Method prefixes served without a token."""

HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
MAX_WATCH_STREAMS = 4
"""Health Watch streams open at once; more are refused with RESOURCE_EXHAUSTED. Nothing of envfleet
watches (its probes, Docker's and Kubernetes' call Check); a Watch stream needs no token and stays
open as long as its caller likes, each taking one of the places ``--max-concurrent-rpcs`` allows."""

# Seconds between two log lines about refused calls of one kind (a scan or a misconfigured learner
# may send many).
_LOG_EVERY_S = 10.0
# Marks a status as this server's own (see ERROR_ORIGIN_KEY).
_ORIGIN = ((ERROR_ORIGIN_KEY, ERROR_ORIGIN_SERVER),)
# What the value of the ``authorization`` metadata starts with, before the token.
_BEARER = b"Bearer "


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


class CallLimitInterceptor(grpc.aio.ServerInterceptor):
    """Counts the calls in progress, to log when gRPC's own cap on them (``maximum_concurrent_rpcs`` of
    ``grpc.aio.server``, ``max_calls`` here) refuses calls, and refuses Health Watch streams past
    :data:`MAX_WATCH_STREAMS` (RESOURCE_EXHAUSTED, unread). The first interceptor: it sees every call.

    gRPC counts a call from the moment it takes it in until the call's task has ended, and refuses one
    that comes while ``max_calls`` are counted, after the interceptors ran, before the handler would;
    this counts a call from the moment it gets here until its task (the one the interceptors run in)
    has ended, and takes one that comes while ``max_calls`` are counted for refused (not counting it).
    The two counts part between a call's arrival and its interception, and at a call's end (gRPC counts
    a call until it has fully closed, after the task this counts ends): near the limit under churn, this
    misses some of gRPC's refusals (a review's flood of short calls: 55 of 86), never counts a call
    served as refused, and never leaks. Its log lines and metric are a lower bound. Unknown methods, which gRPC
    answers UNIMPLEMENTED whatever the count, are counted and never logged as refused.

    ``on_refusal`` (e.g. a metrics counter) is called once per call of EnvService taken for refused,
    with the method's name (``Step``).
    """

    def __init__(self, max_calls: int, on_refusal: Callable[[str], None] | None = None) -> None:
        self.max_calls = max_calls
        self.active = 0
        """Calls in progress, as gRPC counts them (see above)."""
        self.watches = 0
        """Health Watch streams open."""
        self._on_refusal = on_refusal
        self._log = RefusalLog()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if self.active >= self.max_calls and handler is not None:
            self._note_refusal(method)
            return handler  # (gRPC refuses it: RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!")
        if method == HEALTH_WATCH and handler is not None and self.watches >= MAX_WATCH_STREAMS:
            return _unread_refusal(handler, self._refuse_watch)
        task = asyncio.current_task()
        if task is None:  # (gRPC runs every call in a task of its own; were that to change, no count)
            return handler
        self.active += 1
        task.add_done_callback(self._call_ended)
        if method == HEALTH_WATCH:
            self.watches += 1
            task.add_done_callback(self._watch_ended)
        return handler

    def _call_ended(self, task: asyncio.Task[Any]) -> None:
        self.active -= 1

    def _watch_ended(self, task: asyncio.Task[Any]) -> None:
        self.watches -= 1

    def _note_refusal(self, method: str) -> None:
        refuse(
            None,  # (gRPC ends the call itself)
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            _CALL_LIMIT_DETAILS,
            refusals=self._log,
            kind="",  # (one kind for every method: a line says the server is full, whatever was asked)
            line=(
                "refusing %s and every new call with RESOURCE_EXHAUSTED until some end: %d calls are in progress, "
                "the most this server serves at once (--max-concurrent-rpcs)",
                method[:_MAX_METHOD_CHARS],
                self.max_calls,
            ),
            count=_counter(self._on_refusal, method),
        )

    async def _refuse_watch(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        refuse(
            context,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{HEALTH_WATCH}: {MAX_WATCH_STREAMS} Watch streams are open on this server, the most it keeps; "
            "close one, or call Check",
            refusals=self._log,
            kind=HEALTH_WATCH,
            line=(
                "refused %s from %s: %d Watch streams are open, the most this server keeps",
                HEALTH_WATCH,
                peer_text(context.peer()),
                MAX_WATCH_STREAMS,
            ),
        )


# Longest part of a method name a log line shows (a known method's, but for a misbehaving client's typo).
_MAX_METHOD_CHARS = 100
# What gRPC's core tells a caller it refused at its cap on calls in progress (the learner's
# CALL_LIMIT_DETAILS).
_CALL_LIMIT_DETAILS = "Concurrent RPC limit exceeded!"


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Lets through calls whose ``authorization`` metadata is ``Bearer <token>``; refuses the rest.

    ``on_refusal`` (e.g. a metrics counter) is called once per refused call, with the method's name
    (``Step``).
    """

    def __init__(self, token: str, on_refusal: Callable[[str], None] | None = None) -> None:
        self._expected = _BEARER + check_token(token).encode()
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
        given: bytes | None = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_METADATA_KEY:
                given = value.encode() if isinstance(value, str) else bytes(value)
                break
        if hmac.compare_digest(given or b"", self._expected):
            return handler
        return self._refusal(handler, method, _token_fault(given))

    def _refusal(self, handler: grpc.RpcMethodHandler, method: str, reason: str) -> grpc.RpcMethodHandler:
        message = (
            f"{method}: this server requires an auth token and {reason}; send the server's token as metadata "
            f"'{AUTH_METADATA_KEY}: {_BEARER.decode()}<token>' with every call (envfleet's Python learner: "
            "RemoteVectorEnv(auth_token=...); learner train --auth-token, or ENVFLEET_AUTH_TOKEN in its environment)"
        )

        async def refuse_unauthenticated(request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
            refuse(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                message,
                refusals=self._log,
                kind=method,
                line=("refused %s from %s: %s", method, peer_text(context.peer()), reason),
                # (every refused method counted, as the docstring says: only EnvService's need the token)
                count=None if self._on_refusal is None else functools.partial(self._on_refusal, method_name(method)),
            )

        # (the request is not even waited for: see _unread_refusal)
        return _unread_refusal(handler, refuse_unauthenticated)


def _token_fault(given: bytes | None) -> str:
    """Why ``given``, the ``authorization`` metadata of a call (None: it had none), is not the
    server's: what a refusal says, telling a value of the wrong form from a wrong token. Only the
    form is looked at, never compared with the token, so nothing is said about the token."""
    if given is None:
        return "no token was sent (no 'authorization' metadata)"
    if not given:
        return f"the 'authorization' metadata is empty (expected '{_BEARER.decode()}<token>')"
    if not given.startswith(_BEARER):
        if given[: len(_BEARER)].lower() == _BEARER.lower():
            return "the 'authorization' metadata starts with another case of 'Bearer ' (expected exactly 'Bearer ')"
        return (
            "the 'authorization' metadata does not start with 'Bearer ' (expected 'Bearer <token>', the token "
            "after one space)"
        )
    token = given[len(_BEARER) :]
    if not token:
        return "the 'authorization' metadata has no token after 'Bearer '"
    if any(not 33 <= byte <= 126 for byte in token):
        return (
            "the token after 'Bearer ' has spaces or characters outside printable ASCII, which no token has "
            "(one space after 'Bearer', and no line end: a token read from a file?)"
        )
    return "the token is wrong"


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
        if handler.response_streaming and inspect.isasyncgenfunction(inner):

            async def guarded_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, MalformedRequest):
                    self._refuse(context, method, request.message)
                    return
                async for response in inner(request, context):
                    yield response

            return _handler_like(handler, guarded_stream, parse)
        if handler.response_streaming:
            # A handler that writes its responses itself (``await context.write(...)``) and returns
            # None: the health service's Watch. (As an async generator, this wrapper would iterate
            # what it returns: "'async for' requires an object with __aiter__ method".)

            async def guarded_writer(request: Any, context: grpc.aio.ServicerContext) -> None:
                if isinstance(request, MalformedRequest):
                    self._refuse(context, method, request.message)
                    return
                result = inner(request, context)
                if inspect.isawaitable(result):
                    await result

            return _handler_like(handler, guarded_writer, parse)

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, MalformedRequest):
                self._refuse(context, method, request.message)
                return None
            return await inner(request, context)

        return _handler_like(handler, guarded, parse)

    def _refuse(self, context: grpc.aio.ServicerContext, method: str, message: str) -> None:
        """End the call INVALID_ARGUMENT with ``message``; count it (EnvService's) and log it (rate-limited)."""
        code = grpc.StatusCode.INVALID_ARGUMENT
        refuse(
            context,
            code,
            message,
            refusals=self._log,
            kind=method,
            # (as the service logs its own refusals: "refused Step from PEER [CODE]: message (...)")
            line=("refused %s from %s [%s]: %s", method_name(method), peer_text(context.peer()), code.name, message),
            count=_counter(self._on_refusal, method),
        )


def refuse(
    context: grpc.aio.ServicerContext | None,
    code: grpc.StatusCode,
    message: str,
    *,
    refusals: RefusalLog,
    kind: str,
    line: tuple[Any, ...] | None,
    count: Callable[[], object] | None = None,
    level: int = logging.WARNING,
    logger: logging.Logger = log,
    trailing_metadata: tuple[tuple[str, str], ...] = _ORIGIN,
) -> None:
    """Refuse a call with ``code`` and ``message``: the one place this server's refusals, the
    service's and its interceptors', are counted, logged and sent.

    ``count`` (a metric's counter, or None) is called; the refusal is noted in ``refusals`` as one of
    its ``kind`` (a method) and ``code``, and when a line of that kind is due (see RefusalLog),
    ``line`` (a format and its arguments; the count of refusals so far follows them) is logged on
    ``logger`` at ``level`` (``line`` None: nothing is, an error logged as it happened). Then the
    call ends (see end_call; ``trailing_metadata`` marks the status as this server's own).

    ``context`` None: the refusal ends otherwise, ``message`` said by whoever ends it (gRPC's own
    call limit; a StepError frame on the step socket).
    """
    if count is not None:
        count()
    suffix = refusals.note(kind, code)
    if suffix is not None and line is not None:
        logger.log(level, f"{line[0]} %s", *line[1:], suffix)
    if context is not None:
        end_call(context, code, message, trailing_metadata)


def _counter(on_refusal: Callable[[str], None] | None, method: str) -> Callable[[], object] | None:
    """``on_refusal`` (an interceptor's metric counter) for a refused call of ``method``: called with
    the method's name (``Step``), for EnvService's calls alone (the health service's are only logged)."""
    if on_refusal is None or not method.startswith(f"/{SERVICE_NAME}/"):
        return None
    return functools.partial(on_refusal, method_name(method))


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


def _unread_refusal(handler: grpc.RpcMethodHandler, refuse: Callable[..., Any]) -> grpc.RpcMethodHandler:
    """A handler for ``handler``'s method that runs ``refuse(request_iterator, context)`` at once,
    without waiting for the request, let alone parsing it: gRPC runs a unary handler only once the
    whole request is in, and the call, and the request's bytes, are held meanwhile (up to
    ``--max-request-bytes``, for as long as the caller takes to send them); as a streaming handler
    that reads nothing, the call ends as soon as it begins. (The same on the wire: a unary request is a
    stream of one message, which a server may answer before it has read it.)"""
    make = grpc.stream_stream_rpc_method_handler if handler.response_streaming else grpc.stream_unary_rpc_method_handler
    return make(refuse, request_deserializer=_unparsed, response_serializer=handler.response_serializer)


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
