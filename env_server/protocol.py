"""Constants of the envfleet.v1 protocol that servers and clients share."""

from __future__ import annotations

__all__ = ["ENV_INDEX_KEY", "MAX_MESSAGE_BYTES", "PROTOCOL_VERSION", "SERVICE_NAME"]

# Version of the protocol (the proto package is envfleet.v<PROTOCOL_VERSION>).
PROTOCOL_VERSION = 1

# Fully qualified gRPC service name, also the name the health service reports on.
SERVICE_NAME = "envfleet.v1.EnvService"

# Trailing-metadata key carrying the index (within the server) of the env an error is about, so a
# client can name the env by its index over the whole fleet.
ENV_INDEX_KEY = "envfleet-env-index"

# Message size limit on both sides: an Atari batch of 64 envs x 4x84x84 uint8 is 1.8 MB; 64 MiB
# leaves room for large image observations while refusing absurd messages before they are read.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
