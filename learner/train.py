"""``learner train``: PPO on any gymnasium VectorEnv (by default a fleet of local env servers), CleanRL-style.

The loop below reads top to bottom like CleanRL's ``ppo.py`` (https://docs.cleanrl.dev/rl-algorithms/ppo/),
with two differences that matter for correctness: the step after an episode ends under gymnasium's
next-step autoreset is a reset, not a transition, so it never enters the batch; and truncated
episodes are bootstrapped from the value of their final observation (see ``ppo.gae_advantages``).

Env servers may fail mid-run (``--fault-tolerant``, the default): an env the fleet reports in
``infos["env_unavailable"]`` (or ``infos["env_error"]``) gave no transition on that step, so the
step stays out of the batch, its observation updates no statistics, and the transition before it
is bootstrapped as a truncation (the lambda-return stops there). Its episode does not count in the
returns. See ``RemoteVectorEnv`` for how envs are lost and rejoin.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import dataclasses
import functools
import importlib.util
import logging
import math
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import gymnasium as gym
import numpy as np
import torch
from torch import Tensor, optim

from env_server.protocol import runtime_versions
from learner import rundir
from learner.checkpoint import (
    capture_rng,
    find_checkpoint,
    load_checkpoint,
    load_latest_readable,
    load_nets,
    restore_rng,
    save_best_checkpoint,
    save_checkpoint,
)
from learner.config import (
    DEFAULT_ENV,
    LOCAL_SERVER_OPTIONS,
    NO_TLS,
    SESSION_OPTIONS,
    Args,
    PPOConfig,
    check_device,
    check_served_env_here,
    default_run_dir,
    is_atari,
    resolve_ppo,
    wrappers_option,
)
from learner.envs import FleetSpec, open_fleet, reward_threshold
from learner.errors import (
    EnvCrashedError,
    EnvFleetError,
    InvalidResponseError,
    RemoteEnvError,
    RemoteTimeoutError,
    RunCompleteError,
    RunDirWriteError,
    ServerUnavailableError,
    SessionError,
    TrainingInterrupted,
)
from learner.fleet import FleetChange, carry_over
from learner.live_metrics import LearnerMetrics, serve_metrics
from learner.normalize import RewardScaler, RunningMeanStd
from learner.ppo import Agent, check_observation_space, is_image_space, unusable_observation
from learner.stats import ReplicaStats, format_return
from learner.update import Rollout, UpdateResult, make_batch, ppo_update

if TYPE_CHECKING:
    from learner.tracking import WandbRun

__all__ = [
    "Args",
    "NothingToLearnError",
    "Rollout",
    "StopRequest",
    "fleet_spec",
    "like_args",
    "pick_device",
    "progress_bar",
    "resume_args",
    "set_torch_threads",
    "train",
]

log = logging.getLogger(__name__)

RECENT = 20
"""Finished episodes that "the recent return" (and --stop-at-return) averages over."""

LOST_ROLLOUTS = 3
"""Rollouts in a row ended by a failed env server (--no-fault-tolerant) at which the run gives up: the
earlier ones are dropped with a warning, this one raises."""

EMPTY_ROLLOUTS = LOST_ROLLOUTS
"""Rollouts in a row in which no env gave a transition (every env raised, or was unavailable) after
which the run stops with NothingToLearnError."""

FAULT_COUNTS = ("failures", "shutdowns", "reconnects", "server_restarts", "servers_joined", "servers_left")
"""The fleet's fault counters (fields of ``FaultStats`` and of ``Counters``) that each metrics row gives for
its update (``faults/<name>``) and summary.json totals over the whole run. The other fields of
``FaultStats`` are not counts of the fleet's events (``servers_down``, ``envs_unavailable``,
``servers_not_joined``: now) or are
counted here from the steps' infos (``env_steps_lost``, for in-process envs too)."""


class NothingToLearnError(EnvFleetError):
    """No env gave a transition for ``EMPTY_ROLLOUTS`` rollouts in a row: the run stops (its envs' errors
    are in the message)."""


def _versions() -> dict[str, str]:
    """What made a run (config.json): Python, envfleet (and, run from a git checkout, its commit: the
    version alone is the same at every commit) and the libraries its results depend on."""
    versions = runtime_versions("torch", "gymnasium", "numpy", "grpc", "google.protobuf")
    commit = _source_commit()
    if commit is not None:
        versions["envfleet_commit"] = commit
    return versions


def _source_commit() -> str | None:
    """The git commit envfleet's source is at when it runs from a checkout, ``+dirty`` with changes to
    tracked files not committed; None elsewhere (installed, an image) or when git cannot say."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return None
    git = ["git", "-C", str(root)]
    environ = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # (git status must not take the index's lock)
    try:
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True)
        status = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
            env=environ,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def _machine(device: torch.device) -> dict[str, Any]:
    """Where a run ran (config.json), beyond the versions: what its results or speed may depend on. A
    run's curve depends on torch's CPU threads (sums in another order round otherwise), recorded as
    set (--torch-threads 0: torch's default, the machine's cores for a CNN)."""
    machine: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
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


def _check_squash(hp: PPOConfig, envs: Any, wrappers: Sequence[str]) -> None:
    """ValueError naming --action-bounds where it squashes actions without finite bounds to squash into
    (before the run dir is made: a refused run leaves none)."""
    space = envs.single_action_space
    if hp.action_bounds != "squash" or not isinstance(space, gym.spaces.Box):
        return
    if np.isfinite(space.low).all() and np.isfinite(space.high).all():
        return
    why = " (the clip-action wrapper serves them so)" if "clip-action" in wrappers else ""
    raise ValueError(
        f"--action-bounds squash: maps actions onto their bounds, but these envs' actions are {space}, "
        f"unbounded{why}; use --action-bounds clip" + (", or leave out the clip-action wrapper" if why else "")
    )


def raw_atari_frames(env_id: str, wrappers: Sequence[str], observation_space: gym.Space[Any]) -> str:
    """A warning when an ALE game's envs serve raw frames (210x160 RGB, ~100 KB a step each), not the
    atari wrapper's 4x84x84 stacks the Nature CNN and the atari preset are made for; "" otherwise."""
    space = observation_space
    raw = isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 and len(space.shape) == 3
    if not (is_atari(env_id) and "atari" not in wrappers and raw):
        return ""
    return (
        f"{env_id} without the env server's atari wrapper: its envs serve raw frames, {space}, not the "
        "4x84x84 frame stacks of the standard preprocessing (grayscale, frame skip 4, 4 frames stacked), which "
        "the atari preset is tuned for and which are about 1/3.6 of the bytes; serve them with the atari wrapper "
        "(env-server --wrappers atari; learner train's own servers: --wrappers auto or atari)"
    )


def _earlier_sessions(run_dir: Path) -> list[Any]:
    """The config.json of each earlier session of a resumed run, oldest first: what each ran with (its
    options, devices, versions, servers) outlives the resume that rewrites the file."""
    try:
        previous = rundir.read_json(run_dir / rundir.CONFIG)
    except (OSError, ValueError) as err:  # (resume_args read it a moment ago)
        log.warning("%s: cannot keep the earlier sessions' record (%s)", run_dir / rundir.CONFIG, err)
        return []
    if not isinstance(previous, dict):
        return []
    earlier = previous.pop("earlier_sessions", None)
    previous.pop("server_versions", None)  # (one entry per server: kept for the session that runs)
    return [*(earlier if isinstance(earlier, list) else []), previous]


def _stepping(envs: Any) -> tuple[Any, bool]:
    """How a rollout steps ``envs``: (``step_groups``, ``overlap``). Pipelining (RemoteVectorEnv with
    --pipeline-groups > 1, as many groups as servers allow): step_groups sends each group its actions as
    soon as they are computed; else vector envs that step in the background (RemoteVectorEnv:
    step_async) do so while the critic runs (``overlap``)."""
    step_groups = getattr(envs, "step_groups", None) if getattr(envs, "num_groups", 1) > 1 else None
    return step_groups, step_groups is None and hasattr(envs, "step_async") and hasattr(envs, "step_wait")


def pick_device(spec: str) -> torch.device:
    """``auto``: the first CUDA device when there is one, else the CPU; or exactly what was asked for."""
    if check_device(spec) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device: {spec} was asked for, but torch sees no CUDA device (torch {torch.__version__})")
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


def fleet_spec(args: Args) -> FleetSpec:
    servers, envs_per_server = args.local_layout()
    return FleetSpec(
        env=args.env or DEFAULT_ENV,  # None only with --servers, where the servers decide
        servers=args.servers,
        backend=args.backend,
        num_servers=servers,
        envs_per_server=envs_per_server,
        env_kwargs=dict(args.env_kwargs),
        wrappers=args.server_wrappers(),
        step_delay_ms=args.step_delay_ms,
        max_episode_steps=args.max_episode_steps,
        transport=args.transport,
        step_socket=args.step_socket,
        auth_token=args.auth_token,
        timeout=args.timeout,
        reset_timeout=args.reset_timeout,
        connect_timeout=args.connect_timeout,
        keepalive_timeout=args.keepalive_timeout,
        pipeline_groups=args.pipeline_groups,
        fault_tolerant=args.fault_tolerant,
        give_up_after=args.give_up_after,
        hang_timeout=args.hang_timeout,
        tls=args.tls_ca or args.tls,
        tls_server_name=args.tls_server_name,
        tls_client_cert=args.tls_client_cert,
        tls_client_key=args.tls_client_key,
    )


def resume_args(run_dir: str | Path, /, **overrides: Any) -> Args:
    """The ``Args`` a run in ``run_dir`` was started with, with ``overrides`` and ``resume=run_dir``."""
    if not str(run_dir):
        raise ValueError("--resume: expected a value, got an empty string")
    config = Path(run_dir) / rundir.CONFIG
    if Path(run_dir).is_file():
        folder = Path(run_dir).parent
        hint = f"its run dir, {folder.parent}" if folder.name == rundir.CHECKPOINTS else "the run dir it belongs to"
        raise ValueError(
            f"--resume: expected a run dir (the run goes on from its latest checkpoint), got the file {run_dir}; "
            f"pass {hint}"
        )
    if not config.is_file():
        raise FileNotFoundError(f"--resume: expected a run dir holding {rundir.CONFIG}, but {config} does not exist")
    recorded = rundir.read_json(config)
    # As recorded (checked once the overrides are in: one may mend what this version refuses), with
    # the progress display and the metrics endpoint this session's.
    saved = Args.from_json({**recorded["args"], **SESSION_OPTIONS}, check=False)
    if overrides.get("run_dir") not in (None, str(run_dir)):
        raise ValueError(
            f"--run-dir: a resumed run goes on in its own run dir, {run_dir}; --run-dir cannot go with --resume"
        )
    overrides.pop("run_dir", None)
    # The nets go on as they are: options that shape them (or what they act on) cannot change.
    resolved = recorded.get("ppo", {})
    for name, before in (
        ("env", saved.env),
        ("hidden_sizes", tuple(resolved["hidden_sizes"]) if "hidden_sizes" in resolved else None),
        ("action_bounds", resolved.get("action_bounds")),
    ):
        wanted = overrides.get(name)
        if wanted is not None and before is not None and wanted != before:
            flag = f"--{name.replace('_', '-')}"
            raise ValueError(
                f"{flag}: the run in {run_dir} was trained with {flag} {_shown(before)}; a resumed run keeps its "
                f"nets, so {flag} cannot change (got {_shown(wanted)})"
            )
    if overrides.get("seed", saved.seed) != saved.seed:
        log.warning(
            "--seed %d: a resumed run draws from its checkpoint's RNG states (run seed %d), so the new seed changes "
            "only its envs' reset seeds",
            overrides["seed"],
            saved.seed,
        )
    return _recorded_with(saved, recorded, overrides, run_dir, "resume", resume=str(run_dir), run_dir=str(run_dir))


def like_args(source: str | Path, /, **overrides: Any) -> Args:
    """The ``Args`` a run was started with, for a new run (``learner train --like``): ``source`` is its run
    dir or its config.json; ``overrides`` (a seed, say) replace what it recorded. The new run has a run
    dir of its own (``run_dir`` among ``overrides``, else the default) and starts from scratch; the
    auth token, never recorded, is this session's."""
    path = Path(source)
    if not str(source):
        raise ValueError("--like: expected a value, got an empty string")
    if not path.exists():
        raise FileNotFoundError(f"--like: expected a run dir or its {rundir.CONFIG}, but {path} does not exist")
    config = path / rundir.CONFIG if path.is_dir() else path
    if not config.is_file():
        raise FileNotFoundError(f"--like: expected a run dir holding {rundir.CONFIG}, but {config} does not exist")
    try:
        recorded = rundir.read_json(config)
    except ValueError as err:
        raise ValueError(f"--like: {config} is no run's {rundir.CONFIG}: {err}") from None
    if not isinstance(recorded, dict) or not isinstance(recorded.get("args"), dict):
        raise ValueError(f"--like: {config} is no run's {rundir.CONFIG} (it has no 'args' object)")
    fresh = {**SESSION_OPTIONS, "run_dir": None, "resume": None, "auth_token": None}
    values = {**recorded["args"], **fresh}
    other_env = overrides.get("env", values.get("env")) != values.get("env")
    if other_env:  # (the run's env options were for its env: the new one gets its own, or none)
        values.update(env_kwargs={}, max_episode_steps=None, wrappers="auto")
    if "preset" not in overrides and not other_env:
        # The hyperparameters as the run resolved them (config.json's ppo), not as this version's preset
        # would: the same experiment after an upgrade that retuned a preset. (Not those that did not
        # apply to its envs: a CNN's hidden sizes, discrete actions' bounds, which would be warned of.)
        envs = recorded.get("envs") or {}
        idle = {"hidden_sizes"} if recorded.get("policy") == "Nature CNN" else set()
        if not str(envs.get("action_space", "Box")).startswith("Box"):
            idle.add("action_bounds")
        for name, value in (recorded.get("ppo") or {}).items():
            if name != "preset" and name not in idle and values.get(name, 0) is None and name not in overrides:
                values[name] = tuple(value) if isinstance(value, list) else value
    saved = Args.from_json(values, check=False)
    if other_env:  # (nor the options its servers said)
        recorded = {**recorded, "envs": {}}
    args = _recorded_with(saved, recorded, overrides, config.parent, "like")
    given = ", ".join(f"--{name.replace('_', '-')}" for name in overrides) or "none"
    log.info("--like: the options the run in %s recorded; given here instead: %s", config.parent, given)
    return args


def _recorded_with(
    saved: Args, recorded: dict[str, Any], overrides: dict[str, Any], run: Path | str, flag: str, /, **fixed: Any
) -> Args:
    """``saved`` (the options the run in ``run`` recorded, ``recorded`` its config.json) with ``overrides``
    and ``fixed``, checked; options given that move the run off the --servers it used onto envs this
    command starts (or onto other servers) take the others that go with them (``flag``: the command's
    option, --resume or --like, for messages)."""
    moved: dict[str, Any] = {}
    what = "resume" if flag == "resume" else "repeat"
    servers = overrides.get("servers")
    if servers is not None and not servers.strip(" ,"):
        how = "leave --servers out" + (f" and give {_MOVE_FLAGS}" if saved.servers is not None else "")
        raise ValueError(
            f"--servers: expected addresses such as host:port,host:port, got {servers!r}; to {what} the run in "
            f"{run} on envs this command starts, {how}"
        )
    if servers is not None:
        # Moving a run onto running servers: the options of the servers it used to start no longer apply.
        moved = dict(LOCAL_SERVER_OPTIONS)
    elif saved.servers is not None and any(name in overrides for name in _MOVE_OPTIONS):
        # Moving a run off running servers onto envs this command starts: the same env (and, unless
        # given, as many envs), without the servers' address and TLS (local servers speak plaintext).
        # Pipelining was sized for the servers it left: 1 group unless given.
        given = ", ".join(f"--{name.replace('_', '-')}" for name in _MOVE_OPTIONS if name in overrides)
        check_served_env_here(saved.env, saved.servers, overrides.get("env"), f"--{flag} with {given}", "--env")
        moved = {"servers": None, **NO_TLS, "pipeline_groups": 1}
        # The servers' wrappers and time limit, where recorded, unless given (else the checked spaces fail).
        served = recorded.get("envs", {})
        if served.get("wrappers") is not None and "wrappers" not in overrides:
            moved["wrappers"] = wrappers_option(served["wrappers"])
        if served.get("max_episode_steps") and "max_episode_steps" not in overrides:
            moved["max_episode_steps"] = served["max_episode_steps"]
        if served.get("env_kwargs") and "env_kwargs" not in overrides:  # (servers since EnvSpec.env_kwargs)
            moved["env_kwargs"] = served["env_kwargs"]
        num_envs = served.get("num_envs")
        if num_envs and "num_envs" not in overrides and "envs_per_server" not in overrides:
            moved["num_envs"] = num_envs
            wanted = overrides.get("num_servers")
            if wanted is None:
                moved["num_servers"] = math.gcd(num_envs, saved.num_servers)  # (servers of as many envs each)
            elif overrides.get("backend", saved.backend) == "remote" and num_envs % min(wanted, num_envs):
                raise ValueError(
                    f"--num-servers: the run in {run} trained on {num_envs} envs, which do not split evenly "
                    f"over {wanted} servers; pick a number of servers that divides {num_envs}, or give --num-envs "
                    "or --envs-per-server too"
                )
    try:
        return dataclasses.replace(saved, **{**moved, **overrides, **fixed})
    except ValueError as err:
        if saved.servers is None or servers is not None:
            raise
        if moved:
            raise ValueError(f"{err} (moving the run in {run} off --servers {saved.servers})") from None
        # (the option refused conflicts with --servers, which the user did not give this time)
        raise ValueError(
            f"{err} (--servers {saved.servers} comes from the run's {rundir.CONFIG}; to {what} the run on envs this "
            f"command starts, give {_MOVE_FLAGS})"
        ) from None


_MOVE_OPTIONS = ("backend", "num_servers", "num_envs", "envs_per_server")
"""Options that, given with --resume or --like, move a run trained on --servers onto envs this command starts."""
_MOVE_FLAGS = "--backend, --num-servers, --num-envs or --envs-per-server"


def _shown(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


@dataclass
class Counters:
    """Progress a checkpoint carries besides the nets and optimizer."""

    global_step: int = 0
    update: int = 0
    seconds: float = 0.0
    episodes: int = 0
    recent_returns: list[float] = field(default_factory=list)
    recent_lengths: list[int] = field(default_factory=list)
    solved_at_step: int | None = None
    solved_at_seconds: float | None = None
    solved_threshold: float | None = None
    """The mean return ``solved_at_step`` was judged against (--stop-at-return, else the env's threshold)."""
    env_steps_lost: int = 0
    """Env steps that were no transition because their env was unavailable (server lost, env raised)."""
    episodes_cut: int = 0
    """Episodes that ended because their env became unavailable (not counted in the returns)."""
    env_errors: int = 0
    """Env steps whose env raised (``infos["env_error"]``, isolated by its server; an out-of-order env's
    steps too: its reset raised, tried again at each step): of env_steps_lost."""
    failures: int = 0
    """The fleet's fault counters (``FaultStats``, see FAULT_COUNTS), the whole run's as of the end of
    the last rollout learned from: a resumed run adds its own to them."""
    shutdowns: int = 0
    reconnects: int = 0
    server_restarts: int = 0
    servers_joined: int = 0
    servers_left: int = 0
    best_return: float | None = None
    """The highest mean return of the last 20 episodes at an update's end (once 20 had ended) or at the
    run's end; with --save-best, best.pt's (a resumed run takes it from the file)."""
    best_step: int | None = None
    """The step of that update (its nets are checkpoints/best.pt, with --save-best), or of the run's end."""


class StopRequest:
    """Turns the first Ctrl-C (or SIGTERM) into a request to stop at the next step; a second Ctrl-C interrupts.

    ``then`` says what follows the stop (in the warning the first one logs). ``event``, set from any
    thread, asks for the same stop (a caller's: signals reach only the main thread); ``signalled`` says
    whether a signal asked for it."""

    def __init__(
        self,
        then: str = "checkpoint and summary follow",
        logger: logging.Logger | None = None,
        event: threading.Event | None = None,
    ) -> None:
        self.signalled = False
        self._then = then
        self._log = logger or log
        self._event = event
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signalled or (self._event is not None and self._event.is_set())

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signalled and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signalled:  # (a second SIGTERM: the stop asked for stands)
            return
        self.signalled = True
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self._log.warning("%s: stopping after this step (%s); Ctrl-C again to abort at once", what, self._then)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def set_torch_threads(device: torch.device, image: bool, threads: int = 0) -> None:
    """torch's CPU threads for a policy on ``device`` (``image``: a CNN's): ``threads`` if given (> 0), else
    one for an MLP on the CPU (train and eval alike), else torch's default."""
    if threads:
        torch.set_num_threads(threads)
    elif device.type == "cpu" and not image:
        # A 64x64 MLP is too small to gain from threads; extra threads only contend with the env
        # servers for the same cores (measured: `learner eval` 4-8x slower with torch's default).
        torch.set_num_threads(1)


PROGRESS_LINE_S = 60.0
"""How often ``learner train`` without a terminal (no progress bar) prints a progress line (and once
after its first update, so that a log shows the run under way at once, not a minute later)."""


def progress_line(row: dict[str, Any], total: int) -> str:
    """An update's metrics row as one line, for logs: steps, share done, SPS, recent return, elapsed
    and, until ``total``, the time left at this session's SPS."""
    step, recent = row["global_step"], row["episodic_return_mean"]
    line = (
        f"step {step:,}/{total:,} ({100 * step / max(total, 1):.0f}%), {row['sps']:,.0f} SPS, "
        f"mean return {'-' if recent is None else format_return(recent)}, {row['seconds']:.0f} s"
    )
    if step < total and row["sps"] > 0:
        line += f", ~{_duration((total - step) / row['sps'])} left"
    return line


def _duration(seconds: float) -> str:
    """A time left, as precise as such a guess is: seconds, then minutes, then hours (rounded first,
    so that 119.6 s reads 2 min, not 120 s)."""
    if round(seconds) < 120:
        return f"{seconds:.0f} s"
    if round(seconds / 60) < 120:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def bar_postfix(sps: float | None, recent: float | None) -> str:
    """What the training progress bar shows after its count: SPS and the recent mean return."""
    return f"SPS {'-' if sps is None else f'{sps:,.0f}'}, return {'-' if recent is None else format_return(recent)}"


class _TqdmHandler(logging.Handler):
    """Stands in for a console handler while a progress bar is up: formats a record with that
    handler's formatter and writes it with ``tqdm.write``, which clears the bar, writes the line and
    draws the bar again below it; written straight to the stream, the record would continue the
    bar's line (a bar ends in a carriage return, not a newline)."""

    def __init__(self, console: logging.StreamHandler[Any], stream: Any) -> None:
        super().__init__(console.level)
        self.setFormatter(console.formatter)
        self.filters = list(console.filters)
        self._stream = stream

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self._stream)
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def logging_above_bar() -> Iterator[None]:
    """While the block runs (a progress bar is up), the root logger's console handlers (a
    ``StreamHandler`` on stderr or stdout, as ``configure_logging`` makes: text or JSON) and
    ``logging.lastResort`` (no logging configured) write through ``tqdm.write``; restored after.
    Handlers of files and of log collectors are left as they are."""
    root = logging.getLogger()
    last_resort = logging.lastResort
    console = (sys.stderr, sys.stdout)
    stand_ins: dict[logging.Handler, logging.Handler] = {
        _TqdmHandler(h, h.stream): h
        for h in root.handlers
        if isinstance(h, logging.StreamHandler) and any(h.stream is s for s in console)
    }
    originals = {h: stand_in for stand_in, h in stand_ins.items()}
    root.handlers = [originals.get(h, h) for h in root.handlers]
    ours = _TqdmHandler(last_resort, sys.stderr) if isinstance(last_resort, logging.StreamHandler) else None
    if ours is not None:
        logging.lastResort = ours
    try:
        yield
    finally:  # (the handlers added or removed meanwhile stay so)
        root.handlers = [stand_ins.get(h, h) for h in root.handlers]
        # Only its own stand-in: two bars up at once (train() in a thread, evaluate() in the notebook) may
        # end in either order, and the second saw the first's stand-in as the last resort.
        if ours is not None and logging.lastResort is ours:
            logging.lastResort = last_resort


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel's (a notebook's, JupyterLab's, VS Code's): IPython's shell
    is ipykernel's ZMQInteractiveShell. Its stderr is no terminal, yet shows a progress bar well. Looked up
    in ``sys.modules`` only: nothing is imported where no kernel runs."""
    zmqshell, ipython = sys.modules.get("ipykernel.zmqshell"), sys.modules.get("IPython")
    shell_class = getattr(zmqshell, "ZMQInteractiveShell", None)
    get_ipython = getattr(ipython, "get_ipython", None)
    if not isinstance(shell_class, type) or get_ipython is None:
        return False
    try:
        return isinstance(get_ipython(), shell_class)
    except Exception:  # (an IPython of another make: no notebook to go by)
        return False


def _tqdm_class() -> Any:
    """tqdm's widget bar in a notebook that can show one (ipywidgets installed), else its text bar, which
    a notebook shows as well: ``tqdm.auto`` without ipywidgets would warn "IProgress not found" (and fall
    back to the text bar all the same)."""
    if in_notebook() and importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.auto import tqdm as auto_tqdm

        return auto_tqdm
    from tqdm import tqdm

    return tqdm


def _widget_total(bar: Any) -> None:
    """tqdm's notebook widget keeps the total it was made with (its progress's ``max``) when ``total``
    changes: made to follow, so that a full bar looks full."""
    children: Any = getattr(getattr(bar, "container", None), "children", ())
    if len(children) > 1 and hasattr(children[1], "max"):
        children[1].max = bar.total


@contextlib.contextmanager
def progress_bar(show: bool, total: int, initial: int = 0, *, unit: str = "step", scale: bool = True) -> Iterator[Any]:
    """A tqdm bar on stderr counting ``unit``s up to ``total`` (``scale``: as 12.3k), or None when not
    ``show`` (callers pass ``sys.stderr.isatty()`` unless told, so that logs and pipes stay free of it;
    train also ``in_notebook()``). In a notebook with ipywidgets, tqdm's widget instead.
    While it is up, log records are written above it (see logging_above_bar), not into its line."""
    if not show:
        yield None
        return
    tqdm = _tqdm_class()

    bar = tqdm(
        total=total,
        initial=initial,
        unit=unit,
        unit_scale=scale,
        dynamic_ncols=True,
        bar_format=f"{{l_bar}}{{bar}}| {{n_fmt}}/{{total_fmt}} {unit}s [{{elapsed}}<{{remaining}}{{postfix}}]",
    )
    try:
        with logging_above_bar():
            yield bar
    finally:
        bar.close()


def _close_bar(bar: Any, summary: dict[str, Any], stop_reason: str | None, since: tuple[float, int]) -> None:
    """The training bar's last state, before it closes: the run's final figures (summary.json's), not
    those of its last update. A run stopped by --stop-at-return ends at 100% of the steps it took (the
    bar's total was --total-timesteps, whose remaining time it would show); one stopped by Ctrl-C
    keeps its total (it is to be resumed). ``since``: (time.perf_counter(), step) of the session's start:
    the SPS of a run stopped mid-rollout counts the steps after its last update too."""
    step, sps = summary["total_steps"], summary["sps"]
    if stop_reason == "stop_at_return":
        bar.total = step
        _widget_total(bar)
        sps = (step - since[1]) / max(time.perf_counter() - since[0], 1e-9)
    if stop_reason in ("stop_at_return", "total_timesteps") and step >= bar.n:
        bar.update(step - bar.n)
    bar.set_postfix_str(bar_postfix(sps, summary["final_return_mean"]))


@contextlib.contextmanager
def _plot_at_exit(enabled: bool) -> Iterator[list[Path]]:
    """Writes returns.png into the run dir the block appends to the list yielded, once the block is over
    (its envs closed): whether the run ended or failed (then a failed plot is logged, not raised over
    the run's error), but not when it was aborted (a second Ctrl-C)."""
    run_dirs: list[Path] = []
    try:
        yield run_dirs
    except KeyboardInterrupt:
        raise
    except BaseException:
        if enabled and run_dirs:
            try:
                _plot(run_dirs[0])
            except Exception:
                log.exception("could not plot %s", run_dirs[0])
        raise
    if enabled and run_dirs:
        _plot(run_dirs[0])


def _plot(run_dir: Path) -> None:
    from learner.plot import plot_runs

    try:
        plot_runs([run_dir], run_dir / rundir.PLOT, output_name=f"the run's {rundir.PLOT}")
    except ValueError as err:  # no episode ended yet, a full disk
        log.warning("no plot written: %s", err)


def _asked_stop(stop: StopRequest) -> str:
    """summary.json's ``stop_reason`` for a run that ``stop`` stopped: "interrupted" by a signal (Ctrl-C,
    SIGTERM), "stopped" by the caller's event."""
    if not stop.signalled:
        log.info("the stop event was set: the run stops here (checkpoint and summary follow)")
    return "interrupted" if stop.signalled else "stopped"


def _stop_reason(err: BaseException) -> str:
    """summary.json's ``stop_reason`` for a run that ``err`` ended."""
    return "interrupted" if isinstance(err, KeyboardInterrupt) else f"error: {type(err).__name__}: {err}"


ENV_ERROR_LOG_S = 60.0
"""How often, at most, learner train logs an env's error (the first at once; the count in between)."""


def _say_env_error(said: list[Any], total: int, env: int, infos: dict[str, Any]) -> None:
    """Log that env ``env`` raised in its step (its server isolated the error: its episode was cut), the
    first at once, then at most every :data:`ENV_ERROR_LOG_S` (``said``: when last, and the count then)."""
    now = time.monotonic()
    if said[1] and now - said[0] < ENV_ERROR_LOG_S:
        return
    text = str(infos["env_error"][env])
    # (an env whose reset raised is out of order: its server tries a reset at each step, each an env error)
    what = (
        "is out of order (its reset raised; tried again at each step)"
        if text.startswith("out of order")
        else ("raised (its episode was cut short, and the env reset)")
    )
    log.warning(
        "env %d %s: %s (%d env error%s in this run so far; one such line a minute at most)",
        env,
        what,
        text if len(text) <= 300 else text[:300] + "...",
        total,
        "" if total == 1 else "s",
    )
    said[0], said[1] = now, total


def _mean(values: list[float] | list[int]) -> float | None:
    return float(np.mean(values)) if values else None


def unavailable_envs(infos: dict[str, Any], num_envs: int) -> np.ndarray:
    """Bool per env: its step gave no transition (``env_unavailable`` from a fault-tolerant fleet, or an
    ``env_error`` an env server isolated, which in-process envs built by env_server report too)."""
    lost = np.zeros(num_envs, dtype=bool)
    for key in ("_env_unavailable", "_env_error"):
        mask = infos.get(key)
        if mask is not None:
            lost |= np.asarray(mask, dtype=bool)
    return lost


def nothing_to_learn(rollouts: int, errors: dict[str, int]) -> str:
    """NothingToLearnError's message: ``rollouts`` in a row gave no transition; ``errors``: what the envs
    reported in them (``infos["env_error"]`` text -> env steps), the most frequent named."""
    if errors:
        ranked = sorted(errors.items(), key=lambda item: -item[1])
        cause = "the envs reported: " + "; ".join(f"{text} ({count:,} env steps)" for text, count in ranked[:3])
        if len(ranked) > 3:
            cause += f"; and {len(ranked) - 3} other errors"
        cause += " (the env servers log the tracebacks)"
    else:
        cause = (
            "every env's server was unavailable, or was lost before its envs gave a transition (see the warnings above)"
        )
    where = f"{rollouts} rollouts in a row" if rollouts > 1 else "the run's rollout"
    return f"no env gave a transition in {where}: nothing to learn from, the run stops; {cause}"


def _check_minibatches(hp: PPOConfig, num_envs: int) -> None:
    """Warn of minibatches of one transition: advantage normalisation makes a lone advantage 0, so the
    policy would learn nothing (the update takes at most one minibatch per transition)."""
    batch_size = num_envs * hp.num_steps
    if hp.norm_adv and batch_size < 2 * hp.num_minibatches:
        log.warning(
            "--num-minibatches %d: a batch of %d transitions (%d envs x --num-steps %d) leaves fewer than 2 per "
            "minibatch, and advantage normalisation makes a lone advantage 0: the policy learns nothing; "
            "pass at most %d (or more envs or steps)",
            hp.num_minibatches,
            batch_size,
            num_envs,
            hp.num_steps,
            max(1, batch_size // 2),
        )


def _check_fresh(run_dir: Path) -> None:
    """A run dir a new run can be written to (not made yet: a run that fails to start leaves none), or
    one whose run stopped before its first checkpoint (set aside: see :func:`rundir.set_aside`)."""
    existing = next(p for p in (run_dir, *run_dir.parents) if p.exists())
    if not existing.is_dir():
        raise FileExistsError(f"--run-dir: cannot make {run_dir}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--run-dir: cannot make {run_dir}: {existing} is not writable")
    if rundir.list_checkpoints(run_dir):  # (one without: stopped before its first, it starts over)
        raise FileExistsError(
            f"--run-dir {run_dir} already holds a run; pass --resume {run_dir} to continue it, or another --run-dir"
        )


def _close_quietly(f: Any) -> None:
    with contextlib.suppress(OSError):
        f.close()


@contextlib.contextmanager
def writing(path: Path, *, torch_save: bool = False) -> Iterator[None]:
    """A write of ``path`` in a run dir: its OSError (and, ``torch_save``, RuntimeError, which torch's
    writer raises for a full disk) becomes :func:`cannot_write`'s one-line error."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        if not (isinstance(err, OSError) or torch_save):
            raise
        raise cannot_write(path, err) from err


def cannot_write(path: Path, err: BaseException) -> RunDirWriteError:
    """What a failed write of ``path`` in a run dir raises: the file, why, and the room left there."""
    lines = str(err).strip().splitlines()
    reason = err.strerror if isinstance(err, OSError) and err.strerror else lines[0] if lines else type(err).__name__
    try:
        room = f"; {shutil.disk_usage(path.parent).free / 1e6:,.1f} MB free there"
    except OSError:
        room = ""
    return RunDirWriteError(f"cannot write {path}: {reason}{room}")


def stopped_in_update(saved_step: int | None) -> str:
    """What a run stopped during an update says: no checkpoint of that update is written (the nets are
    half-way through it); ``saved_step`` is the step of the last checkpoint on disk, None if there is none."""
    if saved_step is None:
        return (
            "stopped during an update: no checkpoint written, and none was before (see --checkpoint-every): "
            "resuming starts this run over"
        )
    return (
        f"stopped during an update: no checkpoint of it written; resuming starts at the last one, step {saved_step:,}"
    )


def check_resume(args: Args, checkpoint: dict[str, Any]) -> None:
    """RunCompleteError when resuming ``checkpoint`` (the run in ``args.resume``) with ``args`` leaves nothing to
    do: its env steps are done, or it was solved under a bar no lower than --stop-at-return."""
    counters = checkpoint["counters"]
    done = int(counters["global_step"])
    total = args.total_timesteps or int(checkpoint["ppo"]["total_timesteps"])
    if done >= total:
        raise RunCompleteError(
            f"--total-timesteps: the run in {args.resume} already has {done:,} env steps, so {total:,} leaves "
            f"nothing to do; pass more (e.g. --total-timesteps {done + total}) to continue it"
        )
    solved_at, solved_under = counters.get("solved_at_step"), counters.get("solved_threshold")
    stop_at = args.stop_at_return
    if solved_at is not None and solved_under is not None and stop_at is not None and stop_at <= solved_under:
        raise RunCompleteError(
            f"--stop-at-return: the run in {args.resume} was solved at step {solved_at:,} (mean return of the "
            f"last {RECENT} episodes >= {solved_under:g}), so --stop-at-return {stop_at:g} leaves nothing to do; "
            "pass --no-stop-at-return to train it on to --total-timesteps, or a higher --stop-at-return"
        )


_SOLVE_COUNTERS = ("solved_at_step", "solved_at_seconds", "solved_threshold", "best_return", "best_step")
"""What a checkpoint taken at the last update carries over from a run solved after it."""


def restore(
    checkpoint: dict[str, Any],
    run_dir: Path,
    *,
    agent: Agent,
    optimizer: optim.Optimizer,
    obs_rms: RunningMeanStd | None,
    reward_scaler: RewardScaler | None,
    save_best: bool,
) -> Counters:
    """The run in ``run_dir`` as of ``checkpoint``: its nets, optimizer, normalisers and RNG states loaded,
    its run dir cleared of what came after the checkpoint; returns its counters."""
    # The nets take normalised observations (the policy) and learned returns at the scaler's scale (the
    # value): a preset or option that turns either on or off would change what they see.
    for key, flag, now in (
        ("obs_rms", "--norm-obs", obs_rms is not None),
        ("reward_scaler", "--norm-reward", reward_scaler is not None),
    ):
        before = checkpoint.get(key) is not None
        if now != before:
            raise ValueError(
                f"{flag}: the run in {run_dir} was trained {'with' if before else 'without'} it; a resumed run keeps "
                f"its nets, which learned with{'' if before else 'out'} it, so it cannot change (the options given, "
                f"or their preset, turn it {'on' if now else 'off'}: give {flag if before else '--no-' + flag[2:]})"
            )
    load_nets(agent, checkpoint["model"], f"--resume {run_dir}")
    optimizer.load_state_dict(checkpoint["optimizer"])
    if obs_rms is not None:
        obs_rms.load_state_dict(checkpoint["obs_rms"])
    if reward_scaler is not None:
        reward_scaler.load_state_dict(checkpoint["reward_scaler"])
    counters = Counters(**checkpoint["counters"])
    restore_rng(checkpoint["rng"])
    for path in rundir.remove_stale_temp_files(run_dir):
        log.info("removed %s, left by a write the previous run did not finish", path)
    if save_best:
        # The bar is best.pt's own: it may be of an update after the checkpoint (the run was
        # killed in between), or older than the checkpoint's bar (a session with --no-save-best).
        best_file = run_dir / rundir.CHECKPOINTS / rundir.BEST_CHECKPOINT
        kept = load_checkpoint(best_file)["counters"] if best_file.is_file() else {}
        counters.best_return, counters.best_step = kept.get("best_return"), kept.get("best_step")
    # Metrics of updates after the checkpoint were lost with the run; the resumed run redoes them.
    metrics_path = run_dir / rundir.METRICS
    if metrics_path.exists():
        rows = rundir.read_jsonl(metrics_path)
        rundir.rewrite_jsonl(metrics_path, [r for r in rows if r.get("update", 0) <= counters.update])
    return counters


def resumed_threshold(counters: Counters, threshold: float | None) -> float | None:
    """The bar this session judges "solved" by, given its own (``threshold``: --stop-at-return, else the
    env's) and a resumed run's ``counters``: a run solved against a lower bar is judged again (its
    solved_at fields cleared); with no bar of its own, the one it was solved against stands."""
    before = counters.solved_threshold
    if counters.solved_at_step is None:
        return threshold
    if threshold is None:
        threshold = before
    if threshold is None or before is None or threshold > before:
        counters.solved_at_step = counters.solved_at_seconds = counters.solved_threshold = None
    return threshold


# ---- the fleet, update by update: fault counts, per-replica statistics, slow replicas ----------------------

SLOW_RATIO = 3.0
"""A replica whose median env step (or round trip) is this many times the other replicas' median is slow..."""
SLOW_UPDATES = 3
"""... for this many updates in a row: then it is warned of (once, until it recovers)."""
SLOW_MIN_MS = 0.1
"""... and at least this many ms slower, so that the microseconds by which fast envs' replicas differ are not flagged."""


class SlowReplicas:
    """Warns of a replica that stays slower than the others (load imbalance: a synchronous fleet waits
    for its slowest replica on every step), by its ``env_p50_ms`` (its envs' own step time: a slow or
    overloaded host) or else its ``latency_p50_ms`` (the round trip: its network or server)."""

    def __init__(self) -> None:
        self._streaks: dict[str, int] = {}
        self._warned: set[str] = set()

    def check(self, replicas: list[ReplicaStats], label: Callable[[str], str] = str) -> list[tuple[int, str]]:
        """What to log (level, message) after an update whose windows are ``replicas``, each named
        ``label(its address)``."""
        said: list[tuple[int, str]] = []
        for replica in replicas:
            slow = _slowness(replica, replicas)
            if slow is None:
                continue  # not measured in this update (no steps, or no others to compare with)
            address = label(replica.address)
            who = address if address == replica.address else f"{address} ({replica.address})"
            if not slow[0]:
                self._streaks[address] = 0
                if address in self._warned:
                    self._warned.discard(address)
                    said.append((logging.INFO, f"env server {who} is no longer slow ({slow[1]})"))
                continue
            self._streaks[address] = self._streaks.get(address, 0) + 1
            if self._streaks[address] >= SLOW_UPDATES and address not in self._warned:
                self._warned.add(address)
                said.append(
                    (
                        logging.WARNING,
                        f"env server {who} is slow: {slow[1]}, for {SLOW_UPDATES} updates in a row; the "
                        f"fleet waits for it on every step (see replicas/{address}/ in {rundir.METRICS})"
                        + (_busy_here() if address != replica.address else ""),
                    )
                )
        return said


def _busy() -> str:
    """ "1-minute load average L on N CPUs" when this machine is busy (L at least N: other trainings side
    by side, say), else ""."""
    cpus = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # (Windows has none)
        return ""
    return f"1-minute load average {load:.1f} on {cpus} CPUs" if load >= cpus else ""


def _busy_here() -> str:
    """For a server this learner started on this machine: that the machine is busy, which slows one
    local server more than another as the OS gives out the CPUs; "" otherwise."""
    busy = _busy()
    return f"; this machine is busy ({busy}), which may be all it is" if busy else ""


def _slowness(replica: ReplicaStats, replicas: list[ReplicaStats]) -> tuple[bool, str] | None:
    """(whether ``replica`` is slow against the median of the others, in words its figures that say so
    or, if not slow, its env step's); None when there is nothing to compare. (Against the others, not
    the whole fleet's median: with two replicas the fleet's median is their mean, which neither reaches
    3 times.)"""
    said: tuple[bool, str] | None = None
    for key, what in (("env_p50_ms", "its envs' median step"), ("latency_p50_ms", "its median round trip")):
        value = getattr(replica, key)
        others = [getattr(r, key) for r in replicas if r is not replica and r.steps]
        others = [v for v in others if math.isfinite(v)]
        if not (replica.steps and math.isfinite(value) and others):
            continue
        median = float(np.median(others))
        ratio = value / median if median > 0 else math.inf
        text = f"{what} {value:.2f} ms, {ratio:.1f}x the other servers' median ({median:.2f} ms)"
        if ratio >= SLOW_RATIO and value - median >= SLOW_MIN_MS:
            return True, text
        said = said or (False, text)
    return said


@dataclass
class ReplicaTotals:
    """One env server's statistics over a session (summary.json's ``replicas``): sums of its windows'
    counts, and means of their medians weighted by their steps."""

    num_envs: int = 0
    steps: int = 0
    failures: int = 0
    shutdowns: int = 0
    reconnects: int = 0
    stalls: int = 0
    _weighted: dict[str, float] = field(default_factory=dict)
    _weights: dict[str, int] = field(default_factory=dict)

    COUNTS = ("failures", "shutdowns", "reconnects", "stalls")
    MEANS = ("env_p50_ms", "latency_p50_ms", "env_busy")

    def add(self, window: ReplicaStats) -> None:
        self.num_envs = window.num_envs
        self.steps += window.steps
        for key in self.COUNTS:
            setattr(self, key, getattr(self, key) + getattr(window, key))
        for key in self.MEANS:
            value = getattr(window, key, None)  # (env_busy: where the fleet reports it)
            if value is not None and window.steps and math.isfinite(value):
                self._weighted[key] = self._weighted.get(key, 0.0) + value * window.steps
                self._weights[key] = self._weights.get(key, 0) + window.steps

    def as_dict(self) -> dict[str, Any]:
        means = {
            k: round(self._weighted[k] / self._weights[k], 4) if self._weights.get(k) else None for k in self.MEANS
        }
        if "env_busy" not in self._weights:
            del means["env_busy"]
        counts = {k: getattr(self, k) for k in ("num_envs", "steps", *self.COUNTS)}
        return {**counts, **means}


class FleetWatch:
    """A fleet's fault counters and per-replica statistics, rollout by rollout (``envs`` without them,
    in-process envs, give none)."""

    def __init__(self, envs: Any, carried: dict[str, int], local: bool = False) -> None:
        self._fault_stats = getattr(envs, "fault_stats", None)
        self._replica_stats = getattr(envs, "replica_stats", None)
        self._labels: dict[str, str] = {}
        if self._replica_stats is not None:
            first = self._replica_stats(reset=True)
            if local:
                # Servers the learner started: their addresses are new each session (a temporary
                # folder's socket, a free port), their places are not (a restart keeps its address).
                self._labels = {r.address: f"local-{i}" for i, r in enumerate(first)}
        self._before = self._fault_stats() if self._fault_stats is not None else None
        self.carried = carried
        """The fault counts of the run's earlier sessions (a resumed run's checkpoint)."""
        self.replicas: dict[str, ReplicaTotals] = {}
        """This session's statistics per replica (its :meth:`label`)."""
        self.server_ids: dict[str, str] = {}
        """Each replica's (:meth:`label`) server process id as of the last rollout ("" where unknown)."""
        self._slow = SlowReplicas()

    def rollout_metrics(self) -> dict[str, float]:
        """Since the last call: servers lost and back (``faults/<count>``, and ``faults/servers_down`` now),
        and per env server (``replicas/<address>/<field>``) the step latency p50/p99 as the learner saw it,
        the envs' own step time and env-steps/s; warns of a replica that stays slow."""
        metrics: dict[str, float] = {}
        if self._fault_stats is not None and self._before is not None:
            now = self._fault_stats()
            for key in FAULT_COUNTS:
                metrics[f"faults/{key}"] = getattr(now, key) - getattr(self._before, key)
            metrics["faults/servers_down"] = now.servers_down
            metrics["faults/servers_not_joined"] = now.servers_not_joined
            self._before = now
        windows = self._replica_stats(reset=True) if self._replica_stats is not None else []
        self.server_ids = {self.label(window.address): window.server_id for window in windows}
        for window in windows:
            # By address, not position: a fleet's positions shift as servers leave and join.
            name = self.label(window.address)
            metrics.update(window.metrics(f"replicas/{name}/"))
            self.replicas.setdefault(name, ReplicaTotals()).add(window)
        for level, message in self._slow.check(windows, self.label):
            log.log(level, "%s", message)
        return metrics

    def label(self, address: str) -> str:
        """How metrics name a replica: its address, or ``local-<i>`` for the i-th server the learner
        started itself."""
        return self._labels.get(address, address)

    def totals(self) -> dict[str, int] | None:
        """The whole run's fault counts as of now (None for envs without them, unless carried over)."""
        if self._fault_stats is None and not any(self.carried.values()):
            return None
        now = self._fault_stats() if self._fault_stats is not None else None
        return {key: self.carried[key] + (getattr(now, key) if now is not None else 0) for key in FAULT_COUNTS}

    def servers_lost(self) -> int:
        """Servers lost so far (failed or shut down), counting each time one was; 0 for envs without them."""
        totals = self.totals() or {}
        return totals.get("failures", 0) + totals.get("shutdowns", 0)


# ---- what each update and the run report ---------------------------------------------------------------------


def metrics_row(
    update: int,
    timing: dict[str, float],
    result: UpdateResult,
    rollout_info: dict[str, Any],
) -> dict[str, Any]:
    """metrics.jsonl's row of an update: ``timing`` (seconds, sps, sps_update, other_seconds) as of its end,
    the run as of the end of the rollout it learned from (``rollout_info``), and its ``result``."""
    return {
        "update": update,
        "global_step": rollout_info["global_step"],
        "seconds": round(timing["seconds"], 4),
        "sps": round(timing["sps"], 1),
        "sps_update": round(timing["sps_update"], 1),
        "transitions_per_s": round(timing["transitions_per_s"], 1),
        "episodic_return_mean": rollout_info["episodic_return_mean"],
        "episodic_length_mean": rollout_info["episodic_length_mean"],
        "episodes": rollout_info["episodes"],
        "learning_rate": rollout_info["learning_rate"],
        "clip_coef": rollout_info["clip_coef"],
        "value_loss": result.value_loss,
        "policy_loss": result.policy_loss,
        "entropy": result.entropy,
        "old_approx_kl": result.old_approx_kl,
        "approx_kl": result.approx_kl,
        "clipfrac": result.clipfrac,
        "explained_variance": result.explained_variance,
        "num_envs": rollout_info["num_envs"],
        "batch_size": result.batch_size,
        "rollout_seconds": rollout_info["rollout_seconds"],
        "update_seconds": round(result.seconds, 5),
        "other_seconds": round(timing["other_seconds"], 5),
        # Fault tolerance, this update: env steps that were no transition, envs unavailable
        # at its end, episodes cut short; and servers lost and back, from the fleet's
        # counters (summary.json has the run's totals), and per env server its statistics.
        "env_steps_lost": rollout_info["env_steps_lost"],
        "env_errors": rollout_info["env_errors"],
        "envs_unavailable": rollout_info["envs_unavailable"],
        "episodes_cut": rollout_info["episodes_cut"],
        **rollout_info["fleet"],
    }


class EventsWriter:
    """A run's TensorBoard event file (torch's SummaryWriter): a write that fails (a full disk, a run dir
    turned read-only) ends the run with :func:`cannot_write`'s one line, as every run-dir write does.

    The writer writes from a thread of its own, which keeps its error for the next write to raise;
    Python would print that thread's traceback too (:class:`_QuietEventsThread`)."""

    def __init__(self, run_dir: Path, purge_step: int | None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._hook = _QuietEventsThread()
        self.path = run_dir / "events.out.tfevents.*"  # (named once SummaryWriter made it)
        try:
            with writing(self.path):
                self._writer = SummaryWriter(str(run_dir), purge_step=purge_step)
        except BaseException:
            self._hook.close()
            raise
        events = self._writer._get_file_writer().event_writer
        self.path = Path(getattr(events, "_file_name", self.path))
        self._failed = False

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        try:
            self._writer.add_scalar(tag, value, step)
        except OSError as err:
            self._failed = True
            raise cannot_write(self.path, err) from err

    def close(self) -> None:
        """Flush and close the file; a failure not raised already is logged (the run has ended)."""
        try:
            self._writer.close()
        except OSError as err:
            if not self._failed:
                log.error("%s", cannot_write(self.path, err))
        finally:
            self._hook.close()


class _QuietEventsThread:
    """Until closed, leave out the traceback Python prints for an OSError in TensorBoard's writer thread:
    the thread keeps it, and the next write or the close raises it, where :class:`EventsWriter` reports
    it (the process's hook is put back on close, where it is still this one)."""

    def __init__(self) -> None:
        from tensorboard.summary.writer import event_file_writer

        self._inner = inner = threading.excepthook
        writer_thread = event_file_writer._AsyncWriterThread

        def hook(args: Any) -> None:
            if not (isinstance(args.thread, writer_thread) and isinstance(args.exc_value, OSError)):
                inner(args)

        self._hook = hook
        threading.excepthook = hook

    def close(self) -> None:
        if threading.excepthook is self._hook:
            threading.excepthook = self._inner


_PERF_TAGS = ("rollout_seconds", "update_seconds", "other_seconds", "sps_update", "transitions_per_s")
"""Row keys TensorBoard gets as perf/<key> (CleanRL has no tags for them)."""


def _fault_values(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row's fault counts, by their TensorBoard tags (``faults/<key>``)."""
    keys = ("env_steps_lost", "env_errors", "envs_unavailable", "episodes_cut")
    faults = {f"faults/{key}": row.get(key, 0) for key in keys}  # (0 in rows of versions before a key)
    faults.update((key, value) for key, value in row.items() if key.startswith("faults/"))
    return faults


def fault_tags_started(rows: Iterable[dict[str, Any]]) -> set[str]:
    """The faults/ tags :func:`write_tensorboard` started over ``rows`` (a resumed run's metrics, as
    kept): the resumed session goes on writing them, zeros included."""
    started: set[str] = set()
    for row in rows:
        started.update(tag for tag, value in _fault_values(row).items() if value and not math.isnan(value))
    return started


def tagged_values(row: dict[str, Any]) -> dict[str, float]:
    """An update's row by TensorBoard tag: CleanRL's tags for what CleanRL logs, perf/, faults/ (every
    count, zeros included) and replicas/ (without the NaNs of figures a server had none of) for the rest.
    --track logs them to W&B by the same names."""
    values = {
        "charts/learning_rate": row["learning_rate"],
        "charts/clip_coef": row["clip_coef"],
        "charts/SPS": row["sps"],
        "charts/num_envs": row["num_envs"],
    }
    for key in ("value_loss", "policy_loss", "entropy", "old_approx_kl", "approx_kl", "clipfrac"):
        values[f"losses/{key}"] = row[key]
    values["losses/explained_variance"] = row["explained_variance"]
    for key in _PERF_TAGS:
        values[f"perf/{key}"] = row[key]
    values.update(_fault_values(row))
    values.update((key, value) for key, value in row.items() if key.startswith("replicas/") and not math.isnan(value))
    return values


def write_tensorboard(writer: EventsWriter, row: dict[str, Any], faults_seen: set[str]) -> None:
    """An update's row as TensorBoard scalars (:func:`tagged_values`; episodes are logged as they end, as
    CleanRL does).

    A faults/ tag starts at its first update with a fault of its kind (``faults_seen``, the tags started
    so far this session, grows with it) and goes on at every update after: a run with no faults shows
    no flat zeros (metrics.jsonl keeps every count, zeros included)."""
    step = row["global_step"]
    for tag, value in tagged_values(row).items():
        if tag.startswith("faults/"):
            if tag not in faults_seen and not (value and not math.isnan(value)):
                continue
            faults_seen.add(tag)
        writer.add_scalar(tag, value, step)


def build_summary(
    counters: Counters,
    *,
    stop_reason: str | None,
    threshold: float | None,
    last_row: dict[str, Any],
    device: torch.device,
    faults: dict[str, int] | None,
    replicas: dict[str, ReplicaTotals],
) -> dict[str, Any]:
    """summary.json: the run as ``counters`` hold it; ``faults``: the whole run's fault counts (None: no
    fleet); ``replicas``: this session's statistics per env server."""
    summary: dict[str, Any] = {
        "total_steps": counters.global_step,
        "seconds": round(counters.seconds, 3),
        "final_return_mean": _mean(counters.recent_returns),
        "solved": counters.solved_at_step is not None,
        "solved_at_step": counters.solved_at_step,
        "solved_at_seconds": None if counters.solved_at_seconds is None else round(counters.solved_at_seconds, 3),
        "solved_threshold": threshold,
        "stop_reason": stop_reason,
        "episodes": counters.episodes,
        "updates": counters.update,
        "sps": last_row.get("sps"),
        "device": str(device),
        "cuda_max_memory_mb": round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
        if device.type == "cuda"
        else None,
        "env_steps_lost": counters.env_steps_lost,
        "env_errors": counters.env_errors,
        "episodes_cut": counters.episodes_cut,
        "best_return": counters.best_return,
        "best_step": counters.best_step,
    }
    if faults is not None:
        summary.update(faults)
    if replicas:
        summary["replicas"] = {address: totals.as_dict() for address, totals in replicas.items()}
    return summary


def train(
    args: Args,
    *,
    on_start: Callable[[dict[str, Any]], None] | None = None,
    on_fleet_change: Callable[[FleetChange], None] | None = None,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Train until ``--total-timesteps`` or ``--stop-at-return``; returns what ``summary.json`` holds, with
    ``run_dir`` and, with --track, ``wandb_run`` (what ``wandb-run.json`` holds: id, project, entity, url).

    Stopped by Ctrl-C (a notebook's kernel interrupt) or SIGTERM, it stops at the next step, writes what
    a finished run writes, then raises :class:`~learner.errors.TrainingInterrupted` with that summary
    (``.summary``): a caller that trains several runs stops there, not at the next run's start. A second
    Ctrl-C aborts at once (KeyboardInterrupt). torch's thread count and matplotlib's backend are as they
    were once it returns or raises.

    ``on_start`` is called once the envs are up, with what ``config.json`` holds plus ``run_dir``,
    for a resumed run ``resumed_from`` (the checkpoint) and ``resumed_step``, and with --metrics-port
    ``metrics_url`` (where the metrics are served: the CLI prints them).
    ``on_fleet_change`` is called with each change of the fleet (servers that joined or left), before
    the rollout that steps the changed fleet.
    ``stop``, once set (from any thread: a training thread's owner, a notebook's button), stops the run
    as Ctrl-C does (at the next step; checkpoint, summary.json and plot written), but ``train()`` then
    returns its summary, whose ``stop_reason`` is ``"stopped"``.
    """
    device = pick_device(args.device)
    if args.resume and Path(args.resume).is_dir() and not rundir.list_checkpoints(args.resume):
        # Stopped before its first checkpoint (killed in its first update, a full disk): nothing to go on
        # from, so it starts over with the options it was started with, where it was.
        log.warning(
            "--resume %s: no checkpoint there (the run stopped before its first one): starting it over, with the "
            "options in its %s",
            args.resume,
            rundir.CONFIG,
        )
        args = dataclasses.replace(args, resume=None, run_dir=args.resume)
    checkpoint_file: Path | None = None
    checkpoint: dict[str, Any] | None = None
    unreadable: list[tuple[Path, str]] = []  # newer checkpoints torch cannot read (a damaged disk or copy)
    if args.resume and Path(args.resume).is_dir():
        checkpoint_file, checkpoint, unreadable = load_latest_readable(args.resume)
    elif args.resume:
        checkpoint_file = find_checkpoint(args.resume)
        checkpoint = load_checkpoint(checkpoint_file)
        if args.run_dir is None:  # (a checkpoint file: its run goes on in the run dir it is in)
            if checkpoint_file.parent.name != rundir.CHECKPOINTS:
                raise ValueError(
                    f"resume: {args.resume} is a checkpoint outside a run dir's {rundir.CHECKPOINTS}/ folder; give "
                    "run_dir, the run dir the resumed run goes on in"
                )
            args = dataclasses.replace(args, run_dir=str(checkpoint_file.parent.parent))
    given_dir = args.run_dir or args.resume
    if given_dir and checkpoint is None:
        _check_fresh(Path(given_dir))  # before starting any servers
    if checkpoint is not None:
        check_resume(args, checkpoint)

    # Seeding (CleanRL): every RNG the learner draws from; env i gets seed + i at reset.
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic

    if args.track:  # (wandb, imported before any server starts: missing, the error names the extra to install)
        from learner.tracking import tracked

    fleet = fleet_spec(args)
    with contextlib.ExitStack() as stack:
        live: LearnerMetrics | None = None  # --metrics-port: served from here (the env servers' start included)
        if args.metrics_port is not None:
            live = serve_metrics(args.metrics_host, args.metrics_port, env_id=args.env or "", run_dir=given_dir or "")
            stack.callback(live.close)  # (entered first: closed last, once the run is over)
        locked = False
        if given_dir and Path(given_dir).is_dir():  # (before any server starts; a new one once it is made)
            stack.enter_context(rundir.lock(given_dir))
            locked = True
            for moved in rundir.set_aside_unreadable(path for path, _ in unreadable):
                log.warning("%s set aside as %s", moved.with_suffix(""), moved.name)
        plotted = stack.enter_context(_plot_at_exit(args.plot))  # entered first: plots after the envs close
        envs = stack.enter_context(open_fleet(fleet))
        # Running servers say what they host; --env names what this command starts.
        env_id = str(getattr(envs, "env_id", None) or args.env)
        if args.servers is not None:
            if args.resume and args.env is not None and args.env != env_id:
                raise ValueError(
                    f"--servers: the run in {args.resume} trained on {args.env}, but the servers at {args.servers} "
                    f"serve {env_id}; resume it on servers of {args.env}"
                )
            if args.env is not None and args.env != env_id:
                raise ValueError(
                    f"--env: expected the env the servers at {args.servers} serve, {env_id}, got {args.env} "
                    "(leave --env out to train on whatever they serve)"
                )
            args = dataclasses.replace(args, env=env_id)  # config.json and checkpoints name the env trained on
        check_observation_space(envs.single_observation_space)  # before the run dir: a refused env leaves none
        # What the envs are beyond their id (recorded: eval makes the same ones for a run on --servers).
        wrappers = list(getattr(envs, "wrappers", args.server_wrappers()))
        served = {
            "wrappers": wrappers,
            # (as the servers said, None from servers too old to say; in-process envs: as open_fleet made them)
            "max_episode_steps": getattr(envs, "time_limit", None)
            or getattr(getattr(envs, "spec", None), "max_episode_steps", None),
            "env_kwargs": getattr(envs, "env_kwargs", None),
        }
        raw = raw_atari_frames(env_id, wrappers, envs.single_observation_space)
        if raw:
            log.warning("%s", raw)
        hp = resolve_ppo(args, envs.single_observation_space, envs.single_action_space)
        _check_squash(hp, envs, wrappers)
        run_dir = Path(given_dir or default_run_dir(env_id))
        if checkpoint is None and given_dir:
            _check_fresh(run_dir)  # (again: another run may have taken it while the servers started)
        try:
            if given_dir:
                run_dir.mkdir(parents=True, exist_ok=True)
            else:  # runs started in the same second (seeds in parallel) each get their own
                run_dir = rundir.make_new_dir(run_dir)
        except OSError as err:
            raise ValueError(f"--run-dir: cannot make {run_dir}: {err.strerror or err}") from None
        if not locked:
            stack.enter_context(rundir.lock(run_dir))
        if checkpoint is None and given_dir:
            _check_fresh(run_dir)  # (held now: no other learner writes it from here on)
            aside = rundir.set_aside(run_dir)
            if aside is not None:
                log.warning(
                    "--run-dir %s held a run that stopped before its first checkpoint: its files are moved to %s, "
                    "and this run starts over",
                    run_dir,
                    aside,
                )
        autoreset = envs.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
        if autoreset not in (gym.vector.AutoresetMode.NEXT_STEP, gym.vector.AutoresetMode.SAME_STEP):
            raise ValueError(
                f"envs: expected autoreset mode NextStep or SameStep, got {getattr(autoreset, 'value', autoreset)} "
                "(PPO's rollouts reset ended envs as they step: start the servers with --autoreset-mode NextStep)"
            )
        next_step_autoreset = autoreset is gym.vector.AutoresetMode.NEXT_STEP
        obs_space, action_space = envs.single_observation_space, envs.single_action_space
        if checkpoint is not None:
            for what, space in (("observation", obs_space), ("action", action_space)):
                if str(space) != checkpoint[f"{what}_space"]:
                    raise ValueError(
                        f"--resume: the run in {args.resume} trained its nets on {what}s {checkpoint[f'{what}_space']}, "
                        f"but these envs ({fleet.describe()}) have {space}; resume it on the same env, wrappers "
                        "and env kwargs"
                    )
        _check_minibatches(hp, envs.num_envs)
        image = is_image_space(obs_space)
        # (restored at the end: the caller's process, a notebook's kernel, keeps its own setting)
        stack.callback(torch.set_num_threads, torch.get_num_threads())
        set_torch_threads(device, image, args.torch_threads)
        busy = _busy() if image and device.type == "cpu" and not args.torch_threads else ""
        if busy:
            log.warning(
                "this machine is busy (%s) and the CNN's updates take torch's %d threads: runs side by side "
                "(seeds, a sweep) go faster with --torch-threads 1 each (3 Pong runs on 2 cores: 2.1-2.4x)",
                busy,
                torch.get_num_threads(),
            )
        hint = device_hint(args.device, device, image)
        if hint:
            log.warning(hint)
        if args.hidden_sizes is not None and image:
            log.warning("--hidden-sizes: image observations get the Nature CNN, not an MLP; ignored")
        if args.action_bounds is not None and not isinstance(action_space, gym.spaces.Box):
            log.warning("--action-bounds: applies to Box actions, not %s; ignored", action_space)
        if args.hang_timeout is not None and args.backend == "gym":
            log.warning("--hang-timeout: applies to env servers this command starts, not in-process envs; ignored")

        agent = Agent(obs_space, action_space, hidden_sizes=hp.hidden_sizes, action_bounds=hp.action_bounds).to(device)
        # eps 1e-5, not torch's 1e-8: PPO's baselines (Huang et al., 2022, detail 3). fused: one kernel for every
        # parameter's update (on CPU since torch 2.4, pyproject's floor).
        optimizer = optim.Adam(agent.parameters(), lr=hp.learning_rate, eps=1e-5, fused=True)
        vector_obs = isinstance(obs_space, gym.spaces.Box) and not image
        obs_rms = RunningMeanStd(obs_space.shape or (), device) if hp.norm_obs and vector_obs else None
        reward_scaler = RewardScaler(hp.gamma, device) if hp.norm_reward else None
        counters = Counters()
        if checkpoint is not None:
            counters = restore(
                checkpoint,
                run_dir,
                agent=agent,
                optimizer=optimizer,
                obs_rms=obs_rms,
                reward_scaler=reward_scaler,
                save_best=args.save_best,
            )
        threshold = args.stop_at_return if args.stop_at_return is not None else reward_threshold(env_id)
        threshold = resumed_threshold(counters, threshold)

        obs_shape = tuple(obs_space.shape or ())
        obs_dtype = (
            torch.uint8 if image else (torch.int64 if isinstance(obs_space, gym.spaces.Discrete) else torch.float32)
        )
        recorded_args = args.to_json()
        if checkpoint is not None and not args.track and (run_dir / rundir.WANDB_RUN).is_file():
            # A tracked run resumed with --no-track: not tracked this time, and recorded as tracked, so
            # that its later sessions go on in its W&B run as a plain --resume does.
            recorded_args["track"] = True
        config: dict[str, Any] = {
            "args": recorded_args,
            "ppo": dataclasses.asdict(hp),
            "envs": {
                "env_id": env_id,
                "description": fleet.describe(),
                "num_envs": envs.num_envs,
                "addresses": list(getattr(envs, "addresses", [])),
                "observation_space": str(obs_space),
                "action_space": str(action_space),
                "autoreset_mode": str(autoreset.value),
                **served,
            },
            "device": str(device),
            "machine": _machine(device),
            "policy": "Nature CNN" if image else f"MLP {','.join(map(str, hp.hidden_sizes))}",
            "solved_threshold": threshold,
            "versions": _versions(),
            "server_versions": getattr(envs, "server_versions", {}),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "resumed_at_step": counters.global_step if checkpoint is not None else None,
            "earlier_sessions": _earlier_sessions(run_dir) if checkpoint is not None else [],
        }
        with writing(run_dir / rundir.CONFIG):
            rundir.write_json(run_dir / rundir.CONFIG, config)
        not_joined = getattr(envs, "servers_not_joined", [])
        log.info(
            "PPO (%s preset, %s) on %s, %d envs%s, device %s, run dir %s",
            hp.preset,
            config["policy"],
            fleet.describe(),
            envs.num_envs,
            f" (without {', '.join(not_joined)}: not joined yet)" if not_joined else "",
            device,
            run_dir,
        )
        if live is not None:
            live.run_started(
                env_id=env_id,
                run_dir=str(run_dir),
                total_timesteps=hp.total_timesteps,
                global_step=counters.global_step,
                updates=counters.update,
                episodes=counters.episodes,
                solved=counters.solved_at_step is not None,
            )
        if on_start is not None:
            resumed = {"resumed_from": str(checkpoint_file), "resumed_step": counters.global_step} if checkpoint else {}
            served_at = {"metrics_url": live.url} if live is not None else {}
            on_start({**config, "run_dir": str(run_dir), **resumed, **served_at})
        tracker: WandbRun | None = None  # --track: the W&B run (finished once the loop is over)
        if args.track:
            tracker = stack.enter_context(tracked(run_dir, config, args))
        writer = None
        faults_seen: set[str] = set()  # (TensorBoard's faults/ tags so far: see write_tensorboard)
        if args.tensorboard:
            if checkpoint is not None and (run_dir / rundir.METRICS).is_file():  # (the rows restore kept)
                faults_seen = fault_tags_started(rundir.read_jsonl(run_dir / rundir.METRICS))
            # A resumed run hides the events the killed run wrote after its checkpoint (they are redone).
            purge_step = counters.global_step + 1 if checkpoint is not None else None  # (its own update's kept)
            writer = stack.enter_context(contextlib.closing(EventsWriter(run_dir, purge_step)))
        with writing(run_dir / rundir.METRICS):
            metrics_file = open(run_dir / rundir.METRICS, "a")  # noqa: SIM115 (closed by the stack)
        # Each row is flushed as written: a close can only fail on a row whose write failed (and said so).
        stack.callback(_close_quietly, metrics_file)
        show_progress = args.progress if args.progress is not None else sys.stderr.isatty() or in_notebook()
        bar = stack.enter_context(progress_bar(show_progress, hp.total_timesteps, counters.global_step))
        # No terminal (a container's or a job's log, a pipe): a line now and then says how the run goes.
        progress_lines = args.progress is None and bar is None
        last_line: float | None = None  # (when the last line was printed; None: none yet, so the first update's)
        stop_request = stack.enter_context(StopRequest(event=stop))
        recent_returns: deque[float] = deque(counters.recent_returns, maxlen=RECENT)
        recent_lengths: deque[int] = deque(counters.recent_lengths, maxlen=RECENT)

        def prepare_obs(obs: Any, update_stats: bool, stale: np.ndarray | None = None) -> Tensor:
            """One batch of observations onto the device (one copy), normalised when asked; ``stale``
            envs (unavailable: placeholders or old observations) do not update the statistics."""
            x = torch.as_tensor(np.asarray(obs)).to(device, copy=True)
            if obs_rms is None:
                return x.to(obs_dtype)
            if update_stats:
                if stale is not None and stale.any():
                    if not stale.all():
                        obs_rms.update(x[torch.as_tensor(~stale, device=device)])
                else:
                    obs_rms.update(x)
            return obs_rms.normalize(x)

        @contextlib.contextmanager
        def acting_on(raw: np.ndarray, envs_of: Sequence[int]) -> Iterator[None]:
            """Turn an error of the policy's forward on the observations ``raw`` (as the envs gave them,
            of envs ``envs_of``) that one of them explains (NaN, or outside its Discrete space: torch's
            own errors say neither which env nor what came) into a ValueError naming the env, the value
            and the space; looked for only then. (The envs' own values: --norm-obs statistics updated
            with a NaN make every env's normalised observation NaN.)"""
            try:
                yield
            except (RuntimeError, ValueError, IndexError) as err:
                problem = unusable_observation(np.asarray(raw), obs_space, envs_of)
                if problem is None:
                    raise
                raise ValueError(problem) from err

        def env_actions(raw: Tensor) -> Any:
            actions = agent.head.to_env(raw).cpu().numpy()
            if isinstance(action_space, gym.spaces.Box):
                # float32 rounding in tanh/clamp must never step outside the bounds the server checks.
                return np.clip(actions.astype(action_space.dtype), action_space.low, action_space.high)
            return actions

        def act(
            obs: Tensor, storage: Rollout, step: int, envs_slice: slice, send: Callable[[Any], None] | None = None
        ) -> Any:
            """The policy's actions for the envs in ``envs_slice``, stored in the rollout at ``step``.

            With ``send``, they go to the envs (``send(actions)``) before their log-probs and values are
            computed, so the envs step meanwhile (the same numbers: sampling is the only RNG use).
            """
            with torch.no_grad():
                # (every env's observations: with --norm-obs, one env's NaN makes every env's NaN)
                with acting_on(raw_obs, range(num_envs)):
                    action, rest = actor.sample(obs[envs_slice])
                actions = env_actions(action)
                if send is not None:
                    send(actions)
                logprob, value = rest()
            storage.actions[step, envs_slice] = action
            storage.logprobs[step, envs_slice] = logprob
            storage.values[step, envs_slice] = value
            return actions

        # --overlap-update: the nets are updated on a background thread while a copy of them (the actor)
        # collects the next rollout; each update shuffles with its own generator, so that a run is
        # the same whatever the threads' timing.
        update_thread: concurrent.futures.ThreadPoolExecutor | None = None
        update_rng: torch.Generator | None = None
        actor = agent
        if args.overlap_update:
            update_thread = stack.enter_context(
                concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="envfleet-update")
            )
            update_rng = torch.Generator(device=device)
            update_rng.manual_seed(args.seed)
            if checkpoint is not None and checkpoint.get("update_rng") is not None:
                update_rng.set_state(checkpoint["update_rng"])
            actor = copy.deepcopy(agent)
            actor.requires_grad_(False)
        pending: tuple[concurrent.futures.Future[UpdateResult], dict[str, Any], dict[str, Any]] | None = None

        saved_step = counters.global_step if checkpoint is not None else None  # of the last checkpoint written
        saved_update, saved_at = counters.update, time.monotonic()  # (a resumed run's: its checkpoint's)

        def rollout_state() -> dict[str, Any]:
            """What collecting a rollout changes in the learner, as of now: the counters (recent episodes
            included), every RNG state and the observation statistics. Taken at each update's end (a few
            small copies), so that a run stopped mid-rollout is saved as of its last update: the partial
            rollout is not learned from, and a resumed run starts that rollout over. The reward scaler
            is as of the last batch made (--overlap-update: the next rollout's batch is made before the
            update in flight is done)."""
            counters.recent_returns, counters.recent_lengths = list(recent_returns), list(recent_lengths)
            return {
                "counters": dataclasses.asdict(counters),
                "rng": capture_rng(),
                "obs_rms": {k: v.clone() for k, v in obs_rms.state_dict().items()} if obs_rms is not None else None,
                "reward_scaler": {"rms": {k: v.clone() for k, v in reward_scaler.rms.state_dict().items()}}
                if reward_scaler is not None
                else None,
                "update_rng": update_rng.get_state() if update_rng is not None else None,
            }

        def payload(state: dict[str, Any]) -> dict[str, Any]:
            return {
                "args": args.to_json(),
                "ppo": dataclasses.asdict(hp),
                "observation_space": str(obs_space),
                "action_space": str(action_space),
                "served": served,
                "model": agent.state_dict(),
                "optimizer": optimizer.state_dict(),
                **state,
            }

        def save(reason: str, state: dict[str, Any]) -> Path:
            """A checkpoint of the nets and the optimizer with ``state`` (``rollout_state()``'s, from the same
            update's end or later; --overlap-update: from the end of the rollout the update learned from)."""
            nonlocal saved_step, saved_update, saved_at
            step = int(state["counters"]["global_step"])
            with writing(rundir.checkpoint_path(run_dir, step), torch_save=True):
                path = save_checkpoint(run_dir, step, payload(state), keep=args.keep_checkpoints)
            saved_step, saved_update, saved_at = step, int(state["counters"]["update"]), time.monotonic()
            log.info("checkpoint (%s): %s", reason, path)
            return path

        def judge_best(state: dict[str, Any]) -> None:
            """After an update: a new best mean return of the last 20 episodes (as of the rollout it learned
            from) makes its nets checkpoints/best.pt (--save-best)."""
            recent = state["counters"]["recent_returns"]
            if len(recent) == RECENT:
                mean = float(np.mean(recent))
                if counters.best_return is None or mean > counters.best_return:
                    counters.best_return, counters.best_step = mean, int(state["counters"]["global_step"])
                    if args.save_best:
                        state["counters"].update(best_return=counters.best_return, best_step=counters.best_step)
                        with writing(run_dir / rundir.CHECKPOINTS / rundir.BEST_CHECKPOINT, torch_save=True):
                            path = save_best_checkpoint(run_dir, payload(state))
                        log.info("best so far (mean return %.2f at step %d): %s", mean, counters.best_step, path)
            state["counters"].update(best_return=counters.best_return, best_step=counters.best_step)

        # ---- start the envs -------------------------------------------------------------------------------
        session_start = time.perf_counter()
        start_time = session_start - counters.seconds  # wall time accumulates over resumed sessions
        session_start_step = counters.global_step
        reset_seed = args.seed if checkpoint is None else args.seed + counters.global_step
        obs_np, reset_infos = envs.reset(seed=reset_seed)
        num_envs = envs.num_envs
        lost_np = unavailable_envs(reset_infos, num_envs)
        # A resumed run's statistics already include the observations the first reset returns.
        raw_obs = obs_np  # (as the envs gave them: what an error of the policy's is explained by)
        next_obs = prepare_obs(obs_np, update_stats=checkpoint is None, stale=lost_np)
        step_groups, overlap = _stepping(envs)
        background: Any = envs  # (typed for step_async and step_wait, which overlap checked)
        # The fleet counts its faults since it was made; a resumed run's totals add the checkpoint's.
        watch = FleetWatch(
            envs, carried={key: getattr(counters, key) for key in FAULT_COUNTS}, local=args.servers is None
        )
        next_valid = ~lost_np
        # An episode is under way (a reset gave its first observation, and it has not ended): one its
        # env loses, even on its first step, is cut short. (An env out of order, whose resets raise, has
        # none under way, so its failed steps cut nothing.)
        ep_live = ~lost_np
        ep_return = np.zeros(num_envs, dtype=np.float64)
        ep_length = np.zeros(num_envs, dtype=np.int64)
        rollout: Rollout | None = None
        stop_reason: str | None = None
        last_row: dict[str, Any] = {}
        # Env servers that join or leave (docker compose up --scale, a replica that stops) are
        # followed between rollouts: RemoteVectorEnv.refresh looks --servers up again.
        refresh = getattr(envs, "refresh", None)
        lost: RemoteEnvError | None = None  # the server that failed during the last rollout
        lost_rollouts = 0
        episodes_cut = steps_lost = env_errors = 0  # since the last update (a dropped rollout's counts on)
        errors_said = [0.0, 0]  # (when an env's error was last logged, and the run's env errors then)
        empty_rollouts = 0  # rollouts in a row in which no env gave a transition
        learned = False  # whether any rollout of this session did
        empty_errors: dict[str, int] = {}  # what the envs reported in them: text -> env steps
        last_update = rollout_state()  # as of the last update's end (here: the start)
        updating = False  # the nets are being updated: a checkpoint now would mix two updates
        propagating = False  # an exception is on its way out of the loop
        last_record = (session_start, session_start_step)  # (time, env steps) as of the last update recorded

        def record(result: UpdateResult, rollout_info: dict[str, Any]) -> None:
            """Count an update done and log it: metrics.jsonl, TensorBoard, W&B, --metrics-port, the progress bar."""
            nonlocal last_row, last_record, last_line
            counters.update += 1
            now = time.perf_counter()
            counters.seconds = now - start_time
            # sps: CleanRL's SPS, over this session; sps_update: over this update (since the last one's
            # end), whose wall time other_seconds completes (checkpoints, fleet lookups, dropped rollouts;
            # --overlap-update: the update runs during the next rollout, so the parts overlap and
            # other_seconds is what is left, at least 0).
            since = max(now - last_record[0], 1e-9)
            timing = {
                "seconds": counters.seconds,
                "sps": (counters.global_step - session_start_step) / max(now - session_start, 1e-9),
                "sps_update": (counters.global_step - last_record[1]) / since,
                # (the transitions learned from, batch_size: sps_update counts every env step, those of
                # unavailable envs and the reset-only steps after an episode's end too)
                "transitions_per_s": result.batch_size / since,
                "other_seconds": max(0.0, since - rollout_info["rollout_seconds"] - result.seconds),
            }
            last_record = (now, counters.global_step)
            row = metrics_row(counters.update, timing, result, rollout_info)
            with writing(run_dir / rundir.METRICS):
                rundir.append_jsonl(metrics_file, row)
            last_row = row
            if writer is not None:
                write_tensorboard(writer, row, faults_seen)
            if tracker is not None:
                tracker.update(row)
            if live is not None:
                live.observe_update(
                    row, solved=counters.solved_at_step is not None, server_ids=rollout_info.get("server_ids")
                )
            if bar is not None:
                bar.total = max(bar.total, counters.global_step)  # the last rollout may run past it
                _widget_total(bar)
                bar.update(counters.global_step - bar.n)
                bar.set_postfix_str(bar_postfix(timing["sps"], row["episodic_return_mean"]))
            elif progress_lines and (last_line is None or now - last_line >= PROGRESS_LINE_S):
                last_line = now
                print(progress_line(row, hp.total_timesteps), flush=True)

        def finished(state: dict[str, Any]) -> None:
            """The update just recorded is done, with ``state`` (``rollout_state()``'s) as of its rollout's
            end: the run may stop (or be checkpointed) as of it."""
            nonlocal last_update, updating
            if update_rng is not None:
                state["update_rng"] = update_rng.get_state()
            state["counters"]["update"] = counters.update
            last_update = state
            updating = False  # (done: a failure writing best.pt next is no failure in an update)
            judge_best(state)
            if args.checkpoint_every and (
                saved_step is None  # (a new run's first update: a run killed before any could only start over)
                or (
                    counters.update - saved_update >= args.checkpoint_every
                    and time.monotonic() - saved_at >= args.checkpoint_seconds
                )
            ):
                save(f"update {counters.update}", last_update)

        def finish_pending() -> None:
            """--overlap-update: wait for the update running in the background, then record it."""
            nonlocal pending
            assert pending is not None
            future, rollout_info, state = pending
            pending = None
            result = future.result()  # re-raises what the update raised
            record(result, rollout_info)
            finished(state)

        try:
            while stop_reason is None:
                if counters.global_step >= hp.total_timesteps:
                    if empty_rollouts and not learned:  # (a budget of fewer than 3 rollouts, all empty)
                        raise NothingToLearnError(nothing_to_learn(empty_rollouts, empty_errors))
                    if not learned and counters.update == 0:
                        # Every rollout cut short by a lost server (or the fleet down): no update in the
                        # whole run, which is no policy to evaluate, nor a run that did what it was asked.
                        raise NothingToLearnError(
                            f"the run reached --total-timesteps ({hp.total_timesteps:,}) without an update: every "
                            "rollout was cut short by a lost server, or the fleet was down (see the warnings "
                            "above); nothing was learned"
                        )
                    # The steps of rollouts dropped since the last update are the run's too.
                    counters.env_steps_lost += steps_lost
                    counters.episodes_cut += episodes_cut
                    counters.env_errors += env_errors
                    steps_lost = episodes_cut = env_errors = 0
                    stop_reason = "total_timesteps"
                    break
                if stop_request.requested:  # Ctrl-C during the update: stop before the next rollout
                    stop_reason = _asked_stop(stop_request)
                    break
                # ---- follow the fleet: servers that joined or left since the last rollout ------------------
                if refresh is not None:
                    drop = [lost.address] if lost is not None and not isinstance(lost, EnvCrashedError) else []
                    change = refresh(drop=drop)
                    lost = None
                    # config.json keeps what every server that served the run said it runs: those that
                    # joined, and those that came back as a new process (an upgrade rolled out).
                    versions = {**config["server_versions"], **getattr(envs, "server_versions", {})}
                    if versions != config["server_versions"]:
                        config["server_versions"] = versions
                        with writing(run_dir / rundir.CONFIG):
                            rundir.write_json(run_dir / rundir.CONFIG, config)
                    if change is not None:
                        if on_fleet_change is not None:
                            on_fleet_change(change)
                        # Envs that stayed go on with their episodes; new ones (or all, after a failed
                        # step) start from the observations of their reset.
                        raw_obs = change.observations
                        next_obs = prepare_obs(change.observations, update_stats=False)
                        next_valid = carry_over(next_valid, change, True)
                        ep_return = carry_over(ep_return, change, 0.0)
                        ep_length = carry_over(ep_length, change, 0)
                        ep_live = carry_over(ep_live, change, True)
                        if reward_scaler is not None:
                            reward_scaler.follow(change)
                        # (the groups follow the servers: one per server at most, so a fleet that started
                        # without some of them pipelines once they join)
                        step_groups, overlap = _stepping(envs)
                # Storage follows the fleet's size, which may change between rollouts.
                if rollout is None or rollout.num_envs != envs.num_envs:
                    num_envs = envs.num_envs
                    rollout = Rollout.allocate(
                        hp.num_steps,
                        num_envs,
                        obs_shape,
                        obs_dtype,
                        agent.head.action_shape,
                        agent.head.action_dtype,
                        device,
                    )
                # Linear annealing to 0 over total_timesteps (CleanRL anneals per update; this follows
                # env steps, which stays right when the number of envs changes).
                frac = 1.0 - counters.global_step / hp.total_timesteps
                lr = hp.learning_rate * frac if hp.anneal_lr else hp.learning_rate
                clip_coef = hp.clip_coef * frac if hp.anneal_clip else hp.clip_coef

                # ---- collect a rollout ---------------------------------------------------------------------
                rollout_start = time.perf_counter()
                fleet_down = False
                lost_before = watch.servers_lost()
                for step in range(hp.num_steps):
                    rollout.obs[step] = next_obs
                    try:
                        if step_groups is not None:
                            # Each group of servers steps while the policy runs on the next group's envs.
                            obs_np, reward_np, term_np, trunc_np, infos = step_groups(
                                functools.partial(act, next_obs, rollout, step)
                            )
                        elif overlap:
                            act(next_obs, rollout, step, slice(None), send=background.step_async)
                            obs_np, reward_np, term_np, trunc_np, infos = background.step_wait()
                        else:
                            obs_np, reward_np, term_np, trunc_np, infos = envs.step(
                                act(next_obs, rollout, step, slice(None))
                            )
                    except (
                        ServerUnavailableError,
                        SessionError,
                        RemoteTimeoutError,
                        EnvCrashedError,
                        InvalidResponseError,
                    ) as err:
                        # Without --fault-tolerant: a server stopped (scaled down) or vanished, or an env
                        # raised. Drop this rollout and go on with the servers left (every env starting
                        # over), unless that keeps happening.
                        lost_rollouts += 1
                        # Fault-tolerant, a step raises only once every server is gone: nothing to wait for.
                        if refresh is None or args.fault_tolerant or lost_rollouts >= LOST_ROLLOUTS:
                            raise
                        if isinstance(err, EnvCrashedError):  # the server is fine: it stays
                            log.warning("dropping this rollout, every env starts over: %s", err)
                        else:
                            log.warning("dropping this rollout, going on without env server %s: %s", err.address, err)
                        lost = err
                        break
                    counters.global_step += num_envs
                    done_np = np.logical_or(term_np, trunc_np)
                    # A step is a transition of env i unless it follows an episode's end (next-step
                    # autoreset) or env i was unavailable in it (its server lost or down, rejoining, or
                    # its env raised): then its action was not applied, or its result is lost.
                    lost_np = unavailable_envs(infos, num_envs)
                    valid = next_valid & ~lost_np
                    rollout.valid[step] = valid
                    steps_lost += int(lost_np.sum())
                    cut_np = lost_np & ep_live
                    # (under next-step autoreset an episode that ended has none under way until its reset;
                    # under same-step autoreset, one that ended and was not lost has the next under way)
                    ep_live = ~lost_np & (~done_np if next_step_autoreset else True)
                    if lost_np.any():
                        # Episodes cut short by a failure do not count as episodes in the returns.
                        episodes_cut += int(cut_np.sum())
                        ep_return[lost_np], ep_length[lost_np] = 0.0, 0
                        if "_env_error" in infos:  # (for the error of a run that has nothing to learn from)
                            raised = np.flatnonzero(infos["_env_error"])
                            env_errors += len(raised)
                            for i in raised:
                                text = str(infos["env_error"][i]).removeprefix("out of order since ")
                                empty_errors[text] = empty_errors.get(text, 0) + 1
                            if len(raised):
                                _say_env_error(errors_said, counters.env_errors + env_errors, int(raised[0]), infos)
                        if lost_np.all() and refresh is not None and not np.any(getattr(envs, "available", True)):
                            # Fault-tolerant, every server is down (each step now waits up to a second for
                            # one): look the servers up again now, not after the rest of the rollout, so
                            # replicas that replaced them (compose down and up, say) join at once.
                            fleet_down = True
                            break

                    if not np.isfinite(reward_np[valid]).all():
                        # (one NaN spreads through the advantages into the nets, and the next step's
                        # sampling fails with torch's "probability tensor contains ... nan")
                        bad_env = int(np.flatnonzero(valid & ~np.isfinite(reward_np))[0])
                        raise ValueError(
                            f"reward of env {bad_env} is {reward_np[bad_env]}: PPO cannot learn from a NaN or infinite reward "
                            "(fix the env, or clip its rewards in a wrapper)"
                        )
                    # Episode statistics, from the envs' own rewards (before any clipping or scaling).
                    ep_return += np.where(valid, reward_np, 0.0)
                    ep_length += valid
                    for i in np.flatnonzero(done_np & valid):
                        recent_returns.append(float(ep_return[i]))
                        recent_lengths.append(int(ep_length[i]))
                        counters.episodes += 1
                        if writer is not None:
                            writer.add_scalar("charts/episodic_return", ep_return[i], counters.global_step)
                            writer.add_scalar("charts/episodic_length", ep_length[i], counters.global_step)
                        if tracker is not None:
                            tracker.episode(counters.global_step, float(ep_return[i]), int(ep_length[i]))
                        ep_return[i], ep_length[i] = 0.0, 0
                        if (
                            threshold is not None
                            and counters.solved_at_step is None
                            and len(recent_returns) == RECENT
                            and np.mean(recent_returns) >= threshold
                        ):
                            counters.solved_at_step = counters.global_step
                            counters.solved_at_seconds = time.perf_counter() - start_time
                            counters.solved_threshold = threshold
                            log.info(
                                "solved at step %d: mean return of the last %d episodes >= %g",
                                counters.global_step,
                                RECENT,
                                threshold,
                            )
                            if args.stop_at_return is not None:
                                stop_reason = "stop_at_return"

                    rollout.rewards[step] = reward_np
                    rollout.terminations[step] = term_np
                    rollout.truncations[step] = trunc_np
                    raw_obs = obs_np
                    next_obs = prepare_obs(obs_np, update_stats=True, stale=lost_np)
                    if not next_step_autoreset and (trunc_np & valid).any():
                        # Same-step autoreset: obs_np already holds the next episode's first
                        # observation; the truncated episode's last one is in infos["final_obs"].
                        idx = np.flatnonzero(trunc_np & valid)
                        final = np.stack([infos["final_obs"][i] for i in idx])
                        with torch.no_grad(), acting_on(final, idx.tolist()):
                            rollout.final_values[step, idx] = actor.get_value(prepare_obs(final, update_stats=False))
                    # Under next-step autoreset, an env whose episode just ended is reset by its next step.
                    next_valid = ~done_np if next_step_autoreset else np.ones(num_envs, dtype=bool)

                    if stop_request.requested:
                        stop_reason = _asked_stop(stop_request)
                    if stop_reason is not None:
                        break
                if stop_reason is not None:
                    break  # a partial rollout is not learned from
                valid_any = bool(rollout.valid[: step + 1].any())
                empty = ""  # why this rollout has nothing to learn from, if it has not
                if fleet_down:
                    # Every server down with no transition in this rollout: empty, as below, if a server
                    # was lost in it (one that answers gRPC but fails every step is "back" at once and
                    # lost again, without end); not while the fleet only stays down (an outage, which
                    # --give-up-after bounds).
                    if not valid_any and watch.servers_lost() > lost_before:
                        empty = "no env gave a transition in this rollout before every server was lost"
                elif lost is None:
                    lost_rollouts = 0
                    if not valid_any:
                        empty = "no env gave a transition in this rollout (update skipped)"
                if empty:
                    empty_rollouts += 1
                    if empty_rollouts >= EMPTY_ROLLOUTS:
                        raise NothingToLearnError(nothing_to_learn(empty_rollouts, empty_errors))
                    log.warning(
                        "%s: nothing to learn from (the run stops after %d such rollouts in a row)",
                        empty,
                        EMPTY_ROLLOUTS,
                    )
                elif valid_any:
                    empty_rollouts = 0
                    empty_errors.clear()
                if lost is not None or fleet_down:
                    continue  # (a partial rollout is not learned from)
                learned = learned or valid_any

                # ---- the batch: GAE over valid transitions, truncations bootstrapped, flattened --------------
                updating = True  # from here on, a checkpoint of this run would mix two updates
                counters.env_steps_lost += steps_lost
                counters.episodes_cut += episodes_cut
                counters.env_errors += env_errors
                # What the update's metrics row reports of the run: as of the end of the rollout it learns from.
                rollout_info = {
                    "global_step": counters.global_step,
                    "episodic_return_mean": _mean(list(recent_returns)),
                    "episodic_length_mean": _mean(list(recent_lengths)),
                    "episodes": counters.episodes,
                    "episodes_cut": episodes_cut,
                    "num_envs": num_envs,
                    "learning_rate": lr,
                    "clip_coef": clip_coef,
                    "rollout_seconds": round(time.perf_counter() - rollout_start, 5),
                    "env_steps_lost": steps_lost,
                    "env_errors": env_errors,
                    "envs_unavailable": int(lost_np.sum()),
                    "fleet": watch.rollout_metrics(),
                    # (this rollout's: with --overlap-update it is recorded once the next has begun)
                    "server_ids": dict(watch.server_ids),
                }
                for key, total in (watch.totals() or {}).items():
                    setattr(counters, key, total)
                episodes_cut = steps_lost = env_errors = 0
                with torch.no_grad(), acting_on(raw_obs, range(num_envs)):
                    next_value = actor.get_value(next_obs)
                batch = make_batch(
                    rollout,
                    next_value,
                    hp,
                    reward_scaler,
                    next_step_autoreset=next_step_autoreset,
                )

                # ---- optimise the policy and value network ---------------------------------------------------
                if update_thread is None:
                    result = ppo_update(agent, optimizer, batch, hp, learning_rate=lr, clip_coef=clip_coef)
                    record(result, rollout_info)
                    finished(rollout_state())
                else:
                    # --overlap-update: wait for the update on the previous rollout, then the acting copy
                    # takes its nets and collects the next rollout while this one's update runs.
                    if pending is not None:
                        finish_pending()
                    actor.load_state_dict(agent.state_dict())
                    updating = True
                    counters.seconds = time.perf_counter() - start_time  # (as of this rollout's end)
                    pending = (
                        update_thread.submit(
                            ppo_update,
                            agent,
                            optimizer,
                            batch,
                            hp,
                            learning_rate=lr,
                            clip_coef=clip_coef,
                            generator=update_rng,
                        ),
                        rollout_info,
                        rollout_state(),
                    )
        except BaseException as err:
            stop_reason = _stop_reason(err)
            propagating = True
            raise
        finally:
            update_error: BaseException | None = None
            if pending is not None:
                # --overlap-update: the update of the last whole rollout runs on; it counts once done.
                try:
                    finish_pending()
                except BaseException as err:  # it failed, or a second Ctrl-C came while waiting for it
                    update_error = err
                    if not propagating:
                        stop_reason = _stop_reason(err)
                    if not isinstance(err, KeyboardInterrupt):
                        log.error("the update running in the background failed: %s: %s", type(err).__name__, err)
            counters.seconds = time.perf_counter() - start_time
            state: dict[str, Any] | None
            if stop_reason in ("total_timesteps", "stop_at_return"):
                state = rollout_state()
                if not updating:  # (the episodes since the last update: mostly of its nets, the run's last)
                    judge_best(state)
                if (
                    stop_reason == "stop_at_return"
                    and state["counters"]["global_step"] != last_update["counters"]["global_step"]
                ):
                    # Solved mid-rollout: the partial rollout is not learned from, so the checkpoint is
                    # as of the last update (its counters, RNG states and statistics, as after a Ctrl-C),
                    # with the solve and the best return: a run resumed from it starts that rollout over.
                    solved = {k: state["counters"][k] for k in _SOLVE_COUNTERS}
                    state = {**last_update, "counters": {**last_update["counters"], **solved}}
            else:
                # Stopped mid-rollout (Ctrl-C, an error) or mid-update: the run is what it was at its last
                # update, for the checkpoint and the summary alike (none is written when that one is on
                # disk already, or when the nets are half-way through the next update).
                if updating:
                    log.warning("%s", stopped_in_update(saved_step))
                fresh = not updating and last_update["counters"]["global_step"] != saved_step
                state = last_update if fresh else None
                counters = Counters(**last_update["counters"])
            try:
                if state is not None:
                    save(stop_reason or "end", state)
            except Exception as err:
                if stop_reason is None or not stop_reason.startswith(("error", "interrupted", "stopped")):
                    raise
                if isinstance(err, RunDirWriteError):
                    log.error("could not write the last checkpoint: %s", err)
                else:
                    log.exception("could not write the last checkpoint")
            # Fault counts: the whole run's, the checkpoint's and this session's to its very end (the
            # failure that stopped it included).
            summary = build_summary(
                counters,
                stop_reason=stop_reason,
                threshold=threshold,
                last_row=last_row,
                device=device,
                faults=watch.totals(),
                replicas=watch.replicas,
            )
            if bar is not None:
                _close_bar(bar, summary, stop_reason, since=(session_start, session_start_step))
            if live is not None:  # (the steps of a last rollout no update recorded; a solve within it)
                live.run_ended(global_step=counters.global_step, solved=counters.solved_at_step is not None)
            try:
                rundir.write_json(run_dir / rundir.SUMMARY, summary)
            except OSError as err:
                if not propagating:
                    raise cannot_write(run_dir / rundir.SUMMARY, err) from err
                log.error("%s", cannot_write(run_dir / rundir.SUMMARY, err))  # (the error that stopped it follows)
            if tracker is not None:  # (put into the W&B run's summary as it finishes)
                tracker.summary = summary
            if counters.update > 0:
                plotted.append(run_dir)
            if update_error is not None and not propagating:
                raise update_error
    summary["run_dir"] = str(run_dir)
    if tracker is not None and tracker.record is not None:
        summary["wandb_run"] = tracker.record  # (for the command to say where it is; not in summary.json)
    # (a second Ctrl-C, or one before the loop, raised KeyboardInterrupt itself)
    if stop_reason == "interrupted" or stop_request.signalled:
        # Its files written and its envs closed: now the caller stops too (a loop over seeds, "Run All"),
        # also where the Ctrl-C came during the last update, and the run ended as finished.
        raise TrainingInterrupted(summary, run_dir)
    return summary
