"""The ``env-server`` command: serve K copies of one env over gRPC."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import logging
import math
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from env_server.config import (
    COMPRESSIONS,
    DEFAULT_MAX_CONCURRENT_RPCS,
    DEFAULT_MAX_REQUEST_BYTES,
    MAX_MAX_CONCURRENT_RPCS,
    MAX_SPIN_WAIT_MS,
    MIN_MAX_CONCURRENT_RPCS,
    MIN_MAX_REQUEST_BYTES,
    VECTORIZATION_NOTES,
    ServerConfig,
    add_stepping_option,
    json_object_option,
    parse_int,
    parse_on_off,
)
from env_server.protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION
from env_server.tuning import (
    LOG_FORMATS,
    ShortErrorParser,
    VersionAction,
    configure_logging,
    prefer_fast_grpc_core,
    raise_fd_limit,
)
from env_server.variables import unread_variables

__all__ = ["LOG_LEVELS", "main", "parse_args", "server_variables", "usable_stdio"]

log = logging.getLogger("env_server.__main__")  # (its name under `python -m env_server` too)

LOG_LEVELS = ("debug", "info", "warning", "error")
"""The levels ``--log-level`` takes (in any case: ``INFO`` too)."""

EPILOG = (
    """\
examples:
  env-server --env CartPole-v1 --num-envs 4 --port 50051
  env-server --env ALE/Pong-v5 --num-envs 8 --wrappers atari --port 0
  env-server --env mypkg.envs:MyEnv --env-kwargs '{"difficulty": 3}' --unix-socket /tmp/env.sock

Every option can also be set by an environment variable (ENVFLEET_ENV, ENVFLEET_NUM_ENVS,
ENVFLEET_HOST, ENVFLEET_PORT, ENVFLEET_ENV_KWARGS, ENVFLEET_WRAPPERS, ENVFLEET_VECTORIZATION,
...: the option's name in capitals), as in the container image; a set ENVFLEET_* variable that no
envfleet command reads (a typo?) is warned of at start. When ready the server prints one line,
"listening on HOST:PORT", to stdout; logs go to stderr.

"""
    + VECTORIZATION_NOTES
)


def _env_default(name: str, default: Any) -> Any:
    # (parse_args finds the variable of an option by its dest: name each after the other)
    return os.environ.get(_variable(name), default)


def _variable(dest: str) -> str:
    """The environment variable that sets the option whose dest is ``dest``."""
    return f"ENVFLEET_{dest.upper()}"


# The options no variable sets: --help and --version, and --parent-pid (the learner's, for the servers it starts).
_NO_VARIABLE = frozenset({"help", "version", "parent_pid"})


def server_variables(parser: argparse.ArgumentParser | None = None) -> frozenset[str]:
    """The ``ENVFLEET_*`` variables env-server reads: one per option (``--num-envs``: ``ENVFLEET_NUM_ENVS``)."""
    actions = (parser or build_parser())._actions
    return frozenset(_variable(a.dest) for a in actions if a.option_strings and a.dest not in _NO_VARIABLE)


class _BadVariable:
    """The default of an option whose ENVFLEET_* variable does not parse: an error if no flag overrides it."""

    def __init__(self, text: str, message: str) -> None:
        self.text, self.message = text, message

    def __str__(self) -> str:  # (as --help shows the default)
        return self.text


def _on_off(text: str) -> bool:
    try:
        return parse_on_off(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _parse_variables(parser: argparse.ArgumentParser) -> None:
    """Parse the defaults that ENVFLEET_* variables give, as argparse parses a flag's value, so that
    an error names the variable, not the flag (argparse would say "argument --num-envs: ...")."""
    for action in parser._actions:
        variable = _variable(action.dest)
        if not action.option_strings or variable not in os.environ or not isinstance(action.default, str):
            continue
        parse = _on_off if isinstance(action, argparse.BooleanOptionalAction) else action.type
        if not callable(parse):
            continue
        try:
            action.default = parse(action.default)
        except argparse.ArgumentTypeError as err:
            why = str(err)
        except (TypeError, ValueError):
            why = f"invalid {getattr(parse, '__name__', repr(parse))} value: {action.default!r}"
        else:
            continue
        action.default = _BadVariable(action.default, f"{variable} (for {action.option_strings[0]}): {why}")


def _integer_in(least: int, most: float, expected: str) -> Callable[[str], int]:
    """An argparse type: an integer in [least, most] (as :func:`env_server.config.parse_int` reads it:
    ``1e3`` too, as the learner's options take it), refused as not ``expected``."""

    def parse(text: str) -> int:
        try:
            value = parse_int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not least <= value <= most:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
        return value

    return parse


def _number_in(most: float, expected: str, *, above_zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [0, most] ((0, most] with ``above_zero``; inf: time.sleep
    and asyncio raise OverflowError)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value > 0 if above_zero else value >= 0) and value <= most):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    return parse


_positive_int = _integer_in(1, math.inf, "a positive integer")
_port = _integer_in(0, 65535, "a port number 0-65535")
_request_bytes = _integer_in(
    MIN_MAX_REQUEST_BYTES, MAX_MESSAGE_BYTES, f"a number of bytes in [{MIN_MAX_REQUEST_BYTES}, {MAX_MESSAGE_BYTES}]"
)
_concurrent_rpcs = _integer_in(
    MIN_MAX_CONCURRENT_RPCS,
    MAX_MAX_CONCURRENT_RPCS,
    f"a whole number of calls in [{MIN_MAX_CONCURRENT_RPCS}, {MAX_MAX_CONCURRENT_RPCS}]",
)
_non_negative_float = _number_in(math.inf, "a finite number >= 0")
# (0 would end every claim before its learner's next call: the Hold stream that keeps a claim opens
# after the Handshake, and is refused once the claim has been silent for longer than 0 s)
_claim_timeout = _number_in(math.inf, "a finite number of seconds > 0", above_zero=True)
# (while the server waits awake, its event loop does nothing else)
_spin_wait_ms = _number_in(MAX_SPIN_WAIT_MS, f"milliseconds in [0, {MAX_SPIN_WAIT_MS:g}]")


def _path(text: str) -> str:
    """A type: a path, a leading ``~`` the home folder (as learner's path options take it): no shell expands a
    ``~`` after ``=`` (``--unix-socket=~/envs/a.sock``) or in a variable's value read here."""
    return os.path.expanduser(text)


def build_parser() -> argparse.ArgumentParser:
    p = ShortErrorParser(
        prog="env-server",
        description="Serve K copies of a gymnasium env over gRPC (envfleet.v1), stepped as one vector env.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action=VersionAction, suffix=f", protocol envfleet.v1 version {PROTOCOL_VERSION}")
    e = _env_default
    p.add_argument(
        "--env",
        default=e("env", None),
        help="gymnasium id (CartPole-v1) or entry point (package.module:ClassOrFactory)",
    )
    p.add_argument(
        "--num-envs",
        type=_positive_int,
        default=e("num_envs", "1"),
        metavar="N",
        help="envs hosted by this server (default: %(default)s)",
    )
    p.add_argument(
        "--host", default=e("host", "127.0.0.1"), help="interface to listen on; 0.0.0.0 for all (default: %(default)s)"
    )
    p.add_argument(
        "--port", type=_port, default=e("port", "50051"), help="TCP port; 0 picks a free one (default: %(default)s)"
    )
    p.add_argument(
        "--unix-socket",
        default=e("unix_socket", None),
        type=_path,
        metavar="PATH",
        help="listen on a Unix domain socket instead of TCP",
    )
    p.add_argument(
        "--step-socket",
        action=argparse.BooleanOptionalAction,
        default=e("step_socket", True),
        help="with --unix-socket PATH: also serve steps on PATH.steps, without HTTP/2, to learners on this "
        "host (a few times cheaper per step than gRPC in Python; default: on; ENVFLEET_STEP_SOCKET: on or off)",
    )
    p.add_argument(
        "--env-kwargs",
        type=json_object_option,
        default=e("env_kwargs", "{}"),
        metavar="JSON",
        help="keyword arguments for the env's constructor, as a JSON object",
    )
    add_stepping_option(p, "vectorization", e("vectorization", "sync"))
    wrappers = e("wrappers", "")
    p.add_argument(
        "--wrappers",
        default=wrappers,
        metavar="NAMES",
        help="comma-separated wrappers for every env, applied in order, each at most once: 'atari' (84x84 "
        "grayscale, frame skip 4, 4-frame stack), 'clip-action' (Box actions clipped to their bounds, as "
        "CleanRL's make_env does), 'flatten' (Dict/Tuple observations flattened into one Box, Discrete parts "
        "one-hot: gymnasium's FlattenObservation; for learners that take Box observations only, as "
        f"learner train does) (default: {wrappers.replace('%', '%%') or 'none'})",
    )
    add_stepping_option(p, "autoreset_mode", e("autoreset_mode", "NextStep"))
    p.add_argument(
        "--max-episode-steps",
        type=_positive_int,
        default=e("max_episode_steps", None),
        metavar="N",
        help="end every episode after N steps at most, as truncated (gymnasium's TimeLimit): over a gymnasium "
        "id's registered limit, or around an entry point's env, which gets none otherwise (default: the env's own)",
    )
    p.add_argument(
        "--step-delay-ms",
        type=_non_negative_float,
        default=e("step_delay_ms", "0"),
        metavar="MS",
        help="make every step take MS ms longer, like a slow simulator or robot (the server's envs wait "
        "concurrently; default: %(default)s)",
    )
    p.add_argument(
        "--spin-wait-ms",
        type=_spin_wait_ms,
        default=e("spin_wait_ms", "0"),
        metavar="MS",
        help="step socket: after answering a step, look for the learner's next one awake for up to MS ms "
        "(at most 10; polling, yielding the CPU) while its steps have been coming that soon, instead of "
        "sleeping at once: saves the wake-up a sleeping server costs per step, at the price of CPU time and "
        "of the server's other work (health checks, other calls) waiting up to MS ms; give it a server "
        "with a CPU to spare. Learners that start local servers on Unix sockets pass 0.5 when there are no "
        "more servers than CPUs, unless ENVFLEET_SPIN_WAIT_MS is set (default: %(default)s)",
    )
    p.add_argument(
        "--claim-timeout",
        type=_claim_timeout,
        default=e("claim_timeout", "30"),
        metavar="S",
        help="end a learner's claim after S s (> 0) with no connection (its Hold stream) and no calls; a claim "
        "whose connection closes ends at once (default: %(default)s)",
    )
    p.add_argument(
        "--fresh-envs",
        action=argparse.BooleanOptionalAction,
        default=e("fresh_envs", False),
        help="when a new learner claims envs that another learner's session ran, close them and build them "
        "again before answering its Handshake, so that it starts as the first one did: what the envs and "
        "their wrappers keep (NormalizeObservation's statistics, say) does not carry over from one learner "
        "to the next; a rebuild that fails fails that Handshake, and the next one tries again (default: "
        "off: the envs go on, reset, with their state; ENVFLEET_FRESH_ENVS: on or off)",
    )
    p.add_argument(
        "--grace",
        type=_non_negative_float,
        default=e("grace", "5"),
        metavar="S",
        help="on SIGTERM, let calls in flight finish for up to S s (default: %(default)s)",
    )
    p.add_argument(
        "--hang-timeout",
        type=_non_negative_float,
        default=e("hang_timeout", "0"),
        metavar="S",
        help="exit (status 3) when an env call (step or reset) has run for S s: a hung env cannot be stopped, "
        "and a server that exits is started again by whatever runs it (learner train, for the servers it "
        "starts: it passes 60, or twice its --timeout or --reset-timeout where more; Docker's restart policy; "
        "Kubernetes), where one that hangs would stay up serving nothing; 0: never (default: %(default)s)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=_request_bytes,
        default=e("max_request_bytes", str(DEFAULT_MAX_REQUEST_BYTES)),
        metavar="N",
        help="read requests (a step's actions, a reset's seeds and options) of up to N bytes, over gRPC and on "
        "the step socket; larger ones are refused before they are parsed (learners, told N as they connect, "
        "do not send them). Parsing a request can take ~25x its size in memory; responses (observations) may "
        f"take up to {MAX_MESSAGE_BYTES} bytes whatever N. {DEFAULT_MAX_REQUEST_BYTES} (4 MiB) holds nearly 8 times "
        "the actions of 1024 envs with Box(64,) float64 actions (default: %(default)s)",
    )
    p.add_argument(
        "--max-concurrent-rpcs",
        type=_concurrent_rpcs,
        default=e("max_concurrent_rpcs", str(DEFAULT_MAX_CONCURRENT_RPCS)),
        metavar="N",
        help="serve at most N gRPC calls at once, of all callers together, health checks included (a stream "
        'counts until it ends); past N, a call is refused at once with RESOURCE_EXHAUSTED ("Concurrent RPC limit '
        'exceeded!"), unread, and the server logs that it is full (at most a line every 10 s). Each call in '
        "progress holds its request in memory (up to --max-request-bytes), and the health service's calls need no "
        "token: N bounds what they hold. A learner keeps 2-3 calls open per server, a health probe one "
        f"(at least {MIN_MAX_CONCURRENT_RPCS}; default: %(default)s)",
    )
    p.add_argument(
        "--http2-bdp-probe",
        action=argparse.BooleanOptionalAction,
        default=e("http2_bdp_probe", False),
        help="let each call's HTTP/2 receive window grow to what the link carries (gRPC's BDP probing), instead of "
        "keeping it at 64 KiB: a request over 64 KiB (large actions) then takes no extra round trip across a slow "
        "link, but calls not yet served or refused (a flood) may each hold a few MB, not 64 KiB "
        "(default: off; ENVFLEET_HTTP2_BDP_PROBE: on or off)",
    )
    p.add_argument(
        "--compression",
        choices=COMPRESSIONS,
        default=e("compression", "none"),
        help="compress the server's gRPC answers (every method's, streamed or not) with gzip or deflate (gRPC "
        "message compression): learners decompress them by themselves; a client that accepts only the other "
        "algorithm gets that one, one that accepts neither gets them uncompressed. For slow links: a step of 4 "
        "Atari envs (--wrappers atari, 4x84x84 frame stacks) shrinks from 113 KB to ~1.3 KB, for ~1 ms more of the "
        "server's CPU a step (~0.5 ms of the learner's); small observations (CartPole's) gain next to nothing. The "
        "step socket (--unix-socket), local only, stays uncompressed (default: %(default)s)",
    )
    p.add_argument(
        "--metrics-port",
        type=_port,
        default=e("metrics_port", None),
        metavar="PORT",
        help="serve Prometheus metrics (step and reset latency histograms, steps, errors by method and status "
        "code, sessions, readiness, the process's CPU and memory) at http://HOST:PORT/metrics, from the moment "
        "the server listens (while its envs are built too, but for --vectorization async, which builds them before "
        "listening); 0 picks a free port (logged)",
    )
    security = p.add_argument_group(
        "security",
        "Both are off by default: anyone who can reach the port can use the envs.\nOff loopback, turn on both "
        "(the token, or client certificates: --tls-client-ca).",
    )
    security.add_argument(
        "--auth-token",
        default=e("auth_token", None),
        metavar="TOKEN",
        help="require this token with every call (learners: --auth-token / auth_token=...); wrong or missing: "
        "UNAUTHENTICATED. The health service stays open for probes. Visible in the process list: prefer "
        "ENVFLEET_AUTH_TOKEN or --auth-token-file",
    )
    security.add_argument(
        "--auth-token-file",
        default=e("auth_token_file", None),
        type=_path,
        metavar="PATH",
        help="read the token from this file (e.g. a mounted secret; surrounding whitespace is ignored)",
    )
    security.add_argument(
        "--tls-cert",
        default=e("tls_cert", None),
        type=_path,
        metavar="PATH",
        help="serve TLS with this certificate chain (PEM); learners verify it with the CA that signed it",
    )
    security.add_argument(
        "--tls-key", default=e("tls_key", None), type=_path, metavar="PATH", help="private key of --tls-cert (PEM)"
    )
    security.add_argument(
        "--tls-client-ca",
        default=e("tls_client_ca", None),
        type=_path,
        metavar="PATH",
        help="with --tls-cert: require every caller to present a client certificate signed by the CA(s) in "
        "this PEM file (mutual TLS; learners: --tls-client-cert/--tls-client-key); a caller without one, or "
        "with one another CA signed, fails its TLS handshake. The health service needs one too (the image's "
        "probe presents ENVFLEET_TLS_CLIENT_CERT/ENVFLEET_TLS_CLIENT_KEY)",
    )
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--log-level",
        default=e("log_level", "info"),
        type=str.lower,
        choices=LOG_LEVELS,
        metavar="LEVEL",
        help="what the server logs to stderr: debug, info, warning or error (default: %(default)s)",
    )
    p.add_argument(
        "--log-format",
        default=e("log_format", "text"),
        type=str.lower,
        choices=LOG_FORMATS,
        metavar="FORMAT",
        help="text: a line per record (time, level, logger, message); json: a JSON object per line (time, level, "
        "logger, message, exception), for log collectors (default: %(default)s)",
    )
    return p


def parse_args(argv: Sequence[str] | None = None) -> tuple[ServerConfig, tuple[str, str]]:
    """The server config, and the log level and format, the command line (and ENVFLEET_* variables) ask for."""
    parser = build_parser()
    _parse_variables(parser)
    args = parser.parse_args(argv)
    given = list(sys.argv[1:] if argv is None else argv)
    for action in parser._actions:
        # argparse checks the choices of values on the command line, not of defaults: those come
        # from ENVFLEET_* variables here.
        value = getattr(args, action.dest, None)
        if isinstance(value, _BadVariable):
            parser.error(value.message)
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(repr, action.choices))
            parser.error(
                f"ENVFLEET_{action.dest.upper()} (for {action.option_strings[0]}): invalid choice {value!r} (choose from {choices})"
            )
    if not args.env:
        parser.error("--env is required (or set ENVFLEET_ENV)")
    if not args.unix_socket and not args.host.strip():  # (shown with repr: an empty value is invisible)
        parser.error(
            f"{_said_by(given, '--host', 'host')} {args.host!r}: expected a host name or address (0.0.0.0 for all "
            "interfaces), got " + ("an empty one" if not args.host else "only whitespace")
        )
    wrappers = tuple(w.strip() for w in args.wrappers.split(",") if w.strip())  # (ServerConfig checks them)
    token = _auth_token(parser, args, given)
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key: give both (the certificate and its private key) or neither")
    if args.tls_client_ca and not args.tls_cert:
        parser.error(
            "--tls-client-ca (or ENVFLEET_TLS_CLIENT_CA): checks learners' client certificates in the TLS handshake, "
            "so the server must speak TLS: give --tls-cert and --tls-key too (its own certificate and key)"
        )
    try:
        config = ServerConfig(
            env=args.env,
            num_envs=args.num_envs,
            host=args.host,
            port=args.port,
            unix_socket=args.unix_socket,
            step_socket=args.step_socket,
            env_kwargs=args.env_kwargs,
            vectorization=args.vectorization,
            wrappers=wrappers,
            autoreset_mode=args.autoreset_mode,
            max_episode_steps=args.max_episode_steps,
            step_delay_ms=args.step_delay_ms,
            spin_wait_ms=args.spin_wait_ms,
            claim_timeout_s=args.claim_timeout,
            fresh_envs=args.fresh_envs,
            grace_s=args.grace,
            hang_timeout_s=args.hang_timeout,
            max_request_bytes=args.max_request_bytes,
            max_concurrent_rpcs=args.max_concurrent_rpcs,
            http2_bdp_probe=args.http2_bdp_probe,
            compression=args.compression,
            parent_pid=args.parent_pid,
            metrics_port=args.metrics_port,
            auth_token=token,
            tls_cert=args.tls_cert or None,
            tls_key=args.tls_key or None,
            tls_client_ca=args.tls_client_ca or None,
        )
    except ValueError as err:  # (ServerConfig names its field: named here as the flag that sets it)
        parser.error(_in_flag_terms(parser, str(err)))
    return config, (args.log_level, args.log_format)


# ServerConfig fields whose flag is not named after them.
_FIELD_DESTS = {"claim_timeout_s": "claim_timeout", "grace_s": "grace", "hang_timeout_s": "hang_timeout"}


def _in_flag_terms(parser: argparse.ArgumentParser, message: str) -> str:
    """A ServerConfig error ("field: expected ...") as about the flag (and variable) that set the field."""
    field, sep, rest = message.partition(": ")
    dest = _FIELD_DESTS.get(field, field)
    flags = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    if not sep or dest not in flags:
        return message
    return f"{flags[dest]} (or {_variable(dest)}): {rest}"


def _said_by(given: Sequence[str], flag: str, dest: str) -> str:
    """How an error names the option ``flag`` (whose dest is ``dest``): as the flag where the command line gave it,
    else as its variable where that is set (a compose file's ``ENVFLEET_HOST=``: no flag was given)."""
    if not any(_names(a, flag) for a in given) and _variable(dest) in os.environ:
        return _variable(dest)
    return flag


def _names(arg: str, flag: str) -> bool:
    """Whether the command-line word ``arg`` gives ``flag``: as it is, with ``=VALUE``, or abbreviated (``--ho``
    for ``--host``, which argparse takes)."""
    name = arg.partition("=")[0]
    return name.startswith("--") and len(name) > 2 and flag.startswith(name)


def _auth_token(parser: argparse.ArgumentParser, args: argparse.Namespace, given: Sequence[str]) -> str | None:
    """The token from --auth-token or --auth-token-file (not both), checked; None when neither is set. ``given``:
    the command line, for naming each as the user set it (flag or variable)."""
    from env_server.protocol import check_token

    token_by, file_by = (
        _said_by(given, "--auth-token", "auth_token"),
        _said_by(given, "--auth-token-file", "auth_token_file"),
    )
    if args.auth_token and args.auth_token_file:
        parser.error(f"{token_by} and {file_by}: give one of them, not both")
    if args.auth_token_file:
        try:
            with open(args.auth_token_file) as f:
                token = f.read().strip()
        except OSError as err:
            parser.error(f"{file_by} {args.auth_token_file}: cannot read it: {err.strerror}")
        where = f"{file_by} {args.auth_token_file}"
    elif args.auth_token:
        token, where = args.auth_token, token_by
    elif args.auth_token == "":  # set, but to nothing: `--auth-token "$TOKEN"` with TOKEN unset, say
        parser.error(
            "--auth-token (or ENVFLEET_AUTH_TOKEN): the token is empty; give one, or leave both out "
            "to serve without a token"
        )
    else:
        return None
    try:
        return check_token(token, where)
    except ValueError as err:
        parser.error(str(err))


def usable_stdio() -> None:
    """Make stdout and stderr fit for a command's writes, as its entry point's first step (env-server's,
    learner's): whatever they say then reaches its reader or nothing, and never ends the command.

    Closed when the command started (``>&-``, ``2>&-``; a service manager's), a stream is None in Python,
    where every print, flush or ``isatty()`` raises: it becomes os.devnull (opened once, for both), and so
    does its file descriptor (which the next file opened would otherwise take, and anything written to 1
    or 2, a server's "listening on" line, a child's output, would go into). A text stream's encoding that
    cannot say every character (``PYTHONIOENCODING=ascii``, an ASCII locale) writes those it cannot as
    escapes (``\\xe9``), as Python's stderr does, not a UnicodeEncodeError where a path or env name has them."""
    devnull: io.TextIOWrapper | None = None
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = getattr(sys, name)
        if stream is None:
            try:
                os.fstat(fd)
                closed = False
            except OSError:
                closed = True
            if devnull is None:
                devnull = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115  (the process's, to its end)
            if closed:  # (devnull's from now on, for this process and the children it starts: inheritable)
                if devnull.fileno() == fd:  # (opened on it: the lowest free descriptor)
                    os.set_inheritable(fd, True)
                else:
                    os.dup2(devnull.fileno(), fd)
            setattr(sys, name, devnull)
            if getattr(sys, f"__{name}__") is None:
                setattr(sys, f"__{name}__", devnull)
        elif isinstance(stream, io.TextIOWrapper):
            with contextlib.suppress(ValueError, OSError):  # (closed already, or detached: left as it is)
                stream.reconfigure(errors="backslashreplace")


def main(argv: Sequence[str] | None = None) -> int:
    # A fatal signal in an env's native code (a segfault in a simulator's bindings) leaves the Python stack of
    # each thread on stderr, the server's log (async workers, forked, inherit it), not a bare exit status.
    # No C stack (Python 3.14 prints one after the Python frames by default): its addresses would be the last
    # lines, all a learner's LocalServers quotes of a server that died (learner.local's tail).
    usable_stdio()
    with contextlib.suppress(ValueError, OSError, AttributeError):  # (a stderr with no file descriptor: a notebook's)
        if sys.version_info >= (3, 14):
            faulthandler.enable(c_stack=False)
        else:
            faulthandler.enable()
    # Before anything imports grpc (the parser does not).
    prefer_fast_grpc_core()
    # As under `python -m env_server`: modules in the working directory can be entry points
    # (--env mymodule:MyEnv) for the env-server command too.
    with contextlib.suppress(OSError):  # (a working directory removed since: nothing there to find)
        if (here := os.getcwd()) not in sys.path and "" not in sys.path:
            sys.path.insert(0, here)
    config, (log_level, log_format) = parse_args(argv)
    configure_logging(log_level, log_format)
    raise_fd_limit()  # (--vectorization async: about 3 a worker; a soft limit of 1024 stopped at ~330 envs)
    # gymnasium's AsyncVectorEnv says a worker's error as three warnings (in red) before it raises it, which the
    # server logs itself: the first and last say nothing more (the middle one, the worker's traceback, is kept).
    warnings.filterwarnings(
        "ignore",
        r"(\x1b\[[0-9;]*m)?ERROR: (Received the following error from Worker|Raising the last exception back)",
        UserWarning,
        r"gymnasium\.vector\.async_vector_env",
    )
    # (a warning, not an error: the same environment often carries the variables of other envfleet commands)
    for warning in unread_variables(os.environ, server_variables()):
        log.warning("%s", warning)
    # stdout carries exactly one line, "listening on ...", for scripts to read. Anything else that
    # writes to stdout (some envs print banners when built) goes to stderr instead.
    sys.stdout.flush()
    ready_fd = os.dup(1)
    os.dup2(2, 1)

    def on_ready(address: str) -> None:
        try:
            os.write(ready_fd, f"listening on {address}\n".encode())
        except OSError as err:  # (a full disk, a reader that left: the server serves all the same)
            log.warning(
                "could not write 'listening on %s' to stdout (%s); serving all the same", address, err.strerror or err
            )

    from env_server.envs import EnvBuildError
    from env_server.server import START_FAILED_STATUS, run

    try:
        status = run(config, on_ready)
    except (EnvBuildError, OSError) as err:
        _fatal(err, log_format)
        return START_FAILED_STATUS
    except KeyboardInterrupt:
        return 130
    return status


def _fatal(err: BaseException, log_format: str) -> None:
    """Say why the server could not start: ``env-server: error: ...``, as argparse says a bad option's (and
    learners that start servers look for), or under ``--log-format json`` a JSON record (level ERROR, logger
    env_server), which a log collector reading the server's stderr can parse, as it does the server's other lines."""
    if log_format == "json":
        logging.getLogger("env_server").error("%s", err)
    else:
        print(f"env-server: error: {err}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
