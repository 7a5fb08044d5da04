"""``learner servers``: what each env server of a fleet serves, how far it is, and who holds it, without
claiming it (GetSpec needs no claim), so a running training is not disturbed."""

from __future__ import annotations

import asyncio
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc

from env_server import codec
from env_server.protocol import bearer_metadata
from learner.client import EnvClient, channel_credentials, server_text, spread_calls_text
from learner.discovery import diagnose, expand_named, probe_until
from learner.errors import RemoteEnvError
from learner.local import label_of
from learner.loop import LoopRunner, gather

__all__ = ["ServerInfo", "describe", "survey"]

ROUND_TRIPS = 5
"""GetSpec calls timed per server (the median is its round trip)."""
TIMED_AT_ONCE = 4
"""Servers whose round trips are timed at once (see _ask)."""


@dataclass
class ServerInfo:
    """One server's answer (or why there was none)."""

    address: str
    error: str = ""
    """Why it gave no spec ("" when it did)."""
    env_id: str = ""
    num_envs: int = 0
    observation_space: str = ""
    action_space: str = ""
    vectorization: str = ""
    autoreset_mode: str = ""
    max_episode_steps: int = 0
    wrappers: list[str] = field(default_factory=list)
    env_kwargs: str | None = None
    """The kwargs its envs are made with, as JSON ("" for none); None from a server too old to say."""
    versions: dict[str, str] = field(default_factory=dict)
    claimed_by: str = ""
    """Who holds its envs now ("" when no learner does)."""
    note: str = ""
    """What else the server says of its state (GetSpecResponse.note): its envs' last rebuild failed, and why."""
    round_trip_ms: float = 0.0
    """Median GetSpec round trip, ms."""
    server_id: str = ""
    servers_reached: int = 1
    """How many servers (by server id) its address's calls reached: more than one behind a proxy that spreads
    calls over several, which a learner cannot use (its session is one server's); then ``error`` says so."""
    reached_ids: tuple[str, ...] = ()
    """Their server ids, where more than one."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def survey(
    addresses: str,
    *,
    timeout: float = 5.0,
    auth_token: str | None = None,
    tls: bool | str = False,
    tls_server_name: str | None = None,
    tls_client_cert: str | None = None,
    tls_client_key: str | None = None,
) -> list[ServerInfo]:
    """Ask every server ``addresses`` names (``host:port,...``, ``dns:///``, ``compose:``, ...) for its spec
    and who holds it, all at once, each within ``timeout`` seconds (``tls...``: as RemoteVectorEnv's)."""
    named = expand_named(addresses, timeout)
    credentials, roots = channel_credentials(tls, tls_client_cert, tls_client_key)
    client_cert = None if tls_client_cert is None or tls_client_key is None else (tls_client_cert, tls_client_key)
    metadata = bearer_metadata(auth_token) if auth_token else ()

    async def ask(address: str, dns_name: str | None) -> ServerInfo:
        name = tls_server_name or (dns_name if credentials is not None else None)
        client = EnvClient(
            address,
            timeout=timeout,
            metadata=metadata,
            credentials=credentials,
            tls_server_name=name,
            step_socket=False,
        )
        why = functools.partial(
            diagnose, tls=credentials is not None, roots=roots, server_name=name, client_cert=client_cert
        )
        try:
            return await _ask(client, timeout, why, timing)
        finally:
            await client.close()

    async def ask_all() -> list[ServerInfo]:
        return list(await gather(*(ask(a, n) for a, n in named.items())))

    timing = asyncio.Semaphore(TIMED_AT_ONCE)  # (made here: it is bound to the loop it is first used on)

    # (on this thread's LoopRunner, as a fleet's calls: a Ctrl-C then never lands inside one of gRPC's
    # callbacks, which would swallow it and leave its call's task waiting for ever; and from a notebook,
    # whose own loop runs in this thread, it works, where asyncio.run refused)
    return LoopRunner.for_this_thread().run(ask_all)


async def _ask(
    client: EnvClient, timeout: float, diagnose: Callable[[str, float], str | None], timing: asyncio.Semaphore
) -> ServerInfo:
    """What the server at ``client`` says of itself, its round trip timed while ``timing`` is held: a few
    servers' at a time (:data:`TIMED_AT_ONCE`), as 64 servers' timed at once measured this process's loop
    juggling their calls (78 ms where each took 1.6 ms), and one at a time made a survey of distant servers
    last servers x 5 round trips."""
    info = ServerInfo(client.address)
    # A connection refused (or no socket file, a TLS mismatch, an HTTP port, ...) is said at once; something
    # that listens and may be a gRPC server gets the timeout. (On a thread of its own: asyncio's executor has
    # a few threads, each held up to 1 s by an address that does not answer, so 64 such took 23 s, not 5.)
    # (waited for past its own 1 s: a connection that times out takes that long, its TLS probe as long again)
    within = min(timeout, 1.0)
    why = await probe_until(client.address, time.monotonic() + 2 * within + 0.5, lambda a, _: diagnose(a, within))
    if why:
        info.error = why
        return info
    try:
        await asyncio.wait_for(client.wait_ready(), timeout)
    except TimeoutError:
        info.error = f"nothing answered within {timeout:g} s"
        return info
    times = []
    try:
        full = response = await client.get_spec_response()
        reached = {response.spec.server_id}
        async with timing:
            for _ in range(ROUND_TRIPS):  # (the round trip of a small answer, not of a camera's Box bounds)
                start = time.perf_counter()
                response = await client.get_spec_response(server_id_only=True)
                times.append(time.perf_counter() - start)
                reached.add(response.spec.server_id)
    except RemoteEnvError as err:
        starting = err.code == grpc.StatusCode.UNAVAILABLE and "is starting" in err.details
        info.error = (
            "starting (building its envs)"
            if starting
            else str(err).removeprefix(f"env server {label_of(client.address)}: ")
        )
        return info
    spec = full.spec
    info.env_id, info.num_envs, info.server_id = spec.env_id, spec.num_envs, spec.server_id
    info.observation_space = _space(spec.observation_space, "observation_space")
    info.action_space = _space(spec.action_space, "action_space")
    info.vectorization, info.wrappers = spec.vectorization, list(spec.wrappers)
    mode = codec.AUTORESET_FROM_PROTO.get(spec.autoreset_mode)
    info.autoreset_mode = mode.value if mode is not None else f"unreadable (mode {spec.autoreset_mode})"
    info.max_episode_steps, info.versions = spec.max_episode_steps, dict(sorted(spec.versions.items()))
    info.env_kwargs = spec.env_kwargs if spec.HasField("env_kwargs") else None
    info.claimed_by, info.note = response.claimed_by, response.note
    info.round_trip_ms = round(statistics.median(times) * 1000, 3)
    ids = sorted(reached - {""})  # (servers too old to say an id say "")
    if len(ids) > 1:
        info.servers_reached, info.reached_ids = len(ids), tuple(ids)
        info.error = spread_calls_text(ids)
    return info


def _space(space: Any, what: str) -> str:
    try:  # (on one line: numpy breaks a Box's bounds of differing values over lines, flush left)
        return " ".join(str(codec.decode_space(space, what)).split())
    except Exception as err:  # (a server of another version: say so, and show the rest)
        return f"unreadable ({type(err).__name__}: {err})"


def describe(servers: list[ServerInfo]) -> str:
    """The survey as text: a block per server, then a line on the whole. A server's spaces and versions are
    said once for servers listed one after another that share them (64 servers printed 128 lines the same)."""
    lines = []
    above: list[str] = []  # (the spaces and versions of the server listed above)
    for s in servers:
        if s.error:
            lines.append(f"{s.address}  {'not usable' if s.servers_reached > 1 else 'not answering'}: {s.error}")
            above = []
            continue
        # (texts the server sent, shown through server_text: claimed_by is even another client's name)
        limit = f", {s.max_episode_steps}-step limit" if s.max_episode_steps else ""
        wrappers = f", wrappers {server_text(','.join(s.wrappers))}" if s.wrappers else ""
        wrappers += f", env kwargs {server_text(s.env_kwargs)}" if s.env_kwargs else ""
        lines.append(
            f"{s.address}  {server_text(s.env_id)} x{s.num_envs} ({server_text(s.vectorization)}, "
            f"{s.autoreset_mode} autoreset{limit}{wrappers})  round trip {s.round_trip_ms:.2f} ms"
        )
        details = [f"    observation {s.observation_space}; action {s.action_space}"]
        if s.versions:
            runs = ", ".join(f"{name} {version}" for name, version in s.versions.items())
            details.append("    runs " + server_text(runs))
        lines += ["    same spaces and versions as above"] if details == above else details
        above = details
        if s.claimed_by:
            lines.append(f"    claimed by {server_text(s.claimed_by)}")
        elif not s.note:  # (servers older than EnvSpec.versions do not say who holds them either)
            lines.append(
                "    free (no learner holds it)" if s.versions else "    holder unknown (a server too old to say)"
            )
        if s.note:  # (a server with no envs after a failed rebuild is not free to use: it says why)
            lines.append(f"    {server_text(s.note)}")
    # Each server once: one listed under two names (127.0.0.1:P and localhost:P, unix:/x.sock and
    # unix:///x.sock) says the same server_id at both (one too old to say one: each address its own).
    answering: list[ServerInfo] = []
    ids: set[str] = set()
    for s in servers:
        if not s.error and (not s.server_id or s.server_id not in ids):
            answering.append(s)
            ids.add(s.server_id)
    # (one that does not answer: counted per address; one that spreads calls over servers listed too: not again)
    count = len(answering) + sum(1 for s in servers if s.error and not (s.reached_ids and set(s.reached_ids) <= ids))
    total = f"{count} server{'s' if count != 1 else ''}" + (
        f" ({len(servers)} addresses)" if count < len(servers) else ""
    )
    envs = sum(s.num_envs for s in answering)
    summary = f"{total}, {len(answering)} answering, {envs} env{'s' if envs != 1 else ''}"
    if unusable := sum(1 for s in servers if s.servers_reached > 1):  # (they answer, but no learner can use them)
        summary += f", {unusable} address{'es' if unusable > 1 else ''} not usable"
    if len({(s.observation_space, s.action_space, s.autoreset_mode) for s in answering}) > 1:
        summary += "; their spaces or autoreset modes differ: they cannot step as one fleet"
    elif len({s.env_id for s in answering}) > 1:
        summary += "; they serve different envs (with the same spaces)"
    versions = {name for s in answering for name in s.versions if name != "python"}
    # (each compared among the servers that say it: older servers say none)
    differ = sorted(n for n in versions if len({s.versions[n] for s in answering if n in s.versions}) > 1)
    if differ:
        summary += f"; versions differ: {', '.join(differ)}"
    if len(answering) < sum(1 for s in servers if not s.error):
        summary += "; some are one server listed under two names"
    if any(s.reached_ids and set(s.reached_ids) <= ids for s in servers):
        summary += "; an address not usable reaches servers listed by their own"
    lines.append(summary)
    return "\n".join(lines)
