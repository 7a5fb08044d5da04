"""Where the policy's torch runs: the device (--device), its CPU threads (--torch-threads), the machine's load."""

from __future__ import annotations

import os

import torch

from learner.cgroups import cgroup_memory_left
from learner.config import check_device
from learner.local import usable_cpus

__all__ = ["available_memory", "device_hint", "machine_busy", "pick_device", "set_torch_threads"]


def pick_device(spec: str) -> torch.device:
    """``auto``: the first CUDA device when there is one, else the CPU; or exactly what was asked for."""
    if check_device(spec) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {spec} was asked for, but torch sees no CUDA device (torch {torch.__version__})")
    if device.type == "cuda" and device.index is not None and device.index >= (count := torch.cuda.device_count()):
        # (found here, before any server starts: at the nets' .to(), a raw "invalid device ordinal")
        raise ValueError(
            f"--device: {spec} was asked for, but this host has {count} CUDA device{'s' if count != 1 else ''} "
            f"(cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})"
        )
    return device


def device_hint(spec: str, device: torch.device, image: bool) -> str | None:
    """A hint when ``--device auto`` put a vector-observation (MLP) policy on CUDA, where the per-step
    kernel launches and copies cost more than the small nets' compute saves; None otherwise."""
    if spec != "auto" or device.type != "cuda" or image:
        return None
    return (
        "--device auto picked cuda for an MLP policy; small MLPs often train faster on the CPU, with few envs "
        "(measured on an H200 host, CartPole-v1: 8 envs 2.0k-2.3k env steps/s on cuda, 4.1k-4.4k on cpu; 64 envs "
        "about even): try --device cpu"
    )


def set_torch_threads(device: torch.device, image: bool, threads: int = 0) -> None:
    """torch's CPU threads for a policy on ``device`` (``image``: a CNN's): ``threads`` if given (> 0), else
    one for an MLP on the CPU (train and eval alike), else torch's default, at most the CPUs this process
    may use (:func:`usable_cpus`: torch counts the machine's cores, not a container's ``--cpus`` quota)."""
    if threads:
        torch.set_num_threads(threads)
    elif device.type == "cpu" and not image:
        # A 64x64 MLP is too small to gain from threads; extra threads only contend with the env
        # servers for the same cores (measured: `learner eval` 4-8x slower with torch's default).
        torch.set_num_threads(1)
    elif "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > (cpus := usable_cpus()):
        # (threads beyond the quota only take turns on it, each waiting out the others' share of the period;
        # OMP_NUM_THREADS, which torch's default follows, is the user's own choice: kept)
        torch.set_num_threads(cpus)


def machine_busy() -> str:
    """ "1-minute load average L on N CPUs" when this machine is busy (L at least N: other trainings side
    by side, say), else ""."""
    cpus = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # (Windows has none)
        return ""
    return f"1-minute load average {load:.1f} on {cpus} CPUs" if load >= cpus else ""


def available_memory(device: torch.device, root: str = "/") -> tuple[int, str] | None:
    """Bytes more tensors on ``device`` can take, and where that is said: on CUDA, its free memory and what torch's
    allocator holds unused; on the CPU, /proc/meminfo's MemAvailable and SwapFree (a run that swaps is slow, not
    killed), or what this process's cgroups leave if less (:func:`~learner.cgroups.cgroup_memory_left`: a
    container's ``--memory``). None where none can be read. ``root``: where those files are looked for, the
    file system's root but in tests."""
    if device.type == "cuda":  # (with what torch's allocator holds but no tensor uses: an earlier run's, reused)
        try:
            cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
            return int(torch.cuda.mem_get_info(device)[0] + cached), str(device)
        except (RuntimeError, AssertionError):
            return None
    if device.type != "cpu":
        return None
    found: list[tuple[int, str]] = []
    try:
        with open(os.path.join(root, "proc", "meminfo")) as f:
            kb = {
                line.split(":")[0]: int(line.split()[1])
                for line in f
                if line.startswith(("MemAvailable:", "SwapFree:"))
            }
        found.append(((kb["MemAvailable"] + kb.get("SwapFree", 0)) * 1024, "this machine (with its free swap)"))
    except (OSError, ValueError, IndexError, KeyError):
        pass
    if (left := cgroup_memory_left(root)) is not None:
        found.append((left, "this process's cgroup (its memory limit)"))
    return min(found) if found else None
