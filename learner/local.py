"""Starting env servers as local subprocesses (the embedded default, tests and benchmarks)."""

from __future__ import annotations

import collections
import errno
import functools
import inspect
import itertools
import json
import logging
import math
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Literal, ParamSpec, TypeVar

from env_server.protocol import MAX_UNIX_PATH
from env_server.tuning import COLOUR, JsonLogFormatter, raise_fd_limit
from learner.cgroups import cgroup_cpu_quota
from learner.discovery import unix_path
from learner.errors import (
    FDS_PER_SERVER,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    ServerStartError,
    os_reason,
    out_of_fds,
)
from learner.validate import count, is_finite, seconds

try:  # (not on Windows, where LocalServers do not run)
    import fcntl
    import resource
except ImportError:  # pragma: no cover
    fcntl = None  # type: ignore[assignment]
    resource = None  # type: ignore[assignment]

__all__ = [
    "DEFAULT_TRANSPORT",
    "FDS_PER_SERVER",
    "HANG_TIMEOUT_S",
    "SPIN_WAIT_MS",
    "STARTUP_TIMEOUT_S",
    "LocalServers",
    "label_of",
    "left_down",
    "local_servers",
    "orphaned_dirs",
    "out_of_fds",
    "python_m",
    "pid_alive",
    "raise_fd_limit",
    "server_label",
    "server_logger_name",
    "socket_folder",
    "socket_folder_gone",
    "usable_cpus",
    "crowding",
]

# How local servers are reached, by the learner's commands and by LocalServers alike: Unix sockets
# (and so the servers' step sockets, a few times cheaper per step) where the platform has them, else
# loopback TCP.
DEFAULT_TRANSPORT: Literal["tcp", "unix"] = "unix" if os.name == "posix" and hasattr(socket, "AF_UNIX") else "tcp"

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

# Local servers are watched through their stdout pipes (selectors, os.set_blocking: Unix only), and
# notice their parent's death by its pid changing (env-server --parent-pid: Windows never changes it), so
# on Windows LocalServers says what to do instead.
_ON_WINDOWS = os.name == "nt"
_NO_LOCAL_SERVERS = (
    "local env servers need Linux or macOS (this is Windows); run the learner in WSL2 or Docker, or start "
    "env-server processes yourself (env-server --env ENV --host 127.0.0.1 --port PORT) and pass their "
    "addresses (learner train --servers HOST:PORT,...; RemoteVectorEnv(addresses)), or train on in-process "
    "envs (learner train --backend gym)"
)

SPIN_WAIT_MS = 0.5
"""``env-server --spin-wait-ms`` for local servers on Unix sockets when each can have a CPU (see LocalServers)."""

HANG_TIMEOUT_S = 60.0
"""``env-server --hang-timeout`` for local servers: one whose env call hangs exits and is started again."""

STARTUP_TIMEOUT_S = 60.0
"""How long LocalServers wait by default for their servers to listen (their envs built)."""

_LOG_LEVELS = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
    "CRITICAL": logging.CRITICAL,
}


# Supervision: a server that dies is started again on its address after RESTART_BACKOFF_S (doubled at
# each restart within RESTART_WINDOW_S, up to 8 s), at most ``restarts`` times within that window.
RESTART_BACKOFF_S = 0.5
RESTART_WINDOW_S = 60.0
_WATCH_S = 0.2  # how often the supervisor looks at the servers

# Stopping: a server that listens gets SIGTERM and _STOP_WAIT_S to drain and close its envs before it is
# killed; one that has not said it listens yet (building its envs: nothing to drain) _UNREADY_GRACE_S. A
# wait past _SAY_WAIT_S is said (the learner would otherwise seem to hang after a Ctrl-C). Both for up to
# SERVERS_PER_CPU servers on each CPU: more take longer, each stop costing ~0.25 s of CPU (64 servers on 2
# CPUs took 8 s, each run's end said as a wait, and beyond ~80 the deadline killed servers closing normally),
# so both grow with them (the deadline to 60 s at most).
_STOP_WAIT_S = 10.0
_UNREADY_GRACE_S = 0.5
_SAY_WAIT_S = 1.0
SERVERS_PER_CPU = 4
_SAY_STARTING_S = 10.0  # (how often the start of many servers says how far it got)


def _check_arguments(given: dict[str, Any]) -> list[str]:
    """InvalidArgumentError (a ValueError; InvalidArgumentTypeError, also a TypeError, for a type) naming the
    first of LocalServers' arguments that is wrong, what it expects and what came, before any server starts;
    returns ``server_args`` as a list."""
    if not (isinstance(given["env"], str) and given["env"]):
        raise InvalidArgumentTypeError(f"env: expected a gymnasium id or 'module:Factory', got {given['env']!r}")
    count("num_servers", given["num_servers"])
    count("envs_per_server", given["envs_per_server"])
    count("restarts", given["restarts"], 0)
    seconds("startup_timeout", given["startup_timeout"])
    seconds("hang_timeout", given["hang_timeout"], zero=True)
    if given["spin_wait_ms"] is not None and not (is_finite(given["spin_wait_ms"]) and given["spin_wait_ms"] >= 0):
        raise InvalidArgumentError(f"spin_wait_ms: expected finite milliseconds >= 0, got {given['spin_wait_ms']!r}")
    for name, choices in [
        ("transport", ("tcp", "unix")),
        ("log_level", (None, "debug", "info", "warning", "error")),
        ("log_format", (None, "text", "json")),
    ]:
        if _lower(given[name]) not in choices:  # (in any case, as env-server's options)
            named = " or ".join(repr(choice) for choice in choices if choice is not None)
            raise InvalidArgumentError(
                f"{name}: expected {named}{' (or None)' * (None in choices)}, got {given[name]!r}"
            )
    server_args = given["server_args"]
    if isinstance(server_args, str):
        raise InvalidArgumentTypeError(
            f"server_args: expected a list of env-server arguments, got the string {server_args!r} (split it: "
            "shlex.split(...))"
        )
    try:
        listed = list(server_args)  # (a generator: read once, here)
    except TypeError:
        listed = None
    if listed is None or not all(isinstance(arg, str) for arg in listed):
        raise InvalidArgumentTypeError(f"server_args: expected a list of strings, got {server_args!r}")
    if not isinstance(given["env_kwargs"], dict | None):
        raise InvalidArgumentTypeError(f"env_kwargs: expected a dict or None, got {given['env_kwargs']!r}")
    if not (isinstance(given["label_prefix"], str) and _LABEL_PREFIX.fullmatch(given["label_prefix"])):
        raise InvalidArgumentError(
            f"label_prefix: expected letters, digits, '_' or '-' (such as 'local' or 'eval'), got "
            f"{given['label_prefix']!r}"
        )
    if not isinstance(given["auth_token"], str | None):
        raise InvalidArgumentTypeError(
            f"auth_token: expected a string or None, got {type(given['auth_token']).__name__}"
        )
    return listed


# What a label prefix may be: a word (it names loggers, env_server[eval-0], where a dot would make a child of another).
_LABEL_PREFIX = re.compile(r"[A-Za-z0-9_-]+")

THREADS_PER_SERVER = 8
"""Threads an env server holds at least (an idle one of CartPole on 4 envs: 11, gRPC's, its step socket's, its
envs'): counted low, so that no start that fits is refused."""


def _check_task_room(num_servers: int) -> None:
    """ServerStartError where the user's limit on processes (``ulimit -u``, RLIMIT_NPROC: threads count, of
    every process of the user's) leaves no room for the servers' threads (:data:`THREADS_PER_SERVER` each):
    servers that could not start a thread crashed or were said to have stopped, dozens of core dumps among
    them. The soft limit is raised to the hard one first where that makes room. Not checked for root (the
    limit does not hold it; root in a user namespace, a rootless container's, is taken for root too) or
    without /proc to count the user's threads; an async server's worker processes are not counted."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    except (AttributeError, OSError, ValueError):
        return
    if soft == resource.RLIM_INFINITY or os.geteuid() == 0 or (running := _user_threads()) is None:
        return
    need = running + num_servers * THREADS_PER_SERVER
    if need > soft and (hard == resource.RLIM_INFINITY or hard > soft):
        with suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))
            soft = hard
            log.debug("raised the limit on processes (ulimit -u) to %s for %d local env servers", hard, num_servers)
    if soft != resource.RLIM_INFINITY and need > soft:
        raise ServerStartError(
            f"{num_servers} local env servers need at least {num_servers * THREADS_PER_SERVER} threads (about "
            f"{THREADS_PER_SERVER} each), and this user runs {running} already, over its limit of {soft} processes "
            "and threads (ulimit -u): raise the limit or start fewer servers (more envs each: envs_per_server, "
            "--envs-per-server)"
        )


def _user_threads() -> int | None:
    """The threads of every process of this process's real user (what RLIMIT_NPROC counts); None without /proc."""
    uid, count = os.getuid(), 0
    try:
        pids = [name for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:  # (a process that ended meanwhile, or hidden)
            continue
        if int(fields.get("Uid", "-1 ").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count


def _lower(value: Any) -> Any:
    """``value`` in lower case where it is a string (an option's choice, as env-server takes them)."""
    return value.lower() if isinstance(value, str) else value


def _check_fd_room(num_servers: int) -> None:
    """ServerStartError where this process's limit on open files (``ulimit -n``), raised to the hard limit where
    it is short, leaves no room for the :data:`FDS_PER_SERVER` it holds per server: found after every server had
    started, the run died writing its files (16 s for 24 servers under a limit of 100, 44 s for 64 under 256),
    one warning per server before."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        open_now = len(os.listdir("/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"))
    except (AttributeError, OSError, ValueError):
        return
    need = open_now + num_servers * FDS_PER_SERVER + 16  # (and a few for the run's files)
    if soft != resource.RLIM_INFINITY and need > soft:
        raise_fd_limit()  # (up to the hard limit, as the learner command does: called from Python, it had not)
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and need > soft:
        raise ServerStartError(
            f"{num_servers} local env servers need about {need} open files in this process (about "
            f"{FDS_PER_SERVER} each, and {open_now} open already), over its limit of {soft} (ulimit -n): raise the "
            "limit or start fewer servers (more envs each: envs_per_server, --envs-per-server)"
        )


def _check_ipv4_loopback() -> None:
    """Refuse local TCP servers on a machine without 127.0.0.1, where they listen (a container or network
    namespace with IPv6's loopback only): said for the learner, not as each server's own error, which
    points to env-server's --host, an option learner train has not."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
    except OSError as err:
        if err.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
            raise ServerStartError(
                "transport 'tcp': local TCP servers listen on 127.0.0.1, which this host lacks "
                f"({err.strerror}); use --transport unix (LocalServers: transport='unix')"
            ) from err
        # (anything else: the servers' own errors say it)


class LocalServers:
    """``num_servers`` env servers, each hosting ``envs_per_server`` envs, as child processes.

    The servers listen on Unix domain sockets (a socket file each, in a folder of the temp dir, or of
    /tmp when the temp dir's path is too long for Unix sockets; on
    platforms without them, and with ``transport="tcp"``, on loopback), exit when
    :meth:`close` is called, when this object is collected, when the interpreter exits, and — should
    this process be killed — within a second of its death (each server watches its parent; one still
    building its envs does not wait for the build, except under ``--vectorization async``, whose build
    comes first; processes its envs started go with it). Servers still building their envs when they are stopped have nothing to drain: they
    are killed within a second; the others get up to 10 s to finish and close their envs.

    A server that dies (killed, out of memory, crashed) is started again on the same address after a
    short wait, logged as a warning with its exit code and, where they may explain its death (a warning,
    an error, a traceback, what is no log record), its last lines, so that a fault-tolerant
    ``RemoteVectorEnv`` gets its envs back; after ``restarts`` restarts within a minute it is left
    down (logged as an error).

    While they run, this process's lines and errors about them (a ``RemoteVectorEnv``'s: lost, back, slow
    to answer) name them ``local-0``, ``local-1``, ... (:func:`label_of`; ``label_prefix`` says the word
    before the number), as their forwarded lines do, not by their addresses, which are new each time.

    Linux and macOS only: on Windows, ServerStartError saying what to do instead.

    Args:
        env: gymnasium id or ``package.module:Factory`` entry point.
        num_servers: how many server processes.
        envs_per_server: envs each server hosts (K).
        env_kwargs: keyword arguments for the env's constructor.
        server_args: further ``env-server`` options, e.g. ``["--wrappers", "atari"]``.
        transport: ``"unix"`` (a socket file each, ``unix:PATH`` addresses: ``RemoteVectorEnv``
            steps such servers over their step sockets; the default where the platform has Unix
            sockets, as for ``learner train``) or ``"tcp"`` (127.0.0.1, a free port each).
        startup_timeout: seconds to wait for every server to print its ``listening on`` line (its envs
            built: raise it for envs that take long to build; ``learner train`` waits its
            ``--connect-timeout``, 60 s at least).
        log_level: the servers' log level (debug, info, warning or error); their log lines are
            forwarded to this process's logging (:func:`server_logger_name`). None: the level this
            process logs them at (the effective level of the ``env_server[local-i]`` loggers: the root
            logger's, which the ``learner`` commands' ``--log-level`` sets), so ``learner train
            --log-level info`` shows their session lines.
        log_format: the servers' ``--log-format`` (text or json). None: json where this process
            writes their forwarded lines as JSON (``learner --log-format json``), else text. Their JSON
            records are logged here as they were written, under their own logger's name with the
            server's label (``env_server.isolation[local-0]``), their traceback as the record's
            (``exc_text``); their text lines as ``env_server[local-0]`` lines. ``server_args`` may
            give another.
        auth_token: make the servers require this token (passed in their environment, not on
            their command line, where other users of the machine could read it).
        spin_wait_ms: the servers' ``--spin-wait-ms`` (how long a server looks for the learner's
            next step awake after answering one on its step socket). None: ``SPIN_WAIT_MS`` with
            ``transport="unix"`` when there are no more servers than CPUs this process may use
            (the learner's CPU not counted: 2 servers waiting awake beside the learner on 2 CPUs
            measured faster, 4 the same as asleep), else 0; an ``ENVFLEET_SPIN_WAIT_MS`` in the
            environment is left to the servers instead.
        restarts: how many times within a minute a server that dies is started again before it is
            left down; 0: never (one that dies is reaped all the same as it is noticed, not left a
            zombie process until :meth:`close`).
        hang_timeout: the servers' ``--hang-timeout``: a server whose env call (step or reset) has run
            this many seconds exits, and is started again as one that died (a hung env call can be
            neither stopped nor waited out); 0: never. ``server_args`` may give another.
        label_prefix: the word the servers' labels start with (:func:`server_label`): ``"local"`` names
            them ``local-0``, ``local-1``, ...; a second LocalServers running beside another may be told
            apart by its own (``learner train --eval-every``'s evaluation server is ``eval-0``: its log
            lines, errors and forwarded ``env_server[eval-0]`` lines, where both would read ``local-0``).
    """

    def __init__(
        self,
        env: str,
        num_servers: int = 2,
        envs_per_server: int = 4,
        *,
        env_kwargs: dict[str, Any] | None = None,
        server_args: Sequence[str] = (),
        transport: str = DEFAULT_TRANSPORT,
        startup_timeout: float = STARTUP_TIMEOUT_S,
        log_level: str | None = None,
        log_format: str | None = None,
        auth_token: str | None = None,
        spin_wait_ms: float | None = None,
        restarts: int = 5,
        hang_timeout: float = HANG_TIMEOUT_S,
        label_prefix: str = "local",
    ) -> None:
        if _ON_WINDOWS:
            raise ServerStartError(_NO_LOCAL_SERVERS)
        self.env = env  # (first: the repr of one whose arguments are refused names it)
        server_args = _check_arguments(locals())
        log_level, log_format, transport = _lower(log_level), _lower(log_format), _lower(transport)
        _check_fd_room(num_servers)
        _check_task_room(num_servers)
        if transport == "tcp" and not any(a == "--host" or a.startswith("--host=") for a in server_args):
            _check_ipv4_loopback()
        self.addresses: list[str] = []
        self._children = _Children(env, _server_environ(auth_token), label_prefix)
        label = self._children.label
        self._procs = self._children.procs
        self._socket_dir = None
        lock = None
        if transport == "unix":
            self._socket_dir, lock = _make_socket_dir(num_servers)
        # Runs on close(), on garbage collection, or at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(self, _stop_all, self._children, self._socket_dir, lock)
        base = [
            *python_m("env_server"),
            "--env",
            env,
            "--num-envs",
            str(envs_per_server),
            "--parent-pid",
            str(os.getpid()),
            "--log-level",
            log_level or _forwarded_level(label_prefix),
            "--log-format",
            log_format or _forwarded_format(label_prefix),
        ]
        if env_kwargs:
            base += ["--env-kwargs", json.dumps(env_kwargs)]
        if spin_wait_ms is None and "ENVFLEET_SPIN_WAIT_MS" not in os.environ:
            spin_wait_ms = SPIN_WAIT_MS if transport == "unix" and num_servers <= usable_cpus() else 0.0
        if spin_wait_ms:
            base += ["--spin-wait-ms", f"{spin_wait_ms:g}"]
        if hang_timeout:
            base += ["--hang-timeout", f"{hang_timeout:g}"]
        try:
            for i in range(num_servers):
                where = (
                    ["--unix-socket", os.path.join(self._socket_dir, f"server-{i}.sock")]
                    if self._socket_dir
                    else ["--host", "127.0.0.1", "--port", "0"]
                )
                self._children.cmds.append([*base, *where, *server_args])
                try:
                    self._children.spawn(i)
                except (OSError, RuntimeError) as err:  # (was a traceback: a program it may not run, no process left)
                    raise ServerStartError(
                        f"env server {label(i)} for {env!r}: cannot start it ({base[0]}): {_start_failure(err)}"
                    ) from err
            self.addresses = self._wait_ready(startup_timeout)
        except BaseException:
            self.close()
            raise
        for i, address in enumerate(self.addresses):  # restarted on the port each one got
            if not address.startswith("unix:"):
                cmd = self._children.cmds[i]
                cmd[cmd.index("--port") + 1] = address.rpartition(":")[2]
        if restarts:
            watcher = threading.Thread(
                target=_supervise,
                args=(self._children, list(self.addresses), restarts, startup_timeout),
                daemon=True,
                name="env-server-supervisor",
            )
        else:
            watcher = threading.Thread(target=_reap, args=(self._children,), daemon=True, name="env-server-reaper")
        self._children.watcher = watcher
        watcher.start()
        _name_servers(self._children, self.addresses)
        log.info(
            "started %d local env server%s (%d x %s each): %s",
            num_servers,
            "" if num_servers == 1 else "s",
            envs_per_server,
            env,
            f"{label(0)} to {label(num_servers - 1)} in {self._socket_dir} (server-N.sock)"
            if self._socket_dir and num_servers > 2  # (64 paths were a line of 4,000 characters)
            else ", ".join(f"{label(i)} on {address}" for i, address in enumerate(self.addresses)),
        )

    def _wait_ready(self, timeout: float) -> list[str]:
        """The servers' addresses, once each said it listens (ServerStartError where one does not within
        ``timeout``); how many do is said every _SAY_STARTING_S while they are more than SERVERS_PER_CPU on
        each CPU (320 servers on 2 CPUs took 108 s to start, nothing said meanwhile)."""
        start = time.monotonic()
        deadline = start + timeout
        say_at = start + _SAY_STARTING_S if crowding(len(self._procs))[0] > 1 else math.inf
        addresses: list[str | None] = [None] * len(self._procs)
        buffers = [b""] * len(self._procs)
        sel = selectors.DefaultSelector()
        for i, proc in enumerate(self._procs):
            assert proc.stdout is not None
            os.set_blocking(proc.stdout.fileno(), False)
            sel.register(proc.stdout, selectors.EVENT_READ, i)
        try:
            while any(a is None for a in addresses):
                if time.monotonic() >= say_at:
                    listening = sum(a is not None for a in addresses)
                    log.warning(
                        "%d of %d local env servers listening after %.0f s",
                        listening,
                        len(addresses),
                        time.monotonic() - start,
                    )
                    say_at += _SAY_STARTING_S
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    late = [i for i, a in enumerate(addresses) if a is None]
                    raise ServerStartError(
                        f"env server{'s' if len(late) > 1 else ''} {_labels(late, self._children.prefix)} for "
                        f"{self.env!r} did not start listening within {timeout:g} s (envs "
                        f"that take long to build: raise startup_timeout; learner train and eval: --connect-timeout); last "
                        f"output: {self._tail(late[0])}"
                    )
                for key, _ in sel.select(timeout=min(remaining, 0.5)):
                    i = key.data
                    chunk = os.read(key.fileobj.fileno(), 4096)  # type: ignore[union-attr]
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    buffers[i] += chunk
                    if b"\n" in buffers[i]:
                        line = buffers[i].split(b"\n", 1)[0].decode(errors="replace").strip()
                        if not line.startswith("listening on "):
                            raise ServerStartError(
                                f"env server {self._children.label(i)} printed {line!r} instead of 'listening on "
                                "ADDRESS'"
                            )
                        addresses[i] = line[len("listening on ") :]
                        self._children.listening[i] = True
                        sel.unregister(key.fileobj)
                for i, proc in enumerate(self._procs):
                    if addresses[i] is None and proc.poll() is not None:
                        # Its last lines (its own error line among them): read to the end of its
                        # output, which a child of its might hold open (then not for long).
                        self._children.readers[i].join(timeout=2.0)
                        tail = self._tail(i)
                        raise ServerStartError(
                            f"env server {self._children.label(i)} for {self.env!r} {_exit_status(proc.returncode)} before "
                            f"listening: {tail}" + (_SILENT_HINT if tail == _NOTHING else "")
                        )
        finally:
            sel.close()
        return [a for a in addresses if a is not None]

    def _tail(self, index: int) -> str:
        return self._children.tail(index)

    @property
    def pids(self) -> list[int]:
        """The servers' process ids (a server that was started again: its new process's)."""
        with self._children.lock:
            return [p.pid for p in self._procs]

    def close(self) -> None:
        """Stop every server (SIGTERM, then SIGKILL after a grace period) and wait for it."""
        self._finalizer()

    def __enter__(self) -> LocalServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if not hasattr(self, "_finalizer"):  # (its arguments refused: in a traceback's locals)
            return f"<LocalServers {getattr(self, 'env', '?')!r}: not started>"
        if not self._finalizer.alive:
            return f"<LocalServers {self.env!r}: closed>"
        where = ", ".join(self.addresses[:2]) + (
            f", ... ({len(self.addresses)} servers)" if len(self.addresses) > 2 else ""
        )
        return f"<LocalServers {self.env!r}: {where}>"


# Where sockets go when the temp folder's path is too long for them (HPC scratch folders can be).
_SHORT_TEMP_DIR = "/tmp"


def _make_socket_dir(num_servers: int) -> tuple[str, int | None]:
    """A new folder for the servers' sockets: ``envfleet-<pid>-*`` in the temp folder, or in /tmp when
    the temp folder's path ($TMPDIR) leaves the longest socket path (the last server's step socket)
    over what Unix sockets allow, or has a comma (where gRPC splits a unix: address); orphans of killed
    learners in that folder are removed first. With
    the descriptor of its lock file, locked (flock) for as long as it is held open (None on Windows)."""
    longest = f"envfleet-{os.getpid()}-xxxxxxxx/server-{num_servers - 1}.sock.steps"
    root = tempfile.gettempdir()
    too_long = len(os.fsencode(os.path.join(root, longest))) > MAX_UNIX_PATH
    if (too_long or "," in root) and os.path.isdir(_SHORT_TEMP_DIR):
        log.info(
            "the temp folder %s %s: the servers' sockets go in %s",
            root,
            f"is too long a path for Unix sockets ({MAX_UNIX_PATH} bytes at most)"
            if too_long
            else "has a comma, where gRPC splits a unix: address",
            _SHORT_TEMP_DIR,
        )
        root = _SHORT_TEMP_DIR
    _remove_orphaned_socket_dirs(root)
    if fcntl is None:  # pragma: no cover  (Windows: no local servers)
        return tempfile.mkdtemp(prefix=f"envfleet-{os.getpid()}-", dir=root), None
    # Made under another name (one no cleanup takes for a socket folder), locked, then named: under its
    # name a folder is locked from the first (see _remove_orphaned_socket_dirs).
    staging = tempfile.mkdtemp(prefix=f".envfleet-{os.getpid()}-", dir=root)
    lock = None
    try:
        lock = os.open(os.path.join(staging, _LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)  # (not inherited)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as err:  # (a file system without flock, as some network ones: the other checks remain)
            log.debug("cannot lock %s: %s", staging, err)
        folder = os.path.join(root, os.path.basename(staging)[1:])
        os.rename(staging, folder)
    except BaseException:
        if lock is not None:
            os.close(lock)
        with suppress(OSError):
            os.unlink(os.path.join(staging, _LOCK_FILE))
        with suppress(OSError):
            os.rmdir(staging)
        raise
    return folder, lock


LOCAL_SOCKET_DIR = re.compile(r"envfleet-(\d+)-\w+")
# A socket folder before it is locked and named (see _make_socket_dir): left by a learner killed between.
_STAGING_DIR = re.compile(r"\.envfleet-(\d+)-\w+")
"""The name of a LocalServers' socket folder (``envfleet-<learner pid>-*``)."""


def is_local_socket_dir(folder: str) -> bool:
    """Whether ``folder`` is named as LocalServers name their sockets' folders (made and removed by them)."""
    return LOCAL_SOCKET_DIR.fullmatch(os.path.basename(os.path.normpath(folder))) is not None


# The file in a socket folder that its LocalServers holds locked (flock) for as long as it runs.
_LOCK_FILE = "owner.lock"


def _remove_orphaned_socket_dirs(root: str) -> None:
    """Remove the socket folders of learners that were killed (SIGKILL: no finalizer ran; their servers
    exit by themselves, see --parent-pid): this user's ``envfleet-<pid>-*`` in ``root`` whose process is gone,
    whose lock file no process holds locked, and whose sockets no server listens on."""
    for path in itertools.chain(orphaned_dirs(root, LOCAL_SOCKET_DIR), orphaned_dirs(root, _STAGING_DIR)):
        # Its pid is gone *here*: its learner may live in another pid namespace (a second container that
        # shares /tmp, whose pids this one does not see). Its lock tells (its servers may not listen yet:
        # still building their envs); for a learner too old to lock one, a socket a server listens on.
        with suppress(OSError), _locked_by_another(path) as held:
            if held or any(_listening(os.path.join(path, e)) for e in os.listdir(path) if e.endswith(".sock")):
                continue
            for entry in os.listdir(path):  # the servers' sockets, if they could not remove them
                if entry.endswith((".sock", ".sock.steps")) or entry == _LOCK_FILE:
                    os.unlink(os.path.join(path, entry))
            os.rmdir(path)  # (fails, and is left, if anything else is in it)
            log.debug("removed %s, left by a learner that was killed", path)


@contextmanager
def _locked_by_another(folder: str) -> Iterator[bool]:
    """Whether a process holds ``folder``'s lock file locked (its learner runs); where none does, the lock
    is this block's while it runs. False without a lock file, or where flock is not to be had."""
    lock = None
    if fcntl is not None:
        with suppress(FileNotFoundError):
            lock = os.open(os.path.join(folder, _LOCK_FILE), os.O_RDWR)
    try:
        held = False
        if lock is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held = True
            except OSError:  # (a file system without flock: the other checks decide)
                pass
        yield held
    finally:
        if lock is not None:
            os.close(lock)


def _listening(path: str) -> bool:
    """Whether something listens on the Unix socket at ``path`` (one left by a process that was killed
    refuses a connection; so does a file that is no socket)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(0.5)
        try:
            probe.connect(path)
        except TimeoutError:  # (its backlog full: a server, busy)
            return True
        except OSError:
            return False
        return True


def orphaned_dirs(root: str, pattern: re.Pattern[str]) -> Iterator[str]:
    """The folders in ``root`` named as ``pattern`` says (its first group the pid of the process that
    made them) whose process is gone and that are this user's: what a process killed (SIGKILL: no
    finalizer ran) left behind."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        match = pattern.fullmatch(name)
        if match is None or pid_alive(int(match.group(1))):
            continue
        path = os.path.join(root, name)
        try:
            mine = os.stat(path).st_uid == os.getuid()
        except OSError:  # (gone meanwhile, say)
            continue
        if mine:
            yield path


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (another user's included)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


# The one ENVFLEET_* variable local servers take from this process's environment (see spin_wait_ms).
_PASSED_ON = {"ENVFLEET_SPIN_WAIT_MS"}


def python_m(module: str) -> list[str]:
    """The command that runs ``module`` (``python -m module``) with the envfleet this process runs: with
    ``-P`` (the working directory not first on sys.path, where ``-m`` puts it), so that in a clone the child
    runs the installed envfleet as this process does, not the clone's files; without it where this process
    runs the working directory's own (a checkout's source, not installed). (env-server puts the working
    directory back on sys.path itself, for ``--env mymodule:MyEnv``: its own package is imported by then,
    and its modules come from there.)"""
    import env_server

    try:
        from_cwd = Path(env_server.__file__).resolve().parent.parent == Path.cwd().resolve()
    except OSError:  # (a working directory removed since)
        from_cwd = False
    return [sys.executable, *([] if from_cwd else ["-P"]), "-m", module]


def _server_environ(auth_token: str | None) -> dict[str, str]:
    """The servers' environment: this process's, without its other ``ENVFLEET_*`` variables (those are
    for servers elsewhere, a compose file's say: a token file, TLS files, wrappers or env kwargs would
    change or break servers that take their options from the arguments here), with the token (not on
    their command line, where other users of the machine could read it) and, for a script run as
    ``python path/to/script.py``, the script's folder on PYTHONPATH: the servers (``python -m
    env_server``, in this process's working directory) then import entry points (``--env
    mymodule:MyEnv``) from where the script does."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ENVFLEET_") or k in _PASSED_ON}
    if auth_token:
        environ["ENVFLEET_AUTH_TOKEN"] = auth_token
    script = sys.argv[0] if sys.argv else ""
    try:
        cwd: str | None = os.getcwd()
    except OSError:  # (a working directory removed since: only an absolute path's folder can be told)
        cwd = None
    first = sys.path[0] if sys.path else ""
    told = cwd is not None or (os.path.isabs(script) and os.path.isabs(first))  # (abspath needs no cwd then)
    if told and script.endswith(".py") and first:
        folder = os.path.dirname(os.path.abspath(script))
        if os.path.abspath(first) == folder and folder != cwd:
            environ["PYTHONPATH"] = os.pathsep.join(p for p in (folder, environ.get("PYTHONPATH", "")) if p)
    return environ


class _Children:
    """The server processes of a LocalServers, shared with its supervisor thread and its finalizer
    (neither may hold the LocalServers itself: it could then never be collected)."""

    def __init__(self, env: str, environ: dict[str, str] | None, prefix: str = "local") -> None:
        self.env = env
        self.environ = environ
        self.prefix = prefix
        """The word the servers' labels start with (LocalServers' ``label_prefix``)."""
        self.cmds: list[list[str]] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tails: list[collections.deque[_Line]] = []
        self.readers: list[threading.Thread] = []
        # Whether each server (its latest start) has said it listens: one that has not is still building
        # its envs, with nothing to drain, and is not waited for when it is stopped.
        self.listening: list[bool] = []
        self.watcher: threading.Thread | None = None  # (the supervisor, or the reaper)
        # Held to start a server, and by close() to stop starting them: none starts after close().
        self.lock = threading.Lock()
        self.closing = threading.Event()
        # Servers the supervisor left down (they died too often), by address: how the last one ended.
        self.left_down: dict[str, str] = {}

    def label(self, index: int) -> str:
        """Server ``index``'s label (:func:`server_label` with this supervisor's prefix): ``local-0``."""
        return server_label(index, self.prefix)

    def spawn(self, index: int) -> subprocess.Popen[bytes] | None:
        """Start server ``index`` (again); None once closing."""
        with self.lock:
            if self.closing.is_set():
                return None
            proc = subprocess.Popen(
                self.cmds[index],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self.environ,
                # Its own session: a Ctrl-C in the terminal reaches the learner, which then stops the
                # servers in order, instead of killing them under a checkpoint being written.
                start_new_session=True,
            )
            tail: collections.deque[_Line] = collections.deque(maxlen=20)
            reader = threading.Thread(
                target=_forward_stderr,
                args=(proc, index, tail, self.prefix),
                daemon=True,
                name=f"env-server-{index}-stderr",
            )
            try:
                reader.start()
            except RuntimeError:  # (no thread left: the process is not left running, unread and untracked)
                _kill(proc)
                for pipe in (proc.stdout, proc.stderr):
                    if pipe is not None:
                        pipe.close()
                raise
            if index < len(self.procs):
                old = self.procs[index]
                if old.stdout is not None:
                    old.stdout.close()
                self.procs[index], self.tails[index], self.readers[index] = proc, tail, reader
                self.listening[index] = False
            else:
                self.procs.append(proc)
                self.tails.append(tail)
                self.readers.append(reader)
                self.listening.append(False)
            return proc

    def tail(self, index: int, *, explaining: bool = False) -> str:
        """Server ``index``'s last output: its own error line if it printed one, else its last lines.
        ``explaining``: for a server that died, "" where none of those lines may explain it (no warning or
        error, no traceback, nothing but log records: a SIGKILL's server says "claimed by ..." last, which
        would only lengthen the line that says it died)."""
        lines = list(self.tails[index])
        said = [text for _, text in lines if text.startswith("env-server: error:")]
        if said:  # its own one-line reason, not the noise that may follow it
            return said[-1]
        last = lines[-3:]
        if explaining and not any(level >= logging.WARNING for level, _ in last):
            return ""
        return " | ".join(text for _, text in last) if last else _NOTHING


# A server's output line as its tail keeps it: the level it was forwarded at (a traceback's lines and what
# is no log record, an env's print or a C library's abort message, at WARNING at least; the server's own
# error line, forwarded at DEBUG as the error raised quotes it, at ERROR) and its text.
_Line = tuple[int, str]
_NOTHING = "(nothing)"


def _start_failure(err: OSError | RuntimeError) -> str:
    """Why a server's process (or the thread that reads its output: RuntimeError "can't start new thread") could not
    be started, with the limits to look at where none was left."""
    if isinstance(err, OSError):
        short = err.errno in (errno.EAGAIN, errno.ENOMEM)
        return os_reason(err) + (_NO_PROCESS_HINT if short else "")
    return str(err) + (_NO_PROCESS_HINT if "can't start new thread" in str(err) else "")


_NO_PROCESS_HINT = (
    "; the limit on processes (ulimit -u, docker --pids-limit) or memory may be too low: start fewer servers "
    "(more envs each: envs_per_server, --envs-per-server)"
)
# What shows more of a server that died without a word (env-server enables Python's fault handler, which
# prints each thread's stack at a fatal signal, as it starts: a crash before that, in an import say), and the
# servers log "building N x ENV" at info.
_SILENT_HINT = (
    " (to see more: PYTHONFAULTHANDLER=1 in this process's environment, which the servers inherit, has a "
    "server that crashes print where, logged here as env_server[local-N] lines; log level info, learner "
    "--log-level info or LocalServers(log_level='info'), shows how far it got)"
)


def _supervise(children: _Children, addresses: list[str], restarts: int, startup_timeout: float) -> None:
    """Start each server that dies again on its address, until close(): see LocalServers."""
    started: list[collections.deque[float]] = [collections.deque() for _ in addresses]  # restart times
    restart_at: dict[int, float] = {}  # servers down, and when to start them again
    starting: dict[int, tuple[float, bytes]] = {}  # servers started again: deadline, output so far
    left_down: set[int] = set()
    while not children.closing.wait(_WATCH_S):
        now = time.monotonic()
        for i, address in enumerate(addresses):
            proc = children.procs[i]
            if i in left_down:
                continue
            if i in restart_at:
                if now < restart_at[i]:
                    continue
                del restart_at[i]
                try:
                    if children.spawn(i) is None:
                        return
                except (OSError, RuntimeError) as err:  # (out of processes or memory: counts as a failed restart)
                    _forget_old(started[i], now)
                    started[i].append(now)
                    if len(started[i]) >= restarts:
                        left_down.add(i)
                        children.left_down[address] = f"could not be started again: {_start_failure(err)}"
                    else:
                        restart_at[i] = now + min(RESTART_BACKOFF_S * 2 ** len(started[i]), 8.0)
                    log.error(
                        "env server %s (%s): cannot start it again: %s%s",
                        children.label(i),
                        address,
                        _start_failure(err),
                        "; leaving it down" if i in left_down else "",
                    )
                    continue
                started[i].append(now)
                starting[i] = (now + startup_timeout, b"")
                continue
            if i in starting:
                deadline, output = starting[i]
                output += _read_available(proc)
                line = output.split(b"\n", 1)[0].decode(errors="replace").strip() if b"\n" in output else None
                if line == f"listening on {address}":
                    del starting[i]
                    children.listening[i] = True
                    log.info("env server %s is back on %s (started again)", children.label(i), address)
                    continue
                if line is None and proc.poll() is None and now < deadline:
                    starting[i] = (deadline, output)
                    continue
                del starting[i]
                if proc.poll() is not None:
                    died = f"{_exit_status(proc.returncode)} before listening"
                else:  # not listening in time, or not where it did: stopped
                    died = (
                        f"printed {line!r} instead of 'listening on {address}'"
                        if line is not None
                        else f"did not listen again within {startup_timeout:g} s"
                    )
                    _stop_all_procs([proc], [False])  # (killed at once: nothing to drain, nor to wait for)
            elif proc.poll() is None:
                continue
            else:
                died = _exit_status(proc.returncode)
            if children.closing.is_set():
                return
            # Down (or a restart failed): start it again after a wait, unless it died too often.
            children.readers[i].join(timeout=0.5)  # (its last lines)
            _forget_old(started[i], now)
            told = children.tail(i, explaining=True)
            last_output = f"; its last output: {told}" if told else ""
            if len(started[i]) >= restarts:
                left_down.add(i)
                children.left_down[address] = (
                    f"{died}, and was left down after {len(started[i])} restart{'s' if len(started[i]) != 1 else ''} "
                    f"within {RESTART_WINDOW_S:g} s"
                )
                log.error(
                    "env server %s (%s) %s; it was started again %d times within %g s: leaving it down "
                    "(its envs stay unavailable)%s",
                    children.label(i),
                    address,
                    died,
                    len(started[i]),
                    RESTART_WINDOW_S,
                    last_output,
                )
                continue
            wait = min(RESTART_BACKOFF_S * 2 ** len(started[i]), 8.0)
            restart_at[i] = now + wait
            log.warning(
                "env server %s (%s) %s; starting it again on the same address in %g s (restart %d of at most %d "
                "within %g s)%s",
                children.label(i),
                address,
                died,
                wait,
                len(started[i]) + 1,
                restarts,
                RESTART_WINDOW_S,
                last_output,
            )


def _forget_old(started: collections.deque[float], now: float) -> None:
    """Drop the restart times of ``started`` that are out of the window restarts are counted in."""
    while started and started[0] < now - RESTART_WINDOW_S:
        started.popleft()


def _reap(children: _Children) -> None:
    """Without restarts (``restarts=0``): reap each server that dies as the supervisor would notice it,
    saying nothing (as before), so that it is no zombie until close(); until close(), or every one died."""
    while not children.closing.wait(_WATCH_S):
        ended = [proc.poll() is not None for proc in children.procs]  # (poll() reaps a child that ended)
        if all(ended):
            return


def _read_available(proc: subprocess.Popen[bytes]) -> bytes:
    """What ``proc`` wrote to its stdout that can be read now, without waiting."""
    if proc.stdout is None or proc.stdout.closed:
        return b""
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 4096)
    except BlockingIOError:
        return b""


def _exit_status(code: int) -> str:
    """ "exited with code 1", "was killed by SIGKILL"."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stop_all(children: _Children, socket_dir: str | None, lock: int | None = None) -> None:
    with children.lock:  # (a server being started again is in children.procs already)
        children.closing.set()
    try:
        _stop_all_procs(children.procs, children.listening)
        # The supervisor reads the pipes of servers it started again: it is done (it sees closing
        # within _WATCH_S) before they are closed under it. (Not when this runs in its thread: a
        # garbage collection there.)
        watcher = children.watcher
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join(timeout=2.0)
        for proc in children.procs:
            if proc.stdout is not None:  # (its "listening on" line was read long ago; stderr's reader closes that)
                proc.stdout.close()
    finally:  # (a second Ctrl-C while they stop too: the servers notice their parent's end)
        _unname_servers(children)
        if socket_dir is not None:
            for name in os.listdir(socket_dir) if os.path.isdir(socket_dir) else ():
                with suppress(OSError):
                    os.unlink(os.path.join(socket_dir, name))
            with suppress(OSError):
                os.rmdir(socket_dir)
        if lock is not None:
            os.close(lock)


def _stop_all_procs(procs: list[subprocess.Popen[bytes]], listening: Sequence[bool] | None = None) -> None:
    """Stop ``procs`` and wait for them: SIGTERM, then SIGKILL (see _kill) after _STOP_WAIT_S, or
    after _UNREADY_GRACE_S for those ``listening`` says have not said they listen (all do when None);
    a wait past _SAY_WAIT_S is logged, and the stop of more than SERVERS_PER_CPU on each CPU at once (both
    times scale with them: 256 servers on 2 CPUs stopped in ~18 s, the progress bar at 100 % meanwhile)."""
    procs = list(procs)
    ready = list(listening) if listening is not None else [True] * len(procs)
    for proc in procs:
        if proc.poll() is None:
            with suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    crowd, cpus = crowding(len(procs))
    crowd = max(1.0, crowd)
    if crowd > 1 and (stopping := sum(proc.poll() is None for proc in procs)):
        log.warning(
            "stopping %d env servers on %d CPU%s: they take a while (Ctrl-C kills them at once)",
            stopping,
            cpus,
            "s" if cpus != 1 else "",
        )
    # (a hung server killed within a minute however many stop)
    say_at, kill_at = start + _SAY_WAIT_S * crowd, start + min(_STOP_WAIT_S * crowd, 60.0)
    try:
        for proc, listens in zip(procs, ready, strict=True):
            _wait_or_kill(proc, say_at if listens else start + _UNREADY_GRACE_S, kill=not listens)
        running = [proc for proc in procs if proc.poll() is None]
        if running:
            log.warning(
                "stopping %d env server%s: waiting up to %.0f s more for %s to finish %s calls and close %s envs "
                "(then killing %s)",
                len(running),
                "s" if len(running) > 1 else "",
                kill_at - time.monotonic(),
                *(("them", "their", "their", "them") if len(running) > 1 else ("it", "its", "its", "it")),
            )
            for proc in running:
                _wait_or_kill(proc, kill_at, kill=True)
    except KeyboardInterrupt:  # (asked not to wait: killed now, not left running once close() is over)
        for proc in procs:
            if proc.poll() is None:
                _kill(proc)
        raise


def _wait_or_kill(proc: subprocess.Popen[bytes], deadline: float, *, kill: bool) -> None:
    """Wait for ``proc`` until ``deadline`` (time.monotonic()); then kill it (``kill``) or leave it."""
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        if kill:
            _kill(proc)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc`` with its process group (a server leads its own: start_new_session), so that the
    processes it started go with it (async vectorization's workers, an env's simulator), and wait for it."""
    if proc.returncode is None:  # (not reaped: its pid, and so the group's id, are still its own)
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with suppress(ProcessLookupError):
        proc.kill()
    proc.wait()


def _labels(indices: Sequence[int], prefix: str = "local") -> str:
    """The labels of the servers ``indices`` (ascending; their labels' ``prefix``), runs of three or more as
    ``local-0 to local-31``."""
    label = functools.partial(server_label, prefix=prefix)
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ", ".join(
        f"{label(run[0])} to {label(run[-1])}" if len(run) > 2 else ", ".join(map(label, run)) for run in runs
    )


def server_label(index: int, prefix: str = "local") -> str:
    """How the learner names the ``index``-th server it started: ``local-0``, as its metrics do (the
    ``replica`` label, metrics.jsonl's ``replicas/local-0/...``: learner.fleetwatch), its log lines and
    those forwarded from it; its address is new each session, its place is not. ``prefix``: that of a
    LocalServers started with another ``label_prefix`` (``eval-0``: learner train --eval-every's)."""
    return f"{prefix}-{index}"


# The servers of the LocalServers running in this process, by address: their label (server_label) and
# whose they are (_Children), from their start until close(); see label_of.
_LABELS: dict[str, tuple[str, _Children]] = {}


def label_of(address: str) -> str:
    """How the learner's log lines and errors name the env server at ``address``: ``local-0`` for the first
    server of a :class:`LocalServers` running in this process (until its close(): as that server's forwarded
    lines, metrics and Prometheus labels name it, by :func:`server_label`; its address, a temporary folder's
    socket or a free port, is new each session and tells nothing), else ``address`` itself (servers
    started elsewhere: ``learner train --servers``). Where several LocalServers run at once, each has a
    ``local-0``: then with its address, ``local-0 (unix:/tmp/envfleet-.../server-0.sock)``."""
    entry = _LABELS.get(address)
    if entry is None:
        return address
    label, owner = entry
    if any(other == label and by is not owner for other, by in list(_LABELS.values())):
        return f"{label} ({address})"
    return label


def left_down(address: str) -> str | None:
    """Why the env server at ``address`` stays down, where it is one of a running LocalServers' that its
    supervisor left down (it died too often: "was killed by SIGSEGV, and was left down after 5 restarts
    within 60 s"); None otherwise. For an error that ends a run: the fleet's own last error is what the
    learner saw of it (a broken connection), not why."""
    entry = _LABELS.get(address)
    return entry[1].left_down.get(address) if entry is not None else None


def _name_servers(children: _Children, addresses: Sequence[str]) -> None:
    """Have :func:`label_of` name ``children``'s servers, at ``addresses``, by their labels (a restart keeps
    its address, and so its name)."""
    for i, address in enumerate(addresses):
        _LABELS[address] = (children.label(i), children)


def _unname_servers(children: _Children) -> None:
    """Stop naming ``children``'s servers (they stopped: their addresses, a port say, may go to another
    server)."""
    for address in [a for a, (_, owner) in list(_LABELS.items()) if owner is children]:
        _LABELS.pop(address, None)


def server_logger_name(index: int, prefix: str = "local") -> str:
    """The logger the ``index``-th local server's output is forwarded to (``env_server[local-0]``; of a
    LocalServers with another ``label_prefix``, ``env_server[eval-0]``): its text lines are logged there, its
    JSON records through it (so its level and filters apply) under their own logger's name with the server's
    label (``env_server.service[local-0]``)."""
    return f"env_server[{server_label(index, prefix)}]"


def _forwarded_level(prefix: str = "local") -> str:
    """The env-server ``--log-level`` that makes local servers (their labels' ``prefix``) log what this process
    would show of their forwarded lines (the effective level of the ``env_server[local-i]`` loggers)."""
    level = logging.getLogger(server_logger_name(0, prefix)).getEffectiveLevel()
    for at_most, name in ((logging.DEBUG, "debug"), (logging.INFO, "info"), (logging.WARNING, "warning")):
        if level <= at_most:
            return name
    return "error"


def _forwarded_format(prefix: str = "local") -> str:
    """The env-server ``--log-format`` for local servers: json where a handler that writes their forwarded
    lines formats JSON (``learner --log-format json``: a log collector then parses theirs, tracebacks in
    one record, as the learner's own), else text."""
    logger: logging.Logger | None = logging.getLogger(server_logger_name(0, prefix))
    while logger is not None:
        if any(isinstance(handler.formatter, JsonLogFormatter) for handler in logger.handlers):
            return "json"
        logger = logger.parent if logger.propagate else None
    return "text"


# Lines envs print when they are built (ale-py's, once per server, where the server does not turn it off as
# env_server.envs.quiet_env_libraries does: an env class that imports ale-py as it is built): not warnings.
_BANNERS = ("A.L.E: Arcade Learning Environment", "[Powered by Stella]")
# Known third-party noise, once per env built, that the user can do nothing about: debug lines.
# Recent MuJoCo (4.0, say) on gymnasium's own half_cheetah.xml, which sets settotalmass (HalfCheetah): where
# the server has MuJoCo log it (env_server.envs.quiet_env_libraries), it is at debug there; an env class that
# imports MuJoCo only as it is built still has it printed.
_NOISE = ("WARNING: compiler attribute 'settotalmass' is deprecated",)


def _forward_stderr(
    proc: subprocess.Popen[bytes], index: int, tail: collections.deque[_Line], prefix: str = "local"
) -> None:
    """Pass the log lines of server ``index`` (its label's ``prefix``) on to this process's logging, keeping the
    last few for errors."""
    assert proc.stderr is not None
    label = server_label(index, prefix)
    server_log = logging.getLogger(server_logger_name(index, prefix))
    level, traceback = logging.WARNING, False  # (the server's last log line's level; a traceback since)
    with proc.stderr:  # closed at its end (the server's exit)
        for raw in proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            entry = _json_record(line)
            line = _visible(line)
            if not line:
                continue
            if entry is not None:  # (env-server --log-format json)
                entry = {key: _visible(value) if isinstance(value, str) else value for key, value in entry.items()}
                try:
                    _forward_record(server_log, label, entry, tail)
                except Exception:  # (a record that cannot be remade: said as the line it is; reading goes on, or
                    # the server would block once its stderr's pipe is full)
                    server_log.warning("%s", line)
                level, traceback = logging.WARNING, False
                continue
            # Server lines look like "<date> <time> LEVEL logger: message": logged as "logger: message"
            # at that level (this process's log lines have a time of their own).
            header = _SERVER_LINE.match(line)
            if header is not None:
                level, traceback = _LOG_LEVELS[header["level"]], False
                shown, message = level, header["message"]
            else:
                # A traceback (chained ones, its exception's lines) at the level of the server's line it
                # follows, WARNING at least (an uncaught one follows an INFO line); until the next server
                # line, whatever comes is taken as its part. Anything else an env prints: WARNING.
                traceback = traceback or line.startswith("Traceback (most recent call last):")
                shown, message = max(level, logging.WARNING) if traceback else logging.WARNING, line
            kept = shown
            if line.startswith("env-server: error:"):
                shown = logging.DEBUG  # a bad configuration: the error raised for the server quotes this line
                kept = logging.ERROR
            elif line.startswith(_BANNERS):
                shown = kept = logging.INFO  # an env's own greeting on being built, not a problem
            elif line.startswith(_NOISE):
                shown = kept = logging.DEBUG
            tail.append((kept, line))
            server_log.log(shown, "%s", message)


_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # (C0 but tab and newline, DEL, C1)


def _visible(text: str) -> str:
    """A server's output line (or a JSON record's text) without its colour codes (gymnasium's warnings are yellow;
    an env's own) and its other control characters escaped (``\\x1b``): in text logs the colour spilled into the
    next records of a file or a pager, and an env's escape sequence (clear the screen, move the cursor) acted on the
    user's terminal. Of a line redrawn with carriage returns (an env's own progress bar), what a terminal shows:
    its last part."""
    shown = "\n".join(line.rsplit("\r", 1)[-1] for line in COLOUR.sub("", text).rstrip().split("\n"))
    return _CONTROL.sub(lambda found: f"\\x{ord(found[0]):02x}", shown)


def _json_record(line: str) -> dict[str, Any] | None:
    """The log record a server wrote as a JSON line (env-server --log-format json: level, logger, message,
    and where it had them exception and stack); None for any other line (an env's print, a crash)."""
    if not line.startswith("{"):
        return None
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    if not (isinstance(entry, dict) and isinstance(entry.get("message"), str)):
        return None
    if not (isinstance(entry.get("level"), str) and entry["level"] in _LOG_LEVELS):  # (a list: unhashable)
        return None
    return entry


def _forward_record(
    server_log: logging.Logger, label: str, entry: dict[str, Any], tail: collections.deque[_Line]
) -> None:
    """Log a server's JSON record through ``server_log`` as the server logged it: its level, its logger's name
    with the server's ``label`` (``env_server.isolation[local-0]``), its message, and its traceback as the
    record's ``exc_text`` (not lines of its own); kept in ``tail`` as its text line would be."""
    level = _LOG_LEVELS[entry["level"]]
    name, message = str(entry.get("logger") or "env_server"), entry["message"]
    exception = entry.get("exception") if isinstance(entry.get("exception"), str) else None
    stack = entry.get("stack") if isinstance(entry.get("stack"), str) else None
    # env-server's own error (logger env_server; in text, the line "env-server: error: ..."): as that line
    said = name == "env_server" and level >= logging.ERROR
    text = f"env-server: error: {message}" if said else f"{entry.get('time', '')} {entry['level']} {name}: {message}"
    tail.append((level, text))
    tail.extend((max(level, logging.WARNING), line) for line in (exception or "").splitlines() if line)
    shown = logging.DEBUG if said else level
    if not server_log.isEnabledFor(shown):
        return
    record = server_log.makeRecord(f"{name}[{label}]", shown, "(env server)", 0, message, (), None, sinfo=stack)
    record.exc_text = exception
    server_log.handle(record)


# A server's log line (env_server.tuning's format): date, time (with its UTC offset, or without, as servers
# before it wrote it), level, then "logger: message".
_SERVER_LINE = re.compile(
    r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}(?:[+-]\d{4})? (?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<message>.*)"
)


def _taking_the_arguments_of(cls: Callable[P, Any]) -> Callable[[Callable[..., R]], Callable[P, R]]:
    """A function that passes its arguments on to ``cls``, typed and shown (``help()``, ``inspect.signature``)
    with ``cls``'s parameters and its own return annotation: as ``**kwargs: Any``, type checkers took a misspelt
    option and help() hid them."""

    def taking(function: Callable[..., R]) -> Callable[P, R]:
        returns = inspect.signature(function).return_annotation
        function.__signature__ = inspect.signature(cls).replace(return_annotation=returns)  # type: ignore[attr-defined]
        return function

    return taking


@_taking_the_arguments_of(LocalServers)
@contextmanager
def local_servers(*args: Any, **kwargs: Any) -> Iterator[list[str]]:
    """Start local env servers for the duration of a ``with`` block; yields their addresses. Its arguments are
    :class:`LocalServers`'.

    >>> with local_servers("CartPole-v1", 2, 4) as addresses:  # doctest: +SKIP
    ...     envs = RemoteVectorEnv(addresses)
    ...     envs.reset(seed=0)
    """
    servers = LocalServers(*args, **kwargs)
    try:
        yield servers.addresses
    finally:
        servers.close()


def crowding(count: int) -> tuple[float, int]:
    """How crowded ``count`` local servers are on the CPUs this process may use (:func:`usable_cpus`, given
    too): their count over SERVERS_PER_CPU on each. Above 1, they take a while to start and to stop, and
    are said to."""
    cpus = usable_cpus()
    return count / (SERVERS_PER_CPU * cpus), cpus


def usable_cpus(root: str = "/") -> int:
    """The CPUs this process may run on: its affinity, or its cgroup's CPU quota if lower (a
    container started with ``--cpus``: :func:`cgroup_cpu_quota`; ``root``: where its files are looked
    for, the file system's root but in tests)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on this platform
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return cpus


def socket_folder(address: str) -> str | None:
    """The folder of a ``unix:PATH`` address's socket; None for other addresses."""
    path = unix_path(address)
    return None if path is None else os.path.dirname(os.path.abspath(path))


def socket_folder_gone(address: str, *, local_only: bool = False) -> str | None:
    """Why no server can come to a ``unix:PATH`` address, in words, when its socket's folder does not
    exist (LocalServers removes theirs as they stop); else None: a server may be starting there.
    ``local_only``: only for a folder named as LocalServers name theirs (:func:`is_local_socket_dir`)."""
    folder = socket_folder(address)
    if folder is None or (local_only and not is_local_socket_dir(folder)):
        return None
    try:
        os.stat(folder)
    except FileNotFoundError:
        return (
            f"the folder of its socket, {folder}, does not exist: were its servers stopped (their local_servers "
            "block left, or their LocalServers closed or garbage-collected: keep it in a variable while its "
            "addresses are in use, or use a local_servers block)?"
        )
    except OSError:  # (no permission to look, say: not known to be gone)
        return None
    return None
