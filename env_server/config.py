"""ServerConfig: everything an env server is started with (only the CLI reads the command line)."""

from __future__ import annotations

import argparse
import json
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from env_server.protocol import MAX_MESSAGE_BYTES

__all__ = [
    "AUTORESET_MODES",
    "COMPRESSIONS",
    "DEFAULT_MAX_CONCURRENT_RPCS",
    "DEFAULT_MAX_REQUEST_BYTES",
    "MAX_MAX_CONCURRENT_RPCS",
    "MAX_SPIN_WAIT_MS",
    "MIN_MAX_CONCURRENT_RPCS",
    "MIN_MAX_REQUEST_BYTES",
    "VECTORIZATIONS",
    "VECTORIZATION_NOTES",
    "WRAPPER_NAMES",
    "add_stepping_option",
    "parse_int",
    "parse_on_off",
    "ServerConfig",
]

VECTORIZATIONS = ("sync", "async", "vector_entry_point")
AUTORESET_MODES = ("NextStep", "SameStep", "Disabled")
VECTORIZATION_NOTES = """\
vectorization (default sync): the server is already its own process, and a fleet gets its
parallelism from many servers, so stepping a server's envs one after another in-process costs
nothing extra per step, gives results identical to gymnasium's SyncVectorEnv/AsyncVectorEnv for the
same seeds (but for infos whose types differ between envs: widened, not cut; see the README), and
works for every env and wrapper. Use async for envs whose step takes milliseconds of CPU (one
subprocess per env uses more cores), and vector_entry_point for envs with their own batched
implementation (much faster for CartPole, but its random streams differ from gymnasium's per-env
seeding).
"""
"""What ``--vectorization``'s help points to ("see below"): the epilog of env-server and of ``learner check``."""
COMPRESSIONS = ("none", "gzip", "deflate")
"""How a server may compress its gRPC answers (``env-server --compression``): gRPC's message compressions."""
WRAPPER_NAMES = ("atari", "clip-action", "flatten")
"""The wrappers an operator may name (``env_server.envs.WRAPPERS`` holds their code)."""
MAX_SPIN_WAIT_MS = 10.0
"""Longest ``spin_wait_ms``: while it waits awake, the server's event loop does nothing else."""
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
"""Default ``max_request_bytes``. Requests carry actions, seeds and reset options: a large one, 1024
envs with Box(64,) float64 actions, is 0.5 MiB. Parsing a request can take ~25x its size in memory
before the server looks at it (a list of empty Values: 2 bytes each on the wire, ~50 parsed): ~100 MB
at 4 MiB, where the old limit, 64 MiB, let one request take 1.6 GB (tests/measure_request_memory.py)."""
MIN_MAX_REQUEST_BYTES = 4096
"""Smallest ``max_request_bytes``: room for every Handshake, Hold and Release request."""
MIN_MAX_CONCURRENT_RPCS = 4
"""Smallest ``max_concurrent_rpcs``: a learner's Hold stream, StepStream and one call more, and a health probe."""
MAX_MAX_CONCURRENT_RPCS = 2**31 - 1
"""Largest ``max_concurrent_rpcs``: gRPC's core counts them in a C int."""
DEFAULT_MAX_CONCURRENT_RPCS = 32
"""Default ``max_concurrent_rpcs``. A learner keeps 2-3 calls open on each of its servers (the Hold
stream, the StepStream, a Reset, GetSpec or Release now and then), a health probe one for a moment,
and another learner asking whether the envs are free one more: 32 leaves room for all of them many
times over. Each call in progress holds its request (up to ``max_request_bytes``; ~8 MB a call of
4 MB while it is read), and the health service's calls need no token: 64 connections x 8 Health
Check calls of 4 MB at once took a server's peak RSS to 1.2-1.3 GB without a limit, ~0.45 GB with
32 (~0.23 GB with 8, ~0.66 GB with 64)."""


_STEPPING_OPTIONS = {
    "vectorization": (VECTORIZATIONS, "how the server steps its envs (default: %(default)s; see below)"),
    "autoreset_mode": (AUTORESET_MODES, "gymnasium autoreset mode (default: %(default)s)"),
}


def add_stepping_option(parser: argparse.ArgumentParser, dest: str, default: str | None = None) -> None:
    """``--vectorization`` or ``--autoreset-mode`` (``dest``) as env-server takes it, one definition for the commands
    that start a server to step as an operator's would (``learner check``): its choices, help, and ServerConfig's
    default unless ``default`` (env-server's, from its ENVFLEET_* variable)."""
    choices, help_text = _STEPPING_OPTIONS[dest]
    parser.add_argument(
        f"--{dest.replace('_', '-')}",
        choices=choices,
        default=ServerConfig.__dataclass_fields__[dest].default if default is None else default,
        help=help_text,
    )


def parse_int(text: str) -> int:
    """``text`` as an int: decimal (``1000000``, ``1_000_000``) or a whole number in float notation
    (``1e6``, ``2.5e5``), as budgets often are; ValueError otherwise (``1.5``, ``inf``, ``x``). Every
    integer option of env-server and the learner reads this way."""
    try:
        return int(text)
    except ValueError:
        value = float(text)  # (raises on what is no number at all)
    if not (math.isfinite(value) and value.is_integer()):
        raise ValueError(f"not a whole number: {text!r}")
    return int(value)


_ON_OFF = {"on": True, "true": True, "1": True, "yes": True, "off": False, "false": False, "0": False, "no": False}


def parse_on_off(text: str) -> bool:
    """A switch's value from an environment variable: on or off (or true/false, 1/0, yes/no, any case);
    ValueError otherwise. The ENVFLEET_* variables of env-server's switches and the learner's read this way."""
    try:
        return _ON_OFF[text.strip().lower()]
    except KeyError:
        raise ValueError(f"expected on or off (or true/false, 1/0, yes/no), got {text!r}") from None


def _clipped(text: str, most: int = 200) -> str:
    """``repr(text)``, its middle left out where it is longer than ``most`` characters (a file's worth of JSON
    pasted into an option: the error shows its start and end)."""
    if len(text) <= most:
        return repr(text)
    half = most // 2
    return f"{text[:half]!r} ... {text[-half:]!r} ({len(text):,} characters)"


def json_object_option(text: str) -> dict[str, Any]:
    """``text`` as a JSON object (a dict): the argparse type of --env-kwargs (env-server's, and the learner's
    commands'), and of ENVFLEET_ENV_KWARGS. argparse.ArgumentTypeError otherwise, which argparse shows as
    it is: argparse's own words for a ValueError or a RecursionError would be "invalid json_object_option
    value" or a traceback."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(
            f"expected a JSON object, got {_clipped(text)}: not valid JSON ({err.msg} at column {err.colno})"
        ) from None
    except ValueError as err:  # (an integer of over 4,300 digits: Python's limit on converting one)
        raise argparse.ArgumentTypeError(f"expected a JSON object Python can read, got one it cannot: {err}") from None
    except RecursionError as err:  # ([[[[... some thousands deep)
        raise argparse.ArgumentTypeError(
            f"expected a JSON object, got JSON nested too deeply to read ({err})"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"expected a JSON object like '{{\"key\": 1}}', got {type(value).__name__}: {_clipped(text)}"
        )
    return value


@dataclass(frozen=True)
class ServerConfig:
    """How one env server is built and served."""

    env: str
    """A gymnasium id (``CartPole-v1``) or an entry point (``package.module:ClassOrFactory``)."""
    num_envs: int = 1
    """How many copies of the env this server hosts and steps together (K)."""
    host: str = "127.0.0.1"
    """Interface to listen on; ``0.0.0.0`` (or ``::``) for all, as in a container."""
    port: int = 50051
    """TCP port; 0 picks a free one (printed in the ``listening on`` line)."""
    unix_socket: str | None = None
    """Listen on this Unix domain socket path instead of TCP (fastest for a learner on the same host)."""
    step_socket: bool = True
    """With ``unix_socket``: also serve steps on ``unix_socket + ".steps"`` without HTTP/2 (see the proto)."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for every env's constructor (``gymnasium.make(id, **env_kwargs)``)."""
    vectorization: str = "sync"
    """How the K envs are stepped: ``sync`` (in this process, one after another), ``async`` (one
    subprocess each) or ``vector_entry_point`` (the env's own batched implementation)."""
    wrappers: tuple[str, ...] = ()
    """Named wrappers applied to every env, in order (see ``env_server.envs.WRAPPERS``)."""
    autoreset_mode: str = "NextStep"
    """gymnasium's AutoresetMode for the vector env: NextStep, SameStep or Disabled."""
    max_episode_steps: int | None = None
    """A time limit for every env (gymnasium's ``TimeLimit``): ``gymnasium.make``'s ``max_episode_steps``
    for an id (over its registered one), a ``TimeLimit`` around an entry point's env, which has none
    of its own; None: the env's own, if any."""
    step_delay_ms: float = 0.0
    """Extra latency per step (a slow simulator or robot); the server's envs wait concurrently."""
    spin_wait_ms: float = 0.0
    """Step socket: after answering a step, look for the learner's next one awake (polling, yielding
    the CPU) for up to this long, while its steps have been coming that soon; 0: sleep at once."""
    claim_timeout_s: float = 30.0
    """A session with no open Hold stream and no calls for this long ends by itself."""
    fresh_envs: bool = False
    """Close the envs and build them again when a new learner's session claims envs that ran in another's
    (at its Handshake), so that it starts from envs as fresh as the first session's: wrappers' state
    (NormalizeObservation's statistics, ...) and the envs' own do not carry over. Off: they go on."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Largest request read, over gRPC and on the step socket: a larger one is refused before it is
    parsed (responses may take up to ``MAX_MESSAGE_BYTES``); told to learners in the Handshake."""
    parent_pid: int | None = None
    """Exit when this process is gone (set by learners that start servers as subprocesses)."""
    grace_s: float = 5.0
    """On SIGTERM/SIGINT: seconds to let calls in flight finish before exiting."""
    hang_timeout_s: float = 0.0
    """An env call (step or reset) still running after this long makes the server exit (status
    ``HUNG_EXIT_STATUS``), so that whatever runs it (a learner's local servers, Docker's restart
    policy, Kubernetes) starts it again: a hung call can be neither stopped nor waited out. 0: never."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (0: any free one) at ``/metrics``, on ``host`` (127.0.0.1
    for a Unix-socket server); None: no metrics."""
    auth_token: str | None = field(default=None, repr=False)
    """Calls must carry ``authorization: Bearer <auth_token>`` metadata (UNAUTHENTICATED otherwise);
    the health service stays open. None: no token needed. Kept out of ``repr`` (and so out of logs)."""
    tls_cert: str | None = None
    """Path of the server's TLS certificate chain (PEM); with ``tls_key``, the server speaks TLS only."""
    tls_key: str | None = None
    """Path of the private key (PEM) of ``tls_cert``."""
    tls_client_ca: str | None = None
    """Path of the CA certificate(s) (PEM) that sign the clients' certificates: with it, every caller
    must present a certificate that CA signed, or its TLS handshake fails (mutual TLS; the health
    service's callers too, as the handshake comes before any call). Needs ``tls_cert``. None: no
    client certificates asked for."""
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS
    """Calls in progress at once, of every caller and service together (a stream counts until it
    ends); gRPC refuses more with RESOURCE_EXHAUSTED before reading their requests (see
    DEFAULT_MAX_CONCURRENT_RPCS)."""
    http2_bdp_probe: bool = False
    """Let gRPC grow each call's HTTP/2 receive window to what the link carries (BDP probing), instead
    of keeping it at 64 KiB: requests over 64 KiB then take no extra round trip on slow links, but a
    flood of calls can make the server hold up to a few MB each before refusing them."""
    compression: str = "none"
    """How the server compresses its gRPC answers (every method's, streamed or not): ``none``, ``gzip``
    or ``deflate``, gRPC's message compression, as each client accepts it (one that accepts only the
    other algorithm gets that one; one that accepts neither, uncompressed answers). The step socket's
    answers are never compressed: it is local only."""

    def __post_init__(self) -> None:
        """Raise ValueError, naming the field, what it must be and what came, for a config no server
        can run (the CLI checks its options first, with messages that name the flags)."""
        if not isinstance(self.env, str) or not self.env:
            raise ValueError(f"env: expected a gymnasium id or a package.module:Name entry point, got {self.env!r}")
        _check_integer("num_envs", self.num_envs, 1)
        _check_port("port", self.port)
        for name in ("step_socket", "http2_bdp_probe", "fresh_envs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected True or False, got {getattr(self, name)!r}")
        if self.metrics_port is not None:
            _check_port("metrics_port", self.metrics_port)
        _check_choice("vectorization", self.vectorization, VECTORIZATIONS)
        _check_choice("autoreset_mode", self.autoreset_mode, AUTORESET_MODES)
        _check_choice("compression", self.compression, COMPRESSIONS)
        if (
            not isinstance(self.wrappers, Sequence)
            or isinstance(self.wrappers, str)
            or not all(isinstance(w, str) for w in self.wrappers)
        ):
            raise ValueError(f"wrappers: expected a tuple of wrapper names, got {self.wrappers!r}")
        unknown = [w for w in self.wrappers if w not in WRAPPER_NAMES]
        if unknown:
            raise ValueError(
                f"wrappers: expected names among {', '.join(WRAPPER_NAMES)}, got unknown wrapper {unknown[0]!r}"
            )
        twice = _duplicate_wrapper(self.wrappers)
        if twice is not None:
            raise ValueError(
                f"wrappers: expected each wrapper at most once (each applies once), got {twice!r} twice in "
                f"{','.join(self.wrappers)!r}"
            )
        if self.max_episode_steps is not None:
            _check_integer("max_episode_steps", self.max_episode_steps, 1)
            if self.vectorization == "vector_entry_point":
                raise ValueError(
                    "max_episode_steps: a time limit wraps each env, and vector_entry_point vectorization has "
                    "none to wrap; give the limit in env_kwargs if the env's vector entry point takes one"
                )
            if "atari" in self.wrappers:
                raise ValueError(
                    "max_episode_steps: the time limit wraps each env inside the atari wrapper, where it would "
                    "count frames (4 an agent step), not steps; give ALE's own in env_kwargs "
                    '({"max_num_frames_per_episode": N}, in frames)'
                )
        _check_duration("step_delay_ms", self.step_delay_ms)
        _check_duration("spin_wait_ms", self.spin_wait_ms, MAX_SPIN_WAIT_MS)
        _check_duration("claim_timeout_s", self.claim_timeout_s)
        _check_integer("max_request_bytes", self.max_request_bytes, MIN_MAX_REQUEST_BYTES, MAX_MESSAGE_BYTES)
        _check_integer(
            "max_concurrent_rpcs", self.max_concurrent_rpcs, MIN_MAX_CONCURRENT_RPCS, MAX_MAX_CONCURRENT_RPCS
        )
        _check_duration("grace_s", self.grace_s)
        _check_duration("hang_timeout_s", self.hang_timeout_s)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key: give both (the certificate and its private key) or neither")
        if self.tls_client_ca is not None and (not isinstance(self.tls_client_ca, str) or not self.tls_client_ca):
            raise ValueError(f"tls_client_ca: expected the path of a PEM file, or None, got {self.tls_client_ca!r}")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError(
                "tls_client_ca: verifies the clients' certificates in the TLS handshake, so the server needs "
                "TLS of its own: give tls_cert and tls_key too"
            )


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")


def _check_integer(name: str, value: object, least: int, most: float = math.inf, expected: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not least <= int(value) <= most:
        if not expected:
            expected = f"an integer in [{least}, {most}]" if math.isfinite(most) else f"an integer >= {least}"
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


def _check_port(name: str, value: object) -> None:
    _check_integer(name, value, 0, 65535, "a port number 0-65535 (0: any free one)")


def _check_duration(name: str, value: object, most: float = math.inf) -> None:
    """``value`` is a finite number in [0, most] (time.sleep and asyncio take no inf: OverflowError)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or not 0 <= float(value) <= most
    ):
        expected = f"a number in [0, {most:g}]" if math.isfinite(most) else "a finite number >= 0"
        raise ValueError(f"{name}: expected {expected}, got {value!r}")


def _duplicate_wrapper(names: Sequence[str]) -> str | None:
    """The first wrapper named more than once in ``names``, or None. Each applies once: a second
    'atari', say, would preprocess frames it already preprocessed, and fail at every reset."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None
