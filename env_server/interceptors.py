"""The server's interceptors: the limit on calls at once (RESOURCE_EXHAUSTED), the shared-token check
(UNAUTHENTICATED), and INVALID_ARGUMENT for bytes that are no message.

TokenAuthInterceptor. Clients send ``authorization: Bearer <token>`` metadata with every call (``RemoteVectorEnv(...,
auth_token=...)``). The comparison takes the same time whatever the token given (``hmac.compare_digest``),
so a caller cannot find the token byte by byte by timing refusals. A refusal says whether the value was of
the wrong form (none, empty, no ``Bearer `` before the token, another case of it) or the token wrong, from the
form of the value alone: nothing about the token.

The gRPC health service stays open: container and Kubernetes probes cannot send a token, and it
tells nothing but SERVING or NOT_SERVING (its calls keep to the few places CallLimitInterceptor leaves
them). Everything of EnvService, GetSpec included, needs the token.
(The step socket, outside gRPC, checks no token: a step there needs the session id, which only a
Handshake that passed this check hands out.)

CallLimitInterceptor. gRPC itself caps the calls in progress (``env-server --max-concurrent-rpcs``): it
refuses the rest with RESOURCE_EXHAUSTED before reading their requests, after the interceptors have
run and without a word to Python. This interceptor, the first, counts the calls in progress as gRPC
does, to log (rate-limited) that the server is refusing calls, and keeps the health service's calls,
which need no token, to a few places under the cap (health_call_limit: at most MAX_HEALTH_CALLS,
Check and Watch together, and at most half of the cap, leaving a learner its three), so that
callers without the token cannot take every place from learners: Watch streams, which may stay
open for ever, to fewer still (watch_stream_limit), and a Check whose request does not arrive
within HEALTH_REQUEST_TIMEOUT_S is ended, one that runs HEALTH_CHECK_LIMIT_S in all too, either sooner
when another health call needs its place.

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
from env_server.ratelimit import LogBudget

__all__ = [
    "HEALTH_CHECK_LIMIT_S",
    "HEALTH_MAKE_ROOM_AFTER_S",
    "HEALTH_REQUEST_TIMEOUT_S",
    "LEARNER_CALLS",
    "MAX_HEALTH_CALLS",
    "MAX_WATCH_STREAMS",
    "OPEN_SERVICES",
    "CallLimitInterceptor",
    "MalformedRequest",
    "RefusalLog",
    "RequestGuardInterceptor",
    "TokenAuthInterceptor",
    "end_call",
    "health_call_limit",
    "method_name",
    "refuse",
    "watch_stream_limit",
]

log = logging.getLogger(__name__)

OPEN_SERVICES = ("/grpc.health.v1.Health/",)
"""Method prefixes served without a token."""

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
MAX_WATCH_STREAMS = 4
"""Health Watch streams open at once (fewer under a small ``--max-concurrent-rpcs``, see
:func:`watch_stream_limit`); more are refused with RESOURCE_EXHAUSTED. Nothing of envfleet watches
(its probes, Docker's and Kubernetes' call Check); a Watch stream needs no token and stays open as
long as its caller likes, each taking one of the places ``--max-concurrent-rpcs`` allows."""
MAX_HEALTH_CALLS = 8
"""Health calls (Check and Watch together) in progress at once; more are refused with
RESOURCE_EXHAUSTED, unread. They need no token: without a bound, anyone who can reach the port could
take every place ``--max-concurrent-rpcs`` allows (Check calls that never send their request), and
no learner could call. A probe's Check takes a place for a few milliseconds."""
LEARNER_CALLS = 3
"""Places a learner needs on one server at once (its Hold stream, its StepStream, and one call more:
a Reset, GetSpec or Release), which the health service's calls never take (see
:func:`health_call_limit`)."""
HEALTH_REQUEST_TIMEOUT_S = 2.0
"""How long a health Check waits for its request (a few bytes, which a probe sends with the call's
headers): a Check whose request has not come by then is ended, DEADLINE_EXCEEDED, its place free."""
HEALTH_CHECK_LIMIT_S = 5.0
"""Longest a health Check may take in all (a probe's takes milliseconds): one whose answer cannot go out
(a caller that reads nothing: an HTTP/2 window of 0) is ended then (cancelled), its place free."""
HEALTH_MAKE_ROOM_AFTER_S = 0.25
"""Age from which a Check may lose its place to a new health call when the health calls fill theirs (see
:meth:`CallLimitInterceptor._make_room`): probes that arrive together (a liveness and a readiness probe of
the same period) do not end each other, the first one's request a moment behind its headers."""


def health_call_limit(max_calls: int) -> int:
    """Health calls served at once under ``max_calls`` (``--max-concurrent-rpcs``): MAX_HEALTH_CALLS,
    but at most half of ``max_calls`` and never one of the LEARNER_CALLS places a learner needs (and
    one at least, for a probe)."""
    return max(1, min(MAX_HEALTH_CALLS, max_calls // 2, max_calls - LEARNER_CALLS))


def watch_stream_limit(max_calls: int) -> int:
    """Health Watch streams kept open at once under ``max_calls``: MAX_WATCH_STREAMS, but one place
    of :func:`health_call_limit` always left for a probe's Check (none at all under the smallest
    ``max_calls``)."""
    return min(MAX_WATCH_STREAMS, health_call_limit(max_calls) - 1)


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
        self._kinds: dict[tuple[str, str], LogBudget] = {}
        self.refused = 0
        """Refused calls (events) so far, of every kind."""

    def note(self, method: str, code: grpc.StatusCode) -> str | None:
        """Count a refused call; the suffix for its log line (how many refused calls so far, and of
        its kind left out since its kind's last line), or None when no line is due."""
        self.refused += 1
        kind = (method, code.name)  # (a bounded set: the server's methods and the codes it sends)
        # (this module's clock, which a test sets)
        left_out = self._kinds.setdefault(kind, LogBudget(self._every_s)).due(time.monotonic())
        if left_out is None:
            return None
        since = f", {left_out} more like it not logged since the last such line" if left_out else ""
        return f"({self.refused} {self._what} so far{since})"


def method_name(method: str) -> str:
    """``Step`` of ``/envfleet.v1.EnvService/Step``."""
    return method.rsplit("/", 1)[-1]


class CallLimitInterceptor(grpc.aio.ServerInterceptor):
    """Counts the calls in progress, to log when gRPC's own cap on them (``maximum_concurrent_rpcs`` of
    ``grpc.aio.server``, ``max_calls`` here) refuses calls, and refuses health calls past
    :func:`health_call_limit`, and Watch streams past :func:`watch_stream_limit` (RESOURCE_EXHAUSTED,
    unread). The first interceptor: it sees every call.

    A health Check's request must come within :data:`HEALTH_REQUEST_TIMEOUT_S` of its call (else the
    call ends, DEADLINE_EXCEEDED), and the call end within :data:`HEALTH_CHECK_LIMIT_S` (else it is
    cancelled: a caller that reads no answer); and when the health calls fill their places, a new one
    takes the place of the oldest Check of :data:`HEALTH_MAKE_ROOM_AFTER_S` or more (see
    :meth:`_make_room`): a probe's Check is over in milliseconds, so a caller holding Checks open
    cannot keep probes out, only its own calls.

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
        self.health = 0
        """Health calls (Check and Watch) in progress."""
        self.max_health = health_call_limit(max_calls)
        self.max_watches = watch_stream_limit(max_calls)
        self._on_refusal = on_refusal
        self._log = RefusalLog()
        # Checks whose request has not come yet, oldest first: each one's future, set to end it.
        self._waiting: dict[int, asyncio.Future[None]] = {}
        # Checks in progress, oldest first: when each began, and its call's task.
        self._checks: dict[int, tuple[float, asyncio.Task[Any]]] = {}
        self._admitted = 0  # (Checks admitted so far: the keys of _waiting and _checks)

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
        if method == HEALTH_WATCH and handler is not None and self.watches >= self.max_watches:
            return _unread_refusal(handler, self._refuse_watch)
        health = handler is not None and method.startswith(OPEN_SERVICES)
        if health and self.health >= self.max_health and not self._make_room():
            return _unread_refusal(handler, functools.partial(self._refuse_health_unread, method))
        task = asyncio.current_task()
        if task is None:  # (gRPC runs every call in a task of its own; were that to change, no count)
            return handler
        self.active += 1
        task.add_done_callback(self._call_ended)
        if health:
            self.health += 1
            task.add_done_callback(self._health_ended)
        if method == HEALTH_WATCH:
            self.watches += 1
            task.add_done_callback(self._watch_ended)
        if method == HEALTH_CHECK and handler is not None and handler.unary_unary is not None:
            return self._check_in_time(handler, task)
        return handler

    def _call_ended(self, task: asyncio.Task[Any]) -> None:
        self.active -= 1

    def _health_ended(self, task: asyncio.Task[Any]) -> None:
        self.health -= 1

    def _watch_ended(self, task: asyncio.Task[Any]) -> None:
        self.watches -= 1

    def _make_room(self) -> bool:
        """End the oldest Check of :data:`HEALTH_MAKE_ROOM_AFTER_S` or more (its place goes to the health
        call that comes), True; False if there is none. One still waiting for its request is refused
        (RESOURCE_EXHAUSTED, saying so); one whose answer has not gone out (a probe's is out in
        milliseconds) is cancelled."""
        now = time.monotonic()
        for key, (began, task) in self._checks.items():
            if now - began < HEALTH_MAKE_ROOM_AFTER_S:
                return False  # (the others are younger still)
            del self._checks[key]
            ended = self._waiting.pop(key, None)
            if ended is not None:
                ended.set_result(None)
            else:
                task.cancel()
            return True
        return False

    def _check_in_time(self, handler: grpc.RpcMethodHandler, task: asyncio.Task[Any]) -> grpc.RpcMethodHandler:
        """``handler`` (a unary Check) as a streaming handler that waits for its one request at most
        HEALTH_REQUEST_TIMEOUT_S, or until :meth:`_make_room` ends it, and then answers as ``handler``
        does; the call cancelled after :data:`HEALTH_CHECK_LIMIT_S` in all. (gRPC would run the unary
        handler only once the request is in, however long its caller takes to send it; the same on the
        wire.)"""
        inner = handler.unary_unary
        key = self._admitted
        self._admitted += 1
        loop = asyncio.get_running_loop()
        ended = self._waiting[key] = loop.create_future()
        self._checks[key] = (time.monotonic(), task)
        too_long = loop.call_later(HEALTH_CHECK_LIMIT_S, task.cancel)

        def gone(_: asyncio.Task[Any]) -> None:  # (a call that ends before its handler runs, too)
            self._waiting.pop(key, None)
            self._checks.pop(key, None)
            too_long.cancel()

        task.add_done_callback(gone)

        async def check(request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
            read = asyncio.ensure_future(context.read())
            try:
                await asyncio.wait((read, ended), timeout=HEALTH_REQUEST_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED)
            finally:  # (the call cancelled meanwhile, too)
                self._waiting.pop(key, None)
                arrived = read.done()
                if not arrived:
                    read.cancel()
            if not arrived:
                if ended.done():
                    self._refuse_health(HEALTH_CHECK, request_iterator, context, waiting=True)
                else:
                    self._refuse_late(context)
                return None
            request = read.result()
            if request is grpc.aio.EOF and not context.peer():
                # The call has ended (its peer is gone from it): gRPC refused its request before this read
                # (over --max-request-bytes, or compressed data that does not decompress within it) and
                # sent its own status (RESOURCE_EXHAUSTED, INTERNAL), or the caller went away. Nothing to
                # answer: a status set now would not be sent (gRPC logs a traceback), and "it sent no
                # request" would be wrong (was: logged, without a peer, when the server was busy).
                log.debug("%s: its call ended before its request could be read (refused by gRPC)", HEALTH_CHECK)
                raise asyncio.CancelledError
            if request is grpc.aio.EOF:
                refuse(
                    context,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{HEALTH_CHECK}: the call ended its requests without sending one (expected one HealthCheckRequest)",
                    refusals=self._log,
                    kind=HEALTH_CHECK,
                    line=("refused %s from %s: it sent no request", HEALTH_CHECK, peer_text(context.peer())),
                )
                return None
            return await inner(request, context)

        return grpc.stream_unary_rpc_method_handler(
            check, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )

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
            f"{HEALTH_WATCH}: {self.max_watches} Watch streams are open on this server, the most it keeps "
            f"(with --max-concurrent-rpcs {self.max_calls}); close one, or call Check"
            if self.max_watches
            else f"{HEALTH_WATCH}: this server keeps no Watch streams open with --max-concurrent-rpcs "
            f"{self.max_calls} (its places are kept for learners and a probe's Check); call Check, or give "
            f"--max-concurrent-rpcs {self.max_calls + 1} or more for a Watch stream",
            refusals=self._log,
            kind=HEALTH_WATCH,
            line=(
                "refused %s from %s: %d Watch streams are open, the most this server keeps",
                HEALTH_WATCH,
                peer_text(context.peer()),
                self.max_watches,
            ),
        )

    async def _refuse_health_unread(
        self, method: str, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> None:
        self._refuse_health(method, request_iterator, context)

    def _refuse_health(
        self, method: str, request_iterator: Any, context: grpc.aio.ServicerContext, *, waiting: bool = False
    ) -> None:
        """Refuse a health call, RESOURCE_EXHAUSTED: the health calls fill their places (``waiting``:
        a Check whose request had not come, ended to make room for another)."""
        refuse(
            context,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            (
                f"{method}: this call had not sent its request, and its place went to another health call: "
                if waiting
                else f"{method}: "
            )
            + f"{self.max_health} health calls are in progress on this server, the most it serves at once (with "
            f"--max-concurrent-rpcs {self.max_calls}; the other places are kept for learners); call again",
            refusals=self._log,
            kind=method,
            line=(
                "refused %s from %s: %d health calls are in progress, the most this server serves at once%s",
                method[:_MAX_METHOD_CHARS],
                peer_text(context.peer()),
                self.max_health,
                " (it had not sent its request: ended to make room)" if waiting else "",
            ),
        )

    def _refuse_late(self, context: grpc.aio.ServicerContext) -> None:
        refuse(
            context,
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"{HEALTH_CHECK}: the request did not come within {HEALTH_REQUEST_TIMEOUT_S:g} s of the call; send it "
            "with the call",
            refusals=self._log,
            kind=HEALTH_CHECK,
            line=(
                "ended %s from %s: its request did not come within %g s",
                HEALTH_CHECK,
                peer_text(context.peer()),
                HEALTH_REQUEST_TIMEOUT_S,
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
            "RemoteVectorEnv(auth_token=...); learner train --auth-token-file or --auth-token, or "
            "ENVFLEET_AUTH_TOKEN_FILE or ENVFLEET_AUTH_TOKEN in its environment)"
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
