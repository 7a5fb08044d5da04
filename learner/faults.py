"""Fault tolerance of RemoteVectorEnv: each server's state, reconnecting with backoff, failure counters.

A server is UP (stepped as usual), DOWN (it failed: its envs are unavailable while a reconnect task
tries, with exponential backoff, to open a new session on the same address), or READY (a new
session is open and its envs were reset: the next step hands their first observations to the
learner, as a reset, and the server is UP again). See :class:`learner.remote.RemoteVectorEnv`.

A server that is lost again soon after it came back (it answers handshakes and resets but fails its
steps: a broken env, a full step socket, a bug) is *flapping*: each such loss waits longer before
the server is taken back, on the reconnect backoff's schedule, and is logged at most once in a
while, so that it costs neither a reconnect per step nor a log line per step.

A server whose answers cannot be read (:class:`~learner.errors.InvalidResponseError`: an answer that
does not decode, or does not fit the fleet) is lost as any other, once: one such answer may be a
one-off (an answer over the size limit, infos of a rare episode end laid out otherwise). Again at once
after it came back, before it answered a step that could be read, it is *broken* (see
:data:`UNREADABLE_IN_A_ROW`): a server that does not keep to the protocol (another version, a bug in
one written from the proto) answers so every time, and reconnecting to it for good would train on
without its envs, the run "succeeding" with half of its env steps lost. So fault tolerance raises
instead, as it does for a refused token: the operator's to fix, not an outage to wait out.

A server that answers a call UNIMPLEMENTED (:func:`unserved`: a method it does not serve, a step above
all: envfleet's first versions served no StepStream) is broken the same way: it answered Handshake and
Reset, and every step of it fails alike, which fault tolerance took for an outage for good ("is back
after 0.0 s", "lost again soon after coming back", half of the run's env steps lost). Once it is an
outage all the same: an HTTP proxy between the learner and the servers may answer a call it has no
route for yet 404, which gRPC reads as UNIMPLEMENTED, for a moment (a configuration being reloaded);
again right after the reconnect, in which the server answered Handshake and Reset, with no step
answered between, no reconnect will mend it (see :meth:`Replica.broken_by`).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import grpc
import numpy as np

from env_server.envs import ObservationLayoutError
from env_server.rpc import env_pb2 as pb
from learner.client import EnvClient, released_if_given_up, shielded_handshake
from learner.discovery import probe_until
from learner.errors import (
    AuthenticationError,
    EnvCrashedError,
    InvalidRequestError,
    InvalidResponseError,
    RemoteEnvError,
)
from learner.local import label_of
from learner.specs import incompatible, warn_if_other_env

__all__ = [
    "JOIN_BACKOFF",
    "RELAPSE_LOG_S",
    "SETTLE_S",
    "SETTLE_STEPS",
    "SHUT_DOWN_WARN_S",
    "STALL",
    "STALL_BASELINE",
    "STILL_DOWN_LOG_MAX_S",
    "STILL_DOWN_LOG_S",
    "UNREADABLE_IN_A_ROW",
    "FaultStats",
    "Replica",
    "ReplicaState",
    "is_outage",
    "reconnect",
    "next_reminder_in",
    "reminder_gap",
    "still_down_gap",
    "unserved",
]

log = logging.getLogger(__name__)

SETTLE_STEPS = 3
SETTLE_S = 10.0
"""A server back from a loss has settled once it answered :data:`SETTLE_STEPS` steps and
:data:`SETTLE_S` seconds passed since it came back; lost before that, it is flapping (both: a quick
env fails 3 steps in milliseconds, a slow one may take 10 s over one step)."""

RELAPSE_LOG_S = 10.0
"""A flapping server's losses are logged at most once per this many seconds (with their count), or per a third of
the time it has been flapping, once that is longer, up to STILL_DOWN_LOG_MAX_S (see :func:`reminder_gap`): a
server whose every return fails at once (a broken env, a full disk) printed 360 such lines an hour, ~16 now."""

STILL_DOWN_LOG_S = 20.0
"""A server that stays down is said to be so at most once per this many seconds while its reconnect
retries (the attempts that failed, the last one's error): its loss is one line, and its return another,
and a user watching the run needs to see in between that it is still being tried, and why it fails.
The longer it stays down, the rarer: at most once per a third of its time down, if that is longer
(up to STILL_DOWN_LOG_MAX_S), so that between the floor and the cap each gap is half the time down before
it: 64 servers left down printed 64 lines every 20 s, ~11,500 an hour."""
STILL_DOWN_LOG_MAX_S = 600.0

SHUT_DOWN_WARN_S = 60.0
"""A server that left saying it was shutting down (a restart or an update, planned) is said to be still down at
INFO for this long, then at WARNING: a restart takes seconds, and one not back in a minute was stopped for good or
cannot start again, while the fleet goes on without its envs (a listed address is tried until the run ends; a
compose: or swarm: look-up drops a replica scaled down); not while its last answer says it is starting (up again,
building its envs, which may take longer: still INFO, with that answer). Its loss was the one WARNING: a server stopped by hand
and never started again cost half a two-server fleet's envs for the rest of the run with nothing more said at
learner train's default log level. In a fleet that is looked up again (``refresh``, between rollouts), only once
a look-up this long after it left still lists it (:attr:`Replica.looked_up_at`): a replica scaled down is
dropped by the next look-up, which a rollout longer than this (a slow env, a slow link) held off, and it was
warned of as stopped for good."""

JOIN_BACKOFF = (1.0, 15.0)
"""A server out of the fleet whose handshake failed (claimed by another learner, of another env, a token
refused) is tried again at a refresh this many seconds later: first, doubling up to longest, until it
joins or is listed no more; one that answered it is starting or shutting down (UNAVAILABLE) after the
first each time, as a server building its envs is soon there. Refresh runs between rollouts, several
times a second, and each try is a Handshake the server refuses and logs: one per rollout is hundreds a
minute. 15 s at most: a server freed joins at most that late, about as long as a claim cut off by a
partition takes to end (the server's keepalive notices within ~15 s), and each reminder that it has not
joined (every :data:`STILL_DOWN_LOG_S`) tells of a try since the last; 30 s, the default
``--claim-timeout``, would double that wait to save two refusals a minute."""

UNREADABLE_IN_A_ROW = 2
"""A server lost this many times in a row to answers that could not be read (InvalidResponseError),
with no step answered (and read) between, is broken, not out: the fault-tolerant fleet raises rather
than reconnect to it again. Between the two it was reconnected, and its reset's answer may have been
read: a server that answers resets but no step still gives nothing to learn from. One such loss alone
is an outage (a one-off is no broken server); a broken one costs a single reconnect before it is found out."""

STALL = (1.0, 10.0, 60.0)
"""A step the fleet waited at least ``least`` seconds for, one of whose answers spent that long outside
its server's envs and ``factor`` times its median time outside them (over :data:`STALL_BASELINE` steps
at least), is a stall, warned of at most once per ``every`` seconds per server (with the count since), rarer as
its stalls go on (see :func:`reminder_gap`: a server stalling every few seconds for an hour said so 60 times, 12
now): (least, factor, every). A link that stalls for a few seconds, a server paused or swapping, holds up every env
of the fleet for as long while staying within the step deadline (10 s in ``learner train``): without
this, only the latency p99 in the metrics shows it. The envs' own time (each answer says how long its
envs took) is left out: an env slow to reset, or whose steps are slow, is no stall."""

STALL_BASELINE = 20
"""How many earlier steps of a server :data:`STALL`'s median takes at least: before that many, none of its
steps is judged (a server's first steps, its connections warming up, are often slow)."""


class ReplicaState(enum.Enum):
    UP = "up"
    DOWN = "down"
    READY = "ready"


def is_outage(err: BaseException) -> bool:
    """Whether ``err`` means the server is gone, hung, restarted, its env broke or its answer could not
    be read (:class:`~learner.errors.InvalidResponseError`), so: reconnect; rather than a mistake of
    the learner's (invalid actions) or of its configuration (a wrong token). An answer that could not
    be read is an outage once: again right after the reconnect, the server is broken (see
    :meth:`Replica.broken_by`), which the fleet raises when it loses it."""
    return isinstance(err, RemoteEnvError) and not isinstance(err, InvalidRequestError | AuthenticationError)


def unserved(err: BaseException) -> bool:
    """Whether ``err`` is a call the server answered UNIMPLEMENTED: a method it does not serve (a server of
    an older envfleet version: the first served no StepStream), or an HTTP proxy's 404 (see the module's
    docstring). An outage once, broken again right after a reconnect (:meth:`Replica.broken_by`)."""
    return isinstance(err, RemoteEnvError) and err.code == grpc.StatusCode.UNIMPLEMENTED


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
    servers_not_joined: int = 0
    """Servers listed at the start that a fault-tolerant start went on without (not answering, or still
    building their envs), not joined since: now."""

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
    truncate_only: np.ndarray | None = None
    """With ``truncate_next``: a mask over its envs of those whose episodes it ends, where the others
    had none under way (lost in a reset of some of them: ``options["reset_mask"]``); None: all."""
    down_since: float = 0.0
    last_error: str = ""
    planned: bool = False
    """DOWN: it went down saying it was shutting down (a scale-down, a restart), not by failing."""
    looked_up_at: float | None = None
    """When a look-up of the fleet's addresses (``RemoteVectorEnv.refresh``, between rollouts) last listed it
    (``time.monotonic()``; the one it joined at, for a server that joined at a refresh); None where none has: a
    fleet not looked up again (the servers it started with, until its first refresh). A server that left
    saying it was shutting down and is no longer listed was scaled down: see :data:`SHUT_DOWN_WARN_S`."""
    changed: str = ""
    """DOWN: why the server, back, cannot take its old place (another num_envs, other spaces); "" if not
    known to be so. ``RemoteVectorEnv.refresh`` lets it go and takes it in as a new server."""
    failures: int = 0
    shutdowns: int = 0
    reconnects: int = 0
    server_restarts: int = 0
    sessions: list[str] = field(default_factory=list)
    """Session ids opened on this address, newest last (released on reconnect if the server lives)."""
    back_at: float = 0.0
    """When it last came back (``time.monotonic()``); 0 if it was never lost."""
    answered: int = 0
    """Steps it answered since it came back."""
    relapses: int = 0
    """Losses in a row, each before the server had settled since coming back (see :data:`SETTLE_S`)."""
    failing_since: float = 0.0
    """When it last answered no more steps: its loss, or, flapping, its first loss since it last
    answered a step; 0 while it answers. ``give_up_after`` counts from here (see
    ``RemoteVectorEnv._check_anything_left``)."""
    relapses_logged_at: float = 0.0
    """When a line last said it was lost again (see :data:`RELAPSE_LOG_S`)."""
    flapping_since: float = 0.0
    """When its relapses in a row began (the first of them); 0 while it has none."""
    relapses_unlogged: int = 0
    """Relapses since that line."""
    unreadable: int = 0
    """Losses in a row to answers that could not be read, with no step answered between (see
    :data:`UNREADABLE_IN_A_ROW`)."""
    out_of_step: int = 0
    """Losses to answers that were to another request than the one sent, steps answered between or not."""
    unimplemented: int = 0
    """Losses in a row to calls it answered UNIMPLEMENTED (:func:`unserved`), with no step answered between
    (see :meth:`broken_by`)."""
    broken: bool = False
    """DOWN, not reconnected: found broken (:meth:`broken_by`) since the fleet was last reset, which tries
    it again."""
    misfit: RemoteEnvError | None = None
    """Broken by its reconnect's reset, which returned an observation that does not fit the observation space,
    or infos too large to send (see :func:`misfit_reported`): the env's error, which every reconnect would return again; raised by the
    fleet's next step of this server (then None)."""

    def settled(self, now: float) -> bool:
        """Whether it has answered steps for long enough since it came back (or never left)."""
        return not self.back_at or (self.answered >= SETTLE_STEPS and now - self.back_at >= SETTLE_S)

    def note_loss(self, now: float, *, planned: bool = False) -> None:
        """Count a loss at ``now``: a relapse if the server had not settled since it came back, unless
        ``planned`` (it said it was shutting down: a rolling restart may come soon after a start), which
        leaves the count as it was (a server flapping before goes on waiting as long)."""
        if not planned:
            self.relapses = 0 if self.settled(now) else self.relapses + 1
            if self.relapses <= 1:
                self.flapping_since = now if self.relapses else 0.0
        if not self.failing_since:
            self.failing_since = now

    def count_loss(self, *, planned: bool) -> None:
        """Count a loss in its totals: a shutdown if it said it was shutting down (``planned``), else a
        failure."""
        if planned:
            self.shutdowns += 1
        else:
            self.failures += 1

    def note_answer(self) -> int:
        """Count a step it answered; where that settles a flapping server, the relapses in a row it
        ends (for a log line), else 0."""
        self.answered += 1
        self.failing_since = 0.0
        self.unreadable = self.unimplemented = 0
        if not self.relapses or not self.settled(time.monotonic()):
            return 0
        relapses, self.relapses, self.flapping_since = self.relapses, 0, 0.0
        self.relapses_logged_at, self.relapses_unlogged = 0.0, 0
        return relapses

    def broken_by(self, err: BaseException) -> bool:
        """Count a loss to ``err`` (before it is noted: :meth:`note_loss`); whether it makes the server
        broken: its answers could not be read :data:`UNREADABLE_IN_A_ROW` times in a row, with no step
        answered between. Other losses leave the count as it was: a server that also times out in
        between has answered nothing readable either. Answers to another request than the one sent
        count apart, whatever was answered between (a server that sends every other answer twice reads
        well right after each reconnect, and would otherwise flap for good), and only toward another such
        answer; a restarted server process starts that count anew (see :func:`reconnect`).

        A call it answered UNIMPLEMENTED (:func:`unserved`) counts apart, the same way: broken at the
        :data:`UNREADABLE_IN_A_ROW`-th in a row with no step answered between (a server without StepStream
        answers every step so, a proxy's passing 404 only for a moment: once is an outage, as an
        unreadable answer once is)."""
        if unserved(err):
            self.unimplemented += 1
            return self.unimplemented >= UNREADABLE_IN_A_ROW
        if not isinstance(err, InvalidResponseError):
            return False
        self.unreadable += 1
        self.out_of_step += err.out_of_step
        return self.unreadable >= UNREADABLE_IN_A_ROW or (err.out_of_step and self.out_of_step >= UNREADABLE_IN_A_ROW)

    def hold_off(self, backoff: tuple[float, float]) -> float:
        """Seconds to wait before taking it back after its latest loss: none after a first loss, then,
        for each relapse in a row, ``backoff``'s schedule (first, doubling, up to the longest)."""
        if not self.relapses:
            return 0.0
        return min(backoff[0] * 2 ** min(self.relapses - 1, 32), backoff[1])


def reminder_gap(lasted: float, floor: float) -> float:
    """How long after a line that reminds of a state that has lasted ``lasted`` seconds (a server down, not
    joined, flapping) the next such line may come: ``floor``, or a third of ``lasted`` where longer, up to
    STILL_DOWN_LOG_MAX_S: between the floor and the cap each gap is half the time before it."""
    return max(floor, min(lasted / 3, STILL_DOWN_LOG_MAX_S))


def next_reminder_in(lasted: float, floor: float) -> int:
    """In how many seconds (rounded up) the next reminder may come (see :func:`reminder_gap`), one having come
    as the state had lasted ``lasted`` seconds: once the time since it is the gap of the time lasted then, which
    between the floor and the cap is half the time lasted now (x >= (lasted + x) / 3)."""
    return math.ceil(max(floor, min(lasted / 2, STILL_DOWN_LOG_MAX_S)))


def still_down_gap(down: float) -> float:
    """How long after a line saying that a server is still down, or has not joined yet (learner.membership's
    reminders), the next may come, it having been so for ``down`` seconds (see :func:`reminder_gap`)."""
    return reminder_gap(down, STILL_DOWN_LOG_S)


def _still_down_gap(replica: Replica, now: float | None = None) -> float:
    """:func:`still_down_gap` of ``replica``, down since its ``down_since``."""
    return still_down_gap((time.monotonic() if now is None else now) - replica.down_since)


def _next_still_down_in(replica: Replica, now: float) -> int:
    """In how many seconds (rounded up) the next line saying that ``replica`` is still down may come, one having
    come at ``now`` (see :func:`next_reminder_in`)."""
    return next_reminder_in(now - replica.down_since, STILL_DOWN_LOG_S)


async def reconnect(
    replica: Replica,
    *,
    timeout: float,
    connect_timeout: float,
    backoff: tuple[float, float],
    on_ready: Callable[[], None],
    hold_off: float = 0.0,
    diagnose: Callable[[str, float], str | None] | None = None,
) -> None:
    """Open a new session on ``replica``'s server and reset its envs, retrying with backoff until it works.

    The channel reconnects by itself (its own backoff tops at 2 s); each attempt waits for it, asks
    GetSpec (a changed server id means a new server process), releases this learner's old session
    if the server is the same process (after a network cut or a hang it may still hold the claim),
    then Handshake, Hold and Reset. ``on_ready()`` is called once the server is READY. A flapping
    server is first left alone for ``hold_off`` seconds (:meth:`Replica.hold_off`): it answers at
    once, so without that wait it would fail, come back and fail again as fast as steps go. While the
    attempts fail, a line says so at most once per :data:`STILL_DOWN_LOG_S`, rarer as it stays down
    (INFO for a server that left saying it was shutting down, for :data:`SHUT_DOWN_WARN_S`; else WARNING), with
    the last attempt's error. An attempt that got no connection says why, where ``diagnose(address, timeout)`` can tell
    (RemoteVectorEnv's: "connection refused", "no socket file ..."): a server killed refuses at once, and
    "no connection within 10 s" alone read as a server that hangs, or a network that drops packets.

    Its return is INFO: the loss was a WARNING, and the envs merely start new episodes, as they would after
    any reset. A WARNING where another process answers (its server id changed), unless it left saying it
    was shutting down (a restart or an update, planned): the one lost crashed, was killed or was replaced,
    which the operator of the server should know of, and whatever its envs kept from one episode to the
    next started over with it. A flapping server's return is DEBUG (the lines about its losses tell it).
    """
    client = replica.client
    attempts = _Attempts(backoff)
    if hold_off > 0:
        await asyncio.sleep(hold_off * random.uniform(0.8, 1.2))
    while True:
        attempts.count += 1
        try:
            spec, same_process, fresh = await _attempt(replica, timeout, connect_timeout)
        except asyncio.CancelledError:
            client.abandon()
            raise
        except (TimeoutError, RemoteEnvError, _Incompatible) as err:
            client.abandon()
            if misfit_reported(err):
                # (the env's, not the server's: tried again, it returns the same; a step's misfit stops a run at
                # once, and so does this one, at the next step that would take the server back)
                assert isinstance(err, RemoteEnvError)
                log.debug(
                    "reconnect to %s, attempt %d: %s; raised by the next step",
                    label_of(client.address),
                    attempts.count,
                    err,
                )
                replica.broken, replica.misfit = True, err
                on_ready()  # (a step waiting for a server to come back goes on, and raises it)
                return
            await attempts.failed(replica, err, connect_timeout, diagnose)
            continue
        _take_back(replica, spec, same_process, fresh)
        on_ready()
        return


@dataclass
class _Attempts:
    """:func:`reconnect`'s attempts on one server so far: what the lines about them said when, and the backoff."""

    backoff: tuple[float, float]
    delay: float = field(init=False)
    count: int = 0
    said: str = ""  # the last cause warned of: said once, then at DEBUG while it stays the same
    said_down_at: float = field(default_factory=time.monotonic)  # (its loss was just logged: see STILL_DOWN_LOG_S)
    failed_unsaid: int = 0

    def __post_init__(self) -> None:
        self.delay = self.backoff[0]

    async def failed(
        self,
        replica: Replica,
        err: Exception,
        connect_timeout: float,
        diagnose: Callable[[str, float], str | None] | None,
    ) -> None:
        """Say that an attempt failed (warned of once where no retry mends it, at most so often that it is still
        down), then wait before the next one."""
        client = replica.client
        # (a RemoteTimeoutError, a call's deadline, is a TimeoutError too: it says which call, and why)
        no_connection = isinstance(err, TimeoutError) and not isinstance(err, RemoteEnvError)
        text = f"no connection within {connect_timeout:g} s" if no_connection else str(err)
        due = time.monotonic() - self.said_down_at >= _still_down_gap(replica)  # (the still-down line below)
        if no_connection and diagnose is not None and due:  # (probed for that line only: not each attempt)
            text = await _no_connection(client.address, connect_timeout, diagnose)
        # Causes no retry mends (the operator's to fix: another spec, a refused token, an address that
        # now serves no envfleet, UNIMPLEMENTED) are warned of once, not at every attempt.
        warn = (isinstance(err, _Incompatible | AuthenticationError) or unserved(err)) and text != self.said
        if warn:
            self.said = text
        log.log(
            logging.WARNING if warn else logging.DEBUG,
            "reconnect to %s, attempt %d: %s",
            label_of(client.address),
            self.count,
            text,
        )
        self.failed_unsaid += 1
        now = time.monotonic()
        if warn:  # (a line that says why it is still down)
            self.said_down_at, self.failed_unsaid = now, 0
        elif now - self.said_down_at >= _still_down_gap(replica, now):
            self._say_still_down(replica, now, text, starting=_starting(err))
            self.said_down_at, self.failed_unsaid = now, 0
        if not no_connection:  # (a wait for the connection took its time already; a missed deadline backs off too)
            await asyncio.sleep(self.delay * random.uniform(0.8, 1.2))
            self.delay = min(self.delay * 2, self.backoff[1])

    def _say_still_down(self, replica: Replica, now: float, text: str, *, starting: bool = False) -> None:
        """Say that ``replica`` is still down and why (``text``, the last attempt's error), rarer as it stays down.
        ``starting``: the last attempt was answered that the server is starting (building its envs)."""
        listed = replica.looked_up_at  # (listed still, this long after it left: not a replica scaled down)
        long_shut = (
            replica.planned
            and not starting  # (restarted, and building its envs: coming, however long they take to build)
            and now - replica.down_since >= SHUT_DOWN_WARN_S
            and (listed is None or listed - replica.down_since >= SHUT_DOWN_WARN_S)
        )
        log.log(
            logging.INFO if replica.planned and not long_shut else logging.WARNING,
            "env server %s still down after %.0f s: %d reconnect attempt%s failed (%d since the last such "
            "line; the next such line in %d s at the soonest), the last: %s; its %s unavailable, and it "
            "is tried again%s",
            label_of(replica.client.address),
            now - replica.down_since,
            self.count,
            "" if self.count == 1 else "s",
            self.failed_unsaid,
            _next_still_down_in(replica, now),
            text,
            "env stays" if replica.spec.num_envs == 1 else f"{replica.spec.num_envs} envs stay",
            " (it said it was shutting down as it left, and a restart takes seconds: stopped for good, or "
            "failing to start again? Its logs say; start it at its address again, or stop this run and resume "
            "it without it: learner train --resume RUN_DIR --servers ...)"
            if long_shut
            else "",
        )


def _starting(err: BaseException) -> bool:
    """Whether ``err`` is a server's answer that it is starting: it listens, and builds its envs (UNAVAILABLE)."""
    return isinstance(err, RemoteEnvError) and err.code == grpc.StatusCode.UNAVAILABLE and "is starting" in err.details


async def _attempt(
    replica: Replica, timeout: float, connect_timeout: float
) -> tuple[pb.EnvSpec, bool, pb.ResetResponse]:
    """One reconnect attempt: a session anew on ``replica``'s server, its envs reset. The server's spec, whether
    it is the same process as before, and the reset's answer; raises what the attempt met."""
    client = replica.client
    await asyncio.wait_for(client.wait_ready(), connect_timeout)
    spec = await client.get_spec()
    problem = incompatible(replica.spec, spec, same_size=True)
    replica.changed = problem
    if problem:
        raise _Incompatible(
            f"the server came back with {problem}; its envs stay unavailable until the fleet is looked "
            "up again (refresh(), which learner train calls between rollouts, takes it in with its new envs)"
        )
    same_process = spec.server_id == replica.spec.server_id
    if same_process:
        for session_id in replica.sessions[-2:]:
            await client.release_session(session_id, timeout)
    # (the session it continues, released just now or lost: a --fresh-envs server keeps its envs' state)
    client.rejoins_session_id = replica.sessions[-1] if same_process and replica.sessions else ""
    # Given up while the Handshake is in flight (the fleet's close cancels the reconnect: learner train's, after a
    # Ctrl-C): its answer is read, and the session it granted released, as the start's are. Cancelled with the
    # reconnect, the answer was dropped, and the server held the claim, with nobody to release it and no Hold
    # stream, for its claim timeout, refusing the learner started again. (The fleet's close waits for this: see
    # learner.remote._close_all.)
    response = await released_if_given_up(lambda calls: shielded_handshake(client, calls))
    client.start_session(response)
    replica.sessions = [*replica.sessions[-1:], response.session_id]
    fresh = await client.reset(None, None, None)
    return spec, same_process, fresh


def _take_back(replica: Replica, spec: pb.EnvSpec, same_process: bool, fresh: pb.ResetResponse) -> None:
    """Mark ``replica`` READY again with its new session's spec and first observations, and say it is back."""
    client = replica.client
    replica.fresh = fresh
    replica.changed = ""
    replica.state = ReplicaState.READY
    replica.reconnects += 1
    if not same_process:
        replica.server_restarts += 1
        replica.out_of_step = 0  # (another process: what the last one answered out of step is not its doing)
    # (as a server back in a reset, or one joining, is: another env id, time limit, env kwargs or
    # library versions, a restart from another checkout say, rejoined without a word; once it is back,
    # not at each attempt that failed after its spec was read)
    warn_if_other_env(replica.spec, spec, label_of(client.address), "its old")
    replica.spec = spec
    replica.back_at, replica.answered = time.monotonic(), 0
    # (a flapping server's returns are told by the lines about its losses: see RELAPSE_LOG_S; why the
    # others are INFO, or WARNING for another process: see reconnect's docstring)
    say = log.debug if replica.relapses else log.info if replica.planned or same_process else log.warning
    say(
        "env server %s is back after %.1f s (%s); its %s with new episodes",
        label_of(client.address),
        time.monotonic() - replica.down_since,
        "same process"
        if same_process
        else f"restarted: server id {spec.server_id[:8]}, a new process, its envs made anew",
        "env rejoins" if spec.num_envs == 1 else f"{spec.num_envs} envs rejoin",
    )


async def _no_connection(address: str, waited: float, diagnose: Callable[[str, float], str | None]) -> str:
    """A reconnect's error where the channel to ``address`` was not ready within ``waited`` seconds, with why, as
    ``diagnose`` tells it ("no connection: connection refused (tried for 10 s)"; through the connect path's
    :func:`~learner.discovery.probe_until`: a thread of its own, :data:`_PROBE_S` at most)."""
    cause = await probe_until(address, time.monotonic() + _PROBE_S, diagnose)
    if cause is None:  # (it cannot tell)
        return f"no connection within {waited:g} s"
    if not cause:  # (a plain connection opens, and TLS is not the trouble)
        return (
            f"no connection within {waited:g} s: something accepts connections there, but does not answer (a server "
            "stopped or hung?)"
        )
    return f"no connection: {cause} (tried for {waited:g} s)"


_PROBE_S = 2.0
"""The longest :func:`_no_connection` looks (a plain connect of 1 s at most, a peek at what answers)."""


class _Incompatible(Exception):
    """The server at the address now hosts envs that do not fit the fleet."""


# env_server.service's error for an answer its envs' infos make larger than a message may be (64 MiB).
_ANSWER_TOO_LARGE = re.compile(r"the (Step|Reset) answer would take [\d,]+ bytes, over the [\d,]+ bytes")


def misfit_reported(err: BaseException) -> bool:
    """Whether ``err`` is a server's report that an env returned what no reconnect mends (the env returns it
    again): an observation that does not fit the observation space (``env_server.envs.ObservationLayoutError``,
    in the status's text: "the env returned in step what does not fit: ObservationLayoutError: the server's env
    2: ..."), or infos that make the answer larger than a message may be ("the Step answer would take 70,000,121
    bytes, over the 67,108,864 bytes (64 MiB) ...": taken for an outage, a fault-tolerant fleet lost the server
    and took it back at every other step, and `learner train` went on without learning)."""
    return isinstance(err, EnvCrashedError) and (
        f": {ObservationLayoutError.__name__}: " in err.details or _ANSWER_TOO_LARGE.match(err.details) is not None
    )
