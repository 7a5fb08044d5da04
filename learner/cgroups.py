"""What this process's cgroups allow it (a container's ``--cpus`` and ``--memory``), cgroup v2 and v1 alike.

Each reader takes ``root``: where /proc and /sys are looked for, the file system's root but in tests.
"""

from __future__ import annotations

import os

__all__ = ["cgroup_cpu_quota", "cgroup_memory_left"]

# cgroup v1's "no limit": LONG_MAX rounded down to a page (9223372036854771712), or near it.
_V1_UNLIMITED = 1 << 62


def cgroup_cpu_quota(root: str = "/") -> float | None:
    """The CPU time this process's cgroups allow it, in CPUs (0.5: half a CPU's time; ``docker run --cpus``
    sets it), the smallest of the quotas of its cgroup and of their parents; None where none is set or
    none can be read. cgroup v2: ``cpu.max`` ("QUOTA PERIOD", or "max PERIOD": none) of the cgroup that
    /proc/self/cgroup's ``0::/PATH`` line names and its parents, up to the mount's root (a container's
    own cgroup, where it has a cgroup namespace: its PATH is then "/"); cgroup v1 likewise, its
    ``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us``, where the cpu controller is mounted
    (``cpu`` or ``cpu,cpuacct``)."""
    mounts = os.path.join(root, "sys", "fs", "cgroup")
    v2_path, v1_paths = _own_cgroups(root)
    quotas = [_cpu_max(folder) for folder in _up_to(mounts, v2_path)]
    for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        quotas += [_cfs_quota(folder) for folder in _up_to(os.path.join(mounts, mount), v1_paths.get("cpu", "/"))]
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def cgroup_memory_left(root: str = "/") -> int | None:
    """Bytes this process's cgroups leave for more memory (a container's ``--memory``): the least, over its
    cgroup and their parents, of a limit less what their processes hold that cannot be reclaimed (not their
    page cache); None where no limit is set or none can be read. cgroup v2: ``memory.max`` ("max": none) less
    memory.stat's ``anon`` and ``shmem``; cgroup v1, where the memory controller is mounted:
    ``memory.limit_in_bytes`` (about 2**63: none) less memory.stat's ``total_rss`` and ``total_shmem`` (the
    folder's and its children's)."""
    mounts = os.path.join(root, "sys", "fs", "cgroup")
    v2_path, v1_paths = _own_cgroups(root)
    left = [_left(folder, "memory.max", ("anon", "shmem")) for folder in _up_to(mounts, v2_path)]
    v1_folders = _up_to(os.path.join(mounts, "memory"), v1_paths.get("memory", "/"))
    left += [_left(folder, "memory.limit_in_bytes", ("total_rss", "total_shmem")) for folder in v1_folders]
    found = [n for n in left if n is not None]
    return min(found) if found else None


def _own_cgroups(root: str) -> tuple[str, dict[str, str]]:
    """This process's cgroup v2 path and its cgroup v1 paths by controller (/proc/self/cgroup: "0::/PATH",
    and "ID:cpu,cpuacct:/PATH"); "/" for a v2 one not there; none, or "/", for one outside the cgroup
    namespace's root ("/.."), whose folders are not in the mount."""
    v2, v1 = "/", dict[str, str]()
    try:
        with open(os.path.join(root, "proc", "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        return v2, v1
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, cgroup = rest.partition(":")
        if not cgroup.startswith("/") or ".." in cgroup.split("/"):
            continue
        if hierarchy == "0" and not controllers:
            v2 = cgroup
        else:
            v1.update(dict.fromkeys(controllers.split(","), cgroup))
    return v2, v1


def _up_to(mount: str, cgroup: str) -> list[str]:
    """The folders of ``cgroup`` and of its parents, under the mount ``mount`` (its root last)."""
    parts = [p for p in cgroup.split("/") if p]
    return [os.path.join(mount, *parts[:n]) for n in range(len(parts), -1, -1)]


def _cpu_max(folder: str) -> float | None:
    """cgroup v2: the quota of ``folder``'s cpu.max in CPUs; None for none ("max") or no such file."""
    try:
        with open(os.path.join(folder, "cpu.max")) as f:
            quota, _, period = f.read().strip().partition(" ")
        return None if quota == "max" else _cpus(int(quota), int(period or 100_000))
    except (OSError, ValueError):
        return None


def _cfs_quota(folder: str) -> float | None:
    """cgroup v1: ``folder``'s cpu.cfs_quota_us over its cpu.cfs_period_us, in CPUs; None for none (-1)
    or no such file."""
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        if quota < 0:
            return None
        with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
            return _cpus(quota, int(f.read()))
    except (OSError, ValueError):
        return None


def _cpus(quota: int, period: int) -> float | None:
    return quota / period if quota > 0 and period > 0 else None


def _left(folder: str, limit_file: str, held: tuple[str, ...]) -> int | None:
    """``folder``'s memory limit (``limit_file``) less the memory.stat entries ``held``, at least 0; None for
    no limit or no such file."""
    try:
        with open(os.path.join(folder, limit_file)) as f:
            limit = f.read().strip()
        if limit == "max" or int(limit) >= _V1_UNLIMITED:
            return None
        with open(os.path.join(folder, "memory.stat")) as f:
            stat = dict(line.split(maxsplit=1) for line in f if line.strip())
        return max(0, int(limit) - sum(int(stat.get(name, 0)) for name in held))
    except (OSError, ValueError):
        return None
