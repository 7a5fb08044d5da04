"""envfleet's learner side: env servers as one gymnasium VectorEnv, and PPO that trains on them.

``from learner import RemoteVectorEnv`` needs no torch; only training (``learner.train``) does.
"""

from learner.compose import resolve_compose  # also registers the compose: address scheme
from learner.discovery import AddressError, expand_addresses
from learner.errors import (
    AuthenticationError,
    EnvCrashedError,
    EnvFleetError,
    InvalidRequestError,
    RemoteEnvError,
    RemoteTimeoutError,
    ServerBusyError,
    ServerStartError,
    ServerUnavailableError,
    SessionError,
    SpecMismatchError,
)
from learner.local import LocalServers, local_servers
from learner.remote import RemoteVectorEnv

__all__ = [
    "AddressError",
    "AuthenticationError",
    "EnvCrashedError",
    "EnvFleetError",
    "InvalidRequestError",
    "LocalServers",
    "RemoteEnvError",
    "RemoteTimeoutError",
    "RemoteVectorEnv",
    "ServerBusyError",
    "ServerStartError",
    "ServerUnavailableError",
    "SessionError",
    "SpecMismatchError",
    "expand_addresses",
    "local_servers",
    "resolve_compose",
]
