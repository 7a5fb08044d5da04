"""envfleet's learner side: env servers as one gymnasium VectorEnv, and PPO that trains on them.

``from learner import RemoteVectorEnv`` needs no torch; only training (``learner.train``) does.
Names are imported on first use (PEP 562), so that the ``learner`` command can tune gRPC before
anything imports it (see ``env_server.tuning``).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

from env_server.tuning import quiet_grpc_core

# Import no gRPC; register the compose: and swarm: address schemes.
from learner.compose import resolve_compose
from learner.swarm import resolve_swarm

# gRPC core logs at INFO otherwise (a "Handshake failed" line at every attempt to reach a TLS server
# with the wrong CA, before envfleet's own error says why). It reads GRPC_VERBOSITY once, as it
# starts: so only where grpc is not imported yet, and only if the user did not set it (the entry
# points set it themselves; this is for `import learner` in a user's own script).
if "grpc" not in sys.modules and "GRPC_VERBOSITY" not in os.environ:
    quiet_grpc_core()

if TYPE_CHECKING:
    from learner.discovery import AddressError, expand_addresses
    from learner.errors import (
        AuthenticationError,
        ConcurrentUseError,
        EnvCrashedError,
        EnvFleetError,
        InvalidArgumentError,
        InvalidArgumentTypeError,
        InvalidRequestError,
        InvalidResponseError,
        OptionError,
        RemoteEnvError,
        RemoteTimeoutError,
        RunCompleteError,
        RunDirWriteError,
        ServerBusyError,
        ServerFullError,
        ServerStartError,
        ServerUnavailableError,
        SessionError,
        SpecMismatchError,
        TrackingError,
        TrainingInterrupted,
        UnusableEnvOutputError,
        UpdateDivergedError,
    )
    from learner.local import LocalServers, local_servers
    from learner.remote import RemoteVectorEnv, ResetNeededError, close_all
    from learner.sb3 import RemoteVecEnv
    from learner.stats import ReplicaStats

# Public name -> the module that defines it.
_EXPORTS = {
    "AddressError": "learner.discovery",
    "expand_addresses": "learner.discovery",
    "AuthenticationError": "learner.errors",
    "ConcurrentUseError": "learner.errors",
    "EnvCrashedError": "learner.errors",
    "EnvFleetError": "learner.errors",
    "InvalidArgumentError": "learner.errors",
    "InvalidArgumentTypeError": "learner.errors",
    "InvalidRequestError": "learner.errors",
    "InvalidResponseError": "learner.errors",
    "OptionError": "learner.errors",
    "RemoteEnvError": "learner.errors",
    "RemoteTimeoutError": "learner.errors",
    "RunCompleteError": "learner.errors",
    "RunDirWriteError": "learner.errors",
    "ServerBusyError": "learner.errors",
    "ServerFullError": "learner.errors",
    "ServerStartError": "learner.errors",
    "ServerUnavailableError": "learner.errors",
    "SessionError": "learner.errors",
    "SpecMismatchError": "learner.errors",
    "TrackingError": "learner.errors",
    "TrainingInterrupted": "learner.errors",
    "UnusableEnvOutputError": "learner.errors",
    "UpdateDivergedError": "learner.errors",
    "LocalServers": "learner.local",
    "local_servers": "learner.local",
    "RemoteVectorEnv": "learner.remote",
    "ResetNeededError": "learner.remote",
    "close_all": "learner.remote",
    "RemoteVecEnv": "learner.sb3",  # (imports stable-baselines3: only on first use)
    "ReplicaStats": "learner.stats",
}

__all__ = [
    "AddressError",
    "AuthenticationError",
    "ConcurrentUseError",
    "EnvCrashedError",
    "EnvFleetError",
    "InvalidArgumentError",
    "InvalidArgumentTypeError",
    "InvalidRequestError",
    "InvalidResponseError",
    "LocalServers",
    "OptionError",
    "RemoteEnvError",
    "RemoteTimeoutError",
    "RemoteVecEnv",
    "RemoteVectorEnv",
    "ReplicaStats",
    "ResetNeededError",
    "RunCompleteError",
    "RunDirWriteError",
    "ServerBusyError",
    "ServerFullError",
    "ServerStartError",
    "ServerUnavailableError",
    "SessionError",
    "SpecMismatchError",
    "TrackingError",
    "TrainingInterrupted",
    "UnusableEnvOutputError",
    "UpdateDivergedError",
    "close_all",
    "expand_addresses",
    "local_servers",
    "resolve_compose",
    "resolve_swarm",
]


if TYPE_CHECKING:
    __version__: str  # envfleet's version (found on first use: ~60 ms)


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from env_server.protocol import package_version

        return package_version()
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'learner' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
