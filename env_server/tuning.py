"""What envfleet's entry points (env-server, learner) share: gRPC core settings applied before gRPC
is imported, logging, and the form of argument errors."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import MutableMapping
from typing import NoReturn

__all__ = [
    "FAST_GRPC_EXPERIMENTS",
    "ShortErrorParser",
    "configure_logging",
    "prefer_fast_grpc_core",
    "quiet_grpc_core",
]

log = logging.getLogger(__name__)

# gRPC core's EventEngine client and listener (on by default since grpcio 1.6x) hand each message
# between more threads than the older I/O path. Measured with envfleet's StepStream on a 2-core
# machine (grpcio 1.85): ~210 us of CPU per round trip (client + server) without them against ~330
# us with them, and the round trip ~1.5x faster (see README, Performance). Off here until they are
# as fast; nothing else changes (same wire, same API).
FAST_GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def prefer_fast_grpc_core(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set ``GRPC_EXPERIMENTS`` to :data:`FAST_GRPC_EXPERIMENTS` unless the user set it already.

    gRPC reads the variable once, when it is first imported: call this at the very start of an
    entry point. Returns whether the setting is in effect for this process (and its children).
    Also sets ``GRPC_VERBOSITY`` (see :func:`quiet_grpc_core`).
    """
    quiet_grpc_core(environ)
    if "GRPC_EXPERIMENTS" in environ:
        return environ["GRPC_EXPERIMENTS"] == FAST_GRPC_EXPERIMENTS
    environ["GRPC_EXPERIMENTS"] = FAST_GRPC_EXPERIMENTS
    if "grpc" in sys.modules:
        # Too late for this process (children still get it); a programming error in an entry point.
        log.warning("GRPC_EXPERIMENTS was set after grpc was imported; it applies to child processes only")
        return False
    return True


def quiet_grpc_core(environ: MutableMapping[str, str] = os.environ) -> None:
    """gRPC core logs at INFO to stderr unless told otherwise ("I... ssl_transport_security.cc]
    Handshake failed ..." at every attempt to reach a TLS server with the wrong CA, before envfleet's
    own error that says why): from ERROR up, unless the user set ``GRPC_VERBOSITY``. Read once, when
    grpc is first imported."""
    environ.setdefault("GRPC_VERBOSITY", "ERROR")


# Libraries whose DEBUG lines drown envfleet's own at --log-level debug (grpc's "Loaded running
# loop" once per call, asyncio's selector choice): they log from INFO up.
_CHATTY_AT_DEBUG = ("grpc._cython.cygrpc", "asyncio")


def configure_logging(level: str) -> None:
    """Log at ``level`` (debug, info, ...) to stderr, one line per record, naming the logger."""
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for name in _CHATTY_AT_DEBUG:
        logging.getLogger(name).setLevel(max(logging.INFO, logging.getLogger().level))


class ShortErrorParser(argparse.ArgumentParser):
    """argparse's parser, whose errors are two lines: argparse's usage line if it fits on one (else a
    pointer to --help, not a usage of many lines) and the error."""

    def error(self, message: str) -> NoReturn:
        usage = self.format_usage().strip()
        if "\n" in usage:
            usage = f"usage: {self.prog} [options]; see {self.prog} --help"
        self.exit(2, f"{usage}\n{self.prog}: error: {message}\n")
