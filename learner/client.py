"""One env server seen from the learner: its channel, session, step stream, deadlines, and RpcError translation."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import os
import re
import select
import socket
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

from env_server.config import DEFAULT_MAX_CONCURRENT_RPCS
from env_server.protocol import (
    AUTH_METADATA_KEY,
    ENV_INDEX_KEY,
    ERROR_ORIGIN_KEY,
    ERROR_ORIGIN_SERVER,
    FRAME_ERROR,
    FRAME_HEADER,
    FRAME_STEP,
    KEEPALIVE_TIMEOUT,
    MAX_MESSAGE_BYTES,
    NOT_OWNED,
    PROTOCOL_VERSION,
    SERVICE_NAME,
    SHUTDOWN_REASON,
    STEP_SOCKET_SUFFIX,
    check_key_pair,
    grpc_target,
    unreadable_ca,
)
from env_server.rpc import env_pb2 as pb
from env_server.rpc import env_pb2_grpc as pb_grpc
from learner.discovery import UNIX_SERVER_NAME, unix_path
from learner.errors import (
    AuthenticationError,
    EnvCrashedError,
    InvalidArgumentError,
    InvalidRequestError,
    InvalidResponseError,
    RemoteEnvError,
    RemoteTimeoutError,
    ServerBusyError,
    ServerFullError,
    ServerUnavailableError,
    SessionError,
    out_of_fds,
)
from learner.local import label_of
from learner.loop import gather

__all__ = [
    "HANDSHAKE_ANSWER_WAIT_S",
    "KEEPALIVE_TIMEOUT",
    "KEEPALIVE_TIMEOUT_HINT",
    "MAX_IDLE_PINGS",
    "PROXY_SETTINGS",
    "RELEASE_TIMEOUT",
    "RESET_TIMEOUT_HINT",
    "TIMEOUT_HINT",
    "EnvClient",
    "SocketStep",
    "channel_credentials",
    "channel_options",
    "client_identity",
    "proxy_status",
    "proxy_text",
    "release_unadopted",
    "released_if_given_up",
    "releasing_unadopted",
    "request_too_large",
    "server_text",
    "shielded_handshake",
    "status_error",
    "timeout_error",
    "translate_error",
]

log = logging.getLogger(__name__)


MAX_IDLE_PINGS = 2
"""Keepalive pings a channel sends while it sends no data (a learner paused between steps, or waiting on
a step that takes long): then it stops until it sends again. A server left at gRPC's default ping
policy (C-core, as in C++ and Python servers: one ping per 5 minutes while it sends no data, 2 more
forgiven; grpc-go's EnforcementPolicy: MinTime 5 minutes) closes a connection that pings more often
(GOAWAY too_many_pings), which ends the session: with pings every 10 s and no limit, any such server
dropped a learner paused for ~30 s. envfleet's servers take pings every 5 s or more whatever the data."""


def channel_options(keepalive_timeout: float = KEEPALIVE_TIMEOUT) -> list[tuple[str, Any]]:
    """Client channel options: message limits, keepalive (``keepalive_timeout``: seconds a ping's answer
    may take), and quick reconnects."""
    keepalive_ms = min(max(1, round(keepalive_timeout * 1000)), 2**31 - 1)  # (gRPC's options are C ints)
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # Notice a dead server within ~15 s even while no call is in flight: a ping every 10 s, but at
        # most MAX_IDLE_PINGS of them while this side sends nothing (see there).
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", keepalive_ms),
        ("grpc.http2.ping_timeout_ms", keepalive_ms),  # (gRPC core's own ping-ack timeout: 60 s by default)
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", MAX_IDLE_PINGS),
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


# What gRPC's own UNIMPLEMENTED ("Method not found!", which names no service) means of a server, by
# the method it answered so. Handshake: another gRPC server on that port, or an envfleet of another
# protocol version. GetSpec alone says less: those, or an envfleet.v1 server (one written from the
# proto, say) that lacks GetSpec. Step: it served Handshake and Reset, so it speaks envfleet.v1 but
# has no StepStream (envfleet's first versions stepped by unary calls; a server written from the proto
# may leave it out); every step of it would fail alike.
_UNIMPLEMENTED_MEANS: dict[str, str] = {
    "Handshake": (
        f"it answers gRPC but serves no {SERVICE_NAME}: the wrong port, or a server of another envfleet "
        "protocol version"
    ),
    "GetSpec": (
        "it answers gRPC but not GetSpec: the wrong port, a server of another envfleet protocol version, or an "
        f"{SERVICE_NAME} server without GetSpec"
    ),
    "Step": (
        "it serves no StepStream, which this learner steps on: an envfleet.v1 server must serve it for the "
        "Python learner (envfleet's own first versions did not: upgrade those)"
    ),
}

_CODE_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}

SERVER_TEXT_LIMIT = 1_000
"""The most characters of one server-sent text the learner shows (see :func:`server_text`)."""

# Characters a terminal acts on rather than shows: C0 and C1 controls (ESC starts ANSI sequences, C1's
# CSI too), DEL, line and paragraph separators, and the bidirectional overrides and isolates, which
# reorder what follows them on screen.
_UNSHOWABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def server_text(text: str) -> str:
    """``text`` a server sent (a status's details, a HoldEvent's reason, a step socket's StepError
    message) as the learner shows it: its control characters escaped as Python writes them (``\\x1b``,
    ``\\x00``, ``\\n``), so that no server can clear, recolour or rewrite a terminal or forge log
    lines, and at most :data:`SERVER_TEXT_LIMIT` characters, then how many more there were (training
    repeats an error in every warning). The one place server-sent text is cleaned: texts the learner
    compares (NOT_OWNED, SHUTTING_DOWN_MESSAGE, SHUTDOWN_REASON) are compared on the raw text."""
    if len(text) <= SERVER_TEXT_LIMIT and _UNSHOWABLE.search(text) is None:
        return text
    shown: list[str] = []
    size = 0
    for i, char in enumerate(text):
        piece = char.encode("unicode_escape").decode("ascii") if _UNSHOWABLE.match(char) else char
        if size + len(piece) > SERVER_TEXT_LIMIT:
            return "".join(shown) + f"... ({len(text) - i:,} more characters)"
        shown.append(piece)
        size += len(piece)
    return "".join(shown)


def status_text(details: str) -> str:
    """A status's ``details`` as the learner shows them: through :func:`server_text`, and "no details"
    for none (never the call's repr, which is what str() of a call without details gives)."""
    return server_text(details) if details else "no details"


_FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]


RELEASE_TIMEOUT = 2.0
"""Seconds a release of the session on closing waits at most (see :meth:`EnvClient.release`)."""

_NO_ANSWER = "a slow env, or a server or a network that stalled"
"""What a deadline that passed may mean: the advice that follows is for the first."""
TIMEOUT_HINT = "raise `timeout` if the env is slow"
"""The advice a deadline that passed comes with, naming RemoteVectorEnv's argument (``learner train``
and ``learner eval`` name their options instead: ``learner.cli`` rewords these hints where it prints)."""
RESET_TIMEOUT_HINT = "raise `reset_timeout` if the env is slow to reset"
"""The same for a Reset's deadline."""
KEEPALIVE_TIMEOUT_HINT = f"raise `keepalive_timeout`, --keepalive-timeout, {KEEPALIVE_TIMEOUT:g} s by default"
"""The advice a keepalive ping that got no answer in time comes with (the argument and the commands'
option: the commands say only the option)."""
STEP_WAIT_TIMEOUT_HINT = "the deadline was step_wait's timeout argument: pass a longer one if the env is slow"
"""The same for a deadline the caller gave ``step_wait``."""
RESET_WAIT_TIMEOUT_HINT = "the deadline was reset_wait's timeout argument: pass a longer one if the env is slow"
"""The same for a deadline the caller gave ``reset_wait``."""

# gRPC's own status for a request over a limit on messages, the receiving server's ("SERVER:
# Received", or without the prefix from a server whose gRPC is older) or this client's ("CLIENT:
# Sent"). (Its others, "SERVER: Sent" and "CLIENT: Received", are about an answer.)
_TOO_LARGE = re.compile(r"(?:(SERVER|CLIENT): )?(Received|Sent) message larger than max \((\d+) vs\. (\d+)\)")

# gRPC's own text for an answer whose HTTP status was not 200: an HTTP proxy's, between the learner and
# the server (a gRPC server answers 200, its errors in the gRPC status).
_HTTP_STATUS = re.compile(r"Received http2 header with status: (\d+)")
# A GOAWAY for pinging too often, as gRPC C-core words it ("Too many pings") or quotes the peer's debug
# data (grpc-go's "too_many_pings").
_TOO_MANY_PINGS = re.compile(r"too[ _]many[ _]pings", re.IGNORECASE)

PROXY_SETTINGS = (
    "nginx: client_max_body_size 0 and grpc_read_timeout 1d; haproxy: timeout server 1d; see the README's "
    "'Behind an HTTP proxy'"
)
"""What a proxy in front of env servers needs (its defaults end StepStream and Hold, long-lived streams)."""


def proxy_status(details: str) -> int | None:
    """The HTTP status a proxy answered a call with, as gRPC's own status ``details`` say, or None."""
    found = _HTTP_STATUS.search(details)
    return int(found.group(1)) if found else None


def proxy_text(status: int, reached: bool = False) -> str:
    """What an HTTP ``status`` from a proxy between the learner and an env server means; ``reached``: the
    proxy had reached the server before (a session's Handshake went through it), so it is set up right."""
    said = f"an HTTP proxy between the learner and the env server answered HTTP {status}"
    if status in (502, 503) and reached:
        return f"{said}: nothing behind it answers any more (the env server behind it stopped, restarted or moved)"
    if status in (502, 503):
        return (
            f"{said}: nothing behind it answers (the env server is down or not started, or the proxy's upstream is "
            "not it, or the proxy speaks HTTP/1 to it: nginx needs grpc_pass, not proxy_pass; haproxy, proto h2 on "
            "the server line; Caddy, reverse_proxy h2c://HOST:PORT)"
        )
    if status == 504:
        return f"{said}: it gave up waiting on the env server (its timeout on a call's answer: {PROXY_SETTINGS})"
    return f"{said}, not the env server ({PROXY_SETTINGS})"


# Servers whose Handshake said they check no token while this process sent one (warned once each).
_UNCHECKED_TOKEN_WARNED: set[str] = set()
# Servers whose step socket this process could not use (warned once each; a new session tries again).
_STEP_SOCKET_WARNED: set[str] = set()
# Servers whose Hold stream did not hold (warned once each), and those whose spec has no server_id.
_HOLD_WARNED: set[str] = set()
_NO_SERVER_ID_WARNED: set[str] = set()
# Servers whose session an HTTP proxy ended by ending its Hold stream (warned once each).
_PROXY_END_WARNED: set[str] = set()
# Addresses whose calls reached more than one server (warned once each).
_OTHER_SERVER_WARNED: set[str] = set()

OTHER_SERVER_S = 2.0
"""Seconds after a Handshake within which a Hold sent, then refused as another server's session, says the
address reaches several servers (see ``EnvClient._note_other_server``); sent later, the session may have
ended first. Also how long after the Hold a Release must go out for the refusal not to be the Release's."""

SPREAD_PROBES = 8
"""GetSpec calls a Handshake's session is checked with, one after another, for an address whose calls reach
several servers (see ``EnvClient._refuse_spread_calls``): an address that spreads calls over two servers at
random goes unnoticed where all of them reach one server, twice in 256 sessions (the other server: taken for
a restart); one that takes turns, never."""


def spread_calls_text(server_ids: Sequence[str]) -> str:
    """What an address whose calls reached the servers ``server_ids`` (more than one) is told: a learner's
    session lives on one server."""
    return (
        f"its calls reached {len(server_ids)} different env servers (server ids "
        f"{', '.join(server_text(i) for i in server_ids)}): a proxy or load balancer spreading calls over them? A "
        "learner's session is one server's: give each server its own address (or balance connections, not calls)"
    )


def _warning_once(warned: set[str], address: str) -> Callable[..., None]:
    """The log call for a condition of server ``address`` that can come again (each session): WARNING
    the first time (``warned`` holds the servers already warned of), DEBUG after."""
    first = address not in warned
    warned.add(address)
    return log.warning if first else log.debug


def translate_error(
    err: grpc.RpcError,
    *,
    address: str,
    method: str,
    env_offset: int = 0,
    timeout: float | None = None,
    hint: str | None = None,
) -> RemoteEnvError:
    """The envfleet exception for a failed call (the one place RpcError is translated); ``hint``: what
    a deadline that passed advises (None: raising the env's timeout for the method)."""
    # Failed calls of the sync API are grpc.Call objects; those of grpc.aio are AioRpcError. Both
    # carry code(), details() and trailing_metadata().
    is_call = isinstance(err, grpc.Call | grpc.aio.AioRpcError)
    code = err.code() if is_call else None
    # (a call's empty details are "no details", never the call's repr: status_error says so)
    details = (err.details() or "") if is_call else str(err)
    env_index: int | None = None
    from_server = False
    if is_call:
        for key, value in err.trailing_metadata() or ():
            if key == ENV_INDEX_KEY:
                with contextlib.suppress(ValueError):
                    env_index = env_offset + int(value)
            elif key == ERROR_ORIGIN_KEY:
                from_server = value == ERROR_ORIGIN_SERVER
    return status_error(
        code,
        details,
        address=address,
        method=method,
        env_index=env_index,
        from_server=from_server,
        timeout=timeout,
        hint=hint,
    )


def _core_internal(err: grpc.RpcError) -> bool:
    """Whether ``err`` is gRPC's own INTERNAL (a write on a call that ended meanwhile: "Internal error
    from Core"), not an INTERNAL the env server sent (an env that crashed, a dead server: those carry
    the server's origin mark)."""
    if not isinstance(err, grpc.aio.AioRpcError) or err.code() != grpc.StatusCode.INTERNAL:
        return False
    return not any(
        key == ERROR_ORIGIN_KEY and value == ERROR_ORIGIN_SERVER for key, value in err.trailing_metadata() or ()
    )


def _cut_short(err: grpc.RpcError) -> bool:
    """Whether ``err`` is gRPC's UNKNOWN for a response that ended without its status (no trailers): an HTTP proxy
    whose connection to the server broke (nginx, when the server behind it was killed), not the server's word."""
    return (
        isinstance(err, grpc.aio.AioRpcError)
        and err.code() == grpc.StatusCode.UNKNOWN
        and "END_STREAM flag received" in (err.details() or "")
    )


_PROBE_S = 0.5
"""How long :meth:`EnvClient._refusal_of_new_streams` waits for a new stream's refusal,
:meth:`_Statuses.before_write` for the status of a stream a write found ended, and
:meth:`EnvClient.release` for the Hold stream's end after the Release (a server sends its HoldEvent then)."""

# How a Hold stream's end says its session is over, besides a HoldEvent: the session is not live
# (FAILED_PRECONDITION), the server is going or the connection was lost (UNAVAILABLE, CANCELLED), a
# deadline (none is set: gRPC's own). (gRPC's own INTERNAL, a connection that broke, too: _core_internal.)
_HOLD_ENDS_SESSION = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)

Status = tuple[grpc.StatusCode, str, tuple[tuple[str, Any], ...]]
"""A call's status: code, details, trailing metadata."""


class _Statuses:
    """The statuses a StepStream call is given: a done callback of the call, and what it has now.

    A write on a stream the server has ended (answered, then closed: gRPC core has its status, this
    loop may not have taken it in yet) fails with gRPC's own INTERNAL "Internal error from Core", and
    grpc.aio makes that the call's status, over the server's (set a moment before, as the write
    waited: only a done callback saw it) or before it (the server's replaces it a few turns of the
    loop later). The status the server sent is the one that is not the write's. (grpc.aio hands a
    status to callers only through coroutines; the callback reads the one just set from the call's core
    object, ``_cython_call._status``: where a grpc.aio keeps it elsewhere, the callback sees none.)
    """

    def __init__(self) -> None:
        self.seen: list[Status] = []

    def __call__(self, call: Any) -> None:
        status = getattr(getattr(call, "_cython_call", None), "_status", None)
        try:
            code = _CODE_BY_NUMBER.get(status.code(), grpc.StatusCode.UNKNOWN)  # type: ignore[union-attr]
            seen = (code, status.details() or "", tuple(status.trailing_metadata() or ()))  # type: ignore[union-attr]
        except AttributeError:
            return
        self.seen.append(seen)

    async def before_write(self, call: Any) -> Status | None:
        """The status the server ended ``call`` with, for a write on it that just failed with gRPC's own
        INTERNAL: one seen that is not the write's, or the call's own once the server's replaced the
        write's, within :data:`_PROBE_S` (the server's status is in already: a few turns of the loop);
        None if none comes."""
        deadline = time.monotonic() + _PROBE_S
        while True:
            now: Status = (await call.code(), await call.details() or "", tuple(await call.trailing_metadata()))
            status = next((s for s in (*self.seen, now) if not _writes_own(s)), None)
            if status is not None or time.monotonic() >= deadline:
                return status
            await asyncio.sleep(0.01)


CORE_INTERNAL_DETAILS = "Internal error from Core"
"""The details of the status grpc.aio gives a call whose write failed in gRPC core (the call had ended)."""


def _writes_own(status: Status) -> bool:
    """Whether ``status`` is the one grpc.aio gives a call whose write failed (not a peer's: no trailers)."""
    code, details, trailers = status
    return code == grpc.StatusCode.INTERNAL and details == CORE_INTERNAL_DETAILS and not trailers


CALL_LIMIT_DETAILS = "Concurrent RPC limit exceeded!"
"""What gRPC's core says of a call it refused because the server serves its most calls at once
(``maximum_concurrent_rpcs``: env-server --max-concurrent-rpcs)."""


def status_error(
    code: grpc.StatusCode | None,
    details: str,
    *,
    address: str,
    method: str,
    env_index: int | None = None,
    from_server: bool = True,
    timeout: float | None = None,
    hint: str | None = None,
    stream_ended: bool = False,
) -> RemoteEnvError:
    """The envfleet exception for a status (``code``, ``details``) a call ended with (the one place
    statuses become errors); ``env_index`` is over the whole fleet, ``from_server`` whether the env
    server itself sent the status; ``hint``: see :func:`translate_error`; ``stream_ended``: the status
    is that of a stream the server had closed before ``method``'s exchange on it (whatever the code,
    the server is lost: ServerUnavailableError). ``details`` are the server's raw text: compared raw,
    shown through :func:`server_text` (empty ones as "no details"), and kept raw as the error's
    ``details``."""
    raw = details
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not from_server:
        too_large = _TOO_LARGE.fullmatch(details)
        if too_large is not None:
            side, direction, size, limit = too_large.groups()
            if direction == "Received" and side != "CLIENT":
                return request_too_large(address, method, int(size), int(limit), read=True)
            if direction == "Sent" and side == "CLIENT":
                return InvalidRequestError(
                    f"env server {label_of(address)}: {method} failed [RESOURCE_EXHAUSTED]: the request is {size} bytes, over "
                    f"this client's limit of {limit} bytes on messages; nothing was sent",
                    address=address,
                    code=code,
                )
            # "SERVER: Sent" or "CLIENT: Received": the answer (an oversized answer is no busy server)
            return InvalidResponseError(
                f"env server {label_of(address)}: {method} failed [RESOURCE_EXHAUSTED]: its answer is {size} bytes, over the "
                f"limit of {limit} bytes on messages; serve fewer envs per server (env-server --num-envs) or "
                "smaller observations",
                address=address,
                code=code,
            )
        if details == CALL_LIMIT_DETAILS:
            return ServerFullError(
                f"env server {label_of(address)}: {method} failed [RESOURCE_EXHAUSTED]: the server is serving as many calls as "
                f"it takes at once (env-server --max-concurrent-rpcs, {DEFAULT_MAX_CONCURRENT_RPCS} by default; a "
                "learner holds 2-3), so some other client holds them: many learners or probes at one server, or a "
                "flood; its log says when it refuses calls. Try again once they end, or raise the limit where the "
                "server is started",
                address=address,
                code=code,
            )
    cls = _CODE_TO_ERROR.get(code, RemoteEnvError) if code is not None else RemoteEnvError
    shown = status_text(raw)
    details = shown
    if stream_ended and code == grpc.StatusCode.OK:
        # (a stream ended with OK before its request was answered: envfleet's servers end a stream so only
        # once the learner half-closes it, which it never does; a server written from the proto may)
        cls = ServerUnavailableError
        details = (
            "the server ended its StepStream (status OK) without answering this step; a server must answer every "
            "StepRequest on the stream, in order" + (f" ({shown})" if raw else "")
        )
    elif stream_ended:
        cls = ServerUnavailableError
        details = f"the step stream ended ({shown})"
    elif code == grpc.StatusCode.UNIMPLEMENTED and method in _UNIMPLEMENTED_MEANS:
        details = f"{_UNIMPLEMENTED_MEANS[method]} ({shown})"
    elif code == grpc.StatusCode.INTERNAL and not from_server:
        # gRPC itself ended the call (e.g. "Internal error from Core" when the server died mid-stream):
        # the connection broke, the env did not raise.
        cls = ServerUnavailableError
        details = f"the connection broke ({shown})"
    if (
        code == grpc.StatusCode.UNAVAILABLE
        and not from_server
        and ("ping timeout" in raw or "keepalive watchdog timeout" in raw)
    ):
        details += (
            ": the server did not answer a keepalive ping in time: it stopped, or its host is cut off, or "
            "the link is so slow or busy that an answer takes longer to cross (big observations on a slow "
            f"link: {KEEPALIVE_TIMEOUT_HINT}, or have the servers compress their answers, env-server --compression "
            "gzip)"
        )
    # (gRPC's own texts, not an env server's: whether a status was marked as the server's is not known
    # everywhere here, stream_ended's among them; an env's exception, INTERNAL from the server, is left be)
    env_raised = from_server and code == grpc.StatusCode.INTERNAL
    status = None if env_raised else proxy_status(raw)
    if status is not None:
        details += f": {proxy_text(status)}"
    elif "RST_STREAM" in raw and not env_raised:  # (no envfleet server resets one)
        details += (
            "; where an HTTP proxy stands between the learner and the server, the server behind it may have gone "
            "(Caddy ends the stream so when its server dies), or the proxy reset it: StepStream's requests count as "
            f"one long request body, and Hold's answer never ends ({PROXY_SETTINGS}); or the server ended the "
            "stream with an error the proxy did not pass on (haproxy 2.6 does so, haproxy#1219): "
            "`learner servers ADDRESS`, or the server's log, tells"
        )
    if code == grpc.StatusCode.UNAVAILABLE and _TOO_MANY_PINGS.search(raw):  # (gRPC's own, after a GOAWAY)
        details += (
            ": the server closed the connection for the learner's keepalive pings (GOAWAY too_many_pings), as "
            f"servers do whose ping policy allows fewer: the learner pings every 10 s, {MAX_IDLE_PINGS} times at most "
            "while it sends nothing; have the server take them (gRPC C-core, as in C++: "
            "grpc.http2.min_recv_ping_interval_without_data_ms <= 10000; grpc-go: keepalive.EnforcementPolicy with "
            "MinTime <= 10 s)"
        )
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None:
        hint = hint or (RESET_TIMEOUT_HINT if method == "Reset" else TIMEOUT_HINT)
        details = f"no answer within the {timeout:g} s deadline ({details}: {_NO_ANSWER}); {hint}"
    prefix = f"env server {label_of(address)}: {method}"
    if env_index is not None:
        prefix += f" (env {env_index} of the fleet)"
    name = code.name if code is not None else "error"
    return cls(f"{prefix} failed [{name}]: {details}", address=address, code=code, env_index=env_index, details=raw)


def request_too_large(address: str, method: str, size: int, limit: int, *, read: bool = False) -> InvalidRequestError:
    """The error for a request of ``size`` bytes, over the server's ``limit`` on requests: refused by
    the server unread (``read``), or by the client before sending (the code the server would send)."""
    if limit < MAX_MESSAGE_BYTES:
        hint = "the server's env-server --max-request-bytes, or ENVFLEET_MAX_REQUEST_BYTES, raises the limit"
    elif method == "Step":  # (64 MiB: older servers' fixed limit, and the most the option allows)
        hint = (
            "no env server reads more: a Step carries the actions of every env of the server; serve fewer envs per "
            "server (env-server --num-envs), on more servers"
        )
    elif method == "Reset":
        hint = "no env server reads more: pass smaller reset options (every server is sent them whole)"
    else:
        hint = "no env server reads more: send less per request"
    return InvalidRequestError(
        f"env server {label_of(address)}: {method} failed [RESOURCE_EXHAUSTED]: the request is {size} bytes, over the "
        f"server's limit of {limit} bytes on requests; {'the server read none of it' if read else 'nothing was sent'} "
        f"({hint})",
        address=address,
        code=grpc.StatusCode.RESOURCE_EXHAUSTED,
    )


def timeout_error(*, address: str, method: str, timeout: float, hint: str = TIMEOUT_HINT) -> RemoteTimeoutError:
    """The error for a message on a stream that got no answer within ``timeout`` seconds."""
    return RemoteTimeoutError(
        f"env server {label_of(address)}: {method} failed [DEADLINE_EXCEEDED]: no answer within the {timeout:g} s "
        f"deadline ({_NO_ANSWER}); {hint}",
        address=address,
        code=grpc.StatusCode.DEADLINE_EXCEEDED,
    )


class EnvClient:
    """One connection to one env server, holding its session once :meth:`handshake` succeeds.

    Built on ``grpc.aio``: create it and await its methods inside the one event loop that owns it
    (``RemoteVectorEnv`` runs them on its thread's :class:`~learner.loop.LoopRunner`, a loop shared by
    every RemoteVectorEnv of that thread). ``env_offset``, the index over the fleet of its server's
    first env (which errors name envs by), is set by the fleet once the layout is known.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout: float,
        reset_timeout: float | None = None,
        client_name: str | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        credentials: grpc.ChannelCredentials | None = None,
        tls_server_name: str | None = None,
        step_socket: bool = True,
        spin_wait: float = 0.0,
        keepalive_timeout: float = KEEPALIVE_TIMEOUT,
    ) -> None:
        self.address = address
        self.timeout = timeout
        self.reset_timeout = timeout if reset_timeout is None else reset_timeout  # (a Reset's deadline)
        self.env_offset = 0
        self.client_name = client_name or f"{socket.gethostname()}:{os.getpid()}"
        self.metadata = tuple(metadata)
        # The largest request the server reads, as its Handshake says; until then, or from a server
        # that does not say, the limit older servers had (this client's own too).
        self.max_request_bytes = MAX_MESSAGE_BYTES
        options = channel_options(keepalive_timeout)
        if credentials is not None and not tls_server_name and unix_path(address) is not None:
            tls_server_name = UNIX_SERVER_NAME  # (gRPC's default: the socket's path, in no certificate)
        if tls_server_name:
            # The name the server's certificate must hold, when it is not the host in the address
            # (servers reached by IP, or through a compose/Kubernetes name the certificate lacks).
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(grpc_target(address), options=options)
        else:
            self.channel = grpc.aio.secure_channel(grpc_target(address), credentials, options=options)
        self.stub = pb_grpc.EnvServiceStub(self.channel)
        self.session_id = ""
        self.rejoins_session_id = ""
        """The session of this client's that its next Handshake says it continues (HandshakeRequest's
        rejoins_session_id: the server keeps the envs' state, --fresh-envs no rebuild): set by the reconnect
        paths (learner.faults.reconnect, RemoteVectorEnv's) to the session it held on that server process,
        "" for a new learner; cleared once a session starts."""
        self.spec: pb.EnvSpec | None = None
        self.claim_timeout_s = 0.0  # (the session's, as its Handshake said; 0: not said)
        self._hold: Any = None
        self._hold_watch: asyncio.Task[None] | None = None  # (reads the Hold stream's end: _watch_hold)
        self._hold_ended = False  # the Hold stream's end said the session is over
        # When the session's Release went out (time.monotonic()), or None: its Hold stream, should the server
        # take it in only then, is answered that the session is not the server's, which says nothing of the
        # address (see _note_other_server)
        self._released_at: float | None = None
        self._session_since = 0.0  # when the session's Hold stream opened (time.monotonic())
        self._hold_reason: str | None = None  # the HoldEvent's reason, raw, once one came
        self._disowned = False  # a call was answered that the session does not own the server
        self._step_statuses: _Statuses | None = None  # (those of the open StepStream)
        self._steps: Any = None  # the open StepStream call, or None
        # The step_id of the last request made (step_request): the one in flight, whose answer must
        # carry it (servers return it; 0 from those older than the field, which cannot be checked).
        self.step_id = 0
        self._out_of_step = False  # an answer was to another request: open a new StepStream (out_of_step)
        self.writing = False  # a step's request not yet handed to gRPC (its stream still opening)
        # Steps go over the server's step socket (see the proto) when it has one and we reached it
        # over its Unix socket (so we are on its host): the path, and the open connection or None.
        # The path is the one beside the socket we reached it at, as the server makes its own: the
        # path it names is in its file system, which need not be ours (a container's socket folder,
        # mounted elsewhere here), and may name another server's step socket here.
        path = (unix_path(address) or "") if step_socket else ""
        if path and not os.path.isabs(path):
            path = os.path.join(os.getcwd(), path)  # (as gRPC reads it now; not normalised: a/../ after a symlink)
        self._step_socket_here = path + STEP_SOCKET_SUFFIX if path else ""
        self.step_socket = ""
        self._socket: socket.socket | None = None
        # The connection's answers are read into this one buffer, sized to each in turn (see
        # SocketStep._read): a new one per answer took fresh pages at every step (~200 for an 800 KB
        # answer, which glibc gave back to the system after the step), which made large answers slower
        # here than over gRPC. Nothing handed out shares it: protobuf copies what it parses.
        self._socket_buffer = bytearray()
        # Why the step socket refused this session's first step on a connection as not its own (see
        # not_my_step_socket), until that step's resend over gRPC says whose socket it is; "" otherwise.
        self._unknown_to_socket = ""
        # Waiting for a step-socket answer: keep checking for it (yielding the CPU between looks)
        # for up to this many seconds while this server's recent answers came within that time,
        # before sleeping until it comes. Waking a sleeping process costs tens of microseconds,
        # about as much as a quick env's whole step. 0: always sleep.
        self.spin_wait = spin_wait
        self.recent_rtt = 0.0  # moving average of step-socket round trips, seconds

    def _error(
        self, err: grpc.RpcError, method: str, timeout: float | None = None, hint: str | None = None
    ) -> RemoteEnvError:
        if (
            isinstance(err, grpc.aio.AioRpcError)
            and err.code() == grpc.StatusCode.FAILED_PRECONDITION
            and NOT_OWNED in (err.details() or "")
        ):
            # The server says the session is over: whatever its Hold stream said (one that does not hold
            # leaves the session to be kept: see _watch_hold), a new session is needed.
            self._disowned = True
        if (
            isinstance(err, grpc.aio.AioRpcError)
            and err.code() == grpc.StatusCode.UNIMPLEMENTED
            and method in _UNIMPLEMENTED_MEANS
        ):
            # gRPC's own answer for a method the server lacks, whose trailers say nothing of envfleet's
            # (and whose empty details are "no details", not the call's repr, as translate_error has it)
            return status_error(err.code(), err.details() or "", address=self.address, method=method)
        return translate_error(
            err,
            address=self.address,
            method=method,
            env_offset=self.env_offset,
            timeout=timeout or self.timeout,
            hint=hint,
        )

    @property
    def num_envs(self) -> int:
        """Envs this server hosts (K); 0 before the handshake."""
        return int(self.spec.num_envs) if self.spec is not None else 0

    # -- connection ---------------------------------------------------------------------------

    async def wait_ready(self) -> None:
        """Return once the channel is connected (the caller bounds the wait)."""
        await self.channel.channel_ready()

    async def handshake(self, timeout: float | None = None, hint: str | None = None) -> pb.HandshakeResponse:
        """The server's answer to a Handshake; InvalidResponseError for one without a session_id (no
        call could name the session: a new Handshake would get the same). ``timeout``: its deadline (None:
        the client's); ``hint``: what an error for a deadline that passed advises (see translate_error)."""
        request = pb.HandshakeRequest(
            protocol_version=PROTOCOL_VERSION,
            client_name=self.client_name,
            rejoins_session_id=self.rejoins_session_id,
            accepts_compact_bounds=True,  # (codec.decode_space reads both forms: older servers send full ones)
        )
        timeout = self.timeout if timeout is None else timeout
        try:
            response = await self.stub.Handshake(request, timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            raise self._error(err, "Handshake", timeout, hint) from None
        if not response.session_id:
            raise InvalidResponseError(
                f"env server {label_of(self.address)}: Handshake's answer has an empty session_id; expected the id of the "
                "session it opened, which every later call carries: the server does not follow envfleet.v1",
                address=self.address,
            )
        if not response.spec.server_id:
            # (nor can its calls be told to reach other servers: no probes, at any of its sessions)
            if self.address not in _NO_SERVER_ID_WARNED:
                _NO_SERVER_ID_WARNED.add(self.address)
                log.warning(
                    "env server %s answers no server_id (its spec's is empty): a restart of it cannot be told "
                    "from the same process, so after a lost connection the learner takes it for the same one",
                    label_of(self.address),
                )
        else:
            await self._refuse_spread_calls(response, timeout)
        return response

    async def _refuse_spread_calls(self, response: pb.HandshakeResponse, timeout: float) -> None:
        """RemoteEnvError if calls to this address reach other servers than the one whose Handshake granted
        ``response``'s session (a proxy or load balancer spreading calls over several: every later call of the
        session may reach one that does not hold it). :data:`SPREAD_PROBES` GetSpecs tell: their servers' ids.
        One after another: sent at once, some were refused by a server of a small --max-concurrent-rpcs (counted
        in its envfleet_errors_total at most sessions). Each asks for the server's id alone (a full spec from a
        server older than compact bounds carries the Box bounds at full shape: 8 of a 1080x1920 camera's took
        ~0.25 s a server on one host), and for compact bounds too, as every spec request of the learner. The
        session is let go of (Releases at once, of which the server holding it may get one; else it ends after
        its claim timeout). Round trips at the start of each session (~0.3 ms each on one host); none more after
        one that fails (the session's own calls will tell)."""
        own = response.spec.server_id
        reached: set[str] = set()
        for _ in range(SPREAD_PROBES):
            try:
                probe = await self.stub.GetSpec(
                    pb.GetSpecRequest(server_id_only=True, accepts_compact_bounds=True),
                    timeout=timeout,
                    metadata=self.metadata,
                )
            except grpc.RpcError:
                break  # (not waited for again: a server too busy for it, or one that hangs)
            if probe.spec.server_id:
                reached.add(probe.spec.server_id)
            if len(reached) > 1:
                break  # (two others, or its own and another: spread)
        # (all its own; or all one other: the server restarted right after the Handshake, as a reconnect finds out)
        if not reached - {own} or (own not in reached and len(reached) == 1):
            return
        await asyncio.gather(
            *(self.release_session(response.session_id, min(timeout, RELEASE_TIMEOUT)) for _ in range(SPREAD_PROBES)),
            return_exceptions=True,
        )
        raise RemoteEnvError(
            f"env server {label_of(self.address)}: {spread_calls_text(sorted(reached | {own}))}",
            address=self.address,
        )

    def start_session(self, response: pb.HandshakeResponse) -> None:
        """Adopt the session a Handshake returned and open its Hold stream (which keeps the claim). On
        the client's event loop: a task of it watches the Hold stream (:meth:`_watch_hold`)."""
        self.session_id, self.rejoins_session_id = response.session_id, ""
        self.spec = response.spec
        self.claim_timeout_s = response.claim_timeout_s
        self.step_socket = self._adopt_step_socket(response.step_socket)
        self._unknown_to_socket = ""
        self.max_request_bytes = response.max_request_bytes or MAX_MESSAGE_BYTES
        if response.HasField("checks_token") and not response.checks_token:
            self._note_unchecked_token(response.client_certificates_required)
        self._hold_ended, self._hold_reason, self._disowned, self._released_at = False, None, False, None
        self._session_since = time.monotonic()
        self._hold = self.stub.Hold(pb.HoldRequest(session_id=self.session_id), metadata=self.metadata)
        self._hold_watch = asyncio.get_running_loop().create_task(self._watch_hold(self._hold))

    async def _watch_hold(self, hold: Any) -> None:
        """Wait for the end of the Hold stream ``hold`` and take in what it says of the session.

        The session is over when the stream says so, as the proto has it: a HoldEvent (its reason kept
        for :meth:`ended_by_shutdown`), or FAILED_PRECONDITION (the session is not live); or when it
        lost its connection or the server is going (UNAVAILABLE, CANCELLED, DEADLINE_EXCEEDED, gRPC's
        own INTERNAL, an answer cut short: :func:`_cut_short`). Any other end comes from a server that
        does not hold sessions this way: gRPC's UNIMPLEMENTED (it has no Hold), OK without a HoldEvent,
        another error. Its Handshake has just granted the session, so the session is kept (taking it for
        over would make a new one at every reset, and refuse partial resets), with a warning, once per
        server; a call the server then answers that the session does not own it ends the session
        (``_disowned``)."""
        # (the Hold's request went out in this turn of the loop: its call's task, made first, ran just before)
        sent = time.monotonic()
        try:
            event = await hold.read()
        except asyncio.CancelledError:
            return  # (cancelled here: the session was let go of, or abandoned)
        except grpc.aio.AioRpcError as err:
            code, details = err.code(), err.details() or ""
            if code in _HOLD_ENDS_SESSION or _core_internal(err) or _cut_short(err):
                if hold is self._hold:
                    self._hold_ended = True
                    self._note_proxy_end(details)
                    if code == grpc.StatusCode.FAILED_PRECONDITION and NOT_OWNED in details:
                        self._note_other_server(sent)
                return
            if code == grpc.StatusCode.UNIMPLEMENTED:
                did = "answered UNIMPLEMENTED (it serves no Hold)"
            elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                # (a server at its limit of calls at once: an env-server's --max-concurrent-rpcs; no fault of its protocol)
                did = (
                    f"was refused [RESOURCE_EXHAUSTED] ({status_text(details)}): the server was serving as many calls "
                    "as it takes at once (an env-server's --max-concurrent-rpcs)"
                )
            else:
                did = f"ended with [{code.name}] ({status_text(details)})"
        else:
            if event is not grpc.aio.EOF:
                if hold is self._hold:
                    self._hold_reason, self._hold_ended = event.reason, True
                return
            did = "ended (status OK) without a HoldEvent, which a server sends before it ends the stream"
        # (not once the Release went out: the stream may have ended for it, and the session is let go of anyway)
        if hold is not self._hold or self.address in _HOLD_WARNED or self._released_at is not None:
            return
        _HOLD_WARNED.add(self.address)
        claim = f"{self.claim_timeout_s:g} s" if self.claim_timeout_s > 0 else "a time it did not say"
        log.warning(
            "env server %s: its Hold stream %s: without Hold, the server keeps this learner's claim only while "
            "calls come within its claim timeout (HandshakeResponse.claim_timeout_s: %s); a longer pause between "
            "calls may lose the session, and the next call then says so. The session is kept meanwhile",
            label_of(self.address),
            did,
            claim,
        )

    def _note_other_server(self, sent: float) -> None:
        """Warn if the Hold stream, sent at ``sent`` right after the Handshake that opened the session (within
        :data:`OTHER_SERVER_S`), was refused as not the server's session: the address's calls reach more than
        one server, each call another (a proxy or load balancer spreading one address over several servers);
        the session then fails at every call, "does not own this server", whatever the learner does.

        Judged by when the Hold went out, not by when its refusal was read: this thread's event loop runs
        only during the learner's calls (learner.loop), so the refusal, in one round trip after the
        Handshake, is read with the next call, however long after (a model built before the first reset, a
        loaded machine), or by close(). Not where the Release went out within OTHER_SERVER_S of the Hold:
        the server may have taken the Release in first (a close right after connecting)."""
        if sent - self._session_since > OTHER_SERVER_S:
            return  # (sent late, the loop not run meanwhile: the session's claim may have timed out first)
        if self._released_at is not None and self._released_at - sent < OTHER_SERVER_S:
            return
        _warning_once(_OTHER_SERVER_WARNED, self.address)(
            "env server %s: the Hold stream of the session its Handshake had just granted was refused, that session "
            "not the server's: calls to %s seem to reach more than one env server (a proxy or load balancer that "
            "spreads one address over several). A session lives on one server: give each server its own address, "
            "or use a dns:/// name that resolves to every server's",
            label_of(self.address),
            self.address,
        )

    def _note_proxy_end(self, details: str) -> None:
        """Warn if an HTTP proxy ended the session's Hold stream (``details``: its status's): with no
        message on it while the session lives, a proxy's timeout on answers ends it, and the session
        with it, every so many seconds (nginx's default grpc_read_timeout: 60 s); the learner then
        finds the session gone at its next call."""
        status = proxy_status(details)
        if status is None:
            return
        # (502 or 503: the server behind the proxy went away, no setting of the proxy's)
        keep_open = (
            "" if status in (502, 503) else ": a proxy in front of env servers must leave long-lived streams open"
        )
        # (at WARNING once per server: a proxy's timeout repeats)
        _warning_once(_PROXY_END_WARNED, self.address)(
            "env server %s: its Hold stream, which keeps this learner's session, ended %.0f s after it opened: %s. "
            "The session is over (the server freed its envs), and the next call says so%s",
            label_of(self.address),
            time.monotonic() - self._session_since,
            proxy_text(status, reached=True),  # (the session's Handshake went through it)
            keep_open,
        )

    def _adopt_step_socket(self, offered: str) -> str:
        """The path to step on for a server that offers a step socket at ``offered`` (its path, in the
        server's file system), or "" when it offers none or this client does not step on one."""
        if not offered or not self._step_socket_here:
            return ""
        if offered != self._step_socket_here:
            log.debug(
                "env server %s names its step socket %s; stepping on %s, beside the Unix socket it was reached at",
                label_of(self.address),
                offered,
                self._step_socket_here,
            )
        return self._step_socket_here

    def _note_unchecked_token(self, client_certificates_required: bool) -> None:
        """The server checks no token: warn (once per server) if this client sends one, whose user
        may believe the server protected.

        Not where the server requires client certificates (``client_certificates_required``, from its
        Handshake; older servers do not say, and are warned about): then it is protected, and only
        holders of a certificate its CA signed get this far. The token would be a second secret, worth
        having where that CA signs certificates for more than these learners, but its absence exposes
        nothing a warning should sound for: a note (INFO) says the server does not check it."""
        if self.address in _UNCHECKED_TOKEN_WARNED or not any(key == AUTH_METADATA_KEY for key, _ in self.metadata):
            return
        _UNCHECKED_TOKEN_WARNED.add(self.address)
        if client_certificates_required:
            log.info(
                "env server %s does not check tokens (started without --auth-token), so the token sent to it adds "
                "nothing; it admits only clients with a certificate its client CA signed (env-server --tls-client-ca)",
                label_of(self.address),
            )
            return
        log.warning(
            "env server %s does not check tokens (started without --auth-token): the token sent to it protects "
            "nothing, and anyone who can reach it may use it",
            label_of(self.address),
        )

    def check_request_size(self, size: int, method: str) -> None:
        """Refuse a request of ``size`` bytes over the server's limit before sending it (InvalidRequestError)."""
        if size > self.max_request_bytes:
            raise request_too_large(self.address, method, size, self.max_request_bytes)

    @property
    def session_ended(self) -> bool:
        """Whether this session is over: its Hold stream said so (see :meth:`_watch_hold`), a call was
        answered that it does not own the server, or the connection it ran on ended.

        The server ends a claim when its Hold stream's connection drops, so a channel that is no
        longer READY (the server stopped, restarted or vanished) means the session is gone.
        """
        if self._hold is None:
            return False
        return self._hold_ended or self._disowned or self.channel.get_state() is not grpc.ChannelConnectivity.READY

    async def ended_by_shutdown(self, wait: float = 0.1) -> bool:
        """Whether the server ended this session because it is shutting down (SIGTERM: a scale-down, a
        restart), as the end of its Hold stream says; False if the stream ended otherwise (the server
        killed, the connection cut) or said nothing within ``wait`` seconds. For a session that ended."""
        watch = self._hold_watch
        if self._hold is None or watch is None:
            return False
        if not watch.done():
            try:
                await asyncio.wait_for(asyncio.shield(watch), wait)
            except TimeoutError:
                return False
        return self._hold_reason == SHUTDOWN_REASON  # (the raw reason: a stable text of the protocol)

    async def get_spec(self) -> pb.EnvSpec:
        return (await self.get_spec_response()).spec

    async def get_spec_response(self, *, server_id_only: bool = False) -> pb.GetSpecResponse:
        """The server's spec and who holds its envs (GetSpec: no claim needed, none made); ``server_id_only``:
        a spec of its server_id alone (from servers that know the request's field; older ones send all). Its Box
        bounds may be compact (accepts_compact_bounds): codec.decode_space reads them, as it reads full ones."""
        request = pb.GetSpecRequest(server_id_only=server_id_only, accepts_compact_bounds=True)
        try:
            return await self.stub.GetSpec(request, timeout=self.timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            raise self._error(err, "GetSpec") from None

    # -- calls ----------------------------------------------------------------------------------

    async def reset(
        self, seeds: Sequence[int | None] | None, options: pb.Value | None, mask: Sequence[bool] | None
    ) -> pb.ResetResponse:
        return await self.send_reset(self.reset_request(seeds, options, mask))

    def reset_request(
        self, seeds: Sequence[int | None] | None, options: pb.Value | None, mask: Sequence[bool] | None
    ) -> pb.ResetRequest:
        """This session's Reset request; InvalidRequestError if it is over the server's limit."""
        request = pb.ResetRequest(session_id=self.session_id)
        if seeds is not None:
            for seed in seeds:
                request.seeds.add() if seed is None else request.seeds.add(value=seed)
        if options is not None:
            request.options.CopyFrom(options)
        if mask is not None:
            request.reset_mask.extend(mask)
        self.check_request_size(request.ByteSize(), "Reset")
        return request

    async def send_reset(
        self, request: pb.ResetRequest, timeout: float | None = None, hint: str | None = None
    ) -> pb.ResetResponse:
        """Send ``request``; its deadline ``timeout`` seconds (None: ``reset_timeout``); ``hint``: what a
        passed deadline's error advises (None: raising ``reset_timeout``)."""
        timeout = timeout or self.reset_timeout
        try:
            return await self.stub.Reset(request, timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            raise self._error(err, "Reset", timeout, hint) from None

    def step_request(self) -> pb.StepRequest:
        """An empty request of this session, for the caller to fill with actions, numbered: its
        ``step_id`` (this client's count of steps sent) comes back in the answer (see :attr:`step_id`)."""
        self.step_id += 1
        return pb.StepRequest(session_id=self.session_id, step_id=self.step_id)

    async def step(self, request: pb.StepRequest) -> pb.StepResponse:
        """Send ``request`` on the session's StepStream (opened on first use) and return the answer.

        A failure ends the stream (the server closes it with the status); the next step opens a new one.
        (Steps on the step socket take :meth:`send_on_socket` instead.) A request over the server's
        limit is refused before it is sent (InvalidRequestError), the stream left as it is.

        A step the step socket refused as not its session's (:meth:`not_my_step_socket`) comes here
        next: answered, the socket is another server's, and steps go over gRPC from now on.
        """
        unknown_to_socket, self._unknown_to_socket = self._unknown_to_socket, ""
        self.check_request_size(request.ByteSize(), "Step")
        if self._out_of_step:
            self._out_of_step = False
            if self._steps is not None:
                self._steps.cancel()
                self._steps = None
        fresh = self._steps is None
        if fresh:
            self._steps = self.stub.StepStream(metadata=self.metadata)
            self._step_statuses = _Statuses()
            self._steps.add_done_callback(self._step_statuses)
        call, statuses = self._steps, self._step_statuses
        try:
            self.writing = True  # (on a new stream, until it is open: a few turns of the loop)
            try:
                await call.write(request)
            except grpc.RpcError as err:
                if _core_internal(err):
                    # The write found the stream ended: report the status the server ended it with.
                    status = await statuses.before_write(call) if statuses is not None else None
                    if status is not None and (status[0] == grpc.StatusCode.OK or not fresh):
                        self._steps = None
                        raise self._stream_ended(status[0], status[1]) from None
                    if status is not None:  # (a new stream, refused as it opened: the step's own answer)
                        code, details, trailers = status
                        err = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details)
                    elif fresh:
                        err = await self._refusal_of_new_streams() or err
                raise err from None
            finally:
                self.writing = False
            response = await call.read()
        except grpc.RpcError as err:
            self._steps = None
            raise self._error(err, "Step") from None
        except asyncio.InvalidStateError:
            # The stream had already ended (the server closed it); report the status it ended with.
            self._steps = None
            raise await self._ended(call) from None
        except BaseException:  # cancelled (a timeout, or closing): the stream's state is unknown
            self._steps = None
            call.cancel()
            raise
        if response is grpc.aio.EOF:
            self._steps = None
            raise await self._ended(call)
        if unknown_to_socket:  # (this server knows the session: the step socket that did not is another's)
            self._step_over_grpc(
                f"does not know this session ({server_text(unknown_to_socket)}): another server's step socket at "
                "that path?"
            )
        return response

    def send_on_socket(self, request: pb.StepRequest) -> SocketStep | None:
        """Send ``request`` on the server's step socket (connecting first) and return the step in
        flight; None when this session does not step there (then :meth:`step` is the way): it has
        no step socket, it is out of reach, or it refused the connection as it opened. (A refusal
        that comes as the answer is the step's :attr:`SocketStep.refused`: send it over gRPC then.)"""
        if not self.step_socket:
            return None
        first = self._socket is None
        if first:
            sock: socket.socket | None = None
            try:
                # (socket() too: out of file descriptors, EMFILE, the learner steps over gRPC all the same)
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout)
                sock.connect(self.step_socket)
                sock.setblocking(False)  # SocketStep polls: with a timeout, every read would poll first
            except OSError as err:
                if sock is not None:
                    sock.close()
                fds = out_of_fds(err)
                hint = (
                    " (it is beside the server's Unix socket: mount the socket's folder, not the socket alone, "
                    "into a container)"
                    if isinstance(err, FileNotFoundError)
                    else ""
                )
                self._step_over_grpc(f"cannot be used: {fds}" if fds else f"is out of reach ({err}){hint}")
                return None
            self._socket = sock  # (its answers' buffer: a new one, since the last connection's close)
        assert self._socket is not None
        step = SocketStep(self, self._socket, request, first=first, buffer=self._socket_buffer)
        return None if step.refused else step

    def refuse_step_socket(self, reason: str) -> None:
        """The step socket refused this session's connection (see :attr:`SocketStep.refused`): step
        over gRPC for the rest of the session (a new session tries the step socket again)."""
        log.warning(
            "env server %s: its step socket %s refused the connection (%s); stepping over gRPC",
            label_of(self.address),
            self.step_socket,
            server_text(reason),
        )
        self.step_socket = ""

    def not_my_step_socket(self, reason: str) -> None:
        """The step socket answered the first step on a connection that this session does not own its
        server (``reason``), the step not taken: the socket at that path is another server's, or the
        session ended. The step's resend over gRPC (:meth:`step`) tells which: answered, the socket is
        another server's, and the session steps over gRPC from then on (said once per server); refused
        likewise, the session is over, its error all there is to say, and the step socket stays (was:
        turned off, with a warning that blamed another server's socket)."""
        self._unknown_to_socket = reason

    def _step_over_grpc(self, why: str) -> None:
        """Step over gRPC for the rest of the session, the step socket being unusable (``why``):
        said at WARNING once per server, then at DEBUG (each new session tries the step socket again)."""
        _warning_once(_STEP_SOCKET_WARNED, self.address)(
            "env server %s: its step socket %s %s; stepping over gRPC, without the step socket's fast path "
            "(a step's round trip takes ~4x as long: quick envs step about half as fast)",
            label_of(self.address),
            self.step_socket,
            why,
        )
        self.step_socket = ""

    def out_of_step(self) -> None:
        """An answer came that was to another request than the one sent (StepResponse.step_id): the
        stream or step socket it came on is out of step (an answer more, or one less, in it). The next
        step goes on a new one. (From any thread: the StepStream is cancelled on the loop, at that step.)"""
        self._out_of_step = True
        self.close_step_socket()

    def close_step_socket(self) -> None:
        """Close the step socket's connection (the next step connects again)."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
            self._socket_buffer = bytearray()  # (its memory goes with the connection)

    async def _refusal_of_new_streams(self) -> grpc.aio.AioRpcError | None:
        """What the server answers a new StepStream at once, where it refuses them as they open (an older
        server that has none, UNIMPLEMENTED; one at its --max-concurrent-rpcs, RESOURCE_EXHAUSTED); None
        when it does not within a moment. For a first write on a new stream that failed with gRPC's bare
        INTERNAL ("Internal error from Core"): a server that ends the stream while the write is under way
        makes the write fail so, and gRPC then keeps INTERNAL as the call's status, not the server's."""
        probe = self.stub.StepStream(metadata=self.metadata)
        try:
            await asyncio.wait_for(probe.read(), _PROBE_S)
        except grpc.aio.AioRpcError as refusal:
            if refusal.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED):
                return refusal
        except TimeoutError:
            pass
        finally:
            probe.cancel()
        return None

    async def _ended(self, call: Any) -> RemoteEnvError:
        return self._stream_ended(await call.code(), await call.details() or "")

    def _stream_ended(self, code: grpc.StatusCode, details: str) -> RemoteEnvError:
        """The error for a step whose stream the server had ended (with ``code``, ``details``) before answering it."""
        return status_error(code, details, address=self.address, method="Step", stream_ended=True)

    # -- failures ---------------------------------------------------------------------------------

    def abandon(self) -> None:
        """Drop the session's streams at once, without waiting on a server that may be dead or hung.

        The session id is kept (``session_id``) so that a reconnect can release it on a server that
        turns out to be alive; the channel stays open and reconnects by itself.
        """
        if self._steps is not None:
            self._steps.cancel()
            self._steps = None
        self.close_step_socket()
        self._drop_hold()

    def _drop_hold(self) -> None:
        """Cancel the Hold stream; its watch ends with it (its read raises CancelledError). The watch
        task is not cancelled here: this runs in the caller's thread too (abandon), where the loop
        may be running on another (a notebook's), and a task is cancelled only from its loop's thread."""
        if self._hold is not None:
            self._hold.cancel()
            self._hold = None

    async def release_session(self, session_id: str, timeout: float) -> None:
        """End ``session_id`` on the server (best effort; unknown or ended sessions are fine)."""
        try:
            await self.stub.Release(pb.ReleaseRequest(session_id=session_id), timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as err:
            log.debug("release of an old session on %s failed: %s", label_of(self.address), _said(err))

    # -- shutdown -------------------------------------------------------------------------------

    async def release(self, timeout: float | None = None) -> None:
        """End the session (best effort: the server also ends it when the connection drops).

        Within ``timeout`` seconds; by default the call deadline, at most :data:`RELEASE_TIMEOUT`:
        closing a fleet waits for every release, and a server that does not answer soon lets go of
        the session anyway once the connection closes (a long wait would only hold up ``close()``).
        """
        if timeout is None:
            timeout = min(self.timeout, RELEASE_TIMEOUT)
        if self._steps is not None:
            self._steps.cancel()
            self._steps = None
        self.close_step_socket()
        if self.session_id:
            self._released_at = time.monotonic()  # (before the Release: the Hold's watch may read its end meanwhile)
            try:
                await self.stub.Release(
                    pb.ReleaseRequest(session_id=self.session_id), timeout=timeout, metadata=self.metadata
                )
            except grpc.RpcError as err:
                log.debug("release of %s failed: %s", label_of(self.address), _said(err))
            else:
                await self._read_hold_end(_PROBE_S)
            self.session_id = ""
        self._drop_hold()

    async def _read_hold_end(self, wait: float) -> None:
        """Let the Hold stream's watch read the stream's end, for ``wait`` seconds at most, before the
        stream is cancelled. For after a Release the server answered: a server then ends the Hold stream
        (its HoldEvent, as the proto has it), so a wait only for a server that does not.

        A stream's end is read in a few turns of the loop, each waiting on gRPC's own thread, and this
        thread's loop runs only during calls (learner.loop): a refusal that came long before (the Hold
        stream refused by another server than the Handshake's, :meth:`_note_other_server`) was often not
        read by then, and cancelling the stream lost it, and its warning, for good."""
        watch = self._hold_watch
        if self._hold is not None and watch is not None and not watch.done():
            await asyncio.wait([watch], timeout=wait)

    async def close(self) -> None:
        """Release the session, close the connection, and wait (:data:`CLOSE_WAIT_S` at most) for what
        gRPC still has to do for the calls that ended with it.

        A cancelled call (the step stream, the Hold stream, a call of a task cancelled) returns at once,
        but gRPC's own tasks of it end only when the loop next takes in gRPC's events, and its connection
        stays open until they do: on a :class:`~learner.loop.LoopRunner`'s loop, which runs only during
        calls, that was at the next env's first call, or never (measured: 1 close in 5-14 left one of
        them). Once the channel is closed they end within a turn or two of the loop, whatever the server
        does; the bound is for a gRPC that does not."""
        await self.release()
        await self.channel.close()
        left = _call_tasks(self.channel)
        if self._hold_watch is not None and not self._hold_watch.done():
            left.append(self._hold_watch)
        if left:
            await asyncio.wait(left, timeout=CLOSE_WAIT_S)


def _said(err: grpc.RpcError) -> str:
    """What a failed call's status says, for a log line: its code and its details, cleaned (server_text)."""
    if not isinstance(err, grpc.aio.AioRpcError):
        return server_text(str(err))
    return f"[{err.code().name}] {status_text(err.details() or '')}"


CLOSE_WAIT_S = 0.25
"""Seconds :meth:`EnvClient.close` waits at most for gRPC's own tasks of the calls that ended with it."""

_STATUS_WATCHER = "_AioCall._handle_status_once_received"
"""gRPC's task (a Cython coroutine) that waits for a streaming call's final status, one per such call."""


def _call_tasks(channel: grpc.aio.Channel) -> list[asyncio.Task[Any]]:
    """The running loop's tasks, not done yet, of gRPC's calls on ``channel``: those of a call object
    (sending its request, say), whose frame's ``self`` is the call (how grpc.aio's own
    ``Channel.close`` finds them), and those that wait for a call's final status, a Cython coroutine
    with no frame locals, found through what it holds (its ``self``, the call's core object)."""
    core = getattr(channel, "_channel", None)
    found = []
    for task in asyncio.all_tasks():
        if task.done():
            continue
        coro = task.get_coro()
        frame = getattr(coro, "cr_frame", None)
        owner = frame.f_locals.get("self") if frame is not None else None
        if isinstance(owner, grpc.aio.Call):
            calls = [getattr(owner, "_cython_call", None)]
        elif getattr(coro, "__qualname__", "") == _STATUS_WATCHER:
            calls = [held for scope in gc.get_referents(coro) for held in gc.get_referents(scope)]
        else:
            continue
        if any(type(c).__name__ == "_AioCall" and getattr(c, "_channel", None) is core for c in calls):
            found.append(task)
    return found


# Handshakes given up (a Ctrl-C, a close) while in flight: how long their answers are waited for, at most, so that
# the sessions they grant are released at once (else each claim held its server for the server's --claim-timeout, 30 s
# by default: a learner started again was refused meanwhile). A second Ctrl-C ends the wait (LoopRunner.run). Here,
# beside EnvClient, for every Handshake of the fleet: the start's (learner.connecting), refresh()'s of servers joining
# (learner.membership), a reset's renewing a session that ended (learner.remote), a reconnect's (learner.faults).
HANDSHAKE_ANSWER_WAIT_S = 2.0

# The tasks in release_unadopted now, waiting for the answers of Handshakes given up to release their sessions (see
# releasing_unadopted: the fleet's close lets a reconnect it cancelled so finish before it closes the channels).
_RELEASING: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()


async def shielded_handshake(
    client: EnvClient,
    calls: list[tuple[EnvClient, asyncio.Future[pb.HandshakeResponse]]],
    timeout: float | None = None,
    hint: str | None = None,
) -> pb.HandshakeResponse:
    """``client``'s Handshake (``timeout``, ``hint``: see :meth:`EnvClient.handshake`), the call added to
    ``calls``, with ``client``, and run shielded: cancelled (a Ctrl-C), this ends at once, and the call goes on,
    for :func:`release_unadopted` to release the session its answer may grant."""
    call = asyncio.ensure_future(client.handshake(timeout, hint))
    calls.append((client, call))
    return await asyncio.shield(call)


async def release_unadopted(calls: Sequence[tuple[EnvClient, asyncio.Future[pb.HandshakeResponse]]]) -> None:
    """Release the session each of the Handshake ``calls`` (each with its client) granted, where its client did
    not take it up (a session taken up, its client's close releases).

    A connect given up while Handshakes were in flight (a Ctrl-C: the connect's task is cancelled) dropped
    their answers: a server that had granted the claim, its answer on the way, then held it with nobody to
    release it, no Hold stream, until its --claim-timeout (30 s by default: "ended: no Hold stream and no calls
    for 30 s" in its log), refusing the learner started again meanwhile (ServerBusyError; 1-2 of 30 connects
    interrupted in a fuzz). So the calls go on, shielded from the cancel (see :func:`shielded_handshake`), and are
    waited for here, :data:`HANDSHAKE_ANSWER_WAIT_S` at most (a second Ctrl-C ends the wait: LoopRunner.run);
    then those still in flight are cancelled. Each session is released as its answer is read, not after the
    wait for the slowest: a second Ctrl-C, which leaves this task where it is, left the sessions already granted
    (a fast server's, one server hanging on its Handshake) held for the claim timeout too. Answers read before
    (the connect given up after its handshakes: during the alias check, say) are released alike, at once.
    Plain Releases, as every server takes (an old one too).

    The Handshakes made after the start are made so too, and released so when given up: refresh()'s, of
    servers joining the fleet (:meth:`~learner.membership.FleetMembership._join`), a reset's, renewing a
    session that ended (``RemoteVectorEnv._renew_session``), and a fault-tolerant reconnect's
    (:func:`learner.faults.reconnect`: the fleet's close cancels it). Else a Ctrl-C while one was in flight (or
    the call cancelled otherwise) left its server claimed alike."""

    async def release(client: EnvClient, call: asyncio.Future[pb.HandshakeResponse]) -> None:
        if not call.done():
            _, late = await asyncio.wait([call], timeout=HANDSHAKE_ANSWER_WAIT_S)
            if late:
                call.cancel()
                await gather(call, return_exceptions=True)
                return
        if call.cancelled() or call.exception() is not None:
            return
        session_id = call.result().session_id
        if session_id and session_id != client.session_id:  # (none granted, or taken up: nothing to release)
            await client.release_session(session_id, RELEASE_TIMEOUT)

    task = asyncio.current_task()
    assert task is not None  # (a coroutine of asyncio's: it runs in a task)
    _RELEASING.add(task)
    try:
        await gather(*(release(client, call) for client, call in calls), return_exceptions=True)
    finally:
        _RELEASING.discard(task)


T = TypeVar("T")
HandshakeCalls = list[tuple[EnvClient, asyncio.Future[pb.HandshakeResponse]]]


async def released_if_given_up(handshakes: Callable[[HandshakeCalls], Awaitable[T]]) -> T:
    """``await handshakes(calls)``, which adds each Handshake call it makes to ``calls`` (:func:`shielded_handshake`):
    given up while one is in flight (a Ctrl-C, a close cancels it) or failed, the sessions they granted are
    released (:func:`release_unadopted`) before it raises on. For a single client's Handshake made after the start
    (a reset's renewal of an ended session, a reconnect's)."""
    calls: HandshakeCalls = []
    try:
        return await handshakes(calls)
    except BaseException:
        await release_unadopted(calls)
        raise


def releasing_unadopted(tasks: Sequence[asyncio.Future[Any]]) -> list[asyncio.Future[Any]]:
    """Those of ``tasks`` in :func:`release_unadopted` now (a reconnect cancelled while its Handshake was in
    flight, say, waiting for its answer to release the session it granted)."""
    return [task for task in tasks if task in _RELEASING]


class SocketStep:
    """A step sent on a step socket whose answer is not taken in yet.

    The step socket's twin of an asyncio task running a StepStream exchange (``done``,
    ``exception``, ``result`` -> (response, round-trip seconds)), with no event loop: the answer is
    read straight from the socket, by :meth:`wait` (blocking) or :meth:`receive` (what has arrived,
    once the socket is readable). Any failure is the step's exception, and closes the connection (a
    timeout too: where the exchange stands is unknown then).

    ``first``: the connection was opened for this step. A server whose step socket has all its
    connections taken refuses a new one (RESOURCE_EXHAUSTED) before it reads anything from it, so
    a refusal on a connection's first step means the step was not taken: :attr:`refused`, and
    ``request`` is to be sent over gRPC instead. So too a first step answered that the session does
    not own the server (FAILED_PRECONDITION): the socket is not its server's, or the session ended.

    ``buffer``: where the answer's payload is read, resized to fit it; the connection's steps share one
    (see EnvClient), which nothing this step hands out refers to.
    """

    def __init__(
        self,
        client: EnvClient,
        sock: socket.socket,
        request: pb.StepRequest,
        *,
        first: bool = False,
        buffer: bytearray | None = None,
    ) -> None:
        self._client = client
        self._sock = sock
        self.request = request
        self.first = first
        self.refused = False  # the step socket refused the connection: the step was not taken
        self._start = time.perf_counter()
        self._header = bytearray(FRAME_HEADER.size)
        self._payload = bytearray() if buffer is None else buffer
        self._got = 0  # bytes read of the header, then of the payload
        self._kind = -1  # the answer's kind, once its header is in
        self._result: tuple[pb.StepResponse, float] | None = None
        self._error: RemoteEnvError | None = None
        self.timed = False  # waited for: the round trip counts toward the client's recent_rtt
        self.timeout = client.timeout  # (the step's deadline, for the message: longer where envs reset)
        self.hint = TIMEOUT_HINT  # (what the message advises)
        # Something to read before we sent anything: the server ended the connection (and said why:
        # shutting down, say). Take that in rather than reporting the broken pipe sending would meet.
        # (Asked of poll first: a read of nothing raises, which costs more than the question.)
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN)
        if poller.poll(0):
            self.receive()
            if self._got or self.done():
                if self._error is None:
                    self._result = None
                    self._fail(self._broken(None, "it sent an answer to no request"))
                return
        payload = request.SerializeToString()
        if len(payload) > client.max_request_bytes:  # (nothing sent: the connection stays as it is)
            self._error = request_too_large(client.address, "Step", len(payload), client.max_request_bytes)
            return
        try:
            self._send(FRAME_HEADER.pack(len(payload), FRAME_STEP) + payload)
        except OSError as err:
            self.receive()  # the server may have said why it closed
            if not self.done():
                self._fail(self._broken(err))

    def _send(self, frame: bytes) -> None:
        """All of ``frame``, waiting for room up to the client's timeout (then TimeoutError: the
        connection counts as broken, as a server that stops reading is)."""
        view = memoryview(frame)
        deadline = time.monotonic() + self._client.timeout
        while view:
            try:
                view = view[self._sock.send(view) :]
            except BlockingIOError:
                if not self._poll(select.POLLOUT, deadline):
                    raise TimeoutError(f"no room to send for {self._client.timeout:g} s") from None

    def _poll(self, events: int, deadline: float) -> bool:
        """Wait until the socket is ready for ``events`` or ``deadline`` passes; whether it is ready."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        poller = select.poll()  # (not select.select: it fails on file descriptors >= 1024)
        poller.register(self._sock.fileno(), events)
        return bool(poller.poll(math.ceil(remaining * 1000)))

    def fileno(self) -> int:
        return self._sock.fileno()

    def done(self) -> bool:
        return self._result is not None or self._error is not None

    def cancelled(self) -> bool:
        return False

    def exception(self) -> RemoteEnvError | None:
        return self._error

    def result(self) -> tuple[pb.StepResponse, float]:
        if self._error is not None:
            raise self._error
        assert self._result is not None, "the step is still in flight"
        return self._result

    def wait(self, deadline: float) -> None:
        """Read until the answer is in, or ``deadline`` (``time.monotonic()``) passes: then a timeout.

        An answer already there counts even after the deadline (another server's step may have
        used the time up: this one's answer was on time all the same). While answers have been
        coming within the client's ``spin_wait``, look for it without sleeping that long first.
        """
        client = self._client
        self.receive()
        if self.done():
            return
        self.timed = True  # the answer was not in yet: its arrival shows how quick the server is
        spin_until = min(self.spin_until(), deadline)
        while True:
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()  # let a process that has work (an env server on this core) run
            elif now >= deadline or not self._poll(select.POLLIN, deadline):
                self.receive()
                if not self.done():
                    self._fail(
                        timeout_error(address=client.address, method="Step", timeout=self.timeout, hint=self.hint)
                    )
                return
            self.receive()
            if self.done():
                return

    def spin_until(self) -> float:
        """The ``time.monotonic()`` until which to wait for the answer awake: ``spin_wait`` from now
        while the server's recent answers came sooner than that, else 0 (sleep at once)."""
        client = self._client
        if client.spin_wait > 0 and client.recent_rtt < client.spin_wait:
            return time.monotonic() + client.spin_wait
        return 0.0

    def receive(self) -> None:
        """Take in what has arrived, without waiting: until the answer is in or nothing more has come."""
        while not self.done() and self._read():
            pass

    def _read(self) -> bool:
        """One read of what has arrived, without waiting; whether anything came."""
        target = self._header if self._kind < 0 else self._payload
        try:
            # (a view for this read alone: one left alive would forbid resizing the buffer for the next answer)
            count = self._sock.recv_into(memoryview(target)[self._got :])
        except BlockingIOError:
            return False  # nothing yet
        except OSError as err:
            self._fail(self._broken(err))
            return False
        if count == 0:
            self._fail(self._broken(None))
            return False
        self._got += count
        if self._got < len(target):
            return True
        if self._kind < 0:  # the header is in: read the payload next
            length, self._kind = FRAME_HEADER.unpack(self._header)
            if length > MAX_MESSAGE_BYTES:
                self._fail(self._broken(None, f"it sent a frame of {length} bytes, over the message limit"))
                return False
            _resize(self._payload, length)
            self._got = 0
            if length:
                return True
        self._finish(self._payload)
        return True

    def _finish(self, payload: bytearray) -> None:
        client = self._client
        try:
            if self._kind == FRAME_STEP:
                rtt = time.perf_counter() - self._start
                # (parsed from the bytearray itself: a bytes-like view of it would be copied first; the
                # message copies what it keeps, so the next answer read into the buffer changes none of it)
                self._result = (pb.StepResponse.FromString(payload), rtt)
                if self.timed:  # (an answer found waiting says only that the caller was busy)
                    client.recent_rtt += 0.25 * (rtt - client.recent_rtt)
                return
            if self._kind != FRAME_ERROR:
                raise ValueError(f"a frame of unknown kind {self._kind}")
            error = pb.StepError.FromString(payload)
        except Exception as err:  # whatever the bytes were, the exchange is broken
            self._fail(self._broken(None, f"its answer could not be read ({err})"))
            return
        if self.first and error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]:
            # A connection beyond the server's limit is refused as it opens, before any frame of it is
            # read. (The server's other RESOURCE_EXHAUSTED, envs claimed by another learner, is
            # Handshake's answer, never a step's.)
            self.refused = True
            client.refuse_step_socket(error.message)
        elif self.first and error.code == _FAILED_PRECONDITION and NOT_OWNED in error.message:
            # The first step on a connection, and the socket does not know the session: another
            # server's (at the path beside the Unix socket we reached ours at), which checked the
            # session before anything else and stepped nothing. Counting our server lost for it would
            # lose it at every reconnect; gRPC reaches the server we hold (or says the session is over).
            self.refused = True
            client.not_my_step_socket(error.message)
        self._fail(
            status_error(
                _CODE_BY_NUMBER.get(error.code, grpc.StatusCode.UNKNOWN),
                error.message,
                address=client.address,
                method="Step",
                env_index=client.env_offset + error.env_index if error.HasField("env_index") else None,
                timeout=client.timeout,
            )
        )

    def _broken(self, err: OSError | None, reason: str = "it closed the connection") -> ServerUnavailableError:
        address = self._client.address
        return ServerUnavailableError(
            f"env server {label_of(address)}: Step failed [UNAVAILABLE]: the step socket broke ({err or reason})",
            address=address,
            code=grpc.StatusCode.UNAVAILABLE,
        )

    def _fail(self, error: RemoteEnvError) -> None:
        self._error = error
        self._client.close_step_socket()


def _resize(buffer: bytearray, size: int) -> None:
    """Make ``buffer`` ``size`` bytes long, in place. CPython keeps a bytearray's memory while it shrinks
    by less than half, and over-allocates as it grows: answers of about one size take no new memory."""
    if len(buffer) > size:
        del buffer[size:]
    elif len(buffer) < size:
        buffer.extend(bytes(size - len(buffer)))


def channel_credentials(
    tls: bool | str | os.PathLike[str],
    client_cert: str | os.PathLike[str] | None = None,
    client_key: str | os.PathLike[str] | None = None,
) -> tuple[grpc.ChannelCredentials | None, bytes | None]:
    """TLS credentials for ``tls``, and the CA roots they trust: False -> (None, None) (plaintext); True ->
    the system's CA roots (roots None); a path -> the CA certificate(s) in that PEM file. (A server name
    other than the address's host goes in the channel's options: EnvClient's ``tls_server_name``.)

    ``client_cert`` and ``client_key`` (both or neither; TLS only): PEM files of the client certificate
    (chain) this client presents, for servers that require one (``env-server --tls-client-ca``: mutual
    TLS), and its private key. Files that cannot be read, are not what they should be or do not belong
    together raise InvalidArgumentError naming the argument."""
    if (client_cert is None) != (client_key is None):
        given = "tls_client_cert" if client_cert is not None else "tls_client_key"
        raise InvalidArgumentError(
            f"tls_client_cert and tls_client_key: give both (the client certificate and its private key) or "
            f"neither, got {given} alone"
        )
    if tls is False or tls is None:
        if client_cert is not None:
            raise InvalidArgumentError(
                "tls_client_cert: a client certificate is presented in a TLS handshake; connect with TLS too "
                f"(tls=True, or tls=CA_PATH), got tls={tls!r}"
            )
        return None, None
    identity: dict[str, bytes] = {}
    if client_cert is not None and client_key is not None:
        identity = client_identity(client_cert, client_key)
    if tls is True:
        return grpc.ssl_channel_credentials(**identity), None
    roots = ca_roots(tls)
    return grpc.ssl_channel_credentials(root_certificates=roots, **identity), roots


def ca_roots(path: str | os.PathLike[str], name: str = "tls") -> bytes:
    """The CA certificate(s) in the PEM file ``path``, as gRPC takes them; InvalidArgumentError naming ``name`` (the
    argument or option that gave it) where it cannot be read or OpenSSL cannot read certificates in it (else
    gRPC's C core logged "Could not load any root certificate" and no server seemed to answer)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            roots = f.read()
    except OSError as err:
        raise InvalidArgumentError(f"{name}: cannot read the CA certificate file {path!r}: {err.strerror}") from err
    if b"-----BEGIN CERTIFICATE-----" not in roots:
        raise InvalidArgumentError(
            f"{name}: expected PEM CA certificate(s) in {path!r} (-----BEGIN CERTIFICATE-----), got something else"
        )
    if (why := unreadable_ca(roots)) is not None:
        raise InvalidArgumentError(
            f"{name}: expected PEM CA certificate(s) in {path!r}, got ones OpenSSL cannot read ({why})"
        )
    return roots


def client_identity(
    cert: str | os.PathLike[str],
    key: str | os.PathLike[str],
    cert_name: str = "tls_client_cert",
    key_name: str = "tls_client_key",
) -> dict[str, bytes]:
    """``grpc.ssl_channel_credentials``' ``certificate_chain`` and ``private_key`` from the PEM files
    ``cert`` and ``key``; InvalidArgumentError naming ``cert_name`` or ``key_name`` (the options that
    gave them) where one cannot be read, is not what it should be, or they do not belong together."""
    cert_path, key_path = os.fspath(cert), os.fspath(key)
    read: dict[str, bytes] = {}
    for name, path, what, marker, pem in (
        (cert_name, cert_path, "client certificate", b"-----BEGIN CERTIFICATE-----", "-----BEGIN CERTIFICATE-----"),
        (key_name, key_path, "private key", b"PRIVATE KEY-----", "-----BEGIN ... PRIVATE KEY-----"),
    ):
        try:
            with open(path, "rb") as f:
                read[name] = f.read()
        except OSError as err:
            raise InvalidArgumentError(f"{name}: cannot read the {what} file {path!r}: {err.strerror}") from err
        if marker not in read[name]:
            raise InvalidArgumentError(f"{name}: expected a PEM {what} ({pem}) in {path!r}, got something else")
    try:
        check_key_pair(cert_path, key_path, cert_name, key_name)
    except ValueError as err:
        raise InvalidArgumentError(str(err)) from None
    return {"certificate_chain": read[cert_name], "private_key": read[key_name]}
