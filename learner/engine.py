"""The Docker engine, for the ``compose:`` and ``swarm:`` resolvers: one SDK client per process and engine.

The Docker SDK (the ``docker`` package) is in the ``learner`` extra and imported only here, on first
use. Whatever goes wrong while talking to the engine becomes an ``AddressError`` naming the address.
The engine may be on another host (``DOCKER_HOST=tcp://HOST:2375``, ``ssh://HOST``): then a port it
publishes is reached at that host (:func:`engine_host`), not on this one's loopback.

The client is kept for the next look-up (the learner looks its servers up before every rollout): making
one asks the engine for its API version, 9 ms of a 10 ms look-up here against 0.8 ms reused. One that
failed is dropped, and the next look-up makes a new one (an engine restarted, another DOCKER_HOST).
"""

from __future__ import annotations

import ipaddress
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

from learner.discovery import AddressError

__all__ = ["ask_engine", "engine_host", "url_host"]

T = TypeVar("T")

# What docker.from_env() reads to choose its engine: a client is kept per value of these.
_ENGINE_VARIABLES = ("DOCKER_HOST", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH", "DOCKER_CONTEXT", "DOCKER_CONFIG")
_clients: dict[tuple[str | None, ...], Any] = {}
_lock = threading.Lock()  # (one look-up at a time: a client's connection pool is not shared across threads)


def ask_engine(address: str, what: str, query: Callable[[Any], T]) -> T:
    """``query(client)`` with a Docker SDK client for the engine ``DOCKER_HOST`` (and so on) names, else this host's.

    Args:
        address: the address being resolved (``compose:env``), named in errors.
        what: what ``query`` does, for errors ("list containers").
        query: gets a ``docker.DockerClient``; its ``.api`` is the low-level client.

    Raises:
        AddressError: no Docker SDK, no engine, or the engine refused the query.
    """
    try:
        import docker
        import docker.errors
    except ImportError:
        raise AddressError(
            f"address {address!r}: needs the Docker SDK; install it with pip install docker (also in 'envfleet[learner]')"
        ) from None
    import requests.exceptions  # (the SDK's own dependency: what a kept client's lost connection raises)

    key = tuple(os.environ.get(name) for name in _ENGINE_VARIABLES)
    with _lock:
        while True:
            kept = _clients.pop(key, None)
            client = kept
            if client is None:
                try:
                    client = docker.from_env()
                except docker.errors.DockerException as err:
                    raise _unreachable(address, err) from err
            try:
                result = query(client)
            except AddressError:  # (the query's own: what the engine answered says the address is wrong)
                _clients[key] = client
                raise
            except BaseException as err:
                client.close()
                if kept is not None and isinstance(err, Exception):
                    # (a kept client: its engine may have restarted, or gone; a new one asks it afresh, and
                    # says which, as a first look-up would)
                    continue
                if isinstance(err, docker.errors.DockerException):
                    explanation = getattr(err, "explanation", None) or err
                    raise AddressError(
                        f"address {address!r}: the Docker engine failed to {what}: {explanation}"
                    ) from err
                if isinstance(err, requests.exceptions.RequestException | OSError):
                    raise _unreachable(address, err) from err
                raise
            _clients[key] = client
            return result


# The SDK's own names for an engine reached through a local socket (a unix:// socket, a Windows named
# pipe), as its client's base_url has them once made, and the schemes of such engines' URLs.
_LOCAL_URLS = ("http+docker://localhost", "http+docker://localnpipe")
_LOCAL_SCHEMES = ("unix", "http+unix", "npipe")


def url_host(url: str, address: str) -> str | None:
    """The host of the Docker engine at ``url`` (``tcp://198.18.1.1:2375`` -> ``198.18.1.1``,
    ``ssh://me@box`` -> ``box``), or None when that is this host: a ``unix://`` socket, a named pipe,
    or a loopback address (``tcp://127.0.0.1:2375``), where published ports are reached on loopback.

    Raises:
        AddressError: (naming ``address``) a URL of a remote engine without a host in it.
    """
    if not url or url.startswith(_LOCAL_URLS):
        return None
    parts = urlsplit(url)
    if parts.scheme in _LOCAL_SCHEMES:
        return None
    host = parts.hostname
    if not host:
        raise AddressError(
            f"address {address!r}: expected the Docker engine's URL to name its host (tcp://HOST:2375, "
            f"ssh://HOST), got {url!r}"
        )
    if host == "localhost":
        return None
    try:
        return None if ipaddress.ip_address(host).is_loopback else host
    except ValueError:  # a name
        return host


def _unreachable(address: str, err: BaseException) -> AddressError:
    """What a look-up of ``address`` raises where the Docker engine cannot be reached, ``err`` saying why: no client
    could be made (no engine at DOCKER_HOST, no permission on its socket), or a client's query lost its connection
    (the engine stopped, or went). (Both places wrote the same words out.)"""
    return AddressError(
        f"address {address!r}: cannot reach the Docker engine ({err}); is it running, and may this user use it?"
    )


def engine_host(client: Any, address: str) -> str | None:
    """:func:`url_host` of the engine ``client`` (a ``docker.DockerClient``) talks to: where the ports
    it publishes are reached from here, or None when on this host's loopback.

    Raises:
        AddressError: (naming ``address``) the client's URL names no host.
    """
    url = str(client.api.base_url)
    if url.startswith("http+docker://ssh"):
        # The SDK keeps an ssh:// engine's URL on its transport only ("user@host:port", no scheme),
        # and what its connection made of an ~/.ssh/config alias (HostName), a name only ssh knows.
        adapter = getattr(client.api, "_custom_adapter", None)
        host = str((getattr(adapter, "ssh_params", None) or {}).get("hostname") or "")
        url = f"ssh://[{host}]" if ":" in host else f"ssh://{host or getattr(adapter, 'ssh_host', '')}"
    return url_host(url, address)
