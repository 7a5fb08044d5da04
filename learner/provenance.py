"""What made a run and where it ran, as its config.json records them: versions, source commit, machine."""

from __future__ import annotations

import contextlib
import os
import platform
import socket
from typing import Any

import torch

from env_server.protocol import runtime_versions
from learner.local import usable_cpus

__all__ = ["machine_info", "run_versions"]


def run_versions() -> dict[str, str]:
    """What made a run (config.json): Python, envfleet (and, run from a git checkout, its commit: the
    version alone is the same at every commit) and the libraries its results depend on."""
    return runtime_versions("torch", "gymnasium", "numpy", "grpc", "google.protobuf")


def machine_info(device: torch.device) -> dict[str, Any]:
    """Where a run ran (config.json), beyond the versions: what its results or speed may depend on. A
    run's curve depends on torch's CPU threads (sums in another order round otherwise), recorded as
    set (--torch-threads 0: torch's default for a CNN, the machine's cores, at most ``usable_cpus``)."""
    machine: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "usable_cpus": usable_cpus(),  # (affinity, a container's CPU quota: what the run could use of them)
        "torch_threads": torch.get_num_threads(),
    }
    if device.type == "cuda":
        machine["gpu"] = torch.cuda.get_device_name(device)
        machine["cuda"] = torch.version.cuda
        machine["cudnn"] = torch.backends.cudnn.version()
    return machine


def _cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what ``platform`` says."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()
