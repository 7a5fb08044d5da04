"""ServerConfig: everything an env server is started with (only the CLI reads the command line)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["VECTORIZATIONS", "AUTORESET_MODES", "ServerConfig", "duplicate_wrapper"]

VECTORIZATIONS = ("sync", "async", "vector_entry_point")
AUTORESET_MODES = ("NextStep", "SameStep", "Disabled")


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
    step_delay_ms: float = 0.0
    """Extra latency per step (a slow simulator or robot); the server's envs wait concurrently."""
    spin_wait_ms: float = 0.0
    """Step socket: after answering a step, look for the learner's next one awake (polling, yielding
    the CPU) for up to this long, while its steps have been coming that soon; 0: sleep at once."""
    claim_timeout_s: float = 30.0
    """A session with no open Hold stream and no calls for this long ends by itself."""
    parent_pid: int | None = None
    """Exit when this process is gone (set by learners that start servers as subprocesses)."""
    grace_s: float = 5.0
    """On SIGTERM/SIGINT: seconds to let calls in flight finish before exiting."""
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

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key: give both (the certificate and its private key) or neither")


def duplicate_wrapper(names: Sequence[str]) -> str | None:
    """The first wrapper named more than once in ``names``, or None. Each applies once: a second
    'atari', say, would preprocess frames it already preprocessed, and fail at every reset."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            return name
        seen.add(name)
    return None
