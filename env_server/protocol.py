"""Constants of the envfleet.v1 protocol that servers and clients share."""

from __future__ import annotations

import contextlib
import errno
import functools
import ipaddress
import socket
import ssl
import struct
import sys
import urllib.parse

__all__ = [
    "AUTH_METADATA_KEY",
    "DOUBLE_TAP_S",
    "ENV_INDEX_KEY",
    "ERROR_ORIGIN_KEY",
    "ERROR_ORIGIN_SERVER",
    "FRAME_ERROR",
    "FRAME_HEADER",
    "FRAME_STEP",
    "MAX_MESSAGE_BYTES",
    "MAX_UNIX_PATH",
    "NOT_OWNED",
    "PROTOCOL_VERSION",
    "SERVICE_NAME",
    "SHUTDOWN_REASON",
    "SHUTTING_DOWN_MESSAGE",
    "STEP_SOCKET_SUFFIX",
    "bearer_metadata",
    "bind_hint",
    "check_key_pair",
    "check_token",
    "dual_stack",
    "escape_surrogates",
    "grpc_target",
    "host_port",
    "host_problem",
    "http_host",
    "package_version",
    "peer_text",
    "runtime_versions",
    "unreadable_ca",
]

# Version of the protocol (the proto package is envfleet.v<PROTOCOL_VERSION>).
PROTOCOL_VERSION = 1

# Fully qualified gRPC service name, also the name the health service reports on.
SERVICE_NAME = "envfleet.v1.EnvService"

# Trailing-metadata key carrying the index (within the server) of the env an error is about, so a
# client can name the env by its index over the whole fleet.
ENV_INDEX_KEY = "envfleet-env-index"

# Trailing-metadata key every status the env server itself sends carries (value "env-server"). gRPC
# core also ends calls with INTERNAL when a connection breaks mid-stream ("Internal error from Core");
# without this mark a client cannot tell that from an env that raised.
ERROR_ORIGIN_KEY = "envfleet-origin"
ERROR_ORIGIN_SERVER = "env-server"

# Message size limit on both sides: an Atari batch of 64 envs x 4x84x84 uint8 is 1.8 MB; 64 MiB
# leaves room for large image observations while refusing absurd messages before they are read.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

DOUBLE_TAP_S = 0.5
"""A second Ctrl-C this soon after the first is the same press (a key pressed twice in a hurry, a
terminal's Ctrl-C sent twice), not a request to abort, in env-server and in the learner's commands alike:
aborting would throw away what the stop does (a drain, a checkpoint)."""

KEEPALIVE_TIMEOUT = 5.0
"""Seconds a server has to answer a learner's keepalive ping (RemoteVectorEnv's default ``keepalive_timeout``),
sent after 10 s without one: a server stopped or cut off is noticed within ~15 s, even during a longer
deadline."""

# The step socket (see the proto's header): a server on Unix socket PATH also listens on PATH + this.
STEP_SOCKET_SUFFIX = ".steps"


def _max_unix_path(platform: str) -> int:
    """The longest path a Unix socket can have on ``platform`` (a ``sys.platform``): sun_path holds 108
    bytes on Linux, 104 on macOS and the BSDs, NUL included; elsewhere the shorter, to be safe."""
    return 107 if platform.startswith("linux") else 103


# Longest path a Unix socket can have here (see _max_unix_path).
MAX_UNIX_PATH = _max_unix_path(sys.platform)

# A step-socket frame's header: the payload's length (uint32) and its kind (one byte), little-endian.
FRAME_HEADER = struct.Struct("<IB")
# Frame kinds: a StepRequest (client to server) or StepResponse (server to client); a StepError.
FRAME_STEP = 0
FRAME_ERROR = 1

# A server shutting down (SIGTERM: a scale-down, a restart, a rolling update) tells its learner so:
# the reason its session's Hold stream ends with, and the UNAVAILABLE message of the calls it refuses
# meanwhile. A learner counts such a departure apart from failures (a crash, a kill, a cut network).
SHUTDOWN_REASON = "server shutting down"
SHUTTING_DOWN_MESSAGE = "the server is shutting down; connect to another one"

# In the FAILED_PRECONDITION message of a call whose session does not own the server (released, timed
# out, ended, or another server's session): a client reads it on a step socket's first frame as "this
# socket is not my server's".
NOT_OWNED = "does not own this server"

# Metadata key of the shared token, sent as "Bearer <token>" (gRPC metadata keys are lower case).
AUTH_METADATA_KEY = "authorization"


# What gRPC reads in a unix: target as a URI's (a percent escape, a query, a fragment), escaped so that the path
# names the file as written: gRPC bound "unix:/tmp/q%41.sock" as /tmp/qA.sock (another server's socket, say).
_URI_ESCAPES = str.maketrans({"%": "%25", "#": "%23", "?": "%3F"})


def escape_surrogates(text: str) -> str:
    """``text`` with its lone surrogates backslash-escaped (``'caf\\udce9'``), which no wire form carries (protobuf's
    strings are UTF-8): Python decodes bytes that are not UTF-8 so (a file name's, an environment variable's)."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def grpc_target(address: str) -> str:
    """``address`` as gRPC is given it, to listen or connect: a ``unix:PATH``'s path escaped where gRPC would
    read it as a URI's (``%``, ``#``, ``?``); other addresses as they are. (A comma gRPC splits a unix: target
    at, escaped or not: such paths are refused where they are given.)"""
    return address.translate(_URI_ESCAPES) if address.startswith("unix:") else address


def host_port(host: str, port: int | str | None) -> str:
    """``host:port`` as an address is written: an IPv6 host in brackets (``[::1]:50051``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def bind_hint(host: str, code: int | None, *, host_option: str = "--host", port_option: str = "--port") -> str:
    """What to do about a TCP bind of ``host`` (given as ``host_option``) and ``port_option``'s port
    that failed with errno ``code`` (env-server's ports, ``learner train --metrics-port``'s)."""
    if code == errno.EADDRINUSE:
        return f"another process has it; pick another {port_option}, or 0 for a free one"
    if code == errno.EADDRNOTAVAIL and host == "127.0.0.1":  # (a host, or a container, with IPv6 loopback only)
        return (
            f"this machine has no IPv4 loopback; give {host_option} ::1 (IPv6 loopback), one of its own addresses, "
            "or 0.0.0.0 for all"
        )
    if code == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine; give {host_option} one of its own, or 0.0.0.0 for all"
    if code == errno.EACCES:
        return f"ports below 1024 need privileges; pick a higher {port_option}"
    return f"see {host_option} and {port_option}"


def host_problem(host: str, *, host_option: str = "--host", port_option: str = "--port") -> str | None:
    """What is wrong with ``host``, given as ``host_option`` (an address to listen on), if it is written as
    no host is (an IPv6 address in brackets, a host with a port), else None: said so, rather than as a
    name that does not resolve."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return None
    if host.startswith("[") and host.endswith("]"):
        return f"{host_option} {host!r}: write IPv6 addresses without brackets here: {host_option} {host[1:-1]}"
    name, sep, port = host.rpartition(":")
    if sep and name and port.isascii() and port.isdigit():
        return (
            f"{host_option} {host!r}: expected a host alone, got a host and a port; give the port with "
            f"{port_option}: {host_option} {name.removeprefix('[').removesuffix(']')} {port_option} {port}"
        )
    return None


def dual_stack() -> bool:
    """Whether this machine has IPv6, and a socket bound to ``::`` takes IPv4 connections too, asked to
    (``IPV6_V6ONLY`` off, as gRPC and the metrics endpoint ask: where ``net.ipv6.bindv6only`` is set too;
    not where the platform refuses, OpenBSD's)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(("::", 0))
            return sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
    except (OSError, AttributeError):  # (no IPv6; AttributeError: a Python built without it)
        return False


def http_host(host: str) -> str:
    """Where an HTTP endpoint (``/metrics``) of a process that listens on ``host`` listens: ``host``, but
    ``::`` for 0.0.0.0 where that takes IPv4 too (:func:`dual_stack`). gRPC listens on both families for
    0.0.0.0; Python's HTTP server, on IPv4 alone, so a pod's IPv6 address would reach gRPC and not it."""
    return "::" if host == "0.0.0.0" and dual_stack() else host


def peer_text(peer: str) -> str:
    """A call's peer (``context.peer()``) as logs show it: gRPC gives IPv6 peers percent-encoded
    (``ipv6:%5B::1%5D:50000``), ``ipv6:[::1]:50000`` here."""
    return urllib.parse.unquote(peer)


def check_token(token: str, where: str = "auth token") -> str:
    """``token`` if it can travel in gRPC metadata (printable ASCII, no spaces), else ValueError naming ``where``."""
    if not token:
        raise ValueError(f"{where}: expected a non-empty token, got an empty one")
    bad = [c for c in token if not 33 <= ord(c) <= 126]
    if bad:
        raise ValueError(
            f"{where}: expected printable ASCII without spaces (it travels in gRPC metadata), got {bad[0]!r} in it"
        )
    return token


def check_key_pair(cert: str, key: str, cert_name: str, key_name: str) -> None:
    """ValueError ("``cert_name`` CERT and ``key_name`` KEY: why") unless the PEM files ``cert`` (a
    certificate chain) and ``key`` (its private key, without a passphrase: gRPC takes none) are what
    they say and belong together. Servers check their own pair with it, learners their client
    certificate's: named at once, rather than as a handshake that fails later for no stated reason."""

    def no_passphrase() -> bytes:
        raise ValueError(f"{key_name} {key}: the key is encrypted; gRPC needs it without a passphrase")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(cert, key, password=no_passphrase)
    except ssl.SSLError as err:
        if err.reason == "KEY_VALUES_MISMATCH":
            reason = "the key is not the certificate's private key"
        elif "PEM lib" in str(err):
            reason = "one is not what it should be (swapped, or not a certificate and a key)"
        else:
            reason = str(err)
        raise ValueError(f"{cert_name} {cert} and {key_name} {key}: {reason}") from None


def unreadable_ca(data: bytes) -> str | None:
    """Why OpenSSL cannot read ``data`` (a PEM file's bytes) as CA certificate(s), in its words; None where it
    can. Said at once, rather than as gRPC's C core logging "Could not load any root certificate" and every
    connection failing as if no server answered."""
    try:
        # (as text: bytes would be read as DER; a bundle's comments may hold other than ASCII, as the system's do)
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=data.decode("ascii", "ignore"))
    except (ssl.SSLError, ValueError, TypeError) as err:
        return str(err)
    return None


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata a client sends with every call to authenticate with ``token``."""
    return ((AUTH_METADATA_KEY, f"Bearer {check_token(token)}"),)


@functools.cache
def package_version() -> str:
    """envfleet's installed version (for --version and the metrics' info), else the version in the
    pyproject.toml beside the package (a checkout's source run without installing it, PYTHONPATH=...). Found once
    (importlib.metadata reads every installed distribution's: ~60 ms)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("envfleet")
    except PackageNotFoundError:
        pass
    import tomllib
    from pathlib import Path

    try:
        with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as f:
            project = tomllib.load(f)["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "(not installed)"
    if project.get("name") != "envfleet":  # (the package copied into another project)
        return "(not installed)"
    return f"{project.get('version', '?')} (not installed)"


_DISTRIBUTIONS = {"grpc": "grpcio", "google.protobuf": "protobuf"}
"""Modules reported under their distribution's name, where it differs."""


@functools.cache
def source_commit() -> str | None:
    """The git commit envfleet's source is at when it runs from a checkout, ``+dirty`` with changes to
    tracked files not committed; installed from git (``pip install git+URL``), the commit pip recorded;
    None elsewhere (installed from a folder or a wheel, an image) or when git cannot say. (The
    version alone is the same at every commit: a learner's config.json and a server's EnvSpec.versions
    say it as ``envfleet_commit``, so that servers of a half-upgraded fleet are told apart.)"""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return _installed_commit()
    git = ["git", "-C", str(root)]
    environ = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # (git status must not take the index's lock)
    try:
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True)
        status = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
            env=environ,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def _installed_commit() -> str | None:
    """The commit an install from git was made of (PEP 610's direct_url.json, which pip writes), or None;
    None too where this module is not that install's (a copy run with PYTHONPATH beside it)."""
    import json
    from importlib.metadata import PackageNotFoundError, distribution
    from pathlib import Path

    try:
        installed = distribution("envfleet")
        if Path(str(installed.locate_file("env_server/protocol.py"))).resolve() != Path(__file__).resolve():
            return None
        recorded = installed.read_text("direct_url.json")
        commit = json.loads(recorded)["vcs_info"]["commit_id"] if recorded else None
    except (PackageNotFoundError, OSError, ValueError, KeyError, TypeError):
        return None
    return commit if isinstance(commit, str) and commit else None


def runtime_versions(*modules: str) -> dict[str, str]:
    """envfleet's and Python's versions, envfleet's commit where it runs from a git checkout
    (``envfleet_commit``: see :func:`source_commit`), and each of ``modules``' that is loaded (its
    ``__version__``), keyed by the name it is installed under: what made a run (config.json), what a
    server runs (EnvSpec.versions)."""
    import platform
    import sys

    versions = {"envfleet": package_version(), "python": platform.python_version()}
    commit = source_commit()
    if commit is not None:
        versions["envfleet_commit"] = commit
    for name in modules:
        version = getattr(sys.modules.get(name), "__version__", None)
        if isinstance(version, str):
            versions[_DISTRIBUTIONS.get(name, name)] = version
    return versions
