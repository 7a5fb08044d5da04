"""The vector env a run steps: local env servers it starts, running servers, or in-process gymnasium."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import gymnasium as gym
import numpy as np

from env_server.config import ServerConfig
from env_server.envs import build_vector_env, env_kwargs_json, max_episode_steps
from env_server.isolation import tell_positions
from env_server.protocol import KEEPALIVE_TIMEOUT
from learner.config import DEFAULT_ENV, Args, is_atari
from learner.discovery import expand_when_ready, split_addresses
from learner.local import DEFAULT_TRANSPORT, HANG_TIMEOUT_S, STARTUP_TIMEOUT_S, LocalServers, label_of
from learner.remote import DEFAULT_CONNECT_TIMEOUT, RemoteVectorEnv

__all__ = ["FleetSpec", "env_server_of", "fleet_spec", "open_fleet", "raw_atari_frames", "reward_threshold"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetSpec:
    """Where a run's envs come from."""

    env: str
    """gymnasium id or entry point (for local servers and the gym backend)."""
    servers: str | None = None
    """Addresses of running servers; None starts local ones (or builds in-process envs)."""
    backend: Literal["remote", "gym"] = "remote"
    num_servers: int = 2
    envs_per_server: int = 4
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    wrappers: tuple[str, ...] = ()
    step_delay_ms: float = 0.0
    max_episode_steps: int | None = None
    """The time limit of the local servers' envs (env-server --max-episode-steps); None: the env's own."""
    transport: Literal["tcp", "unix"] = DEFAULT_TRANSPORT
    step_socket: bool = True
    """Step servers reached over Unix sockets on their step socket (RemoteVectorEnv(step_socket=...))."""
    auth_token: str | None = field(default=None, repr=False)
    timeout: float = 30.0
    reset_timeout: float | None = None
    """Seconds a reset may take (RemoteVectorEnv(reset_timeout=...)); None: ``timeout``."""
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT
    """Seconds to wait at the start for the servers (RemoteVectorEnv(connect_timeout=...))."""
    keepalive_timeout: float = KEEPALIVE_TIMEOUT
    """Seconds a server has to answer a keepalive ping (RemoteVectorEnv(keepalive_timeout=...))."""
    pipeline_groups: int = 1
    """Groups of servers for send/recv pipelining (at most one per server)."""
    fault_tolerant: bool = True
    """Servers that fail cost their own envs only (RemoteVectorEnv(fault_tolerant=True))."""
    give_up_after: float = 60.0
    """Fault-tolerant: stop once every server has been down this long (seconds)."""
    hang_timeout: float | None = None
    """Local servers' ``env-server --hang-timeout`` (0: never); None: HANG_TIMEOUT_S, or twice the
    learner's deadlines where more (an env call the learner would still wait for is not a hang)."""
    tls: bool | str = False
    """False, True (system CA roots) or the path of a CA file (see RemoteVectorEnv)."""
    tls_server_name: str | None = None
    tls_client_cert: str | None = None
    """The client certificate (PEM file) for servers that require one (see RemoteVectorEnv)."""
    tls_client_key: str | None = None
    """Its private key (PEM file)."""
    label_prefix: str = "local"
    """How local servers are named (LocalServers(label_prefix=...)): ``local-0``, ... for training's, ``eval-0``
    for ``learner train --eval-every``'s evaluation server (running beside them, told apart in log lines)."""

    def describe(self) -> str:
        extras = (f", wrappers {','.join(self.wrappers)}" if self.wrappers else "") + (
            f", step delay {self.step_delay_ms:g} ms" if self.step_delay_ms else ""
        )
        if self.backend == "gym":
            return f"in-process gymnasium SyncVectorEnv, {self.num_servers * self.envs_per_server} x {self.env}{extras}"
        if self.servers is not None:
            # (the addresses as read, not as typed: "a:1,,b:2 " is a:1,b:2, its blanks ignored as when connecting)
            return f"env servers at {','.join(split_addresses(self.servers))}"
        how = "loopback TCP" if self.transport == "tcp" else "Unix sockets"
        if self.transport == "unix":
            how += ", steps on their step sockets" if self.step_socket else ", steps over gRPC"
        servers = "local env server" if self.num_servers == 1 else "local env servers"
        envs = "env" if self.envs_per_server == 1 else "envs"
        return f"{self.num_servers} {servers} x {self.envs_per_server} {self.env} {envs} ({how}){extras}"


def fleet_spec(args: Args) -> FleetSpec:
    """Where ``learner train``'s envs come from, as its options (``args``) say."""
    servers, envs_per_server = args.local_layout()
    return FleetSpec(
        env=args.env or DEFAULT_ENV,  # None only with --servers, where the servers decide
        servers=args.servers,
        backend=args.backend,
        num_servers=servers,
        envs_per_server=envs_per_server,
        env_kwargs=dict(args.env_kwargs),
        wrappers=args.server_wrappers(),
        step_delay_ms=args.step_delay_ms,
        max_episode_steps=args.max_episode_steps,
        transport=args.transport,
        step_socket=args.step_socket,
        auth_token=args.auth_token,
        timeout=args.timeout,
        reset_timeout=args.reset_timeout,
        connect_timeout=args.connect_timeout,
        keepalive_timeout=args.keepalive_timeout,
        pipeline_groups=args.pipeline_groups,
        fault_tolerant=args.fault_tolerant,
        give_up_after=args.give_up_after,
        hang_timeout=args.hang_timeout,
        tls=args.tls_ca or args.tls,
        tls_server_name=args.tls_server_name,
        tls_client_cert=args.tls_client_cert,
        tls_client_key=args.tls_client_key,
    )


@contextlib.contextmanager
def open_fleet(spec: FleetSpec) -> Iterator[gym.vector.VectorEnv]:
    """The vector env ``spec`` describes, closed (and local servers stopped) when the block ends."""
    with contextlib.ExitStack() as stack:
        if spec.backend == "gym":
            # The very code an env server builds its envs with, so both backends step the same envs.
            config = ServerConfig(
                env=spec.env,
                num_envs=spec.num_servers * spec.envs_per_server,
                env_kwargs=dict(spec.env_kwargs),
                wrappers=spec.wrappers,
                step_delay_ms=spec.step_delay_ms,
                max_episode_steps=spec.max_episode_steps,
            )
            # (a second Ctrl-C in an env's step aborts; an error names an env "in-process env 2", no server's)
            envs = build_vector_env(config, ctrl_c=True, in_process=True)
            tell_positions(envs)  # (their errors name them: "env 2's observation_space changed", as a server's do)
            stack.push(functools.partial(_close_in_process, envs))
            # What the envs are made with, as a server says of its own (EnvSpec): for config.json.
            made_with = env_kwargs_json(config)
            envs.env_kwargs = json.loads(made_with) if made_with else {}  # type: ignore[attr-defined]
            envs.time_limit = max_episode_steps(envs, config) or None  # type: ignore[attr-defined]
            yield envs
            return
        addresses: str | Sequence[str]
        if spec.servers is not None:
            # As given (compose:env, dns:///...), so that RemoteVectorEnv.refresh can look it up again.
            addresses = spec.servers
        else:
            server_args = []
            if spec.wrappers:
                server_args += ["--wrappers", ",".join(spec.wrappers)]
            if spec.step_delay_ms:
                server_args += ["--step-delay-ms", f"{spec.step_delay_ms:g}"]
            if spec.max_episode_steps is not None:
                server_args += ["--max-episode-steps", str(spec.max_episode_steps)]
            servers = LocalServers(
                spec.env,
                spec.num_servers,
                spec.envs_per_server,
                env_kwargs=dict(spec.env_kwargs),
                server_args=server_args,
                transport=spec.transport,
                auth_token=spec.auth_token,
                hang_timeout=_hang_timeout(spec),
                # (envs that take long to build: --connect-timeout, "raise it where servers take a while
                # to come up", covers the servers started here too)
                startup_timeout=max(STARTUP_TIMEOUT_S, spec.connect_timeout),
                label_prefix=spec.label_prefix,
            )
            stack.callback(servers.close)
            addresses = servers.addresses
        groups = (
            min(spec.pipeline_groups, len(expand_when_ready(addresses, spec.connect_timeout)))
            if spec.pipeline_groups > 1
            else 1
        )
        if groups < spec.pipeline_groups:  # (only --servers get here: local layouts are checked up front)
            log.warning(
                "--pipeline-groups %d: expected at most one group per env server, and %s has %d: %d group%s",
                spec.pipeline_groups,
                spec.servers,
                groups,
                groups,
                ", so no pipelining" if groups == 1 else "s",
            )
        remote = RemoteVectorEnv(
            addresses,
            timeout=spec.timeout,
            reset_timeout=spec.reset_timeout,
            connect_timeout=spec.connect_timeout,
            keepalive_timeout=spec.keepalive_timeout,
            auth_token=spec.auth_token,
            copy=False,
            num_groups=groups,
            fault_tolerant=spec.fault_tolerant,
            give_up_after=spec.give_up_after,
            step_socket=spec.step_socket,
            tls=spec.tls,
            tls_server_name=spec.tls_server_name,
            tls_client_cert=spec.tls_client_cert,
            tls_client_key=spec.tls_client_key,
        )
        stack.callback(remote.close)
        yield remote


def _close_in_process(envs: gym.vector.VectorEnv, exc_type: type[BaseException] | None, *_: Any) -> bool:
    """Close in-process envs as the block that used them ends (ExitStack.push): an env whose close() raises costs
    a warning, not a finished run (its checkpoints and summary written) turned into a traceback and exit status 1,
    nor the error the block ended with."""
    try:
        envs.close()
    except Exception as err:
        text = " ".join(str(err).split())
        log.warning(
            "the env's close() raised %s%s%s",
            type(err).__name__,
            f": {text}" if text else "",
            "; the run is complete" if exc_type is None else "",
        )
    return False


def reward_threshold(env: str) -> float | None:
    """The return at which the env counts as solved (its registered ``reward_threshold``), if any."""
    try:
        threshold = gym.spec(env).reward_threshold
    except Exception:  # not a registered id (an entry point, or an id whose package is not imported)
        return None
    return None if threshold is None else float(threshold)


def raw_atari_frames(env_id: str, wrappers: Sequence[str], observation_space: gym.Space[Any]) -> str:
    """A warning when an ALE game's envs serve raw frames (210x160 RGB, ~100 KB a step each, or grayscale:
    obs_type), not the atari wrapper's 4x84x84 stacks the Nature CNN and the atari preset are made for;
    "" otherwise."""
    space = observation_space
    raw = isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 and len(space.shape) in (2, 3)
    if not (is_atari(env_id) and "atari" not in wrappers and raw):
        return ""
    ratio = math.prod(space.shape or ()) / (4 * 84 * 84)  # (the bytes of a raw frame against a stack's)
    return (
        f"{env_id} without the env server's atari wrapper: its envs serve raw frames, {space}, not the "
        "4x84x84 frame stacks of the standard preprocessing (grayscale, frame skip 4, 4 frames stacked), which "
        f"the atari preset is tuned for (a raw frame is {ratio:.2g}x the bytes of a stack); serve them with the atari wrapper "
        "(env-server --wrappers atari; learner train's own servers: --wrappers auto or atari)"
    )


def _hang_timeout(spec: FleetSpec) -> float:
    """The local servers' --hang-timeout: as given, or one that no env call the learner would still wait
    for reaches (slow resets: --reset-timeout)."""
    if spec.hang_timeout is not None:
        if 0 < spec.hang_timeout < max(spec.timeout, spec.reset_timeout or 0.0):
            log.warning(
                "--hang-timeout %g: below the learner's own deadline (--timeout %g, --reset-timeout %s): a server "
                "whose env call outlasts it exits and restarts where the learner would still have waited",
                spec.hang_timeout,
                spec.timeout,
                "unset" if spec.reset_timeout is None else f"{spec.reset_timeout:g}",
            )
        return spec.hang_timeout
    return max(HANG_TIMEOUT_S, 2 * max(spec.timeout, spec.reset_timeout or 0.0))


def server_of(envs: Any, env: int) -> tuple[str, int] | None:
    """The env server env ``env`` (counted over the fleet) runs on and its index there, as that server counts
    its envs (``envs.addresses`` and ``envs.env_slices``: RemoteVectorEnv's, as of now: the fleet may have
    changed since the run began); None for in-process envs."""
    slices = getattr(envs, "env_slices", None)
    addresses = getattr(envs, "addresses", None)
    if slices is None or addresses is None:
        return None
    for address, envs_of in zip(addresses, slices, strict=False):
        if envs_of.start <= env < envs_of.stop:
            return address, env - envs_of.start
    return None


def env_server_of(envs: Any, env: int) -> str:
    """What names where env ``env`` runs (:func:`server_of`), as the start of an error's message: "env server
    ADDRESS: " on a fleet of env servers (a server this process started: "env server local-0: "), "" for
    in-process envs."""
    where = server_of(envs, env)
    return f"env server {label_of(where[0])}: " if where is not None else ""
