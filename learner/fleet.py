"""FleetChange: what :meth:`RemoteVectorEnv.refresh` changed when servers came or went."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["FleetChange", "carry_over", "describe_change"]


@dataclass(frozen=True)
class FleetChange:
    """The fleet after servers were added or removed, and how its envs map to the envs before.

    Servers that stayed keep their envs (and the episodes in them) in the same order; the envs of
    added servers come after them, freshly reset. So a learner keeps per-env state (the current
    observation, episode returns) with :func:`carry_over` and starts new envs from ``observations``.
    """

    added: tuple[str, ...]
    """Addresses of the servers that joined."""
    removed: tuple[str, ...]
    """Addresses of the servers that left (no longer resolved, stopped, or failed)."""
    num_envs: int
    """The fleet's number of envs now."""
    previous_num_envs: int
    """... and before."""
    previous_index: np.ndarray
    """For each env now, its index before the change, or -1 for an env of an added server."""
    observations: Any
    """Every env's current observation: the latest one of envs that stayed, the reset one of new envs."""
    infos: dict[str, Any]
    """The new envs' reset infos, as a vector info over all ``num_envs`` envs."""
    restarted: int = 0
    """Envs of servers that stayed which started over all the same (every env does after a failed
    step or reset: those that answered moved on unseen); they count in ``new_envs``, not in ``added``."""

    @property
    def new_envs(self) -> np.ndarray:
        """Mask over the envs now: True for envs whose episodes just started (those of added servers,
        and the ``restarted`` ones)."""
        return np.asarray(self.previous_index < 0)

    @property
    def added_envs(self) -> int:
        """How many envs the servers that joined brought."""
        return int(self.new_envs.sum()) - self.restarted

    @property
    def removed_envs(self) -> int:
        """How many envs left with the servers that left."""
        kept = self.num_envs - int(self.new_envs.sum())
        return self.previous_num_envs - kept - self.restarted


def describe_change(change: FleetChange) -> str:
    """One line for people: "fleet: +4 envs (2 servers joined: a, b); 12 envs now", or after a failed
    step "fleet: -2 envs (1 server left: a); 4 envs restarted; 4 envs now"."""
    added, removed = change.added_envs, change.removed_envs
    parts = []
    if added or removed or change.added or change.removed:
        envs = " ".join(n for n, count in ((f"+{added}", added), (f"-{removed}", removed)) if count) or "+0"
        servers = [
            f"{len(addresses)} server{'s' if len(addresses) > 1 else ''} {verb}: {', '.join(addresses)}"
            for addresses, verb in ((change.added, "joined"), (change.removed, "left"))
            if addresses
        ]
        parts.append(f"{envs} envs ({'; '.join(servers)})" if servers else f"{envs} envs")
    if change.restarted:
        parts.append(f"{change.restarted} env{'s' if change.restarted > 1 else ''} restarted")
    return f"fleet: {'; '.join(parts or ['no change'])}; {change.num_envs} envs now"


def carry_over(values: np.ndarray, change: FleetChange, fill: Any) -> np.ndarray:
    """Per-env ``values`` (leading dimension: the envs before) laid out for the envs now; new envs get ``fill``."""
    values = np.asarray(values)
    if len(values) != change.previous_num_envs:
        raise ValueError(f"values: expected {change.previous_num_envs} envs (before the change), got {len(values)}")
    kept = change.previous_index >= 0
    out = np.full((change.num_envs, *values.shape[1:]), fill, dtype=values.dtype)
    out[kept] = values[change.previous_index[kept]]
    return out
