"""RemoteVectorEnv: many env servers presented as one gymnasium VectorEnv."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from copy import deepcopy
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.utils import batch_space, create_empty_array

from env_server import codec
from env_server.rpc import env_pb2 as pb
from learner.batching import merge_infos, slice_batch, write_batch
from learner.client import EnvClient, timeout_error
from learner.discovery import AddressError, expand_addresses
from learner.errors import ServerUnavailableError, SpecMismatchError
from learner.fleet import FleetChange
from learner.loop import LoopRunner, gather
from learner.stats import ReplicaStats, StepTimer

__all__ = ["RemoteVectorEnv"]

log = logging.getLogger(__name__)

StepResult = tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]


class RemoteVectorEnv(gym.vector.VectorEnv):
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

    Example:
        >>> envs = RemoteVectorEnv(["127.0.0.1:50051", "127.0.0.1:50052"])  # doctest: +SKIP
        >>> obs, infos = envs.reset(seed=42)  # env i gets seed 42 + i         # doctest: +SKIP
        >>> obs, rewards, terminations, truncations, infos = envs.step(envs.action_space.sample())  # doctest: +SKIP

    Args:
        addresses: server addresses, a list or one comma-separated string: ``host:port``,
            ``unix:/path``, or ``dns:///name:port`` (every address the name resolves to).
        timeout: seconds each call (reset, step, handshake) may take before it fails with
            :class:`~learner.errors.RemoteTimeoutError`.
        connect_timeout: seconds to wait for every server to accept a connection before failing
            with :class:`~learner.errors.ServerUnavailableError` naming the address.
        client_name: how this learner is named in servers' logs and refusals (default host:pid).
        copy: return fresh arrays from reset/step/recv (True) or views of the same buffers each
            time (False, faster; the next call overwrites them), as gymnasium's ``copy`` argument.
        auth_token: token sent with every call, for servers started with ``--auth-token``.
        num_groups: how many groups the servers form for :meth:`send` / :meth:`recv` (contiguous,
            as even as possible; at most one group per server).

    Servers may come and go: :meth:`refresh` looks ``addresses`` up again (a ``compose:`` or
    ``dns:///`` name finds replicas added or removed since) and grows or shrinks the fleet.
    """

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        timeout: float = 30.0,
        connect_timeout: float = 10.0,
        client_name: str | None = None,
        copy: bool = True,
        auth_token: str | None = None,
        num_groups: int = 1,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout: expected seconds > 0, got {timeout!r}")
        if not connect_timeout > 0:
            raise ValueError(f"connect_timeout: expected seconds > 0, got {connect_timeout!r}")
        if not (isinstance(num_groups, int) and num_groups >= 1):
            raise ValueError(f"num_groups: expected an int >= 1, got {num_groups!r}")
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.copy = copy
        self._client_name = client_name
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self._state = AsyncState.DEFAULT
        self.closed = False
        self._clients: list[EnvClient] = []
        # One step in flight per server at most: its task (send, then receive) until taken in.
        self._tasks: list[asyncio.Task[tuple[pb.StepResponse, float]] | None] = []
        # The loop this env's gRPC calls run on (see LoopRunner): they always use the same one.
        self._runner = LoopRunner.for_this_thread()
        # For refresh: the addresses as given, servers still connecting, what was logged once, and
        # whether a failed call left the envs that did answer a step ahead of what the caller saw.
        self._address_spec = addresses
        self._num_groups_asked = num_groups
        self._joining: dict[str, tuple[EnvClient, asyncio.Future[None]]] = {}
        self._noted: set[str] = set()
        self._stale = False

        endpoints = expand_addresses(addresses)
        if num_groups > len(endpoints):
            raise ValueError(
                f"num_groups: expected at most one group per server ({len(endpoints)} servers), got {num_groups}"
            )
        self._clients = self._runner.run(self._connect(endpoints))
        self._check_specs()
        first = self._clients[0].spec
        assert first is not None
        self._spec = first
        self.single_observation_space = codec.decode_space(first.observation_space, "observation_space")
        self.single_action_space = codec.decode_space(first.action_space, "action_space")
        self.num_envs = sum(c.num_envs for c in self._clients)
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.metadata = {
            "autoreset_mode": codec.AUTORESET_FROM_PROTO[first.autoreset_mode],
            "render_modes": list(first.render_modes),
        }
        if first.HasField("render_fps"):
            self.metadata["render_fps"] = first.render_fps
        self._obs_buffer = create_empty_array(self.single_observation_space, self.num_envs, fn=np.zeros)
        self._tasks = [None] * len(self._clients)
        self._groups = _split(len(self._clients), num_groups)
        self._timers = [StepTimer(c.address, c.num_envs) for c in self._clients]
        log.info(
            "connected to %d env server(s), %d envs of %s: %s",
            len(self._clients),
            self.num_envs,
            first.env_id,
            ", ".join(self.addresses),
        )

    # -- connecting -------------------------------------------------------------------------------

    async def _connect(self, endpoints: list[str]) -> list[EnvClient]:
        clients: list[EnvClient] = []
        try:
            for address in endpoints:
                clients.append(
                    EnvClient(address, timeout=self.timeout, client_name=self._client_name, metadata=self._metadata)
                )
            # Connect to all servers at once, within one shared deadline.
            readies = [asyncio.ensure_future(c.wait_ready()) for c in clients]
            _, late = await asyncio.wait(readies, timeout=self.connect_timeout)
            if late:
                for task in late:
                    task.cancel()
                client = next(c for c, r in zip(clients, readies, strict=True) if r in late)
                raise ServerUnavailableError(
                    f"env server {client.address}: nothing answered within {self.connect_timeout:g} s "
                    "(is the server running, and is the address right?)",
                    address=client.address,
                )
            responses = await gather(*(c.handshake() for c in clients), return_exceptions=True)
            errors: list[BaseException] = []
            offset = 0
            for client, response in zip(clients, responses, strict=True):
                if isinstance(response, BaseException):
                    errors.append(response)
                    continue
                client.start_session(response)
                client.env_offset = offset
                offset += response.spec.num_envs
            if errors:
                raise errors[0]
        except BaseException:
            await gather(*(c.close() for c in clients), return_exceptions=True)
            raise
        return clients

    def _check_specs(self) -> None:
        first = self._clients[0]
        assert first.spec is not None
        for client in self._clients[1:]:
            spec = client.spec
            assert spec is not None
            for field in ("observation_space", "action_space", "autoreset_mode"):
                if getattr(spec, field) != getattr(first.spec, field):
                    self._close_clients()
                    raise SpecMismatchError(
                        f"{field} differs between env servers {first.address} ({first.spec.env_id}) and "
                        f"{client.address} ({spec.env_id}); one RemoteVectorEnv needs servers of the same env"
                    )

    @property
    def addresses(self) -> list[str]:
        """The servers' addresses, in env order."""
        return [c.address for c in self._clients]

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

    # -- the VectorEnv API --------------------------------------------------------------------------

    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset every env (or those in ``options["reset_mask"]``); env i gets seed ``seed + i``."""
        self._assert_idle("reset")
        seeds = self._seeds(seed)
        options = dict(options) if options else {}
        mask = options.pop("reset_mask", None)
        if mask is not None:
            mask = np.asarray(mask)
            if mask.shape != (self.num_envs,) or mask.dtype != np.bool_:
                raise ValueError(
                    f"options['reset_mask']: expected a bool array of shape ({self.num_envs},), got {mask.dtype} {mask.shape}"
                )
            if not mask.any():
                raise ValueError("options['reset_mask']: expected at least one True value, got none")
        encoded_options = codec.encode_value(options, pb.Value(), "options") if options else None

        calls = []
        for client, sl in zip(self._clients, self.env_slices, strict=True):
            sub_mask = None if mask is None else mask[sl]
            if sub_mask is not None and not sub_mask.any():
                continue
            sub_seeds = None if seeds is None else seeds[sl]
            calls.append(
                (client, client.reset(sub_seeds, encoded_options, None if sub_mask is None else sub_mask.tolist()))
            )
        results = self._runner.run(gather(*(call for _, call in calls), return_exceptions=True))
        self._raise_first([r for r in results if isinstance(r, BaseException)])
        self._stale = self._stale and mask is not None
        parts = []
        for (client, _), response in zip(calls, results, strict=True):
            obs = codec.decode_value(response.observations, "observations")
            write_batch(self._obs_buffer, obs, client.env_offset)
            parts.append((_infos(response), client.env_offset, client.num_envs))
        infos = merge_infos(parts, self.num_envs)
        return self._observations(self._obs_buffer), infos

    def _seeds(self, seed: int | Sequence[int | None] | None) -> list[int | None] | None:
        if seed is None:
            return None
        if isinstance(seed, int | np.integer):
            seed = int(seed)
            if seed < 0:
                raise ValueError(f"seed: expected an int >= 0, got {seed}")
            return [seed + i for i in range(self.num_envs)]
        seeds = list(seed)
        if len(seeds) != self.num_envs:
            raise ValueError(f"seed: expected an int or {self.num_envs} seeds (one per env), got {len(seeds)}")
        for i, s in enumerate(seeds):
            if s is not None and not (isinstance(s, int | np.integer) and 0 <= s < 2**64):
                raise ValueError(f"seed[{i}]: expected None or an int in [0, 2**64), got {s!r}")
        return [None if s is None else int(s) for s in seeds]

    def step(self, actions: Any) -> StepResult:
        """Step every env with its action and wait for all the servers' results."""
        self._assert_idle("step")
        actions = self._as_batch(actions, self.num_envs, "actions")
        servers = range(len(self._clients))
        self._start(servers, actions, 0)
        return self._finish(servers)

    def step_async(self, actions: Any) -> None:
        """Send each server its envs' actions, without waiting for the results."""
        self._assert_idle("step_async")
        actions = self._as_batch(actions, self.num_envs, "actions")
        self._start(range(len(self._clients)), actions, 0)
        self._state = AsyncState.WAITING_STEP
        self._runner.spin()

    def step_wait(self) -> StepResult:
        """Wait for every server's step results and join them into one batch."""
        self._assert_open()
        if self._state is not AsyncState.WAITING_STEP:
            raise NoAsyncCallError(
                "step_wait: no step_async call is pending; call step_async first", AsyncState.WAITING_STEP.value
            )
        self._state = AsyncState.DEFAULT
        return self._finish(range(len(self._clients)))

    # -- pipelining -------------------------------------------------------------------------------

    def step_groups(self, act: Callable[[slice], Any]) -> StepResult:
        """One step of every env, computed and sent group by group; returns what :meth:`step` returns.

        ``act(group_slice)`` returns the actions of the envs in ``group_slice`` (a batch over them). Each
        group is sent its actions as soon as ``act`` returns them, so it steps while ``act`` computes the
        actions of the groups after it (a policy's forward pass, say). Then all results are joined, as
        one fleet-wide step. With one group this is ``step(act(slice(0, num_envs)))``.
        """
        self._assert_idle("step_groups")
        started: list[int] = []
        try:
            for g, servers in enumerate(self._groups):
                sl = self._group_slice(g)
                actions = self._as_batch(act(sl), sl.stop - sl.start, f"actions (group {g})")
                self._start(servers, actions, sl.start)
                started += servers
                if g + 1 < len(self._groups):
                    self._runner.spin()
        except BaseException:
            if started:  # the groups already sent finish their step; their results are dropped
                with contextlib.suppress(Exception):
                    self._finish(started)
            raise
        return self._finish(range(len(self._clients)))

    def send(self, actions: Any, group: int) -> None:
        """Send group ``group``'s envs their actions (a batch over ``group_slices[group]``) and return at once.

        Take the results in with :meth:`recv`; meanwhile, other groups may be sent to or received from.
        """
        self._assert_open()
        self._check_group(group, "send")
        if self._state is not AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"send: a call to `{self._state.value}` is still pending; call step_wait first", self._state.value
            )
        servers = self._groups[group]
        if any(self._tasks[i] is not None for i in servers):
            raise AlreadyPendingCallError(
                f"send: group {group} already has a step in flight; call recv({group}) first", "send"
            )
        sl = self._group_slice(group)
        actions = self._as_batch(actions, sl.stop - sl.start, f"actions (group {group})")
        self._start(servers, actions, sl.start)
        self._runner.spin()

    def recv(self, group: int | None = None) -> tuple[int, Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Wait for a group's step results: ``(group, observations, rewards, terminations, truncations, infos)``.

        ``group=None`` takes whichever group in flight finishes first; an int waits for that group.
        The arrays cover the group's envs only (``group_slices[group]``), infos likewise.
        """
        self._assert_open()
        in_flight = [g for g, servers in enumerate(self._groups) if self._tasks[servers[0]] is not None]
        if group is None:
            if not in_flight:
                raise NoAsyncCallError("recv: no group has a step in flight; call send first", "recv")
            group = self._runner.run(self._first_group_done(in_flight))
        else:
            self._check_group(group, "recv")
            if group not in in_flight:
                raise NoAsyncCallError(
                    f"recv: group {group} has no step in flight; call send(actions, {group})", "recv"
                )
        return (group, *self._finish(self._groups[group]))

    async def _first_group_done(self, groups: list[int]) -> int:
        deadline = time.monotonic() + self.timeout
        while True:
            for g in groups:
                if all(self._task(i).done() for i in self._groups[g]):
                    return g
            pending = [self._task(i) for g in groups for i in self._groups[g] if not self._task(i).done()]
            done, _ = await asyncio.wait(
                pending, timeout=max(0.0, deadline - time.monotonic()), return_when=asyncio.FIRST_COMPLETED
            )
            if not done:  # the deadline passed: _finish reports the late servers
                return groups[0]

    def _check_group(self, group: Any, method: str) -> None:
        if not isinstance(group, int | np.integer) or not 0 <= group < len(self._groups):
            raise ValueError(f"{method}: group must be an int in [0, {len(self._groups)}), got {group!r}")

    # -- stepping, shared by step/step_async/step_wait and send/recv ------------------------------

    def _start(self, servers: Sequence[int], actions: Any, base: int) -> None:
        """Create one task per server that sends its slice of ``actions`` (a batch starting at env ``base``)."""
        requests = []
        for i in servers:  # all encoded before any is sent: a bad action leaves nothing in flight
            client = self._clients[i]
            start = client.env_offset - base
            request = client.step_request()
            codec.encode_value(slice_batch(actions, start, start + client.num_envs), request.actions, "actions")
            requests.append(request)
        for i, request in zip(servers, requests, strict=True):
            self._tasks[i] = self._runner.create_task(_exchange(self._clients[i], request))

    def _task(self, server: int) -> asyncio.Task[tuple[pb.StepResponse, float]]:
        task = self._tasks[server]
        assert task is not None
        return task

    def _finish(self, servers: Sequence[int]) -> StepResult:
        """Wait for the servers' tasks and join their results (a batch over their envs, in order)."""
        tasks = [self._task(i) for i in servers]
        for i in servers:
            self._tasks[i] = None
        self._runner.wait(tasks, self.timeout)
        errors: list[BaseException] = []
        for i, task in zip(servers, tasks, strict=True):
            if task.cancelled():
                client = self._clients[i]
                errors.append(timeout_error(address=client.address, method="Step", timeout=self.timeout))
            elif task.exception() is not None:
                errors.append(task.exception())  # type: ignore[arg-type]
        self._raise_first(errors)

        base = self._clients[servers[0]].env_offset
        count = sum(self._clients[i].num_envs for i in servers)
        rewards = np.empty(count, dtype=np.float64)
        terminations = np.empty(count, dtype=np.bool_)
        truncations = np.empty(count, dtype=np.bool_)
        parts = []
        for i, task in zip(servers, tasks, strict=True):
            client = self._clients[i]
            response, latency = task.result()
            self._timers[i].record(latency, response.env_seconds)
            start, k = client.env_offset - base, client.num_envs
            obs = codec.decode_value(response.observations, "observations")
            write_batch(self._obs_buffer, obs, client.env_offset)
            rewards[start : start + k] = codec.decode_tensor(response.rewards, "rewards")
            terminations[start : start + k] = codec.decode_tensor(response.terminations, "terminations")
            truncations[start : start + k] = codec.decode_tensor(response.truncations, "truncations")
            parts.append((_infos(response), start, k))
        obs = self._obs_buffer if count == self.num_envs else slice_batch(self._obs_buffer, base, base + count)
        return self._observations(obs), rewards, terminations, truncations, merge_infos(parts, count)

    def _as_batch(self, actions: Any, count: int, where: str) -> Any:
        """Check the leading (env) dimension of ``actions``; the servers check the rest."""
        if isinstance(actions, dict | tuple):
            return actions
        arr = np.asarray(actions)
        if arr.ndim == 0 or len(arr) != count:
            raise ValueError(
                f"{where}: expected a batch of {count} actions (leading dimension {count}, "
                f"as in action_space {self.action_space}), got shape {arr.shape}"
            )
        return arr

    def _observations(self, obs: Any) -> Any:
        return deepcopy(obs) if self.copy else obs

    def _assert_open(self) -> None:
        if self.closed:
            raise ClosedEnvironmentError("this RemoteVectorEnv is closed; create a new one to keep stepping")

    def _assert_idle(self, method: str) -> None:
        self._assert_open()
        if self._state is not AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"{method}: a call to `{self._state.value}` is still pending; call step_wait first", self._state.value
            )
        busy = [g for g, servers in enumerate(self._groups) if any(self._tasks[i] is not None for i in servers)]
        if busy:
            raise AlreadyPendingCallError(
                f"{method}: group(s) {busy} have a step in flight (send); call recv for each first", "send"
            )

    def _raise_first(self, errors: Sequence[BaseException]) -> None:
        if errors:
            self._stale = True  # the servers that answered moved on; the caller saw none of it
        _raise_first(errors)

    # -- servers joining and leaving ----------------------------------------------------------------

    def refresh(self, *, drop: Iterable[str] = (), wait: float = 1.0) -> FleetChange | None:
        """Look the servers up again: connect to servers that appeared, let go of those that left.

        Call it between rollouts, with no step in flight. Servers that stay keep their envs, and
        the episodes in them, in order; the envs of servers that join come after them, freshly reset.
        ``num_envs`` and the batched spaces follow. A server leaves when its address no longer
        resolves (``docker compose up --scale env=N`` removed it), when its session ended (it stopped
        or restarted), or when it is named in ``drop`` (a call to it failed); it is let go (released)
        and joins again, with fresh envs, once it resolves and answers a handshake. A new server has
        ``wait`` seconds to answer; one still starting keeps connecting in the background and joins
        at a later refresh. A server whose spaces differ from the fleet's is left out (and logged).
        If the last step or reset failed, every env starts over (those that answered moved on unseen).

        Returns:
            None when nothing changed, else a :class:`~learner.fleet.FleetChange`: who joined and
            left, and for each env now its index before (-1 for new envs) and current observation.

        Raises:
            ServerUnavailableError: no server is left, even after ``connect_timeout`` seconds for those
                listed to answer again (the env is then of no further use: close it).
        """
        self._assert_idle("refresh")
        if not wait >= 0:
            raise ValueError(f"wait: expected seconds >= 0, got {wait!r}")
        dropped = set(drop)
        try:
            resolved = expand_addresses(self._address_spec)
        except AddressError as err:
            log.warning("refresh: %s; keeping the %d servers connected now", err, len(self._clients))
            resolved = self.addresses
        stay = [c for c in self._clients if c.address in resolved and c.address not in dropped and not c.session_ended]
        leave = [c for c in self._clients if c not in stay]
        # Let go of those that left first: a server that comes back must not find itself claimed by us.
        self._runner.run(gather(*(c.close() for c in leave), return_exceptions=True))
        wanted = [a for a in resolved if a not in {c.address for c in stay}]
        joined = self._runner.run(self._join(wanted, wait))
        if not stay and not joined:
            # Every connection dropped at once (an overloaded host, a network blip): give the servers
            # connect_timeout to answer again before giving up.
            joined = self._runner.run(self._join(wanted, self.connect_timeout, everyone=True))
        if not leave and not joined and not self._stale:
            return None
        # Envs that start over: those of new servers, and every env after a failed call. A server whose
        # reset fails leaves as well (several replicas stopping at once fail one after another).
        restart = [*stay, *joined] if self._stale else joined
        results = self._runner.run(gather(*(c.reset(None, None, None) for c in restart), return_exceptions=True))
        resets: dict[str, pb.ResetResponse] = {}
        failed: list[EnvClient] = []
        for client, response in zip(restart, results, strict=True):
            if isinstance(response, BaseException):
                log.warning("refresh: env server %s leaves the fleet: %s", client.address, response)
                failed.append(client)
            else:
                resets[client.address] = response
        leave += [c for c in stay if c in failed]
        stay, joined = [c for c in stay if c not in failed], [c for c in joined if c not in failed]
        if not stay and not joined:
            raise ServerUnavailableError(
                f"refresh: no env server left: {', '.join(c.address for c in leave)} left, and none of "
                f"{', '.join(resolved) or 'no address'} ({self._address_spec}) joined",
                address=leave[0].address,  # every server left: the fleet is never empty
            )
        self._runner.run(gather(*(c.close() for c in failed), return_exceptions=True))

        # The new layout: envs of servers that stay first (with their observations, unless they were
        # reset), then those of new servers.
        clients = stay + joined
        previous_index: list[int] = []
        observations = create_empty_array(self.single_observation_space, sum(c.num_envs for c in clients), fn=np.zeros)
        parts = []
        offset = 0
        for client in clients:
            response = resets.get(client.address)
            if response is not None:
                previous_index += [-1] * client.num_envs
                write_batch(observations, codec.decode_value(response.observations, "observations"), offset)
                parts.append((_infos(response), offset, client.num_envs))
            else:
                previous_index += range(client.env_offset, client.env_offset + client.num_envs)
                old = slice_batch(self._obs_buffer, client.env_offset, client.env_offset + client.num_envs)
                write_batch(observations, old, offset)
            client.env_offset = offset
            offset += client.num_envs

        previous_num_envs, timers = self.num_envs, {t.address: t for t in self._timers}
        self._clients, self.num_envs, self._obs_buffer = clients, offset, observations
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self._tasks = [None] * len(clients)
        self._groups = _split(len(clients), min(self._num_groups_asked, len(clients)))
        self._timers = [timers.get(c.address) or StepTimer(c.address, c.num_envs) for c in clients]
        self._stale = False
        log.info(
            "fleet changed: %d server(s) joined (%s), %d left (%s); %d envs, was %d",
            len(joined),
            ", ".join(c.address for c in joined) or "-",
            len(leave),
            ", ".join(c.address for c in leave) or "-",
            self.num_envs,
            previous_num_envs,
        )
        return FleetChange(
            added=tuple(c.address for c in joined),
            removed=tuple(c.address for c in leave),
            num_envs=self.num_envs,
            previous_num_envs=previous_num_envs,
            previous_index=np.array(previous_index, dtype=np.int64),
            observations=self._observations(self._obs_buffer),
            infos=merge_infos(parts, self.num_envs),
        )

    async def _join(self, addresses: list[str], wait: float, everyone: bool = False) -> list[EnvClient]:
        """The servers at ``addresses`` that answer a handshake and serve the fleet's env.

        Servers seen for the first time (or, with ``everyone``, all those still connecting) get ``wait``
        seconds to connect; the others join if they are connected by now.
        """
        for address in [a for a in self._joining if a not in addresses]:  # no longer listed
            client, ready = self._joining.pop(address)
            ready.cancel()
            await client.close()
        fresh = []
        for address in addresses:
            if address not in self._joining:
                client = EnvClient(
                    address, timeout=self.timeout, client_name=self._client_name, metadata=self._metadata
                )
                self._joining[address] = (client, asyncio.ensure_future(client.wait_ready()))
                fresh.append(self._joining[address][1])
        # Only servers seen for the first time are waited for: one that stays listed without answering
        # must not hold up every rollout.
        if everyone:
            fresh = [ready for _, ready in self._joining.values()]
        if fresh and wait > 0:
            await asyncio.wait(
                fresh, timeout=wait, return_when=asyncio.FIRST_COMPLETED if everyone else asyncio.ALL_COMPLETED
            )
        answered = [client for client, ready in self._joining.values() if ready.done()]
        for client in answered:
            del self._joining[client.address]
        responses = await gather(*(c.handshake() for c in answered), return_exceptions=True)
        joined = []
        for client, response in zip(answered, responses, strict=True):
            problem = str(response) if isinstance(response, BaseException) else self._spec_mismatch(response.spec)
            if problem:
                # Logged once per server: it is tried again at every refresh while it stays listed.
                (log.warning if client.address not in self._noted else log.debug)(
                    "refresh: env server %s does not join: %s", client.address, problem
                )
                self._noted.add(client.address)
                if not isinstance(response, BaseException):
                    client.start_session(response)  # so that close() releases the claim
                await client.close()
                continue
            client.start_session(response)
            self._noted.discard(client.address)
            joined.append(client)
        return joined

    def _spec_mismatch(self, spec: pb.EnvSpec) -> str | None:
        for field in ("observation_space", "action_space", "autoreset_mode"):
            if getattr(spec, field) != getattr(self._spec, field):
                return f"its {field} differs from the fleet's ({spec.env_id}, not {self._spec.env_id})"
        return None

    # -- statistics -------------------------------------------------------------------------------

    def replica_stats(self, *, reset: bool = False) -> list[ReplicaStats]:
        """Each server's step latency (p50, p99), env time and throughput since the last reset.

        ``reset=True`` starts a new window after reading (e.g. once per training iteration).
        """
        stats = [timer.stats() for timer in self._timers]
        if reset:
            for timer in self._timers:
                timer.reset()
        return stats

    # -- closing ----------------------------------------------------------------------------------

    def render(self) -> tuple[Any, ...] | None:
        raise NotImplementedError("RemoteVectorEnv does not render: rendering happens on the env servers")

    def close_extras(self, **kwargs: Any) -> None:
        """Release every server's envs for the next learner and close the connections."""
        self._close_clients()

    def _close_clients(self) -> None:
        tasks: list[asyncio.Future[Any]] = [t for t in self._tasks if t is not None]
        joining = [client for client, _ in self._joining.values()]
        tasks += [ready for _, ready in self._joining.values()]
        self._tasks = [None] * len(self._tasks)
        self._joining = {}
        self._state = AsyncState.DEFAULT
        with contextlib.suppress(Exception):
            self._runner.run_or_schedule(_close_all(self._clients + joining, tasks))

    def __enter__(self) -> RemoteVectorEnv:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            with contextlib.suppress(Exception):  # interpreter shutdown: nothing sensible left to do
                self.close()

    def __repr__(self) -> str:
        return f"RemoteVectorEnv({self.addresses!r}, num_envs={getattr(self, 'num_envs', '?')})"


async def _exchange(client: EnvClient, request: pb.StepRequest) -> tuple[pb.StepResponse, float]:
    """One step of one server: its answer and the round trip in seconds."""
    start = time.perf_counter()
    response = await client.step(request)
    return response, time.perf_counter() - start


def _infos(response: pb.StepResponse | pb.ResetResponse) -> dict[str, Any]:
    """A response's vector infos (an empty dict, the common case, without decoding)."""
    if not response.HasField("infos") or (response.infos.WhichOneof("kind") == "map" and not response.infos.map.keys):
        return {}
    infos = codec.decode_value(response.infos, "infos")
    if not isinstance(infos, dict):
        raise codec.CodecError(f"infos: expected a map, got {type(infos).__name__}")
    return infos


async def _close_all(clients: list[EnvClient], tasks: list[asyncio.Future[Any]]) -> None:
    """Cancel the steps in flight, then release every server and close the connections."""
    for task in tasks:
        task.cancel()
    await gather(*tasks, return_exceptions=True)
    await gather(*(c.close() for c in clients), return_exceptions=True)


def _split(num_servers: int, num_groups: int) -> list[list[int]]:
    """Server indices of each of ``num_groups`` contiguous groups, as even as possible."""
    bounds = np.linspace(0, num_servers, num_groups + 1).round().astype(int)
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds)]


def _raise_first(errors: Sequence[BaseException]) -> None:
    """Raise the first error (in server order), logging the others."""
    if not errors:
        return
    for err in errors[1:]:
        log.warning("%s", err)
    raise errors[0]
