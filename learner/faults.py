"""Fault tolerance of RemoteVectorEnv: each server's state, reconnecting with backoff, failure counters.

A server is UP (stepped as usual), DOWN (it failed: its envs are unavailable while a reconnect task
tries, with exponential backoff, to open a new session on the same address), or READY (a new
session is open and its envs were reset: the next step hands their first observations to the
learner, as a reset, and the server is UP again). See :class:`learner.remote.RemoteVectorEnv`.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from env_server.rpc import env_pb2 as pb
from learner.client import EnvClient
from learner.errors import AuthenticationError, InvalidRequestError, RemoteEnvError

__all__ = ["FaultStats", "Replica", "ReplicaState", "is_outage", "reconnect"]

log = logging.getLogger(__name__)


class ReplicaState(enum.Enum):
    UP = "up"
    DOWN = "down"
    READY = "ready"


def is_outage(err: BaseException) -> bool:
    """Whether ``err`` means the server is gone, hung, restarted or its env broke (so: reconnect),
    rather than a mistake of the learner's (invalid actions) or of its configuration (a wrong token)."""
    return isinstance(err, RemoteEnvError) and not isinstance(err, InvalidRequestError | AuthenticationError)


@dataclass(frozen=True)
class FaultStats:
    """A fleet's failures and recoveries, counted since the RemoteVectorEnv was made."""

    failures: int = 0
    """Times a server was lost (an error or a missed deadline on a step or reset, or its connection
    found dropped between rollouts), not counting ``shutdowns``."""
    shutdowns: int = 0
    """Times a server left saying it was shutting down (SIGTERM: a scale-down, a restart, a rolling
    update): planned, so not failures, though its envs are unavailable the same way until it is back
    or the fleet is looked up again."""
    reconnects: int = 0
    """Times a lost server came back (new session, envs reset)."""
    server_restarts: int = 0
    """Reconnects to a server process other than the one lost (its server id changed)."""
    env_steps_lost: int = 0
    """Env steps that were no transition: an env unavailable (its server down, or its env raised)."""
    env_errors: int = 0
    """Exceptions of single envs, reported by their servers (``infos["env_error"]``)."""
    servers_down: int = 0
    """Servers unavailable now."""
    envs_unavailable: int = 0
    """Envs unavailable now (those of the servers down)."""
    servers_joined: int = 0
    """Servers that joined the fleet when it was looked up again (``refresh``): new replicas, or old
    ones back at another address."""
    servers_left: int = 0
    """Servers that left it (no longer listed, or their session ended between steps)."""

    def metrics(self, prefix: str = "faults/") -> dict[str, int]:
        return {f"{prefix}{k}": int(v) for k, v in asdict(self).items()}


@dataclass
class Replica:
    """One server slot of the fleet: its client, its state, and its counters."""

    client: EnvClient
    spec: pb.EnvSpec
    """The spec the fleet was built with (a server that comes back must match it)."""
    state: ReplicaState = ReplicaState.UP
    reconnect_task: asyncio.Task[None] | None = None
    fresh: pb.ResetResponse | None = None
    """READY: the reset that opened the new session, waiting to be handed to the learner."""
    truncate_next: bool = False
    """DOWN: the next step reports the envs' episodes as truncated (once, where they were lost)."""
    down_since: float = 0.0
    last_error: str = ""
    planned: bool = False
    """DOWN: it went down saying it was shutting down (a scale-down, a restart), not by failing."""
    changed: str = ""
    """DOWN: why the server, back, cannot take its old place (another num_envs, other spaces); "" if not
    known to be so. ``RemoteVectorEnv.refresh`` lets it go and takes it in as a new server."""
    failures: int = 0
    shutdowns: int = 0
    reconnects: int = 0
    server_restarts: int = 0
    sessions: list[str] = field(default_factory=list)
    """Session ids opened on this address, newest last (released on reconnect if the server lives)."""


async def reconnect(
    replica: Replica,
    *,
    timeout: float,
    connect_timeout: float,
    backoff: tuple[float, float],
    on_ready: Any,
) -> None:
    """Open a new session on ``replica``'s server and reset its envs, retrying with backoff until it works.

    The channel reconnects by itself (its own backoff tops at 2 s); each attempt waits for it, asks
    GetSpec (a changed server id means a new server process), releases this learner's old session
    if the server is the same process (after a network cut or a hang it may still hold the claim),
    then Handshake, Hold and Reset. ``on_ready()`` is called once the server is READY.
    """
    client = replica.client
    delay = backoff[0]
    attempt = 0
    said = ""  # the last cause warned of: said once, then at DEBUG while it stays the same
    while True:
        attempt += 1
        try:
            await asyncio.wait_for(client.wait_ready(), connect_timeout)
            spec = await client.get_spec()
            problem = incompatible(replica.spec, spec)
            replica.changed = problem
            if problem:
                raise _Incompatible(
                    f"{problem}; its envs stay unavailable until the fleet is looked up again (refresh(), which "
                    "learner train calls between rollouts, takes it in with its new envs)"
                )
            same_process = spec.server_id == replica.spec.server_id
            if same_process:
                for session_id in replica.sessions[-2:]:
                    await client.release_session(session_id, timeout)
            response = await client.handshake()
            client.start_session(response)
            replica.sessions = [*replica.sessions[-1:], response.session_id]
            fresh = await client.reset(None, None, None)
        except asyncio.CancelledError:
            client.abandon()
            raise
        except (TimeoutError, RemoteEnvError, _Incompatible) as err:
            client.abandon()
            text = "no connection" if isinstance(err, TimeoutError) else str(err)
            # Causes no retry mends (the operator's to fix) are warned of once, not at every attempt.
            warn = isinstance(err, _Incompatible | AuthenticationError) and text != said
            if warn:
                said = text
            log.log(
                logging.WARNING if warn else logging.DEBUG,
                "reconnect to %s, attempt %d: %s",
                client.address,
                attempt,
                text,
            )
            if not isinstance(err, TimeoutError):  # a wait for the connection already took its time
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, backoff[1])
            continue
        replica.fresh = fresh
        replica.changed = ""
        replica.state = ReplicaState.READY
        replica.reconnects += 1
        if not same_process:
            replica.server_restarts += 1
        replica.spec = spec
        (log.info if replica.planned else log.warning)(
            "env server %s is back after %.1f s (%s); its %d envs rejoin with new episodes",
            client.address,
            time.monotonic() - replica.down_since,
            "same process" if same_process else f"restarted: server id {spec.server_id[:8]}",
            spec.num_envs,
        )
        on_ready()
        return


class _Incompatible(Exception):
    """The server at the address now hosts envs that do not fit the fleet."""


FLEET_FIELDS = ("observation_space", "action_space", "autoreset_mode")
"""What every server of one fleet must agree on (their EnvSpec fields)."""


def incompatible(want: pb.EnvSpec, got: pb.EnvSpec) -> str:
    """Why a server that came back with spec ``got`` cannot take its old place (``want``) in the fleet; "" if it can."""
    for name in ("num_envs", *FLEET_FIELDS):
        if getattr(want, name) != getattr(got, name):
            return (
                f"the server came back with another {name} ({got.env_id}, {got.num_envs} envs) than the fleet's "
                f"({want.env_id}, {want.num_envs} envs)"
            )
    return ""
