"""envfleet's env server: K copies of one gymnasium env, served over gRPC (envfleet.v1).

Run it with ``env-server --env CartPole-v1 --num-envs 4 --port 50051``. This package never imports
torch, so the env-server image stays small.
"""

from typing import TYPE_CHECKING

from env_server.codec import CodecError, UnsupportedSpaceError
from env_server.config import ServerConfig
from env_server.envs import EnvBuildError, build_vector_env
from env_server.protocol import PROTOCOL_VERSION

__all__ = [
    "PROTOCOL_VERSION",
    "CodecError",
    "EnvBuildError",
    "ServerConfig",
    "UnsupportedSpaceError",
    "build_vector_env",
]

__version__: str  # envfleet's version (found on first use: ~60 ms)

if not TYPE_CHECKING:  # (to a type checker, the module has the names above alone)

    def __getattr__(name: str) -> str:
        if name == "__version__":
            from env_server.protocol import package_version

            return package_version()
        raise AttributeError(f"module 'env_server' has no attribute {name!r}")
