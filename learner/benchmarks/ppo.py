"""PPO end to end: the SPS ``learner train`` reaches on each layout, run side by side as subprocesses."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from learner.local import python_m

__all__ = ["PPO_LAYOUTS", "TrainLayout", "default_layouts", "measure_ppo", "remove_orphaned_workdirs"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainLayout:
    """One way to run ``learner train``."""

    name: str
    backend: str
    """``gym`` (in-process SyncVectorEnv) or ``remote`` (local env servers)."""
    num_envs: int
    servers: int = 2
    transport: str = "unix"
    groups: int = 1
    """``learner train --pipeline-groups`` (send/recv pipelining over groups of servers; 1: off)."""
    step_socket: bool = True
    """``learner train --step-socket`` (with ``unix``: steps on the servers' step sockets)."""

    def args(self) -> list[str]:
        out = ["--backend", self.backend, "--num-servers", str(self.servers), "--num-envs", str(self.num_envs)]
        if self.backend == "remote":
            out += ["--transport", self.transport, "--pipeline-groups", str(self.groups)]
            out += ["--step-socket" if self.step_socket else "--no-step-socket"]
        return out


PPO_LAYOUTS = ("gym", "tcp", "grpc", "unix", "pipelined", "1-server", "4-servers")
"""The ppo suite's layouts by the names ``learner bench --ppo-layouts`` takes: in-process SyncVectorEnv;
2 servers over loopback TCP, over gRPC on Unix sockets, on their step sockets, pipelined in 2 groups;
1 server; 4 servers pipelined in 2 groups (from 8 envs)."""


def default_layouts(sizes: tuple[int, ...] = (8, 64), names: tuple[str, ...] = PPO_LAYOUTS) -> list[TrainLayout]:
    """The layouts ``names`` (of PPO_LAYOUTS) for each total of envs in ``sizes``."""
    layouts = []
    for n in sizes:
        named = {
            "gym": TrainLayout(f"in-process SyncVectorEnv({n})", "gym", n),
            "tcp": TrainLayout(f"remote 2x{n // 2} tcp", "remote", n, transport="tcp"),
            "grpc": TrainLayout(f"remote 2x{n // 2} unix grpc", "remote", n, step_socket=False),
            "unix": TrainLayout(f"remote 2x{n // 2} unix", "remote", n),
            "pipelined": TrainLayout(f"remote 2x{n // 2} unix pipelined/2", "remote", n, groups=2),
            "1-server": TrainLayout(f"remote 1x{n} unix", "remote", n, servers=1),
        }
        if n >= 8:
            named["4-servers"] = TrainLayout(f"remote 4x{n // 4} unix pipelined/2", "remote", n, servers=4, groups=2)
        layouts += [layout for name, layout in named.items() if name in names]
    return layouts


def _train_once(layout: TrainLayout, env: str, total_timesteps: int, workdir: Path, seed: int) -> float:
    run_dir = workdir / f"{layout.name.replace(' ', '_').replace('(', '').replace(')', '')}-{seed}"
    cmd = [
        *python_m("learner"),
        "train",
        "--env",
        env,
        "--total-timesteps",
        str(total_timesteps),
        "--seed",
        str(seed),
        "--run-dir",
        str(run_dir),
        "--no-tensorboard",
        "--no-plot",
        "--no-progress",
        "--checkpoint-every",
        "0",
        "--parent-pid",  # (killed, the bench cannot stop it: it stops itself)
        str(os.getpid()),
        *layout.args(),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=1800)
    except BaseException:  # the timeout, or the bench stopped (Ctrl-C, SIGTERM): so is this run
        _stop(proc)
        raise
    if proc.returncode != 0:
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"learner train ({layout.name}) exited with {proc.returncode}: {tail}")
    summary = json.loads((run_dir / "summary.json").read_text())
    if not summary.get("sps"):
        raise RuntimeError(f"learner train ({layout.name}) finished no update; raise the number of timesteps")
    return float(summary["sps"])


def _stop(proc: subprocess.Popen[str]) -> None:
    """Stop ``learner train`` as Ctrl-C does (SIGTERM: it stops at its next step and closes its env
    servers, whose sockets' folder a SIGKILL would leave behind), or kill it after 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    proc.communicate()  # (closes the pipes)


_WORKDIR = re.compile(r"envfleet-bench-ppo-(\d+)-\w+")
"""The name of the folder a bench's PPO runs write to (``envfleet-bench-ppo-<bench pid>-*``)."""


def remove_orphaned_workdirs(root: str) -> None:
    """Remove the PPO runs' folders of benches that were killed (SIGKILL: no finalizer ran; their runs
    stop by themselves, see --parent-pid): this user's whose bench is gone. ``learner bench`` does it
    first, whatever its suites."""
    from learner.local import orphaned_dirs  # (here: the CLI imports this module for PPO_LAYOUTS alone)

    for path in orphaned_dirs(root, _WORKDIR):
        shutil.rmtree(path, ignore_errors=True)
        log.debug("removed %s, left by a bench that was killed", path)


def measure_ppo(
    *,
    env: str,
    total_timesteps: int,
    rounds: int,
    layouts: list[TrainLayout],
    progress: Callable[[str], None] = lambda _: None,
    on_run: Callable[[dict[str, Any]], None] = lambda _: None,
) -> dict[str, Any]:
    """SPS of each layout, ``rounds`` runs each, in turns (the order rotates between rounds).

    ``on_run`` gets the results so far after each run, so that a bench stopped half way keeps them."""
    samples: dict[str, list[float]] = {lay.name: [] for lay in layouts}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix=f"envfleet-bench-ppo-{os.getpid()}-") as tmp:
        for r in range(rounds):
            order = layouts[r % len(layouts) :] + layouts[: r % len(layouts)]
            for layout in order:
                if layout.name in errors:
                    continue
                try:
                    sps = _train_once(layout, env, total_timesteps, Path(tmp), seed=1 + r)
                except (RuntimeError, subprocess.TimeoutExpired) as err:
                    log.warning("%s", err)
                    errors[layout.name] = str(err)
                    on_run(_summary(env, total_timesteps, layouts, samples, errors))
                    continue
                samples[layout.name].append(sps)
                progress(f"PPO {env}: round {r + 1}/{rounds}: {layout.name} {sps:,.0f} SPS")
                on_run(_summary(env, total_timesteps, layouts, samples, errors))
    return _summary(env, total_timesteps, layouts, samples, errors)


def _summary(
    env: str, total_timesteps: int, layouts: list[TrainLayout], samples: dict[str, list[float]], errors: dict[str, str]
) -> dict[str, Any]:
    """The ppo suite's results from each layout's SPS samples and errors (layouts not run yet: no samples)."""
    results = []
    for layout in layouts:
        values = samples[layout.name]
        median = statistics.median(values) if values else None
        results.append(
            {
                **asdict(layout),
                "samples": [round(v, 1) for v in values],
                "median": round(median, 1) if median is not None else None,
                "min": round(min(values), 1) if values else None,
                "max": round(max(values), 1) if values else None,
                "spread": round((max(values) - min(values)) / median, 3) if values and median else None,
                "error": errors.get(layout.name),
            }
        )
    return {
        "env": env,
        "total_timesteps": total_timesteps,
        "unit": "env-steps/s over the whole run (rollouts and updates), from summary.json",
        "results": results,
    }
