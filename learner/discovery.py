"""Turning the addresses a user gives into the list of env servers to connect to.

An address is one of:
  ``host:port``            one server (``[::1]:port`` for IPv6);
  ``unix:/path/to/sock``   one server on a Unix domain socket;
  ``dns:///name:port``     every address ``name`` resolves to, one server each (a headless
                           Kubernetes service, Swarm's ``tasks.<service>``, compose's service name);
  ``compose:[PROJECT/]SERVICE``  every healthy replica of a Docker Compose service, at its published
                           host port (``learner.compose``, through the Docker SDK);
  ``swarm:SERVICE``        every running task of a Docker Swarm service, at the port it publishes on
                           its node (``learner.swarm``, through the Docker SDK on a swarm manager);
  ``file:PATH``            every address listed in the file at PATH (any of the forms above but
                           ``file:``; one or more a line, ``#`` comments), read anew at every look-up:
                           the way to grow or shrink a fleet of plain host:port servers while it runs.

Resolving again later (between rollouts) finds replicas that were added or removed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import ipaddress
import logging
import math
import os
import re
import socket
import ssl
import stat
import threading
import time
from collections.abc import Callable, Sequence

from env_server.protocol import host_port
from learner.errors import EnvFleetError, os_reason

__all__ = [
    "CLIENT_CERT_REFUSED",
    "CLIENT_CERT_REQUIRED",
    "TLS_CAUSE",
    "UNIX_SERVER_NAME",
    "AddressError",
    "NotReadyYet",
    "Resolver",
    "check_written",
    "expand_addresses",
    "expand_named",
    "diagnose",
    "expand_when_ready",
    "no_wait_mends",
    "probe_until",
    "note_not_used",
    "pin_addresses",
    "probe",
    "register_resolver",
    "resolve_dns",
    "speaks_tls",
    "split_addresses",
    "tls_probe",
    "unix_path",
    "warn_duplicates",
]


class AddressError(EnvFleetError, ValueError):
    """An address that cannot be parsed or resolved (none given, an unknown scheme, a name with no
    such host, a Docker engine that cannot be asked)."""


class NotReadyYet(AddressError):
    """An address whose servers are starting (a replica's first health check not done, a name with no
    addresses yet): worth a wait. ``waiting_for``: what a wait is for, as a log line says it."""

    def __init__(self, message: str, waiting_for: str = "") -> None:
        super().__init__(message)
        self.waiting_for = waiting_for


Resolver = Callable[[str], list[str]]
log = logging.getLogger(__name__)

_RESOLVERS: dict[str, Resolver] = {}
_READY_POLL_S = 0.5  # (expand_when_ready's look-ups)
_PINNERS: dict[str, Callable[[str], str]] = {}
_NOT_USED: dict[str, str] = {}  # (note_not_used: what was said last, per address)
# (note_not_used: per address, since when each server not used was so, by name; and when a warning last said so)
_NOT_USED_SINCE: dict[str, dict[str, float]] = {}
_NOT_USED_WARNED: dict[str, float] = {}
NOT_USED_WARN_S = 60.0
"""A server a look-up finds but does not use yet (a replica or task still starting, or unhealthy) is warned of
once it has been so this long, then at most once per this long: the INFO lines that name it are not shown at
learner train's default log level, and a replica whose health check never passes stayed out of the fleet unsaid."""
_GONE_STATES = (
    *("exited", "dead", "paused", "removing"),  # (compose: a container's)
    *("shutdown", "complete", "failed", "rejected", "orphaned", "remove"),  # (Swarm: a task's)
)
"""States of servers that are not coming (stopped on purpose, or given up on): not warned of."""


def register_resolver(scheme: str, resolver: Resolver, pin: Callable[[str], str] | None = None) -> None:
    """Let addresses ``<scheme>:<rest>`` expand to the servers ``resolver(rest)`` returns.

    ``pin(rest)``: the same address made specific to what it resolves to now (e.g. the compose
    project a service runs in), so that later look-ups keep to it; see :func:`pin_addresses`.
    """
    _RESOLVERS[scheme] = resolver
    if pin is not None:
        _PINNERS[scheme] = pin


def pin_addresses(addresses: str | Sequence[str]) -> str | list[str]:
    """``addresses`` with each one whose resolver can pin it made specific to what it resolves to now:
    ``compose:env`` becomes ``compose:PROJECT/env`` for the one project that runs it, so that a look-up
    between rollouts keeps to that fleet when another project starts an ``env`` service too. The rest,
    and those that cannot be pinned now, as given."""
    given = split_addresses(addresses) if isinstance(addresses, str) else list(addresses)
    pinned = []
    for address in given:
        scheme, sep, rest = address.strip().partition(":") if isinstance(address, str) else ("", "", "")
        pin = _PINNERS.get(scheme) if sep else None
        pinned.append(f"{scheme}:{pin(rest)}" if pin is not None else address)
    if pinned == given:
        return addresses if isinstance(addresses, str) else list(addresses)
    return ",".join(pinned) if isinstance(addresses, str) else pinned


def note_not_used(logger: logging.Logger, address: str, what: str, waiting: Sequence[str]) -> None:
    """Log (to ``logger``) the servers ``address`` has that are not used yet (``waiting``: "env.3 (starting)", ...; ``what``:
    "task", "replica"), at INFO when they are not those said last for it, else at DEBUG: a resolver runs at
    every look-up, several a second while a fleet starts or between rollouts."""
    text = f"{address}: not using {len(waiting)} {what}(s) yet: {', '.join(waiting)}" if waiting else ""
    said = _NOT_USED.get(address, "")
    if text:
        (logger.info if text != said else logger.debug)("%s", text)
        _NOT_USED[address] = text
    elif said:
        logger.debug("%s: every %s is used now", address, what)
        del _NOT_USED[address]
    _warn_long_unused(logger, address, what, waiting)


def _warn_long_unused(logger: logging.Logger, address: str, what: str, waiting: Sequence[str]) -> None:
    """A warning (see :data:`NOT_USED_WARN_S`) naming the servers of ``waiting`` ("env.3 (starting)") that have
    not been used for that long, by name whatever their state did meanwhile (starting, pending, starting)."""
    now = time.monotonic()
    states = dict(_name_and_state(item) for item in waiting)
    coming = {name for name, state in states.items() if state not in _GONE_STATES}
    since = {name: t for name, t in _NOT_USED_SINCE.get(address, {}).items() if name in coming}
    since.update({name: now for name in coming if name not in since})
    _NOT_USED_SINCE[address] = since
    long = sorted((name for name, t in since.items() if now - t >= NOT_USED_WARN_S), key=lambda n: since[n])
    if not long or now - _NOT_USED_WARNED.get(address, -math.inf) < NOT_USED_WARN_S:
        return
    logger.warning(
        "%s: %d %s(s) not used for %.0f s: %s; their envs join once they are ready (%s)",
        address,
        len(long),
        what,
        now - since[long[0]],
        ", ".join(f"{name} ({states[name]})" for name in long),
        _WHY_NOT_READY.get(what, "their logs say why not"),
    )
    _NOT_USED_WARNED[address] = now


_WHY_NOT_READY = {
    "replica": "`docker compose ps` and the replica's logs say why not",
    "task": "`docker service ps --no-trunc SERVICE` says why not",
}


def _name_and_state(item: str) -> tuple[str, str]:
    """``"env.3 (starting)"`` -> ``("env.3", "starting")``."""
    name, sep, state = item.rpartition(" (")
    return (name, state.removesuffix(")")) if sep else (item, "")


def split_addresses(text: str) -> list[str]:
    """``"a:1,b:2"`` -> ``["a:1", "b:2"]`` (commas or whitespace)."""
    return [part for part in text.replace(",", " ").split() if part]


def check_written(addresses: str | Sequence[str]) -> None:
    """AddressError for the first of ``addresses`` that is written wrong (a port that is no number, an unknown
    scheme, brackets that do not pair, ...), looking nothing up: no name resolved, no file read, no resolver
    (compose:, swarm:) asked. So that a command says it at once, as a usage error of the option that gave
    it, not as an error once it has started; what a ``file:`` address's file lists is checked as it is read."""
    for address in split_addresses(addresses) if isinstance(addresses, str) else list(addresses):
        if not (isinstance(address, str) and address.strip().startswith("file:")):
            _expand_one(address, resolve=False)


def expand_addresses(addresses: str | Sequence[str]) -> list[str]:
    """Every server the addresses name, in order, without duplicates."""
    return list(expand_named(addresses))


def expand_named(addresses: str | Sequence[str], wait: float = 0.0) -> dict[str, str | None]:
    """:func:`expand_addresses` (:func:`expand_when_ready` with ``wait`` > 0), each server with the name it
    was found by: the name of a ``dns:///name:port`` address, which its certificate must hold under TLS
    (as gRPC's own dns resolver checks it; the server is reached at an IP address); None for the others
    (their certificates are checked against the host in their own address)."""
    deadline = time.monotonic() + wait
    told = False
    while True:
        try:
            return _expand_all(addresses)
        except NotReadyYet as err:
            if time.monotonic() + _READY_POLL_S > deadline:
                if told:
                    raise NotReadyYet(f"{err} (still so after waiting {wait:g} s)", err.waiting_for) from None
                raise
            if not told:
                log.info("waiting up to %g s for %s", wait, err.waiting_for or f"env servers that are starting: {err}")
                told = True
            time.sleep(_READY_POLL_S)


def expand_when_ready(addresses: str | Sequence[str], wait: float) -> list[str]:
    """:func:`expand_addresses`, waiting up to ``wait`` seconds while it says the servers are
    starting (:class:`NotReadyYet`: a learner run right after ``docker compose up -d``, or before a
    Kubernetes headless service's name has an address)."""
    return list(expand_named(addresses, wait))


def _expand_all(addresses: str | Sequence[str]) -> dict[str, str | None]:
    if isinstance(addresses, str):
        addresses = split_addresses(addresses)
    if not addresses:
        raise AddressError(
            "addresses: expected at least one server address (host:port, unix:PATH or dns:///name:port), got none"
        )
    out: dict[str, str | None] = {}
    for address in addresses:
        for where, entry in _entries(address):
            try:
                name = _dns_name(entry)
                endpoints = _expand_one(entry)
            except NotReadyYet as err:
                raise NotReadyYet(f"{where}{err}", err.waiting_for) from err
            except AddressError as err:
                if not where:
                    raise
                raise AddressError(f"{where}{err}") from err
            for endpoint in endpoints:
                out.setdefault(endpoint, name)
    return out


_FILE_MAX_BYTES = 1 << 20  # (a list of servers; more is some other file named by mistake)


def _entries(address: str) -> list[tuple[str, str]]:
    """``address`` (as ``("", address)``), or for ``file:PATH`` each address the file lists now, with
    where it is (``"file:PATH line N: "``) for the errors about it."""
    if not (isinstance(address, str) and address.strip().startswith("file:")):
        return [("", address)]
    address = address.strip()
    path = address[len("file:") :]
    if path.startswith("//"):  # the URI form: file:///abs/path (file://host/path names another host's file)
        if not path.startswith("///"):
            raise AddressError(
                f"server address {address!r}: expected file:PATH or file:///PATH (a file on this host), got a host in it"
            )
        path = path[2:]
    if not path:
        raise AddressError(f"server address {address!r}: expected file:PATH, the file listing the servers; got no path")
    try:
        with open(path, "rb") as file:
            data = file.read(_FILE_MAX_BYTES + 1)
        text = data.decode()
    except FileNotFoundError:
        raise AddressError(
            f"server address {address!r}: no such file ({os.path.abspath(path)}); it should list the env servers, "
            "one host:port (or unix:PATH, dns:///name:port) a line"
        ) from None
    except IsADirectoryError:
        raise AddressError(f"server address {address!r}: {os.path.abspath(path)} is a folder, not a file") from None
    except OSError as err:
        raise AddressError(f"server address {address!r}: cannot read {path}: {os_reason(err)}") from err
    except UnicodeDecodeError as err:
        raise AddressError(f"server address {address!r}: {path} is not UTF-8 text ({err})") from None
    if len(data) > _FILE_MAX_BYTES:
        raise AddressError(
            f"server address {address!r}: {path} is over {_FILE_MAX_BYTES >> 20} MiB; expected a list of server "
            "addresses"
        )
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        where = f"{address} line {number}: "
        for entry in split_addresses(line.partition("#")[0]):
            if entry.startswith("file:"):
                raise AddressError(
                    f"{where}{entry!r} is a file: address; a file lists servers (host:port, unix:PATH, "
                    "dns:///name:port, compose:SERVICE, swarm:SERVICE), not other files"
                )
            entries.append((where, entry))
    if not entries:
        raise NotReadyYet(
            f"server address {address!r}: {path} lists no server",
            waiting_for=f"{path} to list a server ({address})",
        )
    return entries


def warn_duplicates(addresses: str | Sequence[str]) -> None:
    """Log the addresses given more than once (each server is used once)."""
    given = split_addresses(addresses) if isinstance(addresses, str) else list(addresses)
    twice = sorted({a for a in given if isinstance(a, str) and given.count(a) > 1})
    if twice:
        log.warning("addresses: %s given more than once; each server is used once", ", ".join(twice))


def probe(address: str, timeout: float = 1.0, *, peek: bool = True) -> str | None:
    """Why a plain connection to ``address`` (``host:port`` or ``unix:PATH``) fails now, or None.

    For error messages: "connection refused", "no socket file /tmp/x.sock", ... Where a connection
    opens, what its first bytes say listens there when that is no gRPC server ("it is an HTTP/1
    port ...", "it is an SSH server's port ...": see :func:`no_wait_mends`; not with ``peek`` False,
    for a TLS port: a server that speaks TLS and HTTP/1 on it, as an nginx TLS proxy does, answers a
    plain gRPC opening in HTTP/1); else None (something listens, and it is not an env server that
    answers), and for an address of another kind.
    """
    path = unix_path(address) or ""
    try:
        opened = _connect(address, timeout)
        if opened is not None:
            with opened[0] as sock:
                return _other_protocol(sock, min(timeout, _PEEK_S)) if peek else None
    except AddressError:
        return None
    except FileNotFoundError:
        return f"no socket file {path}"
    except ConnectionRefusedError:
        return _not_a_socket(path) or "connection refused" + (f" on {path}" if path else "")
    except TimeoutError:
        return f"a plain connect gets no answer within {timeout:g} s"
    except socket.gaierror as err:
        return f"cannot resolve the host: {err.strerror}"
    except OSError as err:
        return os_reason(err)  # (out of file descriptors: said so, with the way out)
    return None


# What a peer's first bytes (lower-cased) say it is. HTTP/1 servers answer gRPC's opening (the HTTP/2
# preface, "PRI * HTTP/2.0" as an HTTP/1 request line) with an HTTP/1 error, Python's http.server
# (and so prometheus_client's, env-server --metrics-port) with a bare HTML page; SSH servers speak first.
_PROTOCOLS = {
    (b"http/", b"<!doctype html", b"<html"): "it is an HTTP/1 port (an env server's --metrics-port? or an HTTP "
    "proxy whose listener takes no HTTP/2 without TLS, h2c, as gRPC speaks it: Caddy needs protocols h1 h2 h2c in "
    "its servers options), not an env server's gRPC port",
    (b"ssh-",): "it is an SSH server's port, not an env server's gRPC port",
}
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_PEEK_BYTES = max(len(prefix) for prefixes in _PROTOCOLS for prefix in prefixes)
_PEEK_S = 0.5  # (the longest a probe waits for a peer's first bytes: a local or LAN server answers in ms)


def _other_protocol(sock: socket.socket, timeout: float) -> str | None:
    """What listens on ``sock``'s peer if its first bytes say it is no gRPC server, else None (a gRPC
    server, one that says nothing within ``timeout`` seconds, or closes). Sends what a gRPC client
    sends first, the HTTP/2 preface; reads a few bytes at most."""
    got = b""
    deadline = time.monotonic() + timeout
    try:
        sock.settimeout(timeout)
        sock.sendall(_HTTP2_PREFACE)
        while len(got) < _PEEK_BYTES and (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(_PEEK_BYTES - len(got))
            if not chunk:
                break
            got += chunk.lower()
            what = next((what for prefixes, what in _PROTOCOLS.items() if got.startswith(prefixes)), None)
            if what is not None:
                return what
    except OSError:  # (a timeout, a reset: nothing more to tell)
        pass
    return None


TLS_CAUSE = "TLS: "
"""How :func:`tls_probe`'s reasons start."""

UNIX_SERVER_NAME = "localhost"
"""The name a server's certificate is checked for at a ``unix:`` address under TLS, unless another is
given (``tls_server_name``). gRPC's own default there is the socket's path (``tmp%2Fenv.sock``), which
no certificate holds: its connection attempts would fail, unseen, until the deadline ("No match found
for server name" in gRPC's log); a certificate for a server on this host holds ``localhost``."""


def no_wait_mends(cause: str | None) -> bool:
    """Whether ``cause`` (:func:`probe`'s or :func:`tls_probe`'s reason) says what no wait will mend:
    a TLS failure, or a port that serves another protocol (unlike a server not started yet)."""
    return cause is not None and (cause.startswith(TLS_CAUSE) or cause in _PROTOCOLS.values())


# OpenSSL's X509_V_ERR_UNABLE_TO_GET_ISSUER_CERT_LOCALLY, _DEPTH_ZERO_SELF_SIGNED_CERT, _SELF_SIGNED_CERT_IN_CHAIN
_UNKNOWN_ISSUER = (20, 18, 19)
# X509_V_ERR_HOSTNAME_MISMATCH, _IP_ADDRESS_MISMATCH
_NAME_MISMATCH = (62, 64)


def tls_probe(
    address: str,
    ca: bytes | None,
    server_name: str | None = None,
    timeout: float = 1.0,
    client_cert: tuple[str, str] | None = None,
) -> str | None:
    """Why a TLS handshake with ``address`` (``host:port`` or ``unix:PATH``) fails, as a client with
    ``ca`` (PEM roots; None: the system's) checking the name ``server_name`` (default: the host)
    and presenting ``client_cert`` (the paths of a client certificate and its key; None: none) would
    see it; None when it succeeds or fails for some other reason (then TLS is not the cause).

    For error messages, as :func:`probe`, when a server listens but gRPC's TLS connection does not
    come up: a certificate that does not verify, a server that does not speak TLS, or one that requires
    a client certificate and takes none this client has (or a TLS proxy whose backend is down, which
    ends the connection after the handshake as such a server does: see :data:`CLIENT_CERT_REQUIRED`)."""
    context = ssl.create_default_context(cadata=ca.decode("ascii", "replace") if ca is not None else None)
    # As gRPC's TLS verifies: Python 3.13's default context adds OpenSSL's strict X.509 checks (RFC 5280's
    # extensions, e.g. an Authority Key Identifier), which would call a certificate gRPC accepts a failure.
    context.verify_flags &= ~(ssl.VERIFY_X509_STRICT | ssl.VERIFY_X509_PARTIAL_CHAIN)
    context.set_alpn_protocols(["h2"])
    if client_cert is not None:
        context.load_cert_chain(*client_cert)
    return _handshake_failure(
        address,
        context,
        server_name,
        timeout,
        ca_given=ca is not None,
        client_cert=None if client_cert is None else client_cert[0],
        after=True,
    )


def diagnose(
    address: str,
    timeout: float,
    *,
    tls: bool,
    roots: bytes | None = None,
    server_name: str | None = None,
    client_cert: tuple[str, str] | None = None,
) -> str | None:
    """Why ``address`` does not answer: :func:`probe`'s reason; where something listens, a TLS reason
    (starting "TLS: ") if there is one (``tls``: the client speaks TLS, trusting ``roots``, the system's
    when None, checking ``server_name`` and presenting ``client_cert``), else ""; None when it cannot tell."""
    # A TLS port may answer a plain opening in HTTP/1 (an nginx TLS proxy's does: "The plain HTTP request was
    # sent to HTTPS port"): where a TLS handshake completes, the port speaks TLS, whatever its plain answer.
    cause = probe(address, timeout=timeout, peek=not tls)
    if cause and (tls or cause not in _PROTOCOLS.values() or not speaks_tls(address, timeout)):
        return cause
    if tls:
        reason = tls_probe(address, roots, server_name, timeout, client_cert)
        if not reason or speaks_tls(address, timeout):  # (its certificate, or its name, is then the cause)
            return reason
        return probe(address, timeout=timeout) or reason  # (no TLS there: what its plain answer says it is)
    if cause or speaks_tls(address, timeout):
        return f"{TLS_CAUSE}the server speaks TLS, this client does not: pass its CA (tls=..., learner train --tls-ca)"
    return ""


def speaks_tls(address: str, timeout: float = 1.0) -> bool:
    """Whether the server at ``address`` completes a TLS handshake (its certificate not checked)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    return _handshake_failure(address, context, None, timeout) == ""


_PASS_CERT = (
    "pass a client certificate its CA signed and its key (tls_client_cert=PATH, tls_client_key=PATH; learner train "
    "--tls-client-cert PATH --tls-client-key PATH, or $ENVFLEET_TLS_CLIENT_CERT and $ENVFLEET_TLS_CLIENT_KEY)"
)
_PASS_SIGNED = "pass one signed by the CA it checks client certificates with (its --tls-client-ca)"
_PROXY = "so does a TLS proxy whose backend is down"
_PROXY_FIX = "behind a proxy, see that the server it forwards to is up"

CLIENT_CERT_REQUIRED = (
    "the server closed the connection right after the TLS handshake: a server that requires client certificates "
    f"(env-server --tls-client-ca) does this when the client presents none, and {_PROXY}. If it requires one, "
    f"{_PASS_CERT}; {_PROXY_FIX}"
)
"""What :func:`tls_probe` says of a server that ends the connection right after the handshake without a
word, to a client without a certificate (after ``TLS_CAUSE``). A gRPC server that requires client
certificates sends no alert; a proxy that ends TLS in front of a server that is down closes the same
way, and nothing on the wire tells the two apart: the reason names both."""

CLIENT_CERT_REFUSED = (
    "the server closed the connection right after the TLS handshake: a server that requires client certificates "
    "(env-server --tls-client-ca) does this when it refuses the client certificate given, {cert} (one its CA did "
    "not sign, one that has expired, or one not made for client authentication: extendedKeyUsage clientAuth), and "
    f"{_PROXY}. If it requires one, {_PASS_SIGNED}; {_PROXY_FIX}"
)
"""The same, to a client that presented the certificate ``{cert}``."""


def _client_cert_reason(client_cert: str | None, alert: str) -> str:
    """Why the server ended the connection at the TLS handshake, where the client's certificate may be
    the cause (``client_cert``: the one presented, or None). A server that names the certificate in an
    ``alert`` (TLS 1.2, or a server that says why) is certainly refusing it; without one ("") a TLS
    proxy whose backend is down is as likely (see :data:`CLIENT_CERT_REQUIRED`)."""
    if not alert:
        return CLIENT_CERT_REQUIRED if client_cert is None else CLIENT_CERT_REFUSED.format(cert=client_cert)
    if client_cert is None:
        return (
            f"the server requires a client certificate (env-server --tls-client-ca) and this client presents none "
            f"(alert: {alert}): {_PASS_CERT}"
        )
    return f"the server refuses the client certificate {client_cert} (alert: {alert}): {_PASS_SIGNED}"


def _handshake_failure(
    address: str,
    context: ssl.SSLContext,
    server_name: str | None,
    timeout: float,
    *,
    ca_given: bool = False,
    client_cert: str | None = None,
    after: bool = False,
) -> str | None:
    """ "" for a handshake that worked; a TLS reason it failed, where the server's answer says so; None
    when it cannot tell (no connection, or one closed or reset before any answer: a proxy whose
    backend is not up yet, say, which a wait may mend). ``after``: also see whether the server goes on
    once the handshake is done (see :func:`_ended_after_handshake`; ``client_cert``: the certificate
    presented, for the reason)."""
    try:
        opened = _connect(address, timeout)
    except (OSError, AddressError):
        return None
    if opened is None:
        return None
    sock, host = opened
    with sock:
        try:
            with context.wrap_socket(sock, server_hostname=server_name or host) as tls:
                ended = _ended_after_handshake(tls) if after else None
                return "" if ended is None else TLS_CAUSE + _client_cert_reason(client_cert, ended)
        except ssl.SSLCertVerificationError as err:
            why = str(err.verify_message or err.reason).rstrip(".")
            if err.verify_code in _UNKNOWN_ISSUER:
                why += (
                    " (it is not signed by the CA given)"
                    if ca_given
                    else " (it is not signed by any CA this machine trusts: give the servers' CA with tls=PATH, "
                    "learner train --tls-ca)"
                )
            elif err.verify_code in _NAME_MISMATCH and unix_path(address) and server_name in (None, UNIX_SERVER_NAME):
                why += (
                    f" (at a unix: address the certificate is checked for the name {UNIX_SERVER_NAME} unless "
                    "another is given: give a name it holds, tls_server_name=NAME, learner train --tls-server-name; "
                    f"or issue it for {UNIX_SERVER_NAME} too)"
                )
            elif err.verify_code in _NAME_MISMATCH:
                why += (
                    " (if the certificate is made for another name of the server, give that name: "
                    "tls_server_name=NAME, learner train --tls-server-name)"
                )
            return f"{TLS_CAUSE}the server's certificate does not verify: {why}"
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
            return None
        except ssl.SSLError as err:
            if err.reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"):
                return f"{TLS_CAUSE}the server does not speak TLS (a plaintext server? then connect without TLS)"
            if err.reason == "UNEXPECTED_EOF_WHILE_READING":
                return None
            if err.reason in _CLIENT_CERT_ALERTS:  # (TLS 1.2, or a server that says why)
                return TLS_CAUSE + _client_cert_reason(client_cert, err.reason)
            if err.reason in _NO_CERTIFICATE_FOR_NAME:
                return (
                    f"{TLS_CAUSE}the handshake failed: {err.reason} (the server, or a TLS proxy in front of it such as "
                    "Caddy, may have no certificate for the name asked, and an IP address asks none: connect by a "
                    "name its certificate holds, or give one: tls_server_name=NAME, learner train --tls-server-name)"
                )
            return f"{TLS_CAUSE}the handshake failed: {err.reason or err}"
        except OSError:
            return None


# OpenSSL's names of the alerts a server sends when it has no certificate for the name the client asked (its
# SNI), or was asked none (an IP address): Caddy's internal_error.
_NO_CERTIFICATE_FOR_NAME = ("TLSV1_ALERT_INTERNAL_ERROR", "TLSV1_UNRECOGNIZED_NAME")

# OpenSSL's names of the alerts a server sends about the client's certificate (none, or one it refuses).
_CLIENT_CERT_ALERTS = (
    "TLSV13_ALERT_CERTIFICATE_REQUIRED",
    "SSLV3_ALERT_BAD_CERTIFICATE",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED",
    "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
    "TLSV1_ALERT_UNKNOWN_CA",
)


def _ended_after_handshake(tls: ssl.SSLSocket) -> str | None:
    """Whether the server ends the connection (or alerts of the client's certificate) at once after a TLS
    handshake that went through on this side: "" when it closes without a word, the alert's name when it
    sends one about the certificate. Under TLS 1.3 a server checks the client's certificate after the
    client's side of the handshake is done: a gRPC server that requires client certificates then closes
    the connection, where one that accepts the client sends its HTTP/2 settings at once (a TLS proxy
    whose backend is down closes too). None when the server sends something, or nothing within the
    socket's timeout (cannot tell)."""
    try:
        return "" if tls.recv(1) == b"" else None
    except ssl.SSLError as err:  # (an EOF, or an alert: certificate required, unknown CA, ...)
        if isinstance(err, (ssl.SSLEOFError, ssl.SSLZeroReturnError)):
            return ""
        return err.reason if err.reason in _CLIENT_CERT_ALERTS else None
    except (ConnectionResetError, BrokenPipeError):  # (BrokenPipeError: a Unix socket, with OpenSSL 3.5)
        return ""
    except OSError:  # (a timeout: a server that says nothing first)
        return None


def unix_path(address: str) -> str | None:
    """The socket file of a ``unix:PATH`` (or ``unix:///abs/path``) address; None for other addresses.
    (:func:`expand_addresses` refuses the forms gRPC does not take: see :func:`_check_unix`.)"""
    if not address.startswith("unix:"):
        return None
    path = address[len("unix:") :]
    return path[2:] if path.startswith("//") else path


def _check_unix(address: str) -> None:
    """Refuse a ``unix:`` address gRPC would not connect to: ``unix://PATH`` with a relative PATH (gRPC
    takes ``u.sock`` in ``unix://u.sock`` for an authority, and refuses it: "authority-based URIs not
    supported by the unix scheme"), and one with no path."""
    path = unix_path(address)
    if not path:
        raise AddressError(
            f"server address {address!r}: no socket path; expected unix:PATH (unix:/abs/path or unix:relative/path)"
        )
    if address.startswith("unix://") and not path.startswith("/"):
        raise AddressError(
            f"server address {address!r}: unix://PATH needs an absolute path (unix:///abs/path, or unix:relative/path)"
        )
    if "," in path:
        raise AddressError(
            f"server address {address!r}: a comma in a Unix socket's path, where gRPC splits a unix: address (a "
            "list of addresses), so it cannot connect there; serve on a path without one"
        )


def _connect(address: str, timeout: float) -> tuple[socket.socket, str] | None:
    """A connection to ``address`` (``host:port`` or ``unix:PATH``) and the name TLS checks there by
    default (the host; :data:`UNIX_SERVER_NAME` for a Unix socket); None for an address of
    several servers (``dns:///name:port`` and the like). Raises OSError or AddressError."""
    path = unix_path(address)
    if path is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
        return sock, UNIX_SERVER_NAME
    if "/" in address:
        return None
    host, port = _split_host_port(address)
    if host.lower() != "localhost":
        return socket.create_connection((host, port), timeout=timeout), host
    # gRPC does not ask the system for localhost: it connects to [::1] and 127.0.0.1 (its resolvers' own
    # rule), where the system's look-up may give one of them only (127.0.0.1 on many distributions). As
    # gRPC, then: a server on either answers; else the first failure that is no missing address family.
    errors: list[OSError] = []
    for loopback in ("::1", "127.0.0.1"):
        try:
            return socket.create_connection((loopback, port), timeout=timeout), host
        except OSError as err:
            errors.append(err)
    absent = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT, errno.ENETUNREACH)
    raise next((err for err in errors if err.errno not in absent), errors[-1])


def _not_a_socket(path: str) -> str | None:
    try:
        mode = os.stat(path).st_mode if path else None
    except OSError:
        return None
    if mode is None or stat.S_ISSOCK(mode):
        return None
    return f"{path} is {'a folder' if stat.S_ISDIR(mode) else 'a file'}, not a socket"


def _expand_one(address: str, *, resolve: bool = True) -> list[str]:
    """The servers ``address`` names; with ``resolve`` False, ``[address]`` once it is found written right
    (a ``dns:`` name not looked up, a resolver not asked: see :func:`check_written`)."""
    if not isinstance(address, str) or not address.strip():
        raise AddressError(f"addresses: expected host:port, unix:PATH or dns:///name:port, got {address!r}")
    address = address.strip()
    if address.startswith("dns:"):
        if not resolve:
            _dns_target(address)  # validates
            return [address]
        return resolve_dns(address)
    if address.startswith("unix:"):
        _check_unix(address)
        return [address]
    scheme, sep, rest = address.partition(":")
    if sep and scheme in _RESOLVERS:
        return _RESOLVERS[scheme](rest) if resolve else [address]
    # http://host:port, gRPC's other schemes (ipv4:, ipv6:, vsock:, unix-abstract:), one misspelt (Unix:,
    # tcp:): said so, not as a host with a ':' in it or a port that is not a number. (A host named like
    # a scheme, tcp:5000, is a host:port still.)
    if sep and (
        rest.startswith("//")
        or (_SCHEME.fullmatch(scheme) and ("/" in rest or (scheme.lower() in _SCHEMES and not rest.isdigit())))
    ):
        known = ", ".join(f"{name}:NAME" for name in sorted(_RESOLVERS))
        lower = scheme.lower() in {"dns", "unix", "file", *_RESOLVERS} and scheme != scheme.lower()
        raise AddressError(
            f"server address {address!r}: unknown scheme {scheme!r}; expected host:port, unix:PATH, dns:///name:port"
            + (f", {known}" if known else "")
            + " or file:PATH"
            + (f" (schemes are lower case: {scheme.lower()}:)" if lower else "")
        )
    _split_host_port(address)  # validates
    return [address]


# A URI scheme (RFC 3986: a letter, then letters, digits, '+', '-' or '.'), and the schemes an address
# is likely to be written with by mistake here (gRPC's own, misspelt ones of ours, the web's).
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
_SCHEMES = {"dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock", "xds", "tcp", "http", "https", "grpc", "grpcs"}


def _split_host_port(target: str, address: str | None = None) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) -> (host, port); ``address``: the address ``target`` is part of, for errors.

    As strict as gRPC's own parsing, so that what it would not connect to is said at once, not as a
    server that does not answer: the port in ASCII digits, an IPv6 address in brackets, brackets that pair."""
    address = address or target
    dns = address.startswith("dns:")
    if target.startswith("["):  # [v6]:port
        host, closed, rest = target[1:].partition("]")
        sep, port_text = rest[:1], rest[1:]
        if not closed or not host or "[" in host or (rest and sep != ":"):
            raise AddressError(
                f"server address {address!r}: unbalanced brackets; write IPv6 addresses as [::1]:PORT"
                if not closed or "[" in host
                else f"server address {address!r}: expected [IPV6]:PORT (e.g. [::1]:50051)"
            )
        if not _is_ipv6(host):  # (gRPC takes [127.0.0.1]:PORT for a name, which never resolves)
            raise AddressError(
                f"server address {address!r}: expected an IPv6 address in the brackets, got {host!r}; "
                + (f"brackets are for IPv6 addresses: write {host}:PORT" if ":" not in host else "e.g. [::1]:PORT")
            )
    else:
        host, sep, port_text = target.rpartition(":")
        if "[" in host or "]" in host or "]" in port_text:
            raise AddressError(f"server address {address!r}: unbalanced brackets; write IPv6 addresses as [::1]:PORT")
    if not sep or not host:
        example = "dns:///name:50051" if dns else f"[{host}]:50051" if target.startswith("[") else "127.0.0.1:50051"
        raise AddressError(
            f"server address {address!r}: expected host:port (e.g. {example})"
            + ("" if dns else ", unix:PATH or dns:///name:port")
        )
    if ":" in host and not target.startswith("["):
        raise AddressError(
            f"server address {address!r}: the host {host!r} has a ':' in it; write IPv6 addresses as [::1]:PORT"
        )
    # (int() takes "+1", " 1", "1_0" and other scripts' digits: gRPC does not)
    if not (port_text.isascii() and port_text.isdigit()):
        raise AddressError(f"server address {address!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if not 0 < port < 65536:
        raise AddressError(f"server address {address!r}: port {port} is outside 1-65535")
    return host, port


def _is_ipv6(host: str) -> bool:
    """Whether ``host`` is an IPv6 address (with a zone, ``fe80::1%eth0``, as gRPC takes one)."""
    try:
        ipaddress.IPv6Address(host.partition("%")[0])
    except ValueError:
        return False
    return True


def _dns_target(address: str) -> tuple[str, int]:
    """``dns:///name:port`` (or ``dns:name:port``) -> (name, port)."""
    target = address[len("dns:") :]
    if target.startswith("//"):
        # dns://authority/name:port: the authority (a DNS server) is not supported; the system resolver is used.
        authority, _, target = target[2:].partition("/")
        if authority:
            raise AddressError(
                f"server address {address!r}: a DNS server in the address is not supported; use dns:///name:port"
            )
    return _split_host_port(target, address)


def _dns_name(address: str) -> str | None:
    """The name of a ``dns:`` address (None for other addresses, and for an IP address given as one)."""
    if not isinstance(address, str) or not address.strip().startswith("dns:"):
        return None
    host, _ = _dns_target(address.strip())
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host
    return None


# getaddrinfo's "no such name" (NXDOMAIN), "the name has no address" and "no answer now": a
# Kubernetes headless service has no records until one of its pods is ready (and `kubectl apply`
# starts the learner's Job with the env Deployment), Swarm's tasks.<service> none until a task runs.
_NOT_YET = {socket.EAI_NONAME, socket.EAI_AGAIN, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def resolve_dns(address: str) -> list[str]:
    """``dns:///name:port`` (or ``dns:name:port``) -> one ``ip:port`` per address, sorted.

    A name that does not resolve (yet) is :class:`NotReadyYet`: worth a wait."""
    host, port = _dns_target(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        why = "" if infos else "no address"
    except socket.gaierror as err:
        infos, why = [], err.strerror or str(err)
        if err.errno not in _NOT_YET:
            raise AddressError(f"server address {address!r}: cannot resolve {host!r}: {why}") from err
    if not infos:
        raise NotReadyYet(
            f"server address {address!r}: cannot resolve {host!r}: {why} (does the service run, with replicas, on "
            f"this network? compose: `docker compose up -d --wait --scale {host}=N`, then the learner on the same "
            "network; Kubernetes: a headless service's name, which has addresses once a pod is ready)",
            waiting_for=f"the name {host!r} to resolve ({address}: a service with no replica ready has no address yet)",
        )
    ips = sorted(
        {str(info[4][0]) for info in infos}, key=lambda ip: (ipaddress.ip_address(ip).version, ipaddress.ip_address(ip))
    )
    return [host_port(ip, port) for ip in ips]


async def probe_until(address: str, deadline: float, diagnose: Callable[[str, float], str | None]) -> str | None:
    """``diagnose(address, timeout)`` (:meth:`RemoteVectorEnv._diagnose`: "" when a plain connection
    opens and TLS is not the trouble), or None if it has not told by ``deadline``.

    On a daemon thread of its own: a name lookup that hangs may outlive the wait, but holds up no
    executor and no exit.
    """
    budget = deadline - time.monotonic()
    if budget <= 0:
        return None
    told: concurrent.futures.Future[str | None] = concurrent.futures.Future()

    def run() -> None:
        if not told.set_running_or_notify_cancel():  # (running, it cannot be cancelled any more)
            return
        try:
            told.set_result(diagnose(address, min(1.0, budget)))
        except Exception:  # only a diagnosis: the error says what it can without one
            log.debug("probing %s failed", address, exc_info=True)
            told.set_result(None)

    threading.Thread(target=run, name="envfleet-probe", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.wrap_future(told), budget)
    except TimeoutError:
        return None
