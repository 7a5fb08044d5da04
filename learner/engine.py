"""The Docker engine, for the ``compose:`` and ``swarm:`` resolvers: one SDK client per look-up.

The Docker SDK (the ``docker`` package) is in the ``learner`` extra and imported only here, on first
use. Whatever goes wrong while talking to the engine becomes an ``AddressError`` naming the address.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from learner.discovery import AddressError

__all__ = ["ask_engine"]

T = TypeVar("T")


def ask_engine(address: str, what: str, query: Callable[[Any], T]) -> T:
    """``query(client)`` with a Docker SDK client for the engine of this host (``DOCKER_HOST`` and so on).

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
    try:
        client = docker.from_env()
    except docker.errors.DockerException as err:
        raise AddressError(
            f"address {address!r}: cannot reach the Docker engine ({err}); is it running, and may this user use it?"
        ) from err
    try:
        return query(client)
    except docker.errors.DockerException as err:
        explanation = getattr(err, "explanation", None) or err
        raise AddressError(f"address {address!r}: the Docker engine failed to {what}: {explanation}") from err
    finally:
        client.close()
