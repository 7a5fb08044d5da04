"""Connecting a RemoteVectorEnv to its servers at the start: connections, handshakes, fitting envs."""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import grpc

from env_server.rpc import env_pb2 as pb
from learner.client import EnvClient, proxy_status, release_unadopted, shielded_handshake
from learner.discovery import diagnose, no_wait_mends, probe_until
from learner.errors import (
    RemoteTimeoutError,
    ServerBusyError,
    ServerFullError,
    ServerUnavailableError,
    SpecMismatchError,
    raise_first,
)
from learner.local import label_of, socket_folder_gone
from learner.loop import gather
from learner.membership import _Away
from learner.specs import incompatible, warn_if_other_env

if TYPE_CHECKING:
    from learner.remote import RemoteVectorEnv

__all__ = ["FleetConnection"]

# RemoteVectorEnv's logger, not this module's: these lines are the env's (users and tests filter
# "learner.remote"), and they were logged there before this code moved out of learner/remote.py.
log = logging.getLogger("learner.remote")

# Connecting: after this long without an answer (or half of connect_timeout, if less), look at why
# (a plain connect: refused? no socket file?) and say which servers are waited for.
_PATIENCE_S = 2.0


# The RemoteVectorEnvs of this process that are open: a server one of them holds, refusing another,
# is held by this process (a notebook cell run twice), not by some other learner. (Each adds itself
# once connected; learner.remote.close_all closes them.)
_LIVE: weakref.WeakSet[RemoteVectorEnv] = weakref.WeakSet()


def _held_here(address: str) -> bool:
    """Whether a RemoteVectorEnv of this process, open, holds the server at ``address``."""
    return any(address in env.addresses for env in _LIVE if not env.closed)


def _start_sessions(
    clients: list[EnvClient],
    responses: list[pb.HandshakeResponse | BaseException],
    *,
    left_out: Collection[EnvClient],
) -> None:
    """Start a session on each of ``clients`` but those ``left_out`` with its handshake's response (of
    ``responses``, in their order), giving each its first env's index in the fleet; the first failed
    handshake's error instead where there is one, the others' as its notes."""
    errors: list[BaseException] = []
    offset = 0
    for client, response in zip(clients, responses, strict=True):
        if client in left_out:
            continue
        if isinstance(response, BaseException):
            errors.append(response)
            continue
        client.start_session(response)
        client.env_offset = offset
        offset += response.spec.num_envs
    raise_first(errors)


class FleetConnection:
    """How a :class:`~learner.remote.RemoteVectorEnv` connects to its servers when it is made: connections
    within one deadline (saying why a server does not answer), handshakes (retried while a server builds
    its envs), and the check that their envs can step as one fleet.

    A mixin of RemoteVectorEnv, its only user: it reads and sets the env's state, declared below for
    the type checker (RemoteVectorEnv's ``__init__`` sets it). The step path does not come here.
    """

    # Of RemoteVectorEnv (see its __init__).
    fault_tolerant: bool
    connect_timeout: float
    _credentials: grpc.ChannelCredentials | None
    _tls_roots: bytes | None
    _client_cert: tuple[str, str] | None
    _clients: list[EnvClient]
    _joining: dict[str, tuple[EnvClient, asyncio.Future[None]]]
    _away: dict[str, _Away]

    if TYPE_CHECKING:

        def _client(self, address: str) -> EnvClient: ...

        def _server_name(self, address: str) -> str | None: ...

        def _close_clients(self) -> None: ...

        def _note_missing(self, missing: list[tuple[str, str]], listed: int) -> None: ...

        def _named(self, address: str) -> str: ...

        def _one_family_hint(self, address: str) -> str: ...

        async def _find_aliases(
            self,
            clients: list[EnvClient],
            responses: list[pb.HandshakeResponse | BaseException],
            held: Sequence[EnvClient] = (),
        ) -> set[EnvClient]: ...

    @property
    def served_envs(self) -> dict[str, str]:
        """The env each server serves (its ``--env``), by address, in env order: servers whose envs fit one
        another's spaces make one fleet (:func:`~learner.specs.incompatible`), whatever env each names, so
        this may hold several (each warned of as it connects), where ``env_id`` is the first server's."""
        return {c.address: c.spec.env_id for c in self._clients if c.spec is not None}

    async def _connect(self, endpoints: list[str], deadline: float) -> list[EnvClient]:
        """Connect to ``endpoints`` within ``deadline`` and start a session on each; the clients in the fleet's
        order. Fault-tolerant, the start goes on without servers that do not answer or are not free yet (they
        join later); an error otherwise, naming the first server and, where found, why. On any error, every
        connect still waiting is cancelled and every client closed."""
        self._refuse_gone(endpoints)
        clients: list[EnvClient] = []
        # Fault-tolerant: the servers the start goes on without (address, why), said in one warning at the
        # end, with the count the fleet starts with (those that did not connect, and those refused after).
        missing: list[tuple[str, str]] = []
        readies: list[asyncio.Future[None]] = []
        # Each Handshake call made, by client: its answer, should the connect be given up, is read then (see
        # _give_up_connecting), not lost with it.
        calls: list[tuple[EnvClient, asyncio.Future[pb.HandshakeResponse]]] = []
        try:
            for address in endpoints:
                clients.append(self._client(address))
            # Connect to all servers at once, within one shared deadline.
            readies = [asyncio.ensure_future(c.wait_ready()) for c in clients]
            late, probed, cause = await self._wait_connected(clients, readies, deadline)
            if late and self.fault_tolerant and len(late) < len(clients):
                clients = await self._go_on_without(clients, readies, late, missing)
            elif late:  # (the connects still waiting are cancelled on the way out, as on any error)
                client = next(c for c, r in zip(clients, readies, strict=True) if r in late)
                raise self._no_answer_error(client, cause if client.address == probed else None)
            responses = await gather(*(self._handshake(c, deadline, calls) for c in clients), return_exceptions=True)
            aliases = await self._find_aliases(clients, responses)
            building = self._building(clients, responses, aliases)
            _start_sessions(clients, responses, left_out={*aliases, *building})
            if aliases or building:
                await self._set_aside(aliases, building, missing)
                clients = [c for c in clients if c not in aliases and c not in building]
            if missing:
                order = {address: i for i, address in enumerate(endpoints)}
                missing.sort(key=lambda m: order[m[0]])  # (as listed)
                self._note_missing(missing, listed=len(endpoints) - len(aliases))
        except BaseException:
            await self._give_up_connecting(clients, readies, calls)
            raise
        return clients

    def _refuse_gone(self, endpoints: list[str]) -> None:
        """ServerUnavailableError where a LocalServers' ``unix:`` address among ``endpoints`` has its folder
        gone (fault-tolerant, only where all have)."""
        # A LocalServers' unix: address whose folder is gone has no server to wait for (they stopped, or
        # were garbage-collected at once: RemoteVectorEnv(LocalServers(...).addresses)): said now, not after
        # connect_timeout. (A folder of another name may yet be made, by a service manager say: waited for.)
        # Fault-tolerant, while another server may answer, it is missing as any is.
        gone = [
            (address, why) for address in endpoints if (why := socket_folder_gone(address, local_only=True)) is not None
        ]
        if gone and (not self.fault_tolerant or len(gone) == len(endpoints)):
            address, why = gone[0]
            raise ServerUnavailableError(
                f"env server {label_of(address)}: nothing can answer there: {why}", address=address
            )

    async def _wait_connected(
        self, clients: list[EnvClient], readies: list[asyncio.Future[None]], deadline: float
    ) -> tuple[set[asyncio.Future[None]], str, str | None]:
        """Wait for the connections of ``clients`` (``readies``, in their order) until ``deadline``; the
        connects still waiting then, the address of the first one probed when some were late (""
        where none were), and why that one did not answer (None where not found). Said in a warning while
        the wait goes on; ServerUnavailableError where no wait will mend why (a TLS failure, another
        protocol)."""
        patience = min(max(0.0, deadline - time.monotonic()) / 2, _PATIENCE_S)
        _, late = await asyncio.wait(readies, timeout=patience)
        probed, cause = "", None
        if late:
            # Why does the first of them not answer? Said now when the wait is long (servers may
            # still be starting; a typo waits as long), and in the error if it runs out.
            waiting = [c.address for c, r in zip(clients, readies, strict=True) if r in late]
            probed, cause = waiting[0], await probe_until(waiting[0], deadline, self._diagnose)
            if no_wait_mends(cause):  # (a TLS failure, another protocol: no wait will mend that)
                raise ServerUnavailableError(f"env server {self._named(probed)}: {cause}", address=probed)
            if self.connect_timeout > _PATIENCE_S:
                log.warning(
                    "env server%s %s not answering yet%s; waiting up to %g s in all (`connect_timeout`)",
                    "s" if len(waiting) > 1 else "",
                    # (a name said with its dns: address has a comma in it: then "; " between them)
                    ("; " if any("," in self._named(a) for a in waiting) else ", ").join(map(self._named, waiting)),
                    f" ({label_of(probed)}: {cause})" if cause else "",
                    self.connect_timeout,
                )
            _, late = await asyncio.wait(late, timeout=max(0.0, deadline - time.monotonic()))
        return late, probed, cause

    async def _go_on_without(
        self,
        clients: list[EnvClient],
        readies: list[asyncio.Future[None]],
        late: set[asyncio.Future[None]],
        missing: list[tuple[str, str]],
    ) -> list[EnvClient]:
        """Fault-tolerant, ``clients`` less those whose connects (``readies``, in their order) are ``late``: they
        join later (their connection attempts go on), each added to ``missing`` with why. ServerUnavailableError
        where one of them has a problem no wait will mend (a wrong port, a TLS mismatch)."""
        unready = [c for c, r in zip(clients, readies, strict=True) if r in late]
        # (each probed: a wrong port, a TLS mismatch is an error whatever the others do)
        until = time.monotonic() + 2.0  # (a name lookup that hangs holds up nothing)
        causes = await gather(*(probe_until(c.address, until, self._diagnose) for c in unready))
        for client, why in zip(unready, causes, strict=True):
            if no_wait_mends(why):
                raise ServerUnavailableError(f"env server {self._named(client.address)}: {why}", address=client.address)
        for client, ready in zip(clients, readies, strict=True):
            if ready in late:
                self._joining[client.address] = (client, ready)  # (its connection attempts go on)
        nothing = f"nothing answered within {self.connect_timeout:g} s"
        missing.extend(
            (
                c.address,
                nothing + "".join(f" ({text})" for text in (why, self._one_family_hint(c.address)) if text),
            )
            for c, why in zip(unready, causes, strict=True)
        )
        return [c for c in clients if c not in unready]

    def _no_answer_error(self, client: EnvClient, cause: str | None) -> ServerUnavailableError:
        """The error for ``client``'s server that did not answer within ``connect_timeout``, with ``cause``
        (what probing it found, where it was) and a hint at what to check."""
        hint = (f"{cause}: " if cause else "") + "is the server running, and is the address right?"
        if self._one_family_hint(client.address):
            hint += f" {self._one_family_hint(client.address)}"
        if cause == "" and self._credentials is None:  # something listens, and says nothing gRPC can read
            hint = (
                "something accepts connections there but does not answer as an env server; "
                "if it uses TLS, pass its CA (tls=..., learner train --tls-ca)"
            )
        if self._credentials is not None:
            hint += (
                " With TLS, the server must speak TLS with a certificate signed by the CA given and "
                "made for the address's host (the name of a dns: address, localhost for a unix: one; or "
                "tls_server_name)"
                + (
                    ", and take the client certificate given (one its --tls-client-ca signed)"
                    if self._client_cert is not None
                    else "; a server that requires client certificates needs one (tls_client_cert, tls_client_key)"
                )
            )
        return ServerUnavailableError(
            f"env server {self._named(client.address)}: nothing answered within {self.connect_timeout:g} s ({hint})",
            address=client.address,
        )

    def _building(
        self,
        clients: list[EnvClient],
        responses: list[pb.HandshakeResponse | BaseException],
        aliases: set[EnvClient],
    ) -> dict[EnvClient, BaseException]:
        """The ``clients`` (but ``aliases``) whose handshakes (``responses``, in their order) failed in a way
        that lets them join later, with each one's error; none unless fault-tolerant with some servers in."""
        # Fault-tolerant, some servers in: those still building their envs at the deadline join later,
        # as those that did not answer at all do; so do those claimed by another learner (one cut off
        # by a partition, or killed on a host that vanished, holds its claim until the server notices),
        # and those that connected but did not answer the handshake in time (a server whose event loop
        # hangs: an env's step that never returns).
        if not (self.fault_tolerant and any(not isinstance(r, BaseException) for r in responses)):
            return {}
        return {
            c: r
            for c, r in zip(clients, responses, strict=True)
            if c not in aliases
            and isinstance(r, ServerUnavailableError | ServerBusyError | RemoteTimeoutError)
            # (held by another RemoteVectorEnv of this process: an error, as before; only closing it helps)
            and not (isinstance(r, ServerBusyError) and _held_here(c.address))
        }

    async def _set_aside(
        self, aliases: set[EnvClient], building: dict[EnvClient, BaseException], missing: list[tuple[str, str]]
    ) -> None:
        """Close the clients of ``aliases`` and ``building`` (see :meth:`_building`); the servers of
        ``building`` join later (a new client each, connecting meanwhile), refused here once (for the refresh
        that tries them again), and are added to ``missing`` with why."""
        for client in building:
            later = self._client(client.address)
            self._joining[client.address] = (later, asyncio.ensure_future(later.wait_ready()))
        await gather(*(c.close() for c in [*aliases, *building]), return_exceptions=True)
        if building:
            reasons = {
                c.address: str(err).removeprefix(f"env server {label_of(c.address)}: ") for c, err in building.items()
            }
            for client, err in building.items():
                # Tried here already: a refresh tries it again once JOIN_BACKOFF's first wait is over, and
                # says at DEBUG that it was refused alike (the warning _connect ends with names the problem).
                away = self._away.setdefault(client.address, _Away())
                away.refuse(err, reasons[client.address])
                away.held = err if isinstance(err, ServerBusyError) else None
            missing.extend(reasons.items())

    async def _give_up_connecting(
        self,
        clients: list[EnvClient],
        readies: list[asyncio.Future[None]],
        calls: Sequence[tuple[EnvClient, asyncio.Future[pb.HandshakeResponse]]] = (),
    ) -> None:
        """On an error in :meth:`_connect`: cancel every connect still waiting (``readies``, and the servers
        to join later), release every session the Handshake ``calls`` granted that no client took up (see
        :func:`~learner.client.release_unadopted`), and close every client (``clients``, theirs too)."""
        joining, self._joining = self._joining, {}
        for _, pending in joining.values():
            pending.cancel()
        # (the connects still waiting too, before their channels close under them: interrupted, a Ctrl-C's
        # cancel, they logged "Task exception was never retrieved ... Channel is closed")
        for ready in readies:
            ready.cancel()
        await gather(*readies, return_exceptions=True)
        await release_unadopted(calls)
        await gather(*(c.close() for c in clients + [c for c, _ in joining.values()]), return_exceptions=True)

    def _diagnose(self, address: str, timeout: float) -> str | None:
        """Why ``address`` does not answer (:func:`~learner.discovery.diagnose`)."""
        return diagnose(
            address,
            timeout,
            tls=self._credentials is not None,
            roots=self._tls_roots,
            server_name=self._server_name(address),
            client_cert=self._client_cert,
        )

    async def _handshake(
        self,
        client: EnvClient,
        deadline: float,
        calls: list[tuple[EnvClient, asyncio.Future[pb.HandshakeResponse]]],
    ) -> pb.HandshakeResponse:
        """Handshake, retried while the server answers UNAVAILABLE (it listens while it builds its envs).
        Each Handshake call is added to ``calls``, with ``client``, and runs shielded (see
        :func:`~learner.client.shielded_handshake`), for the caller to release the session its answer may grant
        should it be given up (:func:`~learner.client.release_unadopted`)."""
        delay = 0.05
        first: ServerUnavailableError | None = None  # (the first failure the handshake was tried again after)
        while True:
            try:
                return await shielded_handshake(client, calls)
            except ServerBusyError as err:
                if first is not None and f"claimed by {client.client_name!r}" in err.details:
                    # The server holds the session a failed attempt of this learner claimed (its answer
                    # was lost on the way: a ping timeout on a slow link, say): the first failure is the
                    # one to say (those after it follow from it: connect timeouts behind the lost answer).
                    raise ServerUnavailableError(
                        f"{first} (tried again: the server still holds the session that attempt claimed, until "
                        "it has had no call for its claim timeout, env-server --claim-timeout, 30 s by default)",
                        address=client.address,
                        code=first.code,
                    ) from None
                if isinstance(err, ServerFullError) or not _held_here(client.address):
                    raise
                # (a notebook cell run twice: the first RemoteVectorEnv still holds the server)
                raise ServerBusyError(
                    f"{err} -- that learner is this process: close the RemoteVectorEnv that holds the server "
                    "(envs.close(), or make it in a with block) before making another; learner.close_all() closes "
                    "every one of this process (one you lost track of: a notebook keeps an error's traceback, and "
                    "the env in it)",
                    address=client.address,
                    code=err.code,
                ) from None
            except ServerUnavailableError as err:
                first = first or err
                gone = socket_folder_gone(client.address)
                if gone is not None:  # (no server can come there: no use waiting for one)
                    raise ServerUnavailableError(f"{err} ({gone})", address=client.address, code=err.code) from None
                if time.monotonic() + delay > deadline:
                    # (a proxy's answer is no server building its envs: its text says what it means)
                    advice = (
                        ""
                        if proxy_status(err.details)
                        else ": raise `connect_timeout` for servers that take long to build their envs"
                    )
                    raise ServerUnavailableError(
                        f"{err} (still, after {self.connect_timeout:g} s{advice})",
                        address=client.address,
                        code=err.code,
                    ) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    def _check_specs(self) -> None:
        """Refuse servers whose envs cannot step as one fleet (see :func:`~learner.specs.incompatible`)."""
        first = self._clients[0]
        assert first.spec is not None
        for client in self._clients[1:]:
            spec = client.spec
            assert spec is not None
            problem = incompatible(first.spec, spec, whose=f"env server {label_of(first.address)}'s")
            if problem:
                self._close_clients()
                raise SpecMismatchError(
                    f"env server {label_of(client.address)} has {problem}; one RemoteVectorEnv needs servers whose envs "
                    "have the same spaces and autoreset mode",
                    address=client.address,
                )
            warn_if_other_env(first.spec, spec, label_of(client.address), f"env server {label_of(first.address)}'s")
