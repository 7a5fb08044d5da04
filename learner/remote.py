"""RemoteVectorEnv: many env servers presented as one gymnasium VectorEnv."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from copy import deepcopy
from typing import Any

import grpc
import gymnasium as gym
import numpy as np
from gymnasium.error import AlreadyPendingCallError, ClosedEnvironmentError, NoAsyncCallError
from gymnasium.vector.async_vector_env import AsyncState
from gymnasium.vector.utils import batch_space, create_empty_array

from env_server import codec
from env_server.rpc import env_pb2 as pb
from learner.batching import merge_infos, slice_batch, write_batch
from learner.client import EnvClient
from learner.discovery import expand_addresses
from learner.errors import RemoteEnvError, ServerUnavailableError, SpecMismatchError

__all__ = ["RemoteVectorEnv"]

log = logging.getLogger(__name__)


class RemoteVectorEnv(gym.vector.VectorEnv):
    """Env servers reached over gRPC, as one ``gymnasium.vector.VectorEnv``.

    Envs are numbered over all servers in address order: server 0's K0 envs first, then server 1's,
    and so on. Every call goes to all servers at once and waits for all of them.

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
        copy: return fresh arrays from reset/step (True) or the same buffers each time (False,
            faster; the next call overwrites them), as gymnasium's ``copy`` argument.
        auth_token: token sent with every call, for servers started with ``--auth-token``.
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
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout: expected seconds > 0, got {timeout!r}")
        if not connect_timeout > 0:
            raise ValueError(f"connect_timeout: expected seconds > 0, got {connect_timeout!r}")
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.copy = copy
        self._client_name = client_name
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self._state = AsyncState.DEFAULT
        self._pending: list[tuple[EnvClient, grpc.Future]] = []
        self.closed = False
        self._clients: list[EnvClient] = []

        endpoints = expand_addresses(addresses)
        self._clients = self._connect(endpoints)
        specs = [c.spec for c in self._clients]
        assert all(s is not None for s in specs)
        self._check_specs()
        first = self._clients[0].spec
        assert first is not None
        self.single_observation_space = codec.decode_space(first.observation_space, "observation_space")
        self.single_action_space = codec.decode_space(first.action_space, "action_space")
        self.num_envs = sum(c.spec.num_envs for c in self._clients if c.spec is not None)
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.metadata = {
            "autoreset_mode": codec.AUTORESET_FROM_PROTO[first.autoreset_mode],
            "render_modes": list(first.render_modes),
        }
        if first.HasField("render_fps"):
            self.metadata["render_fps"] = first.render_fps
        self._obs_buffer = create_empty_array(self.single_observation_space, self.num_envs, fn=np.zeros)
        log.info(
            "connected to %d env server(s), %d envs of %s: %s",
            len(self._clients),
            self.num_envs,
            first.env_id,
            ", ".join(self.addresses),
        )

    # -- connecting -------------------------------------------------------------------------------

    def _connect(self, endpoints: list[str]) -> list[EnvClient]:
        clients: list[EnvClient] = []
        try:
            for address in endpoints:
                clients.append(
                    EnvClient(address, timeout=self.timeout, client_name=self._client_name, metadata=self._metadata)
                )
            # Connect to all servers at once, within one shared deadline.
            deadline = time.monotonic() + self.connect_timeout
            readies = [c.ready_future() for c in clients]
            for client, ready in zip(clients, readies, strict=False):
                try:
                    ready.result(timeout=max(0.0, deadline - time.monotonic()))
                except grpc.FutureTimeoutError:
                    for other in readies:
                        other.cancel()
                    raise ServerUnavailableError(
                        f"env server {client.address}: nothing answered within {self.connect_timeout:g} s "
                        "(is the server running, and is the address right?)",
                        address=client.address,
                    ) from None
            handshakes = [c.handshake_future() for c in clients]
            errors: list[RemoteEnvError] = []
            offset = 0
            for client, future in zip(clients, handshakes, strict=False):
                try:
                    response = client.call(future, "Handshake")
                except RemoteEnvError as err:
                    errors.append(err)
                    continue
                client.start_session(response)
                client.env_offset = offset
                offset += response.spec.num_envs
            if errors:
                raise errors[0]
        except BaseException:
            for client in clients:
                client.close()
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
                    for c in self._clients:
                        c.close()
                    raise SpecMismatchError(
                        f"{field} differs between env servers {first.address} ({first.spec.env_id}) and "
                        f"{client.address} ({spec.env_id}); one RemoteVectorEnv needs servers of the same env"
                    )

    @property
    def addresses(self) -> list[str]:
        """The servers' addresses, in env order."""
        return [c.address for c in self._clients]

    @property
    def env_slices(self) -> list[slice]:
        """For each server, the slice of the fleet's envs it hosts."""
        return [slice(c.env_offset, c.env_offset + self._num_envs_of(c)) for c in self._clients]

    @staticmethod
    def _num_envs_of(client: EnvClient) -> int:
        assert client.spec is not None
        return int(client.spec.num_envs)

    # -- the VectorEnv API --------------------------------------------------------------------------

    def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, dict[str, Any]]:
        """Reset every env (or those in ``options["reset_mask"]``); env i gets seed ``seed + i``."""
        self._assert_open()
        if self._state is not AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"reset: a call to `{self._state.value}` is still pending; call step_wait first", self._state.value
            )
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

        calls: list[tuple[EnvClient, grpc.Future]] = []
        for client, sl in zip(self._clients, self.env_slices, strict=False):
            sub_mask = None if mask is None else mask[sl]
            if sub_mask is not None and not sub_mask.any():
                continue
            sub_seeds = None if seeds is None else seeds[sl]
            calls.append(
                (
                    client,
                    client.reset_future(sub_seeds, encoded_options, None if sub_mask is None else sub_mask.tolist()),
                )
            )
        responses = self._collect(calls, "Reset")
        parts = []
        for client, response in responses:
            obs = codec.decode_value(response.observations, "observations")
            write_batch(self._obs_buffer, obs, client.env_offset)
            infos = codec.decode_value(response.infos, "infos") if response.HasField("infos") else {}
            parts.append((infos, client.env_offset, self._num_envs_of(client)))
        infos = merge_infos(parts, self.num_envs)
        return self._observations(), infos

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

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every env with its action; see :meth:`step_async` and :meth:`step_wait`."""
        self.step_async(actions)
        return self.step_wait()

    def step_async(self, actions: Any) -> None:
        """Send each server its envs' actions, without waiting for the results."""
        self._assert_open()
        if self._state is not AsyncState.DEFAULT:
            raise AlreadyPendingCallError(
                f"step_async: a call to `{self._state.value}` is still pending; call step_wait first", self._state.value
            )
        actions = self._as_batch(actions)
        calls = []
        for client, sl in zip(self._clients, self.env_slices, strict=False):
            part = slice_batch(actions, sl.start, sl.stop)
            value = codec.encode_value(part, pb.Value(), "actions")
            calls.append((client, client.step_future(value)))
        self._pending = calls
        self._state = AsyncState.WAITING_STEP

    def step_wait(self) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Wait for every server's step results and join them into one batch."""
        self._assert_open()
        if self._state is not AsyncState.WAITING_STEP:
            raise NoAsyncCallError(
                "step_wait: no step_async call is pending; call step_async first", AsyncState.WAITING_STEP.value
            )
        calls, self._pending = self._pending, []
        self._state = AsyncState.DEFAULT
        responses = self._collect(calls, "Step")
        rewards = np.empty(self.num_envs, dtype=np.float64)
        terminations = np.empty(self.num_envs, dtype=np.bool_)
        truncations = np.empty(self.num_envs, dtype=np.bool_)
        parts = []
        for client, response in responses:
            start, count = client.env_offset, self._num_envs_of(client)
            obs = codec.decode_value(response.observations, "observations")
            write_batch(self._obs_buffer, obs, start)
            rewards[start : start + count] = codec.decode_tensor(response.rewards, "rewards")
            terminations[start : start + count] = codec.decode_tensor(response.terminations, "terminations")
            truncations[start : start + count] = codec.decode_tensor(response.truncations, "truncations")
            infos = codec.decode_value(response.infos, "infos") if response.HasField("infos") else {}
            parts.append((infos, start, count))
        return self._observations(), rewards, terminations, truncations, merge_infos(parts, self.num_envs)

    def _as_batch(self, actions: Any) -> Any:
        """Check the leading (env) dimension of ``actions``; the servers check the rest."""
        if isinstance(actions, dict | tuple):
            return actions
        arr = np.asarray(actions)
        if arr.ndim == 0 or len(arr) != self.num_envs:
            raise ValueError(
                f"actions: expected a batch of {self.num_envs} actions (leading dimension {self.num_envs}, "
                f"as in action_space {self.action_space}), got shape {arr.shape}"
            )
        return arr

    def _collect(self, calls: list[tuple[EnvClient, grpc.Future]], method: str) -> list[tuple[EnvClient, Any]]:
        """Wait for every call; raise the first failure (in server order) after all have finished."""
        results: list[tuple[EnvClient, Any]] = []
        first_error: RemoteEnvError | None = None
        for client, future in calls:
            try:
                results.append((client, client.call(future, method)))
            except RemoteEnvError as err:
                if first_error is None:
                    first_error = err
                else:
                    log.warning("%s", err)
        if first_error is not None:
            raise first_error
        return results

    def _observations(self) -> Any:
        return deepcopy(self._obs_buffer) if self.copy else self._obs_buffer

    def _assert_open(self) -> None:
        if self.closed:
            raise ClosedEnvironmentError("this RemoteVectorEnv is closed; create a new one to keep stepping")

    def render(self) -> tuple[Any, ...] | None:
        raise NotImplementedError("RemoteVectorEnv does not render: rendering happens on the env servers")

    def close_extras(self, **kwargs: Any) -> None:
        """Release every server's envs for the next learner and close the connections."""
        for _, future in self._pending:
            future.cancel()
        self._pending = []
        self._state = AsyncState.DEFAULT
        for client in self._clients:
            client.close()

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
