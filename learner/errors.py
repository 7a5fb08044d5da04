"""The learner's exceptions: every gRPC failure reaches users as one of these, naming the server; and the
words for an OSError in a message (:func:`os_reason`)."""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:  # (imported here, not where used: out of file descriptors, an import fails too)
    import resource
except ImportError:  # pragma: no cover (Windows)
    resource = None  # type: ignore[assignment]

if TYPE_CHECKING:  # only for annotations: importing this module must not import grpc (see learner.cli)
    import grpc

log = logging.getLogger(__name__)

__all__ = [
    "AuthenticationError",
    "ConcurrentUseError",
    "EnvCrashedError",
    "FDS_PER_SERVER",
    "EnvFleetError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "InvalidRequestError",
    "InvalidResponseError",
    "OptionError",
    "RemoteEnvError",
    "RemoteTimeoutError",
    "RunCompleteError",
    "RunDirWriteError",
    "ServerBusyError",
    "ServerFullError",
    "ServerStartError",
    "ServerUnavailableError",
    "SessionError",
    "SpecMismatchError",
    "TrackingError",
    "TrainingInterrupted",
    "UnusableEnvOutputError",
    "UpdateDivergedError",
    "install_hint",
    "os_reason",
    "out_of_fds",
    "raise_first",
]

# The file descriptors a learner holds per env server it steps (measured with ulimit -n: about 5 per
# local server on Unix sockets, about 4 per server over TCP).
FDS_PER_SERVER = 5


def out_of_fds(err: BaseException) -> str | None:
    """What an error that is the process's (EMFILE) or the system's (ENFILE) lack of file descriptors is,
    in words, and the way out: the words to report it with instead of its own ("Too many open files",
    which a report of a failed write made to sound like the disk's fault); None for any other error."""
    if not isinstance(err, OSError) or err.errno not in (errno.EMFILE, errno.ENFILE):
        return None
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        limit = "unlimited" if soft == resource.RLIM_INFINITY else str(soft)
    except (AttributeError, OSError, ValueError):  # (Windows has no resource module)
        limit = "?"
    need = f"ulimit -n is {limit}; a learner needs about {FDS_PER_SERVER} per env server"
    if err.errno == errno.ENFILE:  # (the system's table: ulimit does not lift it)
        return f"out of file descriptors, system-wide ({need}): close other programs' files or raise fs.file-max"
    return f"out of file descriptors ({need}): raise ulimit -n"


def os_reason(err: OSError) -> str:
    """An OSError in words for a message: :func:`out_of_fds`'s where it is a lack of file descriptors
    (with the way out), else its own (``strerror``, or the whole error where it has none)."""
    return out_of_fds(err) or err.strerror or str(err)


class EnvFleetError(Exception):
    """Base class of envfleet's own errors: of servers, sessions, runs and envs' output. Refused arguments are
    ValueErrors: InvalidArgumentError and OptionError (EnvFleetErrors too), plain ones from ``Args``' checks; a
    checkpoint that cannot be read is a ``learner.checkpoint.UnreadableCheckpointError`` (a ValueError).

    Attributes:
        partial_result: on an error that stopped :func:`learner.evaluate.evaluate` from its first reset
            on (a server lost, a deadline passed, an env that raised), what it would have returned of the
            episodes finished before it (maybe none), with ``episodes_asked`` (its ``episodes``); None
            otherwise.
            So the return of the episodes that did finish is not lost with the error.
    """

    partial_result: dict[str, Any] | None = None


class InvalidArgumentError(EnvFleetError, ValueError):
    """An argument given to envfleet is invalid, found before anything is sent: the message names
    the argument, what was expected and what came (e.g. ``timeout=float("inf")``, reset ``options``
    that cannot be sent, a batch of actions of the wrong shape). An action outside the space is an
    :class:`InvalidRequestError` instead: it names the env and its server."""


class InvalidArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type or dtype (also a TypeError, where gymnasium raises one: a
    ``reset_mask`` that is a list, or not bool)."""


class OptionError(EnvFleetError, ValueError):
    """A command-line option's value that a command can only find wrong once it runs (against a resumed
    run's checkpoint, or what the servers serve): the command says so as a usage error, exit status 2, as
    no retry would mend it (the Kubernetes Job fails at once on 2)."""


class RunCompleteError(OptionError):
    """A resumed run with nothing left to do: its env steps are done, or it was solved under a bar no
    lower than the one asked for. ``learner train --resume RUN`` without a new target says so and exits
    0 (a Kubernetes Job's pod that resumes a run finished just before it was stopped succeeds); with
    one (--total-timesteps, --stop-at-return) it is a usage error."""


class RunDirWriteError(EnvFleetError, OSError):
    """A file of a run's run dir could not be written (a full disk, a read-only mount): the message
    names the file, why, and the room left where it goes."""


class TrackingError(EnvFleetError):
    """``learner train --track``: Weights & Biases could not start the run (not logged in, a project it may
    not write to, ...); the message has wandb's own, and what to do."""


class TrainingInterrupted(KeyboardInterrupt):
    """``train()`` was stopped by Ctrl-C (a notebook's kernel interrupt), SIGTERM or SIGHUP, and stopped as asked:
    at the next step, with its checkpoint, summary.json and plot written. Raised once they are, so that
    what called it stops too (a loop over seeds, a notebook's "Run All") instead of going on to the next
    run; a KeyboardInterrupt, so that code that stops on Ctrl-C stops on it. ``learner train`` says where
    the run is and how to resume it, and exits 130 (0 when the run had ended all the same).

    Attributes:
        summary: what ``train()`` would have returned (summary.json's, with ``run_dir``): ``stop_reason``
            "interrupted", or the reason the run ended for when the Ctrl-C came during its last update.
        run_dir: the run's dir: ``train(resume_args(err.run_dir))`` goes on from its last checkpoint.
    """

    def __init__(self, summary: dict[str, Any], run_dir: str | Path) -> None:
        self.summary = summary
        self.run_dir = Path(run_dir)
        super().__init__(
            f"training stopped at step {summary.get('total_steps', 0):,} (Ctrl-C, SIGTERM or SIGHUP); the run is in "
            f"{self.run_dir}: go on with train(resume_args({str(self.run_dir)!r}))"
        )

    def __reduce__(self) -> tuple[Any, ...]:  # (its arguments are not the message: pickled as made)
        return type(self), (self.summary, self.run_dir)


class ServerStartError(EnvFleetError):
    """A local env server could not be started (its own message is included)."""


class ConcurrentUseError(EnvFleetError, RuntimeError):
    """A call of a RemoteVectorEnv while another thread is in one of its calls: one env is used from one thread
    at a time (its steps' bookkeeping is one step's); refused before anything is sent, the other call goes on."""


class SpecMismatchError(EnvFleetError):
    """Servers given to one RemoteVectorEnv host envs with different spaces or autoreset modes.

    Attributes:
        address: the server whose envs do not fit the fleet's, as given (the first, where several do not);
            None where no one server is to blame.
    """

    def __init__(self, *args: object, address: str | None = None) -> None:
        super().__init__(*args)
        self.address = address

    def __reduce__(self) -> tuple[Any, ...]:  # (pickled and copied with its address, as RemoteEnvError is)
        return functools.partial(type(self), address=self.address), self.args, self.__dict__


class RemoteEnvError(EnvFleetError):
    """A call to one env server failed.

    Attributes:
        address: the server's address, as given (or as resolved from a ``dns:///`` name).
        code: the gRPC status code: the server's, or, for what the client refuses before sending (an
            invalid action, a step after a failed one), the one the server would send; None when no
            call was made otherwise (e.g. nothing listens).
        env_index: the env the error is about, counted over all servers, when the server named one.
        details: the status's text as the server sent it ("" when there was none, or no status): what
            code that looks for a stable text of the protocol (``env_server.protocol``: NOT_OWNED,
            SHUTTING_DOWN_MESSAGE, ...) compares, since the message shows it escaped and shortened
            (``learner.client.server_text``).
    """

    def __init__(
        self,
        message: str,
        *,
        address: str,
        code: grpc.StatusCode | None = None,
        env_index: int | None = None,
        details: str = "",
    ) -> None:
        super().__init__(message)
        self.address = address
        self.code = code
        self.env_index = env_index
        self.details = details

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (and copied) with its keyword arguments: pickle remakes an exception from its args alone,
        # which lack ``address``, so a process pool's worker that raised one broke the pool (BrokenProcessPool;
        # multiprocessing.Pool's result thread died and get() hung).
        remake = functools.partial(
            type(self), address=self.address, code=self.code, env_index=self.env_index, details=self.details
        )
        return remake, self.args, self.__dict__


class ServerUnavailableError(RemoteEnvError, ConnectionError):
    """Nothing answers at the address, or the connection to the server was lost."""


class ServerBusyError(RemoteEnvError):
    """Another learner holds the server's envs (one learner owns a server at a time)."""


class ServerFullError(ServerBusyError):
    """The server serves as many calls at once as it takes (env-server --max-concurrent-rpcs): other
    clients hold them. Busy, but not claimed by another learner."""


class InvalidRequestError(RemoteEnvError, ValueError):
    """A request's contents are invalid (INVALID_ARGUMENT): e.g. an action outside the space.

    ``RemoteVectorEnv`` checks a batch of array actions before sending any of it, as the servers
    would, so no server steps on a bad batch; ``address`` is then the server the bad env lives on.
    """


class InvalidResponseError(RemoteEnvError):
    """A server's answer could not be read, or does not fit the fleet: values the codec cannot decode,
    observations of another shape than the fleet's space, infos laid out otherwise than the other
    servers' for the same key (a server of another version, or another configuration of the env).
    Fault-tolerant, the server counts as lost, as when it fails; ``code`` is None (the call itself
    succeeded)."""

    out_of_step: bool = False
    """Whether the answer was to another request than the one sent (StepResponse.step_id): no one-off
    of an answer's content, but a server that does not keep to the protocol."""


class SessionError(RemoteEnvError):
    """The call was out of order (FAILED_PRECONDITION): step before reset, a session that ended, or
    (refused by RemoteVectorEnv itself) a step after one that failed part way, before a reset."""


class RemoteTimeoutError(RemoteEnvError, TimeoutError):
    """The server did not answer within the call's deadline."""


class EnvCrashedError(RemoteEnvError):
    """The environment raised inside the server (INTERNAL); the message has the exception."""


class AuthenticationError(RemoteEnvError, PermissionError):
    """The server requires a token (or TLS) and refused the one given."""


class UnusableEnvOutputError(EnvFleetError, ValueError):
    """An env gave what training (or evaluating) cannot use: a NaN or infinite reward, or an observation
    the policy cannot act on (NaN or infinite values, outside its Discrete space). The message names the
    env and, on env servers, the server that hosts it. The env's to fix (or a wrapper's); an
    EnvFleetError, so that ``learner train`` ends with how to go on from the run's last checkpoint once
    it is, as for the other errors that stop a run (and a ValueError, as it was before it was one)."""


class UpdateDivergedError(EnvFleetError, FloatingPointError):
    """PPO's update made the gradient NaN or infinite (a loss overflowed: returns too large for float32,
    say), which would leave the nets NaN: the run stops, no checkpoint of that update written. The
    message says in which epoch and minibatch, with their losses."""


def install_hint(missing: str) -> str:
    """How to install ``missing``, a package of the learner extra (envfleet[learner]) that an import did
    not find: torch first, and on a CPU-only machine its small CPU build (a plain ``pip install torch``
    there pulls the multi-GB CUDA build)."""
    how = "pip install 'envfleet[learner]' (from a clone: pip install -e '.[learner]')"
    if missing != "torch":
        return how
    return (
        "pip install torch (on a CPU-only machine, the small CPU build: pip install torch "
        f"--index-url https://download.pytorch.org/whl/cpu), then {how}"
    )


def raise_first(errors: Sequence[BaseException]) -> None:
    """Raise the first of ``errors`` (in server order), with the others as its notes; nothing if none."""
    if not errors:
        return
    first = errors[0]
    for err in errors[1:]:
        # On the exception (shown with its traceback), not on stderr through logging's last resort. The same
        # error of another server (a wrong token at each, with its long hint): named, not repeated.
        here, there = getattr(err, "address", ""), getattr(first, "address", "")
        same = here and there and str(err).replace(here, there, 1) == str(first)
        first.add_note(f"also: env server {here}: the same" if same else f"also: {err}")
        log.debug("%s", err)
    raise first
