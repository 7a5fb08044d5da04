"""A health probe: ask an env server's gRPC health service whether it is SERVING (exit 0) or not (1).

    python -m env_server.health                       # 127.0.0.1:$ENVFLEET_PORT (default 50051)
    python -m env_server.health --address 10.0.0.5:50051 --service envfleet.v1.EnvService
    python -m env_server.health --tls-ca certs/ca.crt    # a server started with --tls-cert/--tls-key

The container image's HEALTHCHECK runs this file by path (``python -I .../health.py``), which skips
the package's ``__init__`` (numpy, gymnasium): a probe then costs grpc's import alone, ~0.1 s of CPU
every interval per replica. So this module imports nothing from ``env_server``.

The health service needs no auth token (probes cannot send one). A server that speaks TLS is asked
over TLS: in its container (``ENVFLEET_TLS_CERT`` set) the probe verifies it with ``ENVFLEET_TLS_CA``,
or, without one, with the server's own certificate file (a self-signed certificate, or a chain file
that ends with its CA); ``ENVFLEET_TLS_SERVER_NAME`` names the host the certificate is for when it
does not cover 127.0.0.1 or localhost (a ``unix:`` address is checked for localhost). A server that
requires client certificates (``ENVFLEET_TLS_CLIENT_CA``: mutual TLS, which the health service cannot
be left out of, as the handshake comes before any call) is shown ``ENVFLEET_TLS_CLIENT_CERT`` and
``ENVFLEET_TLS_CLIENT_KEY``, the variables a learner reads too. A TLS failure is told with what to
set: the name the probe checks (ENVFLEET_TLS_SERVER_NAME, else the host of the address, or localhost
for a ``unix:`` one), the CA it verifies with, or the client certificate the server asks for.
"""

from __future__ import annotations

import argparse
import math
import os
import ssl
import sys
import time
from collections.abc import Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

__all__ = ["check", "default_address", "default_addresses", "default_client_cert", "default_tls", "main", "tls_hint"]

# A server listening on every interface is asked on loopback: gRPC listens on both families for 0.0.0.0
# and ::, so both loopbacks, one after the other (a host or container may lack either: no IPv4 loopback,
# IPv6 disabled). (Not "[::]": the server refuses a --host in brackets, so the probe takes none either.)
_LOOPBACKS = {"": ("127.0.0.1", "::1"), "0.0.0.0": ("127.0.0.1", "::1"), "::": ("::1", "127.0.0.1")}


def default_address(environ: Mapping[str, str] = os.environ) -> str:
    """Where the server started with the same ``ENVFLEET_*`` variables listens, as seen from its host
    (the first of :func:`default_addresses`)."""
    return default_addresses(environ)[0]


def default_addresses(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The addresses the probe tries, in order, for the server started with the same ``ENVFLEET_*``
    variables: one, or for a server on every interface (0.0.0.0, ::) both loopbacks, its own family's first."""
    if environ.get("ENVFLEET_UNIX_SOCKET"):
        return [f"unix:{os.path.expanduser(environ['ENVFLEET_UNIX_SOCKET'])}"]  # (a ~ as env-server takes it)
    host = environ.get("ENVFLEET_HOST", "127.0.0.1")
    port = environ.get("ENVFLEET_PORT", "50051")
    return [f"[{h}]:{port}" if ":" in h else f"{h}:{port}" for h in _LOOPBACKS.get(host, (host,))]


# (env_server.protocol's: this file runs by path, importing nothing of env_server; see the module's docstring)
_URI_ESCAPES = str.maketrans({"%": "%25", "#": "%23", "?": "%3F"})


def _grpc_target(address: str) -> str:
    """``address`` as gRPC is given it (env_server.protocol.grpc_target's)."""
    return address.translate(_URI_ESCAPES) if address.startswith("unix:") else address


def default_tls(environ: Mapping[str, str] = os.environ) -> tuple[str | None, str | None]:
    """(CA file, server name) for probing the server started with the same ``ENVFLEET_*`` variables."""
    if not environ.get("ENVFLEET_TLS_CERT"):
        return None, None
    ca = environ.get("ENVFLEET_TLS_CA") or environ["ENVFLEET_TLS_CERT"]
    return ca, environ.get("ENVFLEET_TLS_SERVER_NAME") or None


def default_client_cert(environ: Mapping[str, str] = os.environ) -> tuple[str | None, str | None]:
    """(client certificate, its key) the probe presents to the server started with the same ``ENVFLEET_*``
    variables: ``ENVFLEET_TLS_CLIENT_CERT`` and ``ENVFLEET_TLS_CLIENT_KEY``, where the server speaks TLS."""
    if not environ.get("ENVFLEET_TLS_CERT"):
        return None, None
    return environ.get("ENVFLEET_TLS_CLIENT_CERT") or None, environ.get("ENVFLEET_TLS_CLIENT_KEY") or None


def check(
    address: str,
    service: str = "",
    timeout: float = 3.0,
    tls_ca: str | None = None,
    tls_server_name: str | None = None,
    tls_client_cert: str | None = None,
    tls_client_key: str | None = None,
) -> str:
    """The health status name (``SERVING``, ``NOT_SERVING``, ...) of ``service`` at ``address``.

    With ``tls_ca`` (a PEM file of CA certificates) the server is asked over TLS and verified with it;
    with ``tls_client_cert`` and ``tls_client_key`` too (PEM files), the probe presents that client
    certificate (for a server started with ``--tls-client-ca``). The certificate must hold
    ``tls_server_name``; by default the host of ``address``, and ``localhost`` for a ``unix:`` address
    (gRPC's own default there is the socket's path, which no certificate holds).

    Raises:
        grpc.RpcError: nothing answered within ``timeout`` seconds, or the service is unknown.
        OSError: a file cannot be read.
    """
    if tls_ca is None:
        channel = grpc.insecure_channel(_grpc_target(address))
    else:
        with open(tls_ca, "rb") as f:
            roots = f.read()
        key = chain = None
        if tls_client_cert is not None and tls_client_key is not None:
            with open(tls_client_cert, "rb") as f:
                chain = f.read()
            with open(tls_client_key, "rb") as f:
                key = f.read()
        credentials = grpc.ssl_channel_credentials(root_certificates=roots, private_key=key, certificate_chain=chain)
        name = tls_server_name or ("localhost" if address.startswith("unix:") else None)
        options = [("grpc.ssl_target_name_override", name)] if name else []
        channel = grpc.secure_channel(_grpc_target(address), credentials, options=options)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))


def tls_hint(
    details: str,
    address: str,
    tls_ca: str | None,
    tls_server_name: str | None,
    tls_client_cert: str | None = None,
    client_ca: bool = False,
) -> str:
    """What to do about the TLS failure gRPC's ``details`` tell of (" (TLS: ...)"), or "" for another failure.
    ``tls_client_cert``: the client certificate presented; ``client_ca``: the server requires one (its
    ``ENVFLEET_TLS_CLIENT_CA`` is set)."""
    if tls_ca is None:
        return ""
    if "Socket closed" in details and (client_ca or tls_client_cert):
        # A server requiring client certificates ends the connection right after the handshake
        # (TLS 1.3) when it has none it accepts: gRPC says no more than "Socket closed".
        if tls_client_cert is None:
            return (
                " (TLS: the server requires a client certificate (ENVFLEET_TLS_CLIENT_CA is set) and the probe "
                "presents none: set ENVFLEET_TLS_CLIENT_CERT and ENVFLEET_TLS_CLIENT_KEY (or --tls-client-cert "
                "and --tls-client-key) to a certificate that CA signed and its key)"
            )
        return (
            f" (TLS: the server ended the connection after the handshake: it may refuse the probe's client "
            f"certificate {tls_client_cert} (not signed by the CA of its ENVFLEET_TLS_CLIENT_CA, expired, or not "
            "for client authentication); set ENVFLEET_TLS_CLIENT_CERT and ENVFLEET_TLS_CLIENT_KEY to one it takes)"
        )
    if "Hostname Verification" in details:
        name = tls_server_name or _host(address)
        if tls_server_name:
            how = "--tls-server-name or ENVFLEET_TLS_SERVER_NAME"
        elif address.startswith("unix:"):
            how = "the name checked at a unix: address, as ENVFLEET_TLS_SERVER_NAME is not set"
        else:
            how = "the host of --address, as ENVFLEET_TLS_SERVER_NAME is not set"
        return (
            f" (TLS: the server's certificate does not hold the name {name!r} the probe checks ({how}): set "
            "ENVFLEET_TLS_SERVER_NAME (or --tls-server-name) to a DNS name or IP address the certificate holds, "
            f"or issue the certificate for {name})"
        )
    if "unable to get local issuer certificate" in details or "CERTIFICATE_VERIFY_FAILED" in details:
        return (
            f" (TLS: the server's certificate is not signed by a CA in {tls_ca}: set ENVFLEET_TLS_CA (or --tls-ca) "
            "to the CA that signed it; without ENVFLEET_TLS_CA the probe verifies with ENVFLEET_TLS_CERT itself, "
            "which works for a self-signed certificate or a chain file that ends with its CA)"
        )
    return ""


def _host(address: str) -> str:
    """The host the probe's TLS check expects in the certificate for ``address`` (gRPC's default authority;
    ``localhost`` for a Unix socket, where :func:`check` names it, as gRPC's default is the socket's path)."""
    if address.startswith("unix:"):
        return "localhost"
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():  # (no port: gRPC takes the whole address as the host)
        host = address
    return host.strip("[]")


def _positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0 (0 or less: every probe would fail at once,
    DEADLINE_EXCEEDED, a healthy server reported unhealthy)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _said_by(given: Sequence[str], flag: str, variable: str) -> str:
    """How a message names the option ``flag``: as the flag where the command line gave it, else as the variable
    its value came from, where that is set. (env_server.__main__ has its like: this file imports nothing of
    env_server, see the module's docstring.)"""
    if not any(_names(a, flag) for a in given) and os.environ.get(variable):
        return f"{flag} (from {variable})"
    return flag


def _names(arg: str, flag: str) -> bool:
    """Whether the command-line word ``arg`` gives ``flag``: as it is, with ``=VALUE``, or abbreviated as argparse
    takes it (``--tls-ca`` as ``--tls-ca=PATH`` or ``--tls-ca``'s unambiguous prefix)."""
    name = arg.partition("=")[0]
    return name.startswith("--") and len(name) > 2 and flag.startswith(name)


def _unreadable_tls(
    ca: tuple[str | None, str], cert: tuple[str | None, str], key: tuple[str | None, str]
) -> str | None:
    """What OpenSSL cannot read of the probe's TLS files (each a path and the option that named it), and why; None
    where it reads them all. (env_server.protocol has the learner's and server's checks: not imported here.)"""

    def no_passphrase() -> bytes:  # (a key with one: refused, rather than OpenSSL asking at the terminal)
        return b""

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if ca[0] is not None:
        try:
            context.load_verify_locations(ca[0])
        except (ssl.SSLError, ValueError) as err:
            return f"{ca[1]} {ca[0]}: expected PEM CA certificate(s), got ones OpenSSL cannot read ({err})"
    if cert[0] is not None and key[0] is not None:
        try:
            context.load_cert_chain(cert[0], key[0], password=no_passphrase)
        except (ssl.SSLError, ValueError) as err:
            return (
                f"{cert[1]} {cert[0]} and {key[1]} {key[0]}: expected a client certificate and its private key "
                f"(without a passphrase), got ones OpenSSL cannot read as such ({err})"
            )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """The probe's command: the server's health printed, exit status 0 where it is SERVING, else 1."""
    args = _parser().parse_args(argv)
    # (for a server on every interface, both loopbacks: the second tried only if the first cannot be reached)
    addresses = [args.address] if args.address else default_addresses()
    address = addresses[0]
    said = _said_tls_files(args, argv)
    # (said as the probe's other failures are, exit status 1: Docker reserves 2, argparse's)
    if (why := _tls_problem(args, said)) is not None:
        print(f"{address}: unhealthy: {why}", file=sys.stderr)
        return 1
    return _probe(args, addresses, said)


def _parser() -> argparse.ArgumentParser:
    """The probe's options, their defaults from the server's variables (a container's probe has those)."""
    parser = argparse.ArgumentParser(
        prog="python -m env_server.health",
        description="Exit 0 if the env server's gRPC health service says SERVING, 1 otherwise.",
    )
    parser.add_argument(
        "--address",
        default=None,
        help="host:port or unix:PATH (default: from ENVFLEET_HOST/ENVFLEET_PORT/ENVFLEET_UNIX_SOCKET, else 127.0.0.1:50051)",
    )
    parser.add_argument(
        "--service", default="", help="service to ask about ('' = the whole server, or envfleet.v1.EnvService)"
    )
    parser.add_argument(
        "--timeout",
        type=_positive_seconds,
        default=3.0,
        metavar="S",
        help="seconds to wait for an answer, > 0 (default: %(default)s)",
    )
    ca, name = default_tls()
    parser.add_argument(
        "--tls-ca",
        default=ca,
        type=os.path.expanduser,  # (no shell expands a ~ after '=')
        metavar="PATH",
        help="ask over TLS, verifying the server with these CA certificates (default: from ENVFLEET_TLS_CA or "
        "ENVFLEET_TLS_CERT when the server's variables say TLS; else plaintext)",
    )
    parser.add_argument(
        "--tls-server-name",
        default=name,
        metavar="NAME",
        help="the name the server's certificate holds, if not the host of --address (localhost for a unix: "
        "address) (default: ENVFLEET_TLS_SERVER_NAME)",
    )
    cert, key = default_client_cert()
    parser.add_argument(
        "--tls-client-cert",
        default=cert,
        type=os.path.expanduser,  # (no shell expands a ~ after '=')
        metavar="PATH",
        help="with TLS: present this client certificate (PEM), for a server started with --tls-client-ca "
        "(default: ENVFLEET_TLS_CLIENT_CERT when the server's variables say TLS)",
    )
    parser.add_argument(
        "--tls-client-key",
        default=key,
        type=os.path.expanduser,  # (no shell expands a ~ after '=')
        metavar="PATH",
        help="the private key (PEM) of --tls-client-cert (default: ENVFLEET_TLS_CLIENT_KEY when the server's "
        "variables say TLS)",
    )
    return parser


_Said = tuple[str | None, str]
"""A TLS file of the probe's: its path (None: not given), and the option or variable that named it."""


def _said_tls_files(args: argparse.Namespace, argv: Sequence[str] | None) -> tuple[_Said, _Said, _Said]:
    """The probe's CA, client certificate and key, each with the option or variable that named it, as errors say."""
    given = list(sys.argv[1:] if argv is None else argv)
    ca_variable = "ENVFLEET_TLS_CA" if os.environ.get("ENVFLEET_TLS_CA") else "ENVFLEET_TLS_CERT"
    # Each named as the user set it (a container's probe gets them from the server's variables), and read as
    # OpenSSL will: else gRPC's C core logged "Could not load any root certificate" and every handshake failed.
    said_ca = (args.tls_ca, _said_by(given, "--tls-ca", ca_variable))
    said_cert = (args.tls_client_cert, _said_by(given, "--tls-client-cert", "ENVFLEET_TLS_CLIENT_CERT"))
    said_key = (args.tls_client_key, _said_by(given, "--tls-client-key", "ENVFLEET_TLS_CLIENT_KEY"))
    return said_ca, said_cert, said_key


def _tls_problem(args: argparse.Namespace, said: tuple[_Said, _Said, _Said]) -> str | None:
    """What is wrong with the probe's TLS options or files, said before any connection; None where nothing is."""
    if (args.tls_client_cert is None) != (args.tls_client_key is None):
        return (
            "--tls-client-cert and --tls-client-key (or ENVFLEET_TLS_CLIENT_CERT and "
            "ENVFLEET_TLS_CLIENT_KEY): give both (the client certificate and its private key) or neither"
        )
    if args.tls_client_cert is not None and args.tls_ca is None:
        return "--tls-client-cert: presents a client certificate over TLS; give --tls-ca too"
    for path, option in said:
        if path is None:
            continue
        try:
            with open(path, "rb") as f:
                pem = b"-----BEGIN " in f.read()
        except OSError as err:
            return f"cannot read {option} {path}: {err.strerror}"
        if not pem:
            return f"{option} {path}: expected a PEM file (-----BEGIN ...), got none"
    return _unreadable_tls(*said)


def _probe(args: argparse.Namespace, addresses: list[str], said: tuple[_Said, _Said, _Said]) -> int:
    """Ask the server's health at the first of ``addresses`` that can be reached and print it: the exit status."""
    address = addresses[0]
    deadline = time.monotonic() + args.timeout
    failures: list[tuple[str, grpc.RpcError]] = []
    for tried in addresses:
        # The certificate is checked for the first address's host whichever loopback answers (as documented:
        # 127.0.0.1 for 0.0.0.0, ::1 for ::), unless ENVFLEET_TLS_SERVER_NAME names another.
        name = args.tls_server_name or (_host(address) if tried != address else None)
        try:
            status = check(
                tried,
                args.service,
                max(deadline - time.monotonic(), 0.001),
                args.tls_ca,
                name,
                args.tls_client_cert,
                args.tls_client_key,
            )
        except OSError as err:  # (gone since it was read above)
            option = next((named for path, named in said if path == err.filename), "--tls-ca")
            print(f"{address}: unhealthy: cannot read {option} {err.filename}: {err.strerror}", file=sys.stderr)
            return 1
        except grpc.RpcError as err:
            if err.code() is grpc.StatusCode.NOT_FOUND:
                print(f"{tried}: unhealthy: the server knows no service {args.service!r}", file=sys.stderr)
                return 1
            failures.append((tried, err))
            if not _no_connection(err) or time.monotonic() >= deadline:
                break  # (an answer, a TLS handshake, a timeout: the server is there; the other loopback says no more)
        else:
            print(f"{tried}: {status}")
            return 0 if status == "SERVING" else 1
    client_ca = bool(os.environ.get("ENVFLEET_TLS_CLIENT_CA"))
    for tried, failure in failures:
        details = _unquoted(str(failure.details()))
        hint = tls_hint(details, address, args.tls_ca, args.tls_server_name, args.tls_client_cert, client_ca)
        print(f"{tried}: unhealthy: {failure.code().name}: {details}{hint}", file=sys.stderr)
    return 1


# What gRPC says of a connection that could not be made (nothing listens, no such loopback here), after which
# the other loopback is tried: not of one made whose TLS handshake failed (tried again, the same failure).
_NO_CONNECTION = ("Failed to connect to remote host", "connect failed", "Network is unreachable", "not supported")


def _no_connection(err: grpc.RpcError) -> bool:
    details = str(err.details())
    return err.code() is grpc.StatusCode.UNAVAILABLE and any(words in details for words in _NO_CONNECTION)


def _unquoted(details: str) -> str:
    """gRPC's error text with IPv6 addresses as written (``ipv6:[::1]:50051``), not percent-encoded
    (``ipv6:%5B::1%5D:50051``), as the server's logs show peers (``env_server.protocol.peer_text``)."""
    return details.replace("%5B", "[").replace("%5D", "]")


if __name__ == "__main__":
    sys.exit(main())
