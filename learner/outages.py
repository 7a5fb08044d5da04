"""Servers lost from a RemoteVectorEnv's fleet: marked down and reconnected, their episodes cut, fault_stats()."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from copy import deepcopy
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np
from gymnasium.vector.utils import batch_space, iterate

from learner import faults, pauses
from learner.batching import slice_batch
from learner.client import EnvClient
from learner.errors import InvalidResponseError, RemoteEnvError, ServerUnavailableError
from learner.faults import FaultStats, Replica, ReplicaState, reconnect, unserved
from learner.local import label_of, left_down
from learner.loop import LoopRunner, gather
from learner.membership import _Retired, _shutting_down
from learner.stats import StepTimer

__all__ = ["FleetOutages", "in_server_order"]

# RemoteVectorEnv's logger, not this module's: these lines are the env's (users and tests filter
# "learner.remote"), and they were logged there before this code moved out of learner/remote.py.
log = logging.getLogger("learner.remote")


class FleetOutages:
    """What a fault-tolerant :class:`~learner.remote.RemoteVectorEnv` does when it loses a server: marks it
    down and starts its reconnect (:func:`~learner.faults.reconnect`), cuts its envs' episodes (truncated),
    waits for a server to come back when none is up, gives up after ``give_up_after``; and
    :meth:`fault_stats`, the counters of it all. (Server states and the reconnect itself: learner.faults.)

    A mixin of RemoteVectorEnv, its only user: it reads and sets the env's state, declared below for
    the type checker (RemoteVectorEnv's ``__init__`` sets it). The step path comes here only when a
    server is lost or none is up; what it calls on every step stays in learner/remote.py.
    """

    # Of RemoteVectorEnv (see its __init__).
    metadata: dict[str, Any]
    single_observation_space: gym.Space[Any]
    timeout: float
    connect_timeout: float
    backoff: tuple[float, float]
    give_up_after: float
    _clients: list[EnvClient]
    _replicas: list[Replica]
    _runner: LoopRunner
    _timers: list[StepTimer]
    _obs_buffer: Any
    _rejoined: asyncio.Event
    _env_steps_lost: int
    _env_error_steps: int
    _retired: _Retired
    # The latest time a server that has left the fleet (refresh()) was last known to answer steps: as
    # it left, or its loss (see _note_leaving). give_up_after counts from it too. (A class default,
    # set on the instance by refresh(); 0.0: none has left, or none left while up.)
    _left_up_at: float = 0.0
    # When the latest outage of the whole fleet began, as give_up_after counts it, once it was said
    # (_say_all_down); and when that was. (Class defaults too: none said yet.)
    _all_down_said_for: float = -1.0
    _all_down_said_at: float = -math.inf
    # Whether that outage's warning was the last word on it: the first server back ends it, said at WARNING
    # too (its own "is back" line is INFO where the server is the same process or left as planned).
    _all_down_open: bool = False

    if TYPE_CHECKING:

        @property
        def addresses(self) -> list[str]: ...

        @property
        def env_slices(self) -> list[slice]: ...

        @property
        def servers_not_joined(self) -> list[str]: ...

        def _share_cpus(self) -> None: ...

        def _raise_first(self, errors: Sequence[BaseException]) -> None: ...

        def _diagnose(self, address: str, timeout: float) -> str | None: ...

    def _lose_all(
        self, lost: Sequence[tuple[int, BaseException]], *, truncate: bool | Mapping[int, np.ndarray]
    ) -> list[tuple[int, BaseException]]:
        """:meth:`_lose` each (server, error), planned or not: a server that said it was shutting down
        (a step it refused), or ended the session saying so (its Hold stream's last word, still there
        after the server exited and the step met a closed connection), left by plan. ``truncate``: for
        every server, or per server (the envs whose episodes it cuts; a server not in it cuts none).
        Returns the errors to raise for servers found broken, (server, error), for the caller to raise
        with its other errors of the same call (see :func:`in_server_order`)."""
        ask = [i for i, err in lost if not _shutting_down(err) and self._clients[i].session_ended]
        said = []
        if ask:
            said = self._runner.run(
                lambda: gather(*(self._clients[i].ended_by_shutdown() for i in ask), return_exceptions=True)
            )
        told = {i for i, answer in zip(ask, said, strict=True) if answer is True}
        # (raised once every server is marked: none left up with its step failed)
        broken: list[tuple[int, BaseException]] = []
        for i, err in lost:
            cut = truncate if isinstance(truncate, bool) else truncate.get(i, False)
            gone = self._mark_lost(i, err, truncate=cut, planned=_shutting_down(err) or i in told)
            if gone is not None:
                broken.append((i, gone))
        return broken

    def _lose(
        self, server: int, err: BaseException, *, truncate: bool | np.ndarray, planned: bool = False
    ) -> list[tuple[int, BaseException]]:
        """Mark a server down (its envs unavailable) and start reconnecting to it; ``planned``: it left
        saying it was shutting down, so it counts as a shutdown, not a failure. One lost again before
        it settled since it came back waits longer each time before it is taken back (see
        learner.faults: Replica.hold_off). ``truncate``: the next step ends its envs' episodes,
        truncated (a mask over its envs: those envs' only, where the others had no episode under way).

        A server whose answers could not be read again right after it came back is broken, not lost
        (learner.faults: Replica.broken_by): marked down all the same, but not reconnected, and the
        InvalidResponseError saying so is returned, (server, error) in a list (else an empty list), for
        the caller to raise once every server of the call is marked (the fleet then needs a reset, as
        after any failed step, which tries it again: :meth:`_retry_broken`). So is one that answered
        UNIMPLEMENTED again right after it came back (a server without StepStream): the error is then
        a RemoteEnvError with that code."""
        broken = self._mark_lost(server, err, truncate=truncate, planned=planned)
        return [] if broken is None else [(server, broken)]

    def _mark_lost(
        self, server: int, err: BaseException, *, truncate: bool | np.ndarray, planned: bool
    ) -> RemoteEnvError | None:
        """:meth:`_lose`'s work, but for a broken server the error to raise, returned (None otherwise)."""
        replica, client = self._replicas[server], self._clients[server]
        if replica.state is ReplicaState.DOWN:  # (lost already: counted, and reconnecting)
            log.debug("env server %s, down already: %s", label_of(client.address), err)
            return None
        broken = replica.broken_by(err)
        now = time.monotonic()
        replica.note_loss(now, planned=planned)
        replica.state = ReplicaState.DOWN
        if isinstance(truncate, np.ndarray):
            replica.truncate_next = bool(truncate.any())
            replica.truncate_only = None if truncate.all() else truncate.copy()
        else:
            replica.truncate_next, replica.truncate_only = truncate, None
        replica.count_loss(planned=planned)
        self._timers[server].count_loss(planned=planned)
        replica.down_since = now
        replica.last_error = str(err)
        replica.planned = planned
        client.abandon()
        if broken:  # (no reconnect, no line: the error says it all)
            replica.broken = True
            return _broken(client, err, replica)
        first, last = client.env_offset, client.env_offset + client.num_envs - 1
        envs = f"its env{f's {first}-{last}' if last > first else f' {first}'} {'are' if last > first else 'is'} unavailable until it is back"
        hold_off = replica.hold_off(self.backoff)
        if replica.relapses:
            replica.relapses_unlogged += 1
            flapping = now - replica.flapping_since
            if now - replica.relapses_logged_at >= faults.reminder_gap(flapping, faults.RELAPSE_LOG_S):
                log.warning(
                    "env server %s lost again soon after coming back, %d time%s in a row (%d since the last such line; "
                    "the next such line in %d s at the soonest): %s; it is taken back after %.1f s, longer each time "
                    "(up to %g s); %s",
                    label_of(client.address),
                    replica.relapses,
                    "" if replica.relapses == 1 else "s",
                    replica.relapses_unlogged,
                    faults.next_reminder_in(flapping, faults.RELAPSE_LOG_S),
                    err,
                    hold_off,
                    self.backoff[1],
                    envs,
                )
                replica.relapses_logged_at, replica.relapses_unlogged = now, 0
            else:
                log.debug(
                    "env server %s lost again (%s); taken back after %.1f s", label_of(client.address), err, hold_off
                )
        elif planned:
            # A WARNING all the same: planned by whoever stopped it, not by this run, which goes on with
            # fewer envs until it is back (the final faults line counts it too, but only at the end).
            log.warning(
                "env server %s shut down (it said so: a scale-down or a restart, say); %s",
                label_of(client.address),
                envs,
            )
        else:
            paused = pauses.own_pause()
            log.warning(
                "env server %s lost (%s); %s%s",
                label_of(client.address),
                err,
                envs,
                f"; this learner itself was held up for {paused:.0f} s just before (stopped, suspended, starved of "
                "CPU, or a long call holding the interpreter): the loss may be its own, and the server fine"
                if paused
                else "",
            )
        self._start_reconnect(replica, hold_off)
        self._say_all_down()
        return None

    def _retry_broken(self, servers: Sequence[int]) -> None:
        """A reset of the fleet takes the broken ones of ``servers`` back: each is reconnected (a server
        mended or replaced at its address rejoins, as after an outage) and keeps its counts, so one
        still broken is found so again at its first answer that cannot be read, and raised again."""
        for i in servers:
            replica = self._replicas[i]
            if replica.broken:
                replica.broken, replica.misfit = False, None
                # (give_up_after counts from now: a server mended while the fleet waited is taken back)
                replica.down_since = replica.failing_since = time.monotonic()
                log.info(
                    "env server %s, found broken, is tried again (a reset): reconnecting",
                    label_of(replica.client.address),
                )
                self._start_reconnect(replica, 0.0)

    def _start_reconnect(self, replica: Replica, hold_off: float) -> None:
        """Start reconnecting ``replica``'s server (down), after ``hold_off`` seconds."""

        def on_ready() -> None:
            # The server's index then, not now: a refresh() in between may have moved it (or let it go).
            try:
                index = next((j for j, r in enumerate(self._replicas) if r is replica), None)
                if index is not None:
                    self._timers[index].reconnects += 1
                    self._share_cpus()  # a new session: the server may now offer a step socket, or no longer
                if self._all_down_open and not replica.broken:
                    self._all_down_open = False
                    # (not where servers that joined since, by refresh(), ended the outage: said as they joined)
                    if all(r.state is ReplicaState.DOWN for r in self._replicas if r is not replica):
                        log.warning(
                            "env server %s is back: the fleet steps again (every server was down for %.1f s)",
                            label_of(replica.client.address),
                            time.monotonic() - self._all_down_said_for,
                        )
            finally:
                self._rejoined.set()  # (a step waiting for a server to come back must hear of it whatever happened)

        if replica.reconnect_task is not None and not replica.reconnect_task.done():
            self._runner.cancel([replica.reconnect_task])  # (one reconnect per server at a time)
        replica.reconnect_task = self._runner.create_task(
            functools.partial(
                reconnect,
                replica,
                timeout=self.timeout,
                connect_timeout=self.connect_timeout,
                backoff=self.backoff,
                on_ready=on_ready,
                hold_off=hold_off,
                diagnose=self._diagnose,
            )
        )

    def _forget_truncations(self, mask: np.ndarray | None) -> None:
        """A reset (of the envs in ``mask``; None: all) ends the episodes a server's loss was still to
        cut on the next step: those envs have no episode left to truncate (their reset reports them
        unavailable, or starts them anew)."""
        for replica, sl in zip(self._replicas, self.env_slices, strict=True):
            if not replica.truncate_next:
                continue
            only = (
                np.ones(sl.stop - sl.start, dtype=np.bool_) if replica.truncate_only is None else replica.truncate_only
            )
            if mask is not None:
                only = only & ~mask[sl]
            if mask is None or not only.any():
                replica.truncate_next, replica.truncate_only = False, None
            else:
                replica.truncate_only = only

    def _wait_for_rejoin(self) -> None:
        """No server of this step is up: where none of the fleet is either (nor back, READY), give the
        reconnects a moment (so callers do not spin). While another server is up, its steps set the
        pace (its group's, pipelining: a group whose servers are all down must not hold it up)."""
        if any(r.state is not ReplicaState.DOWN for r in self._replicas):
            return
        self._rejoined.clear()
        self._runner.run(lambda: _wait_event(self._rejoined, min(self.timeout, 1.0)))

    def _check_anything_left(self) -> None:
        """Fault-tolerant: raise once every server is down and has answered no step for ``give_up_after`` seconds.

        A flapping server (back after each loss, failing again at once) counts from its first loss
        since it last answered a step (Replica.failing_since), not from its latest: it gives no more
        steps than a server that is gone, and counted from its latest loss it would keep a fleet of
        such servers reconnecting for good. One that answers a step now and then counts as
        answering: the run is slow, not over.
        """
        if any(r.state is not ReplicaState.DOWN for r in self._replicas):
            return
        if time.monotonic() - self._all_down_since() > self.give_up_after:
            raise ServerUnavailableError(
                f"no env server left: {', '.join(map(label_of, self.addresses))} all unavailable (down, or failing each step since "
                f"they came back) for more than {self.give_up_after:g} s (give_up_after; `learner train "
                f"--give-up-after`); last error: {self._replicas[-1].last_error}{_left_down(self.addresses)}",
                address=self._clients[0].address,
            )
        self._say_all_down()

    def _all_down_since(self) -> float:
        """Every server down: since when none has answered a step, as give_up_after counts it (see
        :meth:`_check_anything_left`)."""
        # (and from when a server that left the fleet was last up: every server has been down only since then)
        return max(self._left_up_at, *(r.failing_since or r.down_since for r in self._replicas))

    def _say_all_down(self) -> None:
        """Every server down (none back, READY): warn once per such outage that the fleet waits, and for how
        long at most. Each server's loss was said, and each says now and then that it is still down, but
        not that nothing steps any more, nor that give_up_after then ends the run: a run stopped by it
        said so only in its error. An outage is known by when give_up_after counts it from (a flapping
        server's first loss since it last answered a step: :meth:`_all_down_since`), and a new one is said
        at most once per :data:`~learner.faults.STILL_DOWN_LOG_S` (a server lost again at each return,
        after a step or two, would make one line each time). Its end is the first server's return, which
        that server's reconnect says (:func:`~learner.faults.reconnect`)."""
        if not self._replicas or any(r.state is not ReplicaState.DOWN for r in self._replicas):
            return
        since, now = self._all_down_since(), time.monotonic()
        if since == self._all_down_said_for:
            return
        self._all_down_said_for = since
        if now - self._all_down_said_at < faults.STILL_DOWN_LOG_S:
            log.debug("every env server is down again (%s)", ", ".join(map(label_of, self.addresses)))
            return
        self._all_down_said_at, self._all_down_open = now, True
        log.warning(
            "every env server is down (%s): stepping waits for one to come back; unless one answers steps again, "
            "the fleet gives up in %.0f s (give_up_after %g s; `learner train --give-up-after`)",
            ", ".join(map(label_of, self.addresses)),
            max(0.0, since + self.give_up_after - now),
            self.give_up_after,
        )

    def _note_leaving(self, leaving: Iterable[Replica]) -> None:
        """Servers that leave the fleet (refresh()): the give_up_after clock of those that stay must not
        count from before the last of them that was up (one answering steps as it leaves: now; one down,
        or back but failing each step since: its loss), for the fleet was not all down until then."""
        now = time.monotonic()
        for replica in leaving:
            answering = replica.state is not ReplicaState.DOWN and not replica.failing_since
            last_up = now if answering else replica.failing_since or replica.down_since
            self._left_up_at = max(self._left_up_at, last_up)

    def _lost_infos(self, offset: int, count: int, only: np.ndarray | None = None) -> dict[str, Any]:
        """Infos of envs whose episodes were cut short by losing their server (same-step autoreset:
        their last observations as ``final_obs``, as gymnasium reports a truncation); ``only``: a mask
        over the ``count`` envs of those cut (None: all)."""
        if self.metadata["autoreset_mode"] is not gym.vector.AutoresetMode.SAME_STEP:
            return {}
        batch = slice_batch(self._obs_buffer, offset, offset + count)
        final_obs = np.empty(count, dtype=object)
        cut = np.ones(count, dtype=np.bool_) if only is None else only.copy()
        for j, single in enumerate(iterate(batch_space(self.single_observation_space, count), batch)):
            if cut[j]:
                final_obs[j] = deepcopy(single)
        # final_info as gymnasium lays it out: the envs' final infos joined key by key (none here: {}).
        return {"final_obs": final_obs, "_final_obs": cut, "final_info": {}, "_final_info": cut.copy()}

    def fault_stats(self) -> FaultStats:
        """Failures, reconnects and lost env steps so far, and how many servers and envs are down now."""
        down = [(r, c) for r, c in zip(self._replicas, self._clients, strict=True) if r.state is not ReplicaState.UP]
        retired = self._retired
        return FaultStats(
            failures=retired.failures + sum(r.failures for r in self._replicas),
            shutdowns=retired.shutdowns + sum(r.shutdowns for r in self._replicas),
            reconnects=retired.reconnects + sum(r.reconnects for r in self._replicas),
            server_restarts=retired.server_restarts + sum(r.server_restarts for r in self._replicas),
            env_steps_lost=self._env_steps_lost,
            env_errors=self._env_error_steps,
            servers_down=len(down),
            envs_unavailable=sum(c.num_envs for _, c in down),
            servers_joined=retired.joined,
            servers_left=retired.left,
            servers_not_joined=len(self.servers_not_joined),
        )


def in_server_order(*errors: Sequence[tuple[int, BaseException]]) -> list[BaseException]:
    """The errors of one call, (server, error) from several lists, in server order (the first raised is
    the first server's; the others become its notes)."""
    return [err for _, err in sorted((pair for pairs in errors for pair in pairs), key=lambda pair: pair[0])]


def _broken(client: EnvClient, err: BaseException, replica: Replica) -> RemoteEnvError:
    """The error a fault-tolerant fleet raises for a broken server (see learner.faults: UNREADABLE_IN_A_ROW):
    ``err``, the latest of its answers that could not be read, and why this is no outage; or, for one
    that answered UNIMPLEMENTED again (learner.faults: unserved), ``err``'s code and class (not an
    InvalidResponseError: its answers were statuses, read well), with why no reconnect mends it."""
    envs = f"env{'s' if client.num_envs > 1 else ''} {client.env_offset}"
    if client.num_envs > 1:
        envs += f"-{client.env_offset + client.num_envs - 1}"
    if unserved(err):
        why = (
            f"it answered UNIMPLEMENTED {replica.unimplemented} times in a row, the last right after a reconnect, "
            "with no step answered between"
        )
        what = (
            "it does not serve a call this learner makes (a server of an older envfleet version, or one written from "
            "the proto without it), which no reconnect mends"
        )
        remedy = "upgrade or replace it"
    else:
        if getattr(err, "out_of_step", False):
            why = f"{replica.out_of_step} of its answers were to other requests than the ones sent (sent twice)"
        else:
            why = (
                f"{replica.unreadable} of its answers in a row could not be read, the last right after a reconnect, "
                "with no step answered between"
            )
        what = "a server that does not keep to the envfleet.v1 protocol (another version, or a bug)"
        remedy = "fix or replace it"
    text = str(err)
    message = (
        f"{text}{' ' if text.endswith(('?', '.')) else '. '}The server is broken, not out: {why}: {what}; it is not "
        f"reconnected (fault tolerance would go on without its {envs} for good) until the next reset, which tries it "
        f"again: {remedy}"
    )
    broken: RemoteEnvError
    if unserved(err):
        assert isinstance(err, RemoteEnvError)
        broken = type(err)(message, address=client.address, code=err.code, env_index=err.env_index, details=err.details)
    else:
        broken = InvalidResponseError(
            message,
            address=client.address,
            code=getattr(err, "code", None),  # (RESOURCE_EXHAUSTED for an answer over the size limit)
        )
        broken.out_of_step = getattr(err, "out_of_step", False)
    broken.__cause__ = err
    return broken


async def _wait_event(event: asyncio.Event, timeout: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)


def _left_down(addresses: Sequence[str]) -> str:
    """Why the servers of ``addresses`` that learner.local left down stay down, for the error that ends the run
    ("; local-0 was killed by SIGSEGV, and was left down after 5 restarts within 60 s"); "" where none was."""
    said = [f"; {label_of(a)} {why}" for a in addresses if (why := left_down(a)) is not None]
    return "".join(said)
