"""RemoteVectorEnv: many env servers presented as one gymnasium VectorEnv."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import select
import threading
import time
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from copy import deepcopy
from typing import Any

import grpc
import gymnasium as gym
import numpy as np
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError, ResetNeeded
from gymnasium.utils import seeding
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.utils import batch_space

from env_server import codec
from env_server.isolation import error_phrase
from env_server.protocol import bearer_metadata, escape_surrogates
from env_server.rpc import env_pb2 as pb
from env_server.validation import InvalidActionError, check_actions
from learner import faults, pauses
from learner.batching import (
    InfoPart,
    as_arrays,
    check_batch,
    merge_infos,
    placeholder_batch,
    response_infos,
    slice_batch,
    split_groups,
    write_batch,
)
from learner.client import (
    HANDSHAKE_ANSWER_WAIT_S,
    KEEPALIVE_TIMEOUT,
    RESET_TIMEOUT_HINT,
    RESET_WAIT_TIMEOUT_HINT,
    STEP_WAIT_TIMEOUT_HINT,
    TIMEOUT_HINT,
    EnvClient,
    SocketStep,
    channel_credentials,
    released_if_given_up,
    releasing_unadopted,
    server_text,
    timeout_error,
)
from learner.connecting import _LIVE, FleetConnection
from learner.discovery import expand_named, pin_addresses, warn_duplicates
from learner.errors import (
    EnvCrashedError,
    InvalidArgumentError,
    InvalidArgumentTypeError,
    InvalidRequestError,
    InvalidResponseError,
    ServerUnavailableError,
    SessionError,
    SpecMismatchError,
    raise_first,
)
from learner.faults import Replica, ReplicaState, is_outage, misfit_reported
from learner.fleet import FleetChange
from learner.local import label_of, socket_folder_gone, usable_cpus
from learner.loop import LoopRunner, gather
from learner.membership import FleetMembership, _Away, _Retired
from learner.outages import FleetOutages, in_server_order
from learner.specs import gym_env_spec, incompatible, served_kwargs, warn_if_other_env
from learner.stats import ReplicaStats, StepTimer
from learner.validate import addresses as _addresses
from learner.validate import count as _count
from learner.validate import flag as _flag
from learner.validate import is_finite as _is_finite
from learner.validate import one_thread as _one_thread
from learner.validate import seconds as _seconds

__all__ = ["DEFAULT_CONNECT_TIMEOUT", "FAULT_TOLERANT_HINT", "RemoteVectorEnv", "ResetNeededError", "close_all"]

DEFAULT_CONNECT_TIMEOUT = 10.0
"""RemoteVectorEnv's default ``connect_timeout`` (seconds to find and connect to every server)."""

FAULT_TOLERANT_HINT = "fault_tolerant=True reports this in infos['env_error'] instead of raising"
"""The advice an env's exception comes with, not fault-tolerant (``learner eval`` words it its way)."""

log = logging.getLogger(__name__)

# A step the step socket refused, resent over gRPC, gets the time left of the step's timeout, and
# at least this long (the socket's refusal may have come at the very end).
_RESEND_MIN_S = 0.05

# A step whose deadline passed while the learner was busy elsewhere (pipelining: another
# group taken in, a policy's forward pass; or long between step_async and step_wait) gets this long
# (at most ``timeout``) for the loop to take in an answer that came in meanwhile: the loop runs only
# while the learner waits, and an answer on time is no timeout. A hung server is reported that late.
_LAST_LOOK_S = 0.25

ANSWERED_HERE = ("render_mode", "observation_space", "action_space", "metadata", "spec")
"""The envs' attributes that RemoteVectorEnv's get_attr (and the SB3 adapter's) answers from what this process knows;
no other name is read (see _NOT_BY_NAME)."""

_NOT_BY_NAME = (
    "RemoteVectorEnv has no {what}: it would let a request name methods and attributes for a server "
    "to run, and a server runs only what its operator chose; ask for an env (or wrapper) that returns "
    "what you need in infos"
)


def close_all() -> int:
    """Close every RemoteVectorEnv of this process still open (releasing its servers); how many it closed.

    For a notebook or REPL that lost track of one: an exception's traceback, which they keep, keeps
    the env it was raised in alive, and with it the env's claim on its servers (a new RemoteVectorEnv
    on them is refused with ServerBusyError, saying the holder is this process)."""
    envs = [env for env in list(_LIVE) if not env.closed]
    for env in envs:
        env.close()
    return len(envs)


StepResult = tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]


class ResetNeededError(SessionError, ResetNeeded):
    """A step before the first reset: refused before anything is sent. A :class:`SessionError` and
    gymnasium's ``ResetNeeded`` (what its vector envs raise then), so either ``except`` catches it."""


def _backoff(backoff: tuple[float, float]) -> tuple[float, float]:
    """``backoff`` (RemoteVectorEnv's), checked: the first and longest wait between reconnect attempts."""
    if not (
        isinstance(backoff, Sequence)
        and len(backoff) == 2
        and all(_is_finite(b) for b in backoff)
        and 0 < backoff[0] <= backoff[1]
    ):
        raise InvalidArgumentError(
            f"backoff: expected (first, longest) finite seconds with 0 < first <= longest, got {backoff!r}"
        )
    return (float(backoff[0]), float(backoff[1]))


def _spin_wait(spin_wait: float) -> float:
    """``spin_wait`` (RemoteVectorEnv's), checked: seconds to look for a step-socket answer awake."""
    if not (_is_finite(spin_wait) and 0 <= spin_wait <= 1):
        raise InvalidArgumentError(f"spin_wait: expected seconds in [0, 1], got {spin_wait!r}")
    return float(spin_wait)


def _client_cert(cert: str | os.PathLike[str] | None, key: str | os.PathLike[str] | None) -> tuple[str, str] | None:
    """The client certificate and key's paths, for the TLS probe's handshake (channel_credentials checked that
    both or neither are given)."""
    return None if cert is None or key is None else (os.fspath(cert), os.fspath(key))


class RemoteVectorEnv(FleetConnection, FleetMembership, FleetOutages, gym.vector.VectorEnv):
    """Env servers reached over gRPC, as one ``gymnasium.vector.VectorEnv``.

    Envs are numbered over all servers in address order: server 0's K0 envs first, then server 1's,
    and so on. :meth:`step` sends every server its envs' actions at once (one message on a stream
    kept open per server) and waits for all of them.

    Pipelining (as EnvPool and Sample Factory do): with ``num_groups=G`` the servers form G groups,
    and :meth:`send` / :meth:`recv` step one group at a time, so the learner computes the actions
    of one group while the others step::

        envs = RemoteVectorEnv(addresses, num_groups=2)
        obs, infos = envs.reset(seed=0)
        for g, sl in enumerate(envs.group_slices):
            envs.send(policy(obs[sl]), g)
        while training:
            g, obs_g, rewards, terminations, truncations, infos = envs.recv()  # the first group done
            envs.send(policy(obs_g), g)

    For the same seeds and actions, each env's results are exactly those :meth:`step` gives.

    Failures. By default a server that fails (connection lost, no answer within ``timeout``, its session
    gone, its vector env broken, an answer that cannot be read or whose infos do not fit the other
    servers': :class:`~learner.errors.InvalidResponseError`), or an env that raises (which its server
    isolates and reports: :class:`~learner.errors.EnvCrashedError`), raises a
    :class:`~learner.errors.RemoteEnvError` naming it, as a local vector env raises when an env does:
    the gymnasium contract has no way to say "these envs are gone", and a caller that does not expect
    it would otherwise learn from made-up data without knowing. With ``fault_tolerant=True`` (``learner train``'s default) a failed server costs its own
    envs only, and :meth:`step` keeps returning promptly:

    * On the step where the server is lost, its envs' episodes end as *truncated*, with reward 0
      and their last observation (under same-step autoreset also as ``infos["final_obs"]``).
    * While it is down, its envs return their last observation, reward 0, no termination or
      truncation; a reconnect task retries the same address with exponential backoff (``backoff``:
      first and longest wait, seconds; plus gRPC's own reconnects), releasing this learner's old
      session if the server turns out to be the same process (its server id tells a restarted
      server from a live one), then opens a new session and resets the envs (unseeded).
    * The step after that hands over the reset's observations, reward 0: new episodes. From the
      next step on the envs are stepped as before. Rejoining takes a moment after the server is
      back (about the channel's reconnect backoff, at most 2 s, plus one round trip per call).
    * ``infos["env_unavailable"]`` (with gymnasium's ``"_env_unavailable"`` mask) is True for an env on
      every step whose result is no transition of that env: while its server is lost or down, on the
      step it rejoins (``infos["env_rejoined"]`` too, with its mask), and on steps where the server
      reported the env's own exception
      (``infos["env_error"]``; the server isolates it either way, and only a plain env raises). A
      learner drops those steps from its batch (they are not transitions; the observation is stale or a
      new episode's first), and bootstraps the step before a loss as a truncation. The key is absent
      while every env is available, so results are identical to plain stepping when nothing fails.
    * A server lost again soon after it came back (before it answered 3 steps and 10 s passed:
      it answers handshakes and resets but fails its steps) is *flapping*: each such loss in a row
      waits longer before the server is taken back, on ``backoff``'s schedule, and they are logged
      at most once per 10 s, with their count.
    * If no server is up, :meth:`step` waits up to ``min(timeout, 1 s)`` for one to come back before
      returning, so a training loop does not spin (:meth:`recv` of a group whose servers are all down
      waits so only when no server of the fleet is up either); once all have been down for ``give_up_after``
      seconds, it raises :class:`~learner.errors.ServerUnavailableError` instead. A flapping server
      counts as down from its first loss until it answers a step again.
    * A server whose answers cannot be read (:class:`~learner.errors.InvalidResponseError`) again right
      after it came back, with no step answered between, is broken, not lost: it is not reconnected,
      and the step raises that InvalidResponseError (the fleet then needs a reset), as a refused token
      does; one unreadable answer alone is an outage (see learner.faults: UNREADABLE_IN_A_ROW). The
      next reset (of any of its envs) tries it again: mended or replaced at its address, it rejoins as
      after an outage; still broken, the first of its answers that cannot be read raises again. So is
      one whose step is answered UNIMPLEMENTED again right after it came back (a server of envfleet's
      first versions, which served no StepStream; once, an HTTP proxy's 404, is an outage): the step
      raises a :class:`~learner.errors.RemoteEnvError` of that code, which says to upgrade it.

    Invalid arguments (:class:`~learner.errors.InvalidArgumentError`), invalid actions
    (:class:`~learner.errors.InvalidRequestError`) and a refused token
    (:class:`~learner.errors.AuthenticationError`) raise in either mode: they are the caller's to
    fix. So does an observation an env returned that does not fit the observation space (its shape, or a
    dtype gymnasium will not cast: the server's ObservationLayoutError, an
    :class:`~learner.errors.EnvCrashedError` naming the env): the env's to fix, which no reconnect mends
    (the env returns it again), as a NaN observation is; and so do infos that make an answer larger than a
    message may be (64 MiB), an EnvCrashedError naming the answer's size. Envs not reset yet (their server down when the
    fleet was reset) have placeholder observations, members of the space (zeros where the space holds
    them, else its lowest values).
    Counters: :meth:`fault_stats` (cumulative) and :meth:`replica_stats` (per window). All servers
    must be reachable when the env is made (their spaces and sizes are learned then).

    Example:
        >>> envs = RemoteVectorEnv(["127.0.0.1:50051", "127.0.0.1:50052"])  # doctest: +SKIP
        >>> obs, infos = envs.reset(seed=42)  # env i gets seed 42 + i         # doctest: +SKIP
        >>> obs, rewards, terminations, truncations, infos = envs.step(envs.action_space.sample())  # doctest: +SKIP

    Args:
        addresses: server addresses, a list or one comma-separated string: ``host:port``,
            ``unix:/path``, ``dns:///name:port`` (every address the name resolves to), ``compose:SERVICE``,
            ``swarm:SERVICE`` or ``file:PATH`` (the addresses a file lists); :meth:`refresh` looks them up
            again.
        timeout: seconds each call (reset, step, handshake) may take before it fails with
            :class:`~learner.errors.RemoteTimeoutError` (or, fault-tolerant, before its server
            counts as lost); a step's counted from its send (:meth:`step_async`, :meth:`send`),
            whatever the learner does until it waits for the answer; releasing a session on :meth:`close` waits at most 2 s of it (the
            server ends the session anyway once the connection closes). Like every option in
            seconds, finite. (:meth:`step_wait` may set another for its step.)
        reset_timeout: seconds a reset may take, for envs slower to reset than to step (a level
            to load): resets get this deadline (a reconnect's too), and so do the steps in which
            envs autoreset (next-step: the step after an episode ended; same-step: every step);
            other steps keep ``timeout``'s, so a hung server is still noticed within it. None:
            ``timeout``. (:meth:`reset_wait` may set another for its reset.)
        keepalive_timeout: seconds a server has to answer gRPC's keepalive ping, sent after 10 s without
            one: a server that stopped, or whose host is cut off, is noticed within ~15 s, even while a
            call's longer deadline runs. Its answer waits behind the data the server is sending: where
            one answer takes longer than this to cross the link (big observations on a slow one), raise
            it, or every such call fails as a ping timeout.
        connect_timeout: seconds to wait for every server to accept a connection before failing
            with :class:`~learner.errors.ServerUnavailableError` naming the address (fault-tolerant,
            with some servers answering: starting with those, the others joining at a :meth:`refresh`
            once they answer).
        client_name: how this learner is named in servers' logs and refusals (default host:pid).
        copy: return fresh arrays from reset/step/recv (True) or views of the same buffers each
            time (False, faster; a later call overwrites them), as gymnasium's ``copy`` argument.
        auth_token: token sent with every call, for servers started with ``--auth-token``.
        num_groups: how many groups the servers form for :meth:`send` / :meth:`recv` (contiguous,
            as even as possible; at most one group per server).
        fault_tolerant: keep going when servers fail (see Failures above) instead of raising.
        backoff: first and longest wait between reconnect attempts, in seconds (fault-tolerant); also
            before taking back a flapping server.
        give_up_after: fault-tolerant, once every server has been down this many seconds (a flapping
            one: since it last answered a step), steps and resets raise
            :class:`~learner.errors.ServerUnavailableError` (nothing is left to step).
        tls: False for plaintext; True for TLS verified with the system's CA roots; or the path of
            a PEM file with the CA certificate(s) that signed the servers' certificates.
        tls_server_name: the name the servers' certificates must hold, when it is not the host in
            the address (servers reached by IP or by a name their certificate lacks). Default: the
            host in the address; for servers found by a ``dns:///name:port`` address, ``name`` (as
            gRPC's own dns resolver checks it); for a ``unix:PATH`` address, ``localhost`` (gRPC's
            own default there, the path, is in no certificate). A certificate without that name is
            said within seconds, with the name checked.
        tls_client_cert, tls_client_key: paths of PEM files: a client certificate (chain) and its
            private key, presented to servers that require one (``env-server --tls-client-ca``: mutual
            TLS). Both or neither, and TLS on. A server that ends the connection after the handshake
            (no certificate, or one its CA did not sign) raises :class:`~learner.errors.ServerUnavailableError`
            within seconds, saying so (and that a TLS proxy whose backend is down does the same).
        step_socket: step servers reached at a ``unix:`` address over their step socket, a plain
            Unix socket beside the gRPC one (same messages, no HTTP/2; a few times cheaper per step),
            where they offer one; False: always over gRPC's ``StepStream``.
        spin_wait: seconds to keep looking for a step-socket answer, yielding the CPU between
            looks, before sleeping until it comes; only while that server's recent answers came
            sooner (slow envs are waited for asleep), and only while the learner and each
            step-socket server can have a CPU of their own (servers + 1 <= the CPUs this process may
            use; else a learner awake takes a server's CPU). Waking a sleeping process costs tens of
            microseconds, about a quick env's whole step; 0: always sleep.

    Servers may come and go: :meth:`refresh` looks ``addresses`` up again (a ``compose:`` or
    ``dns:///`` name finds replicas added or removed since) and grows or shrinks the fleet.
    """

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        timeout: float = 30.0,
        reset_timeout: float | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        client_name: str | None = None,
        copy: bool = True,
        auth_token: str | None = None,
        num_groups: int = 1,
        fault_tolerant: bool = False,
        backoff: tuple[float, float] = (0.1, 2.0),
        give_up_after: float = 60.0,
        tls: bool | str | os.PathLike[str] = False,
        tls_server_name: str | None = None,
        tls_client_cert: str | os.PathLike[str] | None = None,
        tls_client_key: str | os.PathLike[str] | None = None,
        step_socket: bool = True,
        spin_wait: float = 0.001,
        keepalive_timeout: float = KEEPALIVE_TIMEOUT,
    ) -> None:
        self._caller_lock, self._caller, self._caller_call = threading.Lock(), None, ""  # (see _one_thread)
        addresses = _addresses(addresses)
        self.timeout = _seconds("timeout", timeout)
        self.keepalive_timeout = _seconds("keepalive_timeout", keepalive_timeout)
        self.reset_timeout = self.timeout if reset_timeout is None else _seconds("reset_timeout", reset_timeout)
        self.connect_timeout = _seconds("connect_timeout", connect_timeout)
        num_groups = _count("num_groups", num_groups)
        self.backoff = _backoff(backoff)
        self.copy = _flag("copy", copy)
        self.fault_tolerant = _flag("fault_tolerant", fault_tolerant)
        self.give_up_after = _seconds("give_up_after", give_up_after)
        self._client_name = escape_surrogates(client_name) if isinstance(client_name, str) else client_name
        self._metadata = bearer_metadata(auth_token) if auth_token else ()
        self._credentials, self._tls_roots = channel_credentials(tls, tls_client_cert, tls_client_key)
        self._client_cert = _client_cert(tls_client_cert, tls_client_key)
        self._tls_server_name = tls_server_name
        self._step_socket = _flag("step_socket", step_socket)
        self._spin_wait = _spin_wait(spin_wait)
        self._init_bookkeeping(addresses, num_groups)

        warn_duplicates(addresses)  # here only: refresh() expands the same addresses between rollouts
        # One connect_timeout for all: replicas still starting (compose:), then connections and handshakes.
        deadline = time.monotonic() + self.connect_timeout
        endpoints = self._first_endpoints(addresses, num_groups)
        self._clients = self._runner.run(lambda: self._connect(endpoints, deadline))
        self._check_specs()
        self._read_spec()
        self._lay_out(num_groups)
        self._share_cpus()
        _LIVE.add(self)
        # (a server's loss right after this process was held up says so: see _mark_lost; until close)
        self._watching_pauses = self.fault_tolerant
        if self._watching_pauses:
            pauses.start()
        log.info(
            "connected to %d env server(s), %d envs of %s%s: %s",
            len(self._clients),
            self.num_envs,
            server_text(self._spec.env_id),
            " (fault-tolerant)" if self.fault_tolerant else "",
            ", ".join(map(label_of, self.addresses)),
        )

    def _init_bookkeeping(self, addresses: str | list[str], num_groups: int) -> None:
        """The state of a fleet not yet connected: no servers, nothing in flight, nothing noted yet."""
        self._state = AsyncState.DEFAULT
        self.closed = False
        self._clients: list[EnvClient] = []
        self._replicas: list[Replica] = []
        # One step in flight per server at most: its task (send, then receive) until taken in.
        self._tasks: list[asyncio.Task[tuple[pb.StepResponse, float]] | SocketStep | None] = []
        # The loop this env's gRPC calls run on (see LoopRunner): they always use the same one.
        self._runner = LoopRunner.for_this_thread()
        # For refresh: the addresses as given, servers still connecting, what was logged once, and
        # whether a failed call left the envs that did answer a step ahead of what the caller saw.
        self._address_spec = addresses
        self._num_groups_asked = num_groups
        self._joining: dict[str, tuple[EnvClient, asyncio.Future[None]]] = {}
        # Servers a refresh found listed and is connecting to: since when, and when a line last said so (0: never).
        self._connecting: dict[str, tuple[float, float]] = {}
        # (refresh: failing look-ups since when, and whether a warning named them; when a warning last said so)
        self._lookup_failed: tuple[float, bool] | None = None
        self._lookup_warned_at = -math.inf
        self._stale: tuple[str, str] | None = None  # (address, what failed) while stale
        self._reset_once = False  # (a step before the first reset is refused: ResetNeededError)
        self._pending_reset: tuple[Any, dict[str, Any] | None] = (None, None)  # (reset_async's seed and options)
        self._aliases: set[str] = set()  # addresses of a server listed under another name too (used once)
        # Stalls warned of (see faults.STALL), by server: when last said, and how many since.
        # (_note_stall: per server, when a line last said a stall, the stalls since, when its stalls began, the last)
        self._stalls: dict[str, tuple[float, int, float, float]] = {}
        # Listed servers out of the fleet that the fleet knows of, until they join or are listed no more: those
        # the fault-tolerant start went on without, and those whose handshake failed or that did not fit (_Away).
        self._away: dict[str, _Away] = {}

    def _first_endpoints(self, addresses: str | list[str], num_groups: int) -> list[str]:
        """The servers' endpoints that ``addresses`` name now (``compose:`` and ``dns:///`` names looked up),
        each a group at the most; the names pinned for refresh."""
        named = expand_named(addresses, self.connect_timeout)
        endpoints = list(named)
        # Servers found by a dns: name: under TLS their certificates are checked against that name.
        self._dns_names = {endpoint: name for endpoint, name in named.items() if name}
        # compose:env -> compose:PROJECT/env: refresh keeps to this fleet if another project runs one too.
        self._address_spec = pin_addresses(addresses)
        if self._address_spec != addresses:
            log.info("addresses %s looked up as %s from now on (this fleet's)", addresses, self._address_spec)
        if num_groups > len(endpoints):
            servers = f"{len(endpoints)} server{'s' if len(endpoints) > 1 else ''}"
            raise InvalidArgumentError(
                f"num_groups: expected at most one group per server ({servers}), got {num_groups}"
            )
        return endpoints

    def _read_spec(self) -> None:
        """The spaces, metadata and gymnasium spec of the envs, from the first server's spec (checked alike)."""
        first = self._clients[0].spec
        assert first is not None
        self._spec = first
        try:
            self.single_observation_space = codec.decode_space(first.observation_space, "observation_space")
            self.single_action_space = codec.decode_space(first.action_space, "action_space")
            autoreset_mode = codec.decode_autoreset_mode(first.autoreset_mode)
        except Exception as err:  # (a server of another version, say)
            self._close_clients()
            address = self._clients[0].address
            raise InvalidResponseError(
                f"env server {label_of(address)}: Handshake: its spec could not be read ({type(err).__name__}: {err})",
                address=address,
            ) from err
        self.num_envs = sum(c.num_envs for c in self._clients)
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.metadata = {
            "autoreset_mode": autoreset_mode,
            "render_modes": list(first.render_modes),
        }
        if first.HasField("render_fps"):
            fps = first.render_fps  # (a float on the wire; gymnasium's envs mostly give an int)
            self.metadata["render_fps"] = int(fps) if fps.is_integer() else fps
        self.spec = gym_env_spec(first)

    def _lay_out(self, num_groups: int) -> None:
        """Everything sized by the servers or their envs: buffers, steps in flight, groups, timers, replicas."""
        # Until a server's envs are reset, their observations are placeholders (in the space).
        self._obs_buffer = placeholder_batch(self.single_observation_space, self.num_envs)
        self._ended = self._no_ended_envs()
        # Next-step autoreset: the envs whose episode ended at their last step, and so reset at their
        # next one (its deadline then: reset_timeout); None: not known (after a reset or a new layout).
        self._resets_pending: np.ndarray | None = None
        self._tasks = [None] * len(self._clients)
        # Each server's step in flight: when its deadline passes (time.monotonic()), and the timeout it
        # was sent with; set as it is sent, so that a step's timeout counts from its send (pipelining:
        # whatever the learner does with the other groups meanwhile).
        self._due: list[tuple[float, float]] = [(math.inf, self.timeout)] * len(self._clients)
        self._timeout_hint = TIMEOUT_HINT  # (what a step's timeout error advises: step_wait's own timeout sets it)
        self._groups = split_groups(len(self._clients), min(num_groups, len(self._clients)))
        self._in_flight = [False] * len(self._groups)  # send(g) done, recv(g) not yet
        self._sent_at = [0.0] * len(self._groups)  # when each group was last sent (time.monotonic())
        self._timers = [StepTimer(c.address, c.num_envs) for c in self._clients]
        # The timers of servers that left the fleet in this window, by address, with their server_id
        # (replica_stats() gives them once; one back at its address in the window takes its timer back).
        self._departed: dict[str, tuple[StepTimer, str]] = {}
        # Fault tolerance: each server's state, and the counters of fault_stats().
        self._replicas = [self._replica(c) for c in self._clients]
        self._rejoined = asyncio.Event()
        self._env_steps_lost = 0
        self._env_error_steps = 0
        self._retired = _Retired()  # counts of servers that left the fleet (refresh)

    def _share_cpus(self) -> None:
        """Wait for step-socket answers awake (``spin_wait``) only while the learner and every
        step-socket server (all on this host) can each have a CPU: otherwise a learner looking for
        answers takes the CPU a server needs to produce them."""
        # A server with async vectorization steps its envs in a process each.
        local = sum(
            (c.num_envs if c.spec is not None and c.spec.vectorization == "async" else 1)
            for c in self._clients
            if c.step_socket
        )
        spin_wait = self._spin_wait if local + 1 <= usable_cpus() else 0.0
        for client in self._clients:
            client.spin_wait = spin_wait

    # -- connecting: the servers' clients (connections and handshakes: learner.connecting) -------

    def _client(self, address: str) -> EnvClient:
        return EnvClient(
            address,
            timeout=self.timeout,
            reset_timeout=self.reset_timeout,
            client_name=self._client_name,
            metadata=self._metadata,
            credentials=self._credentials,
            tls_server_name=self._server_name(address),
            step_socket=self._step_socket,
            spin_wait=self._spin_wait,
            keepalive_timeout=self.keepalive_timeout,
        )

    def _server_name(self, address: str) -> str | None:
        """The name ``address``'s certificate must hold, where it is not the address's host: the
        ``tls_server_name`` given, else (under TLS) the name of the ``dns:`` address it was found by
        (as gRPC's own dns resolver checks it; the connection is to an IP address). For a ``unix:``
        address None: the client and the TLS probe name ``localhost`` there themselves
        (:data:`~learner.discovery.UNIX_SERVER_NAME`)."""
        if self._tls_server_name or self._credentials is None:
            return self._tls_server_name
        return self._dns_names.get(address)

    @staticmethod
    def _replica(client: EnvClient) -> Replica:
        assert client.spec is not None
        return Replica(client=client, spec=client.spec, sessions=[client.session_id])

    @property
    def addresses(self) -> list[str]:
        """The servers' addresses, in env order."""
        return [c.address for c in self._clients]

    @property
    def autoreset_mode(self) -> gym.vector.AutoresetMode:
        """The servers' autoreset mode (``--autoreset-mode``), as gymnasium's vector envs have it
        (also in ``metadata["autoreset_mode"]``, which gymnasium's wrappers read)."""
        mode: gym.vector.AutoresetMode = self.metadata["autoreset_mode"]
        return mode

    @property
    def vectorizations(self) -> list[str]:
        """Each server's ``--vectorization`` (sync, async or vector_entry_point), in env order. A
        vector_entry_point server steps the env's own vectorized implementation, which may reset all
        its envs when a ``reset_mask`` asks for some."""
        return [c.spec.vectorization if c.spec is not None else "" for c in self._clients]

    @property
    def server_versions(self) -> dict[str, dict[str, str]]:
        """What each server runs (envfleet, python, gymnasium, numpy, its simulators), by address; empty
        for servers too old to say. ``learner train`` records it in config.json."""
        return {c.address: dict(c.spec.versions) if c.spec is not None else {} for c in self._clients}

    @property
    def wrappers(self) -> tuple[str, ...]:
        """The env-server wrappers (``--wrappers``) the first server applies to its envs (the rest fit its
        spaces); empty for none."""
        spec = self._clients[0].spec
        assert spec is not None
        return tuple(spec.wrappers)

    @property
    def env_kwargs(self) -> dict[str, Any] | None:
        """The kwargs the first server's envs are made with (its ``--env-kwargs`` and what it adds for
        its wrappers; the rest are warned of if theirs differ); None from a server too old to say."""
        spec = self._clients[0].spec
        assert spec is not None
        return served_kwargs(spec)

    @property
    def env_id(self) -> str:
        """The env the servers host, as their operator named it (``--env``)."""
        spec = self._clients[0].spec
        assert spec is not None
        return str(spec.env_id)

    @property
    def env_slices(self) -> list[slice]:
        """For each server, the slice of the fleet's envs it hosts."""
        return [slice(c.env_offset, c.env_offset + c.num_envs) for c in self._clients]

    @property
    def num_groups(self) -> int:
        """How many groups :meth:`send` and :meth:`recv` step separately."""
        return len(self._groups)

    @property
    def group_slices(self) -> list[slice]:
        """For each group, the slice of the fleet's envs it holds."""
        return [self._group_slice(g) for g in range(len(self._groups))]

    def _group_slice(self, group: int) -> slice:
        servers = self._groups[group]
        first, last = self._clients[servers[0]], self._clients[servers[-1]]
        return slice(first.env_offset, last.env_offset + last.num_envs)

    @property
    def available(self) -> np.ndarray:
        """Bool per env: whether its server is up now (always all True unless ``fault_tolerant``)."""
        out = np.ones(self.num_envs, dtype=np.bool_)
        for replica, sl in zip(self._replicas, self.env_slices, strict=True):
            if replica.state is not ReplicaState.UP:
                out[sl] = False
        return out

    # -- the VectorEnv API --------------------------------------------------------------------------

    @_one_thread
    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset every env (or those in ``options["reset_mask"]``); env i gets seed ``seed + i``.

        Fault-tolerant, the envs of servers that are down are not reset: they are reported in
        ``infos["env_unavailable"]`` and rejoin (with new, unseeded episodes) once their server is back.
        With ``options["reset_mask"]`` taking some of a server's envs: if it is lost in this reset, all
        its envs are reported so, and the episodes under way in the others end, truncated, on the next
        step; if it is back (its reconnect reset its envs), the others hand over their new episodes
        here, reported in ``infos["env_rejoined"]`` (and ``env_unavailable``) as on the step a server
        rejoins. Unavailable envs of a reset do not count in ``fault_stats().env_steps_lost``.
        """
        self._assert_idle("reset")
        return self._reset(seed, options)

    @_one_thread
    def _reset_unset_options(
        self, mask: np.ndarray, *, seed: Sequence[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """``reset(seed=seed, options={**options, "reset_mask": mask})``, except that with no ``options``
        (None or empty) the requests carry none, and the envs' ``reset`` gets ``options=None``, not the
        ``{}`` that gymnasium's vector envs leave of ``{"reset_mask": mask}`` (which :meth:`reset` keeps).
        For ``learner.sb3``, whose twin ``DummyVecEnv`` resets envs with no options."""
        self._assert_idle("reset")
        return self._reset(seed, {**(options or {}), "reset_mask": mask}, unset_if_empty=True)

    def _reset_mask(self, options: Mapping[str, Any] | None) -> np.ndarray | None:
        """``options["reset_mask"]``, checked as gymnasium's vector envs check it (a numpy array: a list is refused,
        as there, before anything is reset), or None."""
        mask = options.get("reset_mask") if options is not None else None
        if mask is None:
            return None
        if not isinstance(mask, np.ndarray) or mask.dtype != np.bool_:  # (TypeErrors there, as here)
            got = f"{mask.dtype} array" if isinstance(mask, np.ndarray) else type(mask).__name__
            expected = f"options['reset_mask']: expected a numpy bool array of shape ({self.num_envs},)"
            raise InvalidArgumentTypeError(f"{expected}, got {got} {mask!r}"[:300])
        if mask.shape != (self.num_envs,):
            raise InvalidArgumentError(
                f"options['reset_mask']: expected a bool array of shape ({self.num_envs},), got shape {mask.shape}"
            )
        if not mask.any():
            raise InvalidArgumentError("options['reset_mask']: expected at least one True value, got none")
        return mask

    def _needs_full_reset(self) -> bool:
        """Whether a reset of some envs alone (``reset_mask``) would not make the fleet steppable: before
        the first reset, after a failed step or reset (the envs that answered moved on unseen, and a
        partial reset leaves that as it was; their servers refuse a mask until a full reset), or, not
        fault-tolerant, with a server whose session ended (a new one starts all its envs over)."""
        if not self._reset_once or self._stale is not None:
            return True
        return not self.fault_tolerant and any(c.session_ended for c in self._clients)

    @_one_thread
    def reset_async(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        """``AsyncVectorEnv.reset_async``'s twin, for code written for it: :meth:`reset_wait` resets.

        The servers reset their envs in :meth:`reset_wait` (a reset is rare next to steps: it is not
        overlapped with the caller's work); the arguments are :meth:`reset`'s, checked here."""
        self._assert_idle("reset_async")
        if isinstance(seed, Iterable) and not isinstance(seed, str | bytes):
            seed = list(seed)  # (an iterator is read once: by the check below, and kept for reset_wait)
        self._seeds(seed)
        if options is not None and not isinstance(options, Mapping):
            raise InvalidArgumentError(f"options: expected a dict (or None), got {type(options).__name__} {options!r}")
        self._reset_mask(options)
        self._pending_reset = (seed, dict(options) if options is not None else None)
        _pop_mask(options)
        self._state = AsyncState.WAITING_RESET

    @_one_thread
    def reset_wait(self, timeout: float | None = None) -> tuple[Any, dict[str, Any]]:
        """Reset as :meth:`reset_async` asked: what :meth:`reset` returns. ``timeout``: each server's
        reset has this many seconds (None: ``reset_timeout``), as ``AsyncVectorEnv.reset_wait``'s."""
        timeout = self._end_wait(AsyncState.WAITING_RESET, timeout)
        seed, options = self._pending_reset
        self._pending_reset = (None, None)
        return self._reset(seed, options, timeout)

    def _reset(
        self,
        seed: int | Sequence[int | None] | None,
        options: dict[str, Any] | None,
        timeout: float | None = None,
        *,
        unset_if_empty: bool = False,
    ) -> tuple[Any, dict[str, Any]]:
        """:meth:`reset`'s work; ``timeout``: each server's Reset deadline (None: ``reset_timeout``);
        ``unset_if_empty``: options left empty once ``reset_mask`` is taken out are not sent (the envs
        get None), see :meth:`_reset_unset_options`."""
        seeds = self._seeds(seed)
        # An int also seeds the vector env's own generator, as gymnasium's VectorEnv.reset does.
        if isinstance(seed, int | np.integer):
            self._np_random, self._np_random_seed = seeding.np_random(int(seed))
        if options is not None and not isinstance(options, Mapping):
            raise InvalidArgumentError(f"options: expected a dict (or None), got {type(options).__name__} {options!r}")
        given = options is not None
        mask = self._reset_mask(options)
        caller, options = options, dict(options) if options is not None else {}
        options.pop("reset_mask", None)
        try:
            # (options={} reaches the envs as {}, as on a local vector env: an env may read options.get(...));
            # so does {"reset_mask": mask}, whose mask gymnasium's vector envs pop, on servers reset whole too
            # (unless unset_if_empty: no options sent, so the envs get None, as SB3's DummyVecEnv gives)
            send = bool(options) if unset_if_empty else bool(options) or given
            encoded_options = codec.encode_value(options, pb.Value(), "options") if send else None
        except codec.CodecError as err:  # (it names the option: "options['x']: ...")
            raise InvalidArgumentError(str(err)) from err
        _pop_mask(caller)
        full = mask is None or bool(np.all(mask))
        self._forget_truncations(mask)
        if not self.fault_tolerant:
            ended = [c for c in self._clients if c.session_ended and self._resets_all_of(c, mask, "reset")]
            if ended:
                # (all settled before the first error is raised: none left half done on the loop)
                renewed = self._runner.run(
                    lambda: gather(*(self._renew_session(c) for c in ended), return_exceptions=True)
                )
                self._share_cpus()
                raise_first([r for r in renewed if isinstance(r, BaseException)])

        if self.fault_tolerant:  # (servers found broken since the last reset, if it takes any of their envs)
            self._retry_broken([i for i, sl in enumerate(self.env_slices) if mask is None or mask[sl].any()])
        calls = []  # (requests all made, and sized, before any is sent: one over a limit leaves nothing reset)
        for i, (client, sl) in enumerate(zip(self._clients, self.env_slices, strict=True)):
            if self._replicas[i].state is ReplicaState.DOWN:
                continue
            sub_mask = None if mask is None or mask[sl].all() else mask[sl]  # (all of a server's: its full reset)
            if sub_mask is not None and not sub_mask.any():
                continue
            sub_seeds = None if seeds is None else seeds[sl]
            request = client.reset_request(sub_seeds, encoded_options, None if sub_mask is None else sub_mask.tolist())
            calls.append((i, request))
        if self.fault_tolerant and not calls:
            self._check_anything_left()
        slices = self.env_slices
        # Servers reset in part whose other envs have episodes under way (UP: a READY server's were cut
        # when it was lost, and the caller saw that): if one is lost in this reset, those episodes end,
        # truncated, on the next step, as a loss a step notices ends them; the envs reset had none.
        # (Other envs of a READY server reset in part rejoin: its reconnect started them over.)
        rest = {i: ~mask[slices[i]] for i, _ in calls if mask is not None and not mask[slices[i]].all()}
        under_way = {i: envs for i, envs in rest.items() if self._replicas[i].state is ReplicaState.UP}
        hint = RESET_WAIT_TIMEOUT_HINT if timeout is not None else None  # (only reset_wait gives one)
        results = self._runner.run(
            lambda: gather(
                *(self._clients[i].send_reset(request, timeout, hint) for i, request in calls), return_exceptions=True
            )
        )
        errors: list[tuple[int, BaseException]] = []
        lost: list[tuple[int, BaseException]] = []
        answers: dict[int, tuple[Any, dict[str, Any]]] = {}  # server -> its observations and infos
        for (i, _), result in zip(calls, results, strict=True):
            if not isinstance(result, BaseException):
                try:
                    answers[i] = self._read_reset(self._clients[i], result)
                    continue
                except InvalidResponseError as unreadable:
                    result = unreadable
            if self.fault_tolerant and _is_outage(result):
                lost.append((i, result))
            else:
                errors.append((i, result))
        broken = self._lose_all(lost, truncate=under_way)  # (no episode was under way in the envs reset)
        self._raise_first(in_server_order(broken, errors))
        parts = []
        rejoined = np.zeros(self.num_envs, dtype=np.bool_)
        for i in answers:
            replica, client = self._replicas[i], self._clients[i]
            if replica.state is ReplicaState.READY and i in rest:
                # Its envs not reset now hand over the new episodes its reconnect started (the server's
                # answer holds their observations): as on the step a server rejoins.
                rejoined[slices[i]] = rest[i]
            replica.state, replica.fresh = ReplicaState.UP, None  # a READY server's own reset is superseded
            parts.append((answers[i][1], client.env_offset, client.num_envs))
        infos, misfits = self._merge_infos(parts, self.num_envs, 0, "Reset")
        broken = []
        for i, misfit in misfits:  # (fault-tolerant: lost, as if its reset had failed)
            del answers[i]
            rejoined[slices[i]] = False
            broken += self._lose(i, misfit, truncate=under_way.get(i, False))
        self._raise_first(in_server_order(broken))
        # A partial reset (options["reset_mask"]) leaves the other envs as stale as they were.
        if full:
            self._stale = None
        self._reset_once = True
        started = rejoined if mask is None else mask | rejoined  # the envs whose episodes start now
        if self._ended is not None:
            self._ended[slice(None) if mask is None else started] = False
        if self._resets_pending is not None and len(self._resets_pending) == self.num_envs:
            self._resets_pending[slice(None) if mask is None else started] = False  # (reset: no autoreset due)
        for i, (obs, _) in answers.items():
            write_batch(self._obs_buffer, obs, self._clients[i].env_offset)
        unavailable = ~self.available
        if mask is not None:
            # The envs reset, and every env of a server lost in this reset (news to the caller); the
            # others of servers down since before stay as their last step flagged them.
            news = mask.copy()
            for i, _ in [*lost, *misfits]:
                news[slices[i]] = True
            unavailable &= news
        unavailable |= rejoined
        self._flag_unavailable(infos, unavailable, steps=False)
        if rejoined.any():
            infos["env_rejoined"], infos["_env_rejoined"] = rejoined, rejoined.copy()
        self._raise_env_errors(infos, 0)
        return self._observations(self._obs_buffer), infos

    def _resets_all_of(self, client: EnvClient, mask: np.ndarray | None, method: str) -> bool:
        """Whether a reset with ``mask`` resets every env of ``client``'s server, whose session ended:
        a new session starts them all over, so a mask that takes some of them only is refused (before
        anything is sent); False if it takes none."""
        if mask is None:
            return True
        sub = mask[client.env_offset : client.env_offset + client.num_envs]
        if sub.all() or not sub.any():
            return bool(sub.all())
        last = client.env_offset + client.num_envs - 1
        raise SessionError(
            f"{method}: env server {label_of(client.address)}'s session ended (it restarted or the connection dropped), "
            f"so its envs {client.env_offset}-{last} all start over with a new one: take them all in "
            "options['reset_mask'], or call reset() without a mask; nothing was reset",
            address=client.address,
            code=grpc.StatusCode.FAILED_PRECONDITION,
        )

    async def _renew_session(self, client: EnvClient) -> None:
        """A new session on ``client``'s server, whose old one ended (the server restarted, or its
        connection dropped), for a full reset (which starts every episode over anyway) of a plain
        RemoteVectorEnv; a fault-tolerant one reconnects by itself. A server that came back with
        other envs is a SpecMismatchError: refresh() takes the fleet as it is now."""
        gone = socket_folder_gone(client.address)
        if gone is not None:  # (no server can come there: no use waiting for one)
            raise ServerUnavailableError(
                f"env server {label_of(client.address)}: its session ended, and {gone}", address=client.address
            )
        try:
            await asyncio.wait_for(client.wait_ready(), self.connect_timeout)
        except TimeoutError:
            raise ServerUnavailableError(
                f"env server {label_of(client.address)}: its session ended and it did not answer within "
                f"{self.connect_timeout:g} s (`connect_timeout`); is it running?",
                address=client.address,
            ) from None
        old = client.spec
        assert old is not None
        spec = await client.get_spec()
        problem = incompatible(old, spec, same_size=True)
        if problem:
            raise SpecMismatchError(
                f"env server {label_of(client.address)}: it came back with {problem}; refresh() takes the fleet as it is now",
                address=client.address,
            )
        warn_if_other_env(old, spec, label_of(client.address), "its old")
        if spec.server_id == old.server_id:  # the same process (a dropped connection): free the old claim
            await client.release_session(client.session_id, self.timeout)
        # (the session it continues, released just now or lost: a --fresh-envs server keeps its envs' state)
        client.rejoins_session_id = client.session_id if spec.server_id == old.server_id else ""
        # The old session is dropped only once a new one is had: a failed handshake (another learner
        # took the server, it is building or draining) leaves it ended, for the next reset to try again.
        # Given up (a Ctrl-C cancels the reset) while the Handshake is in flight: its answer is read, and the
        # session it granted released (the client's close releases the old one only), as the start's are.
        deadline = time.monotonic() + self.connect_timeout
        response = await released_if_given_up(lambda calls: self._handshake(client, deadline, calls))
        client.abandon()
        client.start_session(response)
        restarted = "restarted" if spec.server_id != old.server_id else "same process"
        log.info(
            "env server %s: its session had ended (%s); a new one for this reset", label_of(client.address), restarted
        )

    def _seeds(self, seed: int | Sequence[int | None] | None) -> list[int | None] | None:
        if seed is None:
            return None
        if isinstance(seed, int | np.integer):
            seed = int(seed)
            if not 0 <= seed <= 2**64 - self.num_envs:
                raise InvalidArgumentError(
                    f"seed: expected an int in [0, 2**64 - {self.num_envs}] (env i gets seed + i, a 64-bit seed on the "
                    f"wire), got {seed}"
                )
            return [seed + i for i in range(self.num_envs)]
        if isinstance(seed, str | bytes) or not isinstance(seed, Iterable):
            raise InvalidArgumentError(f"seed: expected an int or {self.num_envs} seeds (one per env), got {seed!r}")
        seeds = list(seed)
        if len(seeds) != self.num_envs:
            raise InvalidArgumentError(
                f"seed: expected an int or {self.num_envs} seeds (one per env), got {len(seeds)} seeds"
            )
        for i, s in enumerate(seeds):
            if s is not None and not (isinstance(s, int | np.integer) and 0 <= s < 2**64):
                raise InvalidArgumentError(f"seed[{i}]: expected None or an int in [0, 2**64), got {s!r}")
        return [None if s is None else int(s) for s in seeds]

    @_one_thread
    def step(self, actions: Any) -> StepResult:
        """Step every env with its action and wait for all the servers' results."""
        self._assert_may_step_all("step")
        actions = self._as_batch(actions, self.num_envs, "actions")
        servers = range(len(self._clients))
        self._start(servers, actions, 0)
        return self._finish(servers)

    @_one_thread
    def step_async(self, actions: Any) -> None:
        """Send each server its envs' actions, without waiting for the results."""
        self._assert_may_step_all("step_async")
        actions = self._as_batch(actions, self.num_envs, "actions")
        self._start(range(len(self._clients)), actions, 0)
        self._state = AsyncState.WAITING_STEP
        self._spin_if_needed()

    @_one_thread
    def step_wait(self, timeout: float | None = None) -> StepResult:
        """Wait for every server's step results and join them into one batch.

        ``timeout``: wait this many seconds from now, as ``AsyncVectorEnv.step_wait``'s (a server that
        has not answered by then is a :class:`RemoteTimeoutError`, and the fleet needs a ``reset()``, as
        after any failed step; answers get a last look of up to 0.25 s, so a shorter timeout waits that
        long); None (the default): the step's own deadline, this env's ``timeout`` (``reset_timeout``
        where an env may reset in it) from the step's send."""
        timeout = self._end_wait(AsyncState.WAITING_STEP, timeout)
        if timeout is None:
            return self._finish(range(len(self._clients)))
        due = (time.monotonic() + timeout, timeout)
        for i, task in enumerate(self._tasks):
            if task is not None:
                self._due[i] = due
                if isinstance(task, SocketStep):  # (for its timeout's message)
                    task.timeout, task.hint = timeout, STEP_WAIT_TIMEOUT_HINT
        self._timeout_hint = STEP_WAIT_TIMEOUT_HINT
        try:
            return self._finish(range(len(self._clients)))
        finally:
            self._timeout_hint = TIMEOUT_HINT

    # -- pipelining -------------------------------------------------------------------------------

    @_one_thread
    def step_groups(self, act: Callable[[slice], Any]) -> StepResult:
        """One step of every env, computed and sent group by group; returns what :meth:`step` returns.

        ``act(group_slice)`` returns the actions of the envs in ``group_slice`` (a batch over them). Each
        group is sent its actions as soon as ``act`` returns them, so it steps while ``act`` computes the
        actions of the groups after it (a policy's forward pass, say). Then all results are joined, as
        one fleet-wide step. With one group this is ``step(act(slice(0, num_envs)))``.
        """
        self._assert_may_step_all("step_groups")
        started: list[int] = []
        try:
            for g, servers in enumerate(self._groups):
                sl = self._group_slice(g)
                failed = "act raised"
                group_actions = act(sl)
                failed = f"group {g}'s actions were refused"
                actions = self._as_batch(group_actions, sl.stop - sl.start, f"actions (group {g})", sl.start)
                self._notice_answers()  # (of the groups sent before: their answers may be in)
                self._start(servers, actions, sl.start)
                started += servers
                if g + 1 < len(self._groups):
                    self._spin_if_needed()
        except BaseException as err:
            if started:  # the groups already sent finish their step; their results are dropped
                with contextlib.suppress(Exception):
                    self._finish(started)
                address = getattr(err, "address", None) or self._clients[started[0]].address
                self._went_stale(address, f"{failed}: {type(err).__name__}: {err}")
            raise
        return self._finish(range(len(self._clients)))

    @_one_thread
    def send(self, actions: Any, group: int) -> None:
        """Send group ``group``'s envs their actions (a batch over ``group_slices[group]``) and return at once.

        Take the results in with :meth:`recv`; meanwhile, other groups may be sent to or received from.
        """
        self._assert_open()
        self._check_group(group, "send")
        self._assert_in_step("send")
        if self._state is not AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"send: a call to `{self._state.value}` is still pending; call {self._state.value}_wait first",
                self._state.value,
            )
        if self._in_flight[group]:
            raise AlreadyPendingCallError(
                f"send: group {group} already has a step in flight; call recv({group}) first", "send"
            )
        servers = self._groups[group]
        sl = self._group_slice(group)
        self._assert_none_ended("send", sl)
        actions = self._as_batch(actions, sl.stop - sl.start, f"actions (group {group})", sl.start)
        self._notice_answers()
        self._start(servers, actions, sl.start)
        self._in_flight[group] = True
        self._sent_at[group] = time.monotonic()
        self._spin_if_needed()

    @_one_thread
    def recv(self, group: int | None = None) -> tuple[int, Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Wait for a group's step results: ``(group, observations, rewards, terminations, truncations, infos)``.

        ``group=None`` takes whichever group in flight finishes first (of those done, the one sent
        first); an int waits for that group. A group whose step is not answered within its deadline
        (``timeout``, counted from its :meth:`send`) comes first, whatever the other groups do, and
        its late servers fail (fault-tolerant: count as lost). A group whose servers are all down
        counts as done once another group in flight is (at once when none is).
        The arrays cover the group's envs only (``group_slices[group]``), infos likewise.
        """
        self._assert_open()
        waiting_since = time.monotonic()
        self._notice_answers()
        in_flight = [g for g in range(len(self._groups)) if self._in_flight[g]]
        if group is None:
            if not in_flight:
                raise NoAsyncCallError("recv: no group has a step in flight; call send first", "recv")
            group = self._first_group_done(in_flight)
        else:
            self._check_group(group, "recv")
            if group not in in_flight:
                raise NoAsyncCallError(
                    f"recv: group {group} has no step in flight; call send(actions, {group})", "recv"
                )
        self._in_flight[group] = False
        return (group, *self._finish(self._groups[group], waiting_since))

    def _first_group_done(self, groups: list[int]) -> int:
        """The group in flight for :meth:`recv` to take in (of ``groups``, all in flight).

        A group whose step's deadline (counted from its send) passed unanswered comes first: its
        timeout is reported whatever the other groups do (a group always answering first must not
        hide a hung one). Otherwise, of the groups done, the one sent first; a group whose servers
        are all down (or back, READY: nothing was sent) counts as done once a group with steps in
        flight is (as its servers would wait for the others' in :meth:`step`), or at once when none
        has: it neither holds the others up nor is taken in over and over while they step."""
        stepping = {g: tasks for g in groups if (tasks := self._group_tasks(g))}
        due = {g: max(self._due[i][0] for i in self._groups[g] if self._tasks[i] is not None) for g in stepping}
        sockets = [t for tasks in stepping.values() for t in tasks if isinstance(t, SocketStep)]
        for step in sockets:
            step.receive()
            step.timed = True  # (see SocketStep.wait)
        # Awake while every step-socket server in flight answers quickly (see SocketStep.wait).
        spin_until = min((t.spin_until() for t in sockets), default=0.0)
        while True:
            now = time.monotonic()
            pending = [g for g, tasks in stepping.items() if not all(t.done() for t in tasks)]
            late = [g for g in pending if due[g] <= now]
            if late:  # _finish reports the late servers (after a last look for answers)
                return min(late, key=due.__getitem__)
            if len(pending) < len(stepping) or not stepping:
                return min((g for g in groups if g not in pending), key=self._sent_at.__getitem__)
            remaining = min(due[g] for g in pending) - now
            waiting = [t for g in pending for t in stepping[g] if not t.done()]
            sockets = [t for t in waiting if isinstance(t, SocketStep)]
            on_loop = [t for t in waiting if not isinstance(t, SocketStep)]
            if not on_loop and now < spin_until:
                for step in sockets:
                    step.receive()
                os.sched_yield()
                continue
            if on_loop:
                # Steps over gRPC need the loop to run; beside step-socket steps, it runs a
                # millisecond at a time between looks at the sockets.
                wait = remaining if not sockets else min(remaining, 0.001)
                self._runner.run(
                    functools.partial(asyncio.wait, on_loop, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                )
            if sockets:
                poller = select.poll()  # (not select.select: it fails on file descriptors >= 1024)
                by_fd = {step.fileno(): step for step in sockets}
                for fd in by_fd:
                    poller.register(fd, select.POLLIN)
                for fd, _ in poller.poll(0 if on_loop else max(1, math.ceil(remaining * 1000))):
                    by_fd[fd].receive()

    def _spin_if_needed(self) -> None:
        """Let steps just started over gRPC hand their messages to gRPC (step-socket steps are sent already).

        A step on a new stream (a session's first; after a reconnect or a failed stream) is handed
        over once the stream is open, a few turns of the loop later: wait for that here (at most
        ``timeout``), and count its deadline from then, or a learner busy until past the deadline
        (step_async, then a long update) would find a healthy server's step never sent, and late."""
        started = [
            i for i, t in enumerate(self._tasks) if t is not None and not isinstance(t, SocketStep) and not t.done()
        ]
        if not started:
            return
        self._runner.spin()
        opening = [i for i in started if self._clients[i].writing]
        if not opening:
            return
        self._runner.run(lambda: _until_written([self._clients[i] for i in opening], self.timeout))
        now = time.monotonic()
        for i in opening:
            self._due[i] = (now + self._due[i][1], self._due[i][1])

    def _background_work(self) -> bool:
        """Whether tasks on the loop wait to go on: reconnects, servers joining."""
        return bool(self._joining) or any(
            r.reconnect_task is not None and not r.reconnect_task.done() for r in self._replicas
        )

    def _group_tasks(self, group: int) -> list[asyncio.Task[tuple[pb.StepResponse, float]] | SocketStep]:
        """The steps in flight of a group's servers (none for servers that are down)."""
        return [t for i in self._groups[group] if (t := self._tasks[i]) is not None]

    def _check_group(self, group: Any, method: str) -> None:
        if (
            isinstance(group, bool | np.bool_)
            or not isinstance(group, int | np.integer)
            or not 0 <= group < len(self._groups)
        ):
            raise InvalidArgumentError(f"{method}: group must be an int in [0, {len(self._groups)}), got {group!r}")

    # -- stepping, shared by step/step_async/step_wait and send/recv ------------------------------

    def _start(self, servers: Sequence[int], actions: Any, base: int) -> None:
        """Create one task per server that is up: it sends its slice of ``actions`` (a batch starting at env ``base``)."""
        # (any server's, not just this group's: raised at the first send, before any group is sent; only a
        # fault-tolerant fleet reconnects, and so finds them)
        misfits = (
            [(i, err) for i, replica in enumerate(self._replicas) if (err := replica.misfit) is not None]
            if self.fault_tolerant
            else []
        )
        if misfits:  # (found by their reconnects since: nothing is sent)
            for i, _ in misfits:
                self._replicas[i].misfit = None
            self._raise_first(in_server_order(misfits))
        requests = []
        sending = []
        for i in servers:  # all encoded before any is sent: a bad action leaves nothing in flight
            if self._replicas[i].state is not ReplicaState.UP:
                continue
            client = self._clients[i]
            start = client.env_offset - base
            request = client.step_request()
            try:
                codec.encode_value(slice_batch(actions, start, start + client.num_envs), request.actions, "actions")
            except codec.CodecError as err:  # (checked already as the servers check them: rare)
                raise InvalidArgumentError(str(err)) from err
            client.check_request_size(request.ByteSize(), "Step")  # (over a server's limit: none is sent)
            requests.append(request)
            sending.append(i)
        # The deadline counts from the send: recv() may take other groups in first, for a while.
        timeout = self._step_timeout(base, sum(self._clients[i].num_envs for i in servers))
        due = (time.monotonic() + timeout, timeout)
        try:
            for i, request in zip(sending, requests, strict=True):
                client = self._clients[i]
                sent = client.send_on_socket(request) or self._runner.create_task(
                    functools.partial(_exchange, client, request, time.perf_counter())
                )
                if isinstance(sent, SocketStep):  # (for its timeout's message: longer where envs reset)
                    sent.timeout, sent.hint = timeout, self._step_hint(timeout)
                self._tasks[i], self._due[i] = sent, due
        except BaseException as interrupt:  # Ctrl-C while a frame was going out, say: a frame may be cut short
            tasks = {i: task for i in sending if (task := self._tasks[i]) is not None}
            for i in sending:
                self._tasks[i] = None
                self._clients[i].close_step_socket()
            self._abandon(tasks, interrupt, self._clients[sending[0]].address)
            raise

    def _no_ended_envs(self) -> np.ndarray | None:
        """A fresh record of the envs that ended and wait for a reset: all False, under autoreset
        Disabled; None under the other modes (which reset ended envs themselves)."""
        disabled = self.metadata["autoreset_mode"] is gym.vector.AutoresetMode.DISABLED
        return np.zeros(self.num_envs, dtype=np.bool_) if disabled else None

    def _assert_may_step_all(self, method: str) -> None:
        """What :meth:`step`, :meth:`step_async` and :meth:`step_groups` check before sending any env an action,
        in this order: no call pending nor group in flight (``_assert_idle``), no stale observations from a step
        that failed part way (:meth:`_assert_in_step`), and, under autoreset Disabled, no env that ended and was
        not reset (:meth:`_assert_none_ended`, over all the envs). (Each of the three made the three calls
        itself; :meth:`send`, for one group, checks its own way.)"""
        self._assert_idle(method)
        self._assert_in_step(method)
        self._assert_none_ended(method, slice(0, self.num_envs))

    def _assert_none_ended(self, method: str, envs: slice) -> None:
        """Under autoreset Disabled, refuse to step envs that ended and were not reset since, before
        anything is sent (the servers would refuse them; gymnasium's vector envs assert)."""
        if self._ended is None or not self._ended[envs].any():
            return
        ended = np.flatnonzero(self._ended[envs]) + (envs.start or 0)
        many = len(ended) > 1
        raise SessionError(
            f"{method}: autoreset is Disabled and env{'s' if many else ''} {', '.join(map(str, ended))} ended at "
            f"{'their' if many else 'its'} last step: reset {'them' if many else 'it'} first (reset(options="
            "{'reset_mask': mask}) for those envs, or a full reset); nothing was sent",
            address=self._client_of(int(ended[0])).address,
            code=grpc.StatusCode.FAILED_PRECONDITION,
            env_index=int(ended[0]),
        )

    def _finish(self, servers: Sequence[int], waiting_since: float | None = None) -> StepResult:
        """Wait for the servers' tasks and join their results (a batch over their envs, in order).
        ``waiting_since``: when the caller began to wait for them (``time.monotonic()``; None: now)."""
        waiting_since = time.monotonic() if waiting_since is None else waiting_since
        tasks = {i: t for i in servers if (t := self._tasks[i]) is not None}
        for i in servers:
            self._tasks[i] = None
        steps = [self._timers[i].steps for i in servers]
        try:
            result = self._collect(servers, tasks)
        except Exception:  # (a failed step: the fleet is marked stale where it failed)
            raise
        except BaseException as interrupt:  # Ctrl-C (KeyboardInterrupt), a signal handler's exit, ...
            self._abandon(tasks, interrupt, self._clients[servers[0]].address)
            raise
        waited = time.monotonic() - waiting_since
        if waited >= faults.STALL[0]:
            answered = [
                self._timers[i] for i, before in zip(servers, steps, strict=True) if self._timers[i].steps > before
            ]
            # (A server lost in the step, at its deadline or at once, is said as such; of those that
            # answered, each answer's round trip ends as it arrived, step sockets' beside gRPC steps
            # too: see _reading. So a stall is its own server's, whatever else the step met.)
            if answered:
                self._note_stall(max(answered, key=StepTimer.last_outside_envs), waited)
        return result

    def _note_stall(self, timer: StepTimer, waited: float) -> None:
        """The fleet waited ``waited`` seconds for a step (long: see faults.STALL); of its answers,
        ``timer``'s server's spent the longest outside its envs. Warn if that was a stall: at least as
        long as the wait that counts, and far longer than usual (an env slow to reset, or whose steps
        are slow, is none: its envs' own time, which each answer reports, is left out); at most once per
        faults.STALL's period per server, or per a third of the time it has stalled (stalls less than a period
        apart) once that is longer, up to 10 minutes (faults.reminder_gap), with the count of those since."""
        least, factor, every = faults.STALL
        outside = timer.last_outside_envs()
        usual = timer.usual_outside_envs(at_least=faults.STALL_BASELINE)
        if usual is None or outside < least or outside < factor * usual:
            return
        timer.stalls += 1
        now = time.monotonic()
        said, since, began, last = self._stalls.get(timer.address, (-math.inf, 0, now, now))
        if now - last >= every:  # (its stalls before were over: these begin now)
            began = now
        if now - said < faults.reminder_gap(now - began, every):
            self._stalls[timer.address] = (said, since + 1, began, now)
            return
        self._stalls[timer.address] = (now, 0, began, now)
        took = timer.last_latency()
        paused = pauses.own_pause(within=took)  # (during this step; a fault-tolerant fleet's: see learner.pauses)
        log.warning(
            "env server %s took %.1f s to answer a step, %.1f s of it outside its envs (usually %s); the fleet "
            "waited %.1f s for it (%s)%s",
            label_of(timer.address),
            took,
            outside,
            f"{usual * 1000:.3g} ms" if usual < 1 else f"{usual:.3g} s",
            min(waited, took),
            f"this learner itself was held up for {paused:.0f} s meanwhile (stopped, suspended, starved of CPU, or "
            "a long call holding the interpreter): the wait may be its own, and the server fine"
            if paused
            else "a stalled link, a paused or overloaded server, or a busy learner host",
            f"; {since} more such step{'s' if since > 1 else ''} in the last {now - said:.0f} s" if since else "",
        )

    def _collect(
        self, servers: Sequence[int], tasks: dict[int, asyncio.Task[tuple[pb.StepResponse, float]] | SocketStep]
    ) -> StepResult:
        """:meth:`_finish`'s work: wait for ``tasks`` and join their results.

        Observations reach the obs buffer only once every answer is in and fits: a server whose
        answer cannot be read, or whose infos do not fit the others', is an InvalidResponseError (lost,
        fault-tolerant), and its envs keep their last observations."""
        base = self._clients[servers[0]].env_offset
        count = sum(self._clients[i].num_envs for i in servers)
        out = _StepBatch(count)
        failed: dict[int, BaseException] = {}  # servers whose step failed, or whose answer could not be read
        refused: dict[int, SocketStep] = {}  # steps the step socket refused (not taken): resent over gRPC

        def take(i: int, task: asyncio.Task[tuple[pb.StepResponse, float]] | SocketStep) -> None:
            if isinstance(task, SocketStep) and task.refused:
                refused[i] = task
            elif task.cancelled():  # (the deadline passed: see LoopRunner.wait)
                address, timeout = self._clients[i].address, self._due[i][1]
                failed[i] = timeout_error(
                    address=address, method="Step", timeout=timeout, hint=self._step_hint(timeout)
                )
            elif (err := task.exception()) is not None:
                failed[i] = err
            else:
                try:
                    self._take(i, task.result(), base, out)
                # (an InvalidResponseError, or a fault of the learner's own, raised as it is, not as an outage:
                # reported once every answer is in, so that none is left to reach a later step)
                except Exception as unreadable:
                    failed[i] = unreadable

        if tasks:
            # Each step's deadline counts from its send (see _start); steps sent at different times
            # (step_groups) are all waited for until the latest of theirs; and every step gets a last
            # look, over gRPC or a step socket: an answer that came (or, a large one, began to come)
            # while the learner was busy elsewhere for longer than the timeout was on time.
            last_look = time.monotonic() + min(_LAST_LOOK_S, self.timeout)
            deadline = max(max(self._due[i][0] for i in tasks), last_look)
            on_loop = {i: t for i, t in tasks.items() if not isinstance(t, SocketStep)}
            sockets = {i: t for i, t in tasks.items() if isinstance(t, SocketStep)}
            if on_loop:
                reading = self._reading(sockets) if sockets or len(self._groups) > 1 else ()
                self._runner.wait(list(on_loop.values()), deadline - time.monotonic(), reading)
            if sockets:
                self._wait_sockets(sockets, deadline, take)  # each taken in while the others still step
                if refused:
                    self._resend(refused, tasks, take, deadline)
                if self._background_work():
                    self._runner.spin()  # step-socket steps do not run the loop: let reconnects go on
            for i, task in on_loop.items():
                take(i, task)
        elif self.fault_tolerant:
            self._wait_for_rejoin()
            self._check_anything_left()
        errors: list[tuple[int, BaseException]] = []
        lost: list[tuple[int, BaseException]] = []
        for i in tasks:
            err = failed.get(i)
            if err is None:
                continue
            if self.fault_tolerant and _is_outage(err):
                lost.append((i, err))
            else:
                errors.append((i, err))
        if lost or errors:
            self._raise_first(in_server_order(self._lose_all(lost, truncate=True) if lost else [], errors))

        rejoined: set[int] = set()
        broken: list[tuple[int, BaseException]] = []  # (raised once every server of the step is marked)
        cut: list[InfoPart] = []  # placeholder infos of envs cut short (servers already down): never misfits
        replicas = self._replicas
        down = [i for i in servers if replicas[i].state is not ReplicaState.UP]  # (their answers are not in out)
        # (the common step: every server up, so no env unavailable unless an env raised, or a server's infos misfit)
        unavailable = np.zeros(count, dtype=np.bool_) if down else None
        for i in down:
            assert unavailable is not None
            client, replica = self._clients[i], replicas[i]
            start, k = client.env_offset - base, client.num_envs
            unavailable[start : start + k] = True
            if replica.truncate_next:
                # Lost during this step (or the reset before it): the envs' episodes end here,
                # truncated (a server back already hands its new episodes over on the next step).
                only = replica.truncate_only
                replica.truncate_next, replica.truncate_only = False, None
                out.cut(start, k, only)
                cut.append((self._lost_infos(client.env_offset, k, only), start, k))
            elif replica.state is ReplicaState.READY:
                # Back: its envs were reset; this step hands over their first observations (the
                # actions given for them now were computed from stale ones and are not sent).
                fresh = replica.fresh
                assert fresh is not None
                replica.state, replica.fresh = ReplicaState.UP, None
                try:
                    obs, infos = self._read_reset(client, fresh)
                except InvalidResponseError as unreadable:
                    broken += self._lose(i, unreadable, truncate=False)
                    continue
                out.obs[i] = obs
                out.parts.append((infos, start, k))
                rejoined.add(i)
        out.parts.sort(key=lambda part: part[1])  # in env order, whichever server answered first
        infos, misfits = self._merge_infos(out.parts, count, base, "Step", cut)
        if misfits:  # fault-tolerant: those servers are lost on this step, as if their step had failed
            if unavailable is None:
                unavailable = np.zeros(count, dtype=np.bool_)
            for i, err in misfits:
                client = self._clients[i]
                start, k = client.env_offset - base, client.num_envs
                broken += self._lose(i, err, truncate=False)
                del out.obs[i]
                unavailable[start : start + k] = True
                if i not in rejoined:  # (a rejoining server's last episodes were cut when it was lost)
                    out.cut(start, k)
                    cut.append((self._lost_infos(client.env_offset, k), start, k))
            starts = {self._clients[i].env_offset - base for i, _ in misfits}
            # (the parts that fitted fit again; a cut's own, left out if not)
            infos = merge_infos([p for p in out.parts if p[1] not in starts] + cut, count, [])
        self._raise_first(in_server_order(broken))
        for i in tasks:
            if i not in failed and i in out.obs and (relapses := self._replicas[i].note_answer()):
                log.info(
                    "env server %s is steady again: %d steps answered since it came back, after %d losses in a row",
                    label_of(self._clients[i].address),
                    self._replicas[i].answered,
                    relapses,
                )
        for i, server_obs in out.obs.items():
            write_batch(self._obs_buffer, server_obs, self._clients[i].env_offset)
        obs = self._obs_buffer if count == self.num_envs else slice_batch(self._obs_buffer, base, base + count)
        self._flag_unavailable(infos, unavailable, any_unavailable=bool(down or misfits))
        back = [i for i in rejoined if i in out.obs]  # (not lost again on this step)
        if back:  # the step their servers' envs hand over new episodes' first observations
            mask = np.zeros(count, dtype=np.bool_)
            for i in back:
                mask[
                    self._clients[i].env_offset - base : self._clients[i].env_offset - base + self._clients[i].num_envs
                ] = True
            infos["env_rejoined"], infos["_env_rejoined"] = mask, mask.copy()
        if self._ended is not None:
            np.logical_or(out.terminations, out.truncations, out=self._ended[base : base + count])
        if self.metadata["autoreset_mode"] is gym.vector.AutoresetMode.NEXT_STEP:
            if self._resets_pending is None or len(self._resets_pending) != self.num_envs:
                self._resets_pending = np.ones(self.num_envs, dtype=np.bool_)  # (the others: not known)
            np.logical_or(out.terminations, out.truncations, out=self._resets_pending[base : base + count])
        self._raise_env_errors(infos, base)
        return self._observations(obs), out.rewards, out.terminations, out.truncations, infos

    def _step_hint(self, timeout: float) -> str:
        """What a step whose deadline of ``timeout`` passed advises: to raise ``reset_timeout`` where that was
        its deadline (an env may have reset in it: see :meth:`_step_timeout`), else ``timeout`` (or, in
        step_wait with a timeout of its own, that)."""
        if self._timeout_hint is TIMEOUT_HINT and timeout == self.reset_timeout != self.timeout:
            return RESET_TIMEOUT_HINT
        return self._timeout_hint

    def _step_timeout(self, base: int, count: int) -> float:
        """The deadline of a step of envs ``base:base + count``: ``reset_timeout`` where one of them may
        reset in it (next-step autoreset: one whose episode ended at its last step, or any when that is
        not known; same-step autoreset: any step), else ``timeout``."""
        if self.reset_timeout <= self.timeout:
            return self.timeout
        mode = self.metadata["autoreset_mode"]
        if mode is gym.vector.AutoresetMode.SAME_STEP:
            return self.reset_timeout
        pending = self._resets_pending
        if mode is gym.vector.AutoresetMode.NEXT_STEP and (
            pending is None or len(pending) != self.num_envs or pending[base : base + count].any()
        ):
            return self.reset_timeout
        return self.timeout

    def _wait_sockets(
        self,
        steps: dict[int, SocketStep],
        deadline: float,
        take: Callable[[int, SocketStep], None],
    ) -> None:
        """Read the step sockets' answers in the order they come, and ``take(server, step)`` each in
        server order as soon as it and those before it are in, while the others still step. Until
        ``deadline`` (``time.monotonic()``); then the steps still out fail with a timeout (see
        SocketStep.wait).

        The answers of other groups' steps in flight (pipelining) are read as they come too, not
        taken: each round trip ends when its own answer arrives (as SocketStep reads it), not once
        the learner takes it in (after the servers before it in the fleet, or another group)."""
        others = [t for t in self._tasks if isinstance(t, SocketStep) and t not in steps.values() and not t.done()]
        if len(steps) == 1 and not others:
            ((i, step),) = steps.items()
            step.wait(deadline)
            take(i, step)
            return
        order = list(steps.items())  # (in server order)
        taken = 0
        # One poller for the whole wait (not select.select: it fails on file descriptors >= 1024); the
        # first look asks it which sockets have something to read, rather than reading each (most have
        # nothing yet, just sent), then reads those.
        poller = select.poll()
        by_fd: dict[int, SocketStep] = {}
        for step in [step for _, step in order] + others:
            if not step.done():  # (one that failed as it was sent has no socket any more)
                by_fd[step.fileno()] = step
        for fd in by_fd:
            poller.register(fd, select.POLLIN)
        look = [by_fd[fd] for fd, _ in poller.poll(0)]  # the steps to read from: those readable
        spin_until: float | None = None
        while True:
            for step in look:
                step.receive()
            while taken < len(order) and order[taken][1].done():
                take(*order[taken])
                taken += 1
            if taken == len(order):
                return
            pending = [step for _, step in order[taken:] if not step.done()]  # (order[taken]'s at least)
            others = [step for step in others if not step.done()]
            if spin_until is None:  # (after the first look)
                for step in pending:
                    step.timed = True  # not in yet: its arrival shows how quick the server is
                # Awake only while every server waited for answers quickly (see SocketStep.wait).
                spin_until = min(min(step.spin_until() for step in pending), deadline)
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()  # let a process that has work (an env server on this core) run
                look = pending + others
                continue
            if now >= deadline:
                for i, step in order[taken:]:
                    step.wait(deadline)  # (a last look, then the timeout)
                    take(i, step)
                return
            for fd in [fd for fd, step in by_fd.items() if step.done()]:  # (answered: wait for the others)
                poller.unregister(fd)
                del by_fd[fd]
            look = [by_fd[fd] for fd, _ in poller.poll(max(1, math.ceil((deadline - now) * 1000)))]

    def _reading(self, sockets: dict[int, SocketStep]) -> list[SocketStep]:
        """The step-socket steps to read the answers of while steps over gRPC are waited for (see
        LoopRunner.wait): this step's ``sockets`` and other groups' in flight (pipelining) whose answers
        are not in yet. Each round trip ends when its answer arrives: taken in only once the gRPC wait
        was over, a healthy server's answer was as late as a paused TCP server's (its latency, and the
        stall it was named for, were that server's)."""
        reading = []
        for step in [*sockets.values(), *(t for t in self._tasks if isinstance(t, SocketStep))]:
            step.receive()  # (an answer in already, while the learner was busy: not timed)
            if not step.done():
                step.timed = True  # (see SocketStep.wait)
                reading.append(step)
        return reading

    def _resend(
        self,
        refused: dict[int, SocketStep],
        tasks: dict[int, asyncio.Task[tuple[pb.StepResponse, float]] | SocketStep],
        take: Callable[[int, asyncio.Task[tuple[pb.StepResponse, float]]], None],
        deadline: float,
    ) -> None:
        """Send over gRPC, and ``take`` the answers of, the steps whose step socket refused the
        connection (all its places taken): it refuses before reading a frame, so none was taken, and
        their clients step over gRPC from now on (see SocketStep). Once per session at most. Until the
        step's ``deadline`` (``time.monotonic()``; a moment at least): the step takes ``timeout`` in all."""
        resent = {
            i: self._runner.create_task(
                functools.partial(_exchange, self._clients[i], step.request, time.perf_counter())
            )
            for i, step in refused.items()
        }
        tasks.update(resent)  # (so that an interrupted wait cancels them: see _finish)
        self._runner.wait(list(resent.values()), max(deadline - time.monotonic(), _RESEND_MIN_S))
        for i, task in resent.items():
            take(i, task)

    def _notice_answers(self) -> None:
        """Read the step-socket answers that came in for every group in flight (without waiting), so
        that each one's round trip ends when it arrived, not when its group is taken in (pipelining)."""
        if len(self._groups) > 1:
            for task in self._tasks:
                if isinstance(task, SocketStep):
                    task.receive()

    def _abandon(
        self,
        tasks: dict[int, asyncio.Task[tuple[pb.StepResponse, float]] | SocketStep],
        why: BaseException,
        address: str,
    ) -> None:
        """Give up on steps whose answers will not be taken in (the wait for them was interrupted):
        their answers must not reach a later step, so step sockets still waiting are closed (the next
        step connects again) and StepStream exchanges cancelled (the next step opens a new stream);
        until a reset, steps are refused (their envs moved on, unseen)."""
        on_loop: list[asyncio.Task[Any]] = []
        for i, task in tasks.items():
            if isinstance(task, SocketStep):
                if not task.done():
                    self._clients[i].close_step_socket()
            else:
                on_loop.append(task)
        self._runner.cancel(on_loop)
        self._went_stale(address, f"the step was interrupted ({type(why).__name__})")

    def _take(self, server: int, result: tuple[pb.StepResponse, float], base: int, out: _StepBatch) -> None:
        """Read one server's step answer into ``out`` (a batch from env ``base``): rewards and flags,
        infos, and its observations (for the obs buffer, once every answer is in). An answer that cannot
        be read raises InvalidResponseError, leaving nothing of it in ``out``."""
        response, latency = result
        client = self._clients[server]
        start, k = client.env_offset - base, client.num_envs
        try:
            if response.step_id not in (client.step_id, 0):  # (0: a server older than step_id)
                client.out_of_step()
                raise _OutOfStep(
                    f"step_id: expected {client.step_id}, the request's, got {response.step_id}: the server "
                    f"answered {'an earlier request again' if response.step_id < client.step_id else 'another request'}"
                    " (every later answer would be one step off)"
                )
            obs = codec.decode_value(response.observations, "observations")
            check_batch(self._obs_buffer, obs, k)
            numbers, flags = _answer_fields(k)  # (what they hold, for the error of one left out)
            rewards = codec.decode_tensor(response.rewards, "rewards", expected=numbers)
            terminations = codec.decode_tensor(response.terminations, "terminations", expected=flags)
            truncations = codec.decode_tensor(response.truncations, "truncations", expected=flags)
            if not rewards.shape == terminations.shape == truncations.shape == (k,):
                for name, values in (
                    ("rewards", rewards),
                    ("terminations", terminations),
                    ("truncations", truncations),
                ):
                    if values.shape != (k,):
                        raise ValueError(f"{name}: expected shape ({k},) ({k} envs), got {values.shape}")
            out.rewards[start : start + k] = rewards
            out.terminations[start : start + k] = terminations
            out.truncations[start : start + k] = truncations
            infos = response_infos(response)
        except Exception as err:
            out.rewards[start : start + k], out.terminations[start : start + k] = 0.0, False
            out.truncations[start : start + k] = False
            raise self._unreadable(client, "Step", err) from err
        self._timers[server].record(latency, response.env_seconds)
        out.obs[server] = obs
        out.parts.append((infos, start, k))

    def _read_reset(self, client: EnvClient, response: pb.ResetResponse) -> tuple[Any, dict[str, Any]]:
        """A reset's observations (checked against the fleet's batch) and infos; InvalidResponseError if
        they cannot be read."""
        try:
            obs = codec.decode_value(response.observations, "observations")
            check_batch(self._obs_buffer, obs, client.num_envs)
            return obs, response_infos(response)
        except Exception as err:
            raise self._unreadable(client, "Reset", err) from err

    @staticmethod
    def _unreadable(client: EnvClient, method: str, err: Exception) -> InvalidResponseError:
        if isinstance(err, _OutOfStep):  # (read well, but not the answer to the request sent)
            out_of_step = InvalidResponseError(
                f"env server {label_of(client.address)}: {method}: its answer is not to the request sent ({err})",
                address=client.address,
            )
            out_of_step.out_of_step = True
            return out_of_step
        return InvalidResponseError(
            f"env server {label_of(client.address)}: {method}: its answer could not be read ({type(err).__name__}: {err}); "
            "is it a server of another envfleet version?",
            address=client.address,
        )

    def _merge_infos(
        self, parts: list[InfoPart], count: int, base: int, method: str, placeholders: Sequence[InfoPart] = ()
    ) -> tuple[dict[str, Any], list[tuple[int, InvalidResponseError]]]:
        """The servers' infos (``parts``, for envs from ``base``) joined into one; with the servers whose
        infos do not fit the others' (a key of another shape or dtype: another version or configuration
        of the env), left out. Those are InvalidResponseErrors: raised unless fault-tolerant, else
        returned with their servers for the caller to lose.

        ``placeholders`` (the infos :meth:`_lost_infos` makes up for servers already down) join after
        the servers' own: only servers that answered can be misfits; a placeholder that does not fit is
        left out."""
        if not placeholders and not any(infos for infos, _, _ in parts):
            return {}, []  # (the common step: no infos, none to fit)
        misfits: list[tuple[int, ValueError]] = []
        infos = merge_infos([*parts, *placeholders], count, misfits)
        bad = []
        for j, err in misfits:
            if j >= len(parts):
                continue  # (a placeholder's: its server is down already)
            client = self._client_of(base + parts[j][1])
            bad.append(
                (
                    self._clients.index(client),
                    InvalidResponseError(
                        f"env server {label_of(client.address)}: {method}: its infos do not fit the fleet's batch ({err})",
                        address=client.address,
                    ),
                )
            )
        if bad and not self.fault_tolerant:
            self._raise_first([err for _, err in bad])
        return infos, bad

    # -- failures every step checks for (servers lost, fault_stats(): learner.outages) ---------------

    def _flag_unavailable(
        self,
        infos: dict[str, Any],
        unavailable: np.ndarray | None,
        *,
        steps: bool = True,
        any_unavailable: bool = True,
    ) -> None:
        """Add ``env_unavailable`` (and its mask) to ``infos`` for the envs that gave no transition;
        ``steps``: the infos are a step's, whose unavailable envs count as env steps lost (a reset's are
        no env steps: fault_stats() counts env steps); ``any_unavailable`` False: the caller knows that
        ``unavailable`` is all False (every server answered), so only env errors can add any; None is
        all False too (then ``any_unavailable`` must be False)."""
        errors = infos.get("_env_error")
        if errors is not None:
            self._env_error_steps += int(np.count_nonzero(errors))
            unavailable = (np.zeros(len(errors), dtype=np.bool_) if unavailable is None else unavailable) | errors
        elif not any_unavailable:  # (the caller knows that no env is: the common step)
            return
        assert unavailable is not None
        if unavailable.any():
            if steps:
                self._env_steps_lost += int(np.count_nonzero(unavailable))
            infos["env_unavailable"] = unavailable
            infos["_env_unavailable"] = unavailable.copy()

    def _raise_env_errors(self, infos: dict[str, Any], base: int) -> None:
        """Not fault-tolerant: an env that raised (its server isolated it: ``infos["env_error"]``) raises
        EnvCrashedError, as a local vector env raises when an env does; the envs' results are not
        handed over, so the next step needs a reset first. ``base``: the env index of ``infos``' first."""
        errors = infos.get("_env_error")
        if self.fault_tolerant or errors is None or not errors.any():
            return
        crashed = []
        for j in np.flatnonzero(errors):
            index = base + int(j)
            client = self._client_of(index)
            record = str(infos["env_error"][j])
            after = (
                "its reset failed, so it is out of order: its server tries its reset again at each step, each an "
                "error of this env"
                if record.startswith(("reset:", "out of order"))
                else "the server reset it"
            )
            crashed.append(
                EnvCrashedError(
                    f"env server {label_of(client.address)}: env {index} {error_phrase(record)} ({after}; "
                    f"{FAULT_TOLERANT_HINT})",
                    address=client.address,
                    code=grpc.StatusCode.INTERNAL,
                    env_index=index,
                )
            )
        self._raise_first(crashed)

    def _as_batch(self, actions: Any, count: int, where: str, base: int = 0) -> Any:
        """The batch of ``count`` actions (for envs ``base``...) checked here, as the servers would check
        it, so that a bad action reaches no server: otherwise the servers with good actions would
        step and their results be lost with the error."""
        try:
            batch = as_arrays(self.single_action_space, actions, where)
            return check_actions(self.single_action_space, batch, count, where)
        except InvalidActionError as err:
            if err.env_index is None:
                raise InvalidArgumentError(str(err)) from None  # the batch's shape or dtype: no env to name
            index = base + err.env_index
            client = self._client_of(index)
            message = str(err).replace(
                f"env {err.env_index}:", f"env {index} of the fleet (on env server {label_of(client.address)}):", 1
            )
            raise InvalidRequestError(
                message, address=client.address, code=grpc.StatusCode.INVALID_ARGUMENT, env_index=index
            ) from None

    def _client_of(self, index: int) -> EnvClient:
        """The client of the server that hosts env ``index`` (counted over the fleet)."""
        return next(c for c in self._clients if c.env_offset <= index < c.env_offset + c.num_envs)

    def _observations(self, obs: Any) -> Any:
        return deepcopy(obs) if self.copy else obs

    def _assert_open(self) -> None:
        if self.closed:
            raise ClosedEnvironmentError("this RemoteVectorEnv is closed; create a new one to keep stepping")

    def _end_wait(self, pending: AsyncState, timeout: float | None) -> float | None:
        """The start of ``step_wait``/``reset_wait`` (``pending``: what it waits for): refuse a bad
        ``timeout`` (the call stays pending) or no pending call, then leave the pending state; the
        timeout as seconds."""
        self._assert_open()
        if timeout is not None:
            timeout = _seconds("timeout", timeout)
        if self._state is not pending:
            name = pending.value
            raise NoAsyncCallError(f"{name}_wait: no {name}_async call is pending; call {name}_async first", name)
        self._state = AsyncState.DEFAULT
        return timeout

    def _assert_idle(self, method: str) -> None:
        self._assert_open()
        if self._state is not AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"{method}: a call to `{self._state.value}` is still pending; call {self._state.value}_wait first",
                self._state.value,
            )
        busy = [g for g in range(len(self._groups)) if self._in_flight[g]]
        if busy:
            raise AlreadyPendingCallError(
                f"{method}: group(s) {busy} have a step in flight (send); call recv for each first", "send"
            )

    def _raise_first(self, errors: Sequence[BaseException]) -> None:
        if errors:
            # The servers that answered moved on; the caller saw none of it.
            first = errors[0]
            self._went_stale(getattr(first, "address", ""), str(first))
        raise_first([self._session_hint(err) for err in errors])

    def _session_hint(self, err: BaseException) -> BaseException:
        """A server's "this session does not own me" (it restarted, or the connection dropped) says to
        call Handshake, which users of this class never do: say what does it here."""
        if self.fault_tolerant or not isinstance(err, SessionError) or not err.address:
            return err
        client = next((c for c in self._clients if c.address == err.address), None)
        if client is None or not client.session_ended:
            return err
        return SessionError(
            f"{err} (for this RemoteVectorEnv: reset() does so; refresh() if the server came back with other envs)",
            address=err.address,
            code=err.code,
            env_index=err.env_index,
        )

    def _went_stale(self, address: str, cause: str) -> None:
        self._stale = (address, cause)  # the latest failure is the one to report

    def _assert_in_step(self, method: str) -> None:
        """Refuse to step envs whose last step failed part way: some stepped without the caller
        seeing their results (episodes may have ended unseen), so the caller's observations are stale; and
        steps before the first reset, as gymnasium's vector envs do (the servers would refuse them)."""
        if not self._reset_once:
            raise ResetNeededError(
                f"{method}: called before reset(); call reset() first",
                address="",
                code=grpc.StatusCode.FAILED_PRECONDITION,
            )
        if self._stale is not None:
            address, cause = self._stale
            raise SessionError(
                f"{method}: the last step or reset failed ({cause}), and the envs of the servers that did "
                "answer moved on without their results reaching you: call reset() first (or refresh(), which "
                "also lets go of servers that are gone: num_envs may change, and wrappers keep the old spaces)",
                address=address,
                code=grpc.StatusCode.FAILED_PRECONDITION,
            )

    # -- the fleet laid out anew: refresh's last step (the rest of refresh: learner.membership) --------

    def _relayout(
        self,
        stay: list[EnvClient],
        joined: list[EnvClient],
        leave: list[EnvClient],
        resets: dict[str, tuple[Any, dict[str, Any]]],
        replicas: dict[int, Replica],
    ) -> FleetChange:
        """The fleet laid out anew (refresh's last step): the envs of servers that stay first (with their
        observations, unless they were reset), then those of new servers; everything sized by
        ``num_envs`` follows."""
        clients = stay + joined
        previous_index: list[int] = []
        observations = placeholder_batch(self.single_observation_space, sum(c.num_envs for c in clients))
        parts = []
        offset = 0
        for client in clients:
            reset = resets.get(client.address)
            if reset is not None:
                previous_index += [-1] * client.num_envs
                write_batch(observations, reset[0], offset)
                parts.append((reset[1], offset, client.num_envs))
            else:
                previous_index += range(client.env_offset, client.env_offset + client.num_envs)
                old = slice_batch(self._obs_buffer, client.env_offset, client.env_offset + client.num_envs)
                write_batch(observations, old, offset)
            client.env_offset = offset
            offset += client.num_envs

        previous_num_envs, timers = self.num_envs, {t.address: t for t in self._timers}
        self._clients, self.num_envs, self._obs_buffer = clients, offset, observations
        kept = np.array(previous_index, dtype=np.int64)
        if self._ended is not None:  # (envs that stay keep theirs; reset ones and new ones have none)
            ended = self._no_ended_envs()
            assert ended is not None
            ended[kept >= 0] = self._ended[kept[kept >= 0]]
            self._ended = ended
        if self._resets_pending is not None:
            # Likewise the autoresets due (their steps' deadline is reset_timeout): those of envs that
            # stay move with them; reset and new envs have none due. (Not known before: not known now.)
            if len(self._resets_pending) == previous_num_envs:
                pending = np.zeros(self.num_envs, dtype=np.bool_)
                pending[kept >= 0] = self._resets_pending[kept[kept >= 0]]
                self._resets_pending = pending
            else:
                self._resets_pending = None
        self._share_cpus()
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self._tasks = [None] * len(clients)
        self._due = [(math.inf, self.timeout)] * len(clients)
        self._groups = split_groups(len(clients), min(self._num_groups_asked, len(clients)))
        self._in_flight = [False] * len(self._groups)
        self._sent_at = [0.0] * len(self._groups)
        # (a server back at its address with another number of envs starts a timer of its own)
        self._timers = [self._timer_for(c, timers.get(c.address)) for c in clients]
        for client in leave:  # their counts stay in fault_stats()
            self._retired.add(replicas[id(client)])
            # (and their window's, in the next replica_stats(); in the new server's where one with
            # another num_envs took the address)
            old = timers.get(client.address)
            if old is None or any(old is t for t in self._timers):
                continue
            new = next((t for t in self._timers if t.address == client.address), None)
            if new is not None:
                new.take_counts(old)
            else:
                earlier = self._departed.get(client.address)
                if earlier is not None:  # (left twice in the window: the counts add up, the last steps stand)
                    old.take_counts(earlier[0])
                self._departed[client.address] = (old, replicas[id(client)].spec.server_id)
        self._retired.joined += len(joined)
        self._retired.left += len(leave)
        self._replicas = [replicas.get(id(c)) or self._replica(c) for c in clients]
        self._stale = None
        log.info(
            "fleet changed: %d server(s) joined (%s), %d left (%s); %d envs, was %d",
            len(joined),
            ", ".join(label_of(c.address) for c in joined) or "-",
            len(leave),
            ", ".join(label_of(c.address) for c in leave) or "-",
            self.num_envs,
            previous_num_envs,
        )
        infos = merge_infos(parts, self.num_envs)  # (those that did not fit have left: see _restart)
        # Envs whose reset raised (out of order) are flagged, and counted, as reset() flags them; not
        # raised here, not fault-tolerant either: the caller needs the change (their first step raises).
        self._flag_unavailable(infos, None, steps=False, any_unavailable=False)
        return FleetChange(
            added=tuple(c.address for c in joined),
            removed=tuple(c.address for c in leave),
            num_envs=self.num_envs,
            previous_num_envs=previous_num_envs,
            previous_index=np.array(previous_index, dtype=np.int64),
            observations=self._observations(self._obs_buffer),
            infos=infos,
            restarted=sum(c.num_envs for c in stay if c.address in resets),
        )

    # -- statistics -------------------------------------------------------------------------------

    def _timer_for(self, client: EnvClient, kept: StepTimer | None) -> StepTimer:
        """The step timer of ``client``, a server of the fleet laid out anew: ``kept``, the one its
        address had, or the one it left in this window with (:attr:`_departed`), where its number of
        envs is the same; else a new one, with that one's counts."""
        departed = self._departed.pop(client.address, None)
        old = kept if kept is not None else departed[0] if departed is not None else None
        if old is not None and old.num_envs == client.num_envs:
            return old
        timer = StepTimer(client.address, client.num_envs)
        if departed is not None:
            timer.take_counts(departed[0])
        return timer

    def replica_stats(self, *, reset: bool = False) -> list[ReplicaStats]:
        """Each server's step latency (p50, p99), env time, throughput, failures, shutdowns and reconnects since
        the last reset.

        ``reset=True`` starts a new window after reading (e.g. once per training iteration). Servers
        that left the fleet (refresh()) in the window, with steps or losses in it, come last, unavailable,
        until then. Once the env is closed, its last window's stats stay readable, every server unavailable.
        """
        stats = [
            timer.stats(
                available=replica.state is ReplicaState.UP and not self.closed, server_id=replica.spec.server_id
            )
            for timer, replica in zip(self._timers, self._replicas, strict=True)
        ]
        departed = (timer.stats(available=False, server_id=server_id) for timer, server_id in self._departed.values())
        stats += [w for w in departed if w.steps or any(getattr(w, name) for name in StepTimer.COUNTS)]
        if reset:
            for timer in self._timers:
                timer.reset()
            self._departed.clear()
        return stats

    # -- closing ----------------------------------------------------------------------------------

    def render(self) -> tuple[Any, ...] | None:
        """One None per env, as gymnasium's vector envs give for envs made without a ``render_mode``.

        Frames do not cross the wire: RemoteVectorEnv's envs have no render mode.
        """
        return (None,) * self.num_envs

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """``call("render")`` is :meth:`render`'s Nones, as gymnasium's vector envs answer it for envs without a
        render mode (skrl's trainers call it every step); ``AttributeError`` for any other call."""
        if name == "render" and not args and not kwargs:
            return (None,) * self.num_envs  # (render()'s)
        raise AttributeError(_NOT_BY_NAME.format(what=f"call({name!r})"))

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Each env's ``name``, one of those this process knows (:data:`ANSWERED_HERE`): ``render_mode``
        (None: frames do not cross the wire), ``observation_space`` and ``action_space`` (the single env's),
        ``metadata`` (the envs', without the vector env's ``autoreset_mode``), ``spec``; ``AttributeError`` for
        any other name."""
        if name not in ANSWERED_HERE:
            what = f"get_attr({name!r}) (get_attr answers {', '.join(ANSWERED_HERE)})"
            raise AttributeError(_NOT_BY_NAME.format(what=what))
        value = {
            "render_mode": None,
            "observation_space": self.single_observation_space,
            "action_space": self.single_action_space,
            "metadata": {k: v for k, v in self.metadata.items() if k != "autoreset_mode"},
            "spec": self.spec,
        }[name]
        return tuple(deepcopy(value) for _ in range(self.num_envs))

    def set_attr(self, name: str, values: Any) -> None:
        raise AttributeError(_NOT_BY_NAME.format(what=f"set_attr({name!r}, ...)"))

    def __reduce__(self) -> Any:
        raise TypeError(
            f"cannot pickle or copy {self!r}: it holds sessions with its env servers (one learner per "
            "server); make another with RemoteVectorEnv(envs.addresses) once this one is closed"
        )

    def close_extras(self, **kwargs: Any) -> None:
        """Release every server's envs for the next learner and close the connections."""
        if getattr(self, "_watching_pauses", False):
            self._watching_pauses = False
            pauses.stop()
        self._close_clients()

    def _close_clients(self) -> None:
        tasks: list[asyncio.Future[Any]] = [t for t in self._tasks if t is not None and not isinstance(t, SocketStep)]
        tasks += [r.reconnect_task for r in self._replicas if r.reconnect_task is not None]
        joining = [client for client, _ in self._joining.values()]
        tasks += [ready for _, ready in self._joining.values()]
        self._tasks = [None] * len(self._tasks)
        self._joining = {}
        self._in_flight = [False] * len(getattr(self, "_groups", ()))
        self._state = AsyncState.DEFAULT
        with contextlib.suppress(Exception):
            self._runner.run_or_schedule(functools.partial(_close_all, self._clients + joining, tasks))

    def __enter__(self) -> RemoteVectorEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            with contextlib.suppress(Exception):  # interpreter shutdown: nothing sensible left to do
                self.close()

    def __repr__(self) -> str:
        spec = getattr(self, "spec", None)
        env = f"{spec.id}, " if spec is not None else ""
        closed = ", closed" if getattr(self, "closed", False) else ""
        return f"RemoteVectorEnv({env}{self.addresses!r}, num_envs={getattr(self, 'num_envs', '?')}{closed})"


class _StepBatch:
    """A step's results being joined: rewards and flags over its envs, and each server's infos."""

    def __init__(self, count: int) -> None:
        self.rewards = np.zeros(count, dtype=np.float64)
        self.terminations = np.zeros(count, dtype=np.bool_)
        self.truncations = np.zeros(count, dtype=np.bool_)
        self.parts: list[InfoPart] = []  # (infos, start, count) per server
        self.obs: dict[int, Any] = {}  # server -> its envs' observations, for the obs buffer

    def cut(self, start: int, count: int, only: np.ndarray | None = None) -> None:
        """Envs ``start:start + count`` (``only``: those of them in this mask) lost their server on this
        step: their episodes end, truncated, reward 0."""
        envs = slice(start, start + count) if only is None else start + np.flatnonzero(only)
        self.rewards[envs] = 0.0
        self.terminations[envs] = False
        self.truncations[envs] = True


async def _until_written(clients: list[EnvClient], timeout: float) -> None:
    """Until no client of ``clients`` has a step's request still to hand to gRPC, or ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(c.writing for c in clients) and time.monotonic() < deadline:
        await asyncio.sleep(0.0005)


class _OutOfStep(ValueError):
    """A step's answer to another request than the one sent (its step_id)."""


def _pop_mask(options: Mapping[str, Any] | None) -> None:
    """Take ``reset_mask`` out of the caller's options once a reset took them, as gymnasium's vector envs do: a
    vector wrapper's reset (RecordEpisodeStatistics') reads the options after the env's, and sees what it would see
    on them."""
    if isinstance(options, MutableMapping):
        options.pop("reset_mask", None)


@functools.cache
def _answer_fields(k: int) -> tuple[str, str]:
    """What a step answer's rewards and flags of ``k`` envs hold, as an error says it (made once: per step
    and server, formatting them would cost more than the check they serve)."""
    return f"{k} float64 rewards, one per env", f"{k} bools (DTYPE_BOOL), one per env"


async def _exchange(client: EnvClient, request: pb.StepRequest, sent: float) -> tuple[pb.StepResponse, float]:
    """One step of one server: its answer and the round trip in seconds, from ``sent`` (the
    ``time.perf_counter()`` of the call that sent it) until the loop took the answer in."""
    response = await client.step(request)
    return response, time.perf_counter() - sent


CANCEL_WAIT_S = 0.5
"""How long ``close()`` waits for its cancelled calls to end before it closes the connections under them (a
reconnect releasing the session its Handshake granted: up to HANDSHAKE_ANSWER_WAIT_S more, see :func:`_close_all`)."""


async def _close_all(clients: list[EnvClient], tasks: list[asyncio.Future[Any]]) -> None:
    """Cancel the steps in flight, then release every server and close the connections.

    A task cancelled while it awaits a gRPC call to a server whose process hangs (a reconnect's
    GetSpec, say) stays "cancelling" until that call ends: grpc.aio's call does not end when cancelled,
    but when the server answers (measured: close() took as long as the server's hang, 14 s of 15).
    So the tasks get a moment; then the connections close, which ends such calls, and the tasks with them.

    A fault-tolerant reconnect cancelled while its Handshake is in flight waits for the answer, to release the
    session it granted (:func:`~learner.client.release_unadopted`): closed under it after that moment, it left the
    session to the server's claim timeout (30 s by default), refusing the learner started again (learner train
    closes the fleet after a Ctrl-C). Such a task gets up to HANDSHAKE_ANSWER_WAIT_S more (a close with a server
    hanging on a reconnect's Handshake takes that much longer); the others none.
    """
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=CANCEL_WAIT_S)
        releasing = releasing_unadopted(tasks)
        if releasing:
            await asyncio.wait(releasing, timeout=HANDSHAKE_ANSWER_WAIT_S)
    await gather(*(c.close() for c in clients), return_exceptions=True)
    await gather(*tasks, return_exceptions=True)


def _is_outage(err: BaseException) -> bool:
    """Whether a fault-tolerant fleet takes ``err`` for its server's outage (:func:`learner.faults.is_outage`):
    not for an env's observation that does not fit the observation space (the server's ObservationLayoutError,
    an EnvCrashedError), nor for infos that make its answer too large to send (an EnvCrashedError naming the
    answer's size), which are the env's: it returns it again after the reconnect's reset (or in it), so the
    fleet would retry the server for ``give_up_after`` seconds (a minute, by default) before it stopped with the
    same error. Raised at once instead, as a NaN observation stops a run."""
    return is_outage(err) and not misfit_reported(err)
