"""What envfleet's entry points (env-server, learner) share: gRPC core settings applied before gRPC
is imported, logging, the form of argument errors, and the limit on open files."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import re
import stat
import sys
import time
from collections.abc import MutableMapping, Sequence
from typing import Any, NoReturn

try:  # (imported here, not where used: out of file descriptors, an import fails too)
    import resource
except ImportError:  # pragma: no cover (Windows)
    resource = None  # type: ignore[assignment]

__all__ = [
    "COLOUR",
    "FAST_GRPC_EXPERIMENTS",
    "LOG_FORMATS",
    "JsonLogFormatter",
    "ShortErrorParser",
    "TextLogFormatter",
    "VersionAction",
    "configure_logging",
    "detach_from_terminal",
    "prefer_fast_grpc_core",
    "quiet_grpc_core",
    "raise_fd_limit",
    "to_devnull",
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
# loop" once per call, asyncio's selector choice, matplotlib's ~200 font-matching lines for each plot written,
# Pillow's PNG chunks): they log from INFO up.
_CHATTY_AT_DEBUG = ("grpc._cython.cygrpc", "asyncio", "matplotlib", "PIL")


LOG_FORMATS = ("text", "json")
"""What ``--log-format`` takes: a line of text per record, or a JSON object per line."""


# A terminal's colour codes (gymnasium's warnings come in red and yellow).
COLOUR = re.compile(r"\x1b\[[0-9;]*m")


class JsonLogFormatter(logging.Formatter):
    """One JSON object per record, on one line, for log collectors (Loki, Elasticsearch, Cloud Logging):
    ``time`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``, ``message`` (arguments merged in, terminal
    colour codes taken out), and, where the record has them, ``exception`` (the formatted traceback) and ``stack``."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        entry = {
            "time": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": COLOUR.sub("", record.getMessage()),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:  # (a traceback that came as text: a local server's, forwarded by the learner)
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False)


class TextLogFormatter(logging.Formatter):
    """A line of text per record: time, level, logger, message (``2026-12-06 02:52:01,250+0900 INFO
    env_server.server: serving ...``), then any traceback. The time is local, as logging's, with its UTC offset,
    so that the lines of a learner and a server in other time zones (a container's UTC, a host's) line up."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        # (whole seconds, as logging's own time: a timestamp rounded up would be a second ahead of its msecs)
        local = datetime.datetime.fromtimestamp(int(record.created), datetime.UTC).astimezone()
        return f"{local:%Y-%m-%d %H:%M:%S},{int(record.msecs):03d}{local:%z}"


def configure_logging(level: str, log_format: str = "text") -> None:
    """Log at ``level`` (debug, info, ...) to stderr, one line per record: text naming the logger
    (:class:`TextLogFormatter`), or (``log_format="json"``) a JSON object (:class:`JsonLogFormatter`), warnings
    (gymnasium's, an env's) then logged too, as records of the logger ``py.warnings``, not printed as they are."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format: expected one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(TextLogFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler])
    if log_format == "json":
        logging.captureWarnings(True)
    for name in _CHATTY_AT_DEBUG:
        logging.getLogger(name).setLevel(max(logging.INFO, logging.getLogger().level))


class VersionAction(argparse.Action):
    """--version: ``learner (envfleet) 0.1.0 (commit 863ce9c5ab12)`` (the parser's prog), the commit where it is
    known (a git checkout's, ``+dirty`` with changes not committed; an install from git's), as config.json's
    and EnvSpec.versions' ``envfleet_commit`` say it: the version alone is the same at every commit; then
    ``suffix`` (env-server's protocol). Built when asked for, not with the parser (finding the commit runs git)."""

    def __init__(
        self,
        option_strings: Sequence[str],
        dest: str = argparse.SUPPRESS,
        help: str = "show program's version number and exit",  # (argparse's own)
        suffix: str = "",
    ) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, help=help)
        self.suffix = suffix

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        from env_server.protocol import package_version, source_commit

        commit = source_commit()
        if commit is not None:  # (12 hex digits, as git's short form in a large repository, and +dirty)
            sha, plus, dirty = commit.partition("+")
            commit = sha[:12] + plus + dirty
        said = f" (commit {commit})" if commit else ""
        # (on stdout, as argparse's own version action writes it)
        parser._print_message(
            f"{parser.prog.split()[0]} (envfleet) {package_version()}{said}{self.suffix}\n", sys.stdout
        )
        parser.exit()


class ShortErrorParser(argparse.ArgumentParser):
    """argparse's parser, whose errors are two lines: argparse's usage line if it fits on one (else a
    pointer to --help, not a usage of many lines) and the error."""

    def error(self, message: str) -> NoReturn:
        usage = self.format_usage().strip()
        if "\n" in usage:
            usage = f"usage: {self.prog} [options]; see {self.prog} --help"
        self.exit(2, f"{usage}\n{self.prog}: error: {message}\n")


def raise_fd_limit() -> None:
    """Raise this process's soft limit on open files (``ulimit -n``) to its hard limit, where it is lower,
    as many tools do: a learner holds about 5 per env server (``learner.errors.FDS_PER_SERVER``), an env
    server about 3 per worker of ``--vectorization async``, and a shell's soft limit can be as low as 256
    (macOS) or 1024 (async's 330 envs); the env servers a learner starts inherit it. Said at DEBUG; never an
    error (the limit stays as it was)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (AttributeError, OSError, ValueError):  # (Windows has no resource module)
        return
    # (macOS refuses an unlimited soft limit where its hard one is so: OPEN_MAX, 10240, there, as Go's runtime)
    target = 10240 if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as err:
        log.debug("cannot raise the limit on open files (ulimit -n) from %d to %d: %s", soft, target, err)
    else:
        log.debug("raised the limit on open files (ulimit -n) from %d to %d", soft, target)


def to_devnull(*fds: int) -> None:
    """Point the descriptors ``fds`` at /dev/null: what is written there from now on goes nowhere, not
    into an error (a closed terminal's EIO, a closed pipe's EPIPE, again at the interpreter's last flush)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in fds:
            os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def detach_from_terminal() -> None:
    """SIGHUP: the terminal may be gone, and writing to it fails (EIO; a failed last flush of stderr makes the
    exit status 120): stdout and stderr, where they are a terminal (a character device: a closed terminal is
    no longer a tty to isatty), are /dev/null from now on."""
    with contextlib.suppress(OSError):
        fds = [fd for fd in (1, 2) if stat.S_ISCHR(os.fstat(fd).st_mode)]
        if fds:
            to_devnull(*fds)
