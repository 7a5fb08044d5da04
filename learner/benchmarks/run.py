"""``learner bench``: every measurement in one run, written as JSON, Markdown and a PNG chart."""

from __future__ import annotations

import contextlib
import datetime
import importlib.util
import logging
import math
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata
from pathlib import Path
from types import FrameType
from typing import Any

from env_server.config import ServerConfig
from learner import rundir
from learner.benchmarks import report
from learner.benchmarks.ppo import PPO_LAYOUTS, remove_orphaned_workdirs
from learner.benchmarks.suites import LATENCY_DELAY_MS, LATENCY_SIZES, latency_workload, throughput_workloads
from learner.benchmarks.throughput import Workload, measure_workload, prepare_subprocesses
from learner.errors import RunDirWriteError, os_reason
from learner.interrupts import interrupt
from learner.local import server_logger_name

__all__ = ["SUITES", "BenchConfig", "check", "others_running", "run_bench"]

log = logging.getLogger(__name__)

SUITES = ("throughput", "latency", "ppo", "rpc")


@dataclass(frozen=True)
class BenchConfig:
    """What ``learner bench`` measures, and for how long."""

    out: Path
    """Directory for bench.json, bench.md and bench.png."""
    suites: tuple[str, ...] = SUITES
    workloads: tuple[str, ...] = ("cartpole-8", "cartpole-64", "halfcheetah-8", "pong-8")
    """Throughput workloads (suite throughput)."""
    rounds: int = 5
    """Rounds per workload: each steps every variant once, so each variant gets this many samples."""
    seconds: float = 2.0
    """Seconds each variant steps per round."""
    latency_sizes: tuple[int, ...] = LATENCY_SIZES
    latency_delay_ms: float = LATENCY_DELAY_MS
    ppo_env: str = "CartPole-v1"
    ppo_timesteps: int = 50_000
    ppo_rounds: int = 3
    ppo_sizes: tuple[int, ...] = (8, 64)
    ppo_layouts: tuple[str, ...] = PPO_LAYOUTS
    """The ppo suite's layouts (ppo.PPO_LAYOUTS' names)."""
    seed: int = 0
    extra_meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # Checked before anything runs (names as the command line spells them).
        if not self.suites:
            raise ValueError(f"--suites: expected some of {list(SUITES)}, got none")
        unknown = [s for s in self.suites if s not in SUITES]
        if unknown:
            raise ValueError(f"--suites: unknown {unknown}; expected some of {list(SUITES)}")
        available = throughput_workloads()
        if "throughput" in self.suites and not self.workloads:
            raise ValueError(f"--workloads: expected some of {list(available)}, got none")
        missing = [w for w in self.workloads if w not in available]
        if missing:
            raise ValueError(f"--workloads: unknown {missing}; expected some of {list(available)}")
        if "ppo" in self.suites and not self.ppo_layouts:
            raise ValueError(f"--ppo-layouts: expected some of {list(PPO_LAYOUTS)}, got none")
        unknown = [name for name in self.ppo_layouts if name not in PPO_LAYOUTS]
        if unknown:
            raise ValueError(f"--ppo-layouts: unknown {unknown}; expected some of {list(PPO_LAYOUTS)}")
        for name in ("rounds", "ppo_rounds", "ppo_timesteps"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise ValueError(f"--seconds: expected a finite number > 0, got {self.seconds}")
        # 0 would make every env free: no ideal to measure efficiency against.
        if not (math.isfinite(self.latency_delay_ms) and self.latency_delay_ms > 0):
            raise ValueError(f"--latency-delay-ms: expected a finite number > 0, got {self.latency_delay_ms}")
        for name in ("latency_sizes", "ppo_sizes"):
            sizes = getattr(self, name)
            if not sizes or min(sizes) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')}: expected numbers of envs >= 1 such as 1,8,64, got {sizes}"
                )
        # Every layout splits its envs evenly over its servers (suites.latency_workload, ppo.default_layouts).
        uneven = [n for n in self.latency_sizes if n > 1 and (n % 2 or (n >= 16 and n % 4))]
        if uneven:
            raise ValueError(
                f"--latency-sizes: {uneven} do not split evenly over the layouts' servers (1 env: 1 server; "
                "2-15 envs: 2 servers; 16 or more: 2 and 4); expected 1, an even number, or a multiple of 4 "
                f"from 16, got {','.join(map(str, self.latency_sizes))}"
            )
        uneven = [n for n in self.ppo_sizes if n % 2 or (n >= 8 and n % 4)]
        if uneven:
            raise ValueError(
                f"--ppo-sizes: {uneven} do not split evenly over the layouts' servers (1 and 2 servers; 4 "
                "from 8 envs); expected an even number, a multiple of 4 from 8, "
                f"got {','.join(map(str, self.ppo_sizes))}"
            )


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _meta(config: BenchConfig) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        **{
            name: _version(name) for name in ("grpcio", "protobuf", "gymnasium", "numpy", "stable-baselines3", "ale-py")
        },
        "mujoco": _version("mujoco"),
        "GRPC_EXPERIMENTS": os.environ.get("GRPC_EXPERIMENTS", ""),
        "command": " ".join(["learner", *sys.argv[1:]]) if sys.argv else "",
        "rounds": config.rounds,
        "seconds": config.seconds,
        "load_average_start": list(os.getloadavg()),
        **config.extra_meta,
    }


def others_running(seconds: float = 1.0, samples: int = 40) -> float | None:
    """How many tasks other than this one were runnable, on average over ``seconds`` (sampled from
    /proc/loadavg's count of runnable tasks), for after the bench's own processes have ended: the
    1-minute load average at the end still counts the bench's own last minute (64 AsyncVectorEnv
    workers), which said "busy" on an idle machine. None where there is no /proc (macOS, Windows)."""
    counts = []
    for _ in range(samples):
        try:
            with open("/proc/loadavg") as f:
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)  # (not counting the one reading)
        except (OSError, ValueError, IndexError):
            return None
        time.sleep(seconds / samples)
    return round(max(0.0, statistics.fmean(counts)), 2)


def _workload_result(workload: Workload, measured: list[Any]) -> dict[str, Any]:
    rows = [m.as_dict() for m in measured]
    delay = workload.config.step_delay_ms
    if delay:
        ideal = workload.num_envs / (delay / 1000.0)
        for row in rows:
            row["ideal"] = round(ideal, 1)
            row["efficiency"] = round(row["median"] / ideal, 4) if row["median"] else None
    return {
        "name": workload.name,
        "title": workload.title,
        "env": workload.config.env,
        "wrappers": list(workload.config.wrappers),
        "num_envs": workload.num_envs,
        "delay_ms": delay,
        "note": workload.note,
        # The machine's 1-minute load average when the workload finished: other work competes for the CPUs.
        "load_average_1m": round(os.getloadavg()[0], 2),
        "results": rows,
    }


def _build_error(config: ServerConfig) -> Exception | None:
    """Why one env of ``config`` cannot be built here, as a server would build it; None if it can."""
    from env_server.envs import build_vector_env

    try:
        # (ctrl_c: a Ctrl-C meanwhile stops the bench, not an env that cannot be built)
        build_vector_env(replace(config, num_envs=1, step_delay_ms=0.0), ctrl_c=True).close()
    except Exception as err:  # EnvBuildError, or whatever the env's own constructor raised
        return err
    return None


def _check_ppo_env(env: str) -> None:
    """ValueError naming --ppo-env if one env of ``env`` cannot be built (as a server would build it)."""
    err = _build_error(ServerConfig(env=env))
    if err is not None:
        raise ValueError(f"--ppo-env: cannot build {env!r}: {err}")


def _check_workload_envs(workloads: tuple[str, ...]) -> None:
    """ValueError naming --workloads if one env of a workload cannot be built here (MuJoCo or ALE not
    installed, say): said before anything is measured, not as rows that could not run at the end."""
    available = throughput_workloads()
    for name in workloads:
        err = _build_error(available[name].config)
        if err is not None:
            others = [w for w in workloads if w != name]
            leave_out = f" (--workloads {','.join(others)})" if others else ""
            raise ValueError(
                f"--workloads: {name} cannot run here: {err}; install what it needs (pip install 'envfleet[bench]' "
                f"brings MuJoCo, ALE and SB3) or leave it out{leave_out}"
            )


def _check_installed(module: str) -> None:
    """ModuleNotFoundError (which the command reports with what to install) if ``module`` is missing,
    ValueError if it fails to import; imported in a child process, not here: torch would sit in this
    process's memory while the others are measured."""
    if importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(f"No module named {module!r}", name=module)
    imported = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True)
    if imported.returncode != 0:
        last = (imported.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise ValueError(f"learner bench needs {module}, which is installed but does not import: {last}")


def check(config: BenchConfig) -> None:
    """ValueError naming the option when the run could not start: --ppo-env or a workload's env cannot
    be built, --out cannot be made; ModuleNotFoundError when matplotlib (bench.png) or, for the ppo
    suite, torch is missing. All before anything is measured."""
    _check_installed("matplotlib")
    if "ppo" in config.suites:
        _check_installed("torch")
        _check_ppo_env(config.ppo_env)
    if "throughput" in config.suites:
        _check_workload_envs(config.workloads)
    rundir.check_makeable(config.out, "--out")


class _Once(logging.Filter):
    """Passes each of MuJoCo's own warnings once: servers print one per env they build (HalfCheetah's
    'settotalmass' is deprecated), and the env servers' log forwarder passes them on line by line."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith("WARNING: "):  # (the servers' own lines start with a date)
            return True
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


# learner.local forwards server i's stderr to this logger (at most 4 servers per bench layout).
_SERVER_LOGGERS = [logging.getLogger(server_logger_name(i)) for i in range(8)]


def _interrupt(signum: int, frame: FrameType | None) -> None:
    interrupt()


@contextlib.contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """SIGTERM interrupts as Ctrl-C does (KeyboardInterrupt) while the block runs: the bench then stops
    its servers and runs, removes its temporary folders and writes what finished (as `learner train`
    takes either signal as a request to stop), where SIGTERM's default would end it on the spot."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_bench(config: BenchConfig, progress: Callable[[str], None] = print, *, checked: bool = False) -> dict[str, Any]:
    """Run the configured suites; write bench.json, bench.md and bench.png into ``config.out``.

    Stopped by Ctrl-C or SIGTERM, it writes them of what finished (the workloads measured, the PPO runs
    done; ``meta.interrupted`` true) and returns that; a second Ctrl-C while they are written aborts.
    ``checked``: :func:`check` was called on ``config`` already (it builds the envs, and imports torch
    in a subprocess: seconds)."""
    if not checked:
        check(config)  # before anything is measured
    try:
        config.out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out: cannot make {config.out}: {err.strerror or err}") from None
    once = _Once()
    for logger in _SERVER_LOGGERS:
        logger.addFilter(once)
    try:
        with _sigterm_as_ctrl_c():
            return _run(config, progress)
    finally:
        for logger in _SERVER_LOGGERS:
            logger.removeFilter(once)


def _run(config: BenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    available = throughput_workloads()
    remove_orphaned_workdirs(tempfile.gettempdir())  # (of benches killed before: their PPO runs' folders)
    if {"throughput", "latency", "rpc"} & set(config.suites):  # (those start subprocesses: not the ppo suite's runs)
        prepare_subprocesses()
    results: dict[str, Any] = {"meta": _meta(config), "config": {**asdict(config), "out": str(config.out)}}
    started = time.perf_counter()
    warning = report.load_warning(results["meta"])
    if warning:  # (said again, with the end's load, above the tables)
        progress(warning)

    unwritten: list[str] = []  # (why the last save failed: a full disk; measuring goes on, the tables are printed)

    def save() -> None:
        results["targets"] = report.evaluate_targets(results)
        try:
            with rundir.writing(config.out / "bench.json"):
                rundir.write_json(config.out / "bench.json", results)  # (atomic: a kill mid-write keeps the last)
        except RunDirWriteError as err:
            if not unwritten:
                progress(f"{err}: measuring on (the tables are printed at the end)")
            unwritten[:] = [str(err)]
        else:
            unwritten.clear()

    results["meta"]["others_running_end"] = None
    try:
        _run_suites(config, results, available, save, progress)
        # (a second of sampling: a Ctrl-C then is the run's first, as during the suites; not sampled after one)
        results["meta"]["others_running_end"] = others_running()
    except KeyboardInterrupt:
        results["meta"]["interrupted"] = True
        progress("interrupted: writing what finished")
    results["meta"]["load_average_end"] = list(os.getloadavg())  # (the bench's own work included: kept, not judged)
    results["meta"]["wall_seconds"] = round(time.perf_counter() - started, 1)
    save()
    try:
        report.write_report(results, config.out)
    except OSError as err:
        unwritten.append(f"cannot write the report in {config.out}: {os_reason(err)}")
    results["meta"]["unwritten"] = unwritten  # (not in bench.json: the command says it, and exits 1)
    return results


def _run_suites(
    config: BenchConfig,
    results: dict[str, Any],
    available: dict[str, Workload],
    save: Callable[[], None],
    progress: Callable[[str], None],
) -> None:
    """Run the configured suites into ``results``, saving after each measurement (each round of a
    workload: one stopped mid-workload keeps the rounds it finished)."""

    def measure(suite: str, workload: Workload) -> None:
        entries: list[dict[str, Any]] = results[suite]
        slot = len(entries)

        def keep(measured: list[Any]) -> None:
            entries[slot:] = [_workload_result(workload, measured)]
            save()

        measure_workload(
            workload, rounds=config.rounds, seconds=config.seconds, seed=config.seed, progress=progress, on_round=keep
        )

    if "throughput" in config.suites:
        results["throughput"] = []
        for name in config.workloads:
            measure("throughput", available[name])
    if "latency" in config.suites:
        results["latency"] = []
        for n in config.latency_sizes:
            measure("latency", latency_workload(n, config.latency_delay_ms))
    if "rpc" in config.suites:
        from learner.benchmarks.rpc import measure_rpc

        progress("round trips: measuring")
        results["rpc"] = measure_rpc(rounds=config.rounds, seconds=min(config.seconds, 1.0))
        save()
    if "ppo" in config.suites:
        from learner.benchmarks.ppo import default_layouts, measure_ppo

        def keep(partial: dict[str, Any]) -> None:
            results["ppo"] = partial
            save()

        results["ppo"] = measure_ppo(
            env=config.ppo_env,
            total_timesteps=config.ppo_timesteps,
            rounds=config.ppo_rounds,
            layouts=default_layouts(config.ppo_sizes, config.ppo_layouts),
            progress=progress,
            on_run=keep,
        )
        save()
