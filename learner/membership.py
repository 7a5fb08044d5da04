"""Fleet membership of a RemoteVectorEnv: servers joining and leaving (refresh), and servers away."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from env_server.protocol import SHUTTING_DOWN_MESSAGE, host_port
from env_server.rpc import env_pb2 as pb
from learner import faults
from learner.batching import merge_infos
from learner.client import EnvClient, release_unadopted, shielded_handshake
from learner.discovery import AddressError, expand_named
from learner.errors import InvalidResponseError, RemoteEnvError, ServerBusyError, ServerUnavailableError
from learner.faults import Replica, ReplicaState
from learner.fleet import FleetChange
from learner.local import label_of
from learner.loop import LoopRunner, gather
from learner.specs import incompatible, warn_if_other_env
from learner.stats import StepTimer
from learner.validate import one_thread
from learner.validate import seconds as _seconds

__all__ = ["FleetMembership"]

# RemoteVectorEnv's logger, not this module's: these lines are the env's (users and tests filter
# "learner.remote"), and they were logged there before this code moved out of learner/remote.py.
log = logging.getLogger("learner.remote")

# refresh(): a joining server's handshake gets `wait` seconds to answer, and at least this long (a server
# connected already joins at refresh(wait=0) too): one that connects but does not answer (its event loop
# hangs) holds up a refresh that tries it that long, not for the whole of the fleet's `timeout`.
JOIN_ANSWER_S = 1.0

LOOKUP_FAILED_LOG_S = 60.0
"""refresh(): a look-up of the addresses that fails (a file: address's file gone, a compose: or swarm: engine that
does not answer) is warned of at once, then, while look-ups keep failing or fail again, at most once per this many
seconds, with how long they have failed: meanwhile the fleet keeps the servers it has, and servers added, or replicas
moved to another port, are not found. (Was: once per distinct error for the whole run, then DEBUG: a file
removed or an engine gone for an hour said so once.)"""

# _Away.warned's mark of a server warned of as serving another env than the fleet's (as it took its
# handshake): not said again at each try while its reset fails.
_OTHER_ENV = "another env"


class FleetMembership:
    """Which servers make up a :class:`~learner.remote.RemoteVectorEnv`'s fleet: :meth:`refresh` (servers
    joining and leaving between rollouts), the servers away (those the fault-tolerant start went on
    without, those refused or that did not fit), and servers listed twice under other names.

    A mixin of RemoteVectorEnv, its only user: it reads and sets the env's state, declared below for
    the type checker (RemoteVectorEnv's ``__init__`` sets it). The step path does not come here.
    """

    # Of RemoteVectorEnv (see its __init__).
    fault_tolerant: bool
    connect_timeout: float
    _clients: list[EnvClient]
    _replicas: list[Replica]
    _runner: LoopRunner
    _spec: pb.EnvSpec
    _address_spec: str | Sequence[str]
    _dns_names: dict[str, str | None]
    _joining: dict[str, tuple[EnvClient, asyncio.Future[None]]]
    _connecting: dict[str, tuple[float, float]]
    _away: dict[str, _Away]
    _aliases: set[str]
    _lookup_failed: tuple[float, bool] | None
    _lookup_warned_at: float
    _timers: list[StepTimer]
    _stale: tuple[str, str] | None

    if TYPE_CHECKING:

        @property
        def addresses(self) -> list[str]: ...

        def _assert_idle(self, method: str) -> None: ...

        def _client(self, address: str) -> EnvClient: ...

        async def _handshake(
            self,
            client: EnvClient,
            deadline: float,
            calls: list[tuple[EnvClient, asyncio.Future[pb.HandshakeResponse]]],
        ) -> pb.HandshakeResponse: ...

        def _read_reset(self, client: EnvClient, response: pb.ResetResponse) -> tuple[Any, dict[str, Any]]: ...

        def _note_leaving(self, leaving: Iterable[Replica]) -> None: ...

        def _relayout(
            self,
            stay: list[EnvClient],
            joined: list[EnvClient],
            leave: list[EnvClient],
            resets: dict[str, tuple[Any, dict[str, Any]]],
            replicas: dict[int, Replica],
        ) -> FleetChange: ...

    # -- the start: servers it went on without, servers listed twice -------------------------------

    def _note_missing(self, missing: list[tuple[str, str]], listed: int) -> None:
        """Fault-tolerant, some servers in: start without the ``missing`` ones (address, why), which join
        when they answer, at a :meth:`refresh` (between rollouts), as a server lost in the run comes back;
        until then the fleet is that much smaller, and a line says so once in a while."""
        now = time.monotonic()
        for address, _ in missing:
            away = self._away[address] = self._away.pop(address) if address in self._away else _Away()  # (in order)
            away.missing_since = away.said_at = now
        log.warning(
            "env server%s %s; starting with the %d of %d that answered (fault-tolerant): %s envs join when %s "
            "(looked for at refresh(), which learner train calls between rollouts)",
            "s" if len(missing) > 1 else "",
            "; ".join(f"{self._named(address)}: {why}" for address, why in missing),
            listed - len(missing),
            listed,
            "their" if len(missing) > 1 else "its",
            "they answer" if len(missing) > 1 else "it answers",
        )

    def _named(self, address: str) -> str:
        """``address`` as messages name it: with the ``dns:`` address it was found by, where it was (the one
        typed: "[::1]:50051, an address of dns:///localhost:50051"); a server this process started by its
        label (``local-0``: :func:`~learner.local.label_of`)."""
        name = self._dns_names.get(address)
        if not name:
            return label_of(address)
        return f"{address}, an address of dns:///{host_port(name, address.rpartition(':')[2])}"

    def _one_family_hint(self, address: str) -> str:
        """For a server at ``address`` that does not answer: where the ``dns:`` name it was found by has IPv4 and
        IPv6 addresses both (localhost, on many systems), that one server may listen on one family only (env-server
        listens on 127.0.0.1 by default); "" otherwise."""
        name = self._dns_names.get(address)
        if not name or len({a.startswith("[") for a, n in self._dns_names.items() if n == name}) < 2:
            return ""
        return (
            f"{name} has IPv4 and IPv6 addresses: where they name one server, it listens on one family only "
            "(env-server --host :: listens on both; or list the address it listens on)"
        )

    @property
    def servers_not_joined(self) -> list[str]:
        """Servers listed at the start that the fault-tolerant start went on without (they did not answer,
        or were still building their envs) and that have not joined since."""
        return [address for address, away in self._away.items() if away.missing_since is not None]

    def _held_at_start(self) -> list[ServerBusyError]:
        """The refusals of the servers in :attr:`servers_not_joined` that another learner held at the start."""
        return [away.held for away in self._away.values() if away.missing_since is not None and away.held]

    async def _find_aliases(
        self,
        clients: list[EnvClient],
        responses: list[pb.HandshakeResponse | BaseException],
        held: Sequence[EnvClient] = (),
    ) -> set[EnvClient]:
        """The servers listed twice under other names (a host name and its address, a dns: name and an
        address it resolves to): each refused its second handshake as claimed, by this learner (by one of
        ``clients`` or of ``held``, the fleet's at a refresh). Used once, as an address given twice is,
        with a warning. Not a server that sends no server_id (one older than the field, another implementation):
        such servers cannot be told apart, and one claimed by another learner is no alias."""
        claimed = {c.spec.server_id: c.address for c in held if c.spec is not None and c.spec.server_id}
        claimed |= {
            r.spec.server_id: c.address
            for c, r in zip(clients, responses, strict=True)
            if not isinstance(r, BaseException) and r.spec.server_id
        }
        busy = [c for c, r in zip(clients, responses, strict=True) if isinstance(r, ServerBusyError)]
        if not busy or not claimed:
            return set()
        specs = await gather(*(c.get_spec() for c in busy), return_exceptions=True)
        aliases = set()
        for client, spec in zip(busy, specs, strict=True):
            if not isinstance(spec, BaseException) and spec.server_id and spec.server_id in claimed:
                log.warning(
                    "addresses: %s and %s are the same env server (server id %s); each server is used once",
                    claimed[spec.server_id],
                    client.address,
                    spec.server_id[:8],
                )
                aliases.add(client)
                # (refresh() does not try it again while the other name is in the fleet; see _forget_aliases)
                self._aliases.add(client.address)
                alias = self._away[client.address] = _Away()  # (no longer missing, if it was: in under that name)
                alias.alias_of = claimed[spec.server_id]
        return aliases

    def _forget_aliases(self, stay: list[EnvClient], listed: Sequence[str] | None = None) -> None:
        """Let the addresses found to be another name of a server in the fleet be tried again once that
        server is out of it (under its other name: it left, restarted, was dropped), or once they are
        not among those ``listed`` now (None: a failed look-up, which says nothing of them): the server
        they name may join under them then, should they be listed again."""
        kept = {c.address for c in stay}
        for address in list(self._aliases):
            away = self._away.get(address)
            if away is None or away.alias_of not in kept or (listed is not None and address not in listed):
                self._aliases.discard(address)
                if away is not None:
                    del self._away[address]

    # -- servers joining and leaving ----------------------------------------------------------------

    @one_thread
    def refresh(self, *, drop: Iterable[str] = (), wait: float = 1.0) -> FleetChange | None:
        """Look the servers up again: connect to servers that appeared, let go of those that left.

        Call it between rollouts, with no step in flight. Servers that stay keep their envs, and
        the episodes in them, in order; the envs of servers that join come after them, freshly reset.
        ``num_envs`` and the batched spaces follow. A server leaves when its address no longer
        resolves (``docker compose up --scale env=N`` removed it), when its session ended (it stopped
        or restarted; not fault-tolerant: a fault-tolerant env reconnects it in place), or when it is
        named in ``drop`` (a call to it failed); it is let go (released)
        and joins again, with fresh envs, once it resolves and answers a handshake. A new server has
        ``wait`` seconds to answer; one still starting keeps connecting in the background and joins
        at a later refresh. A server whose spaces differ from the fleet's is left out (and logged).
        One whose handshake failed (claimed by another learner, of another env), or whose reset failed as it
        joined (a missed deadline), is tried again after a while, not at every refresh, until it joins or is
        listed no more (:data:`~learner.faults.JOIN_BACKOFF`:
        1 s, doubling up to 15 s; one still building its envs every 1 s); each kind of refusal is warned
        of once per server (the start's warning included), and said again at DEBUG.
        If the last step or reset failed, every env starts over (those that answered moved on unseen).

        Returns:
            None when nothing changed, else a :class:`~learner.fleet.FleetChange`: who joined and
            left, and for each env now its index before (-1 for new envs) and current observation
            (``restarted`` counts the envs of servers that stayed which started over).

        Raises:
            ServerUnavailableError: no server is left, even after ``connect_timeout`` seconds for those
                listed to answer again (the env is then of no further use: close it).
        """
        self._assert_idle("refresh")
        wait = _seconds("wait", wait, zero=True)
        dropped = set(drop)
        resolved, listed = self._look_up()
        looked_up_at = time.monotonic()
        replicas = {id(r.client): r for r in self._replicas}
        stay, leave = self._partition(resolved, dropped, replicas)
        if listed:  # (listed still: a server that left saying it was shutting down was not scaled down)
            for client in stay:
                replicas[id(client)].looked_up_at = looked_up_at
        # Lost between steps (or, not fault-tolerant, in the rollout dropped): failures, unless they said
        # they were shutting down (scaled down, say) as they ended the session.
        gone = [
            c for c in leave if replicas[id(c)].state is ReplicaState.UP and (c.address in dropped or c.session_ended)
        ]
        ask = [c for c in gone if c.session_ended]
        said = (
            self._runner.run(lambda: gather(*(c.ended_by_shutdown() for c in ask), return_exceptions=True))
            if ask
            else []
        )
        told = {id(c) for c, answer in zip(ask, said, strict=True) if answer is True}
        for client in gone:
            self._count_gone(client, replicas[id(client)], planned=id(client) in told)
        # Let go of those that left first: a server that comes back must not find itself claimed by us.
        self._let_go(leave, replicas)
        self._forget_aliases(stay, resolved if listed else None)
        wanted = [a for a in resolved if a not in {c.address for c in stay} and a not in self._aliases]
        joined = self._runner.run(lambda: self._join(wanted, wait, listed=listed))
        if not stay and not joined:
            # Every connection dropped at once (an overloaded host, a network blip): give the servers
            # connect_timeout to answer again before giving up.
            joined = self._runner.run(lambda: self._join(wanted, self.connect_timeout, everyone=True, listed=listed))
        if not leave and not joined and self._stale is None:
            return None
        try:
            resets, failed = self._restart(stay, joined, replicas)
        except BaseException:
            # Interrupted (a Ctrl-C while they reset): the servers joining are in none of the fleet's lists yet, so
            # no close would release their sessions, taken up (their Hold streams kept the claims for as long as
            # their connections lived: the process's life). Let go of them now; the fleet stays as it was.
            self._let_go(joined, replicas)
            raise
        # A server whose reset failed leaves as well (several replicas stopping at once fail one
        # after another); those that stayed until now may have a reconnect task to end first. One
        # that was joining does not join: it is tried again later, as after a failed handshake.
        leave += [c for c in stay if c in failed]
        stay, joined = [c for c in stay if c not in failed], [c for c in joined if c not in failed]
        for client in joined:
            self._joined(client.address)
        if not stay and not joined:
            self._let_go(failed, replicas)
            raise ServerUnavailableError(
                f"refresh: no env server left: {', '.join(label_of(c.address) for c in leave)} left, and none of "
                f"{', '.join(map(label_of, resolved)) or 'no address'} ({self._address_spec}) joined",
                address=leave[0].address,  # every server left: the fleet is never empty
            )
        self._let_go(failed, replicas)
        if not leave and not joined and self._stale is None:  # (only servers that failed to join: no change)
            return None
        self._note_leaving(replicas[id(c)] for c in leave)
        timers = self._timers
        change = self._relayout(stay, joined, leave, resets, replicas)
        if listed:  # (those that joined were listed by this look-up too: see the servers that stay's, above)
            new = {id(client) for client in joined}
            for replica in self._replicas:
                if id(replica.client) in new:
                    replica.looked_up_at = looked_up_at
        # The window of a server that left ends now (its rates are of its time in the fleet); one back in
        # this window with the same envs takes its timer back, and it runs again.
        kept = {id(timer) for timer in self._timers}
        for timer in timers:
            if id(timer) not in kept:
                timer.stop()
        for timer in self._timers:
            timer.start()
        return change

    def _look_up(self) -> tuple[list[str], bool]:
        """The servers the addresses name now (refresh's first step), and True; on a failed look-up,
        those of now, and False (it says nothing of the servers not connected)."""
        try:
            named = expand_named(self._address_spec)
        except AddressError as err:
            # At once, then once per LOOKUP_FAILED_LOG_S while they go on (refresh runs between rollouts, maybe
            # several times a second), whatever the text: the Docker SDK's errors name a connection object by its
            # memory address, new at each try, and a look-up that fails now and then (an engine that times out)
            # would be warned of, and its end said, at each failure. Not by text, then: a set of them grew as long.
            now = time.monotonic()
            since, warned = self._lookup_failed or (now, False)
            due = now - self._lookup_warned_at >= LOOKUP_FAILED_LOG_S
            if due:
                self._lookup_warned_at = now
            self._lookup_failed = (since, warned or due)
            (log.warning if due else log.debug)(
                "refresh: %s; keeping the %d server(s) connected now%s",
                err,
                len(self._clients),
                f" (look-ups failing for {now - since:.0f} s: servers added or moved since are not found; one such "
                f"line every {LOOKUP_FAILED_LOG_S:g} s while they fail)"
                if now - since >= 1
                else "",
            )
            return self.addresses, False
        if self._lookup_failed is not None:
            since, warned = self._lookup_failed
            # (INFO where a warning named these failures; else, as they were, DEBUG)
            (log.info if warned else log.debug)(
                "refresh: %s looked up again, after %.0f s of failed look-ups",
                self._address_spec if isinstance(self._address_spec, str) else ",".join(self._address_spec),
                time.monotonic() - since,
            )
            self._lookup_failed = None
        self._dns_names.update((endpoint, name) for endpoint, name in named.items() if name)
        return list(named), True

    def _partition(
        self, resolved: list[str], dropped: set[str], replicas: dict[int, Replica]
    ) -> tuple[list[EnvClient], list[EnvClient]]:
        """The servers that stay in the fleet, and those that leave it (refresh's second step)."""
        # Fault-tolerant, a server whose connection dropped stays: its next step fails fast, and it is
        # reconnected in place (its envs unavailable meanwhile) rather than let go and joined anew;
        # unless it came back with other envs (another num_envs: it cannot take its old place), then it
        # leaves and joins again as it is now.
        stay = [
            c
            for c in self._clients
            if c.address in resolved
            and c.address not in dropped
            and (self.fault_tolerant or not c.session_ended)
            and not replicas[id(c)].changed
        ]
        return stay, [c for c in self._clients if c not in stay]

    def _let_go(self, clients: list[EnvClient], replicas: dict[int, Replica]) -> None:
        """End the reconnect tasks of servers that leave the fleet (fault-tolerant), then release and close them."""
        for client in clients:
            replica = replicas.get(id(client))  # (None: a server that was joining)
            if replica is not None and replica.reconnect_task is not None:
                replica.reconnect_task.cancel()  # (it would go on reconnecting a closed channel)
        if clients:
            self._runner.run(lambda: gather(*(c.close() for c in clients), return_exceptions=True))

    def _restart(
        self, stay: list[EnvClient], joined: list[EnvClient], replicas: dict[int, Replica]
    ) -> tuple[dict[str, tuple[Any, dict[str, Any]]], list[EnvClient]]:
        """Reset the envs that start over (refresh's third step): those of servers that joined, and, if
        the last step or reset failed, every env. Returns each reset server's observations and infos
        (by address), and the servers whose reset failed (or could not be read)."""
        restart = [*stay, *joined] if self._stale is not None else joined
        results = self._runner.run(
            lambda: gather(*(c.reset(None, None, None) for c in restart), return_exceptions=True)
        )
        resets: dict[str, tuple[Any, dict[str, Any]]] = {}
        failed: list[EnvClient] = []
        for client, response in zip(restart, results, strict=True):
            if not isinstance(response, BaseException):
                try:
                    resets[client.address] = self._read_reset(client, response)
                except InvalidResponseError as unreadable:
                    response = unreadable
            if isinstance(response, BaseException):
                if id(client) in replicas:
                    log.warning("refresh: env server %s leaves the fleet: %s", label_of(client.address), response)
                else:
                    self._not_joined(client.address, response, f"its reset failed: {response}")
                failed.append(client)
                self._count_loss(client, replicas.get(id(client)), response)
        # Infos that do not fit those of the servers before them in the new layout: those leave too.
        reset = [c for c in restart if c.address in resets]
        misfits: list[tuple[int, ValueError]] = []
        merge_infos(
            [(resets[c.address][1], 0, c.num_envs) for c in reset], max((c.num_envs for c in reset), default=0), misfits
        )
        for j, err in misfits:
            client = reset[j]
            if id(client) in replicas:
                log.warning(
                    "refresh: env server %s leaves the fleet: its infos do not fit the fleet's batch (%s)",
                    label_of(client.address),
                    err,
                )
            else:
                self._not_joined(client.address, err, f"its infos do not fit the fleet's batch ({err})")
            del resets[client.address]
            failed.append(client)
            self._count_loss(client, replicas.get(id(client)), err)
        for client in reset:
            replica = replicas.get(id(client))
            if client.address in resets and replica is not None and replica.state is ReplicaState.READY:
                replica.state, replica.fresh = ReplicaState.UP, None  # (its own reset is superseded, as in reset())
        return resets, failed

    def _not_joined(self, address: str, err: BaseException, problem: str) -> None:
        """A server whose handshake went well but whose reset in refresh() failed with ``err`` (``problem``,
        as said) does not join: it is tried again after a while, as one whose handshake failed (see
        :meth:`_join`), and each kind of failure is warned of once per server (the others at DEBUG)."""
        away = self._away.setdefault(address, _Away())
        away.warned.add(_OTHER_ENV)  # (_admit warned of that, if so, as it took its handshake)
        news = away.refuse(err, problem.replace(f"env server {label_of(address)}: ", "", 1), call="Reset")
        log.log(
            logging.WARNING if news else logging.DEBUG,
            "refresh: env server %s does not join: %s (tried again in %g s)",
            label_of(address),
            away.last,
            away.delay,
        )

    def _joined(self, address: str) -> None:
        """A server joined the fleet (its reset too): it is away no more."""
        was = self._away.pop(address, None)
        if was is not None and was.missing_since is not None:
            log.info(
                "env server %s joined, %.0f s after the start went on without it",
                label_of(address),
                time.monotonic() - was.missing_since,
            )

    def _count_loss(self, client: EnvClient, replica: Replica | None, err: BaseException) -> None:
        """Count the loss of a server that stayed in the fleet (``replica``; None: one that joined, never
        counted in) whose reset in refresh() failed with ``err``: a failure (a shutdown if it said it
        was shutting down), as a failed step or reset counts. A server down already was counted when
        it was lost; one back since (READY) counted its return, so this is a loss of its own."""
        if replica is not None and replica.state is not ReplicaState.DOWN:
            self._count_gone(client, replica, planned=_shutting_down(err))

    def _count_gone(self, client: EnvClient, replica: Replica, *, planned: bool) -> None:
        """Count a server's loss noticed by refresh() in the run's totals and in the window of its
        statistics (replica_stats(): the server's, kept there once it has left)."""
        replica.count_loss(planned=planned)
        for timer in self._timers:
            if timer.address == client.address:
                timer.count_loss(planned=planned)

    async def _join(
        self, addresses: list[str], wait: float, everyone: bool = False, listed: bool = True
    ) -> list[EnvClient]:
        """The servers at ``addresses`` that answer a handshake and serve the fleet's env.

        Servers seen for the first time (or, with ``everyone``, all those still connecting) get ``wait``
        seconds to connect; the others join if they are connected by now. A handshake gets ``wait`` seconds
        too (at least :data:`JOIN_ANSWER_S`). One whose handshake failed (or that did not fit) is tried again
        once its wait is over (:data:`~learner.faults.JOIN_BACKOFF`); with ``everyone`` (no server left: the
        last try before giving up), at once, and until one joins or ``wait`` is over: servers still
        connecting are waited for, and handshakes answered UNAVAILABLE (a server that restarted, still
        building its envs) tried again, as at the start. ``listed``: the addresses are all those listed now
        (not so after a failed look-up), so the servers being connected to, waited for or missed that are
        not among them are no longer listed: forgotten.
        """
        if listed:
            for address in [a for a in self._joining if a not in addresses]:  # no longer listed
                client, ready = self._joining.pop(address)
                self._connecting.pop(address, None)
                ready.cancel()
                await client.close()
            # (listed again: tried at once. Not the other names of servers in the fleet, which refresh() does
            # not ask for: their records say they are set aside; _forget_aliases drops them once unlisted.)
            for address in [a for a in self._away if a not in addresses and a not in self._aliases]:
                del self._away[address]
        now = time.monotonic()
        deadline = now + wait

        def due(address: str) -> bool:
            away = self._away.get(address)
            return everyone or away is None or away.retry_at <= now

        fresh = []
        for address in addresses:
            if address not in self._joining and due(address):
                client = self._client(address)
                self._joining[address] = (client, asyncio.ensure_future(client.wait_ready()))
                self._connecting.setdefault(address, (now, 0.0))
                fresh.append(self._joining[address][1])
        # Only servers seen for the first time are waited for: one that stays listed without answering
        # must not hold up every rollout.
        if everyone:
            fresh = [ready for _, ready in self._joining.values()]
        answer_s = max(wait, JOIN_ANSWER_S)
        hint = f"a joining server has refresh()'s `wait` to answer, at least {JOIN_ANSWER_S:g} s"
        joined: list[EnvClient] = []
        # The clients taken out of _joining to be tried, and each Handshake call made (shielded, as the start's):
        # should the refresh be given up (a Ctrl-C cancels it) while Handshakes are in flight, their answers are
        # read then and the sessions they granted released (see release_unadopted), and those clients closed (a
        # session taken up already: its close releases it). Cancelled with the refresh, an answer was dropped, and
        # its server held the claim, with nobody to release it and no Hold stream, for its claim timeout, refusing
        # the learner started again.
        tried: list[EnvClient] = []
        calls: list[tuple[EnvClient, asyncio.Future[pb.HandshakeResponse]]] = []
        try:
            while True:
                if fresh and wait > 0:
                    await asyncio.wait(
                        fresh,
                        timeout=max(0.0, deadline - time.monotonic()),
                        return_when=asyncio.FIRST_COMPLETED if everyone else asyncio.ALL_COMPLETED,
                    )
                answered = [
                    client for address, (client, ready) in self._joining.items() if ready.done() and due(address)
                ]
                for client in answered:
                    del self._joining[client.address]
                    self._connecting.pop(client.address, None)
                tried += answered
                if everyone:  # (retried while the server answers UNAVAILABLE, up to the deadline)
                    handshakes = [self._handshake(c, deadline, calls) for c in answered]
                else:
                    handshakes = [
                        shielded_handshake(c, calls, answer_s, hint)
                        if answer_s < c.timeout
                        else shielded_handshake(c, calls)
                        for c in answered
                    ]
                responses = await gather(*handshakes, return_exceptions=True)
                joined += await self._admit(answered, responses)
                # (everyone: those still connecting, while none joined and time is left)
                fresh = [ready for _, ready in self._joining.values()]
                if not everyone or joined or not fresh or time.monotonic() >= deadline:
                    break
        except BaseException:
            await release_unadopted(calls)
            await gather(*(c.close() for c in tried), return_exceptions=True)
            raise
        self._remind_missing(joining={c.address for c in joined})
        return joined

    async def _admit(
        self, answered: list[EnvClient], responses: list[pb.HandshakeResponse | BaseException]
    ) -> list[EnvClient]:
        """Of the servers that ``answered`` (their handshakes' ``responses``), those that join the fleet: their
        sessions started. The others are closed, and tried again later (see :meth:`_join`)."""
        # Both names of a server another learner held at the start were set aside: the first to join
        # claimed it, and the fleet's own claim refuses the other.
        aliases = await self._find_aliases(answered, responses, held=self._clients)
        joined = []
        for client, response in zip(answered, responses, strict=True):
            if client in aliases:
                await client.close()
                continue
            problem = (
                str(response).removeprefix(f"env server {label_of(client.address)}: ")
                if isinstance(response, BaseException)
                else self._misfit(response.spec)
            )
            if problem:
                away = self._away.setdefault(client.address, _Away())
                # Each kind of problem warned of once per server (the start's warning counts): it is tried
                # again, refused alike, while it stays listed.
                news = away.refuse(response if isinstance(response, BaseException) else None, problem)
                log.log(
                    logging.WARNING if news else logging.DEBUG,
                    "refresh: env server %s does not join: %s (tried again in %g s)",
                    label_of(client.address),
                    problem,
                    away.delay,
                )
                if not isinstance(response, BaseException):
                    client.start_session(response)  # so that close() releases the claim
                await client.close()
                continue
            assert not isinstance(response, BaseException)  # (a failed handshake is a problem)
            was = self._away.get(client.address)
            if was is None or _OTHER_ENV not in was.warned:  # (once per server while it is away)
                warn_if_other_env(self._spec, response.spec, label_of(client.address), "the fleet's")
            client.start_session(response)
            # (still away until its reset in refresh() works too: see _joined and _not_joined)
            joined.append(client)
        return joined

    def _remind_missing(self, joining: set[str]) -> None:
        """Say (once per STILL_DOWN_LOG_S, rarer as they stay away: see faults.still_down_gap; 64 servers away,
        said every 20 s, made ~11,500 lines an hour) which of the servers the start went on without have not
        joined yet, and why (the last refusal, if one answered); not those ``joining`` now (their handshakes
        went well).
        Likewise of servers listed since that have not taken a connection, or whose handshakes (or resets) keep
        failing: else a server that a look-up lists but that cannot be reached (a port not published, a
        firewall), or that another learner holds, would stay out of the fleet unsaid."""
        now = time.monotonic()
        for address, (since, said_at) in self._connecting.items():
            away = self._away.get(address)
            if (away is not None and away.missing_since is not None) or address not in self._joining:
                continue  # (the start's missing servers: said below; one answered: its refusal was warned of)
            if now - since >= faults.STILL_DOWN_LOG_S and now - said_at >= faults.still_down_gap(now - since):
                client, _ = self._joining[address]
                log.warning(
                    "env server %s, listed %.0f s ago, has not taken a connection yet (gRPC channel %s); its envs "
                    "join when it answers",
                    self._named(address),
                    now - since,
                    client.channel.get_state(try_to_connect=False).name,
                )
                self._connecting[address] = (since, now)
        for address, away in self._away.items():
            if address in joining:
                continue
            if away.missing_since is not None and now - away.said_at >= faults.still_down_gap(now - away.missing_since):
                log.warning(
                    "env server %s has not joined since the start went on without it %.0f s ago%s; its envs join "
                    "when it answers",
                    label_of(address),
                    now - away.missing_since,
                    f" (last tried {now - away.tried_at:.0f} s ago: {away.last})" if away.tried_at else "",
                )
                away.said_at = now
            elif (
                away.missing_since is None
                and away.refused_since is not None
                and away.alias_of is None
                and address not in self._aliases
                and address not in self._joining  # (being connected to: the reminder above says so)
                and now - away.said_at >= faults.still_down_gap(now - away.refused_since)
            ):
                # (one listed after the start, refused since: its first refusal was warned of, the next at DEBUG)
                log.warning(
                    "env server %s, listed %.0f s ago, has not joined (last tried %.0f s ago: %s); it is tried again "
                    "until it joins or is listed no more",
                    label_of(address),
                    now - away.refused_since,
                    now - away.tried_at,
                    away.last,
                )
                away.said_at = now

    def _misfit(self, spec: pb.EnvSpec) -> str:
        """Why a server with ``spec`` cannot join the fleet ("" if it can)."""
        problem = incompatible(self._spec, spec)
        return f"it has {problem}" if problem else ""


class _Away:
    """A listed server out of the fleet: whether the fault-tolerant start went on without it; if its last
    handshake failed or it did not fit, when a refresh tries it again (see :data:`~learner.faults.JOIN_BACKOFF`)
    and what was said of it."""

    def __init__(self) -> None:
        self.missing_since: float | None = None  # the start went on without it, then (time.monotonic())
        self.said_at = 0.0  # when a line last said it had not joined
        self.held: ServerBusyError | None = None  # the start's refusal, as another learner held it
        self.tried_at = 0.0  # (0: not tried since it is away, as one that never answered)
        self.refused_since: float | None = None  # its first refusal since it is away (time.monotonic())
        self.retry_at = 0.0
        self.delay = 0.0  # the wait before retry_at
        self.last = ""  # why the last try failed, as said
        self.warned: set[str] = set()  # the kinds of problem a warning named (see refuse)
        self.alias_of: str | None = None  # another name of the server at this address, in the fleet (used once)

    def refuse(self, err: BaseException | None, problem: str, *, call: str = "Handshake") -> bool:
        """Note a try refused with ``err`` (None: the server did not fit the fleet) for ``problem`` (as
        said), and when to try again: after the first wait, doubling up to the longest; after the first
        each time for a server starting or shutting down (UNAVAILABLE: soon there, or gone). Whether
        that kind of problem is news (no warning named it yet: to be warned of). ``call``: the call that
        failed (its Reset, after a handshake that went well, is a kind of its own)."""
        first, longest = faults.JOIN_BACKOFF
        if isinstance(err, ServerUnavailableError) or not self.delay:
            self.delay = first
        else:
            self.delay = min(self.delay * 2, longest)
        self.tried_at = time.monotonic()
        self.retry_at, self.last = self.tried_at + self.delay, problem
        if self.refused_since is None:
            self.refused_since = self.said_at = self.tried_at  # (its warning, or the start's, said it just now)
        # (an error by its type and status code, its text changing from try to try: "claimed 0.7 s ago")
        code = getattr(err, "code", None)
        kind = problem if err is None else f"{call} {type(err).__name__} {getattr(code, 'name', '')}"
        news = kind not in self.warned
        self.warned.add(kind)
        return news


class _Retired:
    """Counters of the servers that left the fleet, so that fault_stats() keeps counting them."""

    def __init__(self) -> None:
        self.failures = self.shutdowns = self.reconnects = self.server_restarts = self.joined = self.left = 0

    def add(self, replica: Replica) -> None:
        self.failures += replica.failures
        self.shutdowns += replica.shutdowns
        self.reconnects += replica.reconnects
        self.server_restarts += replica.server_restarts


def _shutting_down(err: BaseException) -> bool:
    """Whether ``err`` is a server saying it is shutting down (UNAVAILABLE, over gRPC or the step socket)."""
    return (
        isinstance(err, RemoteEnvError)
        and err.code == grpc.StatusCode.UNAVAILABLE
        # (the server's raw text; str(err) for errors made again elsewhere, which keep no details)
        and (SHUTTING_DOWN_MESSAGE in err.details or SHUTTING_DOWN_MESSAGE in str(err))
    )
